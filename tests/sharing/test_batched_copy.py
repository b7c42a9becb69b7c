"""torch_ipc._batched_copy's item tables (what kv's gather/scatter and weights'
pulls launch), run on the CPU with CPU addresses the way the kernel runs them
on a GPU: every byte copied once, nothing outside the ranges touched, items no
larger than ITEM_BYTES. The kernels themselves: test_kv_cuda.py and
test_weights_cuda.py."""
from array import array

import ipc_test_utils as u
import pytest
import torch

from torch_ipc import _C, _batched_copy
from torch_ipc._batched_copy import ITEM_BYTES, LARGEST_ITEM


@pytest.mark.parametrize(
    "nbytes", [1, 15, 16, 1000, ITEM_BYTES - 8, ITEM_BYTES, ITEM_BYTES + 1, 2 * ITEM_BYTES + 40, LARGEST_ITEM,
               LARGEST_ITEM + 24]
)
@pytest.mark.parametrize("min_items", [1, 12])
def test_block_items_copy_every_byte_of_every_block_once(nbytes, min_items):
    """Blocks of two spans (chunks) gathered into rows and scattered back."""
    gen = torch.Generator().manual_seed(u.new_seed())
    blocks = 5
    src = torch.randint(0, 256, (blocks * nbytes + 7,), dtype=torch.uint8, generator=gen)[7:]  # off alignment
    dst = torch.zeros(blocks * nbytes + 64, dtype=torch.uint8)
    spans = [(0, 2, src.data_ptr()), (2, 3, src.data_ptr() + 2 * nbytes)]
    ids = array("q", [3, 0, 4, 1, 2])
    size = _batched_copy.item_size(nbytes, blocks, min_items)
    per_block = -(-nbytes // size)
    table = torch.empty((blocks * per_block, 4), dtype=torch.int64)
    _C.fill_block_items(table, ids, spans, nbytes, dst.data_ptr(), True, size)
    counts = table[:, 2]
    assert per_block == _batched_copy.items_per_block(nbytes, blocks, min_items) and not table[:, 3].any()
    assert int(counts.max()) <= LARGEST_ITEM and int(counts.min()) > 0 and int(counts.sum()) == blocks * nbytes
    if per_block > 1:  # equal items, 16-byte multiples, the last one shorter: aligned blocks stay aligned
        assert not (counts.view(blocks, per_block)[:, :-1] % 16).any()
    u.run_table_on_cpu(table)
    assert torch.equal(dst[:-64].view(blocks, nbytes), src.view(blocks, nbytes)[list(ids)])
    assert not dst[-64:].any()  # nothing past the blocks
    back = torch.zeros_like(src)
    spans = [(0, 2, back.data_ptr()), (2, 3, back.data_ptr() + 2 * nbytes)]
    _C.fill_block_items(table, ids, spans, nbytes, dst.data_ptr(), False, size)
    u.run_table_on_cpu(table)
    assert torch.equal(back, src)


def test_block_items_refuse_ids_outside_the_spans_and_bad_tables():
    table = torch.zeros((1, 4), dtype=torch.int64)
    for bad in (-1, 5, 2):
        with pytest.raises(IndexError, match=f"block id {bad} is out of range"):
            _C.fill_block_items(table, array("q", [bad]), [(0, 2, 4096), (3, 2, 8192)], 16, 0, True, 16)
    assert not table.any()  # nothing written
    with pytest.raises(ValueError, match="item table"):
        _C.fill_block_items(torch.zeros((2, 4), dtype=torch.int64), array("q", [0]), [(0, 1, 4096)], 16, 0, True, 16)
    with pytest.raises(ValueError, match="0 bytes"):
        _batched_copy.item_size(0, 1)


def test_items_per_block_fill_the_gpu_within_bounds():
    """Note [block items]: items <= LARGEST_ITEM, at least min_items in all
    when blocks allow, never below ITEM_BYTES for that."""
    mib = 1 << 20
    assert LARGEST_ITEM == ITEM_BYTES == 256 << 10
    assert _batched_copy.items_per_block(2 * mib, 256, 132) == 8  # kv_bench: 2048 items of 256 KiB
    assert _batched_copy.items_per_block(2 * mib, 4, 132) == 2 * mib // ITEM_BYTES  # items of ITEM_BYTES
    assert _batched_copy.items_per_block(4 * mib + 16, 256, 132) == 17  # none above LARGEST_ITEM
    assert _batched_copy.items_per_block(15, 3, 132) == 1  # never below a block: no more items than bytes allow
    assert _batched_copy.items_per_block(64 << 10, 1, 132) == 1  # nor below ITEM_BYTES to reach min_items
    assert _batched_copy.items_per_block(ITEM_BYTES + 1, 1, 132) == 2


def test_split_into_items_covers_ranges_of_any_size():
    data = torch.randint(0, 256, (3 * ITEM_BYTES,), dtype=torch.uint8)
    out = torch.zeros_like(data)
    spans = [(0, 5), (9, 9 + 2 * ITEM_BYTES + 3), (2 * ITEM_BYTES + 20, 3 * ITEM_BYTES)]
    starts = torch.tensor([a for a, _ in spans], dtype=torch.int64)
    counts = torch.tensor([b - a for a, b in spans], dtype=torch.int64)
    table = _batched_copy.split_into_items(starts + data.data_ptr(), starts + out.data_ptr(), counts, ITEM_BYTES)
    assert table.shape[0] == 1 + 3 + 1 and int(table[:, 2].max()) <= ITEM_BYTES
    u.run_table_on_cpu(table)
    for a, b in spans:
        assert torch.equal(out[a:b], data[a:b])
    assert not out[5:9].any()


def test_kernels_are_not_offered_for_cpu_tensors():
    assert _batched_copy.kernels_available(torch.device("cpu")) == (False, "CPU tensors")
