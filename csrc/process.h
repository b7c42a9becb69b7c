// Identity of processes and of this boot: who made a descriptor, whether that
// process still lives, and whether a descriptor comes from this machine's boot.
#pragma once

#include <unistd.h>

#include <string>

#include "descriptor.h"

namespace torch_ipc {

// This process: pid and start time (clock ticks after boot, /proc/self/stat).
// A forked child has its own from the moment it is forked (Note [fork]).
const ProcessId& self_process();

// Note [fork]
// Fork is how DataLoader and Pool start workers, so a forked child must work.
// It takes an identity of its own as it is forked (fork.cpp, pthread_atfork):
// its own pid and start time, hence its own lease segments, shared memory
// names and fd server name, and it starts with none of its parent's exports,
// holds, mappings, events or fd server. What it inherited (tensors on its
// parent's memory, the parent's holds and mappings, the parent's segment
// names) stays the parent's: when it dies in the child it releases, closes
// and unlinks nothing (MadeHere). CUDA cannot be used in a forked child
// (torch's own rule), so CUDA calls there raise torch's error.
class MadeHere {
 public:
  // True in a forked child, for what its parent made.
  bool inherited() const { return pid_ != getpid(); }

 private:
  pid_t pid_ = getpid();
};

// The child's half of Note [fork]: take this process's own identity.
void reset_identity_after_fork();

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
