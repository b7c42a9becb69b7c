// Producer side: where this process's own storages live (a cudaMalloc segment,
// VMM chunks, or host shared memory), looked up once and cached per storage.
#pragma once

#include <c10/core/Storage.h>

#include <vector>

#include "memory/location.h"

namespace torch_ipc {

// Where each of `storages` (own, non-empty, CUDA or CPU) lives, in order.
// CUDA storages the cache does not know are located together, VMM ones per
// device (Note [VMM runs per message]); CPU storages are moved into shared
// memory on first use (as share_memory_() does).
std::vector<Location> locate_own(const std::vector<c10::Storage>& storages);

// Forget the cached locations of storages that died.
void forget_dead_locations();

}  // namespace torch_ipc
