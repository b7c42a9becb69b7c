"""SharedKVPool: the class, its construction and the state its parts share."""
from __future__ import annotations

import os
import threading
from array import array
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import _C, _runtime
from .._cuda import cuda_device_index
from ..ipc_event import IpcEvent
from . import _registry
from ._handover import _HandOver
from ._lifetime import _Lifetime
from ._memory import _Memory
from ._ownership import _Ownership
from ._segment import _Segment


class SharedKVPool(_Segment, _Memory, _Ownership, _HandOver, _Lifetime):
    """A paged KV cache pool that several processes map, with block ownership.

    The owner creates it; other processes attach by loading its pickle (send
    the pool over a :class:`torch_ipc.Connection`, a ``multiprocessing`` queue
    or pipe, or carry ``torch_ipc.dumps(pool)``), best through
    :meth:`attach`, which checks the layout they expect. Every attached
    process sees the same memory: ``pool.tensor[i]`` (or ``pool.block(i)``) is
    block ``i``.

    Blocks are allocated and freed from any attached process; the allocator
    lives in shared memory, so no block is handed out twice, and the blocks of
    a process that exits (even by SIGKILL) or closes the pool go back to the
    pool. :meth:`send` / :meth:`recv` hand blocks from a writer to a reader
    with the writer's stream order (Note [hand-over] in _handover.py).

    Args:
        num_blocks: blocks to create now (ids 0 .. num_blocks - 1).
        block_shape: the shape of one block, e.g. ``(2, layers, block_size, heads, head_dim)``.
        dtype: the blocks' dtype.
        device: ``"cpu"`` (POSIX shared memory) or a CUDA device.
        blocks_per_chunk: blocks per allocation (default: all in one).
        max_blocks: the most blocks :meth:`grow` may reach (default: num_blocks).
        vmm: CUDA only: chunks from :class:`torch_ipc.SharedPool` (default; the
            memory outlives the owner) or from torch's caching allocator
            (legacy CUDA IPC; the memory dies with the owner).

    At most 14 processes besides the owner can map a pool at once (each
    chunk is one export, Note [holder limit] in csrc/os/refcount.h).

    The methods come from the modules of this package, one part each:
    attaching and chunks (``_segment``), blocks' memory (``_memory``),
    ownership (``_ownership``), hand-over (``_handover``), closing
    (``_lifetime``); this module keeps the state they share (``_setup``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        device: Union[str, int, torch.device] = "cpu",
        *,
        blocks_per_chunk: Optional[int] = None,
        max_blocks: Optional[int] = None,
        vmm: bool = True,
    ) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, not {dtype!r}")
        num_blocks = int(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, not {num_blocks}")
        max_blocks = num_blocks if max_blocks is None else int(max_blocks)
        if max_blocks < num_blocks:
            raise ValueError(f"max_blocks ({max_blocks}) is below num_blocks ({num_blocks})")
        self._device = torch.device(device)
        if self._device.type == "cuda":
            self._device = torch.device("cuda", cuda_device_index(self._device, "a CUDA KV pool"))
        elif self._device.type != "cpu":
            raise ValueError(f"a KV pool lives on cpu or cuda, not {self._device}")
        chunk = num_blocks if blocks_per_chunk is None else int(blocks_per_chunk)
        if chunk < 1 or -(-num_blocks // chunk) > _C.BlockAllocator.max_chunks:
            raise ValueError(
                f"blocks_per_chunk must make 1 to {_C.BlockAllocator.max_chunks} chunks of the "
                f"{num_blocks} blocks, not {chunk}"
            )
        self._vmm = vmm and self._device.type == "cuda"
        _runtime.ensure_started()
        allocator = _C.BlockAllocator.create([int(s) for s in block_shape], dtype, max_blocks)
        self._setup(allocator, owner=True)
        try:
            for first in range(0, num_blocks, chunk):
                self.grow(min(chunk, num_blocks - first))
        except BaseException:
            self.close()
            raise

    def _setup(self, allocator: "_C.BlockAllocator", owner: bool) -> None:
        self._allocator = allocator
        self._name = allocator.name
        shape, dtype, block_bytes = allocator.layout
        self.block_shape: Tuple[int, ...] = tuple(shape)
        self.dtype: torch.dtype = dtype
        self.block_bytes: int = block_bytes
        self._owner = owner
        self._creator = _C.self_process() if owner else None
        self._chunks: List[torch.Tensor] = []
        self._starts: List[int] = []  # first block id of each chunk
        self._mapped = 0  # blocks of the chunks mapped here
        self._exports: List[Any] = []  # owner: the chunks' exports
        self._events: Dict[Any, List[IpcEvent]] = {}
        self._next_event = 0
        self._pending_frees: List[Tuple[Any, array]] = []  # Note [deferred free]
        self._pending_ids: set = set()
        self._lock = threading.RLock()
        self._closed = False
        self._pid = os.getpid()
        self._sender = (allocator.slot, *_C.self_process())  # what a hand-over names
        _registry.register(self)

    def __repr__(self) -> str:
        if self._closed:
            return "SharedKVPool(closed)"
        return (
            f"SharedKVPool({self.num_blocks} blocks of {self.block_shape} {self.dtype} on {self._device}, "
            f"{self.free_blocks} free, {'owner' if self._owner else 'attached'})"
        )

    def __reduce__(self):
        # Beside _load_pool, the reducer pickles name (torch_ipc.kv._load_pool).
        self._check_open()
        creator = self._creator
        if creator is None:
            creator = (0, 0)
        return (_load_pool, (self._name, creator[0], creator[1]))


def _load_pool(name: str, pid: int, start_time: int) -> SharedKVPool:
    """Unpickling a pool: this process's open pool of that name, or a new attachment (chunks mapped lazily)."""
    pool = _registry.find(name)
    if pool is not None and not pool.closed:
        pool._check_open()  # a forked child's own attachment
        return pool
    _runtime.ensure_started()
    pool = SharedKVPool.__new__(SharedKVPool)
    pool._device = None  # learnt from the first chunk
    pool._vmm = False
    allocator = _C.BlockAllocator.attach(name, pid, start_time)
    pool._setup(allocator, owner=False)
    pool._creator = (pid, start_time)
    return pool


_load_pool.__module__ = "torch_ipc.kv"  # pickles name it torch_ipc.kv._load_pool, where it is exported
