// Moving shareable handles (file descriptors, or 64-byte blobs) between processes
// of one machine: a per-process server on an abstract Unix socket and at a
// path in the socket folder, and pidfd_getfd.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/ids.h"
#include "base/unique_fd.h"

namespace torch_ipc {

// One published item: the size of what it stands for, and either a file
// descriptor (POSIX handles; -1 when none) or a 64-byte blob (fabric handles).
struct PublishedItem {
  uint64_t size = 0;
  int fd = -1;
  Handle64 blob{};
};

struct ReceivedItem {
  uint64_t size = 0;  // 0 when the transport does not carry it (pidfd pulls)
  UniqueFd fd;
  Handle64 blob{};
};

enum class FdTransport : uint8_t { Auto, Socket, Pidfd };

// TORCH_IPC_FD_TRANSPORT=auto|socket|pidfd (default auto); read on every call.
FdTransport fd_transport_from_env();
// Seconds a fetch waits for each answer of the fd server (TORCH_IPC_FD_ANSWER_SECONDS, default 10).
double fd_answer_seconds();

// ---- producer side
// Publish `items` under a fresh random 64-bit id (never 0; its high half
// names the server, Note [fd server name]) and start this process's server
// on first use. The caller keeps the fds open and owns them
// until fd_unpublish(id) returns; the server sends duplicates.
uint64_t fd_publish(const std::vector<PublishedItem>& items);
void fd_unpublish(uint64_t id) noexcept;
// Publish `fds`, owned by the server from here on, for one fetch: it closes
// them once it has sent them (Note [fds for one fetch] in fd_passing.cpp);
// fd_unpublish drops them unsent.
uint64_t fd_publish_once(std::vector<UniqueFd> fds);

// ---- consumer side
// The items `owner` published under `id`. `remote_fds`: the owner's own fd
// numbers for them, when the caller knows them (then pidfd_getfd may be used;
// sizes are not returned that way); empty: socket only. Throws ProducerGone
// when the owner exited, Released when it no longer publishes `id`, and
// OsError for every other refusal: the failing call's errno, the errno the
// owner refused with (EACCES: another uid), or EPROTO for a peer that breaks
// the protocol (a reply that does not parse, a socket served by another pid).
std::vector<ReceivedItem> fd_fetch(const ProcessId& owner, uint64_t id, const std::vector<int>& remote_fds,
                                   FdTransport mode = fd_transport_from_env());

// At exit: remove the fd server's socket at a path (Note [fd server at a
// path] in fd_passing.cpp), if it has one.
void fd_server_unlink_path() noexcept;
// That path, or "" (no server, or on its abstract socket only).
std::string fd_server_path();

struct FdStats {
  int64_t published;      // ids this process serves now
  int64_t served;         // requests this process's server answered with items
  int64_t refused;        // requests it refused (unknown id, other uid, bad request)
  int64_t via_socket;     // fetches done over a socket (SCM_RIGHTS)
  int64_t via_pidfd;      // fetches done with pidfd_getfd
  int64_t pidfd_refused;  // pidfd_getfd refusals (EPERM...) that fell back to the socket
  bool server_running;
};
FdStats fd_stats();

}  // namespace torch_ipc
