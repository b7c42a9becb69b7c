// The shared segment of a channel: two single-producer single-consumer byte
// rings, one per direction, in one memfd that is never linked into a file
// system, and the pipe per direction that wakes fd waiters (select, asyncio).
// Created by one end; the other receives the fds over an authenticated Unix
// socket (SCM_RIGHTS) or from its parent, and checks them before mapping
// (Note [channel segment trust]).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "base/unique_fd.h"

namespace torch_ipc {

// One direction's indices and wait words, each written by one side, each on a
// cache line of its own so that the producer and the consumer never share one.
struct RingControl {
  alignas(64) std::atomic<uint64_t> head;           // bytes published by the producer, ever
  std::atomic<uint64_t> messages_begun;             // messages the producer began (Note [fd wake-ups])
  std::atomic<uint32_t> writer;                     // who sends on it (Note [one process per end])
  std::atomic<int32_t> writer_pid;                  // its pid as its namespace counts it, for messages
  alignas(64) std::atomic<uint64_t> tail;           // bytes taken by the consumer, ever
  std::atomic<uint64_t> messages_read;              // messages the consumer finished
  std::atomic<uint32_t> reader;                     // who receives from it
  std::atomic<int32_t> reader_pid;                  // its pid, for messages
  alignas(64) std::atomic<uint32_t> reader_sleeps;  // futex word: 1 while the consumer sleeps
  alignas(64) std::atomic<uint32_t> writer_sleeps;  // futex word: 1 while the producer waits for room
  alignas(64) std::atomic<uint32_t> fd_wakeups;     // 1: the consumer wants its eventfd rung
};

struct ChannelHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t ring_bytes;
  RingControl rings[2];  // ring i is written by side i
};

inline constexpr uint64_t kChannelMagic = 0x474e495243504954ull;  // "TIPCRING"
inline constexpr uint32_t kChannelVersion = 3;
inline constexpr size_t kChannelHeaderBytes = 4096;
inline constexpr uint32_t kMinRingBytes = 4096;
inline constexpr uint32_t kMaxRingBytes = 1u << 30;

// The fds of a new segment: its memory and the bell (a pipe) of each direction.
struct ChannelFds {
  UniqueFd memory;
  UniqueFd bell[2];
};

class ChannelSegment {
 public:
  // A new segment of two rings of `ring_bytes` each (a power of two, 4 KiB ..
  // 1 GiB): memfd 0600, sized and sealed, header written.
  static ChannelFds create(uint32_t ring_bytes);
  // Map a segment received from the other end, after checking it and the
  // bells (Note [channel segment trust]); throws OsError (EPERM, EPROTO) when
  // a check fails. The fds stay the caller's.
  static std::unique_ptr<ChannelSegment> map(int memory_fd, uint32_t ring_bytes);
  ~ChannelSegment();
  ChannelSegment(const ChannelSegment&) = delete;
  ChannelSegment& operator=(const ChannelSegment&) = delete;

  RingControl* control(int ring) const { return &header()->rings[ring]; }
  uint8_t* data(int ring) const { return base_ + kChannelHeaderBytes + size_t(ring) * ring_bytes_; }
  uint32_t ring_bytes() const { return ring_bytes_; }  // process-local: never re-read from the segment

 private:
  ChannelSegment(uint8_t* base, uint32_t ring_bytes) : base_(base), ring_bytes_(ring_bytes) {}
  ChannelHeader* header() const { return reinterpret_cast<ChannelHeader*>(base_); }
  uint8_t* base_;
  uint32_t ring_bytes_;
};

size_t channel_segment_bytes(uint32_t ring_bytes);

// The checks map() makes of the memory fd (Note [channel segment trust]):
// the seals, then the size. `between_reads`, when given, runs between the two
// reads: a test's stand-in for a peer that acts there.
void check_channel_memory(int fd, uint32_t ring_bytes, const std::function<void()>& between_reads = nullptr);

// A bell of our own on the pipe that `fd` (received from the peer, or our
// parent) is an end of: a new open file description, read-write and
// non-blocking, that nobody else holds (Note [private bells]). Throws
// OsError(EPERM) when `fd` is not a pipe.
UniqueFd open_private_bell(int fd);

}  // namespace torch_ipc
