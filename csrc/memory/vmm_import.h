// VMM consumer side: fetch a producer's shareable handles, import them and map
// them into one VA range (VmmMapping), which unmaps and releases when dropped.
#pragma once

#include <cstdint>
#include <cuda.h>
#include <memory>
#include <utility>
#include <vector>

#include "wire/descriptor.h"

namespace torch_ipc {

// One VA range that maps, in order, the physical allocations of one handle
// field. The destructor unmaps, releases and frees; it warns, never throws.
struct VmmMapping {
  int device = -1;
  CUdeviceptr base = 0;
  uint64_t size = 0;  // reserved bytes; equal to the sum of the mapped ones when complete
  std::vector<CUmemGenericAllocationHandle> handles;     // imported, released last
  std::vector<std::pair<CUdeviceptr, uint64_t>> mapped;  // (address, bytes)
  VmmMapping() = default;
  VmmMapping(const VmmMapping&) = delete;
  VmmMapping& operator=(const VmmMapping&) = delete;
  ~VmmMapping();
};

// Fetch the producer's handles (fds over its socket or with pidfd_getfd, or
// fabric handles), import and map them on `device`. `size` is the AllocRecord's
// size, `owner` the process that owns the lease (the exporter). Throws
// DescriptorError for a malformed or inconsistent field (decode_vmm_handle),
// ProducerGone, Released, CudaError naming what the driver refused.
std::shared_ptr<VmmMapping> import_vmm(const Handle64& handle, uint64_t size, int device, const ProcessId& owner);

struct VmmImportStats {
  int64_t mappings = 0;  // live imported VMM mappings
  int64_t bytes = 0;
};
VmmImportStats vmm_import_stats();

}  // namespace torch_ipc
