// Moving shareable handles between processes: the fd server thread, its wire
// protocol (SOCK_SEQPACKET + SCM_RIGHTS), the client, and pidfd_getfd pulls.
#include "os/fd_passing.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <mutex>
#include <optional>
#include <poll.h>
#include <set>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>

#include <c10/util/Exception.h>

#include "base/clock.h"
#include "base/env.h"
#include "base/errors.h"
#include "base/fork.h"
#include "base/interrupt.h"
#include "base/str.h"

#include "os/names.h"
#include "os/process.h"
#include "os/socket_dir.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace torch_ipc {

namespace {

// Note [fd server protocol]
// One SOCK_SEQPACKET connection per request, so message boundaries (and the
// SCM_RIGHTS attached to each message) are kept. The client sends a Request;
// the server answers with one or more Reply messages, each a ReplyHeader, then
// `count` sizes (u64), then `count` 64-byte blobs when kHasBlobs, with `count`
// fds attached when kHasFds. A refusal is one Reply with status != 0 and no
// items. The server serves one connection at a time with short timeouts, so
// a client that stalls delays others by at most a few seconds.
constexpr uint32_t kRequestMagic = 0x44464954;  // "TIFD"
constexpr uint32_t kReplyMagic = 0x52464954;    // "TIFR"
constexpr uint32_t kProtocol = 1;
constexpr uint32_t kBatch = 64;  // items per message (SCM_MAX_FD is 253)
constexpr uint32_t kHasFds = 1, kHasBlobs = 2;

struct Request {
  uint32_t magic;
  uint32_t version;
  uint64_t id;
};
struct ReplyHeader {
  uint32_t magic;
  int32_t status;  // 0 or an errno value
  uint32_t total;
  uint32_t first;
  uint32_t count;
  uint32_t flags;
};
constexpr size_t kMaxReply = sizeof(ReplyHeader) + kBatch * (8 + 64);
// How long a client waits for each reply: TORCH_IPC_FD_ANSWER_SECONDS, read at
// load (Note [checked settings]), else 10. Not 0: SO_RCVTIMEO takes 0 as never.
const double g_answer_seconds = env_number("TORCH_IPC_FD_ANSWER_SECONDS", 10, 0.001, 1e6);

struct Server {
  std::mutex mu;
  std::unordered_map<uint64_t, std::vector<PublishedItem>> published;
  std::unordered_map<uint64_t, std::vector<UniqueFd>> once;  // Note [fds for one fetch]
  pid_t started_by = 0;     // the pid whose thread serves; another pid (a fork) restarts
  uint32_t tag = 0;         // the random part of its socket name, Note [fd server name]
  int listening = -1;       // its socket
  int listening_path = -1;  // its socket at a path (Note [fd server at a path]), or -1
  std::string path;         // that socket's path while it is linked
  std::atomic<int64_t> served{0}, refused{0};
};

// The thread uses it until the process ends; a forked child has none.
Server& server() { return *process_state<Server>(); }

// Producers whose fds pidfd_getfd was refused: fd_fetch asks their socket.
struct RefusedOwners {
  std::mutex mu;
  std::set<std::pair<uint32_t, uint64_t>> owners;
};

std::atomic<int64_t> via_socket{0}, via_pidfd{0}, pidfd_refused{0};

sockaddr_un address_of(const std::string& name, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  TORCH_IPC_CHECK(name.size() + 1 <= sizeof(addr.sun_path), "torch_ipc: socket name too long");
  addr.sun_path[0] = '\0';  // abstract namespace: no file, gone with the process
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

// 0, or the errno of the setsockopt that failed.
timeval seconds_timeval(double seconds) {
  const auto whole = static_cast<time_t>(seconds);
  return timeval{whole, static_cast<suseconds_t>((seconds - static_cast<double>(whole)) * 1e6)};
}

int set_timeouts(int fd, double recv_s, double send_s) {
  const timeval r = seconds_timeval(recv_s), s = seconds_timeval(send_s);
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &r, sizeof(r)) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &s, sizeof(s)) != 0)
    return errno;
  return 0;
}

bool send_reply(int sock, const ReplyHeader& h, const PublishedItem* items, const int* fds) {
  char buf[kMaxReply];
  size_t n = 0;
  std::memcpy(buf, &h, sizeof(h));
  n += sizeof(h);
  for (uint32_t i = 0; i < h.count; ++i, n += 8) std::memcpy(buf + n, &items[i].size, 8);
  if (h.flags & kHasBlobs)
    for (uint32_t i = 0; i < h.count; ++i, n += 64) std::memcpy(buf + n, items[i].blob.data(), 64);
  iovec iov{buf, n};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kBatch)];
  if ((h.flags & kHasFds) && h.count > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * h.count);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * h.count);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * h.count);
  }
  ssize_t sent;
  do sent = sendmsg(sock, &msg, MSG_NOSIGNAL);
  while (sent < 0 && errno == EINTR);
  return sent == static_cast<ssize_t>(n);
}

void refuse(int sock, int status) {
  ++server().refused;
  ReplyHeader h{kReplyMagic, status, 0, 0, 0, 0};
  send_reply(sock, h, nullptr, nullptr);
}

// Note [a refusal is read]
// The server reads the request before it refuses anything: a Unix socket
// closed with a message unread resets its peer (ECONNRESET), and the client
// would see that instead of the refusal it was sent (EACCES for another uid).
void serve_one(int sock) {
  Server& s = server();
  // Without timeouts a stalled client would hold the server: refuse instead.
  if (int err = set_timeouts(sock, 2, 10)) return refuse(sock, err);
  Request req{};
  ssize_t got;
  do got = recv(sock, &req, sizeof(req), 0);
  while (got < 0 && errno == EINTR);
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    const int err = errno;
    return refuse(sock, err);
  }
  // Note [who may pull]: only processes of our own (effective) uid. A
  // descriptor is a capability (the id is random), but the uid check is the
  // boundary, as it is for ptrace and pidfd_getfd.
  if (cred.uid != geteuid()) return refuse(sock, EACCES);
  if (got != static_cast<ssize_t>(sizeof(req)) || req.magic != kRequestMagic || req.version != kProtocol)
    return refuse(sock, EPROTO);

  std::vector<PublishedItem> items;
  std::vector<UniqueFd> dups;  // sent, then closed here; the owner's fds stay put
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.published.find(req.id);
    if (it == s.published.end()) return refuse(sock, ENOENT);
    items = it->second;
    for (const auto& item : items) {
      if (item.fd < 0) continue;
      int d = fcntl(item.fd, F_DUPFD_CLOEXEC, 0);
      if (d < 0) {
        const int err = errno;
        return refuse(sock, err);
      }
      dups.emplace_back(d);
    }
  }
  bool with_fds = !dups.empty();
  if (with_fds && dups.size() != items.size()) return refuse(sock, EPROTO);
  bool with_blobs = !with_fds;
  std::vector<int> raw;
  for (auto& d : dups) raw.push_back(d.get());
  ++s.served;  // counted before the last send: the client may look at once
  for (uint32_t first = 0; first < items.size() || first == 0; first += kBatch) {
    uint32_t count = std::min<uint32_t>(kBatch, static_cast<uint32_t>(items.size()) - first);
    ReplyHeader h{kReplyMagic, 0,     static_cast<uint32_t>(items.size()),
                  first,       count, (with_fds ? kHasFds : 0u) | (with_blobs ? kHasBlobs : 0u)};
    if (!send_reply(sock, h, items.data() + first, with_fds ? raw.data() + first : nullptr)) {
      --s.served;
      return;
    }
    if (items.empty()) break;
  }
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.once.erase(req.id) != 0) s.published.erase(req.id);  // Note [fds for one fetch]
}

void serve_forever(int listener) {
  for (;;) {
    int sock = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (sock < 0) {
      if (errno == EBADF || errno == EINVAL) return;  // the listener is gone
      if (errno == EMFILE || errno == ENFILE || errno == ENOMEM) poll(nullptr, 0, 10);
      continue;
    }
    try {
      serve_one(sock);
    } catch (...) {
      // Nothing here throws by design; a bug must not end the thread.
    }
    ::close(sock);
  }
}

// A listening socket bound to @name; nothing when another socket holds the name.
std::optional<UniqueFd> listen_on(const std::string& name) {
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) throw_os_error("socket(AF_UNIX, SOCK_SEQPACKET)", "for the fd server");
  socklen_t len;
  sockaddr_un addr = address_of(name, &len);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    if (errno == EADDRINUSE) return std::nullopt;
    throw_os_error("bind", "of the fd server on @" + name);
  }
  if (listen(fd.get(), 128) != 0) throw_os_error("listen", "of the fd server on @" + name);
  return fd;
}

// A listening socket bound to the path `path`; nothing when the name exists.
std::optional<UniqueFd> listen_on_path(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() + 1 > sizeof(addr.sun_path))
    throw OsError(ENAMETOOLONG, "torch_ipc: the socket path " + path + " is longer than " +
                                    std::to_string(sizeof(addr.sun_path) - 1) +
                                    " bytes (set TORCH_IPC_SOCKET_DIR to a shorter folder)");
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) throw_os_error("socket(AF_UNIX, SOCK_SEQPACKET)", "for the fd server");
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno == EADDRINUSE) return std::nullopt;
    throw_os_error("bind", "of the fd server on " + path);
  }
  if (listen(fd.get(), 128) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    throw os_error(err, "listen", "of the fd server on " + path);
  }
  return fd;
}

// Note [fd server at a path]
// A consumer in another network namespace cannot reach the abstract socket,
// and one in another PID namespace cannot use pidfd_getfd; both can reach a
// socket in the socket folder (Note [socket folder] in socket_dir.h). So the
// server also listens there, named by its life key and its tag
// (torch_ipc.<key>.<tag>.fd): a consumer knows both from the descriptor. It
// is unlinked at exit; the file of one that died is removed by the next
// server start of this uid (its life file says it died). Where the folder
// cannot be used the server warns once and listens on its abstract socket only.
void listen_at_path_too(Server& s) {
  const uint32_t key = self_process().life;
  std::string why;
  const std::string dir = key == 0 ? "" : usable_socket_dir(/*create=*/true, &why);
  try {
    if (key == 0) why = "this process has no life file";
    if (dir.empty()) throw OsError(ENOENT, why);
    sweep_socket_dir(dir);
    const std::string path = dir + "/" + fd_socket_file_name(key, s.tag);
    std::optional<UniqueFd> listener = listen_on_path(path);
    if (!listener) throw OsError(EADDRINUSE, path + " exists already");
    s.path = path;
    s.listening_path = listener->get();
    std::thread(serve_forever, listener->release()).detach();
  } catch (const std::exception& e) {
    TORCH_WARN_ONCE("torch_ipc: the fd server listens on its abstract socket only (", e.what(),
                    "): consumers in another network or PID namespace cannot fetch VMM memory");
  }
}

// Note [fd server name]
// The server's abstract socket name has a random part (Note [names]), drawn
// again while the name is taken. Consumers find it in the export id, whose
// high half is that part and whose low half is random per id: the VMM handle
// field carries the id already, so the wire format did not change.
// Called with s.mu held.
void ensure_server(Server& s) {
  if (s.started_by == getpid()) return;
  std::optional<UniqueFd> listener = create_under_random_name("the fd server's socket", [&](uint64_t r) {
    s.tag = static_cast<uint32_t>(r);
    return listen_on(fd_socket_name(self_process(), s.tag));
  });
  s.listening = listener->get();
  std::thread(serve_forever, listener->release()).detach();  // lives as long as the process
  listen_at_path_too(s);
  s.started_by = getpid();
}

int pidfd_open(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }
int pidfd_getfd(int pidfd, int fd) { return static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0)); }

std::string pid_text(const ProcessId& p) { return "pid " + std::to_string(p.pid); }

const char* const kFdsLost = "its file descriptors can no longer be fetched";

// A failure talking to `owner` is ProducerGone when the owner has exited (the
// cause the user can act on), else `otherwise`, built with the errno the
// caller captured (process_alive() makes system calls of its own).
[[noreturn]] void throw_gone_or(const ProcessId& owner, const OsError& otherwise) {
  if (!process_alive(owner)) throw producer_gone(owner.pid, kFdsLost);
  throw otherwise;
}

// Pull with pidfd_getfd. Returns false (and leaves `out` empty) when the kernel
// refuses for want of rights, so that the caller may fall back.
bool fetch_pidfd(const ProcessId& owner, const std::vector<int>& remote_fds, bool forced,
                 std::vector<ReceivedItem>& out) {
  // A pid of another PID namespace names another process here, or none
  // (Note [whose pid] in process.cpp): never pull fds by it.
  if (!pid_visible(owner)) {
    if (!forced) return false;
    throw OsError(ESRCH, "torch_ipc: TORCH_IPC_FD_TRANSPORT=pidfd, but the producer (" + pid_text(owner) +
                             ") runs in another PID namespace, where pidfd_getfd cannot reach it; "
                             "unset TORCH_IPC_FD_TRANSPORT or set it to socket");
  }
  UniqueFd pidfd(pidfd_open(static_cast<pid_t>(owner.pid)));
  if (pidfd.get() < 0) {
    const int err = errno;
    if (err == ESRCH) throw_gone_or(owner, os_error(err, "pidfd_open", "(" + pid_text(owner) + ")"));
    if (!forced) return false;
    throw os_error(err, "pidfd_open", "(" + pid_text(owner) + ")", "(TORCH_IPC_FD_TRANSPORT=pidfd needs Linux >= 5.6)");
  }
  // The pid may have been recycled before pidfd_open: the pidfd must be the producer's.
  if (!process_alive(owner)) throw producer_gone(owner.pid, kFdsLost);
  for (int remote : remote_fds) {
    int fd = pidfd_getfd(pidfd.get(), remote);
    if (fd < 0) {
      const int err = errno;
      out.clear();
      const std::string subject = "(" + pid_text(owner) + ", fd " + std::to_string(remote) + ")";
      if (err == ESRCH) throw_gone_or(owner, os_error(err, "pidfd_getfd", subject));
      if (!forced) return false;  // EPERM (no ptrace rights), ENOSYS, EBADF: ask the socket
      if (err == EPERM || err == EACCES)
        throw os_error(err, "pidfd_getfd", subject,
                       "(pulling file descriptors needs ptrace rights over the producer: "
                       "CAP_SYS_PTRACE, or Yama ptrace_scope 0, or being its ancestor with "
                       "ptrace_scope 1; unset TORCH_IPC_FD_TRANSPORT or set it to socket to pass "
                       "them over a Unix socket instead)");
      throw os_error(err, "pidfd_getfd", subject);
    }
    ReceivedItem item;
    item.fd.reset(fd);
    out.push_back(std::move(item));
  }
  return true;
}

// A connected socket to `addr`, or -1 with `err` set.
UniqueFd connect_to(const sockaddr_un& addr, socklen_t len, int* err) {
  UniqueFd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) throw_os_error("socket(AF_UNIX, SOCK_SEQPACKET)", "to fetch file descriptors");
  if (int e = set_timeouts(sock.get(), g_answer_seconds, g_answer_seconds))
    throw os_error(e, "setsockopt(SO_RCVTIMEO/SO_SNDTIMEO)", "of the fd socket");
  int rc;
  do rc = connect(sock.get(), reinterpret_cast<const sockaddr*>(&addr), len);
  while (rc != 0 && errno == EINTR);
  if (rc == 0) return sock;
  *err = errno;
  return UniqueFd();
}

// The owner's server at its path in the socket folder (Note [fd server at a
// path]); "" when the owner has no life key or the path does not fit.
std::string path_of_server(const ProcessId& owner, uint32_t tag, sockaddr_un* addr) {
  if (owner.life == 0) return "";
  const std::string path = socket_dir() + "/" + fd_socket_file_name(owner.life, tag);
  *addr = sockaddr_un{};
  addr->sun_family = AF_UNIX;
  if (path.size() + 1 > sizeof(addr->sun_path)) return "";
  std::memcpy(addr->sun_path, path.data(), path.size());
  return path;
}

// The server must be `owner` itself where its pid means something here, and
// of our uid elsewhere: SO_PEERCRED gives 0, or another process's number, for
// a peer of another PID namespace (Note [whose pid] in process.cpp).
void check_server(int sock, const ProcessId& owner, const std::string& where) {
  ucred cred{};
  socklen_t clen = sizeof(cred);
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0)
    throw_os_error("getsockopt(SO_PEERCRED)", "of " + where);
  // Where the pid is visible it is the proof; a producer of another uid then
  // answers with its own refusal (EACCES), which the caller reads.
  const bool visible = pid_visible(owner);
  const bool other_uid = cred.uid != geteuid();
  if (visible ? static_cast<uint32_t>(cred.pid) == owner.pid : !other_uid) return;
  const std::string served = "the socket " + where + " is served by pid " + std::to_string(cred.pid) +
                             (other_uid ? " of uid " + std::to_string(cred.uid) : std::string()) +
                             ", not by the producer (" + pid_text(owner) +
                             "); refusing to take file descriptors from it";
  if (!process_alive(owner)) throw producer_gone(owner.pid, served);
  // A living producer whose name another process holds: a peer outside the
  // protocol, so EPROTO; the message names the squatter to look for.
  throw OsError(EPROTO, "torch_ipc: " + served);
}

// Step 1 of a socket fetch: a connection to `owner`'s fd server for export
// `id`, checked to be served by `owner` itself: its abstract socket, else
// (another network namespace) its socket at a path.
UniqueFd connect_fd_server(const ProcessId& owner, uint64_t id) {
  const uint32_t tag = static_cast<uint32_t>(id >> 32);
  socklen_t len;
  std::string name = fd_socket_name(owner, tag);
  sockaddr_un addr = address_of(name, &len);
  std::string where = "@" + name;
  int err = 0;
  UniqueFd sock = connect_to(addr, len, &err);
  if (sock.get() < 0 && (err == ECONNREFUSED || err == ENOENT)) {
    const std::string path = path_of_server(owner, tag, &addr);
    if (!path.empty()) {
      where += " or " + path;
      sock = connect_to(addr, sizeof(addr), &err);
    }
  }
  if (sock.get() < 0)
    throw_gone_or(owner, OsError(err, "torch_ipc: cannot reach the fd server of the producer (" + pid_text(owner) +
                                          ") at " + where + ": " + std::strerror(err) +
                                          " (it runs in another network namespace and does not "
                                          "share the socket folder " +
                                          socket_dir() + " (TORCH_IPC_SOCKET_DIR), or never exported VMM memory)"));
  check_server(sock.get(), owner, where);
  return sock;
}

// Step 2: the request. A send the server reset (EPIPE, ECONNRESET) is not
// reported here: a server that refused before reading (an older one, Note [a
// refusal is read]) has queued its answer, which step 3 reads.
void send_request(int sock, const ProcessId& owner, uint64_t id) {
  Request req{kRequestMagic, kProtocol, id};
  ssize_t sent;
  do sent = send(sock, &req, sizeof(req), MSG_NOSIGNAL);
  while (sent < 0 && errno == EINTR);
  if (sent == static_cast<ssize_t>(sizeof(req))) return;
  // A SOCK_SEQPACKET send is whole or fails; a short one has no errno of its own.
  const int err = sent < 0 ? errno : EPROTO;
  if (err == EPIPE || err == ECONNRESET) return;
  throw_gone_or(owner, os_error(err, "send", "of a request to the producer (" + pid_text(owner) + ")"));
}

// Whether `sock` has something to read (or an error, or an end) within the
// answer time, waited for in slices (Note [interruptible waits] in base/interrupt.h).
bool await_answer(int sock) {
  const int64_t end = steady_now_ns() + static_cast<int64_t>(g_answer_seconds * 1e9);
  for (;;) {
    const int64_t left = end - steady_now_ns();
    if (left <= 0) return false;
    pollfd p{sock, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left / 1'000'000, 1, 50)));
    if (ready > 0 || (ready < 0 && errno != EINTR)) return true;  // recvmsg says what it is
    if (wait_interrupted()) throw WaitInterrupted();
  }
}

// Step 3: one reply message into `buf`, its fds owned by `fds`; its length.
// A reset is read past once: the reply it cut off may wait behind it.
size_t receive_reply(int sock, const ProcessId& owner, char* buf, std::vector<UniqueFd>& fds) {
  const bool answered = await_answer(sock);
  for (int attempt = 0;; ++attempt) {
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kBatch)];
    iovec iov{buf, kMaxReply};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n;
    do n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | (attempt > 0 || !answered ? MSG_DONTWAIT : 0));
    while (n < 0 && errno == EINTR);
    const int err = errno;
    // Own every fd that arrived before looking at anything else.
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n >= 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds.emplace_back(fd);
      }
    }
    if (n > 0) {
      if (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) return kMaxReply + 1;  // reported as malformed
      return static_cast<size_t>(n);
    }
    if (n < 0 && err == ECONNRESET && attempt == 0) continue;
    // SO_RCVTIMEO expired: a timeout (TimeoutError), not EAGAIN.
    if (n < 0 && (err == EAGAIN || err == EWOULDBLOCK) && attempt == 0)
      throw_gone_or(owner, OsError(ETIMEDOUT,
                                   "torch_ipc: no answer from the fd server of the "
                                   "producer (" +
                                       pid_text(owner) + ") within " + str(g_answer_seconds) + " s"));
    if (n < 0 && attempt == 0)
      throw_gone_or(owner, os_error(err, "recvmsg", "of the answer of the producer (" + pid_text(owner) + ")"));
    // The peer hung up without a word: a reset connection, ECONNRESET; trying
    // again may work, unless the producer is exiting (then ProducerGone).
    throw_gone_or(owner, OsError(ECONNRESET, "torch_ipc: the producer (" + pid_text(owner) +
                                                 ") closed the fd socket without answering"));
  }
}

// A reply that breaks Note [fd server protocol] is EPROTO: the producer
// answers, but not as this torch_ipc would (another version, or a bug).
OsError malformed_reply(const ProcessId& owner, const std::string& why) {
  return OsError(EPROTO,
                 "torch_ipc: malformed reply from the fd server of the producer (" + pid_text(owner) + "): " + why);
}

// Step 4: a refusal in a reply header as the error it stands for.
void check_reply_status(const ReplyHeader& h, const ProcessId& owner) {
  if (h.magic != kReplyMagic) throw malformed_reply(owner, "wrong magic number");
  if (h.status == 0) return;
  if (h.status == ENOENT)
    throw Released("torch_ipc: the producer (" + pid_text(owner) +
                   ") no longer shares this memory (export id unknown to it: released already, "
                   "or the descriptor is not from it)");
  if (h.status == EACCES)
    throw OsError(EACCES, "torch_ipc: the producer (" + pid_text(owner) +
                              ") refused to pass file descriptors: it runs as another user (this "
                              "process has uid " +
                              std::to_string(geteuid()) + ")");
  if (h.status < 0 || h.status > 4095) throw malformed_reply(owner, "status " + std::to_string(h.status));
  throw OsError(h.status,
                "torch_ipc: the producer (" + pid_text(owner) + ") refused the request: " + std::strerror(h.status));
}

std::vector<ReceivedItem> fetch_socket(const ProcessId& owner, uint64_t id) {
  UniqueFd sock = connect_fd_server(owner, id);
  send_request(sock.get(), owner, id);
  std::vector<ReceivedItem> out;
  uint32_t total = 0;
  do {
    char buf[kMaxReply];
    std::vector<UniqueFd> fds;
    const size_t n = receive_reply(sock.get(), owner, buf, fds);
    ReplyHeader h{};
    if (n < sizeof(h)) throw malformed_reply(owner, std::to_string(n) + " bytes, shorter than a reply header");
    std::memcpy(&h, buf, sizeof(h));
    check_reply_status(h, owner);
    bool with_fds = h.flags & kHasFds, with_blobs = h.flags & kHasBlobs;
    size_t want = sizeof(h) + h.count * (8 + (with_blobs ? 64 : 0));
    if (h.count > kBatch || h.first != out.size() || n != want || (with_fds && fds.size() != h.count) ||
        (!with_fds && !fds.empty()) || (total != 0 && h.total != total) || h.first + h.count > h.total)
      throw malformed_reply(owner, "a message does not match its header (at item " + std::to_string(out.size()) + ")");
    total = h.total;
    for (uint32_t i = 0; i < h.count; ++i) {
      ReceivedItem item;
      std::memcpy(&item.size, buf + sizeof(h) + 8 * i, 8);
      if (with_blobs) std::memcpy(item.blob.data(), buf + sizeof(h) + 8 * h.count + 64 * i, 64);
      if (with_fds) item.fd = std::move(fds[i]);
      out.push_back(std::move(item));
    }
  } while (out.size() < total);
  return out;
}

}  // namespace

double fd_answer_seconds() { return g_answer_seconds; }

FdTransport fd_transport_from_env() {
  constexpr FdTransport kChoices[] = {FdTransport::Auto, FdTransport::Socket, FdTransport::Pidfd};
  return kChoices[env_choice("TORCH_IPC_FD_TRANSPORT", {"auto", "socket", "pidfd"}, 0)];  // Note [checked settings]
}

// The child closes its copy of the parent's listening socket (a child that
// outlives its parent would keep the parent's name bound, unserved) and
// serves nothing of the parent's: Note [fork].
void fd_server_forget_after_fork() {
  if (server().listening >= 0) ::close(server().listening);
  if (server().listening_path >= 0) ::close(server().listening_path);  // its path stays the parent's
  {
    std::unique_lock<std::mutex> lock(server().mu, std::try_to_lock);
    if (lock.owns_lock()) server().once.clear();  // the child's copies: a peer must see the parent close them
  }
  forget_after_fork<Server>();
  forget_after_fork<RefusedOwners>();
}
const AfterForkInChild reset_fd_server_after_fork(&fd_server_forget_after_fork);

uint64_t fd_publish(const std::vector<PublishedItem>& items) {
  Server& s = server();
  std::lock_guard<std::mutex> lock(s.mu);
  ensure_server(s);
  uint64_t id = 0;
  while (static_cast<uint32_t>(id) == 0 || s.published.count(id))
    id = uint64_t{s.tag} << 32 | static_cast<uint32_t>(os_random64());
  s.published.emplace(id, items);
  return id;
}

void fd_unpublish(uint64_t id) noexcept {
  Server& s = server();
  std::lock_guard<std::mutex> lock(s.mu);
  s.published.erase(id);
  s.once.erase(id);
}

// Note [fds for one fetch]
// A torch_ipc.Pipe end pickled for a process that this one did not start
// (sent over a Connection at a path, to another container) travels as the
// fd server's id for its fds, and the server keeps duplicates of them until
// one fetch took them, then closes its own, as multiprocessing's
// resource_sharer does for a pickled connection; but through the fd server,
// so that no shared authkey or temporary folder is needed and a peer of
// another network namespace reaches it at its path. A pickle never loaded
// keeps its fds in this process until it exits (or fd_unpublish).
uint64_t fd_publish_once(std::vector<UniqueFd> fds) {
  std::vector<PublishedItem> items;
  for (const auto& fd : fds) items.push_back(PublishedItem{0, fd.get(), {}});
  Server& s = server();
  const uint64_t id = fd_publish(items);
  std::lock_guard<std::mutex> lock(s.mu);
  s.once.emplace(id, std::move(fds));
  return id;
}

// Note [choosing a transport]
// pidfd_getfd costs one syscall per fd and no round trip through the
// producer's thread, but needs ptrace rights over the producer, which
// containers usually drop (Docker removes CAP_SYS_PTRACE; Yama ptrace_scope=1
// allows only ancestors). The socket always works between processes of one
// uid in one network namespace. auto tries pidfd when the descriptor carries
// the producer's fd numbers, remembers a refusal per producer, and asks the
// socket otherwise. The pidfd path trusts those numbers: the consumer holds a
// lease on the export before fetching, and the producer keeps the fds open
// while the export lives, so the numbers cannot have been reused.
std::vector<ReceivedItem> fd_fetch(const ProcessId& owner, uint64_t id, const std::vector<int>& remote_fds,
                                   FdTransport mode) {
  RefusedOwners& refused = *process_state<RefusedOwners>();
  auto key = std::make_pair(owner.pid, owner.start_time);
  std::vector<ReceivedItem> out;
  if (mode == FdTransport::Pidfd) {
    TORCH_IPC_CHECK(!remote_fds.empty(),
                    "torch_ipc: TORCH_IPC_FD_TRANSPORT=pidfd, but this descriptor does not carry the "
                    "producer's fd numbers (its allocation has too many or unequal chunks); use auto");
    fetch_pidfd(owner, remote_fds, true, out);
    ++via_pidfd;
    return out;
  }
  bool try_pidfd = mode == FdTransport::Auto && !remote_fds.empty();
  if (try_pidfd) {
    std::lock_guard<std::mutex> lock(refused.mu);
    try_pidfd = refused.owners.count(key) == 0;
  }
  if (try_pidfd) {
    if (fetch_pidfd(owner, remote_fds, false, out)) {
      ++via_pidfd;
      return out;
    }
    ++pidfd_refused;
    std::lock_guard<std::mutex> lock(refused.mu);
    if (refused.owners.size() > 4096) refused.owners.clear();
    refused.owners.insert(key);
  }
  out = fetch_socket(owner, id);
  ++via_socket;
  return out;
}

void fd_server_unlink_path() noexcept {
  Server& s = server();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.started_by != getpid() || s.path.empty()) return;
  ::unlink(s.path.c_str());
  s.path.clear();
}

std::string fd_server_path() {
  Server& s = server();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.started_by == getpid() ? s.path : "";
}

FdStats fd_stats() {
  Server& s = server();
  std::lock_guard<std::mutex> lock(s.mu);
  FdStats st{};
  st.published = static_cast<int64_t>(s.published.size());
  st.served = s.served.load();
  st.refused = s.refused.load();
  st.via_socket = via_socket.load();
  st.via_pidfd = via_pidfd.load();
  st.pidfd_refused = pidfd_refused.load();
  st.server_running = s.started_by == getpid();
  return st;
}

}  // namespace torch_ipc
