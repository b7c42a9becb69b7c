#include "core/import.h"

#include <functional>
#include <map>
#include <tuple>

#include <c10/core/ScalarType.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

#include "base/errors.h"

#include "os/process.h"
#include "os/refcount.h"

#include "cuda/cuda_context.h"
#include "cuda/events.h"

#include "memory/memory_kind.h"

#include "core/mapping_cache.h"
#include "core/registry.h"
#include "core/release.h"

namespace torch_ipc {

namespace {

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
std::vector<std::shared_ptr<Hold>> take_holds(const Descriptor& d, Liveness& alive,
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
      holds[i] = take_hold(l);
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
std::vector<std::shared_ptr<Mapping>> map_allocations(const Descriptor& d, const std::vector<int>& local,
                                                      const std::vector<std::shared_ptr<Hold>>& holds) {
  std::vector<std::shared_ptr<Mapping>> mapped(d.allocs.size());
  auto lock = lock_mappings();  // once per load, not per allocation
  for (size_t i = 0; i < d.allocs.size(); ++i) {
    const AllocRecord& a = d.allocs[i];
    if (!holds[a.lease]) continue;  // ours: resolved by storage
    mapped[i] = get_mapping(allocation_of(a, local), d.leases[a.lease].owner);
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

ImportResult import_tensors(std::string_view data, const std::function<void()>& before_cuda) {
  Liveness alive;
  Descriptor d = decode_and_check(data, alive, before_cuda);
  const std::vector<int> local = local_devices(d);
  std::vector<PendingLoad::Spend> spends;
  std::vector<std::shared_ptr<Hold>> holds = take_holds(d, alive, spends);
  wait_for_producer(d, local);
  std::vector<std::shared_ptr<Mapping>> mapped = map_allocations(d, local, holds);
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
  std::vector<std::shared_ptr<Mapping>> closing;  // closed last, outside the locks
  Liveness alive;
  finish_ready_releases(closing);
  drop_idle_mappings(close_idle, [&](const ProcessId& p) { return alive(p); }, closing);
  lease_drop_dead_segments();
  close_events_of_dead([&](const ProcessId& p) { return alive(p); });
}

void flush_imports() { flush_releases(); }

ImportStats import_stats() {
  ImportStats s{};
  const ReleaseStats r = release_stats();
  const MappingStats m = mapping_stats();
  s.holds = r.holds;
  s.pending_releases = r.pending;
  s.mappings_open = m.open;
  s.mappings_idle = m.idle;
  s.events_open = events_open();
  return s;
}

}  // namespace torch_ipc
