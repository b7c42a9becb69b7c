// The folder of this uid's Unix sockets at filesystem paths: where fd servers
// listen for peers in other network namespaces (TORCH_IPC_SOCKET_DIR).
#pragma once

#include <string>

namespace torch_ipc {

// Note [socket folder]
// An abstract Unix socket belongs to a network namespace; a socket at a path
// belongs to the filesystem, and reaches every process that sees the folder,
// whatever its network or PID namespace. The folder is TORCH_IPC_SOCKET_DIR,
// else /dev/shm/torch_ipc-<euid>: /dev/shm is what peers in containers share
// already (a memory-backed volume mounted there, or hostIPC), where a runtime
// dir (/run/user/<uid>) is private to each container. It must be a directory
// of this euid with mode 0700 exactly, so that only this uid can bind a name
// in it (the fd server's peers are checked by uid, not pid: a pid from
// another namespace is 0 or another process's); one that is not is refused,
// never fixed, and the fd server then listens on its abstract socket alone.

// The folder (read on every call).
std::string socket_dir();

// The folder, made (mode 0700) if `create` and missing, and checked; "" and
// `why` set when it cannot be used.
std::string usable_socket_dir(bool create, std::string* why);

// Remove the fd server sockets in `dir` whose owners are dead by their life
// files (Note [life files] in life.h); returns how many. Never throws.
int sweep_socket_dir(const std::string& dir) noexcept;

}  // namespace torch_ipc
