// Producer side: where this process's own storages live (a cudaMalloc segment,
// VMM chunks, or host shared memory), looked up once and cached per storage.
#pragma once

#include <functional>
#include <vector>

#include <c10/core/Storage.h>

#include "memory/location.h"

namespace torch_ipc {

// Where each of `storages` (own, non-empty, CUDA or CPU) lives, in order.
// CUDA storages the cache does not know are located together, VMM ones per
// device (Note [VMM runs per message]); CPU storages are moved into shared
// memory on first use (as share_memory_() does).
// By reference: copying a c10::Storage costs a reference count (and a trip
// into Python for one that has a Python object).
using StorageRefs = std::vector<std::reference_wrapper<const c10::Storage>>;
std::vector<Location> locate_own(const StorageRefs& storages);

// Forget the cached locations of storages that died.
void forget_dead_locations();

}  // namespace torch_ipc
