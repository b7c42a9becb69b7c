"""dumps/loads: a Python object holding tensors <-> one torch_ipc descriptor.

The object is pickled with every tensor (and UntypedStorage, TypedStorage)
replaced by its index in a list; the list goes to the C++ exporter and the
pickle rides along as the descriptor's payload. So any picklable object works:
a tensor, a state_dict, nested dicts/lists/tuples, dataclasses holding tensors.

Note [tensors torch_ipc does not share itself]
As torch.multiprocessing does: a meta tensor travels as its shape, strides and
dtype (torch's own reducer); a sparse tensor (COO, CSR, CSC, BSR, BSC) as its
index and value tensors, which torch_ipc shares, rebuilt around them on the
other side; a nested tensor by torch's own reducer, around its buffer, which
torch_ipc shares; any other layout raises a TypeError that names it. A
non-leaf tensor that requires grad is refused with torch's own message. A
tensor subclass (other than nn.Parameter) pickles as torch pickles it, by its
own ``__reduce_ex__``, and the storage under it is shared: a subclass through
a Queue arrives as that subclass, on the sender's memory.
"""

import contextlib
import copyreg
import io
import os
import pickle
import re
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterator, List, Optional

import torch

from . import _C, _runtime
from ._weights_only import allowed_global, check_payload, validate_sparse_rebuild
from .errors import CudaUnavailableError, DescriptorError, WeightsOnlyError
from .pool import isolate_tensors

__all__ = ["dumps", "loads"]

_TENSOR = 0
_STORAGE = 1
_TYPED_STORAGE = 2


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_STORAGE_TYPES = (torch.UntypedStorage, torch.storage.TypedStorage, *torch._storage_classes)

# Note [torch's shared memory through multiprocessing]
# A CPU tensor that share_memory_() put in torch's shared memory before the
# process forked is mapped by its forked children too: a DataLoader's
# shared cache, Hogwild weights. Exported by torch_ipc, its storage moved
# into a new segment of torch_ipc's (ensure_host_shared), and the sender's
# writes from then on went there, where the forked children never look: a
# worker's cache fills stopped reaching the main process. Through
# multiprocessing's own channels (init_reductions: a Queue, a Pipe, a
# DataLoader's result queue; the peers are one program's processes, which
# torch's fd passing reaches) such storages are therefore left to torch's
# reducers, exactly as stock torch sends them, where another process may map
# them: one that another process made (its pid is in torch's name for it), or
# any, once this process has forked. A storage this process made and never
# forked with (the batch a DataLoader worker's collate puts in shared memory)
# is nobody else's and goes through torch_ipc. Through torch_ipc's own
# channels and dumps(), whose peers may be any process, torch's fd passing
# does not work, and the storage is still moved (docs/drop-in.md says so).
_torch_shm = threading.local()
_forked = [False]  # whether this process forked a child since it started
os.register_at_fork(after_in_parent=lambda: _forked.__setitem__(0, True),
                    after_in_child=lambda: _forked.__setitem__(0, False))


def maybe_mapped_elsewhere(t: torch.Tensor) -> bool:
    """Whether ``t`` is in torch's shared memory that another process may map."""
    maker = _C.torch_shared_memory_maker(t)
    return maker != 0 and (maker != os.getpid() or _forked[0])


@contextlib.contextmanager
def torch_shm_by_torch() -> Iterator[None]:
    """While active on this thread, storages in torch's shared memory go to
    torch's reducers (Note [torch's shared memory through multiprocessing])."""
    previous = getattr(_torch_shm, "on", False)
    _torch_shm.on = True
    try:
        yield
    finally:
        _torch_shm.on = previous


def _left_to_torch(t: torch.Tensor) -> bool:
    return getattr(_torch_shm, "on", False) and maybe_mapped_elsewhere(t)


def _reduce_storage_by_torch(storage):
    """A storage persistent_id left alone (meta, or in torch's shared memory):
    torch's own reducer of its type, as torch.multiprocessing registers them."""
    from torch.multiprocessing import reductions

    if isinstance(storage, torch.UntypedStorage):
        return reductions.reduce_storage(storage)
    if type(storage) is torch.storage.TypedStorage:
        return reductions.reduce_typed_storage(storage)
    return reductions.reduce_typed_storage_child(storage)


class _Pickler(ForkingPickler):
    # A ForkingPickler, so that what else the message holds (connections, file
    # descriptors) pickles as multiprocessing would pickle it.
    def __init__(self, file, tensors: List[torch.Tensor], parameters: List[bool], protocol=pickle.HIGHEST_PROTOCOL):
        super().__init__(file, protocol)
        self._tensors = tensors
        self._parameters = parameters

        # What persistent_id leaves to pickling (Note [tensors torch_ipc does
        # not share itself]), never to the reducers init_reductions installs.
        self.dispatch_table[torch.Tensor] = _reduce_unshared_tensor
        self.dispatch_table[torch.nn.Parameter] = _reduce_unshared_tensor
        for t in _STORAGE_TYPES:
            self.dispatch_table[t] = _reduce_storage_by_torch

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if type(obj) not in _PLAIN_TENSORS or obj.is_nested:  # Note [tensors torch_ipc does not share itself]
                return None
            if not _C.shared_natively(obj):  # Note [one shareability rule] in csrc/core/export.cpp
                return None
            kind, tensor, extra = _TENSOR, obj, ()
        elif isinstance(obj, torch.UntypedStorage):
            if obj.device.type == "meta":
                return None  # torch's reducer says why it cannot be sent
            kind, extra = _STORAGE, ()
            tensor = torch.empty(0, dtype=torch.uint8, device=obj.device).set_(obj)
        elif isinstance(obj, torch.TypedStorage):
            untyped = obj._untyped_storage
            if untyped.device.type == "meta":
                return None
            kind, extra = _TYPED_STORAGE, (obj.dtype,)
            tensor = torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped)
        else:
            return None
        if _left_to_torch(tensor):  # Note [torch's shared memory through multiprocessing]
            return None
        self._tensors.append(tensor)
        self._parameters.append(type(tensor) is torch.nn.Parameter)
        return (kind, len(self._tensors) - 1, *extra)


def _reduce_unshared_tensor(t: torch.Tensor):
    """Pickle a tensor that persistent_id left alone: meta, nested, sparse ones, and
    those left to torch (Note [torch's shared memory through multiprocessing])."""
    from torch.multiprocessing.reductions import reduce_tensor

    if t.is_meta or t.is_nested or (t.requires_grad and not t.is_leaf) or _left_to_torch(t):
        return reduce_tensor(t)  # torch's: shape only, its buffer (shared by persistent_id), or torch's refusal
    if t.layout is torch.sparse_coo:
        parts = (t._indices().detach(), t._values().detach())
        return (_rebuild_sparse, (t.layout, parts, t.shape, t.is_coalesced(), t.requires_grad))
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values().detach())
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (t.ccol_indices(), t.row_indices(), t.values().detach())
    else:
        raise TypeError(f"torch_ipc cannot share tensors of layout {t.layout}; convert them first (to_dense())")
    return (_rebuild_sparse, (t.layout, parts, t.shape, False, t.requires_grad))


def _rebuild_sparse(layout, parts, shape, coalesced, requires_grad):
    # Indices come from another process's shared memory: checked on a private
    # copy (Note [sparse tensors from a peer] in _weights_only.py).
    *indices, values = parts
    t = validate_sparse_rebuild(layout, indices, values, shape, coalesced if layout is torch.sparse_coo else None)
    return t.requires_grad_(requires_grad)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors: List[torch.Tensor], weights_only: bool):
        super().__init__(file)
        self._tensors = tensors
        self._weights_only = weights_only

    def find_class(self, module, name):
        if not self._weights_only:
            return super().find_class(module, name)
        return allowed_global(module, name)  # Note [weights_only] in _weights_only.py

    def persistent_load(self, pid):
        try:
            kind, index, *extra = pid
            tensor = self._tensors[index]
            if kind == _TYPED_STORAGE:
                (dtype,) = extra
                return torch.TypedStorage(wrap_storage=tensor.untyped_storage(), dtype=dtype, _internal=True)
        except (TypeError, ValueError, IndexError, RuntimeError):
            raise pickle.UnpicklingError(f"torch_ipc: bad tensor reference {pid!r}") from None
        return tensor.untyped_storage() if kind == _STORAGE else tensor


class _Reached(Exception):
    """Raised by _PlainUnpickler at the first global or tensor reference."""


class _PlainUnpickler(pickle.Unpickler):
    """The C unpickler for a payload that names no global and no tensor
    (Note [weights_only] in _weights_only.py): stops at the first of them."""

    def find_class(self, module, name):
        raise _Reached

    def persistent_load(self, pid):
        raise _Reached


# A memo index the C unpickler would size its memo for (~16 bytes each) past
# 2**16 entries: LONG_BINPUT with a high byte set, PUT with 6 or more digits.
# Payloads where these bytes occur, even inside a string, go to the walk,
# which bounds every index (Note [where an object comes from]).
_LARGE_MEMO_INDEX = re.compile(rb"r..[^\x00]|r...[^\x00]|p[^\n]{6}", re.DOTALL)


def _load_weights_only(pickled, tensors: List[torch.Tensor]) -> Any:
    """The object of a pickle in a weights_only load (Note [weights_only] in _weights_only.py)."""
    if not _LARGE_MEMO_INDEX.search(pickled):
        try:
            return _PlainUnpickler(io.BytesIO(pickled)).load()
        except _Reached:
            pass
        except MemoryError:  # a declared size past the payload (BINBYTES8): the walk says which
            pass
    check_payload(bytes(pickled))
    return _Unpickler(io.BytesIO(pickled), tensors, True).load()


# Note [payload fast paths]
# Pickling with persistent_id calls back into Python for every object, ~0.8 us
# per state_dict entry. The shapes people send most (a tensor, a dict of
# tensors such as a state_dict, a list or tuple of tensors) skip that: the
# payload is then a tag byte and, for a dict, the pickled list of its keys.
# A fast shape whose tensors torch_ipc does not all share itself (a sparse or
# meta one among them) is pickled instead, decided up front by the one rule
# (Note [one shareability rule] in csrc/core/export.cpp).
_SINGLE = b""
_DICT = b"D"
_LIST = b"L"
_TUPLE = b"T"
_PICKLED = b"P"
_PLAIN_SET = frozenset((torch.Tensor, torch.nn.Parameter))
_STR_SET = frozenset((str,))


def _flat(obj):
    """(tensors, is_parameter, payload) for the fast shapes, else payload None."""
    kind = type(obj)
    if getattr(_torch_shm, "on", False):
        return None, None, None  # the pickler decides per tensor (Note [torch's shared memory through multiprocessing])
    if kind is torch.Tensor:
        if _C.shared_natively(obj):
            return [obj], [], _SINGLE
    elif kind is dict or kind is list or kind is tuple:
        if not obj or type(next(iter(obj.values())) if kind is dict else obj[0]) not in _PLAIN_SET:
            return None, None, None  # most messages: not a container of tensors
        values = list(obj.values()) if kind is dict else list(obj)
        types = set(map(type, values))
        if types <= _PLAIN_SET and _C.all_shared_natively(values):
            parameters = [type(v) is torch.nn.Parameter for v in values] if torch.nn.Parameter in types else []
            if kind is dict:
                keys = list(obj)
                if set(map(type, keys)) == _STR_SET:
                    return values, parameters, _DICT + pickle.dumps(keys, pickle.HIGHEST_PROTOCOL)
            else:
                return values, parameters, _LIST if kind is list else _TUPLE
    return None, None, None


# Note [consumers=None]
# consumers=N keeps an export until N loads happened and every loader
# released it, even when the producer dropped its tensors right after
# sending: ``q.put(x * 2)`` must work, and it is what torch.multiprocessing
# does for each message. consumers=None instead keeps an export as long as the
# producer references its tensors or a reader holds what it loaded, for any
# number of readers (a descriptor in a file, as with a raw CUDA IPC handle).
# It is not the default because a temporary sent with it is reclaimed before
# anybody loads it, and because an export per message of a long-lived tensor
# (weights resent each step) would then live, with its lease slot, as long as
# the tensor: dumps it once and hand the same bytes to every reader.


def dumps(obj: Any, *, consumers: Optional[int] = 1, isolated: bool = False) -> bytes:
    """Export ``obj`` and every tensor in it; return a descriptor (bytes).

    CUDA tensors are shared zero-copy through CUDA IPC; CPU tensors are moved
    (once, in place, as ``share_memory_()`` does) into shared memory. The
    producer keeps every exported storage alive until ``consumers`` loads have
    happened and every process that loaded it has released it (or died).

    ``consumers=None``: any number of processes may load it, for as long as
    this process references the tensors in ``obj`` or some reader holds what
    it loaded; then it is reclaimed (Note [consumers=None]). Not with
    ``isolated=True`` (the copies would be referenced by nobody).

    ``isolated=True`` COPIES every CUDA tensor that is not already a
    :class:`torch_ipc.SharedPool` tensor into an allocation of its own first,
    and shares the copy: a consumer then maps exactly those bytes, never a
    neighbour that torch's caching allocator put in the same block, and the
    memory outlives this process. Later writes to the original are not seen
    by consumers (nor theirs by it). See Note [isolated sharing] in pool.py.

    Example::

        >>> import torch, torch_ipc
        >>> x = torch.arange(4.0)
        >>> data = torch_ipc.dumps({"x": x})
        >>> torch_ipc.loads(data)["x"].data_ptr() == x.data_ptr()
        True
    """
    return export_object(obj, consumers=consumers, isolated=isolated).data


def export_object(obj: Any, parts=None, *, consumers: Optional[int] = 1, isolated: bool = False,
                  while_referenced: bool = False) -> "_C.Export":
    """Split (or take ``parts``, what :func:`split` returned for ``obj``) and
    export. ``while_referenced``: also keep the export while this process
    references its tensors (Note [one payload, several loaders] in
    mp/_reductions.py)."""
    if consumers is None:
        if isolated:
            raise ValueError("torch_ipc: consumers=None cannot be combined with isolated=True")
        consumers = 0  # open-ended (Note [open-ended exports] in csrc/core/export.cpp)
    elif type(consumers) is not int or consumers < 1:
        raise ValueError(f"consumers must be None or an int of at least 1, not {consumers!r}")
    tensors, parameters, payload = parts if parts is not None else split(obj)
    return export_parts(tensors, parameters, payload, consumers=consumers, isolated=isolated,
                  while_referenced=while_referenced)


# Note [messages without tensors]
# Most messages hold no tensor at all (a KV hand-over, the weights' control
# messages, a reply, a dict of numbers). For them the fastest correct form is
# the pickle alone, as multiprocessing would make it: no descriptor to build
# and parse (~1 us each side), no persistent_id (a Python call per object),
# no ForkingPickler (it copies its 80-entry dispatch table when made). So an
# object that is not a fast shape is first pickled by the C pickler alone,
# with a dispatch table that stops at the first tensor or storage, and at
# every type multiprocessing reduces itself (connections, sockets, bound
# methods: their reducers have effects, such as handing a file descriptor to
# the resource sharer, which must happen once). What completes is ForkingPickler's
# output byte for byte; what stops is pickled again by _Pickler, which also
# raises any error the object's pickling has (a __reduce__ of the user's own
# runs twice then, once per pickling). The table is made again when copyreg's
# or ForkingPickler's table gains or loses a type. A few such picklers are
# kept between messages (making one and its file is half of a small
# message's pickling), each taken by one message at a time: a thread, or a
# __reduce__ that pickles a message of its own, that finds none makes one. Where the pickle alone travels:
# :func:`message` gives it, and torch_ipc's Connection (which tells it from a
# descriptor by its first byte, Note [pickles beside descriptors] in
# mp/connection.py), torch_ipc.Pipe and multiprocessing's channels under
# init_reductions() send it as is.
class _NotPlain(Exception):
    """Raised by the probe's dispatch table: the object needs _Pickler."""


def _not_plain(obj):
    raise _NotPlain


_probe_table = (None, None)  # (fingerprint, table)
_spares: list = []  # (dispatch table, protocol, pieces, pickler) not in use now
_SPARES = 4  # kept for the threads that pickle at once


def _probe_dispatch_table():
    global _probe_table
    extra = ForkingPickler._extra_reducers
    key = (len(copyreg.dispatch_table), len(extra))
    if _probe_table[0] != key:
        table = copyreg.dispatch_table.copy()
        table.update(dict.fromkeys(extra, _not_plain))
        table.update(dict.fromkeys((torch.Tensor, torch.nn.Parameter, torch.UntypedStorage, torch.TypedStorage),
                                   _not_plain))
        _probe_table = (key, table)
    return _probe_table


class _Sink:
    """What a kept pickler writes to: the pieces, in a list (no file to rewind)."""

    __slots__ = ("write", "pieces")

    def __init__(self):
        self.pieces: List[Any] = []
        self.write = self.pieces.append


def plain_dumps(obj: Any, protocol=None) -> Optional[bytes]:
    """``obj`` pickled as ``ForkingPickler.dumps(obj, protocol)`` would, if it
    holds no tensor, storage or object that multiprocessing reduces itself;
    else None (Note [messages without tensors])."""
    table = _probe_dispatch_table()[1]
    try:
        spare = _spares.pop()  # atomic: each pickler serves one message at a time
    except IndexError:
        spare = None
    if spare is None or spare[0] is not table or spare[1] != protocol:
        sink = _Sink()
        pickler = pickle.Pickler(sink, protocol)
        pickler.dispatch_table = table
        spare = (table, protocol, sink.pieces, pickler)
    pieces, pickler = spare[2], spare[3]
    try:
        pickler.dump(obj)
        # one piece, the pickler's own buffer, unless large items were written apart (protocol 4 and 5)
        return pieces[0] if len(pieces) == 1 and type(pieces[0]) is bytes else b"".join(pieces)
    except Exception:  # _NotPlain, or an error that _Pickler raises again for the caller
        return None
    finally:
        pickler.clear_memo()  # it would hold the object's parts until the next message
        pieces.clear()
        if len(_spares) < _SPARES:
            _spares.append(spare)


def _pickled(obj: Any, protocol):
    """(tensors, is_parameter, payload) of _Pickler."""
    tensors, parameters = [], []
    buf = io.BytesIO()
    buf.write(_PICKLED)
    _Pickler(buf, tensors, parameters, protocol).dump(obj)
    return tensors, parameters, buf.getvalue()


def message(obj: Any, *, protocol=pickle.HIGHEST_PROTOCOL):
    """``(pickle, None)`` for an object without tensors (the pickle alone, as
    ForkingPickler makes it: Note [messages without tensors]), else
    ``(None, parts)``, ``parts`` being what :func:`split` returns."""
    parts = _flat(obj)
    if parts[2] is not None:
        return None, parts
    plain = plain_dumps(obj, protocol)
    if plain is not None:
        return plain, None
    parts = _pickled(obj, protocol)
    if not parts[0]:  # nothing to export: the pickle, without its tag
        return memoryview(parts[2])[1:], None
    return None, parts


PICKLE_START = pickle.PROTO  # the first byte of what message() pickles (protocol 2 or more)


def unpickle_message(data: bytes) -> Any:
    """The object of a pickle that :func:`message` made, in full (for an
    authenticated sender only); a :class:`DescriptorError` for one that does
    not unpickle (never the EOFError of a truncated pickle, which would read
    as the peer's end)."""
    try:
        return pickle.loads(data)
    except Exception as e:
        raise DescriptorError(f"torch_ipc: a message that does not unpickle: {e!r}") from e


def split(obj: Any, *, protocol=pickle.HIGHEST_PROTOCOL):
    """(tensors, is_parameter, payload): the tensors in ``obj`` and the rest
    (pickled with ``protocol`` where the fast paths do not apply).
    ``is_parameter`` has one entry per tensor, or none when no tensor is an
    nn.Parameter (as export_tensors takes it: no list of n False to build)."""
    plain, parts = message(obj, protocol=protocol)
    if parts is None:
        return [], [], _PICKLED + plain
    return parts


def export_parts(tensors, parameters, payload: bytes, *, consumers: int = 1, isolated: bool = False,
           while_referenced: bool = False) -> "_C.Export":
    """Export what :func:`split` returned: an ``_C.Export`` whose ``.data`` is
    the descriptor, and whose ``revoke()`` gives back what nobody will load."""
    _runtime.ensure_started()
    _runtime.check_not_shut_down()
    if isolated:
        tensors = isolate_tensors(tensors)
    return _C.export_tensors(tensors, parameters, payload, consumers, while_referenced)


_cuda_ready = False


def _forget_cuda_after_fork() -> None:
    global _cuda_ready
    _cuda_ready = False  # a forked child asks torch again, which refuses (Note [fork])


os.register_at_fork(after_in_child=_forget_cuda_after_fork)


def _ensure_cuda() -> None:
    global _cuda_ready
    if _cuda_ready:
        return
    if torch.cuda._is_in_bad_fork():
        torch.cuda.init()  # raises torch's own error: no CUDA after fork (Note [fork])
    if not torch.cuda.is_available():
        ok, why = _C.cuda_available()
        raise CudaUnavailableError(
            "torch_ipc: this descriptor holds CUDA tensors but torch here cannot use CUDA"
            + ("" if ok else f" ({why})")
        )
    torch.cuda.init()
    _cuda_ready = True


def loads(data: bytes, *, weights_only: bool, expect: Optional[type] = None, what: str = "the descriptor") -> Any:
    """:func:`torch_ipc.loads`. No default: every caller says whether it
    trusts the sender (full pickle) or not (Note [weights_only] in _weights_only.py).
    ``expect``: the type the object must have, checked before the load
    spends anything at the producer (else a DescriptorError naming ``what``)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"torch_ipc.loads() takes the bytes that dumps() returned, not {type(data).__name__}"
                        + ("; keep descriptors as bytes (files opened 'rb'/'wb')" if isinstance(data, str) else ""))
    data = bytes(data)
    if not data:
        raise DescriptorError("torch_ipc.loads() got empty bytes, not a descriptor: whatever carried it "
                              "delivered nothing (an empty file, message or read)")
    _runtime.ensure_started()
    # One crossing: a malformed descriptor is a DescriptorError before CUDA is
    # asked for, and _ensure_cuda runs only for one that holds CUDA tensors. A
    # load that fails from here on spends nothing at the producers (Note [a
    # load spends last] in core/import.cpp): the tensors die with their holds,
    # and the token stays for a retry. Only a complete load commits.
    tensors, is_parameter, payload, pending = _C.load(data, None if _cuda_ready else _ensure_cuda)
    obj = _rebuild(tensors, is_parameter, payload, weights_only=weights_only)
    if expect is not None and not isinstance(obj, expect):
        raise DescriptorError(f"torch_ipc: {what} holds a {expect.__name__}, this one a {type(obj).__name__}")
    pending.commit()
    return obj


# Note [single-tensor descriptors]
# Descriptors that torch_ipc keeps where other processes can write (a KV
# pool's chunk records, Note [chunk records are data] in kv/_chunks.py) hold
# one tensor and nothing else: a payload of tag _SINGLE, no pickle. They are
# loaded by load_single_tensor, which refuses any other payload before reading
# it, so nothing read from shared memory is ever unpickled.


def export_single_tensor(tensor: torch.Tensor, *, consumers: int) -> "_C.Export":
    """Export one tensor as a descriptor that :func:`load_single_tensor` takes."""
    return export_parts([tensor], [False], _SINGLE, consumers=consumers)


def load_single_tensor(data: bytes) -> torch.Tensor:
    """The tensor of a descriptor from :func:`export_single_tensor`; a
    :class:`DescriptorError` for any other descriptor, whose payload is never
    unpickled (Note [single-tensor descriptors])."""
    _runtime.ensure_started()
    tensors, is_parameter, payload, pending = _C.load(bytes(data), None if _cuda_ready else _ensure_cuda)
    if payload != _SINGLE or len(tensors) != 1 or is_parameter is not None:
        raise DescriptorError("torch_ipc: expected a descriptor of one tensor and nothing else")
    pending.commit()
    return tensors[0]


def _rebuild(tensors, is_parameter, payload: bytes, *, weights_only: bool) -> Any:
    """The object of a payload, on the tensors of its load (``is_parameter``:
    None when no tensor is an nn.Parameter, Note [a load's Python objects] in
    csrc/python/core.cpp)."""
    if is_parameter is not None:
        for i, is_param in enumerate(is_parameter):
            if is_param:
                tensors[i] = torch.nn.Parameter(tensors[i], requires_grad=tensors[i].requires_grad)
    tag = payload[:1]
    try:
        if tag == _SINGLE:
            if len(tensors) == 1:
                return tensors[0]
        elif tag == _LIST:
            return tensors
        elif tag == _TUPLE:
            return tuple(tensors)
        elif tag == _DICT:
            pickled = memoryview(payload)[1:]
            keys = _load_weights_only(pickled, []) if weights_only else pickle.loads(pickled)
            if type(keys) is list and len(keys) == len(tensors):
                return dict(zip(keys, tensors))
        elif tag == _PICKLED:
            pickled = memoryview(payload)[1:]
            if weights_only:
                return _load_weights_only(pickled, tensors)
            if not tensors:  # nothing to resolve: the C unpickler alone
                return pickle.loads(pickled)
            return _Unpickler(io.BytesIO(pickled), tensors, False).load()
    except (WeightsOnlyError, DescriptorError):
        raise
    except Exception as e:
        raise DescriptorError(f"torch_ipc descriptor payload does not unpickle: {e!r}") from e
    raise DescriptorError("malformed torch_ipc descriptor: the payload does not match its tensors")
