"""Peer: a long-lived child process that runs the calls sent to it."""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing.connection
import os
import pickle
import signal
import time
import weakref
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

from ._child import STOP, encode_call, pickle_call, unpack_reply
from ._environment import Env, check_env
from ._errors import PeerError, PeerTimeout, describe_exit, qualname
from ._fork_server import fork_server
from ._launch import make_fault_log, remove_file, start_child

T = TypeVar("T")

# Seconds a child gets to write its stacks (faulthandler) after a timeout
# before it is killed, and to exit after it was asked to stop.
_DUMP_GRACE_S = 0.5
EXIT_GRACE_S = 10.0
_REAP_TIMEOUT_S = 30.0
_FAULT_LOG_LIMIT = 64 * 1024

_live_peers: "weakref.WeakSet[Peer]" = weakref.WeakSet()


class Peer:
    """A child process that runs the calls sent to it, one at a time.

    The child keeps its state between calls (module globals of the functions'
    modules), so a test can make it load a tensor in one call, check or write it
    in the next, and kill it while it still holds the tensor.

    Args:
        timeout: seconds each call may take (the first call includes the child's
            start-up); on expiry the child is killed and :class:`PeerTimeout`
            raised.
        env: environment variables for the child (``None`` values remove one),
            in effect before the child imports anything.
        name: a name for the process (shows in ``ps`` and in errors).

    Example::

        import os
        from torch_ipc.testing import Peer

        with Peer(timeout=30) as peer:
            assert peer.call(os.getpid) == peer.pid
            peer.start_call(sum, [1, 2, 3])
            assert peer.result() == 6

    A Peer is not thread-safe. Its child is killed (with its process group) by
    :meth:`close`, when the Peer is garbage collected, and at interpreter exit.
    """

    def __init__(self, timeout: float = 60.0, env: Env = None, *, name: Optional[str] = None) -> None:
        self._closed = True  # until the child is started; keeps __del__ and close() safe
        self.timeout = float(timeout)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._start(check_env(env), name or "torch_ipc-peer", oneshot=False)

    @classmethod
    def _oneshot(cls, env: Dict[str, Optional[str]], timeout: float) -> "Peer":
        """A child that runs one call and exits (run_in_subprocess), code 1 when the call raised."""
        peer = cls.__new__(cls)
        peer._closed = True
        peer.timeout = float(timeout)
        peer._start(env, "torch_ipc-run", oneshot=True)
        return peer

    def _start(self, env: Dict[str, Optional[str]], name: str, oneshot: bool) -> None:
        self._fault_path = make_fault_log()
        try:
            self._proc, self._conn = start_child(env, name, self._fault_path, oneshot)
        except BaseException:
            remove_file(self._fault_path)
            raise
        self._pid = int(self._proc.pid)
        self._final_exitcode: Optional[int] = None
        self._fault_log_at_close = ""
        self._closed = False
        self._next_id = 1
        self._pending: Optional[Tuple[int, str, float]] = None  # (call id, what, deadline)
        self._killed = False  # the caller (kill()) or a timeout ended the child
        self._reported = False  # a PeerError already told the caller that the child died
        self._owner = os.getpid()  # a forked copy of this process must leave the child alone
        _live_peers.add(self)

    # ----------------------------------------------------------------- properties

    @property
    def pid(self) -> int:
        """The child's process id."""
        return getattr(self, "_pid", -1)

    @property
    def exitcode(self) -> Optional[int]:
        """The child's exit code once it has exited and been reaped, else ``None``."""
        if self._closed:
            return getattr(self, "_final_exitcode", None)
        return self._proc.exitcode

    def is_alive(self) -> bool:
        """Whether the child is still running."""
        return not self._closed and self._proc.is_alive()

    @property
    def busy(self) -> bool:
        """Whether a call was started and its result not yet collected."""
        return getattr(self, "_pending", None) is not None

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("busy" if self.busy else "idle")
        return f"<Peer pid={self.pid} {state} exitcode={self.exitcode}>"

    # ----------------------------------------------------------------- calls

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in the child and return its result.

        Raises :class:`PeerError` (carrying the child's traceback) when ``fn``
        raised or the child died, :class:`PeerTimeout` after ``timeout`` seconds
        (the child is then killed).
        """
        self.start_call(fn, *args, **kwargs)
        return self.result()

    def start_call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Send a call to the child without waiting; collect it with :meth:`result`."""
        if self._closed:
            raise PeerError(f"peer pid {self.pid} is closed", pid=self.pid, exitcode=self.exitcode)
        if self._pending is not None:
            raise RuntimeError(f"peer pid {self.pid} is already running {self._pending[1]}; call result() first")
        self._send(pickle_call(fn, args, kwargs), qualname(fn), time.monotonic() + self.timeout)

    def _send(self, payload: bytes, what: str, deadline: float) -> int:
        if not self._proc.is_alive():
            self._raise_dead(what)
        call_id = self._next_id
        self._next_id += 1
        self._pending = (call_id, what, deadline)
        try:
            self._conn.send_bytes(encode_call(call_id, payload))
        except OSError:
            pass  # the child died; result() reports how
        return call_id

    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait for the call started with :meth:`start_call` and return its result.

        ``timeout`` (seconds from now) overrides the deadline the call got from
        the Peer's ``timeout``.
        """
        if self._pending is None:
            raise RuntimeError("no call in progress; use start_call() first")
        call_id, what, deadline = self._pending
        budget = self.timeout
        if timeout is not None:
            deadline = time.monotonic() + timeout
            budget = timeout
        return self._wait(call_id, what, deadline, f"{what} did not return within {budget:g} s")

    def _wait(self, call_id: int, what: str, deadline: float, timeout_message: str) -> Any:
        message = self._receive(what, deadline, timeout_message)
        self._pending = None
        got_id = message[1]
        if got_id != call_id:
            self._shutdown(graceful=False)
            raise PeerError(f"peer pid {self.pid} answered call {got_id}, expected {call_id}", pid=self.pid)
        return unpack_reply(message, what, self.pid)

    def _receive(self, what: str, deadline: float, timeout_message: str) -> Tuple[Any, ...]:
        """The child's next reply; raises PeerTimeout past `deadline`, PeerError when it died."""
        conn = self._conn
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._pending = None
                self._timeout_kill(timeout_message)
            ready = multiprocessing.connection.wait([conn, self._proc.sentinel], timeout=remaining)
            if conn in ready:
                try:
                    return pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    # The child closed its end: it is exiting, or died.
                    self._proc.join(max(0.0, deadline - time.monotonic()))
                    self._pending = None
                    if self._proc.exitcode is None:
                        self._timeout_kill(timeout_message)
                    self._raise_dead(what)
            elif self._proc.sentinel in ready:
                if conn.poll(0):
                    continue  # it answered just before it exited
                self._pending = None
                self._raise_dead(what)

    # ----------------------------------------------------------------- death and cleanup

    def _fault_text(self) -> str:
        if not self._fault_path:
            return ""
        with contextlib.suppress(OSError):
            with open(self._fault_path, "rb") as f:
                data = f.read(_FAULT_LOG_LIMIT)
            return data.decode("utf-8", "replace").strip()
        return ""

    def _reap(self, timeout: float = _REAP_TIMEOUT_S) -> None:
        self._proc.join(timeout)

    def _raise_dead(self, what: str, during: Optional[str] = None) -> None:
        self._reap()
        code = self.exitcode
        log = self._fault_text()
        self._reported = True
        detail = f"\n\n--- child faulthandler output ---\n{log}" if log else ""
        deliberate = " (by kill())" if self._killed else ""
        raise PeerError(
            f"peer pid {self.pid} {describe_exit(code)}{deliberate} {during or 'while running ' + what}{detail}",
            pid=self.pid,
            exitcode=code,
            child_traceback=log,
        )

    def _kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the child's process group, or to the child alone.

        Only while the child is not yet reaped: until then its pid (and the group
        id it set to its pid) cannot name another process.
        """
        if self._proc is None or self._proc.exitcode is not None:
            return
        pid = self._proc.pid
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
                return
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.kill(pid, sig)

    def _timeout_kill(self, why: str) -> None:
        # Ask faulthandler in the child for every thread's stack, then kill.
        if self._proc.exitcode is None:
            with contextlib.suppress(OSError):
                os.kill(self._proc.pid, signal.SIGUSR1)
            self._proc.join(_DUMP_GRACE_S)
        self._killed = True
        self._reported = True
        self._kill_group(signal.SIGKILL)
        self._reap()
        log = self._fault_text()
        self._shutdown(graceful=False)
        detail = f"\n\n--- child stacks when it was killed ---\n{log}" if log else ""
        raise PeerTimeout(
            f"peer pid {self.pid}: {why}; killed it{detail}",
            pid=self.pid,
            exitcode=self.exitcode,
            child_traceback=log,
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child (not its process group).

        With SIGKILL this waits until the child is dead and reaped. A call in
        progress then raises :class:`PeerError` from :meth:`result`. Does nothing
        when the child already exited.
        """
        if self._closed or self._proc.exitcode is not None:
            return
        self._killed = True
        with contextlib.suppress(OSError):
            os.kill(self._proc.pid, sig)
        if sig == signal.SIGKILL:
            self._reap()

    def close(self, timeout: float = EXIT_GRACE_S, *, check: bool = False) -> Optional[int]:
        """Stop the child and free everything; idempotent. Returns its exit code.

        The child is asked to return from its loop and gets ``timeout`` seconds
        to exit; then it gets SIGTERM, then its process group gets SIGKILL. A
        child still running a call is killed at once.

        With ``check=True``, raises :class:`PeerError` when the child, asked to
        stop, did not exit cleanly (a crash or hang at interpreter exit), unless
        it had been killed on purpose or a PeerError already reported its death.
        """
        if self._closed:
            return self.exitcode
        if self._pending is not None:
            # A call is still running (say the test failed while waiting for it):
            # nothing graceful is left to do.
            self._killed = True
            self._pending = None
            self._shutdown(graceful=False)
            return self.exitcode
        graceful_exit = self._shutdown(graceful=True, timeout=timeout)
        if check and not graceful_exit and not self._killed and not self._reported:
            code = self.exitcode
            log = self._fault_log_at_close
            detail = f"\n\n--- child faulthandler output ---\n{log}" if log else ""
            raise PeerError(
                f"peer pid {self.pid} did not exit cleanly when asked to stop: it {describe_exit(code)}{detail}",
                pid=self.pid,
                exitcode=code,
                child_traceback=log,
            )
        return self.exitcode

    def _shutdown(self, graceful: bool, timeout: float = EXIT_GRACE_S) -> bool:
        """Stop the child; returns whether it exited by itself with code 0."""
        if self._closed:
            return self.exitcode == 0
        self._closed = True
        _live_peers.discard(self)
        clean = False
        proc, conn = self._proc, self._conn
        try:
            if graceful and proc.exitcode is None and proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send_bytes(STOP)
                proc.join(timeout)
                clean = proc.exitcode == 0
                if proc.exitcode is None:
                    with contextlib.suppress(OSError):
                        os.kill(proc.pid, signal.SIGUSR1)  # stacks, for close(check=True)
                    proc.join(_DUMP_GRACE_S)
                    with contextlib.suppress(OSError):
                        os.kill(proc.pid, signal.SIGTERM)
                    proc.join(1.0)
            elif proc.exitcode is not None:
                clean = proc.exitcode == 0
            if proc.exitcode is None:
                self._kill_group(signal.SIGKILL)
            proc.join(_REAP_TIMEOUT_S)
            self._fault_log_at_close = "" if clean else self._fault_text()
        finally:
            self._final_exitcode = proc.exitcode
            with contextlib.suppress(OSError):
                conn.close()
            remove_file(self._fault_path)
            with contextlib.suppress(Exception):
                proc.close()  # frees the sentinel; raises only if still running
        return clean

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._owner == os.getpid():
                self._shutdown(graceful=False)
        except Exception:
            pass


def kill_all_peers() -> None:
    """Kill every child started by a Peer or run_in_subprocess that is still running (atexit does this too)."""
    for p in list(_live_peers):
        if getattr(p, "_owner", None) == os.getpid():
            with contextlib.suppress(Exception):
                p._shutdown(graceful=False)


def _at_exit() -> None:
    kill_all_peers()
    with contextlib.suppress(Exception):
        fork_server.stop()


atexit.register(_at_exit)

