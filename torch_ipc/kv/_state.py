"""PoolState: everything one process knows about one pool, in one declared
place. The pool's parts (_chunks, _copies, _ownership, _handover, _lifetime)
each get this object and read and write only its fields; SharedKVPool
(pool.py) builds it and the parts and hands the calls on."""
from __future__ import annotations

import os
import threading
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .. import _C
from ..ipc_event import IpcEvent


@dataclass(eq=False)
class PoolState:
    """One process's view of one pool. Fixed for the pool's life: the layout
    and the names; per process (a forked child replaces them, Note [fork] in
    csrc/base/fork.h): the attachment and what it holds; growing: the chunks."""

    # The layout the segment records (fixed when the pool is created).
    name: str  # the segment's name: a pickle of the pool carries it (and `creator`)
    block_shape: Tuple[int, ...]  # one block's shape
    dtype: torch.dtype  # the blocks' dtype
    block_bytes: int  # bytes of one block
    creator: Tuple[int, ...]  # (pid, start time, life key, PID namespace) of the process that created the pool

    # This process's attachment (a forked child makes its own: _lifetime.py).
    allocator: Optional[_C.BlockAllocator]  # the segment as this process sees it; None once closed
    owner: bool  # this process created the pool: it grows it, and close() unlinks it
    pid: int  # the process `allocator` belongs to
    sender: Tuple[int, int, int, int]  # (holder slot, pid, start time, life key): a hand-over's sender
    lock: threading.RLock  # orders this process's threads over the chunks and the pending frees
    closed: bool = False  # close() ran: every call but close() raises

    # The memory, mapped here as the segment records it (_chunks.py).
    device: Optional[torch.device] = None  # None on an attached pool until its first chunk is mapped
    vmm: bool = False  # the owner's CUDA chunks come from SharedPool, not from torch's caching allocator
    chunks: List[torch.Tensor] = field(default_factory=list)  # each [blocks, *block_shape], in block id order
    starts: List[int] = field(default_factory=list)  # first block id of each chunk
    mapped: int = 0  # blocks of the chunks mapped here
    exports: List[Any] = field(default_factory=list)  # owner: the chunks' exports, revoked on close
    copy_path: str = ""  # how the last gather()/scatter() copied (Note [kv copies] in _copies.py)

    # Frees waiting for the GPU (_ownership.py, Note [deferred free]).
    pending_frees: List[Tuple[torch.cuda.Event, array]] = field(default_factory=list)  # oldest first
    pending_ids: Set[int] = field(default_factory=set)  # the ids in pending_frees

    # Hand-over events (_handover.py): per stream (None: the current one), a ring reused in turn.
    events: Dict[Optional[int], List[IpcEvent]] = field(default_factory=dict)
    next_event: int = 0  # counts the events handed out, to pick the next of a ring

    @classmethod
    def of(cls, allocator: _C.BlockAllocator, *, owner: bool, creator: Tuple[int, ...],
           device: Optional[torch.device], vmm: bool) -> "PoolState":
        """The state of a pool this process has just created (`owner`) or attached to."""
        shape, dtype, block_bytes = allocator.layout
        return cls(
            name=allocator.name,
            block_shape=tuple(shape),
            dtype=dtype,
            block_bytes=block_bytes,
            creator=creator,
            allocator=allocator,
            owner=owner,
            pid=os.getpid(),
            sender=sender(allocator),
            lock=threading.RLock(),
            device=device,
            vmm=vmm,
        )


def sender(allocator: _C.BlockAllocator) -> Tuple[int, int, int, int]:
    """What a hand-over names as its sender: this process's slot and identity
    (Note [pool slots across PID namespaces] in csrc/features/kv/pool_segment.h)."""
    pid, start_time, life, _ = _C.self_identity()
    return (allocator.slot, pid, start_time, life)
