// VMM producer side: finds the physical allocations under storages, exports them
// once (the export cache), publishes their runs for consumers, and drops dead runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda.h>
#include <vector>

#include <c10/core/Storage.h>

#include "memory/location.h"
#include "memory/vmm_mapping.h"

namespace torch_ipc {

// Export the physical allocations under `storages` (all with data on CUDA
// device `device`, the current context), one location per storage: a CudaVmm
// allocation whose handle is the 64-byte VMM handle field (Note [VMM handle
// field] in vmm_handle.h) and whose size is the bytes of the physical
// allocations the storage spans, and its offset in the first of them. Storages
// whose chunks touch or adjoin share one run (Note [VMM runs per message] in
// locate.cpp); a SharedPool storage is always a run of its own. Cached for as
// long as a storage of the run lives; throws InvalidUse (RuntimeError) that
// says why when the memory is not VMM memory or was created without a
// shareable handle type, CudaError when the driver refuses an export.
std::vector<Location> locate_vmm(const std::vector<c10::Storage>& storages, int device);

// Drop the exports of storages that died: unpublish them, close their fds,
// release the retained handles. Returns how many groups were dropped.
int vmm_collect();

struct VmmExportStats {
  int64_t groups = 0;  // distinct chunk runs published by this process
  int64_t chunks = 0;  // physical allocations with an open shareable handle
  int64_t bytes = 0;
};
VmmExportStats vmm_export_stats();

}  // namespace torch_ipc
