"""Multi-process test helpers for torch_ipc, and an opt-in pytest plugin.

Everything that crosses a process boundary in a test goes through one of two
helpers, both built on the multiprocessing ``"spawn"`` start method (never fork:
a forked child of a process that touched CUDA cannot use CUDA):

* :func:`run_in_subprocess` runs one module-level function in a fresh child and
  returns its result, or raises :class:`PeerError` with the child's exit code
  and formatted traceback (or the signal that killed it), or
  :class:`PeerTimeout` after killing it.
* :class:`Peer` is a long-lived child that runs the calls sent to it, so it can
  keep state between them (hold a tensor it loaded) and can be killed while it
  does. A :class:`PeerGroup` hands the same named Peers to several tests, so
  that they pay for starting an interpreter (and importing torch) once.

Example::

    import os
    from torch_ipc.testing import Peer, run_in_subprocess

    def child_pid_and_env():
        return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")

    if __name__ == "__main__":
        pid, visible = run_in_subprocess(child_pid_and_env, env={"CUDA_VISIBLE_DEVICES": "1"})
        assert pid != os.getpid() and visible == "1"
        with Peer(timeout=30) as peer:
            assert peer.call(os.getpid) == peer.pid

Rules for the functions sent to a child:

* They must be defined at module level of an importable module: the child
  unpickles a function by importing its module (pytest's default ``prepend``
  import mode makes test modules importable in the child).
* Test modules must not initialise CUDA at import time (no ``torch.cuda.*``
  calls, no CUDA tensors at module level): the child imports them, and a module
  that touches CUDA on import makes every child pay for a CUDA context, in the
  parent's environment rather than the one given with ``env``.
* Arguments and results travel through a multiprocessing Pipe as standard pickle
  bytes (``pickle.dumps``; not multiprocessing's ForkingPickler, so no tensor is
  ever shared behind the test's back: a tensor argument arrives as a copy). Send
  torch_ipc descriptors (``bytes``) to share memory.

``env`` variables are in the child's environment from the moment its interpreter
starts, before it imports anything (torch reads some, such as
``PYTORCH_CUDA_ALLOC_CONF``, when it is imported; the CUDA driver reads
``CUDA_VISIBLE_DEVICES`` when it initialises). A value of ``None`` removes the
variable in the child.

The pytest plugin is opt-in: ``pytest -p torch_ipc.testing``, or
``pytest_plugins = ["torch_ipc.testing"]`` in the top-level ``conftest.py``.
Installing torch_ipc changes no other project's pytest runs. The plugin adds the
fixtures

* ``ipc_peer``: a fresh :class:`Peer` per test, closed after it (a crash at
  exit fails the test);
* ``ipc_peers``: a :class:`PeerGroup` shared by the tests of one module, whose
  peers are closed after the module's last test (same check);
* ``ipc_spawn``: :func:`run_in_subprocess` with the default timeout;

and the markers ``cuda`` and ``gpus(n)``, which skip a test on a machine without
a GPU or with fewer than ``n``. ``TORCH_IPC_TEST_TIMEOUT`` (seconds, default
60) sets the fixtures' default timeout.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, TypeVar

__all__ = [
    "Peer",
    "PeerError",
    "PeerGroup",
    "PeerTimeout",
    "cuda_device_count",
    "default_timeout",
    "kill_all_peers",
    "run_in_subprocess",
]

T = TypeVar("T")
Env = Optional[Mapping[str, Optional[str]]]

# Seconds a child gets to write its stacks (faulthandler) after a timeout
# before it is killed, and to exit after it was asked to stop.
_DUMP_GRACE_S = 0.5
_EXIT_GRACE_S = 10.0
_REAP_TIMEOUT_S = 30.0
_FAULT_LOG_LIMIT = 64 * 1024


# --------------------------------------------------------------------------- errors


class PeerError(RuntimeError):
    """A child process failed: its function raised, or it died, or it timed out.

    Attributes:
        pid: the child's process id.
        exitcode: the child's exit code once it has exited (negative: killed by
            that signal), ``None`` while it is still alive (a :class:`Peer` whose
            call raised keeps running).
        child_traceback: the formatted traceback of the exception raised in the
            child, or what faulthandler wrote when the child crashed or timed
            out; ``""`` when there is none.
        exc_type: the qualified name of the child's exception type, or ``""``.
        exception: the child's exception itself when it could be pickled back,
            else ``None``; lets a test check ``isinstance(e.exception, X)``.
    """

    def __init__(
        self,
        message: str,
        *,
        pid: Optional[int] = None,
        exitcode: Optional[int] = None,
        child_traceback: str = "",
        exc_type: str = "",
        exception: Optional[BaseException] = None,
    ) -> None:
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode
        self.child_traceback = child_traceback
        self.exc_type = exc_type
        self.exception = exception

    @property
    def signal(self) -> Optional[int]:
        """The number of the signal that killed the child, if one did."""
        if self.exitcode is not None and self.exitcode < 0:
            return -self.exitcode
        return None

    def __reduce__(self) -> Any:
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


class PeerTimeout(PeerError, TimeoutError):
    """A child did not finish in time; it was killed (with its process group)."""


def _rebuild_error(cls: type, args: Tuple[Any, ...], state: Dict[str, Any]) -> PeerError:
    err = cls.__new__(cls, *args)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


def _describe_exit(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown signal"
    return f"was killed by signal {-exitcode} ({name})"


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{module}.{name}"


# --------------------------------------------------------------------------- child side

# Messages: parent -> child  pickle((call_id, payload)) where payload is
#                            pickle((fn, args, kwargs)); call_id 0 means "stop".
#           child -> parent  pickle(("ok", call_id, result_bytes)) or
#                            pickle(("err", call_id, exc_type, text, traceback, exc_bytes)).
# The envelope holds only ints, strings and bytes, so it always unpickles; the
# user's objects are unpickled inside a try so that a failure there is reported
# as that call's error instead of killing the child.

_fault_log: Any = None  # the child's faulthandler file, kept open for its lifetime


def _child_setup(env: Dict[str, Optional[str]], fault_path: str, parent_pid: int, pdeathsig: bool) -> None:
    global _fault_log
    # A process group of its own, so that a timeout or close() kills whatever the
    # child started too.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if pdeathsig and sys.platform.startswith("linux"):
        # Die with the parent (pytest killed with SIGKILL leaves no orphans). Only
        # when the parent started us from its main thread: the signal is sent when
        # the *thread* that forked the child exits.
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent_pid:
                os._exit(70)  # the parent is already gone
    # The parent put `env` in the environment this interpreter started with; set
    # it again in case anything imported while the child was being prepared (the
    # parent's __main__, re-imported by spawn) changed it.
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    with contextlib.suppress(OSError):
        _fault_log = open(fault_path, "w")
        faulthandler.enable(file=_fault_log, all_threads=True)
        # SIGUSR1: the parent asks for every thread's stack before a timeout kill.
        faulthandler.register(signal.SIGUSR1, file=_fault_log, all_threads=True, chain=False)


def _run_one(payload: bytes) -> Tuple[Any, ...]:
    try:
        fn, args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
        del fn, args, kwargs
        try:
            return ("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:
            raise TypeError(f"the function returned {type(result).__name__}, which cannot be pickled: {exc}") from exc
    except BaseException as exc:  # noqa: B902 - report everything, SystemExit included
        tb = traceback.format_exc()
        try:
            exc_bytes: Optional[bytes] = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(exc_bytes)  # only send what will unpickle on the other side
        except Exception:
            exc_bytes = None
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return ("err", _qualname(type(exc)), text, tb, exc_bytes)


def _child_main(
    conn: multiprocessing.connection.Connection,
    env: Dict[str, Optional[str]],
    fault_path: str,
    parent_pid: int,
    pdeathsig: bool,
    oneshot: bool,
) -> None:
    _child_setup(env, fault_path, parent_pid, pdeathsig)
    failed = False
    while True:
        try:
            call_id, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the parent closed its end: nobody is left to answer
        if call_id == 0:
            break
        reply = _run_one(payload)
        failed = reply[0] == "err"
        try:
            conn.send_bytes(pickle.dumps((reply[0], call_id) + reply[1:], protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, OSError):
            break
        del reply, payload
        if oneshot:
            break
    conn.close()
    if oneshot and failed:
        sys.exit(1)


# --------------------------------------------------------------------------- parent side

_env_lock = threading.Lock()


@contextlib.contextmanager
def _environment(env: Dict[str, Optional[str]]) -> Iterator[None]:
    """Put `env` in os.environ while a child is started, then restore it.

    A spawned child inherits the parent's environment at exec, so the variables
    are there before the child imports anything. Other threads of this process
    see the values while the child starts (a few milliseconds).
    """
    if not env:
        yield
        return
    with _env_lock:
        saved = {key: os.environ.get(key) for key in env}
        try:
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _check_env(env: Env) -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {}
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not key or "=" in key:
            raise TypeError(f"env keys must be non-empty str without '=', got {key!r}")
        if value is not None and not isinstance(value, str):
            raise TypeError(f"env[{key!r}] must be a str or None, got {type(value).__name__}")
        out[key] = value
    return out


def _pickle_call(fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"cannot send {_qualname(fn)} and its arguments to a child process: {exc} "
            "(the function must be defined at module level of an importable module, "
            "and its arguments must pickle)"
        ) from exc


_live_peers: "weakref.WeakSet[Peer]" = weakref.WeakSet()


class Peer:
    """A spawned child process that runs the calls sent to it, one at a time.

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
        self._proc: Any = None
        self._conn: Optional[multiprocessing.connection.Connection] = None
        self._fault_path = ""
        self.timeout = float(timeout)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._start(_check_env(env), name, oneshot=False)

    def _start(self, env: Dict[str, Optional[str]], name: Optional[str], oneshot: bool) -> None:
        ctx = multiprocessing.get_context("spawn")
        fd, self._fault_path = tempfile.mkstemp(prefix="torch_ipc_peer_", suffix=".log")
        os.close(fd)
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        pdeathsig = threading.current_thread() is threading.main_thread()
        proc = ctx.Process(
            target=_child_main,
            args=(child_conn, env, self._fault_path, os.getpid(), pdeathsig, oneshot),
            name=name or "torch_ipc-peer",
            daemon=False,  # a daemonic process may not start children of its own
        )
        try:
            with _environment(env):
                proc.start()
        except BaseException:
            parent_conn.close()
            child_conn.close()
            with contextlib.suppress(OSError):
                os.unlink(self._fault_path)
            raise
        child_conn.close()
        self._proc = proc
        self._pid = int(proc.pid)
        self._final_exitcode: Optional[int] = None
        self._fault_log_at_close = ""
        self._conn = parent_conn
        self._closed = False
        self._next_id = 1
        self._pending: Optional[Tuple[int, str, float]] = None  # (call id, what, deadline)
        self._killed = False  # the caller (kill()) or a timeout ended the child
        self._reported = False  # a PeerError already told the caller that the child died
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
        self._send(_pickle_call(fn, args, kwargs), _qualname(fn), time.monotonic() + self.timeout)

    def _send(self, payload: bytes, what: str, deadline: float) -> int:
        if not self._proc.is_alive():
            self._raise_dead(what)
        call_id = self._next_id
        self._next_id += 1
        self._pending = (call_id, what, deadline)
        assert self._conn is not None
        try:
            self._conn.send_bytes(pickle.dumps((call_id, payload), protocol=pickle.HIGHEST_PROTOCOL))
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
        conn = self._conn
        assert conn is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._pending = None
                self._timeout_kill(timeout_message)
            ready = multiprocessing.connection.wait([conn, self._proc.sentinel], timeout=remaining)
            if conn in ready:
                try:
                    message = pickle.loads(conn.recv_bytes())
                    break
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
        self._pending = None
        status, got_id = message[0], message[1]
        if got_id != call_id:
            self._shutdown(graceful=False)
            raise PeerError(f"peer pid {self.pid} answered call {got_id}, expected {call_id}", pid=self.pid)
        if status == "ok":
            return pickle.loads(message[2])
        exc_type, text, tb, exc_bytes = message[2:6]
        exception = None
        if exc_bytes is not None:
            with contextlib.suppress(Exception):
                exception = pickle.loads(exc_bytes)
        raise PeerError(
            f"{what} raised {text} in peer pid {self.pid}\n\n--- child traceback ---\n{tb}",
            pid=self.pid,
            exitcode=None,
            child_traceback=tb,
            exc_type=exc_type,
            exception=exception,
        )

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
            f"peer pid {self.pid} {_describe_exit(code)}{deliberate} {during or 'while running ' + what}{detail}",
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

    def close(self, timeout: float = _EXIT_GRACE_S, *, check: bool = False) -> Optional[int]:
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
                f"peer pid {self.pid} did not exit cleanly when asked to stop: it {_describe_exit(code)}{detail}",
                pid=self.pid,
                exitcode=code,
                child_traceback=log,
            )
        return self.exitcode

    def _shutdown(self, graceful: bool, timeout: float = _EXIT_GRACE_S) -> bool:
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
                    assert conn is not None
                    conn.send_bytes(pickle.dumps((0, None)))
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
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()
            if self._fault_path:
                with contextlib.suppress(OSError):
                    os.unlink(self._fault_path)
            with contextlib.suppress(Exception):
                proc.close()  # frees the sentinel; raises only if still running
        return clean

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._shutdown(graceful=False)
        except Exception:
            pass


def kill_all_peers() -> None:
    """Kill every child started by this module that is still running (atexit does this too)."""
    for p in list(_live_peers):
        with contextlib.suppress(Exception):
            p._shutdown(graceful=False)


atexit.register(kill_all_peers)


class PeerGroup:
    """Named :class:`Peer` processes that several tests share, each started on first use.

    Starting a Peer starts an interpreter that imports torch: seconds on a small
    machine. Tests that only load, check and drop can share peers: each asks the
    group for a peer by name and gets the same process as the tests before it,
    so it must leave nothing behind that the next test could trip over. A test
    that kills its peer, makes it exit, or changes it for good uses a Peer of
    its own.

    Args:
        timeout: the default ``timeout`` of the peers (see :class:`Peer`).

    Example::

        import os
        from torch_ipc.testing import PeerGroup

        with PeerGroup(timeout=30) as group:
            producer = group.get("producer")
            assert group.get("producer") is producer
            assert group.get("consumer").pid != producer.pid
            group.close(check=True)   # both must exit cleanly

    A peer found dead by :meth:`get` is replaced by a new one. If nobody had
    been told of its death (no :class:`PeerError` reported it and it was not
    killed on purpose), :meth:`get` raises :class:`PeerError` saying how it
    ended; the next :meth:`get` starts the new one. A peer left busy (a test
    failed while waiting for a call) is killed and replaced.
    """

    def __init__(self, timeout: float = 60.0) -> None:
        if not float(timeout) > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.timeout = float(timeout)
        self._peers: Dict[str, Tuple[Peer, Tuple[Any, ...]]] = {}
        self._closed = False

    def get(
        self,
        name: str,
        *,
        env: Env = None,
        init: Optional[Callable[[], Any]] = None,
        timeout: Optional[float] = None,
    ) -> Peer:
        """The peer called ``name``, started now if it is not running.

        ``env`` and ``timeout`` are those of a new :class:`Peer`; ``init`` (a
        module-level function) runs once in a new peer before it is handed
        out. Asking again for ``name`` with other arguments is a ``ValueError``.
        """
        if self._closed:
            raise RuntimeError("the PeerGroup is closed")
        config = (tuple(sorted(_check_env(env).items())), init, self.timeout if timeout is None else float(timeout))
        entry = self._peers.get(name)
        if entry is not None:
            peer, had = entry
            if had != config:
                raise ValueError(f"peer {name!r} was started with other arguments ({had}) than {config}")
            if peer.is_alive() and not peer.busy:
                return peer
            del self._peers[name]
            unnoticed = not peer.busy and not peer._killed and not peer._reported
            peer.close()
            if unnoticed:
                raise PeerError(
                    f"shared peer {name!r} (pid {peer.pid}) {_describe_exit(peer.exitcode)} after an earlier "
                    "test used it; the next get() starts a new one",
                    pid=peer.pid,
                    exitcode=peer.exitcode,
                    child_traceback=peer._fault_log_at_close,
                )
        peer = Peer(timeout=config[2], env=env, name=name)
        try:
            if init is not None:
                peer.call(init)
        except BaseException:
            peer.close()
            raise
        self._peers[name] = (peer, config)
        return peer

    def close(self, *, check: bool = False) -> None:
        """Close every peer, the newest first; idempotent.

        With ``check=True``, raises :class:`PeerError` when one did not exit
        cleanly (see :meth:`Peer.close`), after all were closed.
        """
        self._closed = True
        errors: List[PeerError] = []
        while self._peers:
            name = next(reversed(self._peers))
            peer, _ = self._peers.pop(name)
            try:
                peer.close(check=check)
            except PeerError as err:
                errors.append(err)
        if errors:
            if len(errors) > 1:
                errors[0].args = (f"{errors[0].args[0]}\n(and {len(errors) - 1} more peers of the group)",)
            raise errors[0]

    def __enter__(self) -> "PeerGroup":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def run_in_subprocess(
    fn: Callable[..., T], /, *args: Any, timeout: float = 60.0, env: Env = None, **kwargs: Any
) -> T:
    """Run ``fn(*args, **kwargs)`` in a fresh spawned process and return its result.

    The child must also exit cleanly afterwards: a crash at interpreter exit is
    reported too.

    Raises:
        PeerError: ``fn`` raised (``exitcode`` 1, ``child_traceback`` set,
            ``exception`` the original when it pickles), the child died (say a
            signal: ``exitcode`` is minus its number and the message names it), or
            it crashed while exiting.
        PeerTimeout: the whole run (start-up, call and exit) took longer than
            ``timeout`` seconds; the child and its process group were killed.

    Example::

        import math
        from torch_ipc.testing import run_in_subprocess

        assert run_in_subprocess(math.factorial, 5, timeout=30) == 120
    """
    if not float(timeout) > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    payload = _pickle_call(fn, args, kwargs)  # fails here, before a child is started
    checked_env = _check_env(env)
    what = _qualname(fn)
    deadline = time.monotonic() + float(timeout)
    peer = Peer.__new__(Peer)
    peer._closed = True
    peer.timeout = float(timeout)
    peer._start(checked_env, "torch_ipc-run", oneshot=True)
    try:
        try:
            call_id = peer._send(payload, what, deadline)
            result = peer._wait(call_id, what, deadline, f"{what} did not return within {timeout:g} s")
        except PeerTimeout:
            raise
        except PeerError as err:
            if err.exitcode is None and not peer._closed:  # fn raised; the child exits with code 1
                peer._proc.join(max(0.0, min(deadline - time.monotonic(), _EXIT_GRACE_S)))
                if peer._proc.exitcode is None:
                    peer._shutdown(graceful=False)
                err.exitcode = peer.exitcode
                err.args = (f"{err.args[0]}\n(the child then {_describe_exit(err.exitcode)})",)
            raise
        # fn returned; the child must now exit by itself, with code 0.
        peer._proc.join(max(0.0, deadline - time.monotonic()))
        if peer._proc.exitcode is None:
            peer._timeout_kill(f"{what} returned but the child did not exit within {timeout:g} s")
        if peer._proc.exitcode != 0:
            peer._raise_dead(what, during=f"at interpreter exit, after {what} returned")
        return result
    finally:
        peer._shutdown(graceful=False)


# --------------------------------------------------------------------------- pytest plugin

_gpu_count: Optional[int] = None


def cuda_device_count() -> int:
    """The number of CUDA GPUs torch sees in this process, computed once and cached.

    0 when torch is a CPU-only build or no driver or GPU is there.
    """
    global _gpu_count
    if _gpu_count is None:
        count = 0
        try:
            import torch

            if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
                count = int(torch.cuda.device_count())
        except Exception:
            count = 0
        _gpu_count = count
    return _gpu_count


def default_timeout() -> float:
    """Seconds the plugin's fixtures allow per call (``TORCH_IPC_TEST_TIMEOUT``, default 60)."""
    try:
        value = float(os.environ.get("TORCH_IPC_TEST_TIMEOUT", "60"))
    except ValueError:
        value = 60.0
    return value if value > 0 else 60.0


def _gpus_needed(mark: Any) -> int:
    args = list(mark.args)
    if "n" in mark.kwargs:
        args.append(mark.kwargs["n"])
    if len(args) != 1 or not isinstance(args[0], int) or isinstance(args[0], bool) or args[0] < 1:
        raise ValueError(f"@pytest.mark.gpus takes one positive int (the number of GPUs), got {mark}")
    return int(args[0])


def skip_reason(marks: List[Any], gpu_count: int) -> Optional[str]:
    """Why a test with these markers cannot run on a machine with ``gpu_count`` GPUs (``None``: it can)."""
    needed = 0
    for mark in marks:
        if mark.name == "cuda":
            needed = max(needed, 1)
            if gpu_count < 1:
                return "needs a CUDA GPU (torch.cuda.is_available() is False)"
        elif mark.name == "gpus":
            needed = max(needed, _gpus_needed(mark))
    if needed > gpu_count:
        if gpu_count == 0 and needed == 1:
            return "needs a CUDA GPU (torch.cuda.is_available() is False)"
        return f"needs {needed} GPUs, found {gpu_count}"
    return None


try:
    import pytest
except ImportError:  # the helpers work without pytest; the plugin needs it
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    def pytest_configure(config: Any) -> None:
        config.addinivalue_line("markers", "cuda: the test needs a CUDA GPU (skipped without one)")
        config.addinivalue_line("markers", "gpus(n): the test needs at least n CUDA GPUs (skipped with fewer)")

    def pytest_collection_modifyitems(session: Any, config: Any, items: List[Any]) -> None:
        for item in items:
            marks = [m for m in item.iter_markers() if m.name in ("cuda", "gpus")]
            if not marks:
                continue
            try:
                reason = skip_reason(marks, cuda_device_count())
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))

    @pytest.fixture
    def ipc_peer() -> Iterator[Peer]:
        """A fresh :class:`Peer` for the test; closed after it (a crash at exit fails the test)."""
        p = Peer(timeout=default_timeout(), name="torch_ipc-test-peer")
        try:
            yield p
        finally:
            p.close(check=True)

    @pytest.fixture(scope="module")
    def ipc_peers() -> Iterator[PeerGroup]:
        """A :class:`PeerGroup` for the tests of one module; its peers must exit
        cleanly after the module's last test."""
        group = PeerGroup(timeout=default_timeout())
        try:
            yield group
            group.close(check=True)
        finally:
            group.close()

    @pytest.fixture
    def ipc_spawn() -> Callable[..., Any]:
        """:func:`run_in_subprocess` with the default timeout (overridable per call)."""
        return functools.partial(run_in_subprocess, timeout=default_timeout())
