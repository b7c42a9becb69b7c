// Lease counters in shared host memory: how a producer learns that every
// consumer of an export has released it, or died holding it.
#pragma once

#include <cstdint>

#include "wire/descriptor.h"

namespace torch_ipc {

// Note [leases]
// Every export owns one slot in a shared-memory segment of its producer:
//   generation  which export lives in the slot (0: free or being reclaimed)
//   tokens      loads still expected (the `consumers` of dumps)
//   holders[]   one word per consumer process: (life key << 32) | number of
//               holds (Note [life files] in life.h: a pid of another PID
//               namespace would name nothing here, or another process)
// A load registers a hold under its pid FIRST, then checks the generation,
// then takes a token if one is left. The producer reclaims only when no token
// is left and no living process holds: it zeroes the generation, looks at the
// holders again and restores the generation if it finds one. With sequentially
// consistent atomics one of the two sees the other, so an export is never
// reclaimed under a consumer that got through its check. A consumer killed
// while holding leaves its word behind; the producer sees its life file unlocked.
// A hold is always released by the process that took it, after its GPU work
// on the memory has finished (core/release.cpp).
//
// Note [holder limit]
// A slot is one 128-byte line, with room for kHoldersPerSlot holder words: one
// per process holding the export, one per forwarder with deliveries pending.
// A holder that died leaves its word behind; such words are cleared when the
// producer collects (tokens left or not) and by a load that finds no free
// word, so dead consumers never use up an export. So at most 14 LIVING
// processes hold one export at once; a 15th load raises
// torch_ipc.HolderLimitError (a RuntimeError) that says so. Export once per
// group of consumers instead, or have some release first.
constexpr int kHoldersPerSlot = 14;
constexpr uint32_t kSlotsPerSegment = 4096;

struct LeaseCounts {
  uint32_t tokens = 0;
  uint32_t holders = 0;  // processes holding, dead ones included
  uint32_t dead_holders = 0;
};

// Producer side.
LeaseRecord lease_acquire(uint32_t tokens);
// Reclaim if no token is left and no living process holds; true when reclaimed.
// Clears the words of dead holders either way (Note [holder limit]).
bool lease_try_reclaim(const LeaseRecord& lease);
void lease_revoke_tokens(const LeaseRecord& lease);
// Revoke: no load may start from now on, and no token is left (Note [revoked
// exports] in refcount.cpp). Loads already made keep their holds.
void lease_forbid_loads(const LeaseRecord& lease);
LeaseCounts lease_counts(const LeaseRecord& lease);

// An export() that failed after acquiring gives its slot back.
void lease_abandon(const LeaseRecord& lease) noexcept;

// Consumer side (any process, the owner included). Throws Released when the
// export was reclaimed, ProducerGone when its producer exited and its segment
// is gone, HolderLimit past Note [holder limit]. A load of a
// forwarded descriptor takes no token (Note [forwarding] in export.cpp).
void lease_hold(const LeaseRecord& lease, bool take_token);
void lease_unhold(const LeaseRecord& lease) noexcept;
// Forwarding: the forwarder holds n pending deliveries for the consumers it
// sends to; each consumer, once it holds on its own, removes one of them
// (forwarder_key: the life key of the descriptor's producer), and the
// forwarder removes those nobody will load (itself).
void lease_add_deliveries(const LeaseRecord& lease, uint32_t n);
void lease_remove_deliveries(const LeaseRecord& lease, uint32_t forwarder_key, uint32_t n) noexcept;
// Whether the process of life key `key` holds at the lease's slot or has deliveries pending there, as
// a forwarder of it does (Note [forwarder cross-check] in core/import.cpp).
// Throws Released when the export was reclaimed.
bool lease_names_holder(const LeaseRecord& lease, uint32_t key);
// A load in the owner process itself: check the export lives and take one
// token (if `take` and one is left), without holding.
void lease_take_token(const LeaseRecord& lease, bool take = true);

// Note [liveness per cycle]
// Whether a holder lives is a look at its life file (a few us).
// A collection looks at every held export, and the same few consumers hold
// most of them: while a HolderLivenessCycle lives in a thread, each holder is
// asked once and the answer reused, so a collection costs one check per
// consumer process, not one per holder word.
class HolderLivenessCycle {
 public:
  HolderLivenessCycle();
  ~HolderLivenessCycle();
  HolderLivenessCycle(const HolderLivenessCycle&) = delete;
  HolderLivenessCycle& operator=(const HolderLivenessCycle&) = delete;

 private:
  bool outermost_;
};

// Unlink this process's segments (at exit); mappings stay valid.
void lease_unlink_own_segments();
// Unmap the lease segments of producers that have exited.
void lease_drop_dead_segments();
int lease_segment_count();
// The id of this process's first lease segment (made now if there is none):
// the anchor its host segments name (Note [sweep] in sweep.h).
uint32_t lease_anchor_segment();

}  // namespace torch_ipc
