// What the collector thread and interpreter exit run: reclaim, release, sweep.
#pragma once

#include <ATen/core/Tensor.h>

namespace torch_ipc {

// Reclaim exports every consumer released (or died holding), finish deferred
// releases, close idle mappings (all of them with close_idle). One at a time
// (Note [collect without the GIL]). Returns how many exports were reclaimed.
int collect(bool close_idle);

// At interpreter exit: release what this process holds, reclaim what it can,
// and remove the names of its own segments (mappings stay valid).
void shutdown();

// Remove stale files of dead torch_ipc processes (Note [sweep] in os/sweep.h)
// and forget the identities of exited processes. Returns files removed.
int sweep();

// True when t's storage is memory torch_ipc made or mapped (imported, host
// shared memory, SharedPool): Note [torch never sees our storages] in
// torch_ipc/mp/_reductions.py.
bool is_torch_ipc_storage(const at::Tensor& t);

}  // namespace torch_ipc
