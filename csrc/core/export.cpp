#include "core/export.h"

#include <ATen/MapAllocator.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <unordered_map>

#include <c10/core/StorageImpl.h>

#include "base/clock.h"
#include "base/errors.h"

#include "os/process.h"
#include "os/refcount.h"

#include "cuda/cuda_context.h"
#include "cuda/events.h"

#include "memory/locate.h"
#include "memory/memory_kind.h"
#include "memory/vmm.h"

#include "core/registry.h"

namespace torch_ipc {
namespace {

// Note [forwarding]
// A process that received a tensor may send it on. The third process maps the
// owner's memory directly and holds the owner's lease itself, so the owner
// keeps counting it even after the forwarder exits. In between, the forwarder
// keeps one extra hold in the owner's slot per consumer it sent to (its
// holder word, so it vanishes if the forwarder dies before delivery); the
// consumer takes its own hold first and then removes one of those extras
// (lease_remove_deliveries). The owner's token revocation never touches them.

// Note [open-ended exports]
// dumps(consumers=None) asks for no count of loads: any number of processes
// may load while the producer still references the exported storages or some
// reader holds what it loaded. Such an export (consumers == 0 here) takes no
// tokens, so the usual rule (no token left, no living holder) applies once the
// producer's own references are gone: the registry keeps an open-ended record
// while a storage of it has references besides those of the records
// (registry.cpp). Forwarded tensors in it carry no pending deliveries: the
// forwarder's own hold at the owner lasts as long as it keeps the tensor,
// which is the same rule one step up. Not the default: `q.put(x * 2)` drops
// the tensor before anyone loads it (Note [consumers=None] in _serialize.py).
//
// `while_referenced` with consumers >= 1 joins the two rules, which is what
// torch gives a payload that a ForkingPickler instance pickled (Note [one
// payload, several loaders] in mp/_reductions.py): the record is kept while
// the producer references the storages (any number of loads), and the
// counted tokens keep it after that until the first `consumers` loads came
// and released. Its forwarded leases carry deliveries, as a counted export's.

// Leases of several owners: the owner's identity is part of the key.
using LeaseKey = std::tuple<uint32_t, uint64_t, uint32_t, uint32_t, uint64_t>;
LeaseKey key_of(const LeaseRecord& l) { return {l.owner.pid, l.owner.start_time, l.segment, l.slot, l.generation}; }

// What shared_natively() does not cover is refused here with its reason.
void check_shareable(const at::Tensor& t) {
  TORCH_IPC_CHECK(t.defined(), "torch_ipc: cannot share an undefined tensor");
  // torch's own refusal, word for word (torch/multiprocessing/reductions.py).
  TORCH_IPC_CHECK(!t.requires_grad() || t.is_leaf(),
                  "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd "
                  "does not support crossing process boundaries.  If you just want to transfer the "
                  "data, call detach() on the tensor before serializing (e.g., putting it on the queue).");
  TORCH_IPC_CHECK(shared_natively(t), "torch_ipc exports strided tensors that have memory, not ",
                  t.is_meta() ? "a meta tensor" : "a sparse (or other non-strided) tensor",
                  "; torch_ipc.dumps sends those as torch.multiprocessing does");
  TORCH_IPC_CHECK(!t.is_quantized(), "torch_ipc cannot share quantized tensors");
  TORCH_IPC_CHECK(!t.is_neg() && !t.is_conj(),
                  "torch_ipc: resolve lazy conjugation/negation first (tensor.resolve_conj())");
  const c10::DeviceType type = t.storage().device_type();
  TORCH_IPC_CHECK(type == c10::DeviceType::CUDA || type == c10::DeviceType::CPU,
                  "torch_ipc shares CUDA and CPU tensors, not ", t.storage().device());
  TORCH_IPC_CHECK(t.dim() <= kMaxDims, "torch_ipc shares tensors of at most ", kMaxDims, " dimensions, not ", t.dim());
  for (int64_t s : t.strides()) TORCH_IPC_CHECK(s >= 0, "torch_ipc: tensors with negative strides cannot be shared");
}

// Step 1: the distinct storages of a message, in first-seen order, and the
// index of each tensor's storage among them.
struct MessageStorages {
  std::vector<c10::Storage> storages;
  std::vector<uint32_t> of_tensor;
  size_t dims = 0;  // of all tensors, for reserving the descriptor's shapes
};

// The index of each distinct StorageImpl of a message: open addressing in a
// table of at least twice as many slots as tensors, so that a message of many
// storages allocates once, not once per storage (as a node-based map would).
class StorageIndex {
 public:
  explicit StorageIndex(size_t tensors) {
    while ((size_t{1} << bits_) < 2 * tensors) ++bits_;
    slots_.resize(size_t{1} << bits_);
  }
  // The index of `impl`, given `next` when it is new; `inserted` says which.
  uint32_t find_or_add(const c10::StorageImpl* impl, uint32_t next, bool& inserted) {
    const size_t mask = slots_.size() - 1;
    size_t i = (reinterpret_cast<uintptr_t>(impl) * 0x9E3779B97F4A7C15ull) >> (64 - bits_);
    while (slots_[i].first != nullptr && slots_[i].first != impl) i = (i + 1) & mask;
    inserted = slots_[i].first == nullptr;
    if (inserted) slots_[i] = {impl, next};
    return slots_[i].second;
  }

 private:
  int bits_ = 1;
  std::vector<std::pair<const c10::StorageImpl*, uint32_t>> slots_;
};

MessageStorages collect_storages(const TensorRefs& tensors) {
  MessageStorages m;
  StorageIndex index(tensors.size());
  m.of_tensor.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    check_shareable(t);
    m.dims += t.dim();
    const c10::Storage& storage = t.storage();
    bool inserted;
    m.of_tensor.push_back(
        index.find_or_add(storage.unsafeGetStorageImpl(), static_cast<uint32_t>(m.storages.size()), inserted));
    if (inserted) m.storages.push_back(storage);
  }
  return m;
}

// Step 2: where each storage's bytes come from: nowhere (an empty storage),
// an allocation of ours, or one another process owns (a forwarded tensor).
struct Source {
  enum { Empty, Own, Forwarded } kind = Empty;
  Location where;
  LeaseRecord owner_lease;  // Forwarded only
};

std::vector<Source> find_sources(const std::vector<c10::Storage>& storages) {
  std::vector<Source> sources(storages.size());
  StorageRefs own;
  std::vector<size_t> own_index;
  for (size_t i = 0; i < storages.size(); ++i) {
    const c10::Storage& storage = storages[i];
    if (storage.nbytes() == 0 || storage.data() == nullptr) continue;
    if (auto origin = imported_origin(storage)) {
      sources[i] = Source{Source::Forwarded, origin->where, origin->lease};
    } else {
      own.push_back(std::cref(storage));
      own_index.push_back(i);
    }
  }
  if (!own.empty()) {
    std::vector<Location> where = locate_own(own);
    for (size_t k = 0; k < own.size(); ++k) sources[own_index[k]] = Source{Source::Own, where[k], {}};
  }
  return sources;
}

// Step 3: the descriptor's tables. One alloc record per (memory, lease): two
// forwarded tensors in one base allocation may come under two leases, and
// each lease must stay referenced. Leases are filled in by attach_leases.
class TableBuilder {
 public:
  explicit TableBuilder(Descriptor& d) : d_(d) {}

  uint16_t device(int index) {
    auto [it, inserted] = devices.emplace(index, static_cast<uint16_t>(d_.devices.size()));
    if (inserted) d_.devices.push_back(device_uuid(index));
    return it->second;
  }

  void add_storage(const c10::Storage& storage, const Source& source) {
    StorageRecord sr;
    sr.nbytes = storage.nbytes();
    const bool cuda = storage.device_type() == c10::DeviceType::CUDA;
    d_.flags |= cuda ? kHasCuda : kHasCpu;
    if (source.kind == Source::Empty) {
      sr.nbytes = 0;
      sr.empty_device = cuda ? device(storage.device().index()) : kNone16;
    } else {
      sr.alloc = alloc(source);
      sr.offset = source.where.offset;
    }
    d_.storages.push_back(sr);
  }

  // The owners' leases of forwarded allocations, once each.
  std::map<LeaseKey, LeaseRecord> forwarded;
  // Per alloc record: nullopt for our own memory, else the owner's lease.
  std::vector<std::optional<LeaseRecord>> alloc_leases;
  // Local CUDA index -> index into the descriptor's devices.
  std::map<int, uint16_t> devices;

 private:
  // Storages of one message mostly share the allocation of the one before
  // (torch's caching allocator carves them out of one segment): that one is
  // compared first, the table asked only for another.
  uint32_t alloc(const Source& source) {
    const Allocation& a = source.where.alloc;
    const bool own = source.kind == Source::Own;
    AllocKey key{static_cast<uint8_t>(a.kind), a.handle, own ? LeaseKey{} : key_of(source.owner_lease)};
    if (!d_.allocs.empty() && key == last_) return last_index_;
    auto [it, inserted] = allocs_.emplace(key, static_cast<uint32_t>(d_.allocs.size()));
    last_ = key;
    last_index_ = it->second;
    if (!inserted) return it->second;
    AllocRecord ar;
    ar.kind = a.kind;
    ar.device = memory_kind(a.kind).on_gpu ? device(a.device) : kNone16;
    ar.size = a.size;
    ar.handle = a.handle;
    d_.allocs.push_back(ar);
    alloc_leases.push_back(own ? std::nullopt : std::optional<LeaseRecord>(source.owner_lease));
    if (!own) forwarded.emplace(key_of(source.owner_lease), source.owner_lease);
    return it->second;
  }

  struct AllocKey {
    uint8_t kind = 0;
    Handle64 handle{};
    LeaseKey lease;
    bool operator==(const AllocKey& o) const { return kind == o.kind && handle == o.handle && lease == o.lease; }
  };
  struct AllocKeyHash {
    size_t operator()(const AllocKey& k) const { return handle_hash(k.handle) ^ k.kind ^ std::get<4>(k.lease); }
  };

  Descriptor& d_;
  std::unordered_map<AllocKey, uint32_t, AllocKeyHash> allocs_;
  AllocKey last_;
  uint32_t last_index_ = 0;
};

// Tensor `t` as a record of `d`, its shape appended to d.dims (Note [shapes in one table]).
void add_tensor(Descriptor& d, const at::Tensor& t, uint32_t storage, bool is_parameter) {
  TensorRecord tr;
  tr.storage = storage;
  tr.dtype = static_cast<uint8_t>(t.scalar_type());
  tr.flags = (t.requires_grad() ? kRequiresGrad : 0) | (is_parameter ? kParameter : 0);
  tr.storage_offset = t.storage_offset();
  tr.ndim = static_cast<uint8_t>(t.dim());
  tr.dims = d.dims.size();
  d.dims.insert(d.dims.end(), t.sizes().begin(), t.sizes().end());
  d.dims.insert(d.dims.end(), t.strides().begin(), t.strides().end());
  d.tensors.push_back(tr);
}

// Step 4: order. One event per device whose current stream still has work,
// recorded after the work that wrote the tensors (Note [event pool] and Note
// [ordering without waiting] in events.cpp).
void record_events(Descriptor& d, const std::map<int, uint16_t>& devices) {
  for (const auto& [device, index] : devices)
    if (std::optional<Handle64> event = record_export_event(device)) d.events.push_back(EventRecord{index, *event});
}

// Step 5: leases, ours first (if the message holds any storage of ours),
// then the owners' of forwarded tensors; encode; register our export.
// Nothing here may fail without giving back what was taken.
std::shared_ptr<Export> attach_leases_and_encode(Descriptor& d, TableBuilder& tables,
                                                 std::unique_ptr<ExportRecord> record, uint32_t consumers,
                                                 bool while_referenced) {
  const bool open_ended = consumers == 0;
  if (open_ended) d.flags |= kOpenEnded;
  record->open_ended = open_ended || while_referenced;
  std::optional<LeaseRecord> own;
  if (!record->storages.empty()) {
    own = record->lease = lease_acquire(consumers);
    d.leases.push_back(*own);
  }
  std::vector<LeaseRecord> forwarded;
  try {
    std::map<LeaseKey, uint16_t> lease_index;
    for (const auto& [key, lease] : tables.forwarded) {
      if (!open_ended) {
        lease_add_deliveries(lease, consumers);
        forwarded.push_back(lease);
      }
      lease_index[key] = static_cast<uint16_t>(d.leases.size());
      d.leases.push_back(lease);
    }
    for (size_t i = 0; i < d.allocs.size(); ++i) {
      const auto& owner = tables.alloc_leases[i];
      d.allocs[i].lease = owner ? lease_index.at(key_of(*owner)) : 0;
    }
    auto out = std::make_shared<Export>(encode(d), own, forwarded, consumers);
    if (own) register_export(std::move(record));
    return out;
  } catch (...) {
    if (own) lease_abandon(*own);
    for (const auto& lease : forwarded) lease_remove_deliveries(lease, self_process().life, consumers);
    throw;
  }
}

}  // namespace

// Note [one shareability rule]
// A tensor torch_ipc exports itself is strided and has memory (not meta);
// dumps() pickles any other tensor as torch.multiprocessing does (Note
// [tensors torch_ipc does not share itself] in _serialize.py). This function
// is that rule, for both sides: _serialize.py asks it (through
// _C.shared_natively) before it takes a fast path or hands a tensor to
// export_tensors, and check_shareable refuses what it rejects, so a refusal
// here is an error, never a signal to retry another way.
int64_t torch_shared_memory_maker(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !t.is_cpu()) return 0;
  const c10::DataPtr& data = t.storage().data_ptr();
  at::MapAllocator* map = at::MapAllocator::fromDataPtr(data);
  if (map == nullptr) map = at::RefcountedMapAllocator::fromDataPtr(data);
  if (map == nullptr) return 0;
  // torch names its segments /torch_<pid>_<random>_<counter>.
  const std::string& name = map->filename();
  constexpr const char* kPrefix = "/torch_";
  if (name.rfind(kPrefix, 0) != 0) return -1;
  char* end = nullptr;
  const long long pid = std::strtoll(name.c_str() + std::strlen(kPrefix), &end, 10);
  return end != nullptr && *end == '_' && pid > 0 ? pid : -1;
}

// A nested tensor goes by torch's reducer, around its buffer.
bool shared_natively(const at::Tensor& t) {
  return t.defined() && t.layout() == c10::kStrided && !t.is_meta() && !t.is_nested();
}

Export::Export(std::string data, std::optional<LeaseRecord> own, std::vector<LeaseRecord> forwarded, uint32_t consumers)
    : data_(std::move(data)), own_(own), forwarded_(std::move(forwarded)), consumers_(consumers) {}

bool Export::live() const {
  if (revoked_.load()) return false;
  return !forwarded_.empty() || (own_ && export_is_live(*own_));
}

void Export::revoke() {
  if (made_.inherited() || revoked_.exchange(true)) return;
  if (own_ && export_is_live(*own_)) lease_revoke_tokens(*own_);
  for (const auto& lease : forwarded_) lease_remove_deliveries(lease, self_process().life, consumers_);
}

void Export::forbid_loads() {
  if (made_.inherited()) return;
  if (own_) {
    lease_forbid_loads(*own_);
    end_open_ended(*own_);
  }
  revoke();
}

std::shared_ptr<Export> export_tensors(const TensorRefs& tensors, const std::vector<bool>& is_parameter,
                                       const std::string& payload, uint32_t consumers, bool while_referenced) {
  TORCH_IPC_CHECK(is_parameter.empty() || is_parameter.size() == tensors.size(),
                  "torch_ipc: is_parameter must have one entry per tensor");
  MessageStorages message = collect_storages(tensors);
  std::vector<Source> sources = find_sources(message.storages);

  Descriptor d;
  d.producer = self_process();
  d.boot_id = boot_id();
  d.payload = payload;
  TableBuilder tables(d);
  auto record = std::make_unique<ExportRecord>();
  record->exported_at_ns = steady_now_ns();
  d.storages.reserve(message.storages.size());
  record->storages.reserve(message.storages.size());
  record->locations.reserve(message.storages.size());
  for (size_t i = 0; i < message.storages.size(); ++i) {
    tables.add_storage(message.storages[i], sources[i]);
    if (sources[i].kind != Source::Own) continue;
    record->storages.push_back(message.storages[i]);
    record->locations.push_back(sources[i].where);
    record->bytes += message.storages[i].nbytes();
  }
  d.tensors.reserve(tensors.size());
  d.dims.reserve(2 * message.dims);
  for (size_t i = 0; i < tensors.size(); ++i)
    add_tensor(d, tensors[i], message.of_tensor[i], !is_parameter.empty() && is_parameter[i]);
  record_events(d, tables.devices);
  return attach_leases_and_encode(d, tables, std::move(record), consumers, while_referenced);
}

int collect_exports() {
  vmm_collect();  // VMM exports of storages that died since the last call
  forget_dead_locations();
  HolderLivenessCycle cycle;  // Note [liveness per cycle] in refcount.h
  return drop_exports([](const ExportRecord& r) { return lease_try_reclaim(r.lease); });
}

ExportStats export_stats() {
  ExportStats s{};
  HolderLivenessCycle cycle;
  const int64_t now = steady_now_ns();
  auto younger = [](const PinnedExport& a, const PinnedExport& b) { return a.age_s > b.age_s; };
  for_each_export([&](const ExportRecord& r) {
    ++s.exports;
    s.exported_bytes += static_cast<int64_t>(r.bytes);
    LeaseCounts c = lease_counts(r.lease);
    s.tokens_pending += c.tokens;
    s.holders += c.holders;
    s.dead_holders += c.dead_holders;
    // The oldest exports, kept as a heap whose top is the youngest of them.
    PinnedExport p{static_cast<double>(now - r.exported_at_ns) * 1e-9, static_cast<int64_t>(r.bytes), c.tokens,
                   c.holders, c.dead_holders};
    if (s.oldest.size() < kOldestExportsShown) {
      s.oldest.push_back(p);
      std::push_heap(s.oldest.begin(), s.oldest.end(), younger);
    } else if (p.age_s > s.oldest.front().age_s) {
      std::pop_heap(s.oldest.begin(), s.oldest.end(), younger);
      s.oldest.back() = p;
      std::push_heap(s.oldest.begin(), s.oldest.end(), younger);
    }
    if (c.holders <= c.dead_holders) return;
    s.held_bytes += static_cast<int64_t>(r.bytes);
    for (size_t i = 0; i < r.storages.size(); ++i)
      if (r.locations[i].alloc.kind == AllocKind::CudaIpc)
        s.held_cuda_ipc_bytes += static_cast<int64_t>(r.storages[i].nbytes());
  });
  std::sort(s.oldest.begin(), s.oldest.end(), younger);
  return s;
}

}  // namespace torch_ipc
