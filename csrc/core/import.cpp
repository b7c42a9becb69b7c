#include "core/import.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include <c10/core/ScalarType.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

#include "base/clock.h"
#include "base/env.h"
#include "base/errors.h"
#include "base/fork.h"

#include "os/process.h"
#include "os/refcount.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"
#include "cuda/events.h"

#include "memory/memory_kind.h"

#include "core/registry.h"

namespace torch_ipc {

// One allocation of another process, opened in this one (by its kind's table,
// memory/memory_kind.h); closed (or unmapped) when the last user lets go.
struct Mapping {
  Allocation where;
  ProcessId producer;
  const MemoryKind* kind = nullptr;
  std::unique_ptr<OpenedMemory> memory;
  int64_t idle_since_ns = 0;  // set by collect() when no tensor uses it
  char* base() const { return memory->base; }
};

namespace {

// A hold whose tensors are gone, waiting for the GPU work queued on them.
struct PendingRelease {
  LeaseRecord lease;
  std::vector<std::pair<int, CUevent>> done;  // (device, event recorded at release)
  std::vector<std::shared_ptr<Mapping>> mappings;
};

// Note [idle mappings]
// A consumer that receives the same weights again and again (an inference
// engine fed by a trainer) would pay cuIpcOpenMemHandle (45-80 us) per base
// allocation per message if mappings closed with their last tensor. So a
// mapping with no tensor left stays open, idle, and is closed when its
// producer exits, when it has been idle TORCH_IPC_IDLE_SECONDS, when more than
// TORCH_IPC_IDLE_MAPPINGS are idle (oldest first), or on collect(close_idle=True).
// Only legacy IPC mappings stay idle (MemoryKind::stays_open_idle); host and
// VMM ones close with their last tensor, since they would keep the producer's
// freed memory alive.
// The producer's lease is released already; the open handle may keep the
// segment's memory until it closes if the producer frees it (empty_cache).
constexpr int64_t kMaxIdleSetting = 1000000000;  // seconds (31 years) or mappings
using MappingKey = std::pair<uint8_t, Handle64>;
struct MappingKeyHash {
  size_t operator()(const MappingKey& k) const { return handle_hash(k.second) ^ k.first; }
};
struct Consumer {
  std::recursive_mutex mu;
  std::unordered_map<MappingKey, std::shared_ptr<Mapping>, MappingKeyHash> mappings;
  std::vector<PendingRelease> pending;
  std::vector<std::pair<int, CUevent>> spare_events;
  std::atomic<int64_t> holds{0};
  // Note [checked settings]: junk warns and keeps the default.
  const int64_t idle_ns = env_int("TORCH_IPC_IDLE_SECONDS", 60, 0, kMaxIdleSetting) * 1000000000ll;
  const int64_t max_idle = env_int("TORCH_IPC_IDLE_MAPPINGS", 1024, 0, kMaxIdleSetting);
};

// A forked child starts with no hold, mapping or pending release (Note [fork]).
Consumer& consumer() { return *process_state<Consumer>(); }

// Whether processes live, each asked of /proc once per load or collection.
class Liveness {
 public:
  LifeCheck check(const ProcessId& p) {
    auto key = std::make_tuple(p.pid, p.start_time, p.life);
    auto it = known_.find(key);
    if (it == known_.end()) it = known_.emplace(key, check_process(p)).first;
    return it->second;
  }

  // Not proven dead: what closes or frees asks this (Note [unknown is not dead] in os/sweep.cpp).
  bool operator()(const ProcessId& p) { return check(p).life != Life::Dead; }

  // For a load: ProducerGone when `p` has exited, an OsError of what failed
  // when that cannot be checked (a load never says "exited" of a live process).
  void require(const ProcessId& p, const std::string& consequence) {
    const LifeCheck c = check(p);
    if (c.life == Life::Dead) throw producer_gone(p.pid, consequence);
    if (c.life == Life::Unknown && pid_visible(p))
      throw os_error(c.error, "reading /proc/" + std::to_string(p.pid) + "/stat",
                     "(to check that the producer, pid " + std::to_string(p.pid) + ", is alive)");
    if (c.life == Life::Unknown)  // Note [life files] in os/life.h
      throw os_error(c.error, "checking the life file of the producer",
                     "(pid " + std::to_string(p.pid) + " in another PID namespace)",
                     p.life == 0 ? "(it made none: it could not create files in /dev/shm)" : "");
  }

 private:
  std::map<std::tuple<uint32_t, uint64_t, uint32_t>, LifeCheck> known_;
};

// ---------------------------------------------------------------- release

CUevent take_release_event(Consumer& c, int device) {
  for (auto it = c.spare_events.begin(); it != c.spare_events.end(); ++it) {
    if (it->first == device) {
      CUevent e = it->second;
      c.spare_events.erase(it);
      return e;
    }
  }
  CUevent e;
  TORCH_IPC_CU(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
  return e;
}

void finish(Consumer& c, PendingRelease& p) {
  for (auto& de : p.done) c.spare_events.push_back(de);
  lease_unhold(p.lease);
  --c.holds;
}

// Whether the GPU work a release waits for has finished. A driver error (a
// sticky error kills the context, and its work with it) is reported and
// counts as finished: nothing will ever complete that event.
bool release_ready(const PendingRelease& p) {
  for (const auto& [device, e] : p.done) {
    CUresult r = driver().cuEventQuery(e);
    if (r == CUDA_ERROR_NOT_READY) return false;
    if (r != CUDA_SUCCESS)
      TORCH_WARN("torch_ipc: releasing a hold although ", driver_error_message("cuEventQuery", r), " for its GPU work");
  }
  return true;
}

// ---------------------------------------------------------------- mapping

std::shared_ptr<Mapping> open_mapping(const Allocation& where, const ProcessId& owner) {
  auto m = std::make_shared<Mapping>();
  m->where = where;
  m->producer = owner;
  m->kind = &memory_kind(where.kind);
  m->memory = m->kind->open(where, owner);
  return m;
}

// Under c.mu.
std::shared_ptr<Mapping> get_mapping(Consumer& c, const Allocation& where, const ProcessId& owner) {
  MappingKey key{static_cast<uint8_t>(where.kind), where.handle};
  auto it = c.mappings.find(key);
  if (it != c.mappings.end() && it->second->where.size >= where.size && it->second->where.device == where.device) {
    it->second->idle_since_ns = 0;
    return it->second;
  }
  auto m = open_mapping(where, owner);
  c.mappings[key] = m;
  return m;
}

// ---------------------------------------------------------------- the steps of a load

// "CPU tensors", "CUDA tensors" or both, as the descriptor's header says.
std::string tensor_kinds(const Descriptor& d) {
  const bool cuda = d.flags & kHasCuda, cpu = d.flags & kHasCpu;
  return cuda && cpu ? "CPU and CUDA tensors" : cuda ? "CUDA tensors" : cpu ? "CPU tensors" : "tensors";
}

// Step 1: a descriptor of this machine's boot whose producer lives, and
// nothing in it that can be refused without asking its producer.
Descriptor decode_and_check(std::string_view data, Liveness& alive, const std::function<void()>& before_cuda) {
  Descriptor d = decode(data.data(), data.size());
  if (d.boot_id != boot_id())
    throw DescriptorError(
        "torch_ipc descriptor comes from another machine or from before this machine's last "
        "boot; handles are valid only on the machine and boot that made them");
  if ((d.flags & kHasCuda) && before_cuda) before_cuda();
  if (d.producer != self_process())
    alive.require(d.producer, "the " + tensor_kinds(d) +
                                  " it shared can no longer be loaded; export them again from a "
                                  "running process");
  for (const AllocRecord& a : d.allocs)  // a handle that could never be opened: refused before anything is taken
    if (auto check = memory_kind(a.kind).check_handle) check(a.handle);
  return d;
}

std::vector<int> local_devices(const Descriptor& d) {
  std::vector<int> local(d.devices.size());
  for (size_t i = 0; i < d.devices.size(); ++i) local[i] = device_for_uuid(d.devices[i]);
  return local;
}

// Note [a load spends last]
// A load that fails (a record its producer's memory does not match, an fd
// fetch that timed out, a payload that does not unpickle, Ctrl-C) must leave
// the export as it found it, so that a correct retry succeeds. So a load first
// takes only holds, which its tensors give back when they die, and spends what
// it was given (a token of each lease, a forwarder's pending delivery) last,
// in PendingLoad::commit(), once the tensors are built and Python has
// unpickled the payload. Until then the hold keeps the export from being
// reclaimed, and the unspent token keeps it loadable.

// Note [forwarder cross-check]
// A descriptor names its producer, and a lease of another owner makes it a
// forward (Note [forwarding] in export.cpp). The producer field is only what
// the bytes say: a forged one could name any live process (and have us keep
// a pidfd of it). A real forwarder is in the owner's slot while its message
// can be loaded: it holds the tensors it forwards there, or keeps deliveries
// pending for its consumers. So the producer must be a holder of every lease
// it forwards; one that is not did not send this, or let go of what it sent.
void check_forwarder(const Descriptor& d, const LeaseRecord& l) {
  if (d.producer == self_process() || lease_names_holder(l, d.producer.life)) return;
  throw Released("torch_ipc: the descriptor's producer (pid " + std::to_string(d.producer.pid) +
                 ") holds nothing of the memory of pid " + std::to_string(l.owner.pid) +
                 " that it would forward: it released what it forwarded, or the descriptor is "
                 "not from it");
}

// Step 2: holds, one per lease, before anything is mapped: from here on the
// owners cannot reclaim what we build on. A lease of our own export needs no
// hold (its storages keep it): it is only checked, and left null.
std::vector<std::shared_ptr<Hold>> take_holds(Consumer& c, const Descriptor& d, Liveness& alive,
                                              std::vector<PendingLoad::Spend>& spends) {
  std::vector<std::shared_ptr<Hold>> holds(d.leases.size());
  for (size_t i = 0; i < d.leases.size(); ++i) {
    const LeaseRecord& l = d.leases[i];
    const bool forwarded = l.owner != d.producer;  // Note [forwarding] in export.cpp
    if (l.owner == self_process()) {
      lease_take_token(l, /*take=*/false);
    } else {
      if (forwarded) {
        alive.require(l.owner, "the memory it owned is gone");
        check_forwarder(d, l);
      }
      lease_hold(l, /*take_token=*/false);
      ++c.holds;
      holds[i] = std::make_shared<Hold>();
      holds[i]->lease = l;
    }
    if (!(forwarded && (d.flags & kOpenEnded)))  // open-ended forwarding has no deliveries
      spends.push_back(PendingLoad::Spend{l, forwarded, d.producer.life});
  }
  return holds;
}

// Step 3: order. Torch's current stream waits for the producer's writes.
void wait_for_producer(const Descriptor& d, const std::vector<int>& local) {
  for (const EventRecord& e : d.events)
    wait_export_event(e.handle, local[e.device], d.producer, [](const ProcessId& p) { return process_alive(p); });
}

Allocation allocation_of(const AllocRecord& a, const std::vector<int>& local) {
  return Allocation{a.kind, memory_kind(a.kind).on_gpu ? local[a.device] : -1, a.handle, a.size};
}

// Step 4: map every allocation that is not ours, once per process.
std::vector<std::shared_ptr<Mapping>> map_allocations(Consumer& c, const Descriptor& d, const std::vector<int>& local,
                                                      const std::vector<std::shared_ptr<Hold>>& holds) {
  std::vector<std::shared_ptr<Mapping>> mapped(d.allocs.size());
  std::lock_guard<std::recursive_mutex> lock(c.mu);  // once per load, not per allocation
  for (size_t i = 0; i < d.allocs.size(); ++i) {
    const AllocRecord& a = d.allocs[i];
    if (!holds[a.lease]) continue;  // ours: resolved by storage
    mapped[i] = get_mapping(c, allocation_of(a, local), d.leases[a.lease].owner);
    holds[a.lease]->mappings.push_back(mapped[i]);
  }
  return mapped;
}

c10::Device device_of(const Descriptor& d, const StorageRecord& s, const std::vector<int>& local) {
  uint16_t device = storage_device(d, s);
  if (device == kNone16) return c10::Device(c10::DeviceType::CPU);
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(local[device]));
}

// Step 5: storages on the mapped memory (or our own storages, for a load in
// the process that exported).
std::vector<c10::Storage> build_storages(const Descriptor& d, const std::vector<int>& local,
                                         const std::vector<std::shared_ptr<Hold>>& holds,
                                         const std::vector<std::shared_ptr<Mapping>>& mapped) {
  std::vector<c10::Storage> storages;
  storages.reserve(d.storages.size());
  size_t own_next = 0;  // where our own export's next storage is likely to be
  for (const StorageRecord& s : d.storages) {
    const c10::Device device = device_of(d, s, local);
    if (s.alloc == kNoAlloc) {
      storages.emplace_back(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, device), nullptr, false);
      continue;
    }
    const AllocRecord& a = d.allocs[s.alloc];
    if (!holds[a.lease]) {
      auto own =
          find_exported_storage(d.leases[a.lease], Location{allocation_of(a, local), s.offset}, s.nbytes, own_next);
      if (!own) throw Released("torch_ipc: this export was already released by this process");
      storages.push_back(*own);
      continue;
    }
    const Mapping& m = *mapped[s.alloc];
    c10::DataPtr ptr = imported_data_ptr(m.base() + s.offset, holds[a.lease], &m.where, s.offset, device);
    storages.emplace_back(c10::Storage::use_byte_size_t(), s.nbytes, std::move(ptr), nullptr, false);
  }
  return storages;
}

// Step 6: the tensors, views the decoder already checked against their
// storages (Note [view bounds] in descriptor.cpp).
void build_tensors(const Descriptor& d, const std::vector<c10::Storage>& storages, ImportResult& out) {
  out.tensors.reserve(d.tensors.size());
  out.is_parameter.reserve(d.tensors.size());
  for (const TensorRecord& t : d.tensors) {
    const auto dtype = static_cast<c10::ScalarType>(t.dtype);
    const c10::Storage& storage = storages[t.storage];
    c10::DispatchKeySet keys(storage.device_type() == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA
                                                                            : c10::DispatchKey::CPU);
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), keys, c10::scalarTypeToTypeMeta(dtype));
    try {
      const auto sizes = tensor_sizes(d, t), strides = tensor_strides(d, t);
      impl->set_sizes_and_strides(c10::IntArrayRef(sizes.data(), sizes.size()),
                                  c10::IntArrayRef(strides.data(), strides.size()));
      impl->set_storage_offset(t.storage_offset);
    } catch (const c10::Error& e) {
      throw DescriptorError(std::string("malformed torch_ipc descriptor: ") + e.what_without_backtrace());
    }
    at::Tensor tensor(std::move(impl));
    if (t.flags & kRequiresGrad) tensor.set_requires_grad(true);
    out.tensors.push_back(std::move(tensor));
    out.is_parameter.push_back(t.flags & kParameter);
  }
}

}  // namespace

void imports_forget_after_fork() { forget_after_fork<Consumer>(); }
const AfterForkInChild reset_imports_after_fork(&imports_forget_after_fork);

// Note [deferred release]
// A consumer's tensors may die while GPU work it queued on them still runs:
// releasing the hold at once would let the producer reuse memory the GPU is
// still reading. So the release records an event on torch's current stream
// of each device it used and is finished by collect_imports() once those
// events completed; the host never waits. A stream with nothing left to run
// (cuStreamQuery, host side only: a consumer that synchronized, or read with
// .item()) needs no event: that release is finished at once, which saves the
// record and the later query (~3 us a message on the H100 machine).

Hold::~Hold() {
  if (made.inherited()) {  // the hold is the parent's to release
    new std::vector<std::shared_ptr<Mapping>>(std::move(mappings));
    return;
  }
  Consumer& c = consumer();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  PendingRelease p{lease, {}, std::move(mappings)};
  try {
    for (const auto& m : p.mappings) {
      const int device = m->where.device;
      if (!m->kind->on_gpu) continue;
      if (std::any_of(p.done.begin(), p.done.end(), [&](auto& de) { return de.first == device; })) continue;
      ScopedContext scope(device);
      CUstream stream = current_stream(device);
      if (stream_idle(stream)) continue;  // nothing queued can still read it: release now
      CUevent e = take_release_event(c, device);
      p.done.emplace_back(device, e);
      TORCH_IPC_CU(cuEventRecord, e, stream);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("torch_ipc: could not order a release after GPU work (", e.what(), "); releasing now");
    for (auto& de : p.done) c.spare_events.push_back(de);
    p.done.clear();
  }
  if (p.done.empty()) {
    finish(c, p);
  } else {
    c.pending.push_back(std::move(p));
  }
}

ImportResult import_tensors(std::string_view data, const std::function<void()>& before_cuda) {
  Consumer& c = consumer();
  Liveness alive;
  Descriptor d = decode_and_check(data, alive, before_cuda);
  const std::vector<int> local = local_devices(d);
  std::vector<PendingLoad::Spend> spends;
  std::vector<std::shared_ptr<Hold>> holds = take_holds(c, d, alive, spends);
  wait_for_producer(d, local);
  std::vector<std::shared_ptr<Mapping>> mapped = map_allocations(c, d, local, holds);
  std::vector<c10::Storage> storages = build_storages(d, local, holds, mapped);
  holds.clear();  // now owned by the storages alone
  ImportResult out;
  out.payload = std::move(d.payload);
  build_tensors(d, storages, out);
  out.pending = std::make_shared<PendingLoad>(std::move(spends));
  return out;
}

void PendingLoad::commit() {
  if (committed_.exchange(true)) return;
  for (const Spend& s : spends_) {
    if (s.forwarded) {
      lease_remove_deliveries(s.lease, s.forwarder_key, 1);
      continue;
    }
    try {
      lease_take_token(s.lease);
    } catch (const Released&) {
      // Our own export, reclaimed since the load checked it: its storages,
      // which the tensors keep, are all the load needs.
    }
  }
}

void collect_imports(bool close_idle) {
  Consumer& c = consumer();
  std::vector<std::shared_ptr<Mapping>> closing;  // closed after the lock
  Liveness alive;
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  for (size_t i = 0; i < c.pending.size();) {
    if (release_ready(c.pending[i])) {
      finish(c, c.pending[i]);
      closing.insert(closing.end(), c.pending[i].mappings.begin(), c.pending[i].mappings.end());
      c.pending.erase(c.pending.begin() + i);
    } else {
      ++i;
    }
  }
  int64_t now = steady_now_ns();
  std::vector<std::pair<int64_t, decltype(c.mappings)::iterator>> idle;
  for (auto it = c.mappings.begin(); it != c.mappings.end();) {
    Mapping& m = *it->second;
    if (it->second.use_count() > 1) {
      m.idle_since_ns = 0;
      ++it;
    } else if (!m.kind->stays_open_idle) {
      // Closed at once, and not counted against TORCH_IPC_IDLE_MAPPINGS,
      // which bounds the ones that stay.
      closing.push_back(std::move(it->second));
      it = c.mappings.erase(it);
    } else {
      if (m.idle_since_ns == 0) m.idle_since_ns = now;
      idle.emplace_back(m.idle_since_ns, it++);
    }
  }
  std::sort(idle.begin(), idle.end(), [](auto& a, auto& b) { return a.first < b.first; });
  int64_t over = static_cast<int64_t>(idle.size()) - c.max_idle;
  for (auto& [since, it] : idle) {
    bool close = close_idle || over-- > 0 || now - since > c.idle_ns || !alive(it->second->producer);
    if (close) {
      closing.push_back(std::move(it->second));
      c.mappings.erase(it);
    }
  }
  lease_drop_dead_segments();
  close_events_of_dead([&](const ProcessId& p) { return alive(p); });
}

void flush_imports() {
  Consumer& c = consumer();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  for (auto& p : c.pending) {
    for (auto& [device, e] : p.done) {
      CUresult r = driver().cuEventSynchronize(e);
      if (r != CUDA_SUCCESS)  // released either way: at exit nothing else will
        TORCH_WARN("torch_ipc: at exit, ", driver_error_message("cuEventSynchronize", r));
    }
    finish(c, p);
  }
  c.pending.clear();
}

IdlePolicy idle_policy() {
  const Consumer& c = consumer();
  return IdlePolicy{c.idle_ns, c.max_idle};
}

ImportStats import_stats() {
  Consumer& c = consumer();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  ImportStats s{};
  s.holds = c.holds.load();
  s.pending_releases = static_cast<int64_t>(c.pending.size());
  s.mappings_open = static_cast<int64_t>(c.mappings.size());
  for (auto& [k, m] : c.mappings) s.mappings_idle += m.use_count() == 1;
  s.events_open = events_open();
  return s;
}

}  // namespace torch_ipc
