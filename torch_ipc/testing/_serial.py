"""The ``serial`` marker under pytest-xdist: a marked test runs while no other
test of the run does (Note [serial tests])."""
from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator

# Note [serial tests]
# A few tests measure something the whole machine shares: free GPU memory, a
# time limit. Run in parallel (pytest-xdist), another worker's test moves what
# they measure. Each test therefore holds a lock file of the run for as long as
# it runs (setup and teardown included): shared by ordinary tests, exclusive
# for a `serial` one, so that a serial test waits for the tests running on the
# other workers and they wait for it. flock() gives a waiting exclusive lock no
# priority, and some worker nearly always holds the shared one; so a worker
# first passes through a turnstile (a second lock file, taken exclusively and
# released at once by ordinary tests, held by a serial test while it waits):
# once a serial test waits, no new test starts. Without xdist there is one
# process and nothing to lock.


@contextlib.contextmanager
def turn(folder: str, serial: bool) -> Iterator[None]:
    """Hold the run's lock in `folder` (shared by its workers): exclusively for a serial test."""
    with _locked(os.path.join(folder, "torch_ipc-serial.turnstile"), fcntl.LOCK_EX) as gate:
        if serial:
            with _locked(os.path.join(folder, "torch_ipc-serial.lock"), fcntl.LOCK_EX):
                yield
            return
        fcntl.flock(gate, fcntl.LOCK_UN)  # through the turnstile: let the next one in
    with _locked(os.path.join(folder, "torch_ipc-serial.lock"), fcntl.LOCK_SH):
        yield


@contextlib.contextmanager
def _locked(path: str, how: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        os.close(fd)  # releases the lock
