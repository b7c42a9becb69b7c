#include "memory/locate.h"

#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include "base/errors.h"
#include "base/fork.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

#include "memory/host_memory.h"
#include "memory/vmm.h"

namespace torch_ipc {
namespace {

// Note [base allocation]
// CUDA IPC shares whole allocations, and torch's caching allocator carves many
// storages out of one cudaMalloc segment. So we send the handle of the segment
// plus the storage's offset inside it, as torch does. Looking the segment up
// costs a driver call and getting its handle another; both are cached:
//   - by StorageImpl (weakly): a storage sent again costs one hash lookup;
//   - by the driver's BUFFER_ID, a process-wide unique id of the allocation,
//     so a segment freed and another allocated at the same address never
//     reuses a stale handle.
struct Segment {
  Handle64 handle;
  uint64_t base;
  uint64_t size;
};
struct CachedStorage {
  c10::weak_intrusive_ptr<c10::StorageImpl> weak;
  const void* data;
  Location where;
};

struct Locations {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, CachedStorage> storages;
  std::unordered_map<unsigned long long, Segment> segments;  // by BUFFER_ID
};

Locations& locations() { return *process_state<Locations>(); }

// Note [a cached storage is the one asked about]
// The cache's weak pointer keeps the memory of its StorageImpl allocated (c10
// frees it with the last weak reference), so no other StorageImpl can be made
// at that address while the entry exists: an entry found under the address of
// a storage the caller holds is that storage's, and alive. No lock() per
// storage, then; only its memory may have been swapped since (share_memory_()
// does so in place), which the data pointer shows.
const Location* cached(Locations& l, const c10::Storage& storage) {
  auto it = l.storages.find(storage.unsafeGetStorageImpl());
  if (it == l.storages.end() || it->second.data != storage.data()) return nullptr;
  return &it->second.where;
}

void remember(Locations& l, const c10::Storage& storage, const Location& where) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  auto strong = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl);
  l.storages.insert_or_assign(impl,
                              CachedStorage{c10::weak_intrusive_ptr<c10::StorageImpl>(strong), storage.data(), where});
}

// The legacy IPC location of a storage in a cudaMalloc segment; nullopt when
// its memory is not legacy-IPC capable (cuMemCreate memory: the VMM path).
std::optional<Location> locate_legacy(Locations& l, const c10::Storage& storage, int device) {
  const void* data = storage.data();
  CUdeviceptr start = 0;
  size_t range = 0;
  unsigned long long buffer_id = 0;
  int legacy_ipc = 0;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                 CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  void* values[] = {&start, &range, &buffer_id, &legacy_ipc};
  TORCH_IPC_CU(cuPointerGetAttributes, 4, attrs, values, reinterpret_cast<CUdeviceptr>(data));
  if (!legacy_ipc) return std::nullopt;
  auto it = l.segments.find(buffer_id);
  if (it == l.segments.end()) {
    CUipcMemHandle h;
    TORCH_IPC_CU(cuIpcGetMemHandle, &h, start);
    Segment segment{{}, start, range};
    std::memcpy(segment.handle.data(), h.reserved, 64);
    it = l.segments.emplace(buffer_id, segment).first;
  }
  Location where;
  where.alloc = Allocation{AllocKind::CudaIpc, device, it->second.handle, it->second.size};
  where.offset = reinterpret_cast<uint64_t>(data) - it->second.base;
  return where;
}

Location locate_host(const c10::Storage& storage) {
  HostSegment segment = ensure_host_shared(storage);
  TORCH_IPC_CHECK(segment.name.size() < 64, "torch_ipc: shared memory name too long");
  Location where;
  where.alloc.kind = AllocKind::CpuShm;
  std::memcpy(where.alloc.handle.data(), segment.name.data(), segment.name.size());
  where.alloc.size = segment.size;
  return where;
}

// Note [VMM runs per message]
// Storages of one message that live in VMM memory are located together, so
// that the chunks they touch form as few runs as possible (Note [VMM handle
// field]): a state_dict in torch's expandable segments is then one run of
// back-to-back chunks, which a consumer fetches in one request and maps into
// one range, instead of one fetch, reservation and mapping per tensor.
void locate_new_cuda(Locations& l, const std::vector<c10::Storage>& storages) {
  std::map<int, std::vector<c10::Storage>> vmm;  // by device
  for (const c10::Storage& storage : storages) {
    const int device = storage.device().index();
    ScopedContext scope(device);
    if (auto where = locate_legacy(l, storage, device))
      remember(l, storage, *where);
    else
      vmm[device].push_back(storage);
  }
  for (auto& [device, on_device] : vmm) {
    ScopedContext scope(device);
    std::vector<Location> found = locate_vmm(on_device, device);
    for (size_t i = 0; i < on_device.size(); ++i) remember(l, on_device[i], found[i]);
  }
}

}  // namespace

void locations_forget_after_fork() { forget_after_fork<Locations>(); }
const AfterForkInChild reset_locations_after_fork(&locations_forget_after_fork);

std::vector<Location> locate_own(const StorageRefs& storages) {
  Locations& l = locations();
  std::lock_guard<std::mutex> lock(l.mu);
  std::vector<Location> out(storages.size());
  std::vector<size_t> new_cuda;  // indices into storages
  for (size_t i = 0; i < storages.size(); ++i) {
    const c10::Storage& storage = storages[i];
    if (const Location* known = cached(l, storage))
      out[i] = *known;
    else if (storage.device_type() == c10::DeviceType::CUDA)
      new_cuda.push_back(i);  // the caller passes each storage once
    else
      remember(l, storage, out[i] = locate_host(storage));
  }
  if (new_cuda.empty()) return out;
  std::vector<c10::Storage> batch;
  for (size_t i : new_cuda) batch.push_back(storages[i]);
  locate_new_cuda(l, batch);
  for (size_t i : new_cuda) out[i] = *cached(l, storages[i]);
  return out;
}

void forget_dead_locations() {
  Locations& l = locations();
  std::lock_guard<std::mutex> lock(l.mu);
  for (auto it = l.storages.begin(); it != l.storages.end();) {
    if (it->second.weak.expired())
      it = l.storages.erase(it);
    else
      ++it;
  }
}

}  // namespace torch_ipc
