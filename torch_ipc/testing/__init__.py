"""Multi-process test helpers for torch_ipc, and an opt-in pytest plugin.

Everything that crosses a process boundary in a test goes through one of two
helpers. Their children are fresh processes: forked by a fork server that
imported torch and torch_ipc but never touched CUDA (Note [fork server]), or
spawned (multiprocessing's ``"spawn"`` start method) when ``env`` is given. They
are never forked from the test's own process: a forked child of a process that
touched CUDA cannot use CUDA.

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
variable in the child. Without ``env`` the child has the parent's environment:
it is spawned whenever ``os.environ`` differs from the one the fork server
started with. ``TORCH_IPC_TEST_FORK_SERVER=0`` spawns every child.

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
import errno
import faulthandler
import functools
import gc
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from multiprocessing import context as _mp_context
from multiprocessing import popen_fork as _mp_popen_fork
from multiprocessing import process as _mp_process
from multiprocessing import resource_tracker as _mp_resource_tracker
from multiprocessing import spawn as _mp_spawn
from multiprocessing import util as _mp_util
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


# --------------------------------------------------------------------------- fork server

# Note [fork server]
# A spawned child is a new interpreter that imports torch before it runs
# anything: about two seconds of CPU time per child, most of what a
# multi-process test suite costs. So a child started without `env` is forked
# instead by a fork server: one process per parent, itself spawned, that
# imported this module (and so torch and torch_ipc; never CUDA) and forks a
# child per request in milliseconds. The child then runs as a spawned child
# does: multiprocessing's preparation (sys.path, working directory, __main__)
# runs in it, its stdout and stderr are the parent's at the time of the request,
# and it ends with a normal interpreter exit (atexit handlers run). What
# differs: its parent process is the server (it dies with the server, which
# dies with the process that started it), its environment is the one the
# server started with, and torch and torch_ipc were imported by the server.
# Hence a child is spawned whenever `env` is given or os.environ differs from
# the server's (PYTEST_CURRENT_TEST aside: the child sets that one itself, it
# is read by nobody at start-up), and always with TORCH_IPC_TEST_FORK_SERVER=0.
# The server only imports: torch_ipc's extension learns which process it runs
# in at its first use (a forked child refuses to share, Note [fork]), and
# CUDA, never initialised there, is initialised by each child for itself.
# The protocol is multiprocessing's own forkserver's; the server is private, so
# that a program under test that uses the "forkserver" start method still
# gets the standard one.

_LATE_ENV = ("PYTEST_CURRENT_TEST",)
_SIGNED = struct.Struct("q")
_MAX_FDS = 64
_inherited_fds: List[int] = []  # in a forked child: the fds its Process object pickled


def _read_signed(fd: int) -> int:
    data = b""
    while len(data) < _SIGNED.size:
        chunk = os.read(fd, _SIGNED.size - len(data))
        if not chunk:
            raise EOFError("unexpected EOF")
        data += chunk
    return _SIGNED.unpack(data)[0]


def _write_signed(fd: int, n: int) -> None:
    msg = _SIGNED.pack(n)
    while msg:
        msg = msg[os.write(fd, msg):]


def _env_key(environ: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in environ.items() if k not in _LATE_ENV}


class _ForkServer:
    """The parent's handle on its fork server (Note [fork server])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._owner = os.getpid()
        self._proc: Optional[subprocess.Popen] = None
        self._address: Any = None
        self._alive_w = -1
        self._env: Dict[str, str] = {}

    def server_pid(self) -> Optional[int]:
        """The server's pid, started now if needed; None when a child must be spawned instead."""
        if os.environ.get("TORCH_IPC_TEST_FORK_SERVER", "1") == "0" or sys.platform != "linux":
            return None
        with self._lock:
            if self._owner != os.getpid():  # a forked copy of the parent: the server is not ours
                self._reset()
            if self._proc is not None and self._proc.poll() is not None:
                self._stop_unlocked()  # it died: start another
            if self._proc is None:
                self._start_unlocked()
            elif _env_key(os.environ) != self._env:
                return None
            return self._proc.pid if self._proc is not None else None

    def _start_unlocked(self) -> None:
        listener = socket.socket(socket.AF_UNIX)
        try:
            address = multiprocessing.connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if isinstance(address, str) and not address.startswith("\0"):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            pdeathsig = threading.current_thread() is threading.main_thread()
            cmd = (
                f"import sys; sys.path[:] = {sys.path!r}; from torch_ipc.testing import _fork_server_main; "
                f"_fork_server_main({listener.fileno()}, {alive_r}, {os.getpid()}, {pdeathsig!r})"
            )
            exe = _mp_spawn.get_executable()
            try:
                proc = subprocess.Popen(
                    [exe, *_mp_util._args_from_interpreter_flags(), "-c", cmd],
                    pass_fds=(listener.fileno(), alive_r),
                    stdin=subprocess.DEVNULL,
                )
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        finally:
            listener.close()
        self._proc, self._address, self._alive_w = proc, address, alive_w
        self._env = _env_key(os.environ)

    def connect(self, fds: List[int]) -> Tuple[int, int]:
        """Ask the server for a child: (status fd to read its pid and exit code from,
        data fd to write its preparation data and Process object to)."""
        if len(fds) + 5 > _MAX_FDS:
            raise ValueError("too many fds for a forked child")
        with self._lock:
            if self._proc is None or self._owner != os.getpid():
                raise OSError(errno.ESRCH, "the fork server is not running")
            address = self._address
        _mp_resource_tracker.ensure_running()
        std = []
        for fd in (1, 2):  # the child writes where a spawned one would
            try:
                os.fstat(fd)
                std.append(fd)
            except OSError:
                std.append(os.open(os.devnull, os.O_WRONLY))
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(address)
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            try:
                _mp_context.reduction.sendfds(
                    client, [child_r, child_w, _mp_resource_tracker.getfd(), *std, *fds]
                )
            except BaseException:
                os.close(parent_r)
                os.close(parent_w)
                raise
            finally:
                os.close(child_r)
                os.close(child_w)
                for fd, want in zip(std, (1, 2)):
                    if fd != want:
                        os.close(fd)
        return parent_r, parent_w

    def stop(self) -> None:
        with self._lock:
            if self._owner == os.getpid():
                self._stop_unlocked()

    def _stop_unlocked(self) -> None:
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError):
                os.close(self._alive_w)  # EOF on its "alive" pipe: the server exits
            try:
                proc.wait(5.0)  # (forked copies of this process may hold the pipe open)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if isinstance(self._address, str) and not self._address.startswith("\0"):
                with contextlib.suppress(OSError):
                    os.unlink(self._address)
        self._reset()


_fork_server = _ForkServer()


class _DupFd:
    """How a forked child finds an fd its Process object pickled (multiprocessing.reduction.DupFd)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        return _inherited_fds[self.index]


class _ForkServerPopen(_mp_popen_fork.Popen):
    """multiprocessing's Popen for a child of our fork server (its forkserver Popen, with our server)."""

    method = "forkserver"
    DupFd = _DupFd

    def __init__(self, process_obj: Any) -> None:
        self._fds: List[int] = []
        super().__init__(process_obj)

    def duplicate_for_child(self, fd: int) -> int:
        self._fds.append(fd)
        return len(self._fds) - 1

    def _launch(self, process_obj: Any) -> None:
        prep_data = _mp_spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        _mp_context.set_spawning_popen(self)
        try:
            _mp_context.reduction.dump(prep_data, buf)
            _mp_context.reduction.dump(process_obj, buf)
        finally:
            _mp_context.set_spawning_popen(None)
        self.sentinel, w = _fork_server.connect(self._fds)
        # A duplicate of the data pipe's write end stays open here: the child
        # reads EOF from it when this process dies (its parent sentinel).
        parent_w = os.dup(w)
        self.finalizer = _mp_util.Finalize(self, _mp_util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = _read_signed(self.sentinel)

    def poll(self, flag: int = os.WNOHANG) -> Optional[int]:
        if self.returncode is None:
            timeout = 0 if flag == os.WNOHANG else None
            if not multiprocessing.connection.wait([self.sentinel], timeout):
                return None
            try:
                self.returncode = _read_signed(self.sentinel)
            except (OSError, EOFError):
                self.returncode = 255  # the server died before it could say
        return self.returncode


class _ForkServerProcess(_mp_process.BaseProcess):
    _start_method = None

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _ForkServerPopen(process_obj)


def _fork_server_main(listener_fd: int, alive_r: int, parent_pid: int, pdeathsig: bool) -> None:
    """The fork server's loop (multiprocessing.forkserver.main, but a child
    exits as a spawned one does: through SystemExit, running its atexit handlers)."""
    if pdeathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        return
    _mp_util._close_stdin()
    # What the server imported lives as long as its children: keep it out of
    # their garbage collections (and their exits' final one).
    gc.collect()
    gc.freeze()
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    handlers = {signal.SIGCHLD: lambda *_: None, signal.SIGINT: signal.SIG_IGN}
    old_handlers = {sig: signal.signal(sig, val) for sig, val in handlers.items()}
    signal.set_wakeup_fd(sig_w)
    pid_to_fd: Dict[int, int] = {}
    code: Optional[int] = None
    with socket.socket(socket.AF_UNIX, fileno=listener_fd) as listener, selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(alive_r, selectors.EVENT_READ)
        selector.register(sig_r, selectors.EVENT_READ)
        while code is None:
            try:
                ready = [key.fileobj for key, _ in selector.select()]
                if alive_r in ready:
                    return  # EOF: the parent is gone or closed its end
                if sig_r in ready:
                    os.read(sig_r, 65536)
                    while True:
                        try:
                            pid, status = os.waitpid(-1, os.WNOHANG)
                        except ChildProcessError:
                            break
                        if pid == 0:
                            break
                        status_w = pid_to_fd.pop(pid, None)
                        if status_w is not None:
                            with contextlib.suppress(BrokenPipeError):
                                _write_signed(status_w, os.waitstatus_to_exitcode(status))
                            os.close(status_w)
                if listener in ready:
                    with listener.accept()[0] as conn:
                        fds = _mp_context.reduction.recvfds(conn, _MAX_FDS)
                    child_r, status_w, *rest = fds
                    with warnings.catch_warnings():
                        # Python 3.12+ warns on fork() in a process with threads (torch
                        # starts one at import); what it warns of is what DataLoader's
                        # fork workers live with too: the child uses none of them.
                        warnings.simplefilter("ignore", DeprecationWarning)
                        pid = os.fork()
                    if pid == 0:
                        listener.close()
                        selector.close()
                        for fd in (alive_r, status_w, sig_r, sig_w, *pid_to_fd.values()):
                            os.close(fd)
                        code = _fork_server_child(child_r, rest, old_handlers)
                    else:
                        with contextlib.suppress(BrokenPipeError):
                            _write_signed(status_w, pid)
                        pid_to_fd[pid] = status_w
                        for fd in (child_r, *rest):
                            os.close(fd)
            except OSError as e:
                if e.errno != errno.ECONNABORTED:
                    raise
    sys.exit(code)  # in a forked child, after its Process ran: exit as a spawned child does


def _fork_server_child(child_r: int, fds: List[int], handlers: Dict[int, Any]) -> int:
    global _inherited_fds
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        tracker_fd, out_fd, err_fd, *_inherited_fds = fds
        with contextlib.suppress(AttributeError):
            _mp_resource_tracker._resource_tracker._fd = tracker_fd
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        parent_sentinel = os.dup(child_r)
        code = _mp_spawn._main(child_r, parent_sentinel)
    except Exception:
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
    return code


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
        self._proc: Any = None
        self._conn: Optional[multiprocessing.connection.Connection] = None
        self._fault_path = ""
        self.timeout = float(timeout)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._start(_check_env(env), name, oneshot=False)

    def _start(self, env: Dict[str, Optional[str]], name: Optional[str], oneshot: bool) -> None:
        fd, self._fault_path = tempfile.mkstemp(prefix="torch_ipc_peer_", suffix=".log")
        os.close(fd)
        server = None if env else _fork_server.server_pid()
        proc = None
        for attempt in ("fork server", "spawn") if server is not None else ("spawn",):
            parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
            if attempt == "fork server":
                late = {key: os.environ.get(key) for key in _LATE_ENV}
                args = (child_conn, late, self._fault_path, server, True, oneshot)
                proc = _ForkServerProcess(target=_child_main, args=args, name=name or "torch_ipc-peer")
            else:
                pdeathsig = threading.current_thread() is threading.main_thread()
                args = (child_conn, env, self._fault_path, os.getpid(), pdeathsig, oneshot)
                ctx = multiprocessing.get_context("spawn")
                # not daemonic: a daemonic process may not start children of its own
                proc = ctx.Process(target=_child_main, args=args, name=name or "torch_ipc-peer", daemon=False)
            try:
                with _environment(env if attempt == "spawn" else {}):
                    proc.start()
                break
            except OSError:
                parent_conn.close()
                child_conn.close()
                if attempt == "spawn":
                    with contextlib.suppress(OSError):
                        os.unlink(self._fault_path)
                    raise
                # the fork server went away: spawn this one
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
            if not self._closed and self._owner == os.getpid():
                self._shutdown(graceful=False)
        except Exception:
            pass


def kill_all_peers() -> None:
    """Kill every child started by this module that is still running (atexit does this too)."""
    for p in list(_live_peers):
        if getattr(p, "_owner", None) == os.getpid():
            with contextlib.suppress(Exception):
                p._shutdown(graceful=False)


def _at_exit() -> None:
    kill_all_peers()
    with contextlib.suppress(Exception):
        _fork_server.stop()


atexit.register(_at_exit)


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
    """Run ``fn(*args, **kwargs)`` in a fresh child process and return its result.

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
