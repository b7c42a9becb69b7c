// SharedPool: one shareable cuMemCreate allocation per tensor, so a consumer maps
// exactly that tensor's bytes (isolated sharing); and a test view of a mapping.
#pragma once

#include <ATen/core/Tensor.h>
#include <cstdint>
#include <cuda.h>
#include <vector>

#include <c10/core/Storage.h>

namespace torch_ipc {

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

struct PoolStats {
  int64_t allocations = 0;  // live SharedPool allocations
  int64_t bytes = 0;
};
PoolStats vmm_pool_stats();

}  // namespace torch_ipc
