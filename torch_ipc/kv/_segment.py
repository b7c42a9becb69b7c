"""A pool's segment as a process sees it: attaching (from bytes, a connection,
a queue or a pool), pickling as the segment's name, and the chunks of memory
the segment records, mapped here as they appear.

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

from typing import Any, List, Optional, Sequence

import torch

from .. import _serialize
from ..errors import DescriptorError, ProducerGoneError, ReleasedError
from ..pool import SharedPool
from ._errors import LayoutMismatchError, PoolCorruptedError

_UNLIMITED_LOADS = 2**32 - 1  # chunk exports: any number of peers may attach over time


class _Segment:
    """The part of :class:`SharedKVPool` that attaches and maps chunks."""

    @classmethod
    def attach(
        cls,
        source: Any,
        block_shape: Optional[Sequence[int]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> Any:
        """Attach to a pool and map its memory.

        ``source``: bytes from ``torch_ipc.dumps(pool)``, a connection or
        queue to receive the pool from (``recv()`` or ``get()``), or a pool
        already loaded. ``block_shape`` / ``dtype``: the layout this process
        expects; a pool of another layout raises :class:`LayoutMismatchError`
        (and is detached again).
        """
        pool = _receive_pool(source, cls)
        wrong = []
        if block_shape is not None and tuple(int(s) for s in block_shape) != pool.block_shape:
            wrong.append(f"block shape {pool.block_shape}, not {tuple(block_shape)}")
        if dtype is not None and dtype != pool.dtype:
            wrong.append(f"dtype {pool.dtype}, not {dtype}")
        if wrong:
            if not pool._owner:
                pool.close()
            raise LayoutMismatchError(f"torch_ipc: the KV pool {pool._name} has " + " and ".join(wrong))
        try:
            pool.refresh()
        except BaseException:
            if not pool._owner:
                pool.close()
            raise
        return pool

    def refresh(self) -> int:
        """Map the chunks added since this process last looked (Note [growing a
        pool]); returns the blocks now mapped here."""
        self._check_open()
        with self._lock:
            for first, count, descriptor in self._allocator.chunks(len(self._chunks)):
                self._add_chunk(first, self._load_chunk(len(self._chunks), count, descriptor))
            return self._mapped

    def _load_chunk(self, index: int, count: int, descriptor: bytes) -> torch.Tensor:
        """Note [chunk records are data]."""
        try:
            tensor = _serialize.load_single_tensor(descriptor)
        except DescriptorError as e:
            raise PoolCorruptedError(f"torch_ipc: KV pool {self._name} is corrupted: chunk {index}: {e}") from None
        if tuple(tensor.shape) != (count, *self.block_shape) or tensor.dtype != self.dtype:
            raise PoolCorruptedError(
                f"torch_ipc: KV pool {self._name} is corrupted: chunk {index} is a {tensor.dtype} tensor of "
                f"shape {tuple(tensor.shape)}, not {count} blocks of {self.block_shape} {self.dtype}"
            )
        if not tensor.is_contiguous():  # gather/scatter address blocks from the chunk's start (Note [kv copies])
            raise PoolCorruptedError(
                f"torch_ipc: KV pool {self._name} is corrupted: chunk {index} is not contiguous "
                f"(strides {tensor.stride()})"
            )
        return tensor

    def _add_chunk(self, first: int, tensor: torch.Tensor) -> None:
        if first != self._mapped:
            raise PoolCorruptedError(
                f"torch_ipc: KV pool {self._name} is corrupted: a chunk at block {first}, expected {self._mapped}"
            )
        self._chunks.append(tensor)
        self._starts.append(first)
        self._mapped = first + tensor.shape[0]
        if self._device is None:
            self._device = tensor.device

    def grow(self, n: int) -> List[int]:
        """Owner: add a chunk of ``n`` blocks (up to ``max_blocks``); returns
        its ids. See Note [growing a pool] for what other processes see."""
        self._check_open()
        if not self._owner:
            raise RuntimeError("torch_ipc: only the process that created a KV pool can grow it")
        n = int(n)
        with self._lock:
            if n < 1 or n > self.max_blocks - self._mapped:
                raise ValueError(
                    f"torch_ipc: the KV pool has {self._mapped} of at most {self.max_blocks} blocks; "
                    f"it cannot grow by {n} (max_blocks is set at creation)"
                )
            shape = (n, *self.block_shape)
            if self._vmm:
                tensor = SharedPool(self._device).empty(shape, self.dtype)
            else:
                tensor = torch.empty(shape, dtype=self.dtype, device=self._device)
            exported = _serialize.export_single_tensor(tensor, consumers=_UNLIMITED_LOADS)
            try:
                self._allocator.add_chunk(n, exported.data)
            except BaseException:
                exported.revoke()
                raise
            self._exports.append(exported)
            first = self._mapped
            self._add_chunk(first, tensor)
            return list(range(first, first + n))


def _receive_pool(source: Any, cls: type) -> Any:
    """The pool `source` is, holds or delivers (what attach() accepts)."""
    if isinstance(source, cls):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        try:
            pool = _serialize.loads(bytes(source), weights_only=True)  # bytes from anywhere: the allow-list
        except DescriptorError as e:  # loads wraps what unpickling raised: say what it was
            if isinstance(e.__cause__, (ReleasedError, ProducerGoneError, PoolCorruptedError, TimeoutError)):
                raise e.__cause__ from None
            raise
    elif hasattr(source, "recv"):
        pool = source.recv()
    elif hasattr(source, "get"):
        pool = source.get()
    else:
        pool = source
    if not isinstance(pool, cls):
        raise TypeError(f"expected a torch_ipc.kv.SharedKVPool, got {type(pool).__name__}")
    return pool
