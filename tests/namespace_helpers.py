"""Processes in new PID, network and IPC namespaces (as in containers that share
/dev/shm and a uid but not hostPID or hostNetwork), for tests/containers/test_containers.py.

`unshare --pid --net --ipc --fork --mount-proc` needs root (CI runs as root);
where it is refused the tests skip saying so. Each child runs in a session of
its own and is killed with its whole process group (unshare and the python it
forked, pid 1 of the new namespace) when a test ends or times out.

What the namespaces share: the mount namespace is copied (--mount-proc implies
--mount), so /dev/shm stays the very same tmpfs and its files are seen by both
sides; --ipc separates System V IPC and POSIX message queues only (POSIX shared
memory is files in /dev/shm). The network namespace has only a loopback
device, so abstract Unix sockets of the host cannot be reached, while sockets
at filesystem paths can.
"""
import functools
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import pytest

import torch_ipc

UNSHARE = ["unshare", "--pid", "--net", "--ipc", "--fork", "--mount-proc", "--kill-child"]
# A PID namespace whose /proc is still the parent's (no --mount-proc: getpid() and /proc disagree).
UNSHARE_PID_ONLY = ["unshare", "--pid", "--fork", "--kill-child"]
# A time namespace whose boot lies a day earlier (/proc/<pid>/stat's start times shift by it).
UNSHARE_TIME = ["unshare", "--time", "--boottime", "86400", "--fork", "--kill-child"]
HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = str(Path(torch_ipc.__file__).resolve().parent.parent)


@functools.lru_cache(maxsize=None)
def unshare_refusal(unshare: tuple = tuple(UNSHARE)) -> Optional[str]:
    """Why new namespaces cannot be made here, or None when they can."""
    try:
        r = subprocess.run(list(unshare) + ["true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare is not available: {e}"
    if r.returncode != 0:
        return f"{' '.join(unshare)} was refused (needs root or user namespaces): {r.stderr.strip()}"
    return None


def needs_namespaces(unshare: List[str] = UNSHARE) -> Any:
    refusal = unshare_refusal(tuple(unshare))
    return pytest.mark.skipif(refusal is not None, reason=str(refusal))


class NamespacedChild:
    """`python tests/ns_child.py ARGS` in new PID, network and IPC namespaces.

    It prints one JSON object per line; :meth:`next` reads the next one.
    """

    def __init__(self, *args: str, timeout: float = 60.0, env: Optional[dict] = None,
                 unshare: List[str] = UNSHARE) -> None:
        self.timeout = timeout
        environ = dict(os.environ, PYTHONPATH=os.pathsep.join([PACKAGE_ROOT, str(HERE)]), **(env or {}))
        self.proc = subprocess.Popen(
            unshare + [sys.executable, str(HERE / "ns_child.py"), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ, start_new_session=True,
        )  # fmt: skip
        self._buffer = b""

    def next(self, timeout: Optional[float] = None) -> Any:
        """The next JSON line the child printed; kills it and fails after the timeout or at its exit."""
        deadline = time.monotonic() + (timeout or self.timeout)
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    waited = timeout or self.timeout
                    pytest.fail(f"the namespaced child said nothing within {waited} s: {self.stderr()}")
                if sel.select(left):
                    chunk = os.read(self.proc.stdout.fileno(), 65536)
                    if not chunk:
                        self.proc.wait(timeout=10)
                        pytest.fail(f"the namespaced child exited ({self.proc.returncode}): {self.stderr()}")
                    self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")[-3000:]

    def wait(self, timeout: Optional[float] = None) -> int:
        try:
            return self.proc.wait(timeout=timeout or self.timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the namespaced child did not exit within {timeout or self.timeout} s")

    def kill(self) -> None:
        """SIGKILL to the whole process group: unshare and the python it forked."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def __enter__(self) -> "NamespacedChild":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            self.kill()
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()


def run_namespaced(*args: str, timeout: float = 60.0, unshare: List[str] = UNSHARE) -> List[Any]:
    """Run a child to its end; every JSON line it printed."""
    with NamespacedChild(*args, timeout=timeout, unshare=unshare) as child:
        code = child.wait()
        out = [json.loads(line) for line in child.proc.stdout.read().splitlines() if line.strip()]
        assert code == 0, f"namespaced child exited {code}: {child.stderr()}"
        return out
