// Process identity and liveness (os/process.h) for the Python side: the one
// "is that process still running" of torch_ipc, pid AND start time, so a pid
// that was recycled never passes for the process that had it.
#include "os/process.h"
#include "python/bindings.h"

namespace torch_ipc::python {

void bind_process(py::module_& m) {
  m.def(
      "self_process", [] { return py::make_tuple(self_process().pid, self_process().start_time); },
      "(pid, start time) of this process; a forked child has its own.");
  m.def(
      "process_alive",
      [](uint32_t pid, uint64_t start_time) { return process_alive(ProcessId{pid, start_time}); },
      py::arg("pid"), py::arg("start_time"), py::call_guard<py::gil_scoped_release>(),
      "Whether the process (pid, start_time) of self_process() still runs, in this PID namespace.");
}

}  // namespace torch_ipc::python
