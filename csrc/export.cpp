#include "export.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "cuda_context.h"
#include "cuda_driver.h"
#include "errors.h"
#include "host_memory.h"
#include "import.h"
#include "process.h"
#include "refcount.h"
#include "vmm.h"

namespace torch_ipc {
namespace {

// Where a storage's bytes live, as the descriptor says it.
struct StorageLocation {
  AllocKind kind;
  int device;  // CUDA index, -1 for host
  Handle64 handle{};
  uint64_t base_size = 0;
  uint64_t offset = 0;  // of the storage inside the base allocation
};

// Note [base allocation]
// CUDA IPC shares whole allocations, and torch's caching allocator carves many
// storages out of one cudaMalloc segment. So we send the handle of the segment
// plus the storage's offset inside it, as torch does. Looking the segment up
// costs a driver call and getting its handle another; both are cached:
//   - by StorageImpl (weakly): a storage sent again costs one hash lookup;
//   - by the driver's BUFFER_ID, a process-wide unique id of the allocation,
//     so a segment freed and another allocated at the same address never
//     reuses a stale handle.
struct BufferInfo {
  Handle64 handle;
  uint64_t base;
  uint64_t size;
};
struct CachedStorage {
  c10::weak_intrusive_ptr<c10::StorageImpl> weak;
  const void* data;
  StorageLocation location;
};

struct EventSlot {
  CUevent event = nullptr;
  Handle64 handle{};
};

// Note [event pool]
// The consumer's stream waits on an interprocess event that the producer
// records on its current stream at export. Opening an IPC event costs ~150 us
// in the consumer, so each producer records into a small pool per device that
// every consumer opens once. Re-recording an event a consumer has not waited
// on yet only makes that consumer wait for later work: still correct.
constexpr int kEventsPerDevice = 4;
struct EventPool {
  std::vector<EventSlot> slots;
  uint64_t next = 0;
};

struct ExportRecord {
  LeaseRecord lease;
  std::vector<c10::Storage> storages;
  std::vector<StorageLocation> locations;  // parallel to storages
  uint64_t bytes = 0;
};

using LeaseKey = std::tuple<uint32_t, uint32_t, uint64_t>;
LeaseKey key_of(const LeaseRecord& l) { return {l.segment, l.slot, l.generation}; }
// Leases of several owners: the owner's identity is part of the key.
using FullLeaseKey = std::tuple<uint32_t, uint64_t, uint32_t, uint32_t, uint64_t>;
FullLeaseKey full_key_of(const LeaseRecord& l) {
  return {l.owner.pid, l.owner.start_time, l.segment, l.slot, l.generation};
}

// Note [forwarding]
// A process that received a tensor may send it on. The third process maps the
// owner's memory directly and holds the owner's lease itself, so the owner
// keeps counting it even after the forwarder exits. In between, the forwarder
// keeps one extra hold in the owner's slot per consumer it sent to (its
// holder word, so it vanishes if the forwarder dies before delivery); the
// consumer takes its own hold first and then removes one of those extras
// (lease_remove_deliveries). The owner's token revocation never touches them.

struct Producer {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, CachedStorage> storage_cache;
  std::unordered_map<unsigned long long, BufferInfo> buffer_cache;
  std::map<int, EventPool> event_pools;
  std::map<LeaseKey, std::unique_ptr<ExportRecord>> records;
};

Producer& producer() {
  static Producer* p = new Producer();  // outlives static destructors
  return *p;
}

bool is_cuda(AllocKind k) { return k != AllocKind::CpuShm; }

StorageLocation vmm_location(const VmmLocation& v, int device) {
  StorageLocation loc{AllocKind::CudaVmm, device};
  loc.handle = v.handle;
  loc.base_size = v.size;
  loc.offset = v.offset;
  return loc;
}

// The legacy IPC location of a storage in a cudaMalloc segment; nullopt when
// its memory is not legacy-IPC capable (cuMemCreate memory: the VMM path).
std::optional<StorageLocation> locate_legacy(const c10::Storage& storage, int device) {
  Producer& p = producer();
  const void* data = storage.data();
  CUdeviceptr start = 0;
  size_t range = 0;
  unsigned long long buffer_id = 0;
  int legacy_ipc = 0;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                 CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                 CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  void* values[] = {&start, &range, &buffer_id, &legacy_ipc};
  TORCH_IPC_CU(cuPointerGetAttributes, 4, attrs, values, reinterpret_cast<CUdeviceptr>(data));
  if (!legacy_ipc) return std::nullopt;
  StorageLocation loc{AllocKind::CudaIpc, device};
  auto it = p.buffer_cache.find(buffer_id);
  if (it == p.buffer_cache.end()) {
    CUipcMemHandle h;
    TORCH_IPC_CU(cuIpcGetMemHandle, &h, start);
    BufferInfo info;
    std::memcpy(info.handle.data(), h.reserved, 64);
    info.base = start;
    info.size = range;
    it = p.buffer_cache.emplace(buffer_id, info).first;
  }
  loc.handle = it->second.handle;
  loc.base_size = it->second.size;
  loc.offset = reinterpret_cast<uint64_t>(data) - it->second.base;
  return loc;
}

StorageLocation locate_host(const c10::Storage& storage) {
  HostSegment seg = ensure_host_shared(storage);
  StorageLocation loc{AllocKind::CpuShm, -1};
  TORCH_CHECK(seg.name.size() < 64, "torch_ipc: shared memory name too long");
  std::memcpy(loc.handle.data(), seg.name.data(), seg.name.size());
  loc.base_size = seg.size;
  loc.offset = 0;
  return loc;
}

const StorageLocation* cached_location(const c10::Storage& storage) {
  Producer& p = producer();
  const c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  auto it = p.storage_cache.find(impl);
  if (it == p.storage_cache.end()) return nullptr;
  auto alive = it->second.weak.lock();
  if (alive.get() != impl || it->second.data != storage.data()) return nullptr;
  return &it->second.location;
}

void cache_location(const c10::Storage& storage, const StorageLocation& loc) {
  const c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  c10::intrusive_ptr<c10::StorageImpl> strong =
      c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(const_cast<c10::StorageImpl*>(impl));
  producer().storage_cache.insert_or_assign(
      impl, CachedStorage{c10::weak_intrusive_ptr<c10::StorageImpl>(strong), storage.data(), loc});
}

bool is_imported(const c10::Storage& storage) {
  return storage.data_ptr().get_deleter() == &delete_imported_storage;
}

// Locate and cache CUDA storages that the cache does not know: legacy IPC
// ones one by one, VMM ones together per device (Note [VMM runs per message]).
void locate_cuda_storages(const std::vector<c10::Storage>& storages) {
  std::map<int, std::vector<c10::Storage>> vmm;  // by device
  for (const c10::Storage& storage : storages) {
    const int device = storage.device().index();
    ScopedContext scope(device);
    if (auto loc = locate_legacy(storage, device))
      cache_location(storage, *loc);
    else
      vmm[device].push_back(storage);
  }
  for (auto& [device, on_device] : vmm) {
    ScopedContext scope(device);
    std::vector<VmmLocation> locations = locate_vmm(on_device, device);
    for (size_t i = 0; i < on_device.size(); ++i)
      cache_location(on_device[i], vmm_location(locations[i], device));
  }
}

// Note [VMM runs per message]
// Storages of one message that live in VMM memory are located together, so
// that the chunks they touch form as few runs as possible (Note [VMM handle
// field]): a state_dict in torch's expandable segments is then one run of
// back-to-back chunks, which a consumer fetches in one request and maps into
// one range, instead of one fetch, reservation and mapping per tensor. So
// before the descriptor is built, every own CUDA storage of the message that
// the cache does not know yet is located here; the loop then finds them all
// in the cache.
void locate_new_cuda_storages(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Storage> unknown;
  std::unordered_set<const c10::StorageImpl*> seen;  // of the unknown ones
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || t.layout() != c10::kStrided || !t.is_cuda()) continue;  // checked later
    const c10::Storage& storage = t.storage();
    if (storage.nbytes() == 0 || storage.data() == nullptr || is_imported(storage)) continue;
    if (cached_location(storage) || !seen.insert(storage.unsafeGetStorageImpl()).second) continue;
    unknown.push_back(storage);
  }
  if (!unknown.empty()) locate_cuda_storages(unknown);
}

// Own storages: where they live, through the weak cache.
StorageLocation locate_own(const c10::Storage& storage) {
  if (const StorageLocation* known = cached_location(storage)) return *known;
  if (storage.device_type() == c10::DeviceType::CUDA) {
    locate_cuda_storages({storage});
    return *cached_location(storage);
  }
  TORCH_CHECK(storage.device_type() == c10::DeviceType::CPU,
              "torch_ipc shares CUDA and CPU tensors, not ", storage.device());
  StorageLocation loc = locate_host(storage);
  cache_location(storage, loc);
  return loc;
}

EventSlot& next_event(int device) {
  Producer& p = producer();
  EventPool& pool = p.event_pools[device];
  if (pool.slots.empty()) {
    pool.slots.resize(kEventsPerDevice);
    for (auto& s : pool.slots) {
      TORCH_IPC_CU(cuEventCreate, &s.event, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
      CUipcEventHandle h;
      TORCH_IPC_CU(cuIpcGetEventHandle, &h, s.event);
      std::memcpy(s.handle.data(), h.reserved, 64);
    }
  }
  return pool.slots[pool.next++ % pool.slots.size()];
}

uint16_t index_of_device(Descriptor& d, std::map<int, uint16_t>& seen, int device) {
  auto it = seen.find(device);
  if (it != seen.end()) return it->second;
  uint16_t index = static_cast<uint16_t>(d.devices.size());
  d.devices.push_back(device_uuid(device));
  seen.emplace(device, index);
  return index;
}

}  // namespace

std::string export_tensors(const std::vector<at::Tensor>& tensors,
                           const std::vector<bool>& is_parameter, const std::string& payload,
                           uint32_t consumers) {
  check_not_forked();
  TORCH_CHECK(consumers >= 1, "torch_ipc: consumers must be at least 1");
  TORCH_CHECK(is_parameter.empty() || is_parameter.size() == tensors.size(),
              "torch_ipc: is_parameter must have one entry per tensor");
  Producer& p = producer();
  std::lock_guard<std::mutex> lock(p.mu);

  Descriptor d;
  d.producer = self_process();
  d.boot_id = boot_id();
  d.payload = payload;

  std::unordered_map<const c10::StorageImpl*, uint32_t> storage_index;
  // One alloc record per (memory, lease): two forwarded tensors in one base
  // allocation may come under two leases, and each lease must stay referenced.
  std::map<std::tuple<uint8_t, Handle64, FullLeaseKey>, uint32_t> alloc_index;
  std::map<int, uint16_t> device_index;
  std::vector<std::pair<bool, LeaseRecord>> alloc_lease;  // (own, forwarded lease)
  auto record = std::make_unique<ExportRecord>();
  std::map<FullLeaseKey, LeaseRecord> forwarded;
  locate_new_cuda_storages(tensors);

  d.tensors.reserve(tensors.size());
  for (size_t ti = 0; ti < tensors.size(); ++ti) {
    const at::Tensor& t = tensors[ti];
    TORCH_CHECK(t.defined(), "torch_ipc: cannot share an undefined tensor");
    TORCH_CHECK(t.layout() == c10::kStrided, "torch_ipc shares strided tensors, not ", t.layout());
    TORCH_CHECK(!t.is_quantized(), "torch_ipc cannot share quantized tensors");
    TORCH_CHECK(!t.is_neg() && !t.is_conj(),
                "torch_ipc: resolve lazy conjugation/negation first (tensor.resolve_conj())");
    const c10::Storage& storage = t.storage();
    const c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    auto found = storage_index.find(impl);
    uint32_t si;
    if (found != storage_index.end()) {
      si = found->second;
    } else {
      StorageRecord sr;
      bool cuda = storage.device_type() == c10::DeviceType::CUDA;
      TORCH_CHECK(cuda || storage.device_type() == c10::DeviceType::CPU,
                  "torch_ipc shares CUDA and CPU tensors, not ", storage.device());
      sr.kind = cuda ? AllocKind::CudaIpc : AllocKind::CpuShm;
      sr.device = cuda ? index_of_device(d, device_index, storage.device().index()) : kNone16;
      sr.nbytes = storage.nbytes();
      if (sr.nbytes != 0 && storage.data() != nullptr) {
        StorageLocation loc;
        bool own = true;
        LeaseRecord lease;
        if (is_imported(storage)) {
          // A tensor this process received: send the owner's memory and lease on.
          auto* ctx = static_cast<ImportedStorage*>(storage.data_ptr().get_context());
          loc = {ctx->mapping->kind, ctx->mapping->device, ctx->mapping->handle,
                 ctx->mapping->size, ctx->offset};
          own = false;
          lease = ctx->hold->lease;
          forwarded.emplace(full_key_of(lease), lease);
        } else {
          loc = locate_own(storage);
          record->storages.push_back(storage);
          record->locations.push_back(loc);
          record->bytes += sr.nbytes;
        }
        sr.kind = loc.kind;
        auto key = std::make_tuple(static_cast<uint8_t>(loc.kind), loc.handle,
                                   own ? FullLeaseKey{} : full_key_of(lease));
        auto a = alloc_index.find(key);
        if (a == alloc_index.end()) {
          AllocRecord ar;
          ar.kind = loc.kind;
          ar.device = sr.device;
          ar.size = loc.base_size;
          ar.handle = loc.handle;
          a = alloc_index.emplace(key, static_cast<uint32_t>(d.allocs.size())).first;
          d.allocs.push_back(ar);
          alloc_lease.emplace_back(own, lease);
        }
        sr.alloc = a->second;
        sr.offset = loc.offset;
      }
      si = static_cast<uint32_t>(d.storages.size());
      storage_index.emplace(impl, si);
      d.storages.push_back(sr);
      d.flags |= cuda ? kHasCuda : kHasCpu;
    }
    TensorRecord tr;
    tr.storage = si;
    tr.dtype = static_cast<uint8_t>(t.scalar_type());
    tr.flags = (t.requires_grad() ? kRequiresGrad : 0) |
               (!is_parameter.empty() && is_parameter[ti] ? kParameter : 0);
    tr.storage_offset = t.storage_offset();
    tr.sizes.assign(t.sizes().begin(), t.sizes().end());
    tr.strides.assign(t.strides().begin(), t.strides().end());
    for (int64_t s : tr.strides)
      TORCH_CHECK(s >= 0, "torch_ipc: tensors with negative strides cannot be shared");
    d.tensors.push_back(std::move(tr));
  }

  for (auto& [device, index] : device_index) {
    ScopedContext scope(device);
    EventSlot& slot = next_event(device);
    TORCH_IPC_CU(cuEventRecord, slot.event, current_stream(device));
    d.events.push_back(EventRecord{index, producer().event_pools[device].next, slot.handle});
  }

  // Leases: ours first (if this message holds any storage of ours), then the
  // owners' of forwarded tensors (Note [forwarding]). Nothing after this point
  // may fail without giving back what was taken.
  std::map<FullLeaseKey, uint16_t> lease_index;
  const bool any_own = !record->storages.empty();
  if (any_own) d.leases.push_back(record->lease = lease_acquire(consumers));
  std::vector<LeaseRecord> held_for_consumers;
  try {
    for (auto& [key, lease] : forwarded) {
      lease_add_deliveries(lease, consumers);
      held_for_consumers.push_back(lease);
      lease_index[key] = static_cast<uint16_t>(d.leases.size());
      d.leases.push_back(lease);
    }
    for (size_t i = 0; i < d.allocs.size(); ++i)
      d.allocs[i].lease =
          alloc_lease[i].first ? 0 : lease_index.at(full_key_of(alloc_lease[i].second));
    std::string bytes = encode(d);
    if (any_own) p.records.emplace(key_of(record->lease), std::move(record));
    return bytes;
  } catch (...) {
    if (any_own) lease_abandon(record->lease);
    for (const auto& lease : held_for_consumers) lease_remove_deliveries(lease, self_process().pid, consumers);
    throw;
  }
}

std::optional<c10::Storage> find_own_storage(const LeaseRecord& lease, AllocKind kind,
                                             const Handle64& handle, uint64_t offset,
                                             uint64_t nbytes) {
  Producer& p = producer();
  std::lock_guard<std::mutex> lock(p.mu);
  auto it = p.records.find(key_of(lease));
  if (it == p.records.end()) return std::nullopt;
  const ExportRecord& r = *it->second;
  for (size_t i = 0; i < r.storages.size(); ++i) {
    const StorageLocation& loc = r.locations[i];
    if (loc.kind == kind && loc.handle == handle && loc.offset == offset &&
        r.storages[i].nbytes() == nbytes)
      return r.storages[i];
  }
  return std::nullopt;
}

CUevent find_own_event(const Handle64& handle) {
  Producer& p = producer();
  std::lock_guard<std::mutex> lock(p.mu);
  for (auto& [device, pool] : p.event_pools)
    for (auto& s : pool.slots)
      if (s.handle == handle) return s.event;
  return nullptr;
}

int collect_exports() {
  if (in_forked_child()) return 0;
  vmm_collect();  // VMM exports of storages that died since the last call
  Producer& p = producer();
  std::vector<std::unique_ptr<ExportRecord>> reclaimed;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    for (auto it = p.records.begin(); it != p.records.end();) {
      if (lease_try_reclaim(it->second->lease)) {
        reclaimed.push_back(std::move(it->second));
        it = p.records.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = p.storage_cache.begin(); it != p.storage_cache.end();) {
      if (it->second.weak.expired())
        it = p.storage_cache.erase(it);
      else
        ++it;
    }
  }
  return static_cast<int>(reclaimed.size());  // storages are dropped here, outside the lock
}

void revoke_exports(const std::vector<LeaseRecord>& leases) {
  Producer& p = producer();
  std::lock_guard<std::mutex> lock(p.mu);
  if (leases.empty()) {
    for (auto& [key, r] : p.records) lease_revoke_tokens(r->lease);
  } else {
    for (const auto& l : leases)
      if (l.owner == self_process() && p.records.count(key_of(l))) lease_revoke_tokens(l);
  }
}

bool export_is_live(const LeaseRecord& lease) {
  Producer& p = producer();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.records.count(key_of(lease)) > 0;
}

ExportStats export_stats() {
  Producer& p = producer();
  std::lock_guard<std::mutex> lock(p.mu);
  ExportStats s{};
  for (auto& [key, r] : p.records) {
    ++s.exports;
    s.exported_bytes += static_cast<int64_t>(r->bytes);
    LeaseCounts c = lease_counts(r->lease);
    s.tokens_pending += c.tokens;
    s.holders += c.holders;
    s.dead_holders += c.dead_holders;
  }
  return s;
}

}  // namespace torch_ipc
