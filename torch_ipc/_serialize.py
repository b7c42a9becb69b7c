"""dumps/loads: a Python object holding tensors <-> one torch_ipc descriptor.

The object is pickled with every tensor (and UntypedStorage) replaced by its
index in a list; the list goes to the C++ exporter and the pickle rides along
as the descriptor's payload. So any picklable object works: a tensor, a
state_dict, nested dicts/lists/tuples, dataclasses holding tensors.
"""

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, List

import torch

from . import _C, _runtime
from .errors import CudaUnavailableError, DescriptorError

__all__ = ["dumps", "loads"]

_TENSOR = 0
_STORAGE = 1
_HAS_CUDA = 1  # header flag bit (byte 6) of a descriptor


class _Pickler(ForkingPickler):
    # A ForkingPickler, so that what else the message holds (connections, file
    # descriptors) pickles as multiprocessing would pickle it.
    def __init__(self, file, tensors: List[torch.Tensor], parameters: List[bool]):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors
        self._parameters = parameters

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            kind = _TENSOR
            tensor = obj
        elif isinstance(obj, torch.UntypedStorage):
            kind = _STORAGE
            tensor = torch.empty(0, dtype=torch.uint8, device=obj.device).set_(obj)
        else:
            return None
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"torch_ipc shares torch.Tensor and nn.Parameter, not {type(tensor).__name__}")
        self._tensors.append(tensor)
        self._parameters.append(type(tensor) is torch.nn.Parameter)
        return (kind, len(self._tensors) - 1)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors: List[torch.Tensor]):
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid):
        try:
            kind, index = pid
            tensor = self._tensors[index]
        except (TypeError, ValueError, IndexError):
            raise pickle.UnpicklingError(f"torch_ipc: bad tensor reference {pid!r}") from None
        return tensor.untyped_storage() if kind == _STORAGE else tensor


# Note [payload fast paths]
# Pickling with persistent_id calls back into Python for every object, ~0.8 us
# per state_dict entry. The shapes people send most (a tensor, a dict of
# tensors such as a state_dict, a list or tuple of tensors) skip that: the
# payload is then a tag byte and, for a dict, the pickled list of its keys.
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
    if kind is torch.Tensor:
        return [obj], [False], _SINGLE
    if kind is dict or kind is list or kind is tuple:
        values = list(obj.values()) if kind is dict else list(obj)
        types = set(map(type, values))
        if values and types <= _PLAIN_SET:
            if torch.nn.Parameter in types:
                parameters = [type(v) is torch.nn.Parameter for v in values]
            else:
                parameters = [False] * len(values)
            if kind is dict:
                keys = list(obj)
                if set(map(type, keys)) == _STR_SET:
                    return values, parameters, _DICT + pickle.dumps(keys, pickle.HIGHEST_PROTOCOL)
            else:
                return values, parameters, _LIST if kind is list else _TUPLE
    return None, None, None


def dumps(obj: Any, *, consumers: int = 1, isolated: bool = False) -> bytes:
    """Export ``obj`` and every tensor in it; return a descriptor (bytes).

    CUDA tensors are shared zero-copy through CUDA IPC; CPU tensors are moved
    (once, in place, as ``share_memory_()`` does) into shared memory. The
    producer keeps every exported storage alive until ``consumers`` loads have
    happened and every process that loaded it has released it (or died).

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
    if consumers < 1:
        raise ValueError("consumers must be at least 1")
    return export(*split(obj), consumers=consumers, isolated=isolated).data


def split(obj: Any):
    """(tensors, is_parameter, payload): the tensors in ``obj`` and the rest."""
    tensors, parameters, payload = _flat(obj)
    if payload is None:
        tensors, parameters = [], []
        buf = io.BytesIO()
        buf.write(_PICKLED)
        _Pickler(buf, tensors, parameters).dump(obj)
        payload = buf.getvalue()
    return tensors, parameters, payload


def plain_pickle(payload: bytes):
    """The pickle inside a payload from :func:`split` that found no tensor."""
    return memoryview(payload)[1:]


def export(tensors, parameters, payload: bytes, *, consumers: int = 1, isolated: bool = False) -> "_C.Export":
    """Export what :func:`split` returned: an ``_C.Export`` whose ``.data`` is
    the descriptor, and whose ``revoke()`` gives back what nobody will load."""
    _runtime.ensure_started()
    if isolated:
        from .pool import isolate_tensors

        tensors = isolate_tensors(tensors)
    return _C.export_tensors(tensors, parameters, payload, consumers)


_cuda_ready = False


def _ensure_cuda() -> None:
    global _cuda_ready
    if _cuda_ready:
        return
    if not torch.cuda.is_available():
        ok, why = _C.cuda_available()
        raise CudaUnavailableError(
            "torch_ipc: this descriptor holds CUDA tensors but torch here cannot use CUDA"
            + ("" if ok else f" ({why})")
        )
    torch.cuda.init()
    _cuda_ready = True


def loads(data: bytes) -> Any:
    """Rebuild what :func:`dumps` exported, on the same memory.

    Raises :class:`DescriptorError` for bytes that are not a valid descriptor of
    this machine's current boot, :class:`ProducerGoneError` when the producer
    has exited, :class:`ReleasedError` when the export was already reclaimed and
    :class:`DeviceNotFoundError` when the GPU is not visible here.

    The payload is unpickled: load descriptors only from peers you trust, as
    with :func:`pickle.loads`.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"torch_ipc.loads() takes the bytes that dumps() returned, not {type(data).__name__}"
                        + ("; keep descriptors as bytes (files opened 'rb'/'wb')" if isinstance(data, str) else ""))
    data = bytes(data)
    _runtime.ensure_started()
    if not _cuda_ready and len(data) > 6 and data[6] & _HAS_CUDA:
        _C.describe(data)  # a malformed descriptor is a DescriptorError, not a CUDA problem
        _ensure_cuda()
    tensors, is_parameter, payload = _C.import_tensors(data)
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
            keys = pickle.loads(payload[1:])
            if type(keys) is list and len(keys) == len(tensors):
                return dict(zip(keys, tensors))
        elif tag == _PICKLED:
            return _Unpickler(io.BytesIO(payload[1:]), tensors).load()
    except Exception as e:
        raise DescriptorError(f"torch_ipc descriptor payload does not unpickle: {e!r}") from e
    raise DescriptorError("malformed torch_ipc descriptor: the payload does not match its tensors")
