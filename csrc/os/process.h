// Identity of processes and of this boot: who made a descriptor, whether that
// process still lives, and whether a descriptor comes from this machine's boot.
#pragma once

#include <cstddef>
#include <string>
#include <unistd.h>

#include "base/ids.h"

#include "os/life.h"

namespace torch_ipc {

// This process: pid and start time (clock ticks after boot, /proc/self/stat),
// its PID namespace, and its life key, the life file made on the first call
// (Note [life files] in life.h; 0 while it cannot be made). A forked child
// has its own from the moment it is forked (Note [fork] in base/fork.h).
const ProcessId& self_process();

// The inode of the PID namespace this process's pids are counted in, when
// /proc is mounted for that namespace (Note [whose pid] in process.cpp); else 0.
uint32_t own_pid_namespace();
// Whether `p`'s pid means the same process here: same PID namespace as ours
// (or, for an identity that names neither namespace nor life key, assumed).
bool pid_visible(const ProcessId& p);

// MadeHere: what this process made, as opposed to what a forked child
// inherited (Note [fork] in base/fork.h).
class MadeHere {
 public:
  // True in a forked child, for what its parent made.
  bool inherited() const { return pid_ != getpid(); }

 private:
  pid_t pid_ = getpid();
};

// The child's half of Note [fork]: take this process's own identity
// (registered as a ForkStage::Identity reset).
void reset_identity_after_fork();

// The kernel's boot id (/proc/sys/kernel/random/boot_id): differs between
// machines and between boots of one machine.
const Uuid& boot_id();

// Whether the process `p` is running. Where its pid is visible
// (pid_visible), a process with this pid AND this start time, in our PID
// namespace (a recycled pid has another start time); elsewhere its life file
// (Note [life files]); neither: Unknown (ESRCH). Dead only on proof (no such
// process, another start time, its pidfd readable, its life file unlocked);
// Unknown with the errno when /proc or the file could not be read (EMFILE,
// EACCES): Note [unknown is not dead] in sweep.cpp, the same rule for files.
LifeCheck check_process(const ProcessId& p);

// Not proven dead: check_process(p).life != Life::Dead. What frees, reclaims
// or unmaps because a process died asks this, so "could not check" keeps.
bool process_alive(const ProcessId& p);

// Close the pidfds process_alive() keeps for processes that have exited
// since (the collector calls it; process_alive() alone closes a pidfd only
// when asked about that process again).
void forget_exited_processes();

}  // namespace torch_ipc
