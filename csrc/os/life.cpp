#include "os/life.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <fcntl.h>
#include <memory>
#include <mutex>
#include <unistd.h>
#include <unordered_map>

#include "base/errors.h"
#include "base/fork.h"

#include "os/names.h"
#include "os/shm.h"
#include "os/sweep.h"

namespace torch_ipc {
namespace {

constexpr uint32_t kKeyBits = 0x7FFFFFFF;  // bit 31 marks a forwarder's word (refcount.cpp)

struct OwnLife {
  std::mutex mu;
  std::unique_ptr<ShmMapping> file;
  std::atomic<uint32_t> key{0};  // set once, read without the mutex
  int error = 0;
  std::chrono::steady_clock::time_point failed_at{};  // the last attempt that failed
};
// After a failed attempt (a full /dev/shm) the next waits this long: every
// self_process() asks, and each attempt costs several system calls.
constexpr std::chrono::seconds kRetryAfter{1};
OwnLife& own() { return *process_state<OwnLife>(); }

// Note [life file cache]
// A load asks whether its producer lives. Opening the producer's life file
// each time costs four system calls; an fd kept open makes it two (fstat,
// F_OFD_GETLK): ~1 us a check from Python, against ~0.4 us for the pidfd
// poll of a visible pid, which is why a visible pid keeps that path. The
// kept fd also keeps judging the very file that was checked once against the
// identity (a name swept and made again by another process is another file). At most
// kCachedFiles are kept: a descriptor names any key it likes, and one fd per
// key would let a sender use up the receiver's fd table; past that the cache
// is emptied and starts again.
constexpr size_t kCachedFiles = 64;

struct PeerFiles {
  std::mutex mu;
  std::unordered_map<uint32_t, int> fds;  // key -> fd of a file judged to be its owner's
  void forget(uint32_t key) {
    auto it = fds.find(key);
    if (it == fds.end()) return;
    close(it->second);
    fds.erase(it);
  }
};
PeerFiles& peers() { return *process_state<PeerFiles>(); }

LifeCheck verdict(Anchor a, int error = 0) {
  if (a == Anchor::Alive) return {Life::Alive, 0};
  if (a == Anchor::Dead) return {Life::Dead, 0};
  return {Life::Unknown, error};
}

// Open `key`'s life file: an fd, or a verdict without one.
int open_life_file(uint32_t key, LifeCheck* out) {
  const std::string path = "/dev/shm" + life_file_name(key);
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd >= 0) return fd;
  const int err = errno;
  *out = err == ENOENT || err == ELOOP ? LifeCheck{Life::Dead, 0} : LifeCheck{Life::Unknown, err};
  return -1;
}

// The fd of `key`'s file, opened (and checked to be `p`'s when `p` names a
// pid) and cached if need be; -1 with `out` set when there is no fd to judge.
int cached_fd(PeerFiles& c, uint32_t key, const ProcessId* p, LifeCheck* out) {
  auto it = c.fds.find(key);
  if (it != c.fds.end()) return it->second;
  const int fd = open_life_file(key, out);
  if (fd < 0) return -1;
  if (p != nullptr) {
    const std::optional<bool> made = segment_made_by(fd, ProcessId{p->pid, p->start_time});
    if (!made || !*made) {
      const int err = errno;
      close(fd);
      *out = made ? LifeCheck{Life::Dead, 0} : LifeCheck{Life::Unknown, err};
      return -1;
    }
  }
  if (c.fds.size() >= kCachedFiles) {
    for (auto& [k, f] : c.fds) close(f);
    c.fds.clear();
  }
  c.fds.emplace(key, fd);
  return fd;
}

LifeCheck check(uint32_t key, const ProcessId* p) {
  key &= kKeyBits;
  if (key == 0) return {Life::Unknown, ESRCH};
  if (key == own().key.load()) return {Life::Alive, 0};
  PeerFiles& c = peers();
  std::lock_guard<std::mutex> lock(c.mu);
  LifeCheck out{Life::Unknown, 0};
  const int fd = cached_fd(c, key, p, &out);
  if (fd < 0) return out;
  const Anchor a = judge_open_anchor(fd);
  const int err = errno;
  if (a == Anchor::Dead) c.forget(key);
  return verdict(a, err);
}

// A forked child: its copy of the parent's lock fd closed (else the parent
// would look alive as long as the child lives), its own file made when first
// needed; the cached peer fds closed (Note [reading the parent's state after fork]).
void life_forget_after_fork() {
  {
    std::unique_lock<std::mutex> lock(own().mu, std::try_to_lock);
    if (lock.owns_lock() && own().file) own().file->disown();
  }
  {
    std::unique_lock<std::mutex> lock(peers().mu, std::try_to_lock);
    if (lock.owns_lock())
      for (auto& [k, f] : peers().fds) close(f);
  }
  forget_after_fork<OwnLife>();
  forget_after_fork<PeerFiles>();
}
const AfterForkInChild reset_life_after_fork(&life_forget_after_fork);

}  // namespace

uint32_t make_life_file(const ProcessId& self) noexcept {
  OwnLife& o = own();
  std::lock_guard<std::mutex> lock(o.mu);
  if (o.key.load() != 0) return o.key.load();
  const auto now = std::chrono::steady_clock::now();
  if (o.error != 0 && now - o.failed_at < kRetryAfter) return 0;
  try {
    uint32_t key = 0;
    o.file = create_under_random_name("a life file", [&](uint64_t r) -> std::unique_ptr<ShmMapping> {
      key = static_cast<uint32_t>(r) & kKeyBits;
      if (key == 0) return nullptr;
      return ShmMapping::create(life_file_name(key), 0, self, /*anchor=*/true);
    });
    o.key.store(key);
    o.error = 0;
  } catch (const OsError& e) {
    o.error = e.error_number;
  } catch (...) {
    o.error = ENOMEM;
  }
  if (o.error != 0) o.failed_at = now;
  return o.key.load();
}

int life_file_error() {
  std::lock_guard<std::mutex> lock(own().mu);
  return own().error;
}

LifeCheck check_life_file(const ProcessId& p) { return check(p.life, &p); }
LifeCheck check_life_key(uint32_t key) { return check(key, nullptr); }

bool life_key_alive(uint32_t key) { return check_life_key(key).life != Life::Dead; }

void unlink_life_file() noexcept {
  std::lock_guard<std::mutex> lock(own().mu);
  if (own().file) own().file->unlink();
}

size_t cached_life_file_count() {
  std::lock_guard<std::mutex> lock(peers().mu);
  return peers().fds.size();
}

}  // namespace torch_ipc
