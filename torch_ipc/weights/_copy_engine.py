"""Pieces read from another GPU, copied by the copy engine (DMA) as 2-D copies.

Note [peer pieces on the copy engine]
An engine rank that reads a trainer rank's snapshot on another GPU (Note
[peer reads of a snapshot] in _shard_local.py) with the batched copy kernel
pulls every byte through its own SMs' loads over NVLink: 78% of the
peer-copy floor for trainer TP=1 -> engine TP=2 on two H100s, where the
floor is the copy engine's. A slice of a row-major tensor is one 2-D copy
(rows of `width` contiguous bytes, `height` of them, each side's rows
`pitch` bytes apart): a row-parallel (dim-1) slice is a 2-D copy, a
column-parallel (dim-0) slice one contiguous range. So each such pair is one
cuMemcpy2DAsync (a contiguous one a cuMemcpyAsync; csrc/cuda/copy_engine.cpp),
per pair, not per row: cuMemcpyBatchAsync takes 1-D ranges only, and a batch
of rows ran at a third of a device copy for the KV path (Note [kv copy
default]). Chosen per pair: same dtype (the copy engine does not convert),
rows of at least ENGINE_MIN_ROW_BYTES (DMA of short rows is slow), and a
layout that is one 2-D copy; any other pair stays with the kernel. The
copies go on a side stream that waits for the current one and that the
current one waits for after them, so they overlap the kernel launch that
copies the same-GPU pairs.

Measured (benchmarks/sharded_bench.py, 2 x H100 NVLink, 2026-11-26 11:05
UTC, bf16 1.47 GiB): the kernel wins both ways, tp2->tp1 110.5% of the
floor against 82.2% on the copy engine, tp1->tp2 78.7% against 68.9%. So
the kernel is the default and ``TORCH_IPC_PEER_COPY=engine`` opts into the
copy engine (for GPUs whose SMs are busier than their copy engines; the
benchmark compares both).
"""

import os
from typing import List, Optional, Sequence, Tuple

import torch

from .. import _C

__all__ = ["ENGINE_MIN_ROW_BYTES", "copy_2d", "engine_wanted", "EngineCopies"]

ENGINE_MIN_ROW_BYTES = 1024
MAX_PITCH = (1 << 31) - 1  # cuMemcpy2D's pitch limit (CU_DEVICE_ATTRIBUTE_MAX_PITCH on current GPUs)

Copy2D = Tuple[int, int, int, int, int, int]  # src, dst, width bytes, height, src pitch, dst pitch


def engine_wanted() -> bool:
    """TORCH_IPC_PEER_COPY: ``kernel`` (the default) or ``engine``; any other value is refused."""
    mode = os.environ.get("TORCH_IPC_PEER_COPY", "") or "kernel"
    if mode not in ("engine", "kernel"):
        raise ValueError(f"torch_ipc: TORCH_IPC_PEER_COPY={mode!r}: expected 'engine' or 'kernel'")
    return mode == "engine"


def _dims(src: torch.Tensor, dst: torch.Tensor) -> List[Tuple[int, int, int]]:
    """(size, src stride, dst stride) of the dims of size > 1, outer first,
    adjacent dims merged where both sides nest them (one longer dim)."""
    out: List[Tuple[int, int, int]] = []
    for n, a, b in zip(src.shape, src.stride(), dst.stride()):
        if n == 1:
            continue
        if out and out[-1][1] == a * n and out[-1][2] == b * n:
            m, _, _ = out.pop()
            n = m * n
        out.append((n, a, b))
    return out


def copy_2d(src: torch.Tensor, dst: torch.Tensor) -> Optional[Copy2D]:
    """`src` -> `dst` (same shape and dtype) as one 2-D copy (Note [peer
    pieces on the copy engine]), or None when it is not one: more than one
    strided dim left after merging, overlapping rows, a pitch over MAX_PITCH,
    rows shorter than ENGINE_MIN_ROW_BYTES."""
    if src.shape != dst.shape or src.dtype != dst.dtype or src.numel() == 0:
        return None
    size = src.element_size()
    dims = _dims(src, dst)
    inner = 1
    if dims and dims[-1][1] == 1 and dims[-1][2] == 1:
        inner = dims.pop()[0]
    if not dims:
        return (src.data_ptr(), dst.data_ptr(), inner * size, 1, inner * size, inner * size)
    if len(dims) != 1:
        return None
    height, a, b = dims[0]
    width, src_pitch, dst_pitch = inner * size, a * size, b * size
    if min(src_pitch, dst_pitch) < width or max(src_pitch, dst_pitch) > MAX_PITCH or width < ENGINE_MIN_ROW_BYTES:
        return None
    return (src.data_ptr(), dst.data_ptr(), width, height, src_pitch, dst_pitch)


class EngineCopies:
    """Pairs (source on another GPU, destination on `device`) as one table of
    2-D copies, queued by ``run()`` on a side stream (Note [peer pieces on the
    copy engine]). The caller keeps the tensors alive."""

    def __init__(self, copies: Sequence[Copy2D], device: torch.device):
        self.table = torch.tensor(list(copies), dtype=torch.int64).reshape(-1, 6)
        self.device = device
        self._stream: Optional[torch.cuda.Stream] = None

    def run(self) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            _C.copy_2d_by_engine(self.table, self.device.index)
        current.wait_stream(self._stream)
