// VMM memory (AllocKind::CudaVmm): another process's cuMemCreate chunks,
// imported and mapped by import_vmm (vmm_import.cpp), unmapped when dropped.
#include <memory>

#include "os/process.h"

#include "memory/memory_kind.h"
#include "memory/vmm_import.h"

namespace torch_ipc {
namespace {

struct VmmMemory : OpenedMemory {
  std::shared_ptr<VmmMapping> vmm;
  MadeHere made;  // a forked child leaves its parent's mappings alone
  ~VmmMemory() override {
    if (made.inherited()) new std::shared_ptr<VmmMapping>(std::move(vmm));  // CUDA is unusable there: leaked
  }
};

std::unique_ptr<OpenedMemory> open_vmm(const Allocation& where, const ProcessId& owner) {
  auto m = std::make_unique<VmmMemory>();
  m->vmm = import_vmm(where.handle, where.size, where.device, owner);
  m->base = reinterpret_cast<char*>(m->vmm->base);
  return m;
}

}  // namespace

// VMM memory closes with its last tensor: idle, it would keep the physical
// memory its producer freed.
const MemoryKind vmm_memory{/*on_gpu=*/true, /*stays_open_idle=*/false, /*check_handle=*/nullptr, &open_vmm};

}  // namespace torch_ipc
