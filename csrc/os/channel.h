// One end of a channel: the two rings of a ChannelSegment (we write ring
// `side`, read ring 1 - side), the socket to the other end (how its death is
// noticed, Note [noticing a dead peer] in ring.cpp), and the bells for fd
// waiters (Note [fd wake-ups] in channel.cpp). One sender and one receiver
// at a time: the Python layer serializes each direction within a process,
// and an end is used by one process at a time (Note [one process per end]).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>

#include "base/interrupt.h"
#include "base/unique_fd.h"

#include "os/ring.h"
#include "os/ring_segment.h"

namespace torch_ipc {

class Channel {
 public:
  // Takes the fds (closed with the channel, or at once when a check fails).
  Channel(UniqueFd memory, UniqueFd socket, UniqueFd bell0, UniqueFd bell1, int side, uint32_t ring_bytes);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Send one message. OsError EPIPE when the peer is gone, EBADF when closed.
  void send(const void* data, size_t size);
  // The same, giving up after `timeout_ns`: -1 when sent, else how many of its
  // bytes went in (0: none; more: the ring holds part of a message, and the
  // caller must close the channel). Note [send time limit] in torch_ipc/mp/_flow.py.
  int64_t send_within(const void* data, size_t size, int64_t timeout_ns);

  // Receiving one message: next_size() waits for its length (false: the peer
  // closed before a new message began), then body() or try_body() takes
  // exactly that many bytes (or skips them: out == nullptr), then finished().
  // body() is false when the peer is gone in the middle of the message.
  bool next_size(uint64_t* size);
  bool try_body(void* out, size_t size);
  bool body(void* out, size_t size);
  void finished();

  // Whether a message (or the peer's end) is there to receive, waiting up to
  // `timeout_ns` (< 0: forever).
  bool poll(int64_t timeout_ns);
  // An fd that is readable while a message or the peer's end is there to
  // receive (epoll over the incoming bell and the socket); made on first use.
  int wait_fd();
  // Close our end: wakes our own waiters (they raise) and, once no call is
  // inside, closes the fds and wakes the peer's waiters. Idempotent.
  void close();
  bool closed() const { return closed_.load(); }
  // A forked child has none of its parent's calls inside, and a pid of its own.
  void after_fork();

  int memory_fd() const { return memory_.get(); }
  int socket_fd() const { return socket_.get(); }
  int bell_fd(int ring) const { return bell_[ring].get(); }
  int side() const { return side_; }
  uint32_t ring_bytes() const { return segment_->ring_bytes(); }

 private:
  class Busy;
  WaitContext context(int64_t deadline_ns) const;
  bool peer_gone() const;
  [[noreturn]] void fail(WaitEnd end, const char* doing);
  uint32_t claim_key() const;
  void claim(std::atomic<uint32_t>* owner, std::atomic<int32_t>* owner_pid, const char* doing) const;
  void release_claims();
  void close_fds_once();
  void wake_everyone() const;

  UniqueFd memory_, socket_, bell_[2], epoll_;
  std::unique_ptr<ChannelSegment> segment_;
  int side_;
  RingWriter writer_;
  RingReader reader_;
  std::atomic<bool> closed_{false};
  mutable std::atomic<bool> peer_gone_seen_{false};
  std::atomic<bool> fds_closed_{false};
  std::atomic<int> busy_{0};
  mutable std::atomic<uint32_t> claim_key_{0};  // ours (Note [one process per end]); 0 until first used, and after fork
};

// Where the fields of ring `ring` lie in the segment, for tests that write over them.
size_t ring_head_offset(int ring);
size_t ring_tail_offset(int ring);

}  // namespace torch_ipc
