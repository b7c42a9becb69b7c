"""BatchedCopy: a fixed list of (source, destination) tensor pairs, grouped
once into a few launches; ``run()`` is those launches and nothing else.

Same-dtype pairs on one GPU go through one launch of torch_ipc's copy kernel
(strided ones as their contiguous runs of at least MIN_RUN_BYTES: a column
slice is one run per row), fp32 -> bf16 contiguous pairs through one launch
of its conversion kernel (Note [batched copy kernels] in
csrc/cuda/batched_copy.cpp, torch_ipc/_batched_copy.py); a source on another
GPU too when the caller made it readable there (``peer_sources``: Note [peer
reads of a snapshot] in _shard_local.py), unless the copy engine takes it as
one 2-D copy (Note [peer pieces on the copy engine] in _copy_engine.py). Everything else (other
conversions, short runs, CPU tensors) goes through one
``torch._foreach_copy_``. ``path`` says which ran.
"""

import os
from typing import List, Optional, Sequence, Tuple

import torch

from .. import _batched_copy
from ._copy_engine import EngineCopies, copy_2d, engine_wanted

__all__ = ["BatchedCopy", "kernels_available"]

_COPY = _batched_copy.COPY
_F32_TO_BF16 = _batched_copy.F32_TO_BF16


def kernels_available(device: torch.device) -> Tuple[bool, str]:
    """Whether torch_ipc's copy kernels load on `device`, and why not.
    ``TORCH_IPC_WEIGHTS_COPY=foreach`` turns them off."""
    if device.type == "cuda" and os.environ.get("TORCH_IPC_WEIGHTS_COPY", "") == "foreach":
        return False, "TORCH_IPC_WEIGHTS_COPY=foreach"
    return _batched_copy.kernels_available(device)


MIN_RUN_BYTES = 512  # a strided pair with shorter contiguous runs is left to torch
MAX_RUNS = 1 << 22  # runs of one launch (its table: 32 bytes each)


def byte_runs(src: torch.Tensor, dst: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor, int]]:
    """The contiguous runs that copy `src` into `dst` (same shape and dtype):
    (source addresses, destination addresses, bytes per run), built with
    tensor ops; None when a run is shorter than MIN_RUN_BYTES (and not the
    whole pair), there are more than MAX_RUNS, or `dst` overlaps itself."""
    dims = [(n, a, b) for n, a, b in zip(src.shape, src.stride(), dst.stride()) if n != 1]
    if any(b == 0 for _, _, b in dims):
        return None
    inner = 1
    while dims and dims[-1][1] == inner and dims[-1][2] == inner:
        inner *= dims.pop()[0]
    size = src.element_size()
    if dims and (inner * size < MIN_RUN_BYTES or src.numel() // inner > MAX_RUNS):
        return None
    s_off = d_off = torch.zeros(1, dtype=torch.int64)
    for n, a, b in dims:
        i = torch.arange(n, dtype=torch.int64)
        s_off = (s_off[:, None] + i * a).reshape(-1)
        d_off = (d_off[:, None] + i * b).reshape(-1)
    return src.data_ptr() + s_off * size, dst.data_ptr() + d_off * size, inner * size


# Note [copies beside transfers]
# A launch of the copy kernel takes every SM it can (an item of ITEM_BYTES a
# block, so a 256 MiB bucket is 1024 blocks) and, for its ~0.2 ms, nearly all
# of the GPU's memory bandwidth. Beside an NCCL transfer that was a loss: the
# sharded two-node pull moved its 256 MiB rounds in 0.83-0.86 ms against
# 0.73 ms for a raw send of the same bytes, because the pack (trainer) and
# unpack (engine) of the neighbouring bucket starved the transfer. A copy
# that runs beside transfers is therefore cut into about `items` items (a
# few tens: it takes a few SMs, runs ~2-3x longer, and is still hidden behind
# the transfer): with 32 items per bucket the rounds took 0.71-0.77 ms and a
# version 5.17-5.35 ms instead of 5.58-5.60, but the small first and last
# buckets then had 3-4 items and their copies took ~0.2 ms on the critical
# path. So a copy there (the first pack, the last unpack) keeps the default,
# every SM: 5.17-5.18 ms (benchmarks/sharded_timeline.py, two H100s,
# 2026-11-26; benchmarks/RESULTS.md).
BESIDE_TRANSFERS = 32


def item_table(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], kind: int, device: torch.device,
               items: Optional[int] = None) -> torch.Tensor:
    """The [n, 4] int64 table {src, dst, count, 0} of one launch, on `device`:
    each pair (each contiguous run of it, for a copy) cut into items of at
    most ITEM_BYTES of source (count in bytes for a copy, in elements for a
    conversion), or into about `items` items in all (BESIDE_TRANSFERS)
    when that makes them larger (Note [copies beside transfers]); built with tensor ops (no loop
    per item)."""
    if kind == _COPY:
        runs = [byte_runs(s, d) for s, d in pairs]
        src = torch.cat([r[0] for r in runs])
        dst = torch.cat([r[1] for r in runs])
        counts = torch.cat([torch.full((len(r[0]),), r[2], dtype=torch.int64) for r in runs])
        chunk, src_step, dst_step, grain = _batched_copy.ITEM_BYTES, 1, 1, 256
    else:
        counts = torch.tensor([s.numel() for s, _ in pairs], dtype=torch.int64)
        chunk, src_step, dst_step, grain = _batched_copy.ITEM_BYTES // 4, 4, 2, 64
        src = torch.tensor([s.data_ptr() for s, _ in pairs], dtype=torch.int64)
        dst = torch.tensor([d.data_ptr() for _, d in pairs], dtype=torch.int64)
    if items:
        chunk = max(chunk, -(-int(counts.sum()) // items // grain) * grain)
    return _batched_copy.split_into_items(src, dst, counts, chunk, src_step, dst_step).to(device)


class BatchedCopy:
    """Copies ``pairs`` (source, destination), same number of elements each;
    a source on another GPU than its destination is read there in place when
    ``peer_sources`` (the caller has made it readable from the destination's
    GPU). Built once; keeps every tensor alive so the addresses in its
    tables stay valid."""

    def __init__(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], peer_sources: bool = False,
                 by_engine: bool = False, items: Optional[int] = None):
        """``by_engine``: every pair the copy engine can take goes there
        (Note [sends beside the snapshot] in sharded.py), not only peer ones.
        ``items``: about that many items per launch, for a copy that runs
        beside transfers (Note [copies beside transfers])."""
        self._pairs = [(s if s.shape == d.shape else s.view(d.shape), d) for s, d in pairs if s.numel() > 0]
        self._peer_sources, self._by_engine = peer_sources, by_engine
        self._launches: List[Tuple[torch.Tensor, int]] = []
        fallback = []
        groups = {}
        engine = {}
        why = ""
        for src, dst in self._pairs:
            by_engine = self._engine_copy(src, dst)
            if by_engine is not None:
                engine.setdefault(dst.device, []).append(by_engine)
                continue
            ok, why_not = self._kernel_fits(src, dst)
            if ok:
                kind = _COPY if src.dtype == dst.dtype else _F32_TO_BF16
                groups.setdefault((kind, dst.device), []).append((src, dst))
            else:
                why = why or why_not
                fallback.append((src, dst))
        for (kind, device), group in groups.items():
            self._launches.append((item_table(group, kind, device, items), kind))
        self._engine = [EngineCopies(copies, device) for device, copies in engine.items()]
        self._dst = [d for _, d in fallback]
        self._src = [s for s, _ in fallback]
        self.bytes = sum(s.numel() * s.element_size() for s, _ in self._pairs)
        self.launches = len(self._launches) + len(self._engine) + (1 if fallback else 0)
        kinds = (["copy_engine"] if self._engine else []) + (["kernel"] if self._launches else []) + \
            (["foreach"] if fallback else [])
        self.path = "+".join(kinds) or "empty"
        self.why_foreach = why

    def _engine_copy(self, src: torch.Tensor, dst: torch.Tensor):
        """The 2-D copy of a pair read from a peer GPU by the copy engine, or
        None (Note [peer pieces on the copy engine] in _copy_engine.py)."""
        if self._by_engine and src.is_cuda and src.device == dst.device:
            return copy_2d(src, dst)
        if not (self._peer_sources and src.is_cuda and dst.is_cuda and src.device != dst.device):
            return None
        return copy_2d(src, dst) if engine_wanted() else None

    def _kernel_fits(self, src: torch.Tensor, dst: torch.Tensor) -> Tuple[bool, str]:
        if src.device != dst.device and not (self._peer_sources and src.is_cuda and dst.is_cuda):
            return False, f"{src.device} -> {dst.device}"
        ok, why = kernels_available(dst.device)
        if not ok:
            return False, why
        if src.dtype == dst.dtype:
            return (True, "") if byte_runs(src, dst) is not None else (False, "short strided runs")
        if not (src.is_contiguous() and dst.is_contiguous()):
            return False, "a non-contiguous conversion"
        if src.dtype == torch.float32 and dst.dtype == torch.bfloat16:
            return True, ""
        return False, f"{src.dtype} -> {dst.dtype}"

    def run(self) -> None:
        """Queue the copies on the current stream (CUDA; the copy engine's on a
        side stream it waits for); copy now (CPU)."""
        for engine in self._engine:
            engine.run()
        for table, kind in self._launches:
            _batched_copy.launch(table, kind)
        if self._dst:
            torch._foreach_copy_(self._dst, self._src)
