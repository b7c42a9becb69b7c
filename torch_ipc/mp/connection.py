"""Listener/Client over multiprocessing.connection, carrying tensors zero-copy.

Every message is one descriptor (see torch_ipc.dumps). An authkey is always
required. Each side learns the other's pid after authentication, so that
what one side sent and the other never loaded is given back when the peer
closes the connection or dies (Note [connection lifetime]).
"""

import os
import secrets
import socket
import struct
import sys
import threading
import warnings
import weakref
from multiprocessing import AuthenticationError
from multiprocessing import connection as mpc
from typing import Any, List, Optional, Tuple, Union

from .. import _C, _runtime, _serialize
from . import _ring

__all__ = ["Listener", "Client", "Connection", "listen", "connect"]

Address = Union[str, tuple]

# Note [connection lifetime]
# A consumer that loaded something holds it through its lease until it drops
# the tensors or dies (refcount.h). What a connection sent but the peer never
# loaded is a load nobody will make: once the peer can no longer read it (its
# process is gone, or it closed its end) the collector revokes those exports
# (``Export.revoke()``) so they can be reclaimed. Closing our own end does not:
# messages may still sit unread in the socket, and `send(); close()` is a
# normal pattern. Their exports wait in _orphans until the peer exits.
# A connection keeps the exports it sent while they are live; an export that
# every consumer released is dropped from the list at the next prune.
_open_connections: "weakref.WeakSet[Connection]" = weakref.WeakSet()
_orphans: List[Tuple[int, List[_C.Export]]] = []  # (peer pid, exports it may still load)
_open_lock = threading.RLock()  # RLock: Connection.__del__ may run inside a locked region
_PRUNE_EVERY = 64  # sent exports between two prunes of the dead ones


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _live(exports: List[_C.Export]) -> List[_C.Export]:
    return [e for e in exports if e.live]


def _revoke(exports: List[_C.Export]) -> None:
    for e in exports:
        e.revoke()


def _check_peers() -> None:
    """Revoke what peers that exited or closed their end will never load."""
    gone, kept = [], []
    with _open_lock:
        conns = list(_open_connections)
        for pid, exports in _orphans:
            if not _pid_alive(pid):
                gone.append(exports)
            elif live := _live(exports):
                kept.append((pid, live))
        _orphans[:] = kept
    for exports in gone:
        _revoke(exports)
    for c in conns:
        try:
            if not c._peer_alive() or c._peer_closed():
                c._revoke_sent()
        except Exception:  # one bad connection must not stop the others' checks
            pass


_runtime.on_collect(_check_peers)


class Connection:
    """One end of a torch_ipc connection: ``send(obj)``, ``recv()``, ``close()``.
    Between two processes of one machine (a Unix socket) its messages go
    through shared memory (Note [channel] in _ring.py)."""

    def __init__(self, conn: Any, peer_pid: int):
        self._conn = conn  # the transport: an mpc.Connection, or a _ring.RingConnection
        self.peer_pid = peer_pid
        self._sent: List[_C.Export] = []  # what we sent that the peer may still load
        with _open_lock:
            _open_connections.add(self)

    def send(self, obj: Any) -> None:
        """Export ``obj`` (tensors zero-copy) and send it as one message."""
        sent = _serialize.export_object(obj)
        if sent.live:  # it holds tensors of ours or forwarded ones
            self._sent.append(sent)
            if len(self._sent) % _PRUNE_EVERY == 0:
                self._sent = _live(self._sent)
        self._conn.send_bytes(sent.data)

    def recv(self) -> Any:
        """Receive one message and rebuild it on the sender's memory."""
        return _serialize.loads(self._conn.recv_bytes())

    def send_bytes(self, buf: Any, offset: int = 0, size: Optional[int] = None) -> None:
        """Send raw bytes, as ``multiprocessing.connection.Connection.send_bytes``."""
        self._conn.send_bytes(buf, offset, size)

    def recv_bytes(self, maxlength: Optional[int] = None) -> bytes:
        """Receive raw bytes, as ``multiprocessing.connection.Connection.recv_bytes``."""
        return self._conn.recv_bytes(maxlength)

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        return self._conn.poll(timeout)

    def fileno(self) -> int:
        return self._conn.fileno()

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def _peer_alive(self) -> bool:
        return _pid_alive(self.peer_pid)

    def _peer_closed(self) -> bool:
        """True when the peer closed its end (end of file is next to read)."""
        if self._conn.closed or not self._sent:
            return False
        try:
            sock = socket.socket(fileno=getattr(self._conn, "socket_fileno", self._conn.fileno)())
        except OSError:  # not a socket (a pipe): only the peer's exit tells
            return False
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        finally:
            sock.detach()

    def _revoke_sent(self) -> None:
        sent, self._sent = self._sent, []
        _revoke(sent)

    def close(self) -> None:
        """Close our end. Idempotent. What the peer has not loaded yet stays
        loadable while the peer lives (it may still read it from the socket)
        and is given back when it exits."""
        with _open_lock:
            sent, self._sent = _live(self._sent), []
            if sent:
                _orphans.append((self.peer_pid, sent))
            _open_connections.discard(self)
        self._conn.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# Note [peer pid]
# Both sides send their pid after authentication, but a pid that the peer
# says is only as true as the peer: one that names another process would make
# us revoke what we sent when that process exits, or keep it while the real
# peer is long gone. Where the transport knows the peer (a Unix socket:
# SO_PEERCRED, the pid of the process that connected or listened, as our PID
# namespace sees it) that pid is taken; the one sent counts only over TCP.
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _peer_pid_from_kernel(conn: mpc.Connection) -> int:
    """The peer's pid by SO_PEERCRED, or 0 where the transport has none."""
    try:
        sock = socket.socket(fileno=conn.fileno())
    except OSError:
        return 0
    try:
        if sock.family != socket.AF_UNIX:
            return 0
        pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        return pid
    except OSError:
        return 0
    finally:
        sock.detach()


def _exchange_pids(conn: mpc.Connection) -> int:
    conn.send_bytes(struct.pack("<I", os.getpid()))
    data = conn.recv_bytes(16)
    if len(data) != 4:
        raise ConnectionError("torch_ipc: the peer is not a torch_ipc endpoint")
    said = struct.unpack("<I", data)[0]
    return _peer_pid_from_kernel(conn) or said  # Note [peer pid]


# Note [handshake time limit]
# Listener.accept() authenticates each client before returning it. A client
# that connects and then hangs up, or connects and says nothing, must neither
# raise out of accept() nor block it: every read and write of the handshake
# gives up after `handshake_timeout` seconds (SO_RCVTIMEO/SO_SNDTIMEO, since
# multiprocessing reads the socket with blocking os.read), the client is
# closed with a warning, and accept() waits for the next one.
_HANDSHAKE_ERRORS = (AuthenticationError, EOFError, OSError)


def _set_io_timeout(conn: mpc.Connection, seconds: float) -> None:
    """Let each read and write on ``conn`` wait at most ``seconds`` (0: forever)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        whole = int(seconds)
        value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    finally:
        sock.detach()


def _accept_handshake(conn: mpc.Connection, authkey: bytes, timeout: float) -> int:
    """Authenticate a client that just connected; its pid."""
    _set_io_timeout(conn, timeout)
    mpc.deliver_challenge(conn, authkey)
    mpc.answer_challenge(conn, authkey)
    pid = _exchange_pids(conn)
    _set_io_timeout(conn, 0)
    return pid


def _refusal(e: BaseException, timeout: float) -> str:
    if isinstance(e, BlockingIOError):  # what a read or write past SO_*TIMEO raises
        return f"it did not finish the handshake within {timeout:g} s"
    if isinstance(e, (EOFError, BrokenPipeError, ConnectionResetError)):
        return "it hung up during the handshake"
    return str(e) or type(e).__name__


def _with_address(error: OSError, what: str, todo: str) -> OSError:
    """The same OSError (class and errno kept) with the address and what to do."""
    reason = error.strerror or str(error)
    return type(error)(error.errno, f"torch_ipc: {what}: {reason}; {todo}")


class Listener:
    """Accept torch_ipc connections. ``authkey=None`` generates a random key,
    available as ``.authkey`` and printed to stderr so a client can be given it.

    Example::

        >>> with torch_ipc.listen(authkey=b"secret") as listener:  # doctest: +SKIP
        ...     conn = listener.accept(); conn.send(torch.ones(3, device="cuda"))
    """

    def __init__(
        self,
        address: Optional[Address] = None,
        family: Optional[str] = None,
        *,
        authkey: Optional[bytes] = None,
        backlog: int = 16,
        handshake_timeout: float = 10.0,
    ):
        if not handshake_timeout > 0:
            raise ValueError(f"handshake_timeout must be positive, got {handshake_timeout!r}")
        generated = authkey is None
        if generated:
            authkey = secrets.token_hex(16).encode()
        if not isinstance(authkey, bytes) or not authkey:
            raise TypeError("authkey must be non-empty bytes")
        self.authkey = authkey
        self.handshake_timeout = float(handshake_timeout)
        # No authkey here: accept() authenticates, with a time limit.
        try:
            self._listener = mpc.Listener(address, family, backlog=backlog)
        except OSError as e:
            raise _with_address(e, f"cannot listen at {address!r}", "pick a free address") from None
        if generated:
            print(f"torch_ipc: listening at {self.address!r}; clients connect with "
                  f"torch_ipc.connect({self.address!r}, authkey={authkey!r})", file=sys.stderr)

    @property
    def address(self) -> Address:
        return self._listener.address

    def accept(self) -> Connection:
        """Wait for an authenticated client. Clients with a wrong authkey, and
        clients that hang up or stay silent during the handshake (longer than
        ``handshake_timeout`` seconds), are refused and skipped with a warning
        (Note [handshake time limit])."""
        while True:
            if self._listener is None:
                raise OSError("torch_ipc: the listener is closed")
            conn = self._listener.accept()
            try:
                pid = _accept_handshake(conn, self.authkey, self.handshake_timeout)
                return Connection(_ring.accept_offer(conn, self.handshake_timeout), pid)
            except _HANDSHAKE_ERRORS as e:
                conn.close()
                warnings.warn(f"torch_ipc: refused a client: {_refusal(e, self.handshake_timeout)}", RuntimeWarning)
            except BaseException:
                conn.close()
                raise

    def close(self) -> None:
        """Stop listening. Idempotent."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def listen(
    address: Optional[Address] = None, *, authkey: Optional[bytes] = None, handshake_timeout: float = 10.0
) -> Listener:
    """Listen for torch_ipc clients at ``address`` (a Unix socket path, or a
    (host, port) pair; None picks a fresh Unix socket)."""
    return Listener(address, authkey=authkey, handshake_timeout=handshake_timeout)


def Client(address: Address, family: Optional[str] = None, authkey: Optional[bytes] = None) -> Connection:
    """Connect to a :class:`Listener`; the signature of
    ``multiprocessing.connection.Client``, except that ``authkey`` is required
    (bytes; there is no process-wide default). A wrong ``authkey`` raises
    :class:`multiprocessing.AuthenticationError` and nothing is received.

    Example::

        >>> with torch_ipc.Client(address, authkey=b"secret") as conn:  # doctest: +SKIP
        ...     y = conn.recv()
    """
    if not isinstance(authkey, bytes) or not authkey:
        raise TypeError("torch_ipc.Client: authkey must be non-empty bytes (it is required)")
    try:
        conn = mpc.Client(address, family, authkey=authkey)
    except AuthenticationError as e:
        raise AuthenticationError(f"torch_ipc: the listener at {address!r} refused this authkey ({e})") from None
    except OSError as e:
        raise _with_address(e, f"cannot connect to {address!r}",
                            "start the listener first, or check the address") from None
    pid = _exchange_pids(conn)
    return Connection(_ring.offer(conn), pid)


def connect(address: Address, *, authkey: bytes) -> Connection:
    """``Client(address, authkey=authkey)``."""
    return Client(address, authkey=authkey)
