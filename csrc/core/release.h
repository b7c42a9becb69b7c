// The holds a consumer takes on producers' leases, and their deferred release:
// a hold whose tensors died is released once the GPU work queued on its
// memory has finished (Note [deferred release] in release.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "wire/descriptor.h"

#include "os/process.h"

namespace torch_ipc {

struct Mapping;  // core/mapping_cache.h

// The hold one import took on one lease, and the mappings its storages use.
// Dropped when the last storage built by that import dies; the lease is then
// released once the GPU work queued on the memory has finished.
struct Hold {
  LeaseRecord lease;
  std::vector<std::shared_ptr<Mapping>> mappings;
  MadeHere made;  // a forked child leaves its parent's holds alone
  ~Hold();
};

// Hold `lease` at its owner (no token taken: Note [a load spends last] in import.cpp).
std::shared_ptr<Hold> take_hold(const LeaseRecord& lease);

// Finish the releases whose GPU work is done, moving their mappings into
// `closing` (the caller drops them after the lock).
void finish_ready_releases(std::vector<std::shared_ptr<Mapping>>& closing);
// Wait for every deferred release and finish it (at exit).
void flush_releases();

struct ReleaseStats {
  int64_t holds, pending;
};
ReleaseStats release_stats();

}  // namespace torch_ipc
