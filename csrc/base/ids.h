// The identities every layer names: a process (pid + start time), a GPU or a
// boot (16-byte UUID), and the 64-byte opaque handles the CUDA driver hands out.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

namespace torch_ipc {

using Uuid = std::array<uint8_t, 16>;
using Handle64 = std::array<uint8_t, 64>;

// A hash of a handle's bytes, for tables keyed by handle (no cryptography:
// handles are not chosen to collide).
inline uint64_t handle_hash(const Handle64& h) {
  uint64_t out = 0;
  for (size_t i = 0; i < h.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, h.data() + i, 8);
    out = (out ^ word) * 0x9E3779B97F4A7C15ull;
  }
  return out ^ (out >> 29);
}

// The identity of a process: pid plus its start time in clock ticks since
// boot, so a recycled pid is never mistaken for the producer.
struct ProcessId {
  uint32_t pid = 0;
  uint64_t start_time = 0;
  bool operator==(const ProcessId& o) const { return pid == o.pid && start_time == o.start_time; }
  bool operator!=(const ProcessId& o) const { return !(*this == o); }
};

}  // namespace torch_ipc
