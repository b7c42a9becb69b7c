// Devices by UUID, the primary context of a device, and torch's current stream:
// the small glue between torch's view of a GPU and the driver API's.
#pragma once

#include <cuda.h>

#include "base/ids.h"

namespace torch_ipc {

// The UUID of torch's CUDA device `index` (the driver's ordinal in this process).
const Uuid& device_uuid(int index);

// The local index of the GPU with this UUID; throws DeviceNotFound.
int device_for_uuid(const Uuid& uuid);

// Make the primary context of `device` (the one torch uses) current on this
// thread for the scope, and restore the previous one after. Where it is
// current already (torch made it so), nothing is pushed or popped.
class ScopedContext {
 public:
  explicit ScopedContext(int device);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  bool pushed_ = false;
};

// torch's current stream on `device` for this thread.
CUstream current_stream(int device);

// Whether every command queued on `stream` has finished (cuStreamQuery: host
// side only, never waits); a driver error other than "not ready" throws.
bool stream_idle(CUstream stream);

}  // namespace torch_ipc
