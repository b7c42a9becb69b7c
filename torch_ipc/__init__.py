"""torch_ipc: share PyTorch tensors between processes on one machine, zero-copy.

    >>> import torch, torch_ipc
    >>> data = torch_ipc.dumps({"w": torch.randn(4, 4, device="cuda")})  # doctest: +SKIP
    >>> state = torch_ipc.loads(data)   # in another process: same GPU memory  # doctest: +SKIP
"""

import torch  # noqa: F401  (loads libc10/libtorch before the extension)

from ._torch_check import check_built_torch, extension_import_error

check_built_torch()
try:
    from . import _C
except ImportError as e:
    raise extension_import_error(e) from e
from .mp._reductions import init_reductions, reductions, restore_reductions
from ._serialize import dumps, loads
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
)
from .ipc_event import IpcEvent
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
    "Listener",
    "Client",
    "Connection",
    "listen",
    "connect",
    "Pipe",
    "SharedPool",
    "IpcEvent",
    "DescriptorError",
    "CudaError",
    "CudaUnavailableError",
    "ProducerGoneError",
    "ReleasedError",
    "DeviceNotFoundError",
    "HolderLimitError",
    "InFlightLimitError",
]


def stats() -> dict:
    """Counters of this process, for finding leaks (the entries are listed below)."""
    out = dict(_C.stats())
    out["fd_server_running"] = bool(out["fd_server_running"])
    return out


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
