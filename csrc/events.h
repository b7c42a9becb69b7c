// Stream ordering between processes: the producer's pool of interprocess
// events, recorded at export, and the consumer's cache of opened ones.
#pragma once

#include <cstdint>
#include <functional>

#include "descriptor.h"

namespace torch_ipc {

// Producer: record an interprocess event on torch's current stream of
// `device` (Note [event pool]) and return its IPC handle.
Handle64 record_export_event(int device);

// Consumer: make torch's current stream of `device` wait on the event
// `handle` that `producer` recorded (this process included). `alive` says
// whether the producer lives, asked only when opening the event failed.
void wait_export_event(const Handle64& handle, int device, const ProcessId& producer,
                       const std::function<bool(const ProcessId&)>& alive);

// Destroy the opened events of producers that exited.
void close_events_of_dead(const std::function<bool(const ProcessId&)>& alive);
int64_t events_open();

}  // namespace torch_ipc
