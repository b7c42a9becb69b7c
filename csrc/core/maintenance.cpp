// The collector's work and interpreter exit, over the export and import sides.
#include "core/maintenance.h"

#include <mutex>

#include "base/errors.h"
#include "base/fork.h"

#include "os/fd_passing.h"
#include "os/life.h"
#include "os/process.h"
#include "os/refcount.h"
#include "os/sweep.h"

#include "memory/host_memory.h"
#include "memory/shared_pool.h"

#include "core/export.h"
#include "core/import.h"
#include "core/registry.h"

namespace torch_ipc {
namespace {

// Collections run one at a time (Note [collect without the GIL]).
struct CollectLock {
  std::mutex mu;
};
std::mutex& collect_lock() { return process_state<CollectLock>()->mu; }
void collect_lock_forget_after_fork() { forget_after_fork<CollectLock>(); }
const AfterForkInChild reset_collect_lock(&collect_lock_forget_after_fork);

}  // namespace

// Note [collect without the GIL]
// A collection looks at every live export and import: with thousands held it
// takes milliseconds, and the GIL would stall every Python thread for that
// long, every collect interval. It touches no Python object; storages it
// drops take the GIL themselves if a Python object still refers to them
// (torch's PyObject slot does). Collections run one at a time (the GIL used
// to see to that): a collect() returns after what another thread's collection
// dropped is freed and unmapped, so stats() afterwards are settled. The
// binding releases the GIL before this takes the lock, never the other way round.
int collect(bool close_idle) {
  std::lock_guard<std::mutex> lock(collect_lock());
  int reclaimed = collect_exports();
  collect_imports(close_idle);
  return reclaimed;
}

void shutdown() {
  try {
    flush_imports();
  } catch (const CudaUnavailable&) {
  }
  collect_exports();
  lease_unlink_own_segments();
  host_unlink_all();
  // Its lock goes with the process; the name goes now unless something is
  // still held (a holder whose file is gone looks dead: Note [life files]);
  // else a later sweep removes it.
  if (import_stats().holds == 0) unlink_life_file();
  fd_server_unlink_path();
  // What exited producers left (a Pool's workers end by SIGTERM, and forked
  // children skip exit hooks): removed now, not at the next torch_ipc
  // process's start, which may never come (only the proven dead: Note
  // [unknown is not dead] in os/sweep.cpp).
  sweep_stale_shm();
}

int sweep() {
  int removed = sweep_stale_shm();
  forget_exited_processes();
  return removed;
}

bool is_torch_ipc_storage(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  const c10::Storage& s = t.storage();
  return imported_origin(s).has_value() || is_host_shared(s) || (t.is_cuda() && vmm_is_pool_storage(s));
}

}  // namespace torch_ipc
