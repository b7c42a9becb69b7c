#include "os/process.h"

#include <poll.h>
#include <sys/syscall.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>

#include <c10/util/Exception.h>

#include "base/errors.h"
#include "base/fork.h"

namespace torch_ipc {
namespace {

// /proc/<pid>/stat from field 3 (the state) on; empty when there is no such
// process. The command name (field 2) may hold spaces and parentheses, so the
// fields start after the last ')'.
std::string stat_fields(uint32_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%u/stat", pid);
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return {};
  size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return {};
  return line.substr(close + 2);
}

// Field 22 of /proc/<pid>/stat; 0 when the process does not exist.
uint64_t start_time_of(uint32_t pid) {
  std::string fields = stat_fields(pid);
  if (fields.empty()) return 0;
  const char* p = fields.c_str();  // field 3
  for (int field = 3; field < 22 && *p; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return 0;
    ++p;
  }
  return std::strtoull(p, nullptr, 10);
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

}  // namespace

namespace {
// Made at load, not at first use (Note [no first use at fork] in fork.h).
ProcessId self_identity{static_cast<uint32_t>(getpid()), start_time_of(static_cast<uint32_t>(getpid()))};

ProcessId& identity() { return self_identity; }
}  // namespace

const ProcessId& self_process() { return identity(); }

void reset_identity_after_fork() {
  identity() = ProcessId{static_cast<uint32_t>(getpid()), start_time_of(static_cast<uint32_t>(getpid()))};
}
const AfterForkInChild reset_identity(&reset_identity_after_fork, ForkStage::Identity);

const Uuid& boot_id() {
  static const Uuid id = read_boot_id();
  return id;
}

bool pid_alive(uint32_t pid) {
  if (pid == 0 || (kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM)) return false;
  // A killed process that its parent has not reaped yet is a zombie: dead to us.
  std::string fields = stat_fields(pid);
  return fields.empty() || fields[0] != 'Z';
}

// Note [liveness through pidfd]
// Every load asks whether its producer still lives; reading /proc/<pid>/stat
// each time costs ~10 us. The first check of a process reads /proc once and
// opens a pidfd, which becomes readable when that very process exits, so
// later checks are one poll() and a recycled pid can never pass.
namespace {
std::mutex pidfds_mu;
// (pid, start time) -> an open pidfd of that process; never destroyed (used at exit).
auto* pidfds = new std::map<std::pair<uint32_t, uint64_t>, int>();
}  // namespace

bool process_alive(const ProcessId& p) {
  if (p.pid == 0) return false;
  auto key = std::make_pair(p.pid, p.start_time);
  std::lock_guard<std::mutex> lock(pidfds_mu);
  auto it = pidfds->find(key);
  if (it == pidfds->end()) {
    if (start_time_of(p.pid) != p.start_time) return false;
    int fd = static_cast<int>(syscall(SYS_pidfd_open, p.pid, 0));
    if (fd < 0) return true;  // no pidfd here: /proc said alive
    if (start_time_of(p.pid) != p.start_time) {  // exited and recycled in between
      close(fd);
      return false;
    }
    it = pidfds->emplace(key, fd).first;
  }
  pollfd pfd{it->second, POLLIN, 0};
  const int ready = poll(&pfd, 1, 0);
  if (ready == 0) return true;
  // poll failed (EINTR, ENOMEM): that says nothing about the process; ask /proc.
  if (ready < 0) return start_time_of(p.pid) == p.start_time;
  close(it->second);
  pidfds->erase(it);
  return false;
}

void forget_exited_processes() {
  std::lock_guard<std::mutex> lock(pidfds_mu);
  for (auto it = pidfds->begin(); it != pidfds->end();) {
    pollfd pfd{it->second, POLLIN, 0};
    if (poll(&pfd, 1, 0) > 0) {  // readable: that process has exited
      close(it->second);
      it = pidfds->erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace torch_ipc
