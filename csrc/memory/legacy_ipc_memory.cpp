// Legacy CUDA IPC memory (AllocKind::CudaIpc): a cudaMalloc segment of another
// process, opened with cuIpcOpenMemHandle and closed with cuIpcCloseMemHandle.
#include <cstring>
#include <string>

#include <c10/util/Exception.h>

#include "base/errors.h"

#include "os/process.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

#include "memory/memory_kind.h"

namespace torch_ipc {
namespace {

struct LegacyIpcMemory : OpenedMemory {
  int device = -1;
  MadeHere made;  // a forked child leaves its parent's mappings alone
  ~LegacyIpcMemory() override {
    if (made.inherited() || base == nullptr) return;  // CUDA is unusable there, and the mapping is the parent's
    try {
      ScopedContext scope(device);
      TORCH_IPC_CU_WARN(cuIpcCloseMemHandle, reinterpret_cast<CUdeviceptr>(base));
    } catch (const std::exception& e) {
      TORCH_WARN("torch_ipc: closing a mapping failed: ", e.what());
    }
  }
};

// Note [opening many allocations]
// The first share of a state dict opens each base allocation once: torch's
// caching allocator puts 384 tensors of 4 MiB in 77 allocations of 20 MiB,
// and cuIpcOpenMemHandle costs 40-70 us each on an H100 (more for larger
// allocations), 3-5 ms in all. Opening them from several threads does not
// help: the driver serialises the calls, and they get slower (384 x 4 MiB:
// 15.5 ms from 1 thread, 23-29 ms from 2 to 16; 96 x 16 MiB: 5.9 ms from 1,
// 7.0-10.9 ms from 2 to 16; benchmarks/ipc_open_threads.py). Opening lazily,
// on first touch, is not possible either: a tensor needs its address when it
// is built. So mappings open one after the other, once per process (Note
// [idle mappings] in core/mapping_cache.cpp), and a producer that wants a
// cheap first share sends from few allocations (a SharedPool, or one flat
// buffer viewed as its tensors).
std::unique_ptr<OpenedMemory> open_legacy(const Allocation& where, const ProcessId& owner) {
  auto m = std::make_unique<LegacyIpcMemory>();
  m->device = where.device;
  ScopedContext scope(where.device);
  CUipcMemHandle h;
  std::memcpy(h.reserved, where.handle.data(), 64);
  CUdeviceptr ptr = 0;
  CUresult r = driver().cuIpcOpenMemHandle(&ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r != CUDA_SUCCESS) {
    if (!process_alive(owner)) throw producer_gone(owner.pid, "its CUDA memory is gone with it");
    throw_driver_error("cuIpcOpenMemHandle", r);
  }
  m->base = reinterpret_cast<char*>(ptr);  // from here m's destructor closes it
  size_t range = 0;
  CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_RANGE_SIZE;
  void* value = &range;
  TORCH_IPC_CU(cuPointerGetAttributes, 1, &attr, &value, ptr);
  if (range < where.size)
    throw DescriptorError("malformed torch_ipc descriptor: the allocation is " + std::to_string(range) +
                          " bytes, the descriptor says " + std::to_string(where.size));
  return m;
}

}  // namespace

const MemoryKind legacy_ipc_memory{/*on_gpu=*/true, /*stays_open_idle=*/true, /*check_handle=*/nullptr, &open_legacy};

}  // namespace torch_ipc
