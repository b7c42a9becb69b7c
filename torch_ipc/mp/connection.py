"""Listener/Client over multiprocessing.connection, carrying tensors zero-copy.

A message that holds tensors is one descriptor (see torch_ipc.dumps); one
without is its pickle (Note [pickles beside descriptors]). An authkey is always
required. Each side learns the other's process (pid and start time) after
authentication, so that what one side sent and the other never loaded is given back when the peer
closes the connection or dies (Note [connection lifetime]).
"""

import secrets
import socket
import struct
import sys
import threading
import time
import warnings
import weakref
from multiprocessing import AuthenticationError
from multiprocessing import connection as mpc
from typing import Any, List, Optional, Tuple, Union

from .. import _C, _process, _runtime, _serialize
from .._closing import Closeable
from ..errors import InFlightLimitError
from . import _flow, _listener, _ring

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
_orphans: List[Tuple[_process.ProcessId, List[_C.Export]]] = []  # (peer, exports it may still load)
_open_lock = threading.RLock()  # RLock: Connection.__del__ may run inside a locked region
_PRUNE_EVERY = 64  # sent exports between two prunes of the dead ones

# Note [pickles beside descriptors]
# A message that holds no tensor travels as its pickle alone (Note [messages
# without tensors] in _serialize.py): there is nothing to export, so neither
# side builds or parses a descriptor, and the round trip of a small object
# costs what torch_ipc.Pipe's does. The receiver tells the two forms apart by
# the first byte: a pickle of protocol 2 or more starts with PROTO (0x80), a
# descriptor with its magic ("TIPC"); anything else is a descriptor that
# loads() refuses. Both forms are unpickled in full only because the peer
# proved the authkey first (Note [weights_only] in _weights_only.py): a
# pickle gives the sender no power that a descriptor's payload did not. An
# end of an older torch_ipc (descriptors only) refuses these pickles with a
# DescriptorError: both ends must run the same torch_ipc.


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
        for peer, exports in _orphans:
            if not _process.alive(peer):
                gone.append(exports)
            elif live := _live(exports):
                kept.append((peer, live))
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


class Connection(Closeable):
    """One end of a torch_ipc connection: ``send(obj)``, ``recv()``, ``close()``.

    ``max_bytes_in_flight`` (None: no bound) bounds the bytes of tensors this
    end sent that the peer has not released yet, read or unread (Note [bytes
    in flight] in _flow.py); it may be changed at any time. Between two
    processes of one machine (a Unix socket) its messages go through shared
    memory (Note [channel] in _ring.py)."""

    def __init__(self, conn: Any, peer: _process.ProcessId, *, max_bytes_in_flight: Optional[int] = None):
        self._conn = conn  # the transport: an mpc.Connection, or a _ring.RingConnection
        self._peer = peer
        self._sent: List[_C.Export] = []  # what we sent that the peer may still load
        self._sent_bytes: List[Tuple[_C.Export, int]] = []  # Note [bytes in flight]
        self.max_bytes_in_flight = max_bytes_in_flight
        with _open_lock:
            _open_connections.add(self)

    # ---- send path: Note [bytes in flight], Note [send time limit]
    def send(self, obj: Any, timeout: Optional[float] = None) -> None:
        """Export ``obj`` (tensors zero-copy) and send it as one message.

        ``timeout`` (seconds; None waits as long as it takes) bounds the whole
        send: waiting for room under ``max_bytes_in_flight`` and writing to a
        peer that does not read. Past it, :class:`TimeoutError`; the message
        was not sent, or (written in part) the connection is closed."""
        plain, parts = _serialize.message(obj)
        if parts is None and timeout is None:  # no tensor: the pickle alone (Note [pickles beside descriptors])
            self._conn.send_bytes(plain)
            return
        deadline = _flow.deadline_of(timeout)
        if parts is None:
            self._send_by(plain, deadline)
            return
        nbytes = _flow.storage_bytes(parts[0])
        self._wait_for_room(nbytes, deadline)
        sent = _serialize.export_object(obj, parts)
        try:
            if deadline is None:
                self._conn.send_bytes(sent.data)
            else:
                self._send_by(sent.data, deadline)
        except BaseException:
            sent.revoke()  # the peer has not got it (or got part of it): nobody loads it
            raise
        if sent.live:  # it holds tensors of ours or forwarded ones
            self._sent.append(sent)
            self._sent_bytes.append((sent, nbytes))
            if len(self._sent) % _PRUNE_EVERY == 0:
                self._sent = _live(self._sent)
                self._sent_bytes = [(e, n) for e, n in self._sent_bytes if e.live]

    def bytes_in_flight(self) -> int:
        """Bytes of tensors sent here that the peer has not released yet."""
        self._sent_bytes = [(e, n) for e, n in self._sent_bytes if e.live]
        return sum(n for _, n in self._sent_bytes)

    def _wait_for_room(self, nbytes: int, deadline: Optional[float]) -> None:
        limit = self.max_bytes_in_flight
        if limit is None or nbytes == 0:
            return
        if nbytes > limit:
            raise InFlightLimitError(f"torch_ipc: this message holds {nbytes} bytes of tensors, more than the "
                                     f"connection's max_bytes_in_flight ({limit}); raise the limit or send less")
        while (pending := self.bytes_in_flight()) + nbytes > limit:
            if deadline is None or time.monotonic() >= deadline:
                raise InFlightLimitError(
                    f"torch_ipc: sending {nbytes} bytes would put {pending + nbytes} bytes in flight to pid "
                    f"{self.peer_pid}, over the connection's max_bytes_in_flight ({limit}): the peer has not "
                    "read or released what was sent" + ("" if deadline is None else " within the timeout")
                    + "; pass send(timeout=...) to wait for it, or raise the limit")
            time.sleep(_flow.ROOM_POLL_S)

    def _send_by(self, data: bytes, deadline: float) -> None:
        """send_bytes that gives up at ``deadline`` (Note [send time limit] in _flow.py)."""
        if isinstance(self._conn, _ring.RingConnection):
            written = self._conn.send_bytes_within(data, deadline - time.monotonic())
        else:
            written = _flow.write_by(self._conn.fileno(), data, deadline)
        if written < 0:
            return
        if written:
            self.close()  # the peer holds part of a message: the stream cannot go on
        raise TimeoutError(f"torch_ipc: send() to pid {self.peer_pid} did not finish within its timeout: "
                           "the peer does not read" + ("; the connection is closed, part of the message "
                                                       "having been written" if written else ""))

    def recv(self) -> Any:
        """Receive one message and rebuild it on the sender's memory."""
        # authenticated by its authkey: full pickle (Note [weights_only] in _weights_only.py)
        data = self._conn.recv_bytes()
        if data[:1] == _serialize.PICKLE_START:  # Note [pickles beside descriptors]
            return _serialize.unpickle_message(data)
        return _serialize.loads(data, weights_only=False)

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

    @property
    def peer_pid(self) -> int:
        """The pid of the process at the other end (Note [peer pid])."""
        return self._peer[0]

    def _peer_alive(self) -> bool:
        return _process.alive(self._peer)

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
        self._sent_bytes = []

    def close(self) -> None:
        """Close our end. Idempotent. What the peer has not loaded yet stays
        loadable while the peer lives (it may still read it from the socket)
        and is given back when it exits."""
        with _open_lock:
            sent, self._sent = _live(self._sent), []
            self._sent_bytes = []
            if sent:
                _orphans.append((self._peer, sent))
            _open_connections.discard(self)
        self._conn.close()


# Note [peer pid]
# Both sides send their process (pid and start time, Note [liveness through
# pidfd] in csrc/os/process.cpp) after authentication, but a pid that the peer
# says is only as true as the peer: one that names another process would make
# us revoke what we sent when that process exits, or keep it while the real
# peer is long gone. Where the transport knows the peer (a Unix socket:
# SO_PEERCRED, the pid of the process that connected or listened, as our PID
# namespace sees it) that pid is taken; the one sent counts only over TCP. The
# start time is the peer's word (the kernel does not tell it): a false one can
# only make us take the peer for dead and give back what it did not load. A
# peer in another PID namespace is not visible: SO_PEERCRED says 0, and the
# pid it sends counts in its namespace, so it is judged by the life key and
# PID namespace it sends (Note [life files] in csrc/os/life.h), words as true
# as its start time.
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_IDENTITY = struct.Struct("<IQII")  # pid, start time, life key, PID namespace


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


def _exchange_identities(conn: mpc.Connection) -> _process.ProcessId:
    conn.send_bytes(_IDENTITY.pack(*_process.self_identity()))
    data = conn.recv_bytes(32)
    if len(data) != _IDENTITY.size:
        raise ConnectionError("torch_ipc: the peer is not a torch_ipc endpoint of this version")
    said_pid, start_time, life, pidns = _IDENTITY.unpack(data)
    kernel_pid = _peer_pid_from_kernel(conn)  # Note [peer pid]
    if kernel_pid:  # a pid of our namespace
        return kernel_pid, start_time, life, _C.pid_namespace()
    return said_pid, start_time, life, pidns


# Note [handshake time limit]
# Listener.accept() returns authenticated clients only. A client that connects
# and then hangs up, says nothing, or trickles its handshake must neither raise
# out of accept() nor delay other clients: each handshake runs on a thread of
# its own under one deadline of `handshake_timeout` seconds for all of it
# (Note [concurrent handshakes] in _listener.py), the client is closed, and
# accept() warns and goes on with the next one. A client that hangs up
# without a word (a health check's connect, the probe of a second listen()
# at this path: Note [stale socket path]) is skipped without a warning.
_HANDSHAKE_ERRORS = (AuthenticationError, EOFError, OSError)


class _SaidNothing(EOFError):
    """A client hung up before it answered the challenge with a single byte."""


class _ServerHandshake:
    """The listening side of a connection's handshake, handed to the
    listener's handshake threads (Note [concurrent handshakes] in
    _listener.py): authenticate() under the handshake's deadline, then
    connection() makes what accept() returns."""

    def __init__(self, authkey: bytes, timeout: float, max_bytes_in_flight: Optional[int]):
        self._authkey = authkey
        self._timeout = timeout
        self._max_bytes_in_flight = max_bytes_in_flight

    def authenticate(self, conn: mpc.Connection) -> _process.ProcessId:
        """Authenticate a client that just connected; its process."""
        try:
            mpc.deliver_challenge(conn, self._authkey)
        except (EOFError, BrokenPipeError, ConnectionResetError):  # EOFError: no byte of an answer
            raise _SaidNothing() from None
        mpc.answer_challenge(conn, self._authkey)
        return _exchange_identities(conn)

    def connection(self, conn: mpc.Connection, peer: _process.ProcessId) -> "Connection":
        return Connection(_ring.accept_offer(conn, self._timeout), peer,
                          max_bytes_in_flight=self._max_bytes_in_flight)


def _refusal(e: BaseException, timed_out: bool, timeout: float) -> str:
    if timed_out or isinstance(e, BlockingIOError):
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

    A Unix socket file gets ``mode`` (0o600, the owner only; None: the
    umask's); a socket file left at ``address`` by a listener that died is
    taken over. ``max_bytes_in_flight`` becomes each accepted connection's.

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
        mode: Optional[int] = 0o600,
        max_bytes_in_flight: Optional[int] = None,
    ):
        if not handshake_timeout > 0:
            raise ValueError(f"handshake_timeout must be positive, got {handshake_timeout!r}")
        generated = authkey is None
        if generated:
            authkey = secrets.token_hex(16).encode()
        check_authkey(authkey, "Listener")
        self.authkey = authkey
        self.handshake_timeout = float(handshake_timeout)
        self.max_bytes_in_flight = max_bytes_in_flight
        self._handshakes: Optional[_listener.Handshakes] = None
        self._listener = _listener.SocketListener(address, family, backlog, mode)  # Note [listen errors]
        if generated:
            print(f"torch_ipc: listening at {self.address!r}; clients connect with "
                  f"torch_ipc.connect({self.address!r}, authkey={authkey!r})", file=sys.stderr)

    @property
    def address(self) -> Address:
        return self._listener.address

    def accept(self) -> Connection:
        """Wait for an authenticated client. Clients with a wrong authkey, and
        clients that hang up or do not finish the handshake within
        ``handshake_timeout`` seconds, are refused and skipped with a warning;
        a slow client never delays another (Note [handshake time limit])."""
        if self._listener is None:
            raise OSError("torch_ipc: the listener is closed")
        if self._handshakes is None:
            handshake = _ServerHandshake(self.authkey, self.handshake_timeout, self.max_bytes_in_flight)
            self._handshakes = _listener.Handshakes(self._listener, handshake, self.handshake_timeout)
        while True:
            kind, value = self._handshakes.next()
            if kind == "ok":
                return value
            if kind == "closed":
                raise OSError("torch_ipc: the listener is closed")
            if kind == "error":  # Note [accept at the fd limit] in _listener.py
                raise value
            error, timed_out, peer = value
            if not isinstance(error, _HANDSHAKE_ERRORS):
                raise error
            if isinstance(error, _SaidNothing) and not timed_out:
                continue
            warnings.warn(f"torch_ipc: refused a client ({peer}): "
                          f"{_refusal(error, timed_out, self.handshake_timeout)}",
                          RuntimeWarning, stacklevel=_listener.caller_stacklevel())

    def close(self) -> None:
        """Stop listening. Idempotent."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._handshakes is not None:
            self._handshakes.close()

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def listen(
    address: Optional[Address] = None,
    *,
    authkey: Optional[bytes] = None,
    handshake_timeout: float = 10.0,
    mode: Optional[int] = 0o600,
    max_bytes_in_flight: Optional[int] = None,
) -> Listener:
    """Listen for torch_ipc clients at ``address`` (a Unix socket path, or a
    (host, port) pair; None picks a fresh Unix socket)."""
    if authkey is not None:
        check_authkey(authkey, "listen")
    return Listener(address, authkey=authkey, handshake_timeout=handshake_timeout, mode=mode,
                    max_bytes_in_flight=max_bytes_in_flight)


def check_authkey(authkey: Any, caller: str) -> None:
    """The one check of an authkey, for every entry point that takes one
    (``caller`` names it in the message)."""
    if not isinstance(authkey, bytes) or not authkey:
        what = "empty bytes" if isinstance(authkey, bytes) else type(authkey).__name__
        raise TypeError(f"torch_ipc.{caller}: authkey must be non-empty bytes, not {what}")


# Note [a client's deadline]
# multiprocessing's Client waits as long as the listener takes: to accept
# (a full backlog), to challenge, to answer. A listener that accepts and
# then says nothing, or trickles, held connect() forever. With ``timeout``,
# the connect waits at most that long, and the listener's own handshake
# deadline (_listener._Deadline) then shuts the socket down at what is left,
# which ends whatever read or write waits on it (a per-read SO_RCVTIMEO
# would let a trickle go on): TimeoutError. Without one it waits, as
# multiprocessing's does (a listener may accept only once its model is
# loaded); Ctrl-C interrupts it either way.
def _client(address: Address, family: Optional[str], authkey: bytes,
            max_bytes_in_flight: Optional[int], timeout: Optional[float] = None) -> Connection:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be positive or None, got {timeout!r}")
    family = family or mpc.address_type(address)
    started = time.monotonic()
    try:
        with socket.socket(getattr(socket, family)) as sock:
            sock.settimeout(timeout)
            sock.connect(address)
            sock.settimeout(None)
            conn = mpc.Connection(sock.detach())
    except AttributeError as e:
        raise ValueError(f"torch_ipc: cannot connect to {address!r} (family {family}): {e}") from None
    except socket.timeout:
        raise TimeoutError(f"torch_ipc: the listener at {address!r} did not accept within {timeout} s") from None
    except OSError as e:
        raise _with_address(e, f"cannot connect to {address!r}",
                            "start the listener first, or check the address") from None
    deadline = None if timeout is None else _listener._Deadline(conn, max(timeout - (time.monotonic() - started), 1e-3))
    late = TimeoutError(f"torch_ipc: the listener at {address!r} did not finish the handshake within {timeout} s")
    try:
        mpc.answer_challenge(conn, authkey)
        mpc.deliver_challenge(conn, authkey)
        peer = _exchange_identities(conn)
        end = _ring.offer(conn)
    except BaseException as e:
        expired = deadline is not None and not deadline.finish()
        conn.close()
        if expired and isinstance(e, (EOFError, OSError, AuthenticationError)):
            raise late from None
        if isinstance(e, AuthenticationError):
            raise AuthenticationError(f"torch_ipc: the listener at {address!r} refused this authkey ({e})") from None
        raise
    if deadline is not None and not deadline.finish():  # fired after the last step: the socket is shut down
        end.close()
        raise late
    return Connection(end, peer, max_bytes_in_flight=max_bytes_in_flight)


def Client(address: Address, family: Optional[str] = None, authkey: Optional[bytes] = None) -> Connection:
    """Connect to a :class:`Listener`; the signature of
    ``multiprocessing.connection.Client``, except that ``authkey`` is required
    (bytes; there is no process-wide default). A wrong ``authkey`` raises
    :class:`multiprocessing.AuthenticationError` and nothing is received.
    It waits for the listener as multiprocessing's does; :func:`connect`
    takes a ``timeout`` (Note [a client's deadline]).
    Set ``.max_bytes_in_flight`` on the connection for a bound (or use
    :func:`connect`).

    Example::

        >>> with torch_ipc.Client(address, authkey=b"secret") as conn:  # doctest: +SKIP
        ...     y = conn.recv()
    """
    check_authkey(authkey, "Client")
    return _client(address, family, authkey, None)


def connect(address: Address, *, authkey: bytes, max_bytes_in_flight: Optional[int] = None,
            timeout: Optional[float] = None) -> Connection:
    """``Client(address, authkey=authkey, timeout=timeout)``."""
    check_authkey(authkey, "connect")
    return _client(address, None, authkey, max_bytes_in_flight, timeout)
