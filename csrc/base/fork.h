// A forked child's fresh start (Note [fork] below): the handler that
// pthread_atfork runs in the child, and the resets that per-process state
// registers with it. A hook runs in the child alone, before anything else:
// it replaces its state with an empty one and leaks the parent's (whose mutex
// another thread of the parent may have held), touching neither the parent's
// leases nor CUDA.
#pragma once

// Note [fork]
// Fork is how DataLoader and Pool start workers, so a forked child must work.
// It takes an identity of its own as it is forked (pthread_atfork, the resets below):
// its own pid and start time, hence its own lease segments, shared memory
// names and fd server name, and it starts with none of its parent's exports,
// holds, mappings, events or fd server. What it inherited (tensors on its
// parent's memory, the parent's holds and mappings, the parent's segment
// names) stays the parent's: when it dies in the child it releases, closes
// and unlinks nothing (MadeHere). CUDA cannot be used in a forked child
// (torch's own rule), so CUDA calls there raise torch's error.

namespace torch_ipc {

// The one instance of a piece of per-process state: created when the module
// loads, never destroyed (deleters use it during interpreter exit), replaced
// by a fresh one in a forked child (forget_after_fork<T>(), leaking the
// parent's).
//
// Note [no first use at fork]
// Not a function-local static: its first use takes a guard that C++ holds
// while it constructs, and a fork while the collector thread was there (the
// first collection after import) left the child's fork handler waiting on
// that guard forever: a fork Pool hung at start. Made at load, while the
// import holds the interpreter, no guard is ever held by another thread.
template <class T>
struct ProcessState {
  static inline T* instance = new T();
};
template <class T>
T*& process_state() {
  return ProcessState<T>::instance;
}
// Note [reading the parent's state after fork]
// A hook that must look at the parent's state (to close the child's copies of
// its fds) takes that state's lock with try_lock. Free, it proves no thread
// was changing the state at the fork (the child has no other thread); held,
// the thread that held it is gone, the lock stays held forever and what it
// guards may be half changed: the hook then leaves those fds open, which
// keeps the parent's memory or lease file alive until the child exits,
// instead of reading a broken structure or waiting forever.
template <class T>
void forget_after_fork() {
  process_state<T>() = new T();
}

// Note [fork resets register themselves]
// Each piece of per-process state says in its own file what a forked child
// does with it, by defining one AfterForkInChild (as PyTorch's allocators
// register their callbacks); the handler knows none of them, so a layer never
// names a higher one to be reset. Identity resets run first (the others may
// name this process); the rest run in registration order and must not depend
// on each other. Registration happens while the module loads, before the
// handler is installed.
enum class ForkStage { Identity, State };
struct AfterForkInChild {
  explicit AfterForkInChild(void (*reset)(), ForkStage stage = ForkStage::State);
};

// Registers the handler that runs every AfterForkInChild, once; called when the module loads.
void install_fork_handler();

}  // namespace torch_ipc
