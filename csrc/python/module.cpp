// torch_ipc._C: each feature binds itself (bindings.h).
#include "base/fork.h"

#include "python/bindings.h"

PYBIND11_MODULE(_C, m) {
  torch_ipc::install_fork_handler();  // Note [fork] in base/fork.h
  m.doc() = "torch_ipc's C++ core: descriptors, export/import, leases, CUDA driver";
  using namespace torch_ipc::python;
  bind_errors(m);
  bind_core(m);
  bind_process(m);
  bind_ipc_event(m);
  bind_vmm(m);
  bind_batched_copy(m);
  bind_kv(m);
  bind_weights(m);
  bind_channel(m);
  bind_testing(m);
}
