// SharedPool: cuMemCreate allocations of a whole number of granules, one per
// tensor, with shareable handles; freed (after a device sync) with the storage.
#include "memory/shared_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>

#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include "base/errors.h"

#include "wire/vmm_handle.h"

#include "os/process.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

#include "memory/vmm_mapping.h"

namespace torch_ipc {
namespace {

std::atomic<int64_t> pool_count{0}, pool_bytes{0};

struct PoolAllocation {
  int device = -1;
  uint64_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr va = 0;
  bool created = false, reserved = false, mapped = false;
  MadeHere made;
  ~PoolAllocation() {
    if (made.inherited()) return;  // the parent's memory; CUDA is unusable here (Note [fork])
    try {
      ScopedContext scope(device);
      // Note [pool frees synchronize]: cuMemUnmap does not wait for kernels
      // still using the memory, and a storage deleter does not know which
      // streams used it; so wait for the device, as cudaFree would.
      if (mapped) {
        TORCH_IPC_CU_WARN(cuCtxSynchronize);
        TORCH_IPC_CU_WARN(cuMemUnmap, va, size);
      }
      if (created) TORCH_IPC_CU_WARN(cuMemRelease, handle);
      if (reserved) TORCH_IPC_CU_WARN(cuMemAddressFree, va, size);
    } catch (const std::exception& e) {
      TORCH_WARN("torch_ipc: freeing a SharedPool allocation failed: ", e.what());
    }
    if (created) {
      --pool_count;
      pool_bytes -= static_cast<int64_t>(size);
    }
  }
};

void delete_pool_allocation(void* ctx) { delete static_cast<PoolAllocation*>(ctx); }

CUmemAllocationProp pool_prop(int device, CUmemAllocationHandleType type) {
  TORCH_IPC_CHECK(vmm_known_handle_type(type),
                  "torch_ipc: handle type must be POSIX_FILE_DESCRIPTOR (1) or FABRIC (8), not ",
                  static_cast<int>(type));
  CUdevice dev;
  TORCH_IPC_CU(cuDeviceGet, &dev, device);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = type;
  return prop;
}

c10::DispatchKeySet cuda_keys() { return c10::DispatchKeySet(c10::DispatchKey::CUDA); }

void delete_storage_ref(void* ctx) { delete static_cast<c10::Storage*>(ctx); }

}  // namespace

uint64_t vmm_granularity(int device, CUmemAllocationHandleType handle_type) {
  ScopedContext scope(device);
  CUmemAllocationProp prop = pool_prop(device, handle_type);
  size_t g = 0;
  TORCH_IPC_CU(cuMemGetAllocationGranularity, &g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  return g;
}

at::Tensor vmm_pool_empty(const std::vector<int64_t>& sizes, c10::ScalarType dtype, int device,
                          CUmemAllocationHandleType handle_type) {
  uint64_t numel = 1;
  for (int64_t s : sizes) {
    TORCH_IPC_CHECK(s >= 0, "torch_ipc: negative dimension ", s);
    TORCH_IPC_CHECK(s == 0 || numel <= UINT64_MAX / static_cast<uint64_t>(s), "torch_ipc: tensor too large");
    numel *= static_cast<uint64_t>(s);
  }
  const uint64_t item = c10::elementSize(dtype);
  TORCH_IPC_CHECK(numel <= UINT64_MAX / item, "torch_ipc: tensor too large");
  const uint64_t nbytes = numel * item;

  ScopedContext scope(device);
  CUmemAllocationProp prop = pool_prop(device, handle_type);
  size_t granularity = 0;
  TORCH_IPC_CU(cuMemGetAllocationGranularity, &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  auto a = std::make_unique<PoolAllocation>();
  a->device = device;
  a->size = (std::max<uint64_t>(nbytes, 1) + granularity - 1) / granularity * granularity;
  CUresult r = driver().cuMemCreate(&a->handle, a->size, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY)
    TORCH_CHECK_WITH(OutOfMemoryError, false,  // one string: no stream (Note [messages without iostreams])
                     str("torch_ipc.SharedPool: out of memory allocating ", a->size, " bytes on CUDA device ", device));
  if (r != CUDA_SUCCESS && handle_type == CU_MEM_HANDLE_TYPE_FABRIC)
    throw_driver_error("cuMemCreate", r,
                       "torch_ipc.SharedPool: cannot create memory with fabric handles here; they "
                       "need an IMEX channel (/dev/nvidia-caps-imex-channels) on a system with a "
                       "multi-node NVLink fabric; use handle_type='posix_fd'");
  if (r != CUDA_SUCCESS) throw_driver_error("cuMemCreate", r);
  a->created = true;
  ++pool_count;
  pool_bytes += static_cast<int64_t>(a->size);
  TORCH_IPC_CU(cuMemAddressReserve, &a->va, a->size, granularity, 0, 0);
  a->reserved = true;
  TORCH_IPC_CU(cuMemMap, a->va, a->size, 0, a->handle, 0);
  a->mapped = true;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  TORCH_IPC_CU(cuMemSetAccess, a->va, a->size, &access, 1);
  // Note [pool tail]: a consumer maps the whole allocation; what lies past the
  // tensor must not be stale bytes of memory this process freed before.
  if (a->size > nbytes) TORCH_IPC_CU(cuMemsetD8Async, a->va + nbytes, 0, a->size - nbytes, current_stream(device));

  void* ptr = reinterpret_cast<void*>(a->va);
  c10::DataPtr data(ptr, a.release(), &delete_pool_allocation,
                    c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), cuda_keys(), c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

bool vmm_is_pool_storage(const c10::Storage& storage) {
  return storage.data_ptr().get_deleter() == &delete_pool_allocation;
}

at::Tensor vmm_mapping_view(const at::Tensor& t) {
  TORCH_IPC_CHECK(t.is_cuda() && t.storage().nbytes() > 0, "torch_ipc: need a non-empty CUDA tensor");
  int device = t.device().index();
  ScopedContext scope(device);
  auto [base, size, block] = chunk_at(reinterpret_cast<CUdeviceptr>(t.storage().data()));
  (void)block;
  c10::DataPtr data(reinterpret_cast<void*>(base), new c10::Storage(t.storage()), &delete_storage_ref, t.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), size, std::move(data), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), cuda_keys(),
                                                   c10::scalarTypeToTypeMeta(c10::ScalarType::Byte));
  impl->set_sizes_contiguous({static_cast<int64_t>(size)});
  return at::Tensor(std::move(impl));
}

PoolStats vmm_pool_stats() {
  PoolStats s;
  s.allocations = pool_count.load();
  s.bytes = pool_bytes.load();
  return s;
}

}  // namespace torch_ipc
