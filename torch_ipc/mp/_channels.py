"""Exports sent through multiprocessing connections, tied to the connection.

Note [unread messages]
With :func:`torch_ipc.init_reductions`, a message that holds tensors is
exported when multiprocessing pickles it, and the export waits for its load.
A message that is never read (its reader died with it unread) would keep its
export, and the memory, for the producer's whole life. So every export is
tied to the multiprocessing ``Connection`` that sent it: the pickler
(``_reductions._dumps``) leaves the exports of the bytes it made with this
thread, and the connection that sends exactly those bytes takes them
(``Connection._send_bytes``, which ``send``, ``send_bytes`` and the feeder
threads of ``Queue`` and ``SimpleQueue`` all call). The collector then looks
at each such connection: once no process can read its other end any more
(a pipe whose readers are all closed, a socket whose peer closed), the loads
its exports still expect are given back (``Export.revoke()``), so they are
reclaimed once their holders release them.

What torch_ipc cannot see, and which keeps such exports for the producer's
life: a reading end that some living process still has open. That is the
case of a ``Queue`` (the process that created it keeps its reading end), and
of a ``Pipe`` whose other end the producer did not close after handing it to
the child. Close the child's end in the parent after starting the child, or
use torch_ipc's own Listener/Client, whose connections know their peer.
Neither can it see past the sender closing its own end: the messages may
still be read, so their exports stay. ``torch_ipc.stats()["oldest_exports"]``
lists the oldest live exports with their age, to find such leftovers.
"""

import select
import threading
import weakref
from typing import Any, List, Optional, Tuple

from .. import _C, _runtime

_local = threading.local()  # .made: (the bytes of the last pickle, its exports)
_lock = threading.Lock()
# connection -> exports it sent that may still be loaded
_sent: "weakref.WeakKeyDictionary[Any, List[_C.Export]]" = weakref.WeakKeyDictionary()
_PRUNE_EVERY = 64  # sent exports between two prunes of the reclaimed ones
_CLOSED = select.POLLERR | select.POLLHUP | select.POLLNVAL


def made(data: bytes, exports: List[_C.Export]) -> None:
    """The pickler made ``data``, which carries ``exports``."""
    _local.made = (data, exports)


def _take_made(buf: Any) -> Optional[List[_C.Export]]:
    made_now: Optional[Tuple[bytes, List[_C.Export]]] = getattr(_local, "made", None)
    if made_now is None:
        return None
    data, exports = made_now
    if getattr(buf, "obj", buf) is not data:
        return None
    _local.made = None
    return exports


def sending(conn: Any, buf: Any, send: Any) -> None:
    """``send(buf)`` on ``conn``; tie the exports that ``buf`` carries to it."""
    exports = _take_made(buf)
    try:
        send(buf)
    except BaseException:
        if exports:  # never delivered: nobody will load them
            for e in exports:
                e.revoke()
        raise
    if exports:
        with _lock:
            sent = _sent.setdefault(conn, [])
            sent.extend(exports)
            if len(sent) % _PRUNE_EVERY == 0:
                sent[:] = [e for e in sent if e.live]


def _other_end_closed(fd: int) -> bool:
    """True when no process can read what we write to ``fd`` any more."""
    poller = select.poll()
    poller.register(fd, 0)  # errors and hang-ups are always reported
    try:
        return any(events & _CLOSED for _, events in poller.poll(0))
    except OSError:
        return False


def check_connections() -> None:
    """Revoke what connections whose other end closed still wait to be loaded."""
    closed: List[List[_C.Export]] = []
    with _lock:
        for conn, exports in list(_sent.items()):
            exports[:] = [e for e in exports if e.live]
            if not exports or conn.closed:  # closed by us: its messages may still be read
                del _sent[conn]
            elif _other_end_closed(getattr(conn, "socket_fileno", conn.fileno)()):  # a ring's fileno is no socket
                closed.append(exports)
                del _sent[conn]
    for exports in closed:
        for e in exports:
            e.revoke()


_runtime.on_collect(check_connections)
