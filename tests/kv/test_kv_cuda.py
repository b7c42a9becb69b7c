"""SharedKVPool.gather/scatter on GPUs through torch_ipc's batched copy kernel
(Note [kv copies] in torch_ipc/kv/_copies.py): bit for bit what index_select
gives, over pools of several chunks, blocks of sizes that are not multiples
of 16 bytes, odd dtypes, buffers off alignment; the host does not wait; bad
arguments are refused before anything is copied (there and with a grown
pool, on the copy-engine path too: the rest of it in test_kv_copy_engine.py).
Skipped without CUDA (the CPU side: test_kv.py, test_batched_copy.py)."""
import ipc_test_utils as u
import pytest
import torch

from torch_ipc._batched_copy import ITEM_BYTES
from torch_ipc.kv import SharedKVPool

pytestmark = pytest.mark.cuda

# (block shape, dtype): 2 MiB blocks as kv_bench's, blocks of 15, 18, 56 and
# 5 bytes, blocks larger than an item and not a multiple of 16 bytes.
LAYOUTS = [
    ((2, 32, 16, 8, 128), torch.bfloat16),
    ((3, 5), torch.uint8),
    ((9,), torch.int16),
    ((7,), torch.float64),
    ((5,), torch.bool),
    ((3, 4), torch.complex64),
    ((2 * ITEM_BYTES + 40,), torch.uint8),
]
if hasattr(torch, "float8_e4m3fn"):
    LAYOUTS.append(((17,), torch.float8_e4m3fn))
KERNEL = "kernel"


def _pool(shape, dtype, gen, blocks=40, per_chunk=16, **kw) -> SharedKVPool:
    """A CUDA pool of `blocks` blocks in chunks of `per_chunk`, filled with random bits."""
    pool = SharedKVPool(blocks, shape, dtype, "cuda", blocks_per_chunk=per_chunk, **kw)
    for chunk in pool.chunks:
        chunk.copy_(u.random_tensor(chunk.shape, dtype, gen, "cuda"))
    return pool


def _index_select_gather(pool, ids, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("TORCH_IPC_KV_COPY", "index_select")
    try:
        out = pool.gather(ids)
        assert pool.copy_path == "index_select (TORCH_IPC_KV_COPY=index_select)"
        return out
    finally:
        monkeypatch.delenv("TORCH_IPC_KV_COPY")


def _rows_as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Each block of `t` [n, *block_shape] as a row of bytes (any dtype)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def _pool_bytes(pool) -> torch.Tensor:
    return torch.cat([_rows_as_bytes(chunk) for chunk in pool.chunks])


def _snapshot(pool) -> list:
    return [u.bits(chunk) for chunk in pool.chunks]


@pytest.mark.parametrize("shape,dtype", LAYOUTS, ids=[f"{s}-{u.dtype_name(d)}" for s, d in LAYOUTS])
def test_gather_is_index_select_bit_for_bit(shape, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(u.new_seed())
    with _pool(shape, dtype, gen) as pool:
        ids = torch.randint(0, 40, (64,), generator=gen).tolist()  # every chunk, repeats
        want = _index_select_gather(pool, ids, monkeypatch)
        got = pool.gather(ids)
        assert pool.copy_path == KERNEL
        torch.cuda.synchronize()
        assert u.bits(got) == u.bits(want)


@pytest.mark.parametrize("shape,dtype", LAYOUTS, ids=[f"{s}-{u.dtype_name(d)}" for s, d in LAYOUTS])
def test_scatter_writes_exactly_its_blocks(shape, dtype):
    gen = torch.Generator().manual_seed(u.new_seed())
    with _pool(shape, dtype, gen) as pool:
        want = _pool_bytes(pool).clone()
        ids = torch.randperm(40, generator=gen)[:25].tolist()  # every chunk, in no order
        src = u.random_tensor((25, *shape), dtype, gen, "cuda")
        want[ids] = _rows_as_bytes(src)
        pool.scatter(ids, src)
        assert pool.copy_path == KERNEL
        torch.cuda.synchronize()
        assert torch.equal(_pool_bytes(pool), want)


def test_buffers_off_alignment_and_sources_off_the_device():
    """out and src at odd addresses (the kernel's byte loop), a CPU src and a
    non-contiguous one (moved and made contiguous first)."""
    gen = torch.Generator().manual_seed(u.new_seed())
    shape = (4, 1000)
    with _pool(shape, torch.uint8, gen, blocks=12, per_chunk=5) as pool:
        ids = [11, 0, 7, 3, 5]
        raw = torch.zeros(len(ids) * 4000 + 3, dtype=torch.uint8, device="cuda")
        out = raw[3:].view(len(ids), *shape)
        pool.gather(ids, out=out)
        torch.cuda.synchronize()
        assert u.bits(out) == u.bits(torch.stack([pool.block(i) for i in ids]))
        misaligned = u.random_tensor((len(ids) * 4000 + 1,), torch.uint8, gen, "cuda")[1:].view(len(ids), *shape)
        pool.scatter(ids, misaligned)
        on_cpu = u.random_tensor((2, *shape), torch.uint8, gen)
        pool.scatter([2, 9], on_cpu)
        transposed = u.random_tensor((2, shape[1], shape[0]), torch.uint8, gen, "cuda").transpose(1, 2)
        pool.scatter([4, 6], transposed)
        assert pool.copy_path == KERNEL
        torch.cuda.synchronize()
        assert u.bits(torch.stack([pool.block(i) for i in ids])) == u.bits(misaligned)
        assert u.bits(torch.stack([pool.block(2), pool.block(9)])) == u.bits(on_cpu)
        assert u.bits(torch.stack([pool.block(4), pool.block(6)])) == u.bits(transposed)


@pytest.mark.parametrize("path", [KERNEL, "copy_engine"])
def test_a_grown_pool_is_addressed_through_its_new_chunk(path, monkeypatch):
    monkeypatch.setenv("TORCH_IPC_KV_COPY", path)
    gen = torch.Generator().manual_seed(u.new_seed())
    with _pool((3, 5), torch.int32, gen, blocks=4, per_chunk=4, max_blocks=10) as pool:
        pool.gather([1, 3])  # the chunks' addresses are cached now
        ids = pool.grow(6)
        src = u.random_tensor((6, 3, 5), torch.int32, gen, "cuda")
        pool.scatter(ids[::-1], src)
        got = pool.gather([9, 0, 3, 4] + ids)  # 3, 4: adjacent ids in two chunks
        assert pool.copy_path.split(" (")[0] == path
        torch.cuda.synchronize()
        assert u.bits(got[4:]) == u.bits(src.flip(0)) and u.bits(got[1]) == u.bits(pool.block(0))
        assert u.bits(got[2:4]) == u.bits(torch.stack([pool.block(3), pool.block(4)]))


def test_the_host_does_not_wait_and_temporaries_are_ordered():
    """Note [kv copies]: gather and scatter queue behind a busy stream without
    the host waiting for it; scatter's contiguous copy of its src, and the
    tables, go back to the caching allocator at once, and the work queued
    after them that reuses that memory runs after the kernel."""
    gen = torch.Generator().manual_seed(u.new_seed())
    shape = (2, 8, 16, 64)
    with _pool(shape, torch.float16, gen, blocks=24, per_chunk=10) as pool:
        src = u.random_tensor((12, *reversed(shape)), torch.float16, gen, "cuda").permute(0, 4, 3, 2, 1)
        ids = list(range(23, 11, -1))

        def queue() -> torch.Tensor:
            pool.scatter(ids, src)  # not contiguous: scatter copies it first
            out = pool.gather(ids)
            for _ in range(4):  # overwrite whatever memory scatter and gather let go of
                torch.full((12, *shape), float("nan"), dtype=torch.float16, device="cuda")
            return out

        cycles = int(0.3 * u.gpu_cycles_per_second())
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            queue()  # once before: the kernels load, both allocators hold what the calls need
            stream.synchronize()
            torch.cuda._sleep(cycles)
            out = queue()
            busy = not stream.query()
        assert busy, "the host waited for the stream"
        assert pool.copy_path == KERNEL
        stream.synchronize()
        assert u.bits(out) == u.bits(src)
        assert u.bits(torch.stack([pool.block(i) for i in ids])) == u.bits(src)


@pytest.mark.parametrize("path", [KERNEL, "copy_engine"])
def test_bad_arguments_are_refused_before_anything_is_copied(path, monkeypatch):
    """On both paths that trust their addresses (Note [kv copies])."""
    monkeypatch.setenv("TORCH_IPC_KV_COPY", path)
    gen = torch.Generator().manual_seed(u.new_seed())
    shape = (3, 5)
    with _pool(shape, torch.int16, gen, blocks=10, per_chunk=4) as pool:
        before = _snapshot(pool)
        good = torch.zeros((2, *shape), dtype=torch.int16, device="cuda")
        for out in (good.float(), good.cpu(), torch.zeros((3, *shape), dtype=torch.int16, device="cuda"),
                    torch.zeros((2, 5, 3), dtype=torch.int16, device="cuda").transpose(1, 2)):
            with pytest.raises(ValueError, match="out must be"):
                pool.gather([0, 1], out=out)
        for bad in ([0, 10], [-1, 3], [2, 1 << 40]):
            with pytest.raises(IndexError, match="out of range"):
                pool.gather(bad, out=good)
            with pytest.raises(IndexError, match="out of range"):
                pool.scatter(bad, good)
        with pytest.raises(ValueError, match="src must be"):
            pool.scatter([0, 1], good.float())
        with pytest.raises(ValueError, match="src must be"):
            pool.scatter([0, 1, 2], good)
        with pytest.raises(ValueError, match="twice"):
            pool.scatter([4, 4], good)
        torch.cuda.synchronize()
        assert _snapshot(pool) == before and not good.any()
        assert pool.gather([]).shape == (0, *shape)
        pool.scatter([], good[:0])
        assert pool.copy_path.split(" (")[0] == path
