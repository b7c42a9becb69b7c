"""SharedKVPool.gather/scatter through the GPU's copy engines
(TORCH_IPC_KV_COPY=copy_engine, Note [kv copies] in torch_ipc/kv/_copies.py):
the ranges handed to the driver, checked and run on the CPU here; on a GPU,
bit for bit what index_select gives, through one cuMemcpyBatchAsync and
through one cuMemcpyAsync per range, on torch's default stream (where the
copies go per range) and on another stream.
The choice of path: TORCH_IPC_KV_COPY parsed, junk refused. Bad arguments
and a grown pool on this path: test_kv_cuda.py (parametrized by path)."""
from array import array

import ipc_test_utils as u
import pytest
import torch
from test_kv_cuda import LAYOUTS, _index_select_gather, _pool, _pool_bytes, _rows_as_bytes

from torch_ipc import _C
from torch_ipc.kv import SharedKVPool, _copies

ENGINE = "copy_engine"
PER_RANGE = "copy_engine (cuMemcpyAsync per range: ENGINE_BATCH is off)"


# ------------------------------------------------------------------ the path, on any machine


@pytest.mark.parametrize("value", ["", "copy_engine", "kernel", "index_select"])
def test_kv_copy_is_parsed(value, monkeypatch):
    monkeypatch.setenv(_copies.ENV, value)
    assert _copies.copy_method() == (value or _copies.DEFAULT_METHOD)
    monkeypatch.delenv(_copies.ENV)
    assert _copies.copy_method() == _copies.DEFAULT_METHOD


@pytest.mark.parametrize("junk", ["Kernel", "copy-engine", " kernel", "dma", "index_select,kernel", "0"])
def test_a_junk_kv_copy_is_refused_before_anything_is_copied(junk, monkeypatch):
    """Before, any value but index_select took the kernel silently: a typo
    measured the wrong path."""
    monkeypatch.setenv(_copies.ENV, junk)
    with pytest.raises(ValueError, match=r"TORCH_IPC_KV_COPY=.* is not one of copy_engine, kernel, index_select"):
        _copies.copy_method()
    gen = torch.Generator().manual_seed(u.new_seed())
    with SharedKVPool(6, (3, 4), torch.int32, "cpu") as pool:
        pool.tensor.copy_(u.random_tensor(pool.tensor.shape, torch.int32, gen))
        before = u.bits(pool.tensor)
        with pytest.raises(ValueError, match="TORCH_IPC_KV_COPY"):
            pool.gather([0, 1])
        with pytest.raises(ValueError, match="TORCH_IPC_KV_COPY"):
            pool.scatter([2, 3], torch.zeros((2, 3, 4), dtype=torch.int32))
        assert u.bits(pool.tensor) == before and pool.copy_path == ""


def _run_ranges_on_cpu(ranges) -> None:
    if ranges:
        u.run_table_on_cpu(torch.tensor([(s, d, n, 0) for s, d, n in ranges], dtype=torch.int64))


@pytest.mark.parametrize("nbytes", [1, 15, 16, 1000, 1 << 20])
def test_block_ranges_copy_every_block_once_and_merge_neighbours(nbytes):
    """The ranges of _C.copy_blocks_by_engine, run on the CPU with CPU
    addresses: gathered rows and scattered blocks exact, a run of adjacent
    blocks one range, never across two chunks even where their memory touches."""
    gen = torch.Generator().manual_seed(u.new_seed())
    pool = torch.randint(0, 256, (7 * nbytes + 3,), dtype=torch.uint8, generator=gen)[3:]  # off alignment
    spans = [(0, 3, pool.data_ptr()), (3, 4, pool.data_ptr() + 3 * nbytes)]  # two chunks, back to back
    ids = array("q", [4, 5, 6, 1, 2, 3, 0, 0, 2])  # a run, one across the chunks, a repeat
    rows = torch.zeros(len(ids) * nbytes + 64, dtype=torch.uint8)
    ranges = _C.block_copy_ranges(ids, spans, nbytes, rows.data_ptr(), True)
    assert [n // nbytes for _, _, n in ranges] == [3, 2, 1, 1, 1, 1]
    _run_ranges_on_cpu(ranges)
    assert torch.equal(rows[:-64].view(len(ids), nbytes), pool.view(7, nbytes)[list(ids)])
    assert not rows[-64:].any()
    back = torch.zeros_like(pool)
    unique = array("q", [6, 5, 2, 3, 4, 0, 1])
    src = torch.randint(0, 256, (len(unique) * nbytes,), dtype=torch.uint8, generator=gen)
    spans = [(0, 3, back.data_ptr()), (3, 4, back.data_ptr() + 3 * nbytes)]
    ranges = _C.block_copy_ranges(unique, spans, nbytes, src.data_ptr(), False)
    assert [n // nbytes for _, _, n in ranges] == [1, 1, 1, 2, 2]
    _run_ranges_on_cpu(ranges)
    assert torch.equal(back.view(7, nbytes)[list(unique)], src.view(len(unique), nbytes))


def test_block_ranges_refuse_ids_outside_the_chunks():
    spans = [(0, 2, 4096), (3, 2, 8192)]  # id 2 is in no chunk
    for bad in (-1, 5, 2, 1 << 62):
        with pytest.raises(IndexError, match=f"block id {bad} is out of range"):
            _C.block_copy_ranges(array("q", [0, 1, bad]), spans, 16, 0, True)
    with pytest.raises(ValueError, match="int64"):
        _C.block_copy_ranges(array("i", [0]), spans, 16, 0, True)
    with pytest.raises(ValueError, match="0 bytes"):
        _C.block_copy_ranges(array("q", [0]), spans, 0, 0, True)


# ------------------------------------------------------------------ on a GPU

cuda = pytest.mark.cuda
CALLS = ["batch", "per_range"]


@pytest.fixture(params=CALLS)
def engine(request, monkeypatch, stream):
    """TORCH_IPC_KV_COPY=copy_engine, through one batch or one copy per range;
    the copy_path each gives (on the legacy default stream: per range, Note
    [batch copies off the legacy stream] in csrc/cuda/copy_engine.cpp)."""
    monkeypatch.setenv(_copies.ENV, ENGINE)
    monkeypatch.setattr(_copies, "ENGINE_BATCH", request.param == "batch")
    if request.param == "per_range":
        return PER_RANGE
    ok, why = _C.memcpy_batch_available()
    if ok and stream.cuda_stream == 0:
        ok, why = False, _copies.LEGACY_STREAM
    return ENGINE if ok else f"copy_engine (cuMemcpyAsync per range: {why})"


@pytest.fixture(params=["default_stream", "side_stream"])
def stream(request):
    """Where the calls are queued: torch's default stream (the legacy one,
    where the copies go per range) or a stream of torch's pool."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.cuda.default_stream() if request.param == "default_stream" else torch.cuda.Stream()


LAYOUT_IDS = [f"{s}-{u.dtype_name(d)}" for s, d in LAYOUTS]


@cuda
@pytest.mark.parametrize("shape,dtype", LAYOUTS, ids=LAYOUT_IDS)
def test_gather_is_index_select_bit_for_bit(shape, dtype, engine, stream, monkeypatch):
    gen = torch.Generator().manual_seed(u.new_seed())
    with _pool(shape, dtype, gen) as pool:
        ids = torch.randint(0, 40, (64,), generator=gen).tolist()  # every chunk, in no order, repeats
        ids[10:14] = [20, 21, 22, 23]  # and a run the ranges merge
        want = _index_select_gather(pool, ids, monkeypatch)
        monkeypatch.setenv(_copies.ENV, ENGINE)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            got = pool.gather(ids)
        assert pool.copy_path == engine
        torch.cuda.synchronize()
        assert u.bits(got) == u.bits(want)


@cuda
@pytest.mark.parametrize("shape,dtype", LAYOUTS, ids=LAYOUT_IDS)
def test_scatter_writes_exactly_its_blocks(shape, dtype, engine, stream):
    gen = torch.Generator().manual_seed(u.new_seed())
    with _pool(shape, dtype, gen) as pool:
        want = _pool_bytes(pool).clone()
        ids = torch.randperm(40, generator=gen)[:25].tolist()
        ids = [i for i in ids if i not in (30, 31, 32)] + [30, 31, 32]  # every chunk, in no order, and a run
        src = u.random_tensor((len(ids), *shape), dtype, gen, "cuda")
        want[ids] = _rows_as_bytes(src)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            pool.scatter(ids, src)
        assert pool.copy_path == engine
        torch.cuda.synchronize()
        assert torch.equal(_pool_bytes(pool), want)


@cuda
def test_ordered_with_the_current_stream_both_ways_without_the_host_waiting(engine, stream):
    """Behind a busy stream: the copies see the writes queued before them
    and not those queued after, and the host does not wait for any of it
    (Note [batch copies off the legacy stream])."""
    gen = torch.Generator().manual_seed(u.new_seed())
    shape = (4, 1000)
    with _pool(shape, torch.uint8, gen, blocks=12, per_chunk=5) as pool:
        ids = [11, 0, 7, 3, 5, 6]
        src = u.random_tensor((len(ids), *shape), torch.uint8, gen, "cuda")
        torch.cuda.synchronize()
        cycles = int(0.3 * u.gpu_cycles_per_second())
        with torch.cuda.stream(stream):
            # Once before, every call the timed part makes: the allocators hold what
            # the calls need, and each kernel is loaded (CUDA loads kernels lazily,
            # and loading one waits for the GPU: that wait is not the copies').
            torch.cuda._sleep(1)
            pool.block(ids[0]).fill_(0)
            pool.scatter(ids, src)
            pool.gather(ids)
            stream.synchronize()
            torch.cuda._sleep(cycles)
            for i in ids:
                pool.block(i).fill_(7)  # before: the gather must see it
            got = pool.gather(ids)
            for i in ids:
                pool.block(i).fill_(9)  # after: the gather must not see it
            pool.scatter(ids, src)  # after the fill: the blocks end as src
            again = pool.gather(ids)
            busy = not stream.query()
        assert busy, "the host waited for the stream"
        assert pool.copy_path == engine
        torch.cuda.synchronize()
        assert bool((got == 7).all())
        assert u.bits(again) == u.bits(src)
        assert u.bits(torch.stack([pool.block(i) for i in ids])) == u.bits(src)
