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

Note [torch never sees our storages]
torch's reducers cannot send a storage that torch_ipc made or mapped: a CUDA
one fails inside ``_share_cuda_()`` ("invalid device pointer"), a CPU one
would be moved into torch's shared memory, away from the memory other
processes map. So from the moment torch_ipc is imported (which loading
anything from it does), torch's tensor and storage reducers are wrapped:
what torch_ipc owns or mapped goes through torch_ipc (one descriptor per
tensor), everything else to torch exactly as before. A relay that received
tensors and forwards them through its own Queue or Pipe needs no
init_reductions() of its own. Nor does torch move them itself: its
``share_memory_()`` copies any CPU storage that is not in its own shared
memory into a new segment, so a consumer that called ``share_memory_()`` on
a received tensor (or ``model.share_memory()`` on a received model) wrote
into a private copy from then on, and ``is_shared()`` said False where
stock torch says True. So ``UntypedStorage.share_memory_`` and
``is_shared`` are wrapped too: a storage torch_ipc shares or mapped is
shared memory already.

Note [spawned children inherit the reductions]
init_reductions() puts a marker in multiprocessing's process config, which
every new Process copies and which a child started with 'spawn' or
'forkserver' unpickles before its target runs: unpickling it turns the
reductions on in the child (and its children in turn). A forked child
inherits them with the rest of its parent's memory.

Note [one payload, several loaders]
What a ForkingPickler INSTANCE pickles (``ForkingPickler(buf).dump(obj)``,
as SGLang's MultiprocessingSerializer does, then ``ForkingPickler.loads`` in
every tensor-parallel rank) is bytes the caller may load in several
processes, which torch allows for CUDA tensors. So the per-type reducers
export each tensor ``while_referenced`` with one counted load: any number of
loads while this process references the tensor, and the first load after it
dropped it (all that torch's limbo gives). A message of
``ForkingPickler.dumps`` (Queue, Pipe, Pool) has one reader and keeps its
counted lifetime, also where the per-type reducers pickle it (a relay
without init_reductions, Note [torch never sees our storages]): that is why
``ForkingPickler.dumps`` marks the thread while it runs. The cost: each
instance-pickled export lives, with its lease slot, as long as its tensor;
a payload made per step of long-lived weights adds one per tensor per step.

What a message exported is tied to the connection that sends it (Note
[unread messages] in _channels.py).
"""

import contextlib
import functools
import multiprocessing.process
import pickle
import threading
from multiprocessing import connection as _mpc
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterator, Optional

import torch

from .. import _C, _serialize
from . import _channels

__all__ = ["init_reductions", "restore_reductions", "reductions"]

_STORAGE_TYPES = _serialize._STORAGE_TYPES
_REDUCED_TYPES = tuple(dict.fromkeys((torch.Tensor, torch.nn.Parameter, *_STORAGE_TYPES)))
_saved = None  # (original dumps, {type: original reducer or None}, original Connection._send_bytes)
_CONFIG_KEY = "torch_ipc.reductions"


def _rebuild(descriptor: bytes):
    # inside a message of multiprocessing's own channels, which unpickle it with full pickle already
    return _serialize.loads(descriptor, weights_only=False)


class _Message:
    """What travels: a descriptor that rebuilds itself on unpickling."""

    __slots__ = ("descriptor",)

    def __init__(self, descriptor: bytes):
        self.descriptor = descriptor

    def __reduce__(self):
        return (_rebuild, (self.descriptor,))


_in_message = threading.local()  # .depth > 0 inside ForkingPickler.dumps


def _reduce_one(obj):
    """The per-type reducer (Note [one payload, several loaders])."""
    one_reader = getattr(_in_message, "depth", 0) > 0
    with _serialize.torch_shm_by_torch():  # Note [torch's shared memory through multiprocessing]
        return (_rebuild, (_serialize.export_object(obj, while_referenced=not one_reader).data,))


def _counted(dumps):
    """``ForkingPickler.dumps`` marking the thread as pickling one message."""

    def message_dumps(cls, obj, protocol=None):
        depth = getattr(_in_message, "depth", 0)
        _in_message.depth = depth + 1
        try:
            return dumps(cls, obj, protocol)
        finally:
            _in_message.depth = depth

    message_dumps.counted = True
    return message_dumps


# Note [objects without a reducer]
# ForkingPickler.dumps copies the whole reducer registry (copyreg's and the
# ~80 reducers torch and multiprocessing register) into a new pickler for
# every message: 2.3 us of a 64-byte object's 2.6 on the 2-core machine, paid
# twice per round trip, as much as the round trip of the bytes themselves on
# torch_ipc's rings. A message that meets none of those reducers and no
# tensor or storage pickles to the same bytes with a plain pickler (0.2 us,
# reused by the thread): _serialize.plain_dumps, Note [messages without
# tensors] in _serialize.py, whose rule decides for every torch_ipc channel.


def _dumps(cls, obj, protocol=None):
    plain, parts = _serialize.message(obj, protocol=protocol)  # without tensors: as multiprocessing pickles it
    if parts is None:
        return plain
    if any(map(_serialize.maybe_mapped_elsewhere, parts[0])):  # Note [torch's shared memory through multiprocessing]
        with _serialize.torch_shm_by_torch():
            parts = _serialize.split(obj, protocol=protocol)
    sent = _serialize.export_object(obj, parts)
    data = pickle.dumps(_Message(sent.data), pickle.HIGHEST_PROTOCOL)
    if sent.live:
        _channels.made(data, [sent])
    return memoryview(data)


def _tracked_send_bytes(original):
    def _send_bytes(self, buf):
        _channels.sending(self, buf, lambda b: original(self, b))

    return _send_bytes


def _tensor_view(obj) -> Optional[torch.Tensor]:
    """A tensor on the storage of ``obj`` (a tensor, or a storage), to ask C++ about."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, torch.storage.TypedStorage):
        obj = obj._untyped_storage
    if isinstance(obj, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.uint8, device=obj.device).set_(obj)
    return None


def _guarded(torch_reducer: Optional[Callable]) -> Callable:
    """torch's reducer for what torch_ipc does not own (Note [torch never sees our storages])."""

    def reduce(obj):
        t = _tensor_view(obj)
        if t is not None and _C.is_torch_ipc_storage(t):
            return _reduce_one(obj)
        if torch_reducer is None:
            return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return torch_reducer(obj)

    reduce.torch_reducer = torch_reducer
    return reduce


def _install_guards() -> None:
    import torch.multiprocessing  # noqa: F401  (registers torch's reducers first, to wrap them)

    dumps = getattr(ForkingPickler.__dict__.get("dumps"), "__func__", None)  # None: not the classmethod it was
    if dumps is not None and not getattr(dumps, "counted", False):
        ForkingPickler.dumps = classmethod(_counted(dumps))

    for t in _REDUCED_TYPES:
        reducer = ForkingPickler._extra_reducers.get(t)
        if getattr(reducer, "torch_reducer", False) is False:  # not wrapped yet
            ForkingPickler.register(t, _guarded(reducer))
    _guard_storage_methods()


def _ours(storage: torch.UntypedStorage) -> bool:
    return storage.device.type == "cpu" and _C.is_torch_ipc_storage(_tensor_view(storage))


def _guard_storage_methods() -> None:
    """Note [torch never sees our storages]: share_memory_() and is_shared()."""
    cls = torch.UntypedStorage
    share, is_shared = cls.share_memory_, cls.is_shared
    if getattr(share, "torch_ipc_guard", False):
        return

    @functools.wraps(share)
    def share_memory_(self, *args, **kwargs):
        return self if _ours(self) else share(self, *args, **kwargs)

    @functools.wraps(is_shared)
    def guarded_is_shared(self):
        return is_shared(self) or _ours(self)

    share_memory_.torch_ipc_guard = guarded_is_shared.torch_ipc_guard = True
    cls.share_memory_, cls.is_shared = share_memory_, guarded_is_shared


class _InheritReductions:
    """The marker of Note [spawned children inherit the reductions]."""

    def __reduce__(self):
        return (_inherit, ())


def _inherit() -> _InheritReductions:
    init_reductions()
    return _InheritReductions()


def init_reductions() -> None:
    """Make multiprocessing (and torch.multiprocessing) carry tensors through
    torch_ipc. Idempotent; undo with :func:`restore_reductions`. Children
    started afterwards have them on too (Note [spawned children inherit the
    reductions]).

    Example::

        >>> import torch.multiprocessing as mp, torch_ipc
        >>> torch_ipc.init_reductions()   # then use mp.Queue / Pipe / Pool as usual
    """
    global _saved
    if _saved is not None:
        return
    _install_guards()
    originals = {t: ForkingPickler._extra_reducers.get(t) for t in _REDUCED_TYPES}
    send_bytes = _mpc.Connection.__dict__["_send_bytes"]
    _saved = (ForkingPickler.__dict__["dumps"], originals, send_bytes)
    ForkingPickler.dumps = classmethod(_counted(_dumps))
    _mpc.Connection._send_bytes = _tracked_send_bytes(send_bytes)
    for t in _REDUCED_TYPES:
        ForkingPickler.register(t, _reduce_one)
    multiprocessing.process.current_process()._config[_CONFIG_KEY] = _InheritReductions()


def reductions_on() -> bool:
    """Whether init_reductions() is in force."""
    return _saved is not None


def restore_reductions() -> None:
    """Undo :func:`init_reductions`: torch's own reducers again. Idempotent."""
    global _saved
    if _saved is None:
        return
    dumps, originals, send_bytes = _saved
    multiprocessing.process.current_process()._config.pop(_CONFIG_KEY, None)
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


_install_guards()
