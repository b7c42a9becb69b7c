"""torch_ipc: share PyTorch tensors between processes on one machine, zero-copy.

    >>> import torch, torch_ipc
    >>> data = torch_ipc.dumps({"w": torch.randn(4, 4, device="cuda")})  # doctest: +SKIP
    >>> state = torch_ipc.loads(data)   # in another process: same GPU memory  # doctest: +SKIP

Note [lazy package]
The package is also a pytest plugin (torch_ipc.testing), which pytest imports
in every run of every project where torch_ipc is installed. So importing the
package imports neither torch nor the extension: each public name is resolved
on first use (PEP 562).
"""

from importlib import import_module
from typing import Any

from .errors import (
    CudaError,
    CudaUnavailableError,
    DescriptorError,
    DeviceNotFoundError,
    ProducerGoneError,
    ReleasedError,
)

__version__ = "0.1.0"

_LAZY = {
    "dumps": "._serialize",
    "loads": "._serialize",
    "Connection": ".connection",
    "Listener": ".connection",
    "connect": ".connection",
    "listen": ".connection",
    "SharedPool": ".pool",
    "init_reductions": "._reductions",
    "restore_reductions": "._reductions",
    "reductions": "._reductions",
}

__all__ = [
    "dumps",
    "loads",
    "stats",
    "collect",
    "init_reductions",
    "restore_reductions",
    "reductions",
    "Listener",
    "Connection",
    "listen",
    "connect",
    "SharedPool",
    "DescriptorError",
    "CudaError",
    "CudaUnavailableError",
    "ProducerGoneError",
    "ReleasedError",
    "DeviceNotFoundError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
    elif name == "_C":
        import torch  # noqa: F401  (loads libc10/libtorch before the extension)

        value = import_module("._C", __name__)
    else:
        raise AttributeError(f"module 'torch_ipc' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def stats() -> dict:
    """Counters of this process, for finding leaks.

    exports / exported_bytes: live exports of this process and their bytes;
    tokens_pending: loads still expected; holders / dead_holders: processes
    holding our exports (dead ones until the next collect);
    imports: holds this process has on other processes' exports;
    pending_releases: releases waiting for GPU work; mappings_open /
    mappings_idle / events_open: opened handles; lease_segments, host_segments;
    vmm_*: shareable (cuMemCreate) memory exported, pooled and mapped;
    fd_*: file descriptors served and fetched, and through which transport
    (fd_via_socket: SCM_RIGHTS, fd_via_pidfd: pidfd_getfd).
    """
    from . import _C

    return dict(_C.stats())


def collect(close_idle: bool = False) -> int:
    """Reclaim exports that every consumer released (or died holding), finish
    deferred releases, and close idle mappings (all of them if ``close_idle``).
    Returns how many exports were reclaimed. A background thread does this
    every 50 ms; call it to make it happen now."""
    from . import _C

    return _C.collect(close_idle)
