// The stale-file sweep: removing the /dev/shm files of torch_ipc processes
// that are gone without removing them (killed, os._exit, execv).
#pragma once

#include <cstdint>
#include <string>

namespace torch_ipc {

// Note [sweep]
// A process that exits without its exit hook leaves its /dev/shm files; some
// other torch_ipc process removes them once their owner is provably gone. A
// pid cannot prove it: processes that share /dev/shm need not share a PID
// namespace (docker --ipc=host, pods sharing a memory volume), a pid is
// recycled, and after execv the same pid and start time belong to a new
// image. A lock can. Every lease segment is an anchor: its owner creates it,
// takes an OFD lock on it, and only then gives it bytes (ShmMapping::create),
// and keeps the file open (close-on-exec) until it unlinks it. The kernel
// drops the lock when the owner dies or execs, whatever its namespace. A host
// segment names the lease segment that anchors it (Note [names]). So a file
// is stale when its anchor has bytes and no lock, or is gone. Only files of
// our own uid are looked at: another user's files are not ours to judge (and
// root would otherwise remove anybody's). A file without bytes is an anchor
// being created; it is stale only once it is a minute old. An anchor that
// cannot be looked at (no fd left) keeps its files (Note [unknown is not dead]
// in sweep.cpp).

// A life file (Note [life files] in life.h) is an anchor of its own.
//
// Whether the anchor file `name` (relative to the folder `dir`, or a path
// with AT_FDCWD) proves its owner alive: Note [unknown is not dead] in sweep.cpp.
enum class Anchor { Alive, Dead, Unknown };
Anchor judge_anchor(int dir, const std::string& name);
// The same of an anchor file open at `fd`.
Anchor judge_open_anchor(int fd);

// Remove the stale files; returns how many. Never throws.
int sweep_stale_shm() noexcept;
// How many files this process's sweeps removed (stats()["swept_files"]).
int64_t swept_file_count();

}  // namespace torch_ipc
