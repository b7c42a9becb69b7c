#include "os/channel.h"

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/errors.h"

#include "os/futex.h"
#include "os/life.h"
#include "os/process.h"

namespace torch_ipc {

// Note [fd wake-ups]
// select() and asyncio wait on an fd, not on a futex. Once the reader asks
// for an fd (Connection.fileno()), it sets fd_wakeups in its incoming ring;
// from then on the producer rings the bell (a pipe: Note [private bells] in
// ring_segment.cpp) of that ring for each message, before publishing it:
// readable fd => a message is there or about to be (a recv then waits at
// most for the producer to finish copying, or notices its death). After each
// message the reader empties the bell and rings it again itself while
// messages_begun > messages_read, so the fd stays readable exactly while
// messages wait. The producer counts the message, then reads the flag; the
// reader sets the flag, then reads the count (both seq_cst): a message begun
// as the flag is set is either rung by the producer or found by the reader.
// The fd handed out is an epoll fd over that bell and the socket, so the
// peer's end (socket hang-up) wakes it too. None of these reads and writes
// can block (our bells are ours alone and non-blocking), so they run with the
// GIL held where the call holds it.

class Channel::Busy {
 public:
  explicit Busy(Channel* c) : c_(c) {
    c_->busy_.fetch_add(1, std::memory_order_seq_cst);
    if (c_->closed_.load(std::memory_order_seq_cst)) {
      release();
      throw OsError(EBADF, "torch_ipc: the connection is closed");
    }
  }
  ~Busy() {
    if (c_ != nullptr) release();
  }

 private:
  void release() {
    if (c_->busy_.fetch_sub(1, std::memory_order_seq_cst) == 1 && c_->closed_.load(std::memory_order_seq_cst))
      c_->close_fds_once();
    c_ = nullptr;
  }
  Channel* c_;
};

namespace {

std::unique_ptr<ChannelSegment> map_checked(int memory, int socket, int side, uint32_t ring_bytes) {
  TORCH_IPC_CHECK_VALUE(side == 0 || side == 1, "torch_ipc: a channel end's side is 0 or 1, not ", side);
  struct stat st{};
  if (fstat(socket, &st) != 0) throw_os_error("fstat", "the channel's socket");
  if (!S_ISSOCK(st.st_mode)) throw OsError(ENOTSOCK, "torch_ipc: the channel's socket is not a socket");
  return ChannelSegment::map(memory, ring_bytes);
}

// Whether process `pid` has exited (a zombie has); "could not tell" is "no".
bool process_gone(int32_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", int(pid));
  UniqueFd f(open(path, O_RDONLY | O_CLOEXEC));
  char buf[512] = {};
  if (f.get() < 0 || ::read(f.get(), buf, sizeof(buf) - 1) <= 0) return false;
  const char* paren = std::strrchr(buf, ')');  // the state follows the command's closing parenthesis
  return paren != nullptr && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

// A claim is a life key (31 bits), or this bit and a pid where the claimant
// could not make its life file (then it is judged by its pid).
constexpr uint32_t kPidClaim = 0x80000000u;

// Whether the claimant `claim` has exited; "could not tell" is "no".
bool claimant_gone(uint32_t claim) {
  if (claim & kPidClaim) return process_gone(int32_t(claim & ~kPidClaim));
  return check_life_key(claim).life == Life::Dead;
}

}  // namespace

// Note [one process per end]
// Two processes sending on one end (a forked child and its parent) would
// both write at the head they read and garble each other's messages, without
// a word; two receiving would each take parts of messages. So each ring says
// in its segment which process sends on it and which receives from it: the
// first process to send (receive) claims it, and another process that tries
// while the claimant lives gets OSError(EBUSY) naming it. The claim goes
// with close() (and the end's destruction) in the claimant, and with its
// exit: an exited (or zombie) claimant is replaced. A claim names the
// claimant's life key (Note [life files] in life.h), not its pid: a pid
// counts in one PID namespace, and one of another namespace, or a recycled
// one, named a living stranger (an end handed on by a process that was pid 1
// of its container: EBUSY for good) or nobody. So what multiprocessing
// programs do works: an end used by a forked or spawned child only, or by
// the parent only, or handed from one to the other once the first closed it
// or exited. What raises: two living processes using one direction of one
// end, which a multiprocessing.Pipe allows, unsafely, for messages above
// PIPE_BUF. The check is one load of a word of the segment per message. A
// peer can write a live key there and make our calls raise: never a hang.

Channel::Channel(UniqueFd memory, UniqueFd socket, UniqueFd bell0, UniqueFd bell1, int side, uint32_t ring_bytes)
    : memory_(std::move(memory)),
      socket_(std::move(socket)),
      bell_{open_private_bell(bell0.get()), open_private_bell(bell1.get())},  // Note [private bells]
      segment_(map_checked(memory_.get(), socket_.get(), side, ring_bytes)),
      side_(side),
      writer_(segment_->control(side), segment_->data(side), ring_bytes, bell_[side].get()),
      reader_(segment_->control(1 - side), segment_->data(1 - side), ring_bytes, bell_[1 - side].get()) {}

Channel::~Channel() {
  closed_.store(true);
  release_claims();
  close_fds_once();
}

void Channel::after_fork() {
  busy_.store(0);
  claim_key_.store(0);  // the child has a life key of its own
}

uint32_t Channel::claim_key() const {
  uint32_t key = claim_key_.load(std::memory_order_relaxed);
  if (key == 0) {  // first use in this process: made here, not in the fork handler
    key = self_process().life;
    if (key == 0) key = kPidClaim | uint32_t(getpid());
    claim_key_.store(key, std::memory_order_relaxed);
  }
  return key;
}

void Channel::claim(std::atomic<uint32_t>* owner, std::atomic<int32_t>* owner_pid, const char* doing) const {
  const uint32_t me = claim_key();
  uint32_t was = owner->load(std::memory_order_relaxed);
  while (was != me) {
    if (was != 0 && !claimant_gone(was))
      throw OsError(EBUSY,
                    str("torch_ipc: process ", owner_pid->load(std::memory_order_relaxed), " ", doing,
                        " on this end of the connection (a pid as its own PID namespace counts it); process ", getpid(),
                        " may not as well: an end is used by one process at a time, or messages get "
                        "garbled. Close the end in the process that no longer uses it, or give each "
                        "process a connection of its own (Note [one process per end])"));
    if (owner->compare_exchange_weak(was, me, std::memory_order_relaxed)) {
      owner_pid->store(int32_t(getpid()), std::memory_order_relaxed);
      return;
    }
  }
}

void Channel::release_claims() {
  const uint32_t me = claim_key_.load(std::memory_order_relaxed);
  if (me == 0) return;  // never claimed anything in this process
  for (auto* owner : {&segment_->control(side_)->writer, &segment_->control(1 - side_)->reader}) {
    uint32_t mine = me;
    owner->compare_exchange_strong(mine, 0, std::memory_order_relaxed);
  }
}

WaitContext Channel::context(int64_t deadline_ns) const {
  return WaitContext{&closed_, &peer_gone_seen_, [this] { return peer_gone(); }, deadline_ns};
}

bool Channel::peer_gone() const {
  struct pollfd p{socket_.get(), POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;  // nothing, or could not check: not gone
  bool gone = (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0;
  if (!gone && (p.revents & POLLIN)) {  // the socket carries nothing once the rings run: only its end
    char c;
    gone = recv(socket_.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
  }
  if (gone) peer_gone_seen_.store(true, std::memory_order_relaxed);  // an end of file is for good
  return gone;
}

void Channel::fail(WaitEnd end, const char* doing) {
  if (end == WaitEnd::Interrupted) throw WaitInterrupted();
  if (end == WaitEnd::Closed) throw OsError(EBADF, "torch_ipc: the connection is closed");
  throw OsError(
      EPIPE, str("torch_ipc: the other end of the connection is gone (closed, or its process exited) while ", doing));
}

void Channel::send(const void* data, size_t size) {
  Busy busy(this);
  claim(&segment_->control(side_)->writer, &segment_->control(side_)->writer_pid, "sends");
  uint64_t written = 0;
  WaitEnd end = writer_.send(data, size, context(-1), &written);
  if (end == WaitEnd::Interrupted && written > 0) close();  // the ring holds part of a message: the stream is cut
  if (end != WaitEnd::Ready) fail(end, "sending");
}

int64_t Channel::send_within(const void* data, size_t size, int64_t timeout_ns) {
  Busy busy(this);
  claim(&segment_->control(side_)->writer, &segment_->control(side_)->writer_pid, "sends");
  uint64_t written = 0;
  WaitEnd end = writer_.send(data, size, context(steady_now_ns() + std::max<int64_t>(timeout_ns, 0)), &written);
  if (end == WaitEnd::Timeout) return int64_t(written);
  if (end == WaitEnd::Interrupted && written > 0) close();
  if (end != WaitEnd::Ready) fail(end, "sending");
  return -1;
}

bool Channel::next_size(uint64_t* size) {
  Busy busy(this);
  claim(&segment_->control(1 - side_)->reader, &segment_->control(1 - side_)->reader_pid, "receives");
  WaitContext ctx = context(-1);
  WaitEnd end = reader_.wait_readable(ctx);  // an interrupt here has taken nothing
  const bool began = end == WaitEnd::Ready;
  if (began) end = reader_.read(size, sizeof(*size), ctx);
  if (end == WaitEnd::PeerGone) return false;
  if (end == WaitEnd::Interrupted && began) close();  // part of a length was taken: the stream is cut
  if (end != WaitEnd::Ready) fail(end, "receiving");
  if (*size >= (uint64_t(1) << 47))  // more than any machine holds: not a length we wrote
    throw OsError(EPROTO, str("torch_ipc: the channel's incoming ring holds an impossible message length (", *size,
                              "): its shared memory was written over"));
  return true;
}

bool Channel::try_body(void* out, size_t size) {
  Busy busy(this);
  return reader_.try_read(out, size);
}

bool Channel::body(void* out, size_t size) {
  Busy busy(this);
  WaitEnd end = reader_.read(out, size, context(-1));
  if (end == WaitEnd::PeerGone) return false;
  if (end == WaitEnd::Interrupted) close();  // part of a message was taken: the stream is cut
  if (end != WaitEnd::Ready) fail(end, "receiving");
  return true;
}

void Channel::finished() {
  Busy busy(this);
  reader_.message_done();
}

bool Channel::poll(int64_t timeout_ns) {
  Busy busy(this);
  int64_t deadline = timeout_ns < 0 ? -1 : steady_now_ns() + timeout_ns;
  WaitEnd end = reader_.wait_readable(context(deadline));
  if (end == WaitEnd::Closed || end == WaitEnd::Interrupted) fail(end, "polling");
  return end != WaitEnd::Timeout;  // PeerGone: readable, the next recv raises EOFError
}

int Channel::wait_fd() {
  Busy busy(this);
  if (epoll_.get() >= 0) return epoll_.get();
  UniqueFd ep(epoll_create1(EPOLL_CLOEXEC));
  if (ep.get() < 0) throw_os_error("epoll_create1", "a channel's wait fd");
  int incoming = 1 - side_;
  struct epoll_event bell{};
  bell.events = EPOLLIN;
  struct epoll_event sock{};
  sock.events = EPOLLIN | EPOLLRDHUP;
  if (epoll_ctl(ep.get(), EPOLL_CTL_ADD, bell_[incoming].get(), &bell) != 0 ||
      epoll_ctl(ep.get(), EPOLL_CTL_ADD, socket_.get(), &sock) != 0)
    throw_os_error("epoll_ctl", "a channel's wait fd");
  reader_.enable_fd_wakeups();
  epoll_ = std::move(ep);
  return epoll_.get();
}

void Channel::wake_everyone() const {
  for (int r = 0; r < 2; ++r) {
    futex_wake_all(&segment_->control(r)->reader_sleeps);
    futex_wake_all(&segment_->control(r)->writer_sleeps);
  }
}

void Channel::close() {
  if (closed_.exchange(true, std::memory_order_seq_cst)) return;
  release_claims();
  wake_everyone();  // our own waiters return and raise
  if (busy_.load(std::memory_order_seq_cst) == 0) close_fds_once();
}

void Channel::close_fds_once() {
  if (fds_closed_.exchange(true)) return;
  epoll_.reset();
  socket_.reset();  // the peer's poll now sees the end of file ...
  bell_[0].reset();
  bell_[1].reset();
  memory_.reset();
  wake_everyone();  // ... and its sleeping waiters look now
}

size_t ring_head_offset(int ring) {
  return offsetof(ChannelHeader, rings) + ring * sizeof(RingControl) + offsetof(RingControl, head);
}

size_t ring_tail_offset(int ring) {
  return offsetof(ChannelHeader, rings) + ring * sizeof(RingControl) + offsetof(RingControl, tail);
}

}  // namespace torch_ipc
