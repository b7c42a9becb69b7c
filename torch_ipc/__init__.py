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
from ._reductions import init_reductions, reductions, restore_reductions
from ._serialize import dumps, loads
from .connection import Client, Connection, Listener, connect, listen
from .errors import (
    CudaError,
    CudaUnavailableError,
    DescriptorError,
    DeviceNotFoundError,
    HolderLimitError,
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
    "SharedPool",
    "IpcEvent",
    "DescriptorError",
    "CudaError",
    "CudaUnavailableError",
    "ProducerGoneError",
    "ReleasedError",
    "DeviceNotFoundError",
    "HolderLimitError",
]


def stats() -> dict:
    """Counters of this process, for finding leaks.

    exports / exported_bytes: live exports of this process and their bytes;
    tokens_pending: loads still expected; holders / dead_holders: processes
    holding our exports (dead ones until the next collect); held_bytes /
    held_cuda_ipc_bytes: bytes of our exports that living consumers hold, and
    how many of them are legacy CUDA IPC memory (lost to them when we exit);
    oldest_exports: the 16 oldest live exports, oldest first, each a dict of
    age_s, bytes, tokens_pending, holders and dead_holders (an old one is
    pinned by a load that never came, or by a holder that keeps it);
    imports: holds this process has on other processes' exports;
    pending_releases: releases waiting for GPU work; mappings_open /
    mappings_idle / events_open: opened handles; lease_segments, host_segments;
    vmm_*: shareable (cuMemCreate) memory exported, pooled and mapped;
    fd_*: file descriptors served and fetched, and through which transport
    (fd_via_socket: SCM_RIGHTS, fd_via_pidfd: pidfd_getfd).
    """
    return dict(_C.stats())


def collect(close_idle: bool = False) -> int:
    """Reclaim exports that every consumer released (or died holding), finish
    deferred releases, and close idle mappings (all of them if ``close_idle``).
    Returns how many exports were reclaimed. A background thread does this
    every 50 ms; call it to make it happen now."""
    return _C.collect(close_idle)
