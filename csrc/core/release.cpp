#include "core/release.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>

#include <c10/util/Exception.h>

#include "base/fork.h"

#include "os/refcount.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

#include "memory/memory_kind.h"

#include "core/mapping_cache.h"

namespace torch_ipc {
namespace {

// A hold whose tensors are gone, waiting for the GPU work queued on them.
struct PendingRelease {
  LeaseRecord lease;
  std::vector<std::pair<int, CUevent>> done;  // (device, event recorded at release)
  std::vector<std::shared_ptr<Mapping>> mappings;
};

struct Releases {
  std::recursive_mutex mu;
  std::vector<PendingRelease> pending;
  std::vector<std::pair<int, CUevent>> spare_events;
  std::atomic<int64_t> holds{0};
};

// A forked child starts with no hold or pending release (Note [fork]).
Releases& releases() { return *process_state<Releases>(); }

CUevent take_release_event(Releases& c, int device) {
  for (auto it = c.spare_events.begin(); it != c.spare_events.end(); ++it) {
    if (it->first == device) {
      CUevent e = it->second;
      c.spare_events.erase(it);
      return e;
    }
  }
  CUevent e;
  TORCH_IPC_CU(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
  return e;
}

void finish(Releases& c, PendingRelease& p) {
  for (auto& de : p.done) c.spare_events.push_back(de);
  lease_unhold(p.lease);
  --c.holds;
}

// Whether the GPU work a release waits for has finished. A driver error (a
// sticky error kills the context, and its work with it) is reported and
// counts as finished: nothing will ever complete that event.
bool release_ready(const PendingRelease& p) {
  for (const auto& [device, e] : p.done) {
    CUresult r = driver().cuEventQuery(e);
    if (r == CUDA_ERROR_NOT_READY) return false;
    if (r != CUDA_SUCCESS)
      TORCH_WARN("torch_ipc: releasing a hold although ", driver_error_message("cuEventQuery", r), " for its GPU work");
  }
  return true;
}

}  // namespace

void releases_forget_after_fork() { forget_after_fork<Releases>(); }
const AfterForkInChild reset_releases_after_fork(&releases_forget_after_fork);

std::shared_ptr<Hold> take_hold(const LeaseRecord& lease) {
  lease_hold(lease, /*take_token=*/false);
  ++releases().holds;
  auto hold = std::make_shared<Hold>();
  hold->lease = lease;
  return hold;
}

// Note [deferred release]
// A consumer's tensors may die while GPU work it queued on them still runs:
// releasing the hold at once would let the producer reuse memory the GPU is
// still reading. So the release records an event on torch's current stream
// of each device it used and is finished by collect_imports() once those
// events completed; the host never waits. A stream with nothing left to run
// (cuStreamQuery, host side only: a consumer that synchronized, or read with
// .item()) needs no event: that release is finished at once, which saves the
// record and the later query (~3 us a message on the H100 machine).

Hold::~Hold() {
  if (made.inherited()) {  // the hold is the parent's to release
    new std::vector<std::shared_ptr<Mapping>>(std::move(mappings));
    return;
  }
  Releases& c = releases();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  PendingRelease p{lease, {}, std::move(mappings)};
  try {
    for (const auto& m : p.mappings) {
      const int device = m->where.device;
      if (!m->kind->on_gpu) continue;
      if (std::any_of(p.done.begin(), p.done.end(), [&](auto& de) { return de.first == device; })) continue;
      ScopedContext scope(device);
      CUstream stream = current_stream(device);
      if (stream_idle(stream)) continue;  // nothing queued can still read it: release now
      CUevent e = take_release_event(c, device);
      p.done.emplace_back(device, e);
      TORCH_IPC_CU(cuEventRecord, e, stream);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("torch_ipc: could not order a release after GPU work (", e.what(), "); releasing now");
    for (auto& de : p.done) c.spare_events.push_back(de);
    p.done.clear();
  }
  if (p.done.empty()) {
    finish(c, p);
  } else {
    c.pending.push_back(std::move(p));
  }
}

void finish_ready_releases(std::vector<std::shared_ptr<Mapping>>& closing) {
  Releases& c = releases();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  for (size_t i = 0; i < c.pending.size();) {
    if (release_ready(c.pending[i])) {
      finish(c, c.pending[i]);
      closing.insert(closing.end(), c.pending[i].mappings.begin(), c.pending[i].mappings.end());
      c.pending.erase(c.pending.begin() + i);
    } else {
      ++i;
    }
  }
}

void flush_releases() {
  Releases& c = releases();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  for (auto& p : c.pending) {
    for (auto& [device, e] : p.done) {
      CUresult r = driver().cuEventSynchronize(e);
      if (r != CUDA_SUCCESS)  // released either way: at exit nothing else will
        TORCH_WARN("torch_ipc: at exit, ", driver_error_message("cuEventSynchronize", r));
    }
    finish(c, p);
  }
  c.pending.clear();
}

ReleaseStats release_stats() {
  Releases& c = releases();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  return ReleaseStats{c.holds.load(), static_cast<int64_t>(c.pending.size())};
}

}  // namespace torch_ipc
