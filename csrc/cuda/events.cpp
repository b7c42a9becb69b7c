#include "cuda/events.h"

#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "base/errors.h"
#include "base/fork.h"

#include "os/process.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

namespace torch_ipc {
namespace {

// Note [event pool]
// The consumer's stream is ordered after an interprocess event that the
// producer records on its current stream at export. Opening an IPC event costs
// ~150 us in the consumer, so each producer records into a small pool that
// every consumer opens once. There is one pool per (device, stream): a
// consumer may skip the wait when the event has completed (Note [ordering
// without waiting]), and a completed latest record proves that the record
// made for its export completed only when every later record of that event
// went to the same stream. Re-recording an event a consumer has not looked at
// yet only makes that consumer wait for later work of that stream: correct.
constexpr int kEventsPerStream = 4;

struct PooledEvent {
  CUevent event = nullptr;
  Handle64 handle{};
};

struct EventPool {
  std::vector<PooledEvent> slots;
  uint64_t next = 0;
};

struct Events {
  std::mutex mu;
  std::map<std::pair<int, CUstream>, EventPool> pools;    // producer side
  std::map<Handle64, std::weak_ptr<OpenedEvent>> users;   // consumer side, by handle
  std::map<Handle64, std::shared_ptr<OpenedEvent>> kept;  // ... kept open while the producer lives
};

Events& events() { return *process_state<Events>(); }

PooledEvent& next_pooled_event(Events& e, int device, CUstream stream) {
  EventPool& pool = e.pools[{device, stream}];
  if (pool.slots.empty()) {
    std::vector<PooledEvent> slots(kEventsPerStream);
    for (auto& s : slots) {
      TORCH_IPC_CU(cuEventCreate, &s.event, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
      CUipcEventHandle h;
      TORCH_IPC_CU(cuIpcGetEventHandle, &h, s.event);
      std::memcpy(s.handle.data(), h.reserved, 64);
    }
    pool.slots = std::move(slots);
  }
  return pool.slots[pool.next++ % pool.slots.size()];
}

CUevent own_pooled_event(Events& e, const Handle64& handle) {
  for (auto& [key, pool] : e.pools)
    for (auto& s : pool.slots)
      if (s.handle == handle) return s.event;
  throw DescriptorError("malformed torch_ipc descriptor: an event this process never made");
}

}  // namespace

void events_forget_after_fork() { forget_after_fork<Events>(); }
const AfterForkInChild reset_events_after_fork(&events_forget_after_fork);

OpenedEvent::~OpenedEvent() {
  if (event == nullptr || made.inherited()) return;        // CUDA is unusable in a forked child
  CUresult r = driver().cuEventDestroy(event);             // needs no current context
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED)  // at exit, the driver went first
    TORCH_WARN(driver_error_message("cuEventDestroy", r));
}

std::optional<Handle64> record_export_event(int device) {
  Events& e = events();
  ScopedContext scope(device);
  CUstream stream = current_stream(device);
  if (stream_idle(stream)) return std::nullopt;  // every write of this stream landed
  std::lock_guard<std::mutex> lock(e.mu);
  PooledEvent& slot = next_pooled_event(e, device, stream);
  TORCH_IPC_CU(cuEventRecord, slot.event, stream);
  return slot.handle;
}

// Note [ordering without waiting]
// Two costs dominate a small message to a consumer that reads what it gets
// (H100, measured with plain torch and with benchmarks/bench.py, numbers in
// benchmarks/RESULTS.md): a stream that waits on an interprocess event
// (cuStreamWaitEvent) starts its next kernel ~225 us late even when the event
// completed long before, and any GPU command of the producer right before the
// consumer's kernel (an event record included) costs the consumer a switch of
// the GPU between the two processes' contexts, ~170 us. So:
// - the producer records no event when torch's current stream has no work
//   left (cuStreamQuery, host side only): the descriptor then carries none
//   for that device, and the consumer orders nothing;
// - the consumer queries an event before waiting on it and queues a wait
//   only when it has not completed; the pools of Note [event pool] make
//   "completed" mean "the record made for this export completed".
// A write still in flight at export is always waited for, on the GPU; the
// host never blocks. Not measured yet: ordering through a counter in memory
// both processes map (cuStreamWriteValue32 / cuStreamWaitValue32) instead of
// an interprocess event. With the two rules above, bench.py's small_same with
// a reading consumer went from 333-347 us to 137 us on the H100 (floor: 78).
void order_stream_after(CUevent event, CUstream stream) {
  CUresult r = driver().cuEventQuery(event);
  if (r == CUDA_SUCCESS) return;
  if (r != CUDA_ERROR_NOT_READY) throw_driver_error("cuEventQuery", r);
  TORCH_IPC_CU(cuStreamWaitEvent, stream, event, 0);
}

std::shared_ptr<OpenedEvent> open_ipc_event(const Handle64& handle, int device, const ProcessId& producer,
                                            const AliveFn& alive) {
  Events& e = events();
  std::lock_guard<std::mutex> lock(e.mu);
  auto it = e.users.find(handle);
  if (it != e.users.end()) {
    if (auto opened = it->second.lock()) {
      if (opened->producer != producer || opened->device != device)
        throw DescriptorError("malformed torch_ipc descriptor: one event handle named for two producers or devices");
      return opened;
    }
  }
  ScopedContext scope(device);
  CUipcEventHandle h;
  std::memcpy(h.reserved, handle.data(), 64);
  auto opened = std::make_shared<OpenedEvent>();
  opened->producer = producer;
  opened->device = device;
  CUresult r = driver().cuIpcOpenEventHandle(&opened->event, h);
  if (r != CUDA_SUCCESS) {
    opened->event = nullptr;
    if (!alive(producer)) throw producer_gone(producer.pid, "its events are gone with it");
    throw_driver_error("cuIpcOpenEventHandle", r);
  }
  e.users[handle] = opened;
  e.kept[handle] = opened;
  return opened;
}

void wait_export_event(const Handle64& handle, int device, const ProcessId& producer, const AliveFn& alive) {
  ScopedContext scope(device);
  CUstream stream = current_stream(device);
  if (producer == self_process()) {
    Events& e = events();
    CUevent event;
    {
      std::lock_guard<std::mutex> lock(e.mu);
      event = own_pooled_event(e, handle);
    }
    order_stream_after(event, stream);
    return;
  }
  order_stream_after(open_ipc_event(handle, device, producer, alive)->event, stream);
}

void close_events_of_dead(const AliveFn& alive) {
  Events& e = events();
  std::vector<std::shared_ptr<OpenedEvent>> dropped;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(e.mu);
  for (auto it = e.kept.begin(); it != e.kept.end();) {
    if (!alive(it->second->producer)) {
      dropped.push_back(std::move(it->second));
      it = e.kept.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = e.users.begin(); it != e.users.end();) it = it->second.expired() ? e.users.erase(it) : std::next(it);
}

int64_t events_open() {
  Events& e = events();
  std::lock_guard<std::mutex> lock(e.mu);
  int64_t n = 0;
  for (auto& [handle, user] : e.users) n += user.expired() ? 0 : 1;
  return n;
}

}  // namespace torch_ipc
