"""A pool's chunks of memory as a process sees them: mapped here as the
segment records them, added by the owner's grow(), and where a block id lies.

Note [growing a pool]
``grow(n)`` (the owner) appends a chunk of n blocks, ids [num_blocks,
num_blocks + n). Block ids never move and existing chunks stay mapped. Other
processes see the new ids in ``num_blocks``, may be handed them by
``allocate`` at once, and map the new chunk the first time they touch one of
its blocks (``block``, ``gather``, ``scatter``, ``recv``) or call ``refresh``.
``tensor`` covers one chunk only: after growth use ``chunks`` or the per-block
methods. A pool's size is bounded by ``max_blocks`` given at creation.

Note [chunk records are data]
Every attached process can write into the segment, so a chunk record is
never unpickled: it is a descriptor of one tensor and nothing else
(``_serialize.export_single_tensor``), loaded by
``_serialize.load_single_tensor``, which refuses any other descriptor before
reading its payload. A record that does not fit the pool (another shape, not
contiguous, not the next block ids) is a :class:`PoolCorruptedError`.
"""
from __future__ import annotations

import bisect
from array import array
from typing import List, Tuple

import torch

from .. import _C, _serialize
from ..errors import DescriptorError
from ..pool import SharedPool
from ._errors import PoolCorruptedError
from ._state import PoolState

_UNLIMITED_LOADS = 2**32 - 1  # chunk exports: any number of peers may attach over time


class Chunks:
    """The chunks of one pool in this process (state.chunks, starts, mapped,
    exports, device). The caller has checked that the pool is open."""

    def __init__(self, state: PoolState) -> None:
        self._state = state

    def refresh(self) -> int:
        """Map the chunks added since this process last looked; returns the blocks now mapped here."""
        s = self._state
        with s.lock:
            for first, count, descriptor in s.allocator.chunks(len(s.chunks)):
                self._add(first, self._load(len(s.chunks), count, descriptor))
            return s.mapped

    def _load(self, index: int, count: int, descriptor: bytes) -> torch.Tensor:
        """Note [chunk records are data]."""
        s = self._state
        try:
            tensor = _serialize.load_single_tensor(descriptor)
        except DescriptorError as e:
            raise PoolCorruptedError(f"torch_ipc: KV pool {s.name} is corrupted: chunk {index}: {e}") from None
        if tuple(tensor.shape) != (count, *s.block_shape) or tensor.dtype != s.dtype:
            raise PoolCorruptedError(
                f"torch_ipc: KV pool {s.name} is corrupted: chunk {index} is a {tensor.dtype} tensor of "
                f"shape {tuple(tensor.shape)}, not {count} blocks of {s.block_shape} {s.dtype}"
            )
        if not tensor.is_contiguous():  # gather/scatter address blocks from the chunk's start (Note [kv copies])
            raise PoolCorruptedError(
                f"torch_ipc: KV pool {s.name} is corrupted: chunk {index} is not contiguous "
                f"(strides {tensor.stride()})"
            )
        return tensor

    def _add(self, first: int, tensor: torch.Tensor) -> None:
        s = self._state
        if first != s.mapped:
            raise PoolCorruptedError(
                f"torch_ipc: KV pool {s.name} is corrupted: a chunk at block {first}, expected {s.mapped}"
            )
        s.chunks.append(tensor)
        s.starts.append(first)
        s.mapped = first + tensor.shape[0]
        if s.device is None:
            s.device = tensor.device

    def grow(self, n: int) -> List[int]:
        """The owner's growth by a chunk of `n` blocks (Note [growing a pool]); returns its ids."""
        s = self._state
        if not s.owner:
            raise RuntimeError("torch_ipc: only the process that created a KV pool can grow it")
        n = int(n)
        with s.lock:
            max_blocks = s.allocator.max_blocks
            if n < 1 or n > max_blocks - s.mapped:
                raise ValueError(
                    f"torch_ipc: the KV pool has {s.mapped} of at most {max_blocks} blocks; "
                    f"it cannot grow by {n} (max_blocks is set at creation)"
                )
            shape = (n, *s.block_shape)
            if s.vmm:
                tensor = SharedPool(s.device).empty(shape, s.dtype)
            else:
                tensor = torch.empty(shape, dtype=s.dtype, device=s.device)
            exported = _serialize.export_single_tensor(tensor, consumers=_UNLIMITED_LOADS)
            try:
                s.allocator.add_chunk(n, exported.data)
            except BaseException:
                exported.revoke()
                raise
            s.exports.append(exported)
            first = s.mapped
            self._add(first, tensor)
            return list(range(first, first + n))

    def device(self) -> torch.device:
        """Where the blocks live (an attached pool learns it from its first chunk)."""
        if self._state.device is None:
            self.refresh()
        return self._state.device

    def whole(self) -> torch.Tensor:
        """The pool as one tensor, when it is one chunk."""
        s = self._state
        if len(s.chunks) != 1 or s.allocator.num_blocks != s.mapped:
            self.refresh()
        if len(s.chunks) != 1:
            raise RuntimeError(
                f"torch_ipc: KV pool {s.name} has {len(s.chunks)} chunks; use block(), gather(), "
                "scatter() or chunks"
            )
        return s.chunks[0]

    def block(self, block_id: int) -> torch.Tensor:
        chunk, local = self.locate(int(block_id))
        return self._state.chunks[chunk][local]

    def locate(self, block_id: int) -> Tuple[int, int]:
        """(chunk, id within it) of `block_id`, mapping chunks added since; else IndexError."""
        s = self._state
        if block_id >= s.mapped:
            self.refresh()
        if not 0 <= block_id < s.mapped:
            raise IndexError(f"torch_ipc: block id {block_id} is out of range: the KV pool has {s.mapped} blocks")
        if len(s.starts) == 1:
            return 0, block_id
        chunk = bisect.bisect_right(s.starts, block_id) - 1
        return chunk, block_id - s.starts[chunk]

    def check_ids(self, packed: array) -> None:
        """Every id of `packed` (not empty) names a block, mapping chunks added since; else IndexError."""
        self.check_range(*_C.block_id_range(packed))  # min() and max() took 21 us for 256 ids on the H100 host

    def check_range(self, low: int, high: int) -> None:
        """Ids from `low` to `high` name blocks, mapping chunks added since; else IndexError."""
        s = self._state
        if high >= s.mapped:
            self.refresh()
        if low < 0 or high >= s.mapped:
            bad = low if low < 0 else high
            raise IndexError(f"torch_ipc: block id {bad} is out of range: the KV pool has {s.mapped} blocks")
