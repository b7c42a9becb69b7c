// torch_ipc.IpcEvent: a CUDA event that processes of one machine record, wait
// on and query, and that travels in a pickle.
#pragma once

#include <cuda.h>
#include <memory>
#include <optional>
#include <string>

#include "cuda/events.h"

namespace torch_ipc {

class __attribute__((visibility("hidden"))) IpcEvent {
 public:
  // A new interprocess event on CUDA device `device`, made by this process.
  explicit IpcEvent(int device);
  // The event that `state` (from state(), in any process of this boot)
  // names. Throws DescriptorError on a malformed state, DeviceNotFound when
  // this process does not see its GPU, ProducerGone when its maker exited.
  static std::shared_ptr<IpcEvent> from_state(const std::string& state);

  // What a pickle carries: the IPC handle, the GPU's UUID, the maker.
  std::string state() const;
  int device() const { return event_->device; }

  // `stream`: a CUstream of this event's device; none: torch's current one.
  void record(std::optional<CUstream> stream);
  // Orders `stream` after the latest record (Note [ordering without waiting]);
  // the host never blocks.
  void wait(std::optional<CUstream> stream);
  bool query();
  void synchronize();  // blocks the calling thread, not the GIL (csrc/python/)

 private:
  explicit IpcEvent(std::shared_ptr<OpenedEvent> event, const Handle64& handle)
      : event_(std::move(event)), handle_(handle) {}
  CUstream stream_or_current(std::optional<CUstream> stream) const;

  std::shared_ptr<OpenedEvent> event_;
  Handle64 handle_{};
};

}  // namespace torch_ipc
