#include "os/process.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <list>
#include <map>
#include <mutex>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

#include <c10/util/Exception.h>

#include "base/errors.h"
#include "base/fork.h"

namespace torch_ipc {
namespace {

// /proc/<pid>/stat (pid 0: /proc/self/stat) from field 3 (the state) on,
// into `fields`: 0, or the errno that kept us from reading it (ENOENT or
// ESRCH: there is no such process). The command name (field 2) may hold
// spaces and parentheses, so the fields start after the last ')'.
int read_stat_fields(uint32_t pid, std::string* fields) {
  char path[64];
  if (pid == 0)
    std::snprintf(path, sizeof(path), "/proc/self/stat");
  else
    std::snprintf(path, sizeof(path), "/proc/%u/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  char buf[1024];
  ssize_t n;
  do n = read(fd, buf, sizeof(buf) - 1);
  while (n < 0 && errno == EINTR);
  const int err = n < 0 ? errno : 0;
  close(fd);
  if (n < 0) return err;
  std::string line(buf, static_cast<size_t>(n));
  size_t close_paren = line.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= line.size()) return EIO;
  *fields = line.substr(close_paren + 2);
  return 0;
}

bool no_such_process(int err) { return err == ENOENT || err == ESRCH; }

// Note [start times across time namespaces]
// /proc/<pid>/stat's start time counts clock ticks since boot as the
// reader's time namespace sees boot: the kernel adds the reader's boottime
// offset. A producer in a container with its own time namespace (`unshare
// --time --boottime N`, CRIU's restores) and a consumer outside read two
// numbers for one process, and the consumer called a living producer dead.
// So identities carry start times as the initial time namespace counts
// them: what /proc says minus this process's boottime offset, in ticks
// (/proc/self/timens_offsets; none where the kernel has no time namespaces).
// An offset that is not a whole number of ticks (CRIU's) leaves a tick of
// doubt, so a start time within one tick of the recorded one is the same
// process: a pid recycled that soon would need pid_max forks in 20 ms.
int64_t boottime_offset_ticks = 0;  // this process's; set with its identity (after fork too)

int64_t read_boottime_offset_ticks() {
  std::FILE* f = std::fopen("/proc/self/timens_offsets", "r");
  if (f == nullptr) return 0;
  char clock[32] = {};
  long long sec = 0, nsec = 0;
  int64_t ticks = 0;
  while (std::fscanf(f, "%31s %lld %lld", clock, &sec, &nsec) == 3) {
    if (std::strcmp(clock, "boottime") != 0 && std::strcmp(clock, "7") != 0) continue;  // 7: CLOCK_BOOTTIME
    const long hz = sysconf(_SC_CLK_TCK) > 0 ? sysconf(_SC_CLK_TCK) : 100;
    const long double t = (static_cast<long double>(sec) + static_cast<long double>(nsec) / 1e9L) * hz;
    ticks = static_cast<int64_t>(t >= 0 ? t + 0.5L : t - 0.5L);
  }
  std::fclose(f);
  return ticks;
}

// Field 22 of /proc/<pid>/stat (the start time) from read_stat_fields'
// output, as the initial time namespace counts it (Note [start times across
// time namespaces]).
uint64_t start_time_in(const std::string& fields) {
  const char* p = fields.c_str();  // field 3
  for (int field = 3; field < 22 && *p; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return 0;
    ++p;
  }
  const int64_t seen = static_cast<int64_t>(std::strtoull(p, nullptr, 10));
  return static_cast<uint64_t>(std::max<int64_t>(seen - boottime_offset_ticks, 1));
}

// Whether a start time read now is the recorded one (within the tick of doubt).
bool same_start(uint64_t read, uint64_t recorded) {
  return read == recorded || read + 1 == recorded || read == recorded + 1;
}

// The start time of `pid` (0: this process); 0 when it cannot be read.
uint64_t start_time_of(uint32_t pid) {
  std::string fields;
  return read_stat_fields(pid, &fields) == 0 ? start_time_in(fields) : 0;
}

// What /proc says of `p`: alive with this start time, dead (no such process,
// or another start time: the pid was recycled), or unknown (could not read).
LifeCheck life_from_proc(const ProcessId& p) {
  std::string fields;
  const int err = read_stat_fields(p.pid, &fields);
  if (err != 0) return no_such_process(err) ? LifeCheck{Life::Dead, 0} : LifeCheck{Life::Unknown, err};
  return {same_start(start_time_in(fields), p.start_time) ? Life::Alive : Life::Dead, 0};
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A boot id we could not read must not pass as one: every descriptor would
// then carry zeros, and zeros match on any machine.
Uuid read_boot_id() {
  const char* path = "/proc/sys/kernel/random/boot_id";
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) throw_os_error("fopen", path);
  char text[64] = {};
  const bool got = std::fgets(text, sizeof(text), f) != nullptr;
  std::fclose(f);
  Uuid id{};
  int n = 0;
  for (size_t i = 0; got && text[i] != '\0' && n < 32; ++i) {
    if (text[i] == '-') continue;
    const int d = hex_digit(text[i]);
    if (d < 0) break;
    id[n / 2] = static_cast<uint8_t>(id[n / 2] << 4 | d);
    ++n;
  }
  if (n != 32)
    throw OsError(EIO, std::string("torch_ipc: ") + path + " holds no boot id (read: '" +
                           std::string(text, std::strcspn(text, "\n")) + "')");
  return id;
}

// Note [whose pid]
// getpid() counts in this process's PID namespace, /proc/<pid> in the
// namespace /proc was mounted for: they differ after `unshare --pid --fork`
// without --mount-proc. A pid is checked in /proc only when both are the
// namespace the identity was made in; so the namespace is known only when
// /proc/self is getpid() (then /proc/self/ns/pid is ours), and 0 otherwise,
// which makes every peer judge this process by its life file.
uint32_t read_pid_namespace() {
  char self[32] = {};
  const ssize_t n = readlink("/proc/self", self, sizeof(self) - 1);
  if (n <= 0 || std::strtoul(self, nullptr, 10) != static_cast<unsigned long>(getpid())) return 0;
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0 || st.st_ino > UINT32_MAX) return 0;
  return static_cast<uint32_t>(st.st_ino);
}

// Our start time from /proc/self, which is this process whichever namespace
// /proc was mounted for (/proc/<getpid()> may be another: Note [whose pid]).
ProcessId this_process() {
  boottime_offset_ticks = read_boottime_offset_ticks();
  return ProcessId{static_cast<uint32_t>(getpid()), start_time_of(0), 0, read_pid_namespace()};
}

// Made at load, not at first use (Note [no first use at fork] in fork.h).
ProcessId self_identity = this_process();
std::atomic<bool> self_has_life{false};

ProcessId& identity() { return self_identity; }
}  // namespace

const ProcessId& self_process() {
  ProcessId& id = identity();
  if (!self_has_life.load()) {
    // Made once (make_life_file serialises), published before the flag.
    const uint32_t key = make_life_file(id);
    if (key != 0 && !self_has_life.load()) {
      id.life = key;
      self_has_life.store(true);
    }
  }
  return id;
}

uint32_t own_pid_namespace() { return identity().pidns; }

bool pid_visible(const ProcessId& p) {
  if (p.pidns == 0 && p.life == 0) return true;  // an identity from before namespaces were recorded
  return p.pidns != 0 && p.pidns == identity().pidns;
}

void reset_identity_after_fork() {
  identity() = this_process();
  self_has_life.store(false);
}
const AfterForkInChild reset_identity(&reset_identity_after_fork, ForkStage::Identity);

const Uuid& boot_id() {
  static const Uuid id = read_boot_id();
  return id;
}

// Note [liveness through pidfd]
// Every load asks whether its producer still lives; reading /proc/<pid>/stat
// each time costs ~10 us. The first check of a process reads /proc once and
// opens a pidfd, which becomes readable when that very process exits, so
// later checks are one poll() and a recycled pid can never pass.
//
// Note [bounded pidfd cache]
// The pidfds are an LRU cache of kCachedPidfds: a descriptor names any pid it
// likes, and one kept fd per named process would let a sender use up the
// receiver's fd table. An evicted process is asked of /proc again next time.
namespace {
constexpr size_t kCachedPidfds = 32;

class PidfdCache {
 public:
  using Key = std::pair<uint32_t, uint64_t>;  // (pid, start time)

  // The cached pidfd of `key` (now the most recent), or -1.
  int find(const Key& key) {
    auto it = fds_.find(key);
    if (it == fds_.end()) return -1;
    order_.splice(order_.begin(), order_, it->second.second);
    return it->second.first;
  }

  void add(const Key& key, int fd) {
    order_.push_front(key);
    fds_.emplace(key, std::make_pair(fd, order_.begin()));
    if (fds_.size() > kCachedPidfds) forget(order_.back());
  }

  void forget(const Key& key) {
    auto it = fds_.find(key);
    if (it == fds_.end()) return;
    close(it->second.first);
    order_.erase(it->second.second);
    fds_.erase(it);
  }

  // Forget the processes whose pidfd is readable (they exited).
  void forget_exited() {
    std::vector<Key> gone;
    for (const auto& [key, entry] : fds_) {
      pollfd pfd{entry.first, POLLIN, 0};
      if (poll(&pfd, 1, 0) > 0) gone.push_back(key);
    }
    for (const Key& key : gone) forget(key);
  }

 private:
  std::list<Key> order_;  // most recently used first
  std::map<Key, std::pair<int, std::list<Key>::iterator>> fds_;
};

std::mutex pidfds_mu;
auto* pidfds = new PidfdCache();  // never destroyed (used at exit)

constexpr int kNoPidfd = -1;   // none opened (EMFILE, an old kernel): /proc's answer stands
constexpr int kRecycled = -2;  // the process exited and its pid was reused in between

// A pidfd of `p` once /proc said it is alive, or kNoPidfd, or kRecycled.
int open_pidfd_of(const ProcessId& p) {
  int fd = static_cast<int>(syscall(SYS_pidfd_open, p.pid, 0));
  if (fd < 0) return kNoPidfd;
  if (life_from_proc(p).life == Life::Dead) {
    close(fd);
    return kRecycled;
  }
  return fd;
}

// Today's check of a pid we can see: /proc, then a pidfd.
LifeCheck check_visible_process(const ProcessId& p) {
  const PidfdCache::Key key{p.pid, p.start_time};
  std::lock_guard<std::mutex> lock(pidfds_mu);
  int fd = pidfds->find(key);
  if (fd < 0) {
    LifeCheck proc = life_from_proc(p);
    if (proc.life != Life::Alive) return proc;
    fd = open_pidfd_of(p);
    if (fd == kRecycled) return {Life::Dead, 0};
    if (fd == kNoPidfd) return proc;  // /proc said alive
    pidfds->add(key, fd);
  }
  pollfd pfd{fd, POLLIN, 0};
  const int ready = poll(&pfd, 1, 0);
  if (ready == 0) return {Life::Alive, 0};
  // poll failed (EINTR, ENOMEM): that says nothing about the process; ask /proc.
  if (ready < 0) return life_from_proc(p);
  pidfds->forget(key);
  return {Life::Dead, 0};
}
}  // namespace

LifeCheck check_process(const ProcessId& p) {
  if (p.pid == 0) return {Life::Dead, 0};
  if (!pid_visible(p)) return p.life != 0 ? check_life_file(p) : LifeCheck{Life::Unknown, ESRCH};
  return check_visible_process(p);
}

bool process_alive(const ProcessId& p) { return check_process(p).life != Life::Dead; }

void forget_exited_processes() {
  std::lock_guard<std::mutex> lock(pidfds_mu);
  pidfds->forget_exited();
}

}  // namespace torch_ipc
