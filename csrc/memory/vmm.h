// VMM sharing, one header for its users: the handle field codec, the producer and
// consumer sides, SharedPool, and the statistics summed over them (vmm.cpp).
#pragma once

#include <cstdint>

#include "wire/vmm_handle.h"

#include "memory/shared_pool.h"
#include "memory/vmm_export.h"
#include "memory/vmm_import.h"

namespace torch_ipc {

struct VmmStats {
  int64_t export_groups;    // distinct chunk runs published by this process
  int64_t exported_chunks;  // physical allocations with an open shareable handle
  int64_t exported_bytes;
  int64_t pool_allocations, pool_bytes;  // live SharedPool allocations
  int64_t mappings, mapped_bytes;        // live imported VMM mappings
};
VmmStats vmm_stats();

}  // namespace torch_ipc
