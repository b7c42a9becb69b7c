#include "features/kv/pool_lock.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/errors.h"
#include "base/interrupt.h"

#if defined(__GLIBC__) && __WORDSIZE == 64
#define TORCH_IPC_GLIBC_MUTEX 1  // the fields of Note [the pool's lock] are known
#endif

namespace torch_ipc {
namespace {

void set_attributes(pthread_mutexattr_t* attr) {
  pthread_mutexattr_init(attr);
  pthread_mutexattr_setpshared(attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(attr, PTHREAD_MUTEX_ROBUST);
}

#ifdef TORCH_IPC_GLIBC_MUTEX
static_assert(sizeof(__pthread_list_t) == 2 * sizeof(void*), "glibc's robust list link");

// The type word of the mutexes init_pool_mutex makes, learnt at load time
// (Note [no first use at fork] in base/fork.h).
const int kPoolMutexKind = [] {
  pthread_mutexattr_t attr;
  set_attributes(&attr);
  pthread_mutex_t m;
  pthread_mutex_init(&m, &attr);
  pthread_mutexattr_destroy(&attr);
  const int kind = m.__data.__kind;
  pthread_mutex_destroy(&m);
  return kind;
}();

uint32_t lock_word_owner(const pthread_mutex_t& m) {
  return static_cast<uint32_t>(__atomic_load_n(&m.__data.__lock, __ATOMIC_RELAXED)) & FUTEX_TID_MASK;
}
#endif

constexpr int64_t kLockSliceNs = 50'000'000;  // how late a Ctrl-C may be seen

timespec deadline_after(double seconds) {
  timespec t;
  clock_gettime(CLOCK_REALTIME, &t);  // pthread_mutex_timedlock's clock
  const double whole = std::floor(seconds);
  t.tv_sec += static_cast<time_t>(whole);
  t.tv_nsec += static_cast<long>((seconds - whole) * 1e9);
  if (t.tv_nsec >= 1000000000L) {
    t.tv_sec += 1;
    t.tv_nsec -= 1000000000L;
  }
  return t;
}

// Who holds the lock, as far as the segment says (its words may be anyone's).
std::string holder_description(const PoolHeader* h) {
  std::string who = "the lock word names no thread";
#ifdef TORCH_IPC_GLIBC_MUTEX
  if (uint32_t tid = lock_word_owner(h->mutex)) who = str("the lock word names thread ", tid, " as its holder");
#endif
  const uint32_t pid = h->locker_pid.load(), tid = h->locker_tid.load();
  if (pid != 0) return str(who, "; pid ", pid, " (thread ", tid, ") recorded taking it");
  return str(who, "; no process recorded taking it, so something wrote into the lock");
}

}  // namespace

void init_pool_mutex(pthread_mutex_t* mutex, const std::string& pool_name) {
  pthread_mutexattr_t attr;
  set_attributes(&attr);
  const int r = pthread_mutex_init(mutex, &attr);
  pthread_mutexattr_destroy(&attr);
  if (r != 0) throw os_error(r, "pthread_mutex_init", pool_name);
}

PoolMutex::PoolMutex(PoolHeader* h, double timeout_s, bool wait, const std::string& pool_name, bool interruptible)
    : h_(h) {
#ifdef TORCH_IPC_GLIBC_MUTEX
  const int kind = h->mutex.__data.__kind;
  if (kind != kPoolMutexKind)
    throw_pool_corrupted(pool_name, str("the type word of its lock is ", kind, ", not ", kPoolMutexKind));
#endif
  int r;
  if (wait) {
    // In slices, so that Ctrl-C ends the wait (Note [interruptible waits] in base/interrupt.h).
    const int64_t end = steady_now_ns() + static_cast<int64_t>((timeout_s > 0 ? timeout_s : 0) * 1e9);
    for (;;) {
      const int64_t left = end - steady_now_ns();
      const timespec deadline = deadline_after(static_cast<double>(std::clamp<int64_t>(left, 0, kLockSliceNs)) / 1e9);
      r = pthread_mutex_timedlock(&h->mutex, &deadline);
      if (r != ETIMEDOUT || left <= kLockSliceNs) break;
      if (interruptible && wait_interrupted()) throw WaitInterrupted();
    }
  } else {
    r = pthread_mutex_trylock(&h->mutex);
    if (r == EBUSY) return;
  }
  if (r == ETIMEDOUT)
    throw OsError(ETIMEDOUT, str("torch_ipc: KV pool ", pool_name, ": its lock was not released within ", timeout_s,
                                 " s (", holder_description(h),
                                 "). A member that is stopped (SIGSTOP, a debugger) or stuck while it holds "
                                 "the lock blocks the others; one that exits or dies releases it. "
                                 "SharedKVPool.lock_timeout sets the limit"));
  if (r == ENOTRECOVERABLE)
    throw_pool_corrupted(pool_name, "its lock is unrecoverable (a holder died and nobody repaired the tables)");
  if (r != 0 && r != EOWNERDEAD)
    throw_pool_corrupted(pool_name, str("its lock cannot be taken (", std::strerror(r), ")"));
  locked_ = true;
  owner_died_ = r == EOWNERDEAD;
#ifdef TORCH_IPC_GLIBC_MUTEX
  std::memcpy(robust_link_, &h->mutex.__data.__list, sizeof(robust_link_));
#endif
  h->locker_pid.store(static_cast<uint32_t>(getpid()));
  h->locker_tid.store(static_cast<uint32_t>(syscall(SYS_gettid)));
}

void PoolMutex::mark_consistent() {
  pthread_mutex_consistent(&h_->mutex);
  owner_died_ = false;
}

PoolMutex::~PoolMutex() {
  if (!locked_) return;
  h_->locker_pid.store(0);
  h_->locker_tid.store(0);
#ifdef TORCH_IPC_GLIBC_MUTEX
  std::memcpy(&h_->mutex.__data.__list, robust_link_, sizeof(robust_link_));
#endif
  // EPERM when another process overwrote the lock word meanwhile: the lock is
  // then the overwriter's to give back, and the next locker's to time out on.
  pthread_mutex_unlock(&h_->mutex);
}

}  // namespace torch_ipc
