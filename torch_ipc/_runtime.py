"""Process-wide housekeeping: the background collector thread and the exit hook.

Note [collector thread]
Releases are deferred (a consumer releases only after its GPU work on the
memory finished) and a producer reclaims an export only when its consumers
released it or died. Somebody has to look: a daemon thread calls
``_C.collect()`` every TORCH_IPC_COLLECT_INTERVAL seconds (default 0.05), then
the hooks other modules registered with :func:`on_collect` (connections check
their peers there). It runs with the GIL, so the storages it drops are
dropped as from Python code.

Note [periodic sweep]
Files of processes that died without their exit hook (SIGKILL, os._exit)
would stay until another process made its first segment. So the collector
also calls ``_C.sweep()`` (Note [sweep] in csrc/sweep.h), at most once per
TORCH_IPC_SWEEP_INTERVAL seconds (default 5): such files go within that time
while any torch_ipc process (a consumer too) runs. A sweep reads /dev/shm and
probes one lock per process there, without the GIL.
"""

import atexit
import os
import threading
import time
import warnings
from typing import Callable, List

from . import _C

_lock = threading.Lock()
_started = False
_stop = threading.Event()
_pid = -1  # the process that started the collector
_hooks: List[Callable[[], None]] = []
_exit_registered = False


# Note [fork] (csrc/process.h): a forked child has its own identity and none
# of its parent's state. Its collector thread did not survive the fork, so
# it starts its own on first use; its exit hook looks after its own exports.
def _forget_parent_after_fork() -> None:
    global _lock, _started, _stop, _pid
    _lock = threading.Lock()
    _started = False
    _stop = threading.Event()
    _pid = -1


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
                warnings.warn(f"torch_ipc collector: {e!r}", RuntimeWarning)


def ensure_started() -> None:
    """Start the collector thread and register the exit hook, once."""
    global _started
    if _started:
        return
    with _lock:
        if _started:
            return
        threading.Thread(target=_loop, args=(_interval(),), name="torch_ipc-collector", daemon=True).start()
        global _pid, _exit_registered
        _pid = os.getpid()
        if not _exit_registered:  # a forked child inherits its parent's registration
            atexit.register(_at_exit)
            _exit_registered = True
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


def _at_exit() -> None:
    if os.getpid() != _pid:  # this process never used torch_ipc (it inherited the hook)
        return
    _stop.set()
    try:
        _C.collect(False)
        s = _C.stats()
        if s["held_cuda_ipc_bytes"] > 0:
            warnings.warn(exit_warning(s), RuntimeWarning)
        _C.shutdown()
    except Exception:
        pass
