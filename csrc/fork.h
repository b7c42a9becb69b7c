// A forked child's fresh start (Note [fork] in process.h): the handler that
// pthread_atfork runs in the child, and the hook of each piece of per-process
// state that it calls. A hook runs in the child alone, before anything else:
// it replaces its state with an empty one and leaks the parent's (whose mutex
// another thread of the parent may have held), touching neither the parent's
// leases nor CUDA.
#pragma once

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

// Registers the handler, once; called when the module loads.
void install_fork_handler();

void leases_forget_after_fork();      // refcount.cpp: own lease segments
void exports_forget_after_fork();     // registry.cpp: live exports
void imports_forget_after_fork();     // import.cpp: holds, pending releases, mappings
void host_forget_after_fork();        // host_memory.cpp: own shared memory segments
void events_forget_after_fork();      // events.cpp: event pools and opened events
void ipc_events_forget_after_fork();  // ipc_event.cpp: IpcEvents this process made
void locations_forget_after_fork();   // locate.cpp: cached locations
void vmm_forget_after_fork();         // vmm_export.cpp: published VMM chunks
void fd_server_forget_after_fork();   // fd_passing.cpp: the fd server and what it serves
void collect_lock_forget_after_fork();  // bindings.cpp: collections one at a time
void cuda_forbid_after_fork();        // cuda_driver.cpp: CUDA calls raise torch's error
// The same, asked by Python when torch had initialised CUDA in the parent.
void forbid_cuda_after_fork();

}  // namespace torch_ipc
