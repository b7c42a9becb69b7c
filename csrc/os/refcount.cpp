#include "os/refcount.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <c10/util/Exception.h>

#include "base/errors.h"
#include "base/fork.h"

#include "os/names.h"
#include "os/process.h"
#include "os/shm.h"
#include "os/sweep.h"

namespace torch_ipc {
namespace {

struct alignas(128) Slot {
  std::atomic<uint64_t> generation;
  std::atomic<uint32_t> tokens;
  std::atomic<uint32_t> flags;  // kLoadsForbidden

  std::atomic<uint64_t> holders[kHoldersPerSlot];
};
// Note [revoked exports]
// The producer's revoke() (torch_ipc.Export.revoke) forbids loads from then on:
// a load registers its hold, then finds the flag and gives up, as it does for
// a changed generation. Loads that got through before keep their holds. The
// flag word also keeps the low 31 bits of the revoked export's generation, and
// keeps them after the slot is reclaimed, until the slot is handed to another
// export: a load that comes late then says that the export was revoked, not
// that its consumers released it.
constexpr uint32_t kLoadsForbidden = 1;
uint32_t revoked_flags(uint64_t generation) { return kLoadsForbidden | (static_cast<uint32_t>(generation) << 1); }
static_assert(sizeof(Slot) == 128, "slot layout is part of the protocol");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need address-free atomics");

constexpr size_t kSegmentBytes = sizeof(Slot) * kSlotsPerSegment;

uint64_t holder_word(uint32_t key, uint32_t count) { return (uint64_t(key) << 32) | count; }
uint32_t holder_key(uint64_t w) { return static_cast<uint32_t>(w >> 32); }
// A forwarder's pending deliveries live in a word of their own, marked by this
// bit, so that a consumer moving one to itself never takes the forwarder's own
// holds (a descriptor loaded more often than it was meant to be).
constexpr uint32_t kDeliveryBit = 0x80000000u;

// The answers of the HolderLivenessCycle of this thread, if one is open.
thread_local std::unordered_map<uint32_t, bool>* cycle_answers = nullptr;

bool holder_alive(uint64_t w) {
  const uint32_t key = holder_key(w) & ~kDeliveryBit;
  if (cycle_answers == nullptr) return life_key_alive(key);
  auto [it, inserted] = cycle_answers->emplace(key, false);
  if (inserted) it->second = life_key_alive(key);
  return it->second;
}

// This process's life key, the name of its holder words: Note [life files].
// Without one no hold can be taken: a word that named nothing would look dead
// and be reclaimed under this process.
uint32_t own_holder_key() {
  const uint32_t key = self_process().life;
  if (key == 0)
    throw os_error(life_file_error(), "creating", "this process's life file in /dev/shm",
                   "(a holder is named by it: Note [life files])");
  return key;
}
uint32_t holder_count(uint64_t w) { return static_cast<uint32_t>(w); }

class Leases {
 public:
  // A forked child starts with no segment (the parent's stay linked: Note [fork]).
  static Leases& get() { return *process_state<Leases>(); }

  LeaseRecord acquire(uint32_t tokens) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) grow();
    auto [segment, slot_index] = free_.back();
    free_.pop_back();
    Slot* s = slot_in(own_.at(segment).get(), slot_index);
    for (auto& h : s->holders) h.store(0);
    s->tokens.store(tokens);
    s->flags.store(0);
    uint64_t generation = ++next_generation_;
    s->generation.store(generation);
    return LeaseRecord{self_process(), segment, slot_index, generation};
  }

  // Under the mutex, so that the slot cannot be reclaimed and handed to
  // another export between the generation check and the flag.
  void forbid_loads(const LeaseRecord& lease) {
    Slot* s = slot(lease);
    std::lock_guard<std::mutex> lock(mu_);
    if (s->generation.load() != lease.generation) return;
    s->flags.store(revoked_flags(lease.generation));
    s->tokens.store(0);
  }

  void release_slot(const LeaseRecord& lease) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace_back(lease.segment, lease.slot);
  }

  Slot* slot(const LeaseRecord& lease) {
    if (lease.slot >= kSlotsPerSegment)
      throw DescriptorError("malformed torch_ipc descriptor: lease slot out of range");
    std::lock_guard<std::mutex> lock(mu_);
    if (lease.owner == self_process()) {
      auto it = own_.find(lease.segment);
      if (it == own_.end())
        throw DescriptorError("malformed torch_ipc descriptor: this process has no lease segment " +
                              std::to_string(lease.segment));
      return slot_in(it->second.get(), lease.slot);
    }
    // The life key too: a descriptor that names another one for this segment
    // gets a mapping of its own, judged by what it said.
    auto key = std::make_tuple(lease.owner.pid, lease.owner.start_time, lease.owner.life, lease.segment);
    auto it = foreign_.find(key);
    if (it == foreign_.end()) {
      const std::string name = lease_segment_name(lease.owner, lease.segment);
      auto mapping = ShmMapping::open(name, kSegmentBytes, lease.owner);
      if (!mapping) {
        if (!process_alive(lease.owner)) throw producer_gone(lease.owner.pid, "its lease segment is gone");
        // A living producer unlinks its segments only as it exits.
        throw Released("torch_ipc: the producer (pid " + std::to_string(lease.owner.pid) +
                       ") no longer shares lease segment " + name +
                       " (it is exiting, or the descriptor is not from it)");
      }
      it = foreign_.emplace(key, Foreign{lease.owner, std::move(mapping)}).first;
    }
    return slot_in(it->second.mapping.get(), lease.slot);
  }

  // Unmap the segments of producers that exited: nobody reads their counters
  // any more (a late release finds the name gone and gives up quietly).
  void drop_dead_foreign() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = foreign_.begin(); it != foreign_.end();) {
      // The whole identity: a pid of another PID namespace says nothing here.
      if (process_alive(it->second.owner)) {
        ++it;
      } else {
        it = foreign_.erase(it);
      }
    }
  }

  void unlink_own() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [n, m] : own_) m->unlink();
  }

  int count() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(own_.size() + foreign_.size());
  }

  uint32_t anchor() {
    std::lock_guard<std::mutex> lock(mu_);
    if (own_.empty()) grow();
    return anchor_;
  }

  // In a forked child, before anything else runs: the child's copies of the
  // parent's anchors must not keep the parent's OFD locks alive (Note
  // [sweep]); read only if no parent's thread held the mutex at the fork
  // (Note [reading the parent's state after fork] in fork.h).
  void disown_after_fork() {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return;
    for (auto& [n, m] : own_) m->disown();
  }

 private:
  static Slot* slot_in(ShmMapping* m, uint32_t index) { return static_cast<Slot*>(m->data()) + index; }

  // Each segment has a random id (Note [names]) and is an anchor (Note [sweep]).
  void grow() {
    if (own_.empty()) sweep_stale_shm();
    uint32_t segment = 0;
    auto mapping = create_under_random_name("a lease segment", [&](uint64_t r) {
      segment = static_cast<uint32_t>(r);
      return own_.count(segment) ? nullptr
                                 : ShmMapping::create(lease_segment_name(self_process(), segment), kSegmentBytes,
                                                      self_process(), /*anchor=*/true);
    });
    for (uint32_t i = kSlotsPerSegment; i-- > 0;) free_.emplace_back(segment, i);
    if (own_.empty()) anchor_ = segment;
    own_.emplace(segment, std::move(mapping));
  }

  std::mutex mu_;
  std::map<uint32_t, std::unique_ptr<ShmMapping>> own_;
  struct Foreign {
    ProcessId owner;  // as the descriptors that name it say
    std::unique_ptr<ShmMapping> mapping;
  };
  std::map<std::tuple<uint32_t, uint64_t, uint32_t, uint32_t>, Foreign> foreign_;
  std::vector<std::pair<uint32_t, uint32_t>> free_;
  uint64_t next_generation_ = 0;
  uint32_t anchor_ = 0;  // the first own segment: the anchor of host segments
};

// Add n holds for `pid` to an existing word of it, or to a free one; false
// when all holder words are taken.
bool add_to_holder_words(Slot* s, uint32_t key, uint32_t n) {
  for (auto& h : s->holders) {
    uint64_t w = h.load();
    while (w != 0 && holder_key(w) == key) {
      if (h.compare_exchange_weak(w, w + n)) return true;
    }
  }
  for (auto& h : s->holders) {
    uint64_t expected = 0;
    if (h.compare_exchange_strong(expected, holder_word(key, n))) return true;
  }
  return false;
}

// Clear the words of holders that died; true when one was cleared.
bool clear_dead_holders(Slot* s) {
  bool cleared = false;
  for (auto& h : s->holders) {
    uint64_t w = h.load();
    if (w != 0 && !holder_alive(w) && h.compare_exchange_strong(w, 0)) cleared = true;
  }
  return cleared;
}

// Add n holds for `key`; false when all holder words are taken by living
// holders (Note [holder limit]).
bool add_holder(Slot* s, uint32_t key, uint32_t n = 1) {
  if (add_to_holder_words(s, key, n)) return true;
  return clear_dead_holders(s) && add_to_holder_words(s, key, n);
}

// Remove up to n holds of `key`; returns how many were there to remove.
uint32_t remove_holder(Slot* s, uint32_t key, uint32_t n = 1) {
  for (auto& h : s->holders) {
    uint64_t w = h.load();
    while (w != 0 && holder_key(w) == key) {
      uint32_t take = std::min(n, holder_count(w));
      uint64_t next = holder_count(w) <= take ? 0 : w - take;
      if (h.compare_exchange_weak(w, next)) return take;
    }
  }
  return 0;
}

// True when some living process holds; clears the words of dead holders.
bool has_living_holder(Slot* s) {
  bool living = false;
  for (auto& h : s->holders) {
    uint64_t w = h.load();
    if (w == 0) continue;
    if (holder_alive(w)) {
      living = true;
    } else {
      h.compare_exchange_strong(w, 0);
    }
  }
  return living;
}

[[noreturn]] void throw_revoked(const LeaseRecord& lease) {
  throw Released("torch_ipc: this export was revoked by its producer (pid " + std::to_string(lease.owner.pid) +
                 "): it can no longer be loaded");
}

[[noreturn]] void throw_released_by_consumers(const LeaseRecord& lease) {
  throw Released("torch_ipc: this export was already released by its producer (pid " + std::to_string(lease.owner.pid) +
                 "): every consumer it was sent to has loaded and released it. "
                 "Pass consumers=N to dumps() to share one descriptor with N loads, or "
                 "consumers=None for any number of loads while the producer keeps the tensors.");
}

// The export of `lease` is gone from its slot: revoked (Note [revoked
// exports]) or released by its consumers; say which.
[[noreturn]] void throw_released(const Slot* s, const LeaseRecord& lease) {
  if (s->flags.load() == revoked_flags(lease.generation)) throw_revoked(lease);
  throw_released_by_consumers(lease);
}

// Register n holds under `holder` (a life key, or a forwarder's delivery word),
// then check the export still lives: the consumer's half of Note [leases].
void hold_as(Slot* s, const LeaseRecord& lease, uint32_t holder, uint32_t n) {
  if (!add_holder(s, holder, n))  // Note [holder limit] in refcount.h
    throw HolderLimit("torch_ipc: this export already has " + std::to_string(kHoldersPerSlot) +
                      " holders, the most one export can have at once (a holder is a living "
                      "process that loaded it and holds it, or a forwarder with deliveries "
                      "pending). Export once per group of at most " +
                      std::to_string(kHoldersPerSlot) +
                      " consumers (a dumps() call each), or have consumers release what they "
                      "loaded before more load it.");
  if (s->generation.load() != lease.generation) {
    remove_holder(s, holder, n);
    throw_released(s, lease);
  }
  if (s->flags.load() & kLoadsForbidden) {  // Note [revoked exports]
    remove_holder(s, holder, n);
    throw_revoked(lease);
  }
}

// One of the loads the producer expects has happened (none left: an extra load).
void take_one_token(Slot* s) {
  uint32_t t = s->tokens.load();
  while (t > 0 && !s->tokens.compare_exchange_weak(t, t - 1)) {
  }
}

}  // namespace

LeaseRecord lease_acquire(uint32_t tokens) { return Leases::get().acquire(tokens); }

bool lease_try_reclaim(const LeaseRecord& lease) {
  Slot* s = Leases::get().slot(lease);
  if (s->generation.load() != lease.generation) return false;  // reclaimed already
  const bool living = has_living_holder(s);                    // clears dead words, tokens left or not
  if (s->tokens.load() != 0 || living) return false;
  uint64_t expected = lease.generation;
  if (!s->generation.compare_exchange_strong(expected, 0)) return false;
  if (s->tokens.load() != 0 || has_living_holder(s)) {
    s->generation.store(lease.generation);  // a load got in: it keeps the export
    return false;
  }
  Leases::get().release_slot(lease);
  return true;
}

void lease_forbid_loads(const LeaseRecord& lease) { Leases::get().forbid_loads(lease); }

void lease_revoke_tokens(const LeaseRecord& lease) {
  Slot* s = Leases::get().slot(lease);
  if (s->generation.load() == lease.generation) s->tokens.store(0);
}

LeaseCounts lease_counts(const LeaseRecord& lease) {
  Slot* s = Leases::get().slot(lease);
  LeaseCounts c;
  if (s->generation.load() != lease.generation) return c;
  c.tokens = s->tokens.load();
  for (auto& h : s->holders) {
    uint64_t w = h.load();
    if (w == 0) continue;
    ++c.holders;
    if (!holder_alive(w)) ++c.dead_holders;
  }
  return c;
}

void lease_hold(const LeaseRecord& lease, bool take_token) {
  Slot* s = Leases::get().slot(lease);
  hold_as(s, lease, own_holder_key(), 1);
  if (take_token) take_one_token(s);
}

void lease_unhold(const LeaseRecord& lease) noexcept {
  try {
    remove_holder(Leases::get().slot(lease), self_process().life);
  } catch (...) {
    // The owner's segment is gone: nobody is left to tell.
  }
}

void lease_add_deliveries(const LeaseRecord& lease, uint32_t n) {
  hold_as(Leases::get().slot(lease), lease, own_holder_key() | kDeliveryBit, n);
}

void lease_remove_deliveries(const LeaseRecord& lease, uint32_t forwarder_key, uint32_t n) noexcept {
  try {
    remove_holder(Leases::get().slot(lease), forwarder_key | kDeliveryBit, n);
  } catch (...) {
  }
}

void lease_abandon(const LeaseRecord& lease) noexcept {
  try {
    Slot* s = Leases::get().slot(lease);
    s->tokens.store(0);
    s->generation.store(0);
    Leases::get().release_slot(lease);
  } catch (...) {
  }
}

bool lease_names_holder(const LeaseRecord& lease, uint32_t key) {
  Slot* s = Leases::get().slot(lease);
  if (s->generation.load() != lease.generation) throw_released(s, lease);
  for (auto& h : s->holders) {
    const uint64_t w = h.load();
    if (key != 0 && w != 0 && (holder_key(w) & ~kDeliveryBit) == key) return true;
  }
  return false;
}

void lease_take_token(const LeaseRecord& lease, bool take) {
  Slot* s = Leases::get().slot(lease);
  if (s->generation.load() != lease.generation) throw_released(s, lease);
  if (s->flags.load() & kLoadsForbidden) throw_revoked(lease);
  if (take) take_one_token(s);
}

void leases_forget_after_fork() {
  Leases::get().disown_after_fork();
  forget_after_fork<Leases>();
}
const AfterForkInChild reset_leases_after_fork(&leases_forget_after_fork);

HolderLivenessCycle::HolderLivenessCycle() : outermost_(cycle_answers == nullptr) {
  if (outermost_) cycle_answers = new std::unordered_map<uint32_t, bool>();
}

HolderLivenessCycle::~HolderLivenessCycle() {
  if (!outermost_) return;
  delete cycle_answers;
  cycle_answers = nullptr;
}

void lease_unlink_own_segments() { Leases::get().unlink_own(); }
void lease_drop_dead_segments() { Leases::get().drop_dead_foreign(); }
int lease_segment_count() { return Leases::get().count(); }
uint32_t lease_anchor_segment() { return Leases::get().anchor(); }

}  // namespace torch_ipc
