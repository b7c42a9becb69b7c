"""A pool's memory as a process sees it: the mapped chunks, one block, and
gather/scatter of many blocks on the current stream."""
from __future__ import annotations

import bisect
from array import array
from typing import Dict, List, Optional, Tuple

import torch

from ._ids import Ids, pack


class _Memory:
    """The part of :class:`SharedKVPool` that reads and writes blocks."""

    @property
    def device(self) -> torch.device:
        """Where the blocks live (an attached pool learns it from its first chunk)."""
        if self._device is None:
            self.refresh()
        return self._device

    @property
    def chunks(self) -> List[torch.Tensor]:
        """The mapped chunks, each a tensor [blocks, *block_shape], in block id order."""
        return list(self._chunks)

    @property
    def tensor(self) -> torch.Tensor:
        """The whole pool as one tensor [num_blocks, *block_shape] (a pool of one chunk)."""
        self._check_open()
        if len(self._chunks) != 1 or self._allocator.num_blocks != self._mapped:
            self.refresh()
        if len(self._chunks) != 1:
            raise RuntimeError(
                f"torch_ipc: KV pool {self._name} has {len(self._chunks)} chunks; use block(), gather(), "
                "scatter() or chunks"
            )
        return self._chunks[0]

    def block(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` of the pool (a view: writes land in the pool)."""
        self._check_open()
        block_id = int(block_id)
        chunk, local = self._locate(block_id)
        return self._chunks[chunk][local]

    def _locate(self, block_id: int) -> Tuple[int, int]:
        if block_id >= self._mapped:
            self.refresh()
        if not 0 <= block_id < self._mapped:
            raise IndexError(f"torch_ipc: block id {block_id} is out of range: the KV pool has {self._mapped} blocks")
        if len(self._starts) == 1:
            return 0, block_id
        chunk = bisect.bisect_right(self._starts, block_id) - 1
        return chunk, block_id - self._starts[chunk]

    def _index(self, packed: array) -> List[Tuple[int, torch.Tensor, Optional[List[int]]]]:
        """(chunk, ids within it on the pool's device, positions in `packed` or None for all)."""
        if len(packed) == 0:
            return []
        low, high = min(packed), max(packed)
        if high >= self._mapped:
            self.refresh()
        if low < 0 or high >= self._mapped:
            bad = low if low < 0 else high
            raise IndexError(f"torch_ipc: block id {bad} is out of range: the KV pool has {self._mapped} blocks")
        if len(self._chunks) == 1:
            return [(0, self._to_device(torch.frombuffer(packed, dtype=torch.int64)), None)]
        groups: Dict[int, Tuple[List[int], List[int]]] = {}
        for pos, block_id in enumerate(packed):
            chunk, local = self._locate(block_id)
            ids, positions = groups.setdefault(chunk, ([], []))
            ids.append(local)
            positions.append(pos)
        return [(c, self._to_device(torch.tensor(ids, dtype=torch.int64)), pos) for c, (ids, pos) in groups.items()]

    def _to_device(self, index: torch.Tensor) -> torch.Tensor:
        if self._device.type == "cpu":
            return index.clone()
        # Pinned, so the copy is queued on the stream and the host does not wait for it.
        return index.pin_memory().to(self._device, non_blocking=True)

    def _rows(self, *tensors: torch.Tensor) -> List[torch.Tensor]:
        """Each of `tensors` [n, *block_shape] as rows of the widest element that
        divides a block and suits every tensor's offset (index kernels move one
        element per thread: wider elements, fewer threads; copies are bitwise)."""
        raw = [t.reshape(t.shape[0], -1).view(torch.uint8) for t in tensors]
        for dtype, size in ((torch.complex128, 16), (torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
            if self.block_bytes % size == 0 and all(r.storage_offset() % size == 0 for r in raw):
                return [r.view(dtype) for r in raw]
        return raw

    def gather(self, ids: Ids, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The blocks ``ids`` copied into one contiguous tensor [len(ids), *block_shape]
        (into ``out`` when given), on the current stream."""
        self._check_open()
        packed = pack(ids)
        device = self.device
        if out is None:
            out = torch.empty((len(packed), *self.block_shape), dtype=self.dtype, device=device)
        elif (
            tuple(out.shape) != (len(packed), *self.block_shape)
            or out.dtype != self.dtype
            or out.device != device
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be a contiguous {self.dtype} tensor of shape {(len(packed), *self.block_shape)} "
                f"on {self._device}"
            )
        for chunk, index, positions in self._index(packed):
            source, rows = self._rows(self._chunks[chunk], out)
            if positions is None:
                torch.index_select(source, 0, index, out=rows)
            else:
                rows[positions] = source.index_select(0, index)
        return out

    def scatter(self, ids: Ids, src: torch.Tensor) -> None:
        """Write ``src`` [len(ids), *block_shape] into the blocks ``ids``, on the current stream."""
        self._check_open()
        packed = pack(ids)
        if tuple(src.shape) != (len(packed), *self.block_shape) or src.dtype != self.dtype:
            raise ValueError(f"src must be a {self.dtype} tensor of shape {(len(packed), *self.block_shape)}")
        if len(set(packed)) != len(packed):
            raise ValueError("torch_ipc: scatter() into a block listed twice")
        src = src.to(self.device).contiguous()
        for chunk, index, positions in self._index(packed):
            target, rows = self._rows(self._chunks[chunk], src)
            target.index_copy_(0, index, rows if positions is None else rows[positions])

