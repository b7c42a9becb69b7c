// Waiting on a 32-bit word of shared memory: FUTEX_WAIT / FUTEX_WAKE (not the
// private variants: the word lives in a segment that two processes map).
#pragma once

#include <atomic>
#include <cstdint>

namespace torch_ipc {

// Sleep while `*word == expected`, at most `timeout_ns` (< 0: no limit).
// Returns on a wake, a timeout, a signal, or when the word already differs;
// the caller re-checks what it waits for in every case.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);

// Wake every thread sleeping on `word` (any process).
void futex_wake_all(std::atomic<uint32_t>* word);

// A pause for spin loops: tells the core that this thread spins.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace torch_ipc
