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
// boot, so a recycled pid is never mistaken for the producer; plus what lets
// a process that cannot see that pid judge it (Note [life files] in
// os/life.h): the key of its life file (0: it has none) and the inode of
// the PID namespace its pid is counted in (0: unknown).
struct ProcessId {
  uint32_t pid = 0;
  uint64_t start_time = 0;
  uint32_t life = 0;
  uint32_t pidns = 0;
  // Two processes of two PID namespaces may share a pid and a start time (two
  // containers' first processes, started in one clock tick); their life keys
  // tell them apart. A key of 0 is "not known", as in an identity from Python.
  bool operator==(const ProcessId& o) const {
    return pid == o.pid && start_time == o.start_time && (life == 0 || o.life == 0 || life == o.life);
  }
  bool operator!=(const ProcessId& o) const { return !(*this == o); }
};

}  // namespace torch_ipc
