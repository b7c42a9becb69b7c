"""Plug torch_ipc into multiprocessing: Queue, Pipe, Pool, connection.send.

Note [one descriptor per message]
multiprocessing pickles every message with ``ForkingPickler.dumps``, and a
per-type reducer would make one descriptor (one lease, one event, one pickle
frame) per tensor. So :func:`init_reductions` replaces ``ForkingPickler.dumps``
itself: a message that holds tensors becomes ONE descriptor, wrapped so that
the receiving side's plain ``pickle.loads`` calls :func:`torch_ipc.loads`.
Messages without tensors are pickled once, exactly as before (the pickler that
looks for tensors is a ForkingPickler, so its output is what multiprocessing
would have sent). Per-type reducers are
installed too, for code that pickles with a ForkingPickler instance directly.
What a message exported is tied to the connection that sends it (Note
[unread messages] in _channels.py).
"""

import contextlib
import pickle
from multiprocessing import connection as _mpc
from multiprocessing.reduction import ForkingPickler
from typing import Iterator

import torch

from . import _channels, _serialize

__all__ = ["init_reductions", "restore_reductions", "reductions"]

_REDUCED_TYPES = (torch.Tensor, torch.nn.Parameter, torch.UntypedStorage)
_saved = None  # (original dumps, {type: original reducer or None}, original Connection._send_bytes)


def _rebuild(descriptor: bytes):
    return _serialize.loads(descriptor)


class _Message:
    """What travels: a descriptor that rebuilds itself on unpickling."""

    __slots__ = ("descriptor",)

    def __init__(self, descriptor: bytes):
        self.descriptor = descriptor

    def __reduce__(self):
        return (_rebuild, (self.descriptor,))


def _reduce_one(obj):
    return (_rebuild, (_serialize.dumps(obj),))


def _dumps(cls, obj, protocol=None):
    tensors, parameters, payload = _serialize.split(obj)
    if not tensors:  # pickled exactly as multiprocessing would, already
        return _serialize.plain_pickle(payload)
    sent = _serialize.export(tensors, parameters, payload)
    data = pickle.dumps(_Message(sent.data), pickle.HIGHEST_PROTOCOL)
    if sent.live:
        _channels.made(data, [sent])
    return memoryview(data)


def _tracked_send_bytes(original):
    def _send_bytes(self, buf):
        _channels.sending(self, buf, lambda b: original(self, b))

    return _send_bytes


def init_reductions() -> None:
    """Make multiprocessing (and torch.multiprocessing) carry tensors through
    torch_ipc. Idempotent; undo with :func:`restore_reductions`.

    Example::

        >>> import torch.multiprocessing as mp, torch_ipc
        >>> torch_ipc.init_reductions()   # then use mp.Queue / Pipe / Pool as usual
    """
    global _saved
    if _saved is not None:
        return
    import torch.multiprocessing  # noqa: F401  (registers torch's reducers first, to save them)

    originals = {t: ForkingPickler._extra_reducers.get(t) for t in _REDUCED_TYPES}
    send_bytes = _mpc.Connection.__dict__["_send_bytes"]
    _saved = (ForkingPickler.__dict__["dumps"], originals, send_bytes)
    ForkingPickler.dumps = classmethod(_dumps)
    _mpc.Connection._send_bytes = _tracked_send_bytes(send_bytes)
    for t in _REDUCED_TYPES:
        ForkingPickler.register(t, _reduce_one)


def restore_reductions() -> None:
    """Undo :func:`init_reductions`: torch's own reducers again. Idempotent."""
    global _saved
    if _saved is None:
        return
    dumps, originals, send_bytes = _saved
    ForkingPickler.dumps = dumps
    _mpc.Connection._send_bytes = send_bytes
    for t, reducer in originals.items():
        if reducer is None:
            ForkingPickler._extra_reducers.pop(t, None)
        else:
            ForkingPickler._extra_reducers[t] = reducer
    _saved = None


@contextlib.contextmanager
def reductions() -> Iterator[None]:
    """``with torch_ipc.reductions(): ...`` installs the reducers for the block."""
    was_installed = _saved is not None
    init_reductions()
    try:
        yield
    finally:
        if not was_installed:
            restore_reductions()
