"""Connections over a shared-memory channel: :func:`torch_ipc.Pipe`, and the
transport that torch_ipc's :class:`~torch_ipc.Connection` switches to after
its handshake.

Note [channel]
Two processes of one machine hand each other messages through a pair of
single-producer single-consumer byte rings in one shared segment (C++:
csrc/os/ring.h, channel.h): a message costs two memcpy and, only when the
reader sleeps, one futex wake, instead of a socket write and read. The socket
stays: its end (close, or the process's death) is how a waiting side notices
that the peer is gone, and fileno() gives an fd that select/asyncio can wait
on (Note [fd wake-ups] in csrc/os/channel.cpp). A message larger than the
ring streams through it in pieces (the writer waits for room while the reader
takes what is there): no second path, no size limit, order kept.

Threads: one sender and one receiver at a time per end; others wait on a
lock. Processes: each direction of an end is used by one process at a time
(a forked child that inherited it, or the parent, not both at once); another
process that tries while the first lives gets OSError(EBUSY) instead of
garbled messages (Note [one process per end] in csrc/os/channel.cpp).
Every wait ends on Ctrl-C with the signal handler's exception (Note
[interruptible waits] in csrc/os/ring.cpp); one that ends in the middle of a
message closes the end, whose stream cannot go on.

The segment is a memfd, 0600, size-sealed, never named (Note [channel
segment trust] in csrc/os/ring_segment.cpp): a Connection's client makes it
and passes its fds over the authenticated Unix socket (SCM_RIGHTS); a Pipe's
ends are made together and reach a spawned child through multiprocessing's
fd passing (DupFd). Connections over TCP keep the socket.
"""

import os
import select
import socket
import struct
import threading
import time
import weakref
from multiprocessing import connection as mpc
from multiprocessing import context, reduction
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional, Tuple

from .. import _C, _serialize
from . import _channels

__all__ = ["Pipe", "RingConnection", "RING_BYTES"]

RING_BYTES = 1 << 20  # each direction; a larger message streams through
_live: "weakref.WeakSet[RingConnection]" = weakref.WeakSet()


class RingConnection:
    """A drop-in for ``multiprocessing.connection.Connection`` over a
    shared-memory channel (Note [channel])."""

    def __init__(self, channel: "_C.Channel", readable: bool = True, writable: bool = True):
        if not (readable or writable):
            raise ValueError("at least one of `readable` and `writable` must be True")
        self._channel = channel
        self._readable = readable
        self._writable = writable
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        _live.add(self)

    # ---- what multiprocessing's Connection offers

    @property
    def closed(self) -> bool:
        return self._channel.closed

    @property
    def readable(self) -> bool:
        return self._readable

    @property
    def writable(self) -> bool:
        return self._writable

    def fileno(self) -> int:
        """An fd readable while a message (or the peer's end) waits: for select,
        multiprocessing.connection.wait and asyncio."""
        return self._channel.fileno()

    def close(self) -> None:
        self._channel.close()

    def send_bytes(self, buf: Any, offset: int = 0, size: Optional[int] = None) -> None:
        self._check(self._writable, "write-only")
        if offset or size is not None or not isinstance(buf, bytes):
            buf = _slice(buf, offset, size)
        with self._send_lock:
            self._channel.send_bytes(buf)

    def send_bytes_within(self, buf: bytes, timeout: float) -> int:
        """send_bytes giving up after ``timeout`` seconds: -1 when sent, else
        how many of its bytes went in (0: none; more: part of a message is in
        the ring, close the connection). Note [send time limit] in _flow.py."""
        self._check(self._writable, "write-only")
        deadline = time.monotonic() + max(timeout, 0.0)
        if not self._send_lock.acquire(timeout=max(timeout, 0.0)):
            return 0
        try:
            return self._channel.send_bytes_within(buf, deadline - time.monotonic())
        finally:
            self._send_lock.release()

    def recv_bytes(self, maxlength: Optional[int] = None) -> bytes:
        self._check(self._readable, "read-only")
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        with self._recv_lock:
            data = self._channel.recv_bytes(-1 if maxlength is None else maxlength)
        if data is None:
            raise EOFError
        return data

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
        data = self.recv_bytes()
        with memoryview(buf) as m:
            itemsize = m.itemsize
            bytesize = itemsize * len(m)
            if offset < 0:
                raise ValueError("negative offset")
            if offset > bytesize:
                raise ValueError("offset too large")
            if bytesize - offset < len(data):
                raise mpc.BufferTooShort(data)
            m.cast("B")[offset:offset + len(data)] = data
        return len(data)

    def send(self, obj: Any) -> None:
        """Pickle ``obj`` (ForkingPickler: tensors through torch_ipc when its
        reductions are on) and send it."""
        self._check(self._writable, "write-only")
        data = _serialize.plain_dumps(obj)  # Note [objects without a reducer] in _reductions.py
        if data is not None:  # as ForkingPickler.dumps would make it, reductions on or off; nothing exported
            with self._send_lock:
                self._channel.send_bytes(data)
            return
        data = ForkingPickler.dumps(obj)
        _channels.sending(self, data, self._send_locked)  # Note [unread messages] in _channels.py

    def recv(self) -> Any:
        return ForkingPickler.loads(self.recv_bytes())

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        self._check(self._readable, "write-only")
        # Another thread in recv: wait for it at most `timeout` (it takes what is there).
        if not self._recv_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        try:
            return self._channel.poll(timeout)
        finally:
            self._recv_lock.release()

    def __enter__(self) -> "RingConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        if self.closed:
            raise OSError("torch_ipc: cannot pass a closed connection")
        shape = (self._channel.side, self._channel.ring_bytes, self._readable, self._writable)
        if context.get_spawning_popen() is not None:  # a child being started: its fds go along
            return (_rebuild, (tuple(reduction.DupFd(fd) for fd in self._channel.fds()), *shape))
        # Any other process, in another container too: Note [fds for one fetch] in csrc/os/fd_passing.cpp.
        owner = tuple(_C.self_identity())
        return (_rebuild_fetched, (owner, _C.channel_publish_fds(list(self._channel.fds())), *shape))

    # ---- torch_ipc's own

    def socket_fileno(self) -> int:
        """The socket to the other end: it hangs up when the other end is gone."""
        return self._channel.fds()[1]

    def _send_locked(self, buf: Any) -> None:
        with self._send_lock:
            self._channel.send_bytes(buf)

    def _check(self, allowed: bool, what: str) -> None:
        if self._channel.closed:
            raise OSError("handle is closed")
        if not allowed:
            raise OSError(f"connection is {what}")

    def _after_fork(self) -> None:
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._channel.after_fork()


def _slice(buf: Any, offset: int, size: Optional[int]) -> memoryview:
    m = memoryview(buf)
    if m.itemsize > 1:
        m = m.cast("B")
    n = m.nbytes
    if offset < 0:
        raise ValueError("offset is negative")
    if n < offset:
        raise ValueError("buffer length < offset")
    if size is None:
        size = n - offset
    elif size < 0:
        raise ValueError("size is negative")
    elif offset + size > n:
        raise ValueError("buffer length < offset + size")
    return m[offset:offset + size]


def _close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _channel(memory: int, sock: int, bells: Tuple[int, int], side: int, ring_bytes: int) -> "_C.Channel":
    """A channel end on duplicates of the given fds (the caller keeps its own)."""
    dups = []
    try:
        for fd in (memory, sock, *bells):
            dups.append(os.dup(fd))
    except BaseException:
        _close_fds(dups)
        raise
    return _C.Channel(*dups, side, ring_bytes)  # takes the duplicates, even when it raises


def _rebuild(fds, side: int, ring_bytes: int, readable: bool, writable: bool) -> RingConnection:
    owned = [df.detach() for df in fds]
    return RingConnection(_C.Channel(*owned, side, ring_bytes), readable, writable)


def _rebuild_fetched(owner: tuple, ident: int, side: int, ring_bytes: int, readable: bool,
                     writable: bool) -> RingConnection:
    """An end pickled for a process its owner did not start: its fds from the owner's fd server."""
    fds = _C.channel_fetch_fds(*owner, ident)
    if len(fds) != 4:
        _close_fds(fds)
        raise OSError(f"torch_ipc: a Pipe end came with {len(fds)} file descriptors, not 4")
    return RingConnection(_C.Channel(*fds, side, ring_bytes), readable, writable)


def Pipe(duplex: bool = True, *, ring_bytes: int = RING_BYTES) -> Tuple[RingConnection, RingConnection]:
    """A pair of connected ends, like ``multiprocessing.Pipe``, whose messages
    go through shared memory (Note [channel]). Both ends can be passed to a
    child (``Process(args=(end,))``), forked or spawned. ``duplex=False``:
    (receive-only end, send-only end). ``ring_bytes``: the ring of each
    direction (a power of two, 4 KiB .. 1 GiB); larger messages stream through.

    Example::

        >>> parent, child = torch_ipc.Pipe()
        >>> parent.send({"x": 1}); child.recv()
        {'x': 1}
    """
    memory, bell0, bell1 = _C.channel_segment(ring_bytes)
    end0 = None
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with a, b:
            end0 = _channel(memory, a.fileno(), (bell0, bell1), 0, ring_bytes)
            end1 = _channel(memory, b.fileno(), (bell0, bell1), 1, ring_bytes)
    except BaseException:
        if end0 is not None:
            end0.close()
        raise
    finally:
        _close_fds((memory, bell0, bell1))  # each end holds duplicates
    if duplex:
        return RingConnection(end0), RingConnection(end1)
    return RingConnection(end1, writable=False), RingConnection(end0, readable=False)


# ---- a torch_ipc Connection's switch to the rings (Note [channel])

_OFFER = struct.Struct("<8sII")  # magic, version, ring bytes
_MAGIC = b"TIPCRING"
_VERSION = 1
_ACCEPTED, _REFUSED = b"\x01", b"\x00"


def offer(conn: mpc.Connection, ring_bytes: int = RING_BYTES) -> Any:
    """The connecting side, after the handshake: make a segment and offer it.
    Returns a RingConnection on it, or ``conn`` (not a Unix socket, or refused)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        if sock.family != socket.AF_UNIX:
            return conn
        memory, bell0, bell1 = _C.channel_segment(ring_bytes)
        try:
            socket.send_fds(sock, [_OFFER.pack(_MAGIC, _VERSION, ring_bytes)], [memory, bell0, bell1])
            answer = sock.recv(1)
            if answer == b"":
                raise EOFError("torch_ipc: the listener hung up while setting up the channel")
            if answer != _ACCEPTED:
                return conn
            end = RingConnection(_channel(memory, sock.fileno(), (bell0, bell1), 0, ring_bytes))
        finally:
            _close_fds((memory, bell0, bell1))
    finally:
        sock.detach()
    conn.close()  # the channel holds its own duplicate of the socket
    return end


def accept_offer(conn: mpc.Connection, timeout: float) -> Any:
    """The listening side, after the handshake: take the client's segment
    (waiting ``timeout`` seconds for it). Returns a RingConnection on it, or
    ``conn``: not a Unix socket, a segment that fails its checks, or a client
    that offers none (it hung up, sent a message first, or said nothing)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        if sock.family != socket.AF_UNIX:
            return conn
        if not select.select([sock], [], [], timeout)[0]:
            return conn
        head = sock.recv(len(_MAGIC), socket.MSG_PEEK)
        if not head or not _MAGIC.startswith(head):
            return conn
        data, fds, flags, _ = socket.recv_fds(sock, _OFFER.size, 3)
        try:
            end = _accept(sock, data, fds, flags)
        finally:
            _close_fds(fds)
    finally:
        sock.detach()
    if end is None:
        return conn
    conn.close()
    return end


def _accept(sock: socket.socket, data: bytes, fds, flags: int) -> Optional[RingConnection]:
    end = None
    if len(data) == _OFFER.size and len(fds) == 3 and not flags & socket.MSG_CTRUNC:
        magic, version, ring_bytes = _OFFER.unpack(data)
        if magic == _MAGIC and version == _VERSION:
            try:
                end = RingConnection(_channel(fds[0], sock.fileno(), (fds[1], fds[2]), 1, ring_bytes))
            except (OSError, ValueError):  # a segment that fails its checks: keep the socket
                end = None
    sock.sendall(_ACCEPTED if end is not None else _REFUSED)
    return end


def set_spin_us(us: float) -> None:
    """How long a waiting end spins before it sleeps (Note [spin budget] in csrc/os/ring.cpp)."""
    _C.set_channel_spin_ns(int(us * 1000))


def _after_fork_in_child() -> None:
    for end in list(_live):
        end._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
