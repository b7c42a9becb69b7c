// The consumer's opened allocations: each allocation of another process is
// opened once per process (by its kind's table, memory/memory_kind.h) and
// stays open, idle, after its last tensor died as its kind and the idle
// policy say (Note [idle mappings] in mapping_cache.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "base/ids.h"

#include "memory/location.h"
#include "memory/memory_kind.h"

namespace torch_ipc {

// One allocation of another process, opened in this one; closed (or unmapped)
// when the last user lets go: the cache, and the holds of the loads built on it.
struct Mapping {
  Allocation where;
  ProcessId producer;
  const MemoryKind* kind = nullptr;
  std::unique_ptr<OpenedMemory> memory;
  int64_t idle_since_ns = 0;  // set by drop_idle_mappings() when no tensor uses it
  char* base() const { return memory->base; }
};

// Held while a load gets its mappings: once per load, not per allocation.
std::unique_lock<std::recursive_mutex> lock_mappings();
// Under lock_mappings(): the mapping of `where`, exported by `owner`, opened
// now unless it is open already.
std::shared_ptr<Mapping> get_mapping(const Allocation& where, const ProcessId& owner);

// Move the mappings no tensor uses that must close into `closing` (the caller
// drops them after the lock): those of kinds that do not stay open idle, and
// idle ones past the policy, of producers `alive` does not vouch for, or all
// of them when close_idle.
void drop_idle_mappings(bool close_idle, const std::function<bool(const ProcessId&)>& alive,
                        std::vector<std::shared_ptr<Mapping>>& closing);

// How long a mapping stays open idle, and how many may (Note [idle mappings]),
// as read from TORCH_IPC_IDLE_SECONDS and TORCH_IPC_IDLE_MAPPINGS.
struct IdlePolicy {
  int64_t idle_ns, max_idle;
};
IdlePolicy idle_policy();

struct MappingStats {
  int64_t open, idle;
};
MappingStats mapping_stats();

}  // namespace torch_ipc
