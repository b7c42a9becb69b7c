// Stream ordering between processes: the producer's pools of interprocess
// events, recorded at export, and the consumer's cache of opened ones.
#pragma once

#include <cstdint>
#include <cuda.h>
#include <functional>
#include <memory>
#include <optional>

#include "wire/descriptor.h"

#include "os/process.h"

namespace torch_ipc {

using AliveFn = std::function<bool(const ProcessId&)>;

// Producer: record an interprocess event on torch's current stream of
// `device` (Note [event pool]) and return its IPC handle; nothing when that
// stream has no work left (Note [ordering without waiting]).
std::optional<Handle64> record_export_event(int device);

// Consumer: order torch's current stream of `device` after the event `handle`
// that `producer` recorded (this process included), without a stream wait
// where the event completed already (Note [ordering without waiting]).
// `alive` says whether the producer lives, asked only when opening failed.
void wait_export_event(const Handle64& handle, int device, const ProcessId& producer, const AliveFn& alive);

// Make `stream` wait for the work before the latest record of `event`; where
// that work is done already, nothing is queued.
void order_stream_after(CUevent event, CUstream stream);

// An interprocess event of another process, opened once per process and
// shared by everyone who uses it here; destroyed with its last user once its
// producer exited.
struct OpenedEvent {
  CUevent event = nullptr;
  ProcessId producer;
  int device = -1;
  MadeHere made;  // a forked child leaves its parent's events alone (Note [fork])
  ~OpenedEvent();
};
std::shared_ptr<OpenedEvent> open_ipc_event(const Handle64& handle, int device, const ProcessId& producer,
                                            const AliveFn& alive);

// Forget the opened events of producers that exited.
void close_events_of_dead(const AliveFn& alive);
int64_t events_open();

}  // namespace torch_ipc
