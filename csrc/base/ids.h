// The identities every layer names: a process (pid + start time), a GPU or a
// boot (16-byte UUID), and the 64-byte opaque handles the CUDA driver hands out.
#pragma once

#include <array>
#include <cstdint>

namespace torch_ipc {

using Uuid = std::array<uint8_t, 16>;
using Handle64 = std::array<uint8_t, 64>;

// The identity of a process: pid plus its start time in clock ticks since
// boot, so a recycled pid is never mistaken for the producer.
struct ProcessId {
  uint32_t pid = 0;
  uint64_t start_time = 0;
  bool operator==(const ProcessId& o) const { return pid == o.pid && start_time == o.start_time; }
  bool operator!=(const ProcessId& o) const { return !(*this == o); }
};

}  // namespace torch_ipc
