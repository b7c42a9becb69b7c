// Whether a blocking call should give up because the user pressed Ctrl-C.
#pragma once

#include <exception>

namespace torch_ipc {

// Note [interruptible waits]
// Ctrl-C must end any wait of torch_ipc, as it ends a wait on a socket: the
// channel's rings, a KV pool's lock, an fd fetch. Each waits with the GIL
// released, in slices (tens of ms at most); each time a slice ends with
// nothing there it asks wait_interrupted(), which the bindings make "run
// Python's signal handlers if this is the main thread, and say whether one
// raised". A handler that raises ends the wait and its exception is what the
// call raises; one that returns lets the wait go on. A signal that another
// thread took is seen at the end of the slice.
using InterruptCheck = bool (*)();
// Set once by the bindings; none: never interrupted.
void set_wait_interrupt_check(InterruptCheck check);
bool wait_interrupted();

// A wait ended because Python's signal handler raised: the Python error is
// set; the bindings raise it (one translator for every binding).
struct WaitInterrupted : std::exception {
  const char* what() const noexcept override { return "torch_ipc: a wait was interrupted"; }
};

}  // namespace torch_ipc
