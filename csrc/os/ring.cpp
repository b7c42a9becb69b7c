#include "os/ring.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sched.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/env.h"
#include "base/errors.h"
#include "base/interrupt.h"

#include "os/futex.h"

namespace torch_ipc {

// Note [ring wait]
// A waiter first spins on the index it waits for (Note [spin budget]), then
// declares that it sleeps (its futex word := 1), looks once more, and sleeps
// on the word. The other side, after publishing an index, looks at the word
// and wakes it only if it is 1: with nobody asleep a message costs no system
// call. Both sides put a seq_cst fence between their store (the word; the
// index) and their load (the index; the word), so one of them always sees
// the other's store: no wake-up is lost. A sleep lasts at most
// kPeerCheckNs (Note [noticing a dead peer]).
//
// Note [spin budget]
// Measured with benchmarks/channel_bench.py --quick --spin on the 2-core CI
// machine (64 B round trip through torch_ipc.Pipe, paired batches; load
// average ~17 from other builds), min / median us per round trip:
//   spin 0: 9.9 / 23.7    2 us: 17.2 / 39.4    5 us: 19.9 / 55.6
//   10 us: 31.8 / 83.1    20 us: 52.8 / 139.5  100 us: 382 / 568
//   (multiprocessing.Pipe in the same run: 32.3 / 51.1)
// Where cores are scarce, a spinning waiter takes the core its peer needs to
// answer: every microsecond of spin costs more than the futex wake it saves.
// Where they are not, a waiter that sleeps pays more than the futex call: its
// core idles and its answer runs on a cold, slower core. On the H100 machine
// (16 CPUs; bench.py and a KV hand-over loop, one run each, medians in us):
//   spin                        20    100   300   1000
//   hand-over channel RT        88     80    66     45
//   small_same, floor           79     55    53     51
//   small_same, torch_ipc       97     84    59     89
//   small_new, torch_ipc       107     72    53     87
// An answer that needs Python and a kernel launch (30-100 us there) is waited
// for without sleeping from ~300 us of spin on. So the default is 0 on a
// process allowed fewer than 4 CPUs and 250 us otherwise: a waiter burns at
// most 250 us of one core per wait, and vLLM's shm_broadcast reader spins
// (with yields) without any bound. TORCH_IPC_CHANNEL_SPIN_US overrides it.
// After the spin, and before the futex, the waiter gives its core away
// kYields times (sched_yield): the peer, if it waits for a core, runs at once,
// and an answer that comes meanwhile costs neither side a futex call. Same
// machine, spin 0, 15 paired batches of 2000, median round trip over
// multiprocessing.Pipe's: 0 yields 0.54x, 2: 0.42x, 4: 0.41x, 8: 0.39x,
// 16: 0.38x, 32: 0.38x. On an idle machine a yield returns at once: 16 of
// them are ~5 us more of spinning.
// A wait's slices end at least every kPeerCheckNs (Note [interruptible waits]
// in base/interrupt.h).
// Note [noticing a dead peer]
// Nothing in the segment tells that the peer died (SIGKILL leaves no trace
// there). Its socket does: the kernel closes it with the process. A sleeping
// waiter wakes every kPeerCheckNs and asks the socket (poll: hang-up or end of
// file); a clean close() of the peer also wakes it at once, after closing the
// socket. So a dead peer is noticed within ~kPeerCheckNs.

namespace {

constexpr int64_t kPeerCheckNs = 50'000'000;
constexpr int kYields = 16;  // Note [spin budget]
int64_t default_spin_ns() {
  cpu_set_t cpus;
  const bool few_cpus = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 && CPU_COUNT(&cpus) < 4;
  const double us = env_number("TORCH_IPC_CHANNEL_SPIN_US", few_cpus ? 0 : 250, 0, 1e6);  // Note [checked settings]
  return int64_t(us * 1000);
}

std::atomic<int64_t> g_spin_ns{default_spin_ns()};

template <class Ready>
WaitEnd wait_for(Ready ready, std::atomic<uint32_t>* sleeps, const WaitContext& ctx) {
  if (ready()) return WaitEnd::Ready;
  int64_t now = steady_now_ns();
  int64_t spin_end = now + g_spin_ns.load(std::memory_order_relaxed);
  if (ctx.deadline_ns >= 0) spin_end = std::min(spin_end, ctx.deadline_ns);
  for (uint32_t i = 1; now < spin_end; ++i) {
    cpu_relax();
    if (ready()) return WaitEnd::Ready;
    if ((i & 31) == 0) now = steady_now_ns();
  }
  for (int i = 0; i < kYields && (ctx.deadline_ns < 0 || steady_now_ns() < ctx.deadline_ns); ++i) {
    sched_yield();
    if (ready()) return WaitEnd::Ready;
  }
  auto gone = [&] { return ctx.peer_gone_seen->load(std::memory_order_relaxed) || ctx.peer_gone(); };
  for (;;) {
    if (ctx.closed->load(std::memory_order_acquire)) return WaitEnd::Closed;
    if (ctx.peer_gone_seen->load(std::memory_order_relaxed)) return ready() ? WaitEnd::Ready : WaitEnd::PeerGone;
    int64_t sleep_ns = kPeerCheckNs;
    if (ctx.deadline_ns >= 0) {
      int64_t left = ctx.deadline_ns - steady_now_ns();
      if (left <= 0) {  // poll(0) on a dead peer must say so, as a socket's would
        if (ready()) return WaitEnd::Ready;
        return gone() ? (ready() ? WaitEnd::Ready : WaitEnd::PeerGone) : WaitEnd::Timeout;
      }
      sleep_ns = std::min(left, sleep_ns);
    }
    sleeps->store(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!ready()) futex_wait(sleeps, 1, sleep_ns);
    sleeps->store(0, std::memory_order_relaxed);
    if (ready()) return WaitEnd::Ready;
    if (ctx.closed->load(std::memory_order_acquire)) return WaitEnd::Closed;
    if (wait_interrupted()) return WaitEnd::Interrupted;  // Note [interruptible waits] in base/interrupt.h
    if (gone()) return ready() ? WaitEnd::Ready : WaitEnd::PeerGone;
  }
}

// Wake the other side if it said it sleeps (Note [ring wait]).
void wake_if_sleeping(std::atomic<uint32_t>* sleeps) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleeps->load(std::memory_order_relaxed) != 0) {
    sleeps->store(0, std::memory_order_relaxed);
    futex_wake_all(sleeps);
  }
}

}  // namespace

int64_t ring_spin_ns() { return g_spin_ns.load(std::memory_order_relaxed); }

void set_ring_spin_ns(int64_t ns) {
  TORCH_IPC_CHECK_VALUE(ns >= 0 && ns <= 1'000'000'000, "torch_ipc: a spin budget is 0 .. 1 s, not ", ns, " ns");
  g_spin_ns.store(ns, std::memory_order_relaxed);
}

void throw_corrupt_ring(const char* which, uint64_t head, uint64_t tail, uint64_t capacity) {
  throw OsError(EPROTO, str("torch_ipc: the channel's ", which, " ring holds impossible indices (head ", head,
                            ", tail ", tail, ", capacity ", capacity,
                            "): its shared memory was written over; the channel cannot be used any more"));
}

// ---- producer

uint64_t RingWriter::room(uint64_t head) const {
  uint64_t tail = c_->tail.load(std::memory_order_acquire);
  if (head - tail > capacity_) throw_corrupt_ring("outgoing", head, tail, capacity_);
  return capacity_ - (head - tail);
}

void RingWriter::publish(uint64_t head) {
  c_->head.store(head, std::memory_order_release);
  wake_if_sleeping(&c_->reader_sleeps);
}

namespace {

// One byte into a bell of our own (non-blocking: Note [private bells] in
// ring_segment.cpp). EAGAIN: the pipe is full, so the bell is rung already.
void ring(int bell_fd) {
  const char one = 1;
  while (write(bell_fd, &one, 1) < 0 && errno == EINTR) {
  }
}

// Empty a bell of our own, in a bounded number of reads: a peer that keeps
// ringing cannot keep us here.
void empty(int bell_fd) {
  char sink[256];
  for (int i = 0; i < 16; ++i) {
    ssize_t n = ::read(bell_fd, sink, sizeof(sink));
    if (n < 0 && errno == EINTR) continue;
    if (n < ssize_t(sizeof(sink))) return;
  }
}

}  // namespace

void RingWriter::ring_bell() { ring(bell_fd_); }

WaitEnd RingWriter::send(const void* payload, size_t size, const WaitContext& ctx, uint64_t* written) {
  // Note [fd wake-ups] in channel.cpp: count the message, then look at the flag.
  c_->messages_begun.fetch_add(1, std::memory_order_seq_cst);
  if (c_->fd_wakeups.load(std::memory_order_seq_cst) != 0) ring_bell();
  uint64_t frame = size;  // little endian on every platform torch_ipc builds for
  const uint8_t* parts[2] = {reinterpret_cast<const uint8_t*>(&frame), static_cast<const uint8_t*>(payload)};
  size_t sizes[2] = {sizeof(frame), size};
  uint64_t head = c_->head.load(std::memory_order_relaxed);
  const uint64_t start = head;
  for (int p = 0; p < 2; ++p) {
    const uint8_t* src = parts[p];
    size_t left = sizes[p];
    while (left > 0) {
      uint64_t free = room(head);
      if (free == 0) {
        publish(head);
        WaitEnd end = wait_for([&] { return room(head) > 0; }, &c_->writer_sleeps, ctx);
        if (end != WaitEnd::Ready) {
          if (written) *written = head - start;  // all of it published before the wait
          return end;
        }
        continue;
      }
      size_t n = size_t(std::min<uint64_t>(free, left));
      size_t at = size_t(head & (capacity_ - 1));
      size_t first = std::min(n, size_t(capacity_ - at));
      std::memcpy(data_ + at, src, first);
      std::memcpy(data_, src + first, n - first);
      head += n;
      src += n;
      left -= n;
    }
  }
  publish(head);
  return WaitEnd::Ready;
}

// ---- consumer

uint64_t RingReader::available(uint64_t tail) const {
  uint64_t head = c_->head.load(std::memory_order_acquire);
  if (head - tail > capacity_) throw_corrupt_ring("incoming", head, tail, capacity_);
  return head - tail;
}

void RingReader::copy_out(void* out, uint64_t tail, size_t n) const {
  if (out == nullptr) return;
  size_t at = size_t(tail & (capacity_ - 1));
  size_t first = std::min(n, size_t(capacity_ - at));
  std::memcpy(out, data_ + at, first);
  std::memcpy(static_cast<uint8_t*>(out) + first, data_, n - first);
}

void RingReader::consume(uint64_t tail) {
  c_->tail.store(tail, std::memory_order_release);
  wake_if_sleeping(&c_->writer_sleeps);
}

WaitEnd RingReader::wait_readable(const WaitContext& ctx) {
  uint64_t tail = c_->tail.load(std::memory_order_relaxed);
  return wait_for([&] { return available(tail) > 0; }, &c_->reader_sleeps, ctx);
}

WaitEnd RingReader::read(void* out, size_t size, const WaitContext& ctx) {
  uint64_t tail = c_->tail.load(std::memory_order_relaxed);
  auto* dst = static_cast<uint8_t*>(out);
  while (size > 0) {
    uint64_t have = available(tail);
    if (have == 0) {
      WaitEnd end = wait_for([&] { return available(tail) > 0; }, &c_->reader_sleeps, ctx);
      if (end != WaitEnd::Ready) return end;
      continue;
    }
    size_t n = size_t(std::min<uint64_t>(have, size));
    copy_out(dst, tail, n);
    tail += n;
    if (dst != nullptr) dst += n;
    size -= n;
    consume(tail);
  }
  return WaitEnd::Ready;
}

bool RingReader::try_read(void* out, size_t size) {
  uint64_t tail = c_->tail.load(std::memory_order_relaxed);
  if (available(tail) < size) return false;
  copy_out(out, tail, size);
  consume(tail + size);
  return true;
}

void RingReader::message_done() {
  c_->messages_read.store(c_->messages_read.load(std::memory_order_relaxed) + 1, std::memory_order_seq_cst);
  if (c_->fd_wakeups.load(std::memory_order_relaxed) != 0) rearm_bell();
}

void RingReader::rearm_bell() {
  empty(bell_fd_);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (c_->messages_begun.load(std::memory_order_seq_cst) > c_->messages_read.load(std::memory_order_relaxed))
    ring(bell_fd_);
}

void RingReader::enable_fd_wakeups() {
  c_->fd_wakeups.store(1, std::memory_order_seq_cst);
  rearm_bell();
}

}  // namespace torch_ipc
