// One direction of a channel: a single-producer single-consumer byte ring in
// shared memory (ring_segment.h), messages framed by an 8-byte length. A
// message of any size streams through it: the producer publishes what fits
// and waits for room, the consumer takes what is there and waits for more.
// Waiting spins a little, then sleeps on a futex word that the other side
// wakes only when it was told that this side sleeps (Note [ring wait]). The
// bells (pipes, Note [private bells] in ring_segment.cpp) are never waited on
// here: every read and write of them is non-blocking.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "os/ring_segment.h"

namespace torch_ipc {

// How a wait ended. A sleeping waiter asks wait_interrupted() each time its
// sleep ends with nothing there: true stops the wait (Interrupted; Note
// [interruptible waits] in base/interrupt.h).
enum class WaitEnd { Ready, Timeout, PeerGone, Closed, Interrupted };

// What a wait looks at besides the ring: our own close, and whether the peer
// is gone (its end of the socket closed): asked when a sleep or the deadline
// ends with nothing there, remembered once true (`peer_gone_seen`).
struct WaitContext {
  const std::atomic<bool>* closed;
  const std::atomic<bool>* peer_gone_seen;
  std::function<bool()> peer_gone;
  int64_t deadline_ns;  // steady clock; < 0: none
};

// How long a waiter spins before it sleeps (Note [spin budget] in ring.cpp).
int64_t ring_spin_ns();
void set_ring_spin_ns(int64_t ns);

// Thrown as OsError(EPROTO) when an index read from the segment is impossible
// for this ring's process-local geometry.
[[noreturn]] void throw_corrupt_ring(const char* which, uint64_t head, uint64_t tail, uint64_t capacity);

class RingWriter {
 public:
  RingWriter(RingControl* control, uint8_t* data, uint32_t capacity, int bell_fd)
      : c_(control), data_(data), capacity_(capacity), bell_fd_(bell_fd) {}
  // Write one whole message (length frame + payload), waiting for room as needed.
  // Short of Ready, `*written` (when given) says how many of its bytes went in.
  WaitEnd send(const void* payload, size_t size, const WaitContext& ctx, uint64_t* written = nullptr);

 private:
  uint64_t room(uint64_t head) const;  // validated against capacity
  void publish(uint64_t head);
  void ring_bell();
  RingControl* c_;
  uint8_t* data_;
  uint64_t capacity_;
  int bell_fd_;
};

class RingReader {
 public:
  RingReader(RingControl* control, uint8_t* data, uint32_t capacity, int bell_fd)
      : c_(control), data_(data), capacity_(capacity), bell_fd_(bell_fd) {}
  // Wait until at least one byte is there.
  WaitEnd wait_readable(const WaitContext& ctx);
  // Take exactly `size` bytes into `out` (nullptr: skip them), waiting as needed.
  WaitEnd read(void* out, size_t size, const WaitContext& ctx);
  // Take `size` bytes if all of them are there now; false (nothing taken) otherwise.
  bool try_read(void* out, size_t size);
  // The consumer finished a message: count it, and in fd mode re-arm the bell.
  void message_done();
  // Ask the producer to ring the eventfd for every message from now on.
  void enable_fd_wakeups();

 private:
  uint64_t available(uint64_t tail) const;  // validated against capacity
  void copy_out(void* out, uint64_t tail, size_t n) const;
  void consume(uint64_t tail);
  void rearm_bell();
  RingControl* c_;
  uint8_t* data_;
  uint64_t capacity_;
  int bell_fd_;
};

}  // namespace torch_ipc
