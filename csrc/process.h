// Identity of processes and of this boot: who made a descriptor, whether that
// process still lives, and whether a descriptor comes from this machine's boot.
#pragma once

#include <string>

#include "descriptor.h"

namespace torch_ipc {

// This process: pid and start time (clock ticks after boot, /proc/self/stat).
const ProcessId& self_process();

// Note [fork]
// A child forked from a process that used torch_ipc inherits its identity,
// lease slots, segment names and fd server socket name, none of which it may
// use: it would write descriptors in its parent's name and release its
// parent's holds. Such a child cannot use CUDA either. So it refuses to
// export or import (start processes with 'spawn'), and the deleters of what it
// inherited do nothing.
bool in_forked_child();
// Throws a RuntimeError saying to use spawn, in a forked child.
void check_not_forked();

// The kernel's boot id (/proc/sys/kernel/random/boot_id): differs between
// machines and between boots of one machine.
const Uuid& boot_id();

// True when a process with this pid AND this start time is running, in our
// PID namespace. A recycled pid has another start time.
bool process_alive(const ProcessId& p);

// Only the pid, for holder slots that store 32 bits: kill(pid, 0).
bool pid_alive(uint32_t pid);

// Close the pidfds process_alive() keeps for processes that have exited
// since (the collector calls it; process_alive() alone closes a pidfd only
// when asked about that process again).
void forget_exited_processes();

}  // namespace torch_ipc
