// The lock of a KV pool: its robust process-shared mutex, taken with a time
// limit, guarded against what another process may write into it.
#pragma once

#include <pthread.h>
#include <string>

#include "features/kv/pool_segment.h"

namespace torch_ipc {

// Note [the pool's lock]
// The mutex lives in the segment, so every attached process can write into
// it (Note [nothing trusted from the pool's segment] in pool_segment.h):
// - It is taken with a time limit (pthread_mutex_timedlock). A holder that
//   never lets go (stopped by SIGSTOP or a debugger, hung, or a lock word
//   overwritten to name a thread that never took it) is a TimeoutError after
//   the limit, naming the thread the lock word names and the process the
//   pool recorded taking it, instead of every member hanging for good.
// - Its type word is compared with the one this process makes before every
//   lock: glibc picks its locking protocol by that word and aborts on states
//   that the priority-inheritance protocols reach with a foreign lock word.
// - glibc links a robust mutex its thread holds into that thread's robust
//   list through two pointers inside the mutex, and follows them at unlock.
//   The holder saves them once it has the lock and writes them back before
//   it unlocks, so it never follows pointers that another process wrote.
// A process dying while it holds the lock is the robust mutex's own case
// (EOWNERDEAD: the next holder repairs, Note [block ownership under a robust
// mutex] in block_allocator.cpp).

// Make `mutex` robust and process-shared. Throws OsError.
void init_pool_mutex(pthread_mutex_t* mutex, const std::string& pool_name);

class PoolMutex {
 public:
  // Take the lock of `h`: within timeout_s seconds when `wait`, else only if
  // it is free now (locked() tells). Throws OsError(ETIMEDOUT) saying who
  // holds it, PoolCorrupted when the mutex is not one this process made,
  // WaitInterrupted when `interruptible` and Ctrl-C ended the wait (Note
  // [interruptible waits] in base/interrupt.h).
  PoolMutex(PoolHeader* h, double timeout_s, bool wait, const std::string& pool_name, bool interruptible = true);
  ~PoolMutex();
  PoolMutex(const PoolMutex&) = delete;
  PoolMutex& operator=(const PoolMutex&) = delete;

  bool locked() const { return locked_; }
  // The previous holder died holding it: repair, then mark_consistent().
  bool owner_died() const { return owner_died_; }
  void mark_consistent();

 private:
  PoolHeader* h_;
  bool locked_ = false;
  bool owner_died_ = false;
  void* robust_link_[2] = {nullptr, nullptr};  // Note [the pool's lock]
};

}  // namespace torch_ipc
