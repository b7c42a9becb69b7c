"""SharedPool: CUDA memory that other processes can map, one allocation per tensor.

Owns torch_ipc.SharedPool and the copy behind ``torch_ipc.dumps(..., isolated=True)``.

Note [isolated sharing]
CUDA IPC shares whole allocations, and torch's caching allocator packs many
tensors into one (a 2 MiB or 20 MiB block, or a chunk of an expandable
segment): a consumer handed one tensor can read its neighbours' bytes too (the
CUDA programming guide warns about this information disclosure). A tensor
from a SharedPool is alone in its own ``cuMemCreate`` allocation, a whole
number of granules (2 MiB on current GPUs), whose bytes past the tensor are
zeroed; the consumer maps exactly that allocation. The allocation is created
with a POSIX file descriptor handle, passed to consumers over a Unix socket
(SCM_RIGHTS) or pulled with ``pidfd_getfd``, so the memory also outlives the
producer: it is freed when the last process that maps it lets go.

Note [fabric handles]
``handle_type="fabric"`` creates allocations with ``CU_MEM_HANDLE_TYPE_FABRIC``
handles: 64-byte values that need no file descriptor and work across the nodes
of a multi-node NVLink system. The driver grants them only to processes that
can open an IMEX channel (``/dev/nvidia-caps-imex-channels/channelN``, created
by the IMEX daemon of such a system); elsewhere ``cuMemCreate`` refuses them.
The export, transport and import code is shared with POSIX handles (the
handles travel as data over the same socket), but it is not tested: the test
machines have no IMEX channel.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Union

import torch

from . import _C
from ._cuda import DeviceLike, cuda_device_index

__all__ = ["SharedPool", "is_pool_tensor", "isolate_tensors"]

_HANDLE_TYPES = {"posix_fd": 1, "fabric": 8}  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, _FABRIC

class SharedPool:
    """A source of CUDA tensors that are shared *isolated*.

    Every tensor from :meth:`empty` is alone in its own ``cuMemCreate``
    allocation (rounded up to the granularity, 2 MiB on current GPUs), so a
    consumer that loads it maps that allocation and nothing else. Share them
    with :func:`torch_ipc.dumps` as any other tensor. The memory of a tensor is
    freed when the tensor dies here and every consumer has let go of it; it
    stays valid in consumers after this process exits.

    Each tensor costs a whole allocation: use the pool for what must be
    isolated, or for memory that must outlive its producer, not for many small
    tensors. Allocation and free are driver calls (tens of microseconds), and a
    free waits for the device (as ``cudaFree`` does).

    Example::

        >>> import torch, torch_ipc
        >>> pool = torch_ipc.SharedPool()                     # doctest: +SKIP
        >>> x = pool.empty((1024, 1024), torch.float16)      # doctest: +SKIP
        >>> data = torch_ipc.dumps(x)  # a consumer maps only x's 2 MiB  # doctest: +SKIP

    Args:
        device: the default CUDA device of :meth:`empty` (default: the current one).
        handle_type: ``"posix_fd"`` (default; one machine) or ``"fabric"``
            (multi-node NVLink; needs an IMEX channel, see Note [fabric handles]).
    """

    def __init__(self, device: DeviceLike = None, *, handle_type: str = "posix_fd") -> None:
        if handle_type not in _HANDLE_TYPES:
            raise ValueError(f"handle_type must be one of {sorted(_HANDLE_TYPES)}, not {handle_type!r}")
        self.handle_type = handle_type
        self._device = device
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def granularity(self, device: DeviceLike = None) -> int:
        """Bytes every allocation is a multiple of, on ``device``."""
        index = cuda_device_index(self._device if device is None else device, "torch_ipc.SharedPool")
        return _C.vmm_granularity(index, _HANDLE_TYPES[self.handle_type])

    def empty(
        self,
        shape: Union[int, Sequence[int], torch.Size],
        dtype: torch.dtype = torch.float32,
        device: DeviceLike = None,
    ) -> torch.Tensor:
        """An uninitialised contiguous tensor alone in its own shareable allocation."""
        if self._closed:
            raise RuntimeError("torch_ipc.SharedPool is closed")
        sizes = [int(shape)] if isinstance(shape, int) else [int(s) for s in shape]
        index = cuda_device_index(self._device if device is None else device, "torch_ipc.SharedPool")
        return _C.vmm_pool_empty(sizes, dtype, index, _HANDLE_TYPES[self.handle_type])

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pool tensor holding a copy of ``tensor`` (same shape, dtype, device,
        requires_grad; contiguous). The copy is queued on the current stream."""
        if not tensor.is_cuda:
            raise ValueError(f"torch_ipc.SharedPool copies CUDA tensors, not {tensor.device} ones")
        out = self.empty(tensor.shape, tensor.dtype, tensor.device)
        out.copy_(tensor.detach())
        if tensor.requires_grad:
            out.requires_grad_(True)
        return out

    def close(self) -> None:
        """Stop handing out tensors; idempotent. Tensors already made stay valid
        (each owns its allocation)."""
        self._closed = True

    def __enter__(self) -> "SharedPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"SharedPool(device={self._device!r}, handle_type={self.handle_type!r}, {state})"


def is_pool_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is a SharedPool allocation."""
    return bool(tensor.is_cuda and _C.vmm_is_pool_tensor(tensor))


_default_pool: Optional[SharedPool] = None
_default_lock = threading.Lock()


def _pool() -> SharedPool:
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = SharedPool()
        return _default_pool


def isolate_tensors(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """For ``dumps(..., isolated=True)``: each CUDA tensor that is not already
    alone in a SharedPool allocation is replaced by a pool copy (CPU tensors
    are left alone: each CPU storage is shared in a segment of its own). The
    same tensor object listed twice is copied once; two views of one storage
    become two independent copies."""
    copies: Dict[int, torch.Tensor] = {}
    out = []
    for t in tensors:
        if not t.is_cuda or is_pool_tensor(t):
            out.append(t)
            continue
        key = id(t)
        if key not in copies:
            copies[key] = _pool().copy(t)
        out.append(copies[key])
    return out
