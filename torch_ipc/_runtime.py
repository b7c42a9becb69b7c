"""Process-wide housekeeping: the background collector thread and the exit hook.

Note [collector thread]
Releases are deferred (a consumer releases only after its GPU work on the
memory finished) and a producer reclaims an export only when its consumers
released it or died. Somebody has to look: a daemon thread calls
``_C.collect()`` every TORCH_IPC_COLLECT_INTERVAL seconds (default 0.05), then
the hooks other modules registered with :func:`on_collect` (connections check
their peers there). ``_C.collect()`` releases the GIL (Note [collect without
the GIL] in csrc/core/maintenance.cpp): thousands of held exports do not stall the
process's Python threads.

Note [exit order]
At exit, torch_ipc unlinks this process's shared memory names and releases
its holds (``_C.shutdown()``). multiprocessing exports at exit too: a
``Queue.put(t)`` right before the main function returns is pickled (and so
exported) by the queue's feeder thread, which multiprocessing flushes and
joins in its own exit function, and children that still load are joined
there. atexit runs hooks in reverse order of registration and multiprocessing
registers its hook when it is imported (torch imports it first), so an atexit
hook of ours would run before it. So the exit hook is a multiprocessing
finalizer with the lowest priority: multiprocessing's exit function runs it
last, after the feeders were flushed and the children joined (in processes
that multiprocessing started, too, which skip atexit). An export after the
shutdown (a thread still sending) raises instead of creating names nobody
will unlink.

Note [periodic sweep]
Files of processes that died without their exit hook (SIGKILL, os._exit)
would stay until another process made its first segment. So the collector
also calls ``_C.sweep()`` (Note [sweep] in csrc/os/sweep.h), at most once per
TORCH_IPC_SWEEP_INTERVAL seconds (default 5): such files go within that time
while any torch_ipc process (a consumer too) runs. A sweep reads /dev/shm and
probes one lock per process there, without the GIL.
"""

import os
import threading
import time
import warnings
from multiprocessing import util as _mp_util
from typing import Callable, List, Optional

import torch

from . import _C

_lock = threading.Lock()
_started = False
_stop = threading.Event()
_thread: Optional[threading.Thread] = None
_pid = -1  # the process that started the collector
_shut_down = False
_hooks: List[Callable[[], None]] = []
_EXIT_PRIORITY = -1000  # below every finalizer of multiprocessing (queues join at -5)
_JOIN_TIMEOUT_S = 5.0


# Note [fork] (csrc/base/fork.h): a forked child has its own identity and none
# of its parent's state. Its collector thread did not survive the fork, so
# it starts its own on first use; its exit hook looks after its own exports
# (the finalizer it inherited does nothing there: it is not the _pid's).
def _forget_parent_after_fork() -> None:
    global _lock, _started, _stop, _pid, _thread, _shut_down
    _lock = threading.Lock()
    _started = False
    _stop = threading.Event()
    _thread = None
    _pid = -1
    _shut_down = False
    if torch.cuda._is_in_bad_fork():  # the parent initialised CUDA (Note [CUDA after fork])
        _C._forbid_cuda_after_fork()


os.register_at_fork(after_in_child=_forget_parent_after_fork)


def on_collect(hook: Callable[[], None]) -> None:
    """Call ``hook()`` after every background collection."""
    _hooks.append(hook)


def _interval() -> float:
    try:
        return max(0.001, float(os.environ.get("TORCH_IPC_COLLECT_INTERVAL", "0.05")))
    except ValueError:
        return 0.05


def _sweeper() -> Callable[[], None]:
    """A step that calls ``_C.sweep()`` at most once per TORCH_IPC_SWEEP_INTERVAL seconds."""
    try:
        interval = max(0.001, float(os.environ.get("TORCH_IPC_SWEEP_INTERVAL", "5")))
    except ValueError:
        interval = 5.0
    due = time.monotonic()

    def sweep() -> None:
        nonlocal due
        if time.monotonic() >= due:
            due = time.monotonic() + interval
            _C.sweep()

    return sweep


def _loop(interval: float) -> None:
    sweep = _sweeper()
    while not _stop.wait(interval):
        for step in [lambda: _C.collect(False), sweep, *_hooks]:
            try:
                step()
            except Exception as e:  # never let the thread die silently
                warnings.warn(f"torch_ipc collector: {e!r}", RuntimeWarning, stacklevel=1)


def ensure_started() -> None:
    """Start the collector thread and register the exit hook, once."""
    global _started
    if _started:
        return
    with _lock:
        if _started:
            return
        global _pid, _thread
        _thread = threading.Thread(target=_loop, args=(_interval(),), name="torch_ipc-collector", daemon=True)
        _thread.start()
        _pid = os.getpid()
        _mp_util.Finalize(None, _at_exit, exitpriority=_EXIT_PRIORITY)  # Note [exit order]
        _started = True


def exit_warning(s: dict) -> str:
    """What an exiting producer tells about the legacy CUDA IPC memory its
    consumers still hold (CPU shared memory and VMM memory they mapped stay
    valid after it exits: lifetime rule 7)."""
    living = s["holders"] - s["dead_holders"]
    return (
        f"torch_ipc: this process exits while {living} consumer process(es) still hold "
        f"{s['held_cuda_ipc_bytes']} bytes of its CUDA memory shared through legacy CUDA IPC, "
        "which goes with it; keep it running until they drop those tensors, or share "
        "VMM memory (expandable segments, SharedPool), which outlives it"
    )


def check_not_shut_down() -> None:
    """Raise if this process already shut torch_ipc down (it is exiting)."""
    if _shut_down and os.getpid() == _pid:
        raise RuntimeError(
            "torch_ipc: this process is exiting and has already unlinked its shared memory; "
            "nothing can be exported any more (send before the main function returns, or "
            "join the threads that send)"
        )


def _at_exit() -> None:
    global _shut_down
    if os.getpid() != _pid or _shut_down:  # not this process's hook, or run already
        return
    _stop.set()
    if _thread is not None and _thread is not threading.current_thread():
        # The collector runs without the GIL; it must not be inside _C when
        # the interpreter finalizes (a daemon thread that takes the GIL back
        # then is ended in the middle of C++ code).
        _thread.join(_JOIN_TIMEOUT_S)
    _shut_down = True
    try:
        _C.collect(False)
        s = _C.stats()
        if s["held_cuda_ipc_bytes"] > 0:
            warnings.warn(exit_warning(s), RuntimeWarning, stacklevel=1)
        _C.shutdown()
    except Exception:
        pass
