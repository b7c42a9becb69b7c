#include "os/futex.h"

#include <climits>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace torch_ipc {

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  struct timespec limit{};
  struct timespec* limit_ptr = nullptr;
  if (timeout_ns >= 0) {
    limit.tv_sec = timeout_ns / 1000000000;
    limit.tv_nsec = timeout_ns % 1000000000;
    limit_ptr = &limit;
  }
  // EAGAIN (the word changed), EINTR and ETIMEDOUT all mean: look again.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, limit_ptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace torch_ipc
