"""The fork server: forks the children of this process's Peers from an
interpreter that already imported torch (Note [fork server])."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import io
import multiprocessing
import multiprocessing.connection
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import warnings
from multiprocessing import context as _mp_context
from multiprocessing import popen_fork as _mp_popen_fork
from multiprocessing import process as _mp_process
from multiprocessing import resource_tracker as _mp_resource_tracker
from multiprocessing import spawn as _mp_spawn
from multiprocessing import util as _mp_util
from typing import Any, Dict, List, Mapping, Optional, Tuple

# Note [fork server]
# A spawned child is a new interpreter that imports torch before it runs
# anything: about two seconds of CPU time per child, most of what a
# multi-process test suite costs. So a child started without `env` is forked
# instead by a fork server: one process per parent, itself spawned, that
# imported torch_ipc.testing (and so torch and torch_ipc; never CUDA) and forks a
# child per request in milliseconds. The child then runs as a spawned child
# does: multiprocessing's preparation (sys.path, working directory, __main__)
# runs in it, its stdout and stderr are the parent's at the time of the request,
# and it ends through the interpreter's exit (atexit handlers run; Note [fork
# server exit] says what it leaves out). What
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
#
# Note [fork server exit]
# A forked child exits as a spawned one does up to the end of the interpreter:
# multiprocessing's finalizers (torch_ipc's exit hook among them) and the
# atexit handlers run, then the interpreter's own finalization (modules
# cleared, the deleters of what they held run, torch_ipc's during interpreter
# exit among them; a crash there is the child's exit status). Unless the child
# initialised CUDA, it then leaves out the C library's exit handlers that were
# registered before: the static destructors of libtorch and the other
# libraries the server loaded. libtorch deregisters each of its operators
# there, about 0.1 s of CPU time per child, half of what a short-lived child
# costs in all; torch_ipc keeps no static object whose destructor does
# anything (its per-process state is never destroyed, ProcessState in
# csrc/base/fork.h). A child that initialised CUDA exits in full, the CUDA
# runtime's teardown included, as a spawned child does.

LATE_ENV = ("PYTEST_CURRENT_TEST",)
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
    return {k: v for k, v in environ.items() if k not in LATE_ENV}


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
                f"import sys; sys.path[:] = {sys.path!r}; from torch_ipc.testing._fork_server import serve; "
                f"serve({listener.fileno()}, {alive_r}, {os.getpid()}, {pdeathsig!r})"
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


fork_server = _ForkServer()


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
        self.sentinel, w = fork_server.connect(self._fds)
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


class ForkServerProcess(_mp_process.BaseProcess):
    _start_method = None

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _ForkServerPopen(process_obj)


def serve(listener_fd: int, alive_r: int, parent_pid: int, pdeathsig: bool) -> None:
    """The fork server's loop (multiprocessing.forkserver.main, but a child
    exits through SystemExit, running its atexit handlers: Note [fork server exit])."""
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
                    _report_exits(pid_to_fd)
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
                        code = _run_child(child_r, rest, old_handlers)
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


def _report_exits(pid_to_fd: Dict[int, int]) -> None:
    """Reap the children that exited and write each one's exit code to its status pipe."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status_w = pid_to_fd.pop(pid, None)
        if status_w is not None:
            with contextlib.suppress(BrokenPipeError):
                _write_signed(status_w, os.waitstatus_to_exitcode(status))
            os.close(status_w)


def _run_child(child_r: int, fds: List[int], handlers: Dict[int, Any]) -> int:
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
    _end_before_static_destructors()
    return code


def _end_before_static_destructors() -> None:
    """Note [fork server exit]: unless CUDA was initialised here, the exit() that
    ends the interpreter calls _exit(status) first, before the exit handlers
    registered earlier (the libraries' static destructors)."""
    torch = sys.modules.get("torch")
    if torch is None or torch.cuda.is_initialized():
        return
    with contextlib.suppress(Exception):  # without on_exit (not glibc) the child exits in full
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fflush(None)  # what C code buffered so far; later output goes through Python's files
        libc.on_exit.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
        libc.on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)  # _exit(status, arg): the status exit() got
