// Life files: each process that shares or holds makes one small /dev/shm file,
// keeps it locked while it lives, and names it by a random key, so that a peer
// that cannot see its pid (another PID namespace) can still tell whether it lives.
#pragma once

#include <cstdint>

#include "base/ids.h"

namespace torch_ipc {

// Note [life files]
// Containers share /dev/shm and a uid but not a PID namespace: a pid in a
// descriptor or a holder word may name nothing here, or an unrelated process
// of the same number. A lock needs no pid. A process makes its life file
// /torch_ipc.life.<key> once (O_EXCL, mode 0600, an OFD lock on a
// close-on-exec fd, then its identity page, written through that fd and never
// mapped: ShmMapping's anchor, Note [an anchor maps nothing]) before
// its key appears anywhere, and keeps it until it exits. So:
//   lock held by another open file   it lives (or is a forked child still
//                                    holding its parent's copy: Note [fork])
//   lock free, or the file gone      it died, or exec'd (the fd closes)
//   file made by another process     its own was unlinked: it died (a key is
//                                    free again only once its file is gone)
//   open/fstat/fcntl failed          Unknown (Note [unknown is not dead])
// Keys are 31 random bits, unique among living processes of one /dev/shm by
// O_EXCL, so they fit a holder word beside its count (Note [leases] in
// refcount.h). A holder word names no pid and start time to compare with the
// file's identity page: a key taken again after its file was swept makes a
// dead holder look alive until the new owner exits (held memory kept longer,
// never freed early). A forked child makes its own file: it closes its copy
// of its parent's fd, which keeps the lock only as long as the parent lives.
enum class Life { Alive, Dead, Unknown };
struct LifeCheck {
  Life life;
  int error;  // the errno behind Unknown, else 0
};

// This process's key, making its life file on first call (`self`: this
// process, for the identity page); 0 when it could not be made
// (life_file_error() says why; a call a second later tries again).
uint32_t make_life_file(const ProcessId& self) noexcept;
int life_file_error();

// Whether the process `p` (p.life != 0) lives, by its life file: also Dead
// when the file of that key was made by another process.
LifeCheck check_life_file(const ProcessId& p);
// Whether the holder of `key` lives (Note [life files]: no identity to compare).
LifeCheck check_life_key(uint32_t key);
// Not proven dead (Note [unknown is not dead] in sweep.cpp): check_life_key(key) is not Dead.
bool life_key_alive(uint32_t key);

// Remove this process's life file (at exit, when it holds nothing); its lock
// stays until the process ends.
void unlink_life_file() noexcept;

// How many peers' life files are open (at most 64: Note [life file cache] in life.cpp).
size_t cached_life_file_count();

}  // namespace torch_ipc
