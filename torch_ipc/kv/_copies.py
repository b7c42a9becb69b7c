"""Gather and scatter: many blocks of a pool copied on the current stream,
by one kernel launch, by the GPU's copy engines, or by index_select.

Note [kv copies]
On a CUDA pool, gather() and scatter() take one of three paths, chosen by
``TORCH_IPC_KV_COPY`` (unset: the default of Note [kv copy default]);
``pool.copy_path`` says which the last gather/scatter took:
- ``kernel``: one launch of torch_ipc's batched copy kernel
  (torch_ipc/_batched_copy.py) over a table of the blocks' byte ranges, which
  keeps every SM busy with 16-byte loads.
- ``copy_engine``: the blocks' byte ranges (adjacent ones merged) handed to
  the GPU's copy engines in one cuMemcpyBatchAsync (CUDA 12.8 drivers on),
  asking the driver to keep them off the SMs: slower alone than the kernel
  may be, but it leaves the SMs to a model running beside it. A driver
  without that call gets one cuMemcpyAsync per range
  (``copy_engine (cuMemcpyAsync per range: why)``). csrc/cuda/copy_engine.cpp.
- ``index_select`` (index_select/index_copy_ over rows of the widest
  element): ~0.78x of a device copy of the same bytes on an H100. It serves
  CPU pools, and the kernel path on GPUs or drivers the kernels do not load
  on (``index_select (why)``).
A value of ``TORCH_IPC_KV_COPY`` other than these three is a ValueError at
the next gather/scatter, CPU pools included, before anything is copied.

The kernel and the copy engines trust their addresses, so:
- every id is bounds-checked (its min and max) before an address is formed,
  ``out``/``src`` are checked as for the fallback (shape, dtype, device,
  contiguous), and a chunk that is not one contiguous tensor is refused when
  it is mapped (Note [chunk records are data] in _chunks.py): a block is
  chunk start + local id * block_bytes.
- the table reaches the device without the host waiting: it is built in
  pinned memory and copied with non_blocking (the caching host allocator keeps
  the pinned buffer until that copy has run), as the fallback's index is.
  Except once: when the caching host allocator has no free pinned block of
  the table's size yet, it makes one (cudaHostAlloc), and that waits for the
  device. A GPU run showed it: a free after the first gather of a process,
  behind 0.1 s of queued work, found that work done. Later gathers of that
  size reuse the block and do not wait.
- the copy engines' ranges are built in C++ from the same checked ids
  (_C.copy_blocks_by_engine: every id found in a chunk before any address is
  formed, Note [block items]) and handed to the driver, which reads them
  during the call; nothing is staged. A range never crosses two chunks.
- every tensor whose address is in the table lives as long as it would for
  an index_select queued on the current stream, which is all the kernel is
  to the allocators: the device table, and a ``src`` that scatter() moved to
  the device or made contiguous, are allocated on the current stream, so the
  caching allocator reuses them only for work queued after the launch;
  ``out`` is returned to the caller (or is the caller's); the chunks are the
  pool's until close(), and their release waits for the current stream's work
  (Note [deferred release] in csrc/core/release.cpp; the owner's SharedPool
  chunks: Note [pool frees synchronize] in csrc/memory/shared_pool.cpp). A
  caller who queues gather/scatter on a stream other than the one that
  allocated ``out`` or ``src`` calls record_stream, as for any torch op.
"""
from __future__ import annotations

import os
from array import array
from typing import Dict, List, Optional, Tuple

import torch

from .. import _C, _batched_copy
from ._chunks import Chunks
from ._ids import Ids, pack
from ._state import PoolState

_INDEX_SELECT = "index_select"
_KERNEL = "kernel"
_COPY_ENGINE = "copy_engine"
_METHODS = (_COPY_ENGINE, _KERNEL, _INDEX_SELECT)
ENV = "TORCH_IPC_KV_COPY"

# Note [kv copy default]
# The path of a CUDA pool's gather/scatter when TORCH_IPC_KV_COPY is unset.
# Measured with benchmarks/kv_bench.py --quick (256 random blocks of
# [2, 32, 16, 8, 128] bf16; 2 x H100 80GB, driver 580, 2026-11-26, one run):
#   alone, vs a 512 MiB device copy (2870 GB/s): kernel 0.81x (gather) /
#   0.83x (scatter), copy_engine 0.32x / 0.31x (one batch; per range the
#   same), index_select 0.79x / 0.81x; host time of one gather: kernel
#   58 us, copy_engine 1.0 ms, index_select 83 us.
#   beside a bf16 8192^3 matmul loop (109.5 ms alone): matmul slowdown kernel
#   1.16x, copy_engine 0.98x, index_select 1.15x; one gather beside it: kernel
#   0.75 ms (1.89x its time alone), copy_engine 1.54 ms (1.31x); both done vs
#   one after the other: kernel 0.95x, copy_engine 0.99x.
# The copy engines leave the matmul alone, but a gather takes twice the
# kernel's time under load and 2.6x alone, and 1 ms of host time a call: the
# kernel stays the default; copy_engine is there for engines that measure
# their own mix.
DEFAULT_METHOD = _KERNEL

# Note [a gather's host time]
# The kernel path's launch runs after the host has built its table, so a
# gather takes its host time plus the kernel's. Measured on the H100 machine
# (2026-11-26, 256 random blocks of [2, 32, 16, 8, 128] bf16 into one buffer;
# that host runs Python ~2.5x slower than the 2-core CI machine): the kernel
# took 381 us on the GPU against 374 us for a device copy of the same 512 MiB
# (0.98x), but a gather 448 us from call to synchronize (0.85x), of which
# 91 us on the host: the ids packed 11.5 us, their min() and max() 21.5 us,
# the pinned table 5 us and its filling ~12 us, its copy to the device
# 11.8 us, the launch 8.1 us. So the ids' range is taken in C++
# (_C.block_id_range), and the table is made, filled, copied and launched
# in one C++ call (_C.launch_block_items). Then, on the same kind of machine:
# host 45 us, gather 423 us against 372 us for the device copy (0.88x; the
# kernel alone 380 us), and kv_bench.py's gather row 0.88x in each of two
# runs (0.77x earlier that day). What is left: the ids packed (11.5 us, an
# array("q") of a list), the path chosen and the arguments checked in Python,
# and the kernel's 3% over the device copy.

# How the copy_engine path calls the driver; kv_bench.py turns them to compare.
ENGINE_BATCH = True  # one cuMemcpyBatchAsync; False: one cuMemcpyAsync per range
LEGACY_STREAM = "the current stream is the legacy default stream"  # where the batch is not used
ENGINE_PREFER_OVERLAP = True  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE on the batch


def copy_method() -> str:
    """The path TORCH_IPC_KV_COPY asks for (DEFAULT_METHOD when unset or
    empty); another value is a ValueError naming the valid ones."""
    value = os.environ.get(ENV, "")
    if value == "":
        return DEFAULT_METHOD
    if value not in _METHODS:
        raise ValueError(f"torch_ipc: {ENV}={value!r} is not one of {', '.join(_METHODS)} (or unset)")
    return value


class BlockCopies:
    """gather() and scatter() of one pool (they record state.copy_path). The
    caller has checked that the pool is open."""

    def __init__(self, state: PoolState, chunks: Chunks) -> None:
        self._state = state
        self._chunks = chunks
        self._spans: Optional[List[Tuple[int, int, int]]] = None  # spans() until the pool grows

    def gather(self, ids: Ids, out: Optional[torch.Tensor], beside_transfers: bool = False) -> torch.Tensor:
        """``beside_transfers``: the copy runs beside a transfer (a remote send's
        next piece): the kernel takes one item a block, a few SMs (Note [copies
        beside transfers] in torch_ipc/weights/_copy.py)."""
        s = self._state
        packed = pack(ids)
        device = self._chunks.device()
        path = self._path()  # a bad TORCH_IPC_KV_COPY is refused before anything is allocated or copied
        if out is None:
            out = torch.empty((len(packed), *s.block_shape), dtype=s.dtype, device=device)
        elif (
            tuple(out.shape) != (len(packed), *s.block_shape)
            or out.dtype != s.dtype
            or out.device != device
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be a contiguous {s.dtype} tensor of shape {(len(packed), *s.block_shape)} "
                f"on {s.device}"
            )
        if path != _INDEX_SELECT:
            if len(packed):
                self._copy_by(path, packed, out, into_rows=True, beside_transfers=beside_transfers)
            return out
        for chunk, index, positions in self._index(packed):
            source, rows = self._rows(s.chunks[chunk], out)
            if positions is None:
                torch.index_select(source, 0, index, out=rows)
            else:
                rows[positions] = source.index_select(0, index)
        return out

    def scatter(self, ids: Ids, src: torch.Tensor, beside_transfers: bool = False) -> None:
        s = self._state
        packed = pack(ids)
        if tuple(src.shape) != (len(packed), *s.block_shape) or src.dtype != s.dtype:
            raise ValueError(f"src must be a {s.dtype} tensor of shape {(len(packed), *s.block_shape)}")
        if len(set(packed)) != len(packed):
            raise ValueError("torch_ipc: scatter() into a block listed twice")
        path = self._path()
        src = src.to(self._chunks.device()).contiguous()
        if path != _INDEX_SELECT:
            if len(packed):
                self._copy_by(path, packed, src, into_rows=False, beside_transfers=beside_transfers)
            return
        for chunk, index, positions in self._index(packed):
            target, rows = self._rows(s.chunks[chunk], src)
            target.index_copy_(0, index, rows if positions is None else rows[positions])

    def _path(self) -> str:
        """The path this gather/scatter takes (_COPY_ENGINE, _KERNEL or _INDEX_SELECT);
        records it, with why it is not the one asked for, in state.copy_path."""
        method = copy_method()
        device = self._state.device
        if device.type != "cuda":
            return self._record(_INDEX_SELECT, "CPU pool")
        if method == _COPY_ENGINE:
            ok, why = _C.memcpy_batch_available()
            if not ENGINE_BATCH:
                ok, why = False, "ENGINE_BATCH is off"
            elif ok and torch.cuda.current_stream(device).cuda_stream == 0:
                # Note [batch copies off the legacy stream] in csrc/cuda/copy_engine.cpp
                ok, why = False, LEGACY_STREAM
            return self._record(_COPY_ENGINE, "" if ok else f"cuMemcpyAsync per range: {why}")
        if method == _INDEX_SELECT:
            return self._record(_INDEX_SELECT, f"{ENV}={_INDEX_SELECT}")
        ok, why = _batched_copy.kernels_available(device)
        return self._record(_KERNEL, "") if ok else self._record(_INDEX_SELECT, why)

    def _record(self, path: str, why: str) -> str:
        self._state.copy_path = f"{path} ({why})" if why else path
        return path

    # ------------------------------------------------------------ the kernel

    def spans(self) -> List[Tuple[int, int, int]]:
        """(first id, blocks, address) of each mapped chunk, cached until the pool grows."""
        s = self._state
        if self._spans is None or len(self._spans) != len(s.chunks):
            self._spans = [(first, c.shape[0], c.data_ptr()) for first, c in zip(s.starts, s.chunks)]
        return self._spans

    def table(self, packed: array, rows: torch.Tensor, into_rows: bool, pin: bool, min_items: int) -> torch.Tensor:
        """The CPU table that copies the blocks `packed` (not empty) into the rows of contiguous
        `rows` (gather), or the rows into the blocks (scatter): what _C.launch_block_items
        builds and launches (the same C++ fills both), for tests that run it on a CPU; the ids
        are checked first, here and again where the table is filled (Note [block items])."""
        self._chunks.check_ids(packed)
        block_bytes = self._state.block_bytes
        size = _batched_copy.item_size(block_bytes, len(packed), min_items)
        per_block = -(-block_bytes // size)
        table = torch.empty((len(packed) * per_block, 4), dtype=torch.int64, pin_memory=pin)
        _C.fill_block_items(table, packed, self.spans(), block_bytes, rows.data_ptr(), into_rows, size)
        return table

    def _copy_by(self, path: str, packed: array, rows: torch.Tensor, into_rows: bool,
                 beside_transfers: bool = False) -> None:
        """Copy the blocks `packed` (not empty) into the rows of contiguous `rows` (gather) or
        back (scatter) on the current stream, by the kernel or the copy engines (Note [kv copies]);
        beside transfers, the kernel's items are whole blocks."""
        device = self._state.device
        index = torch.cuda.current_device() if device.index is None else device.index
        self._chunks.check_ids(packed)  # here and again where each address is formed (Note [block items])
        block_bytes = self._state.block_bytes
        if path == _KERNEL:  # Note [a gather's host time]
            size = block_bytes if beside_transfers else \
                _batched_copy.item_size(block_bytes, len(packed), _batched_copy.sm_count(device))
            _C.launch_block_items(packed, self.spans(), block_bytes, rows.data_ptr(), into_rows, size, index)
            return
        _C.copy_blocks_by_engine(packed, self.spans(), block_bytes, rows.data_ptr(), into_rows, index,
                                 ENGINE_BATCH, ENGINE_PREFER_OVERLAP)

    # ------------------------------------------------------ the index_select path

    def _index(self, packed: array) -> List[Tuple[int, torch.Tensor, Optional[List[int]]]]:
        """(chunk, ids within it on the pool's device, positions in `packed` or None for all)."""
        if len(packed) == 0:
            return []
        self._chunks.check_ids(packed)
        if len(self._state.chunks) == 1:
            return [(0, self._to_device(torch.frombuffer(packed, dtype=torch.int64)), None)]
        groups: Dict[int, Tuple[List[int], List[int]]] = {}
        for pos, block_id in enumerate(packed):
            chunk, local = self._chunks.locate(block_id)
            ids, positions = groups.setdefault(chunk, ([], []))
            ids.append(local)
            positions.append(pos)
        return [(c, self._to_device(torch.tensor(ids, dtype=torch.int64)), pos) for c, (ids, pos) in groups.items()]

    def _to_device(self, index: torch.Tensor) -> torch.Tensor:
        device = self._state.device
        if device.type == "cpu":
            return index.clone()
        # Pinned, so the copy is queued on the stream and the host does not wait for it.
        return index.pin_memory().to(device, non_blocking=True)

    def _rows(self, *tensors: torch.Tensor) -> List[torch.Tensor]:
        """Each of `tensors` [n, *block_shape] as rows of the widest element that
        divides a block and suits every tensor's offset (index kernels move one
        element per thread: wider elements, fewer threads; copies are bitwise)."""
        raw = [t.reshape(t.shape[0], -1).view(torch.uint8) for t in tensors]
        for dtype, size in ((torch.complex128, 16), (torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
            if self._state.block_bytes % size == 0 and all(r.storage_offset() % size == 0 for r in raw):
                return [r.view(dtype) for r in raw]
        return raw
