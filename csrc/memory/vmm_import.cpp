// VMM consumer side: the import + map sequence (fetch, import, reserve, map, set
// access) for one handle field, and the teardown of the mapping it makes.
#include "memory/vmm_import.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include <c10/util/Exception.h>

#include "base/errors.h"

#include "wire/vmm_handle.h"

#include "os/fd_passing.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

namespace torch_ipc {
namespace {

std::atomic<int64_t> mapping_count{0}, mapped_bytes{0};

}  // namespace

VmmMapping::~VmmMapping() {
  if (device < 0) return;
  try {
    ScopedContext scope(device);
    for (auto it = mapped.rbegin(); it != mapped.rend(); ++it) TORCH_IPC_CU_WARN(cuMemUnmap, it->first, it->second);
    for (auto h : handles) TORCH_IPC_CU_WARN(cuMemRelease, h);
    if (base != 0) TORCH_IPC_CU_WARN(cuMemAddressFree, base, size);
  } catch (const std::exception& e) {
    TORCH_WARN("torch_ipc: unmapping shared VMM memory failed: ", e.what());
  }
  if (base != 0) {
    --mapping_count;
    mapped_bytes -= static_cast<int64_t>(size);
  }
}

namespace {

DescriptorError bad_field(const std::string& what) {
  return DescriptorError("malformed torch_ipc descriptor: VMM handle field: " + what);
}

// Step 1: the producer's chunks (fds, or fabric handles as data), checked
// against the field: as many as it says, of its chunk size, `size` in all.
std::vector<ReceivedItem> fetch_chunks(const VmmHandleField& f, uint64_t size, const ProcessId& owner) {
  const auto type = static_cast<CUmemAllocationHandleType>(f.type);
  // decode_vmm_handle leaves fd numbers only on POSIX fields.
  const std::vector<int> remote(f.fds.begin(), f.fds.end());
  std::vector<ReceivedItem> items = fd_fetch(owner, f.id, remote);
  if (items.size() != f.n_chunks)
    throw bad_field("the producer holds " + std::to_string(items.size()) + " allocations, the descriptor says " +
                    std::to_string(f.n_chunks));
  uint64_t total = 0;
  for (auto& item : items) {
    if (item.size == 0) item.size = f.chunk_bytes;
    if (f.chunk_bytes != 0 && item.size != f.chunk_bytes) throw bad_field("the producer reports other chunk sizes");
    if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && item.fd.get() < 0)
      throw bad_field("the producer sent no file descriptor");
    if (item.size > UINT64_MAX - total) throw bad_field("the producer reports sizes that overflow 64 bits");
    total += item.size;
  }
  if (total != size)
    throw bad_field("the allocations hold " + std::to_string(total) + " bytes, the descriptor says " +
                    std::to_string(size));
  return items;
}

// Step 2: import each chunk into m.handles (closing its fd: the handle holds
// the memory now); returns the alignment the reservation needs, the largest
// granularity, which every chunk size must be a multiple of.
size_t import_chunks(VmmMapping& m, std::vector<ReceivedItem>& items, CUmemAllocationHandleType type,
                     const ProcessId& owner) {
  size_t alignment = 0;
  CUmemAllocationProp last_prop{};
  size_t granularity = 0;
  for (auto& item : items) {
    CUmemGenericAllocationHandle h;
    void* os_handle = type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                          ? reinterpret_cast<void*>(static_cast<uintptr_t>(item.fd.get()))
                          : static_cast<void*>(item.blob.data());
    CUresult r = driver().cuMemImportFromShareableHandle(&h, os_handle, type);
    item.fd.reset();
    if (r != CUDA_SUCCESS)
      throw_driver_error("cuMemImportFromShareableHandle", r,
                         "torch_ipc: what the producer (pid " + std::to_string(owner.pid) +
                             ") sent is not a CUDA allocation this process can import" +
                             (type == CU_MEM_HANDLE_TYPE_FABRIC ? " (fabric handles need an IMEX channel)" : ""));
    m.handles.push_back(h);
    CUmemAllocationProp prop{};
    TORCH_IPC_CU(cuMemGetAllocationPropertiesFromHandle, &prop, h);
    if (granularity == 0 || std::memcmp(&prop, &last_prop, sizeof(prop)) != 0) {
      granularity = 0;
      TORCH_IPC_CU(cuMemGetAllocationGranularity, &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      last_prop = prop;
    }
    if (granularity == 0 || item.size % granularity != 0)
      throw bad_field("a chunk of " + std::to_string(item.size) + " bytes is not a multiple of the granularity " +
                      std::to_string(granularity));
    alignment = std::max(alignment, granularity);
  }
  return alignment;
}

// Step 3: reserve one address range, map the chunks back to back, and let
// this device read and write all of it.
void map_chunks(VmmMapping& m, const std::vector<ReceivedItem>& items, uint64_t size, size_t alignment,
                const ProcessId& owner) {
  TORCH_IPC_CU(cuMemAddressReserve, &m.base, size, alignment, 0, 0);
  m.size = size;
  ++mapping_count;
  mapped_bytes += static_cast<int64_t>(size);
  CUdeviceptr at = m.base;
  for (size_t i = 0; i < items.size(); ++i) {
    CUresult r = driver().cuMemMap(at, items[i].size, 0, m.handles[i], 0);
    if (r != CUDA_SUCCESS)
      throw_driver_error("cuMemMap", r,
                         "torch_ipc: mapping " + std::to_string(items[i].size) + " bytes of allocation " +
                             std::to_string(i) + " from pid " + std::to_string(owner.pid) +
                             " (is the allocation smaller than the descriptor says?)");
    m.mapped.emplace_back(at, items[i].size);
    at += items[i].size;
  }
  CUdevice dev;
  TORCH_IPC_CU(cuDeviceGet, &dev, m.device);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  // One call for the whole range: the chunks are mapped back to back, and
  // the driver's cost is per call as well as per page.
  TORCH_IPC_CU(cuMemSetAccess, m.base, m.size, &access, 1);
}

}  // namespace

// A mapping that fails halfway is torn down by ~VmmMapping: what was
// imported is released, what was mapped unmapped, the reservation freed.
std::shared_ptr<VmmMapping> import_vmm(const Handle64& handle, uint64_t size, int device, const ProcessId& owner) {
  const VmmHandleField f = decode_vmm_handle(handle, size);
  if (f.pid != owner.pid)
    throw bad_field("it names pid " + std::to_string(f.pid) + " but its lease belongs to pid " +
                    std::to_string(owner.pid));
  std::vector<ReceivedItem> items = fetch_chunks(f, size, owner);
  ScopedContext scope(device);
  auto m = std::make_shared<VmmMapping>();
  m->device = device;
  const auto type = static_cast<CUmemAllocationHandleType>(f.type);
  const size_t alignment = import_chunks(*m, items, type, owner);
  map_chunks(*m, items, size, alignment, owner);
  return m;
}

VmmImportStats vmm_import_stats() {
  VmmImportStats s;
  s.mappings = mapping_count.load();
  s.bytes = mapped_bytes.load();
  return s;
}

}  // namespace torch_ipc
