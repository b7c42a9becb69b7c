// The Python face of torch_ipc._C: one bind_<feature>(m) per feature, each in
// its own file of this folder; module.cpp only calls them. The only folder that
// includes pybind11 (through torch/extension.h).
#pragma once

#include <torch/extension.h>

namespace torch_ipc::python {

namespace py = pybind11;

void bind_errors(py::module_& m);        // errors.cpp: C++ exception types -> torch_ipc.errors
void bind_core(py::module_& m);          // core.cpp: export, load, collect, stats
void bind_process(py::module_& m);       // process.cpp: this process, and whether another lives
void bind_ipc_event(py::module_& m);     // ipc_event.cpp: IpcEvent
void bind_vmm(py::module_& m);           // vmm.cpp: SharedPool memory
void bind_kv(py::module_& m);            // kv.cpp: BlockAllocator of torch_ipc.kv
void bind_batched_copy(py::module_& m);  // batched_copy.cpp: the batched copy kernels (torch_ipc/_batched_copy.py)
void bind_weights(py::module_& m);       // weights.cpp: shared counters
void bind_channel(py::module_& m);       // channel.cpp: shared-memory channel ends (torch_ipc/mp/_ring.py)
void bind_testing(py::module_& m);       // testing.cpp: _C._testing, for torch_ipc's own tests

}  // namespace torch_ipc::python
