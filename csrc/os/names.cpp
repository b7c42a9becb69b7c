#include "os/names.h"

#include <cerrno>
#include <cstdio>
#include <deque>
#include <mutex>
#include <sys/random.h>

#include "base/errors.h"

namespace torch_ipc {
namespace {

std::mutex queued_mu;
std::deque<uint64_t>* queued = new std::deque<uint64_t>();  // tests only

std::string hex(uint64_t value, int digits) {
  char text[17];
  std::snprintf(text, sizeof(text), "%0*llx", digits, static_cast<unsigned long long>(value));
  return text;
}

std::string prefix(const ProcessId& owner) {
  return "torch_ipc." + std::to_string(owner.pid) + "." + std::to_string(owner.start_time) + ".";
}

// A strict reader of the names above: decimal and lowercase hex fields of
// exact shapes, nothing left over.
struct NameReader {
  std::string_view s;
  size_t at = 0;
  bool ok = true;

  bool literal(const char* text) {
    for (; ok && *text; ++text, ++at) ok = at < s.size() && s[at] == *text;
    return ok;
  }
  uint64_t decimal(int max_digits) {
    uint64_t v = 0;
    int n = 0;
    while (ok && at < s.size() && s[at] >= '0' && s[at] <= '9' && n < max_digits) {
      v = v * 10 + static_cast<uint64_t>(s[at++] - '0');
      ++n;
    }
    ok = ok && n > 0 && (n == 1 || s[at - n] != '0');
    return v;
  }
  uint64_t hex(int digits) {
    uint64_t v = 0;
    for (int i = 0; ok && i < digits; ++i, ++at) {
      const char c = at < s.size() ? s[at] : '\0';
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      ok = d >= 0;
      v = v << 4 | static_cast<uint64_t>(d < 0 ? 0 : d);
    }
    return v;
  }
  bool done() const { return ok && at == s.size(); }
};

constexpr int kHostRandomDigits = 12;  // 48 bits: the name fits 63 bytes whatever the start time

}  // namespace

uint64_t os_random64() {
  {
    std::lock_guard<std::mutex> lock(queued_mu);
    if (!queued->empty()) {
      uint64_t v = queued->front();
      queued->pop_front();
      return v;
    }
  }
  uint64_t v = 0;
  ssize_t got;
  do got = getrandom(&v, sizeof(v), 0);
  while (got < 0 && errno == EINTR);
  if (got != static_cast<ssize_t>(sizeof(v))) throw_os_error("getrandom", "of 8 bytes");
  return v;
}

void queue_random_for_testing(const std::vector<uint64_t>& values) {
  std::lock_guard<std::mutex> lock(queued_mu);
  queued->insert(queued->end(), values.begin(), values.end());
}

std::string lease_segment_name(const ProcessId& owner, uint32_t segment) {
  return "/" + prefix(owner) + "L" + hex(segment, 8);
}

std::string host_segment_name(const ProcessId& owner, uint32_t anchor, uint64_t random) {
  return "/" + prefix(owner) + "H" + hex(anchor, 8) + "." +
         hex(random & ((uint64_t{1} << (4 * kHostRandomDigits)) - 1), kHostRandomDigits);
}

std::string fd_socket_name(const ProcessId& owner, uint32_t tag) { return prefix(owner) + hex(tag, 8) + ".fd"; }

std::string life_file_name(uint32_t key) { return "/torch_ipc.life." + hex(key, 8); }

std::string fd_socket_file_name(uint32_t key, uint32_t tag) {
  return "torch_ipc." + hex(key, 8) + "." + hex(tag, 8) + ".fd";
}

std::string anchor_file_name(const SharedFileName& f) {
  if (f.life) return life_file_name(f.anchor).substr(1);
  return lease_segment_name(ProcessId{f.pid, f.start_time}, f.anchor).substr(1);
}

std::optional<SharedFileName> parse_shared_file_name(std::string_view name) {
  NameReader r{name};
  SharedFileName out;
  r.literal("torch_ipc.");
  if (r.ok && name.substr(r.at, 5) == "life.") {
    r.literal("life.");
    out.life = true;
    out.anchor = static_cast<uint32_t>(r.hex(8));
    if (!r.done() || out.anchor == 0) return std::nullopt;
    return out;
  }
  const uint64_t pid = r.decimal(10);
  out.pid = static_cast<uint32_t>(pid);
  r.literal(".");
  out.start_time = r.decimal(20);
  r.literal(".");
  if (r.ok && r.at < name.size() && name[r.at] == 'L') {
    r.literal("L");
    out.lease = true;
    out.anchor = static_cast<uint32_t>(r.hex(8));
  } else {
    r.literal("H");
    out.anchor = static_cast<uint32_t>(r.hex(8));
    r.literal(".");
    r.hex(kHostRandomDigits);
  }
  if (!r.done() || pid == 0 || pid > UINT32_MAX) return std::nullopt;
  return out;
}

void throw_names_taken(const std::string& what) {
  throw OsError(EEXIST, "torch_ipc: " + std::to_string(kNameAttempts) + " random names for " + what +
                            " in a row were taken already (is another process filling "
                            "/dev/shm or the abstract socket namespace with torch_ipc names?)");
}

}  // namespace torch_ipc
