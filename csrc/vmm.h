// VMM sharing: physical allocations made with cuMemCreate (torch's expandable
// segments, torch_ipc.SharedPool) exported as shareable handles and mapped in consumers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "descriptor.h"

namespace torch_ipc {

// What the descriptor says about a storage in VMM memory: the 64-byte handle
// field of its AllocRecord (see Note [VMM handle field] in vmm.cpp), the bytes
// of the physical allocations it spans, and its offset in the first of them.
struct VmmLocation {
  Handle64 handle{};
  uint64_t size = 0;
  uint64_t offset = 0;
};

// ---- producer side
// Export the physical allocations under `storages` (all with data on CUDA
// device `device`, the current context), one location per storage. Storages
// whose chunks touch or adjoin share one run (Note [VMM runs per message] in
// export.cpp); a SharedPool storage is always a run of its own. Cached for as
// long as a storage of the run lives; throws a runtime_error that says why
// when the memory is not VMM memory or was created without a shareable handle type.
std::vector<VmmLocation> locate_vmm(const std::vector<c10::Storage>& storages, int device);
// Drop the exports of storages that died: unpublish them, close their fds,
// release the retained handles. Returns how many groups were dropped.
int vmm_collect();

// ---- consumer side
// One VA range that maps, in order, the physical allocations of one handle
// field. The destructor unmaps, releases and frees; it warns, never throws.
struct VmmMapping {
  int device = -1;
  CUdeviceptr base = 0;
  uint64_t size = 0;  // reserved bytes; equal to the sum of the mapped ones when complete
  std::vector<CUmemGenericAllocationHandle> handles;      // imported, released last
  std::vector<std::pair<CUdeviceptr, uint64_t>> mapped;   // (address, bytes)
  VmmMapping() = default;
  VmmMapping(const VmmMapping&) = delete;
  VmmMapping& operator=(const VmmMapping&) = delete;
  ~VmmMapping();
};

// Fetch the producer's handles (fds over its socket or with pidfd_getfd, or
// fabric handles), import and map them on `device`. `size` is the AllocRecord's
// size, `owner` the process that owns the lease (the exporter). Throws
// DescriptorError for a malformed or inconsistent field, ProducerGone,
// Released, CudaError naming what the driver refused.
std::shared_ptr<VmmMapping> import_vmm(const Handle64& handle, uint64_t size, int device,
                                       const ProcessId& owner);

// ---- SharedPool: one cuMemCreate allocation per tensor
// A tensor of `sizes` (contiguous) and `dtype` on `device`, alone in its own
// allocation of a whole number of granules; the bytes past the tensor are
// zeroed. `handle_type`: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR or _FABRIC.
at::Tensor vmm_pool_empty(const std::vector<int64_t>& sizes, c10::ScalarType dtype, int device,
                          CUmemAllocationHandleType handle_type);
bool vmm_is_pool_storage(const c10::Storage& storage);
uint64_t vmm_granularity(int device, CUmemAllocationHandleType handle_type);

// For tests: a uint8 tensor over the whole driver mapping (cuMemMap) that
// holds t's first byte, keeping t's storage alive; and that mapping's extent.
at::Tensor vmm_mapping_view(const at::Tensor& t);

struct VmmStats {
  int64_t export_groups;    // distinct chunk runs published by this process
  int64_t exported_chunks;  // physical allocations with an open shareable handle
  int64_t exported_bytes;
  int64_t pool_allocations, pool_bytes;  // live SharedPool allocations
  int64_t mappings, mapped_bytes;        // live imported VMM mappings
};
VmmStats vmm_stats();

}  // namespace torch_ipc
