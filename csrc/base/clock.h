// The one clock for deadlines, ages and idle times: the steady (monotonic)
// clock in nanoseconds, comparable across the threads of one process.
#pragma once

#include <chrono>
#include <cstdint>

namespace torch_ipc {

inline int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace torch_ipc
