"""torch_ipc: share PyTorch tensors between processes on one machine, zero-copy.

    >>> import torch, torch_ipc
    >>> data = torch_ipc.dumps({"w": torch.randn(4, 4, device="cuda")})  # doctest: +SKIP
    >>> state = torch_ipc.loads(data)   # in another process: same GPU memory  # doctest: +SKIP
"""

from typing import Any, Union

import torch  # noqa: F401  (loads libc10/libtorch before the extension)

from ._torch_check import check_built_torch, extension_import_error

check_built_torch()
try:
    from . import _C
except ImportError as e:
    raise extension_import_error(e, __path__[0]) from None  # the traceback of the failed import says nothing more
from .mp._reductions import init_reductions, reductions, restore_reductions
from ._serialize import dumps
from . import _serialize
from .mp.handles import reduce_tensor
from ._export import Export, export
from .mp.connection import Client, Connection, Listener, connect, listen
from .mp._ring import Pipe
from .errors import (
    CudaError,
    CudaUnavailableError,
    DescriptorError,
    DeviceNotFoundError,
    HolderLimitError,
    InFlightLimitError,
    ProducerGoneError,
    ReleasedError,
    WeightsOnlyError,
)
from .ipc_event import IpcEvent
from ._dist import DistTransport, Transport
from .pool import SharedPool
from . import kv  # noqa: E402  (torch_ipc.kv.SharedKVPool)
from . import weights  # torch_ipc.weights.Publisher / Subscriber

__version__ = "0.1.0"

__all__ = [
    "dumps",
    "loads",
    "export",
    "Export",
    "stats",
    "collect",
    "init_reductions",
    "restore_reductions",
    "reductions",
    "reduce_tensor",
    "Listener",
    "Client",
    "Connection",
    "listen",
    "connect",
    "Pipe",
    "SharedPool",
    "IpcEvent",
    "Transport",
    "DistTransport",
    "DescriptorError",
    "CudaError",
    "CudaUnavailableError",
    "ProducerGoneError",
    "ReleasedError",
    "DeviceNotFoundError",
    "HolderLimitError",
    "InFlightLimitError",
    "WeightsOnlyError",
]


def loads(data: Union[bytes, bytearray, memoryview], *, weights_only: bool = True) -> Any:
    """Rebuild what :func:`dumps` exported, on the same memory.

    ``data``: the ``bytes`` (or a ``bytearray``/``memoryview`` of them) that
    :func:`dumps` returned.

    ``weights_only=True`` (the default, as ``torch.load``'s since torch 2.6):
    what the payload holds besides tensors is unpickled with the allow-list
    of ``torch.load(weights_only=True)``: containers, primitives,
    ``OrderedDict``, ``torch.dtype``/``device``/``Size``. Anything else raises
    :class:`WeightsOnlyError` (a ``pickle.UnpicklingError``) before it runs,
    and the load spends nothing. ``weights_only=False`` unpickles anything:
    only for bytes from a sender you trust, as with :func:`pickle.loads`
    (Note [weights_only] in torch_ipc/_weights_only.py).

    Raises :class:`DescriptorError` for bytes that are not a valid descriptor of
    this machine's current boot (empty ones included), :class:`ProducerGoneError`
    when the producer has exited, :class:`ReleasedError` when the export was
    already reclaimed, :class:`DeviceNotFoundError` when the GPU is not visible
    here, :class:`CudaUnavailableError` when it holds CUDA tensors and this
    process cannot use CUDA, :class:`HolderLimitError` when 14 living processes
    hold it already, and ``TypeError`` for anything but bytes.

    Example::

        >>> import torch, torch_ipc
        >>> x = torch.arange(4.0)
        >>> torch_ipc.loads(torch_ipc.dumps({"x": x}))["x"].data_ptr() == x.data_ptr()
        True
    """
    return _serialize.loads(data, weights_only=weights_only)


def stats() -> dict:
    """Counters of this process, for finding leaks (the entries are listed below)."""
    return dict(_C.stats())


def _stats_doc() -> str:
    lines = []
    for name, doc in _C.stats_fields():
        if isinstance(doc, list):
            doc = "the 16 oldest live exports, oldest first, each a dict of " + ", ".join(
                f"{n} ({d})" for n, d in doc) + "; an old one is pinned by a load that never came, or a holder"
        lines.append(f"    {name}: {doc}")
    return "\n".join(lines)


stats.__doc__ += "\n\n" + _stats_doc() + "\n"


def collect(close_idle: bool = False) -> int:
    """Reclaim exports that every consumer released (or died holding), finish
    deferred releases, and close idle mappings (all of them if ``close_idle``).
    Returns how many exports were reclaimed. A background thread does this
    every 50 ms; call it to make it happen now."""
    return _C.collect(close_idle)
