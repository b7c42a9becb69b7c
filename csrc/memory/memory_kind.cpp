// The one place that maps AllocKind to its table (Note [one table per kind of memory]).
#include "memory/memory_kind.h"

#include "base/errors.h"

namespace torch_ipc {

const MemoryKind& memory_kind(AllocKind kind) {
  switch (kind) {
    case AllocKind::CudaIpc:
      return legacy_ipc_memory;
    case AllocKind::CpuShm:
      return host_shm_memory;
    case AllocKind::CudaVmm:
      return vmm_memory;
  }
  throw DescriptorError("malformed torch_ipc descriptor: an allocation of an unknown kind");
}

}  // namespace torch_ipc
