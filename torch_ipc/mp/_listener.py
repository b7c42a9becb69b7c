"""The listening side of torch_ipc connections: the socket (its file mode, a
stale path taken over) and the handshakes, each on a thread of its own with a
deadline, feeding a queue that Listener.accept() reads.

Note [concurrent handshakes]
A handshake is a few messages that the client sends at the pace it likes. Done
one at a time in accept(), a client that sends one byte every few seconds held
every other client back for as long as it liked (a per-read time limit bounds
each read, not their number). So an acceptor thread takes connections as they
come and authenticates each on a thread of its own under one deadline for the
whole handshake (`handshake_timeout`: a timer shuts the socket down, which ends
any read); accept() takes authenticated connections from a queue in the order
they finished. At most `_MAX_PENDING` connections are being authenticated or
wait in the queue; beyond that the acceptor waits, and the kernel's backlog
holds newcomers. Refusals are reported by accept() as warnings, in its caller's
thread.

Note [listen errors]
Every error of listening is one OSError (its class and errno kept) whose
message says once where, what went wrong and what to do: another listener
answers there, a file that is not a socket is there, the folder does not
exist, or what the system said (and "pick a free address").

Note [stale socket path]
A listener that was killed leaves its socket file behind, and binding there
fails with EADDRINUSE. As servers do, a path that is a socket nobody accepts
on (connecting is refused) is taken over; a path where a listener answers is
reported as such, and one that is not a socket is left alone. Two listen()
calls that take one stale path over at once must not both succeed: the
second would unlink the first's fresh socket, which then listens where
nobody can reach it. So the stale file is moved aside (rename is atomic),
and removed only if it is the file that was probed; anything else is put
back, and bind() then says EADDRINUSE.
"""

import errno
import os
import queue
import socket
import stat
import struct
import sys
import threading
import time
from multiprocessing import connection as mpc
from typing import Any, Optional, Protocol, Tuple, Union

Address = Union[str, tuple]


class Handshake(Protocol):
    """The handshake of a connection, in two steps: authenticate() runs under
    the deadline, connection() after it (connection.py's _ServerHandshake)."""

    def authenticate(self, conn: mpc.Connection) -> Any: ...

    def connection(self, conn: mpc.Connection, peer: Any) -> Any: ...


_MAX_PENDING = 64  # connections in handshake or waiting in the queue
_ACCEPT_POLL_S = 0.5  # how often the acceptor looks whether the listener was closed
_ACCEPT_RETRY_S = 0.05  # how soon it tries again after accept() failed (Note [accept at the fd limit])

# Note [accept at the fd limit]
# A client waiting in the backlog while this process is out of fds (EMFILE)
# makes every accept() fail at once: the acceptor tried again at once, and
# spun a core. It now waits _ACCEPT_RETRY_S between tries, and the first
# failure of a run is raised by Listener.accept(), as multiprocessing's
# accept() raises it; the client stays in the backlog for the next try.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # torch_ipc/


def _cannot_listen(error_class: type, errno_: Optional[int], address: Address, why: str, todo: str) -> OSError:
    message = f"torch_ipc: cannot listen at {address!r}: {why}; {todo}"
    return error_class(message) if errno_ is None else error_class(errno_, message)


def _listen_error(e: OSError, address: Address) -> OSError:
    """``e`` from bind() or listen() at ``address``, said once (Note [listen errors])."""
    if e.errno is None:  # e.g. "AF_UNIX path too long"
        return _cannot_listen(OSError, None, address, str(e), "pick a shorter path")
    if isinstance(e, FileNotFoundError) and _is_path(address):
        folder = os.path.dirname(os.path.abspath(address))
        return _cannot_listen(FileNotFoundError, e.errno, address, f"the folder {folder!r} does not exist",
                              "create it first, or pick another path")
    return _cannot_listen(type(e), e.errno, address, e.strerror or str(e), "pick a free address")


def caller_stacklevel() -> int:
    """The stacklevel for warnings.warn that names the first frame outside
    torch_ipc: the user's line that called into it."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def peer_of(sock: socket.socket) -> str:
    """Who is at the other end of ``sock``: "pid N" (a Unix socket, SO_PEERCRED) or its address."""
    try:
        if sock.family == socket.AF_UNIX:
            pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            return f"pid {pid}" if pid > 0 else "a process of another PID namespace"
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a client that is gone"


def _is_path(address: Address) -> bool:
    return isinstance(address, str) and not address.startswith("\0")


def _someone_listens(path: str) -> bool:
    """Whether a listener accepts at the Unix socket ``path`` (Note [stale socket path])."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except PermissionError:
        raise _cannot_listen(PermissionError, errno.EACCES, path, "a socket this user may not connect to is "
                             "there (another user's)", "pick another address") from None
    except OSError:  # a timeout (a full backlog): somebody is there
        return True
    finally:
        probe.close()


def _take_over_stale_path(path: str) -> None:
    """Remove the socket file a dead listener left at ``path``, or raise."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise _cannot_listen(FileExistsError, errno.EEXIST, path, "a file that is not a socket is there",
                             "pick a free address")
    if _someone_listens(path):
        raise _cannot_listen(OSError, errno.EADDRINUSE, path, "another listener accepts connections there",
                             "pick a free address")
    try:
        _remove_if_same(path, st)
    except OSError as e:
        raise _listen_error(e, path) from None


def _remove_if_same(path: str, stale: os.stat_result) -> None:
    """Remove the file at ``path`` if it is still ``stale``: another listen()
    may have taken the path over since it was looked at, and its fresh socket
    must stay (Note [stale socket path])."""
    aside = f"{path}.stale-{os.getpid()}-{threading.get_ident():x}"
    try:
        os.rename(path, aside)  # atomic: whatever is there now, and only that, is moved
    except FileNotFoundError:
        return  # taken over and gone already: bind() says whether the path is free
    moved = os.lstat(aside)
    # The inode number alone is not enough: a fresh socket may get the stale one's freed number.
    if (moved.st_dev, moved.st_ino, moved.st_mtime_ns) != (stale.st_dev, stale.st_ino, stale.st_mtime_ns):
        try:
            os.link(aside, path)  # another listener's fresh socket: back where it was
        except OSError:
            pass
    os.unlink(aside)


class SocketListener:
    """A bound, listening socket: a Unix socket file gets ``mode`` (0600 by
    default) before it listens, so nobody connects under the umask's mode."""

    def __init__(self, address: Optional[Address], family: Optional[str], backlog: int, mode: Optional[int]):
        family = family or (mpc.address_type(address) if address is not None else "AF_UNIX")
        if address is None:
            address = mpc.arbitrary_address(family)
        self._family = getattr(socket, family)
        self._path = address if self._family == socket.AF_UNIX and _is_path(address) else None
        if self._path is not None:
            _take_over_stale_path(self._path)
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            if self._family != socket.AF_UNIX:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            if self._path is not None:
                self._inode = os.stat(self._path).st_ino
                if mode is not None:
                    os.chmod(self._path, mode)  # before listen(): nobody can connect yet
            sock.listen(backlog)
        except OSError as e:
            sock.close()
            raise _listen_error(e, address) from None
        except BaseException:
            sock.close()
            raise
        self._socket = sock
        self.address = sock.getsockname() if self._path is None and self._family != socket.AF_UNIX else address
        self.closed = False

    def accept(self) -> Optional[socket.socket]:
        """A connected socket, or None after a short wait (so that close() is seen)."""
        self._socket.settimeout(_ACCEPT_POLL_S)
        try:
            sock, _ = self._socket.accept()
        except (socket.timeout, InterruptedError):
            return None
        sock.settimeout(None)
        return sock

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept()
        except OSError:
            pass
        self._socket.close()
        if self._path is not None:
            try:
                if os.stat(self._path).st_ino == self._inode:  # still ours, not a successor's
                    os.unlink(self._path)
            except OSError:
                pass


class Handshakes:
    """Authenticate connections concurrently (Note [concurrent handshakes]).
    ``handshake.authenticate(conn)`` returns the peer's process or raises,
    within the deadline; ``handshake.connection(conn, peer)`` makes what
    accept() returns."""

    def __init__(self, listener: SocketListener, handshake: "Handshake", timeout: float):
        self._listener = listener
        self._handshake_steps = handshake
        self._timeout = timeout
        self._results: "queue.Queue[Tuple[str, object]]" = queue.Queue()
        self._slots = threading.BoundedSemaphore(_MAX_PENDING)
        self._thread = threading.Thread(target=self._accept_loop, name="torch_ipc-listener", daemon=True)
        self._thread.start()

    def next(self) -> Tuple[str, object]:
        """("ok", connection), ("refused", (error, timed_out, peer)), ("error", OSError) or ("closed", None)."""
        kind, value = self._results.get()
        if kind == "ok":
            self._slots.release()
        elif kind == "closed":
            self._results.put((kind, value))  # for every later accept()
        return kind, value

    def close(self) -> None:
        """Close the connections nobody will accept; refusals stay to be reported."""
        kept = []
        while True:
            try:
                kind, value = self._results.get_nowait()
            except queue.Empty:
                break
            if kind == "ok":
                value.close()
            elif kind == "refused":
                kept.append((kind, value))
        for item in kept + [("closed", None)]:
            self._results.put(item)

    def _accept_loop(self) -> None:
        failing = False  # Note [accept at the fd limit]
        while not self._listener.closed:
            if not self._slots.acquire(timeout=_ACCEPT_POLL_S):
                continue
            try:
                sock = self._listener.accept()
            except OSError as e:
                sock = None
                if self._listener.closed:
                    self._slots.release()
                    return
                if not failing:
                    self._results.put(("error", e))
                failing = True
                time.sleep(_ACCEPT_RETRY_S)
            else:
                failing = False
            if sock is None:
                self._slots.release()
                continue
            threading.Thread(target=self._handshake, args=(sock,), name="torch_ipc-handshake", daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        peer = peer_of(sock)
        conn = mpc.Connection(sock.detach())
        deadline = _Deadline(conn, self._timeout)
        try:
            pid = self._handshake_steps.authenticate(conn)
            if not deadline.finish():
                raise TimeoutError("the handshake passed its deadline")
            if self._listener.closed:
                conn.close()
                self._slots.release()
                return
            self._results.put(("ok", self._handshake_steps.connection(conn, pid)))
        except BaseException as e:  # noqa: BLE001  (reported by accept(), in its caller's thread)
            timed_out = not deadline.finish()
            conn.close()
            self._slots.release()
            self._results.put(("refused", (e, timed_out, peer)))


class _Deadline:
    """Shut a handshake's socket down once ``seconds`` have passed, unless
    finish() came first; the lock keeps the timer off a closed (reused) fd."""

    def __init__(self, conn: mpc.Connection, seconds: float):
        self._conn = conn
        self._lock = threading.Lock()
        self._done = False
        self._fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def finish(self) -> bool:
        """Stop the timer; False when it fired already."""
        with self._lock:
            self._done = True
        self._timer.cancel()
        return not self._fired

    def _fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self._fired = True
            try:
                sock = socket.socket(fileno=self._conn.fileno())
            except OSError:
                return
            try:
                sock.shutdown(socket.SHUT_RDWR)  # ends any read or write of the handshake
            except OSError:
                pass
            finally:
                sock.detach()
