"""torch_ipc's batched copy kernels from Python: one launch copies a whole
table of byte ranges on the current stream (Note [batched copy kernels] in
csrc/cuda/batched_copy.cpp). Used by kv (``SharedKVPool.gather``/``scatter``)
and weights (``BatchedCopy``); each feature decides when to fall back to
torch's own ops.

A table is an [n, 4] int64 tensor of items {src, dst, count, 0}: count bytes
for ``COPY``, count fp32 elements for ``F32_TO_BF16``. The kernel trusts its
addresses: whoever builds a table forms them from live tensors only after
checking its own arguments, and keeps those tensors alive until the stream
has passed the launch.
"""
from typing import Dict, Tuple

import torch

from . import _C

__all__ = ["COPY", "F32_TO_BF16", "ITEM_BYTES", "LARGEST_ITEM", "kernels_available", "sm_count",
           "split_into_items", "items_per_block", "item_size", "to_device", "launch"]

COPY = 0
F32_TO_BF16 = 1
# The most bytes (COPY) or elements (F32_TO_BF16) one item holds: one GPU block
# of the launch each, so that work spreads evenly over the SMs.
ITEM_BYTES: int = _C.batched_item_bytes
# The most bytes item_size() puts in one item (Note [block items]).
LARGEST_ITEM = ITEM_BYTES
_available: Dict[int, Tuple[bool, str]] = {}
_sm_counts: Dict[int, int] = {}


def kernels_available(device: torch.device) -> Tuple[bool, str]:
    """Whether the kernels load on `device` (a CUDA device, sm_80 or newer,
    a driver that takes PTX ISA 7.0), and why not. Asked once per device."""
    if device.type != "cuda":
        return False, "CPU tensors"
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _available:
        _available[index] = tuple(_C.batched_copy_available(index))
    return _available[index]


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA `device` (asked once)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def split_into_items(src: torch.Tensor, dst: torch.Tensor, counts: torch.Tensor, chunk: int,
                     src_step: int = 1, dst_step: int = 1) -> torch.Tensor:
    """The CPU table of ranges (src[i], dst[i], counts[i]) (int64 tensors),
    each cut into items of at most `chunk` counts; an item of count c starts
    c * src_step bytes further in the source, c * dst_step in the destination.
    Tensor ops only: no Python loop per range or item."""
    per_range = (counts + chunk - 1) // chunk
    which = torch.repeat_interleave(torch.arange(len(counts)), per_range)
    first = torch.repeat_interleave(torch.cumsum(per_range, 0) - per_range, per_range)
    start = (torch.arange(int(per_range.sum())) - first) * chunk
    table = torch.zeros(len(which), 4, dtype=torch.int64)
    table[:, 0] = src[which] + start * src_step
    table[:, 1] = dst[which] + start * dst_step
    table[:, 2] = torch.clamp(counts[which] - start, max=chunk)
    return table


def items_per_block(nbytes: int, blocks: int, min_items: int) -> int:
    """How many items item_size() cuts each of `blocks` ranges of `nbytes`
    into so that a launch has at least `min_items` (Note [block items])."""
    fewest = _ceil_div(nbytes, LARGEST_ITEM)
    most = _ceil_div(nbytes, ITEM_BYTES)
    return min(most, max(fewest, _ceil_div(min_items, blocks)))


def item_size(nbytes: int, blocks: int, min_items: int = 1) -> int:
    """The bytes of each item that cuts `blocks` ranges of `nbytes` (the last
    item of a range shorter), for a launch of at least `min_items` items.

    Note [block items]
    Ranges of one size (a KV pool's blocks) are cut into items of equal size,
    rounded up to 16 bytes, so an aligned block stays aligned in every item
    and no item is a small remainder. How many: as few as keep items <=
    LARGEST_ITEM and give the launch `min_items` (the caller passes the GPU's
    SM count: every SM gets work), but no item below ITEM_BYTES (256 KiB, the
    grain of weights' launches) for that. LARGEST_ITEM was 2 MiB (256 blocks
    of 2 MiB: 256 items, ~2 per SM of an H100, all resident at once); items
    of at most 256 KiB gathered 256 random such blocks at 0.84x and 0.85x of
    a device copy against 0.79x for one item a block, in each of two
    kv_bench.py runs on an H100 (2026-11-25, 2026-11-26 12:51 UTC): eight
    times the blocks, each with less to do, keep the SMs busier to the end of
    the launch. So LARGEST_ITEM is ITEM_BYTES now. The table itself is
    filled in C++ (_C.launch_block_items, which checks every id against the
    pool's chunks before it writes an address): built with tensor ops it cost
    134 us of host time a gather on the H100 machine, a third of the 512 MiB
    copy it launches."""
    if nbytes < 1:
        raise ValueError(f"torch_ipc: a batched copy of blocks of {nbytes} bytes")
    k = items_per_block(nbytes, blocks, min_items)
    return nbytes if k == 1 else _ceil_div(_ceil_div(nbytes, k), 16) * 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`table` (pinned) on `device`, copied on the current stream without the
    host waiting; the caching host allocator keeps the pinned buffer until the
    copy has run, the device copy is allocated on the current stream."""
    return table.to(device, non_blocking=True)


def launch(table: torch.Tensor, kind: int = COPY) -> None:
    """Queue one launch over `table` (on the device of its addresses) on that
    device's current stream."""
    _C.launch_batched(table, kind)
