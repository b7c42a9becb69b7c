"""Whether another process still runs: the one liveness test of torch_ipc.

A process is named by its pid AND its start time (``_C.self_process()``, clock
ticks after boot), so a pid the kernel gave to a new process never passes for
the one that had it (Note [liveness through pidfd] in csrc/os/process.cpp);
with its life key and PID namespace (``_C.self_identity()``) it is judged by
its life file where its pid is not ours to see (Note [life files]).
"""

from typing import Tuple

from . import _C

__all__ = ["ProcessId", "alive", "self_identity", "self_process"]

ProcessId = Tuple[int, ...]  # (pid, start time) or (pid, start time, life key, PID namespace)


def self_process() -> ProcessId:
    """(pid, start time) of this process; a forked child has its own."""
    return _C.self_process()


def self_identity() -> ProcessId:
    """(pid, start time, life key, PID namespace) of this process: a peer in
    another PID namespace judges it by its life key (Note [life files] in
    csrc/os/life.h)."""
    return _C.self_identity()


def alive(process: ProcessId) -> bool:
    """Whether ``process`` (what :func:`self_process` returned there) still
    runs. A process that could not be checked (an ``OSError``: out of file
    descriptors, /proc not readable) counts as alive: only a process known to
    be gone is dead, since what the callers do with a dead one (give back
    what it holds) cannot be undone."""
    try:
        return bool(_C.process_alive(*process))
    except OSError:
        return True
