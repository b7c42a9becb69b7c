#include "events.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "cuda_context.h"
#include "cuda_driver.h"
#include "errors.h"
#include "fork.h"
#include "process.h"

namespace torch_ipc {
namespace {

// Note [event pool]
// The consumer's stream waits on an interprocess event that the producer
// records on its current stream at export. Opening an IPC event costs ~150 us
// in the consumer, so each producer records into a small pool per device that
// every consumer opens once. Re-recording an event a consumer has not waited
// on yet only makes that consumer wait for later work: still correct.
constexpr int kEventsPerDevice = 4;

struct PooledEvent {
  CUevent event = nullptr;
  Handle64 handle{};
};

struct EventPool {
  std::vector<PooledEvent> slots;
  uint64_t next = 0;
};

struct OpenedEvent {
  CUevent event;
  ProcessId producer;
};

struct Events {
  std::mutex mu;
  std::map<int, EventPool> pools;           // producer side, by device
  std::map<Handle64, OpenedEvent> opened;   // consumer side, by handle
};

Events& events() { return *process_state<Events>(); }

PooledEvent& next_pooled_event(Events& e, int device) {
  EventPool& pool = e.pools[device];
  if (pool.slots.empty()) {
    std::vector<PooledEvent> slots(kEventsPerDevice);
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

CUevent own_event(Events& e, const Handle64& handle) {
  for (auto& [device, pool] : e.pools)
    for (auto& s : pool.slots)
      if (s.handle == handle) return s.event;
  throw DescriptorError("malformed torch_ipc descriptor: an event this process never made");
}

CUevent open_event(Events& e, const Handle64& handle, const ProcessId& producer,
                   const std::function<bool(const ProcessId&)>& alive) {
  auto it = e.opened.find(handle);
  if (it != e.opened.end()) return it->second.event;
  CUipcEventHandle h;
  std::memcpy(h.reserved, handle.data(), 64);
  CUevent event = nullptr;
  CUresult r = driver().cuIpcOpenEventHandle(&event, h);
  if (r != CUDA_SUCCESS) {
    if (!alive(producer)) throw producer_gone(producer.pid, "its events are gone with it");
    throw_driver_error("cuIpcOpenEventHandle", r);
  }
  e.opened.emplace(handle, OpenedEvent{event, producer});
  return event;
}

}  // namespace

void events_forget_after_fork() { forget_after_fork<Events>(); }

Handle64 record_export_event(int device) {
  Events& e = events();
  ScopedContext scope(device);
  std::lock_guard<std::mutex> lock(e.mu);
  PooledEvent& slot = next_pooled_event(e, device);
  TORCH_IPC_CU(cuEventRecord, slot.event, current_stream(device));
  return slot.handle;
}

void wait_export_event(const Handle64& handle, int device, const ProcessId& producer,
                       const std::function<bool(const ProcessId&)>& alive) {
  Events& e = events();
  ScopedContext scope(device);
  CUevent event;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    event = producer == self_process() ? own_event(e, handle) : open_event(e, handle, producer, alive);
  }
  TORCH_IPC_CU(cuStreamWaitEvent, current_stream(device), event, 0);
}

void close_events_of_dead(const std::function<bool(const ProcessId&)>& alive) {
  Events& e = events();
  std::lock_guard<std::mutex> lock(e.mu);
  for (auto it = e.opened.begin(); it != e.opened.end();) {
    if (!alive(it->second.producer)) {
      TORCH_IPC_CU_WARN(cuEventDestroy, it->second.event);
      it = e.opened.erase(it);
    } else {
      ++it;
    }
  }
}

int64_t events_open() {
  Events& e = events();
  std::lock_guard<std::mutex> lock(e.mu);
  return static_cast<int64_t>(e.opened.size());
}

}  // namespace torch_ipc
