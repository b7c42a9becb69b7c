"""Peer pieces on the copy engine (Note [peer pieces on the copy engine] in
torch_ipc/weights/_copy_engine.py): a (source, destination) pair as one 2-D
copy. CPU: the descriptor arithmetic, executed on host memory row by row
(what cuMemcpy2DAsync does), must equal dst.copy_(src). GPU (2 devices): the
copy engine against the batched copy kernel, bit for bit."""

import ctypes

import pytest
import torch

from torch_ipc.weights._copy_engine import ENGINE_MIN_ROW_BYTES, copy_2d, engine_wanted


def _run_on_host(desc) -> None:
    """A 2-D copy as the driver runs it: `height` rows of `width` bytes."""
    src, dst, width, height, src_pitch, dst_pitch = desc
    for i in range(height):
        ctypes.memmove(dst + i * dst_pitch, src + i * src_pitch, width)


def _pairs():
    base = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)
    cube = torch.arange(4 * 8 * 1024, dtype=torch.float32).reshape(4, 8, 1024)
    return {
        "contiguous rows (column-parallel)": (base[8:24], torch.zeros(16, 1024), 1),
        "a row-parallel slice": (base[:, 512:], torch.zeros(64, 512), 64),
        "a slice into a fused tensor's columns": (base[:, :512], torch.zeros(64, 1024)[:, 256:768], 64),
        "3-d, outer dims nest": (cube[:, :, :512], torch.zeros(4, 8, 512), 32),
        "bf16 rows": (base.to(torch.bfloat16)[:, :512], torch.zeros(64, 512, dtype=torch.bfloat16), 64),
        "a size-1 dim between": (base[:, None, :512], torch.zeros(64, 1, 512), 64),
    }


@pytest.mark.parametrize("case", list(_pairs()))
def test_a_pair_as_one_2d_copy_equals_a_tensor_copy(case):
    """Every byte of the destination's storage ends as dst.copy_(src) leaves it
    (the columns of a fused tensor outside the slice untouched)."""
    src, dst, height = _pairs()[case]
    desc = copy_2d(src, dst)
    assert desc is not None and desc[3] == height
    whole = dst if dst._base is None else dst._base
    want = whole.clone()
    want.as_strided(dst.shape, dst.stride(), dst.storage_offset()).copy_(src)
    _run_on_host(desc)
    assert torch.equal(whole, want) and torch.equal(dst, src)


def test_pairs_that_are_not_one_2d_copy_stay_with_the_kernel():
    cube = torch.zeros(4, 8, 1024)
    row = ENGINE_MIN_ROW_BYTES // 4
    assert copy_2d(cube[:, :4, :512], torch.zeros(4, 4, 512)) is None  # two strided dims
    assert copy_2d(cube[0, :, : row // 2], torch.zeros(8, row // 2)) is None  # rows too short for DMA
    assert copy_2d(cube[0], torch.zeros(1, 1024).expand(8, 1024)) is None  # rows overlap in the destination
    assert copy_2d(cube[0], torch.zeros(8, 1024, dtype=torch.bfloat16)) is None  # a conversion
    assert copy_2d(cube[0].t(), torch.zeros(1024, 8)) is None  # transposed: no contiguous run
    assert copy_2d(cube[0, :0], torch.zeros(0, 1024)) is None


def test_the_peer_copy_setting_is_engine_or_kernel(monkeypatch):
    monkeypatch.delenv("TORCH_IPC_PEER_COPY", raising=False)
    assert not engine_wanted()  # the kernel by default (Note [peer pieces on the copy engine])
    monkeypatch.setenv("TORCH_IPC_PEER_COPY", "engine")
    assert engine_wanted()
    monkeypatch.setenv("TORCH_IPC_PEER_COPY", "kernel")
    assert not engine_wanted()
    monkeypatch.setenv("TORCH_IPC_PEER_COPY", "dma")
    with pytest.raises(ValueError, match="TORCH_IPC_PEER_COPY='dma'"):
        engine_wanted()


@pytest.mark.gpus(2)
def test_peer_pieces_by_copy_engine_equal_the_kernel_bit_for_bit(monkeypatch):
    """Sources on GPU 1, destinations on GPU 0 (peer access on): the pairs the
    copy engine takes (contiguous, row-parallel, 3-d nested, into a fused
    tensor's columns) and one it leaves to the kernel, plus a same-GPU pair;
    the copy-engine path equals the kernel path and torch's copy bit for bit."""
    from torch_ipc.weights._copy import BatchedCopy

    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPUs 0 and 1 cannot reach each other")
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda:1").manual_seed(5)
    big = torch.randn(256, 4096, device="cuda:1", generator=gen).to(torch.bfloat16)
    cube = torch.randn(4, 8, 2048, device="cuda:1", generator=gen)
    local = torch.randn(64, 1024, device="cuda:0")
    torch.zeros(1, device="cuda:0").copy_(torch.zeros(1, device="cuda:1"))  # torch enables peer access both ways
    torch.zeros(1, device="cuda:1").copy_(torch.zeros(1, device="cuda:0"))

    def run(mode: str):
        monkeypatch.setenv("TORCH_IPC_PEER_COPY", mode)
        fused = torch.zeros(256, 6144, dtype=torch.bfloat16, device="cuda:0")
        pairs = [(big[32:96], torch.zeros(64, 4096, dtype=torch.bfloat16, device="cuda:0")),
                 (big[:, 2048:], torch.zeros(256, 2048, dtype=torch.bfloat16, device="cuda:0")),
                 (big[:, :2048], fused[:, 1024:3072]),
                 (cube[:, :, :1024], torch.zeros(4, 8, 1024, device="cuda:0")),
                 (cube[:, :4, :1024], torch.zeros(4, 4, 1024, device="cuda:0")),
                 (local[:, :512], torch.zeros(64, 512, device="cuda:0"))]
        copy = BatchedCopy(pairs, peer_sources=True)
        copy.run()
        torch.cuda.synchronize()
        return copy.path, [d.cpu() for _, d in pairs] + [fused.cpu()], [s.cpu() for s, _ in pairs]

    engine_path, by_engine, sources = run("engine")
    kernel_path, by_kernel, _ = run("kernel")
    assert engine_path == "copy_engine+kernel" and kernel_path == "kernel"
    for got, want in zip(by_engine, by_kernel):
        assert torch.equal(got, want)
    for got, src in zip(by_engine, sources):
        assert torch.equal(got, src)


def test_a_bad_2d_copy_table_is_refused_before_anything_is_queued():
    from torch_ipc import _C

    with pytest.raises(ValueError, match=r"\[n, 6\]"):
        _C.copy_2d_by_engine(torch.zeros(2, 5, dtype=torch.int64), 0)
    rows_wider_than_pitch = torch.tensor([[4096, 8192, 2048, 4, 1024, 2048]], dtype=torch.int64)
    with pytest.raises(ValueError, match="pitches 1024 and 2048"):
        _C.copy_2d_by_engine(rows_wider_than_pitch, 0)
    with pytest.raises(ValueError, match="0 rows"):
        _C.copy_2d_by_engine(torch.tensor([[4096, 8192, 2048, 0, 2048, 2048]], dtype=torch.int64), 0)
