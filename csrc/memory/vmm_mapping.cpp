// Driver queries about VMM mappings (cuPointerGetAttributes, cuMemGetAddressRange),
// and access to them from another device (cuMemSetAccess).
#include "memory/vmm_mapping.h"

#include "base/errors.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

namespace torch_ipc {

std::string vmm_not_shareable(const std::string& why) {
  return "torch_ipc: this CUDA tensor's memory cannot be shared: it is not a cudaMalloc segment "
         "(legacy CUDA IPC) and not a cuMemCreate allocation either (" +
         why +
         "). Memory from cudaMallocAsync pools (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) "
         "cannot be shared; copy the tensor into torch_ipc.SharedPool memory, or use "
         "torch_ipc.dumps(..., isolated=True)";
}

MappedChunk chunk_at(CUdeviceptr p) {
  MappedChunk c;
  // The driver's MAPPING_* attributes (CUDA >= 11.7) name the mapping and its
  // physical allocation; where they are not answered, cuMemGetAddressRange
  // returns the mapped region (not the reservation) for VMM memory.
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
                                 CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID};
  void* values[] = {&c.base, &c.size, &c.block};
  bool ok = driver().cuPointerGetAttributes(3, attrs, values, p) == CUDA_SUCCESS && c.size != 0 && c.base <= p &&
            p < c.base + c.size;
  if (!ok) {
    c = MappedChunk{};
    CUresult r = driver().cuMemGetAddressRange(&c.base, &c.size, p);
    TORCH_IPC_CHECK(r == CUDA_SUCCESS && c.size != 0 && c.base <= p && p < c.base + c.size,
                    vmm_not_shareable(r != CUDA_SUCCESS ? driver_error_message("cuMemGetAddressRange", r)
                                                        : "the driver reports no mapping at this address"));
  }
  return c;
}

void grant_device_access(CUdeviceptr p, size_t size, int device) {
  ScopedContext scope(device);
  CUdevice dev;
  TORCH_IPC_CU(cuDeviceGet, &dev, device);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUdeviceptr end = p + size;
  while (p < end) {
    const MappedChunk c = chunk_at(p);
    TORCH_IPC_CU(cuMemSetAccess, c.base, c.size, &access, 1);
    p = c.base + c.size;
  }
}

}  // namespace torch_ipc
