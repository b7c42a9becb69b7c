"""torch_ipc.weights on GPUs: the batched copy and conversion kernels bitwise
against torch, pulls across processes, torn updates, two subscribers,
bucketed == direct, errors. Skipped without CUDA (CPU twin: test_weights.py)."""

import secrets
import signal

import pytest
import torch
from weights_helpers import bits, listener_address, make_weights, pair

from torch_ipc.weights import PublisherGoneError, Subscriber, WeightsMismatchError
from torch_ipc.weights._copy import BatchedCopy

pytestmark = pytest.mark.cuda


def _random_bits(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(dtype).cuda()


def _pairs_in_flat_buffers(sizes, src_dtype, dst_dtype, gen, misalign=0):
    """Sources and destinations as views of two flat buffers, like a model's
    parameters; `misalign` elements shift every start off 16-byte alignment."""
    total = sum(sizes) + misalign * len(sizes)
    src_flat = _random_bits(total, src_dtype, gen)
    dst_flat = torch.zeros(total, dtype=dst_dtype, device="cuda")
    pairs, at = [], 0
    for n in sizes:
        at += misalign
        pairs.append((src_flat[at : at + n], dst_flat[at : at + n]))
        at += n
    return pairs


@pytest.mark.parametrize("misalign", [0, 1, 3])
def test_batched_copy_is_bitwise(misalign):
    gen = torch.Generator().manual_seed(secrets.randbits(31))
    sizes = [1, 7, 16, 1000, 65536 + 5, (256 << 10) + 3, 3 << 20]
    pairs = _pairs_in_flat_buffers(sizes, torch.bfloat16, torch.bfloat16, gen, misalign)
    copy = BatchedCopy(pairs)
    assert copy.path == "kernel" and copy.launches == 1, copy.why_foreach
    copy.run()
    torch.cuda.synchronize()
    for s, d in pairs:
        assert torch.equal(s.view(torch.int16), d.view(torch.int16))


@pytest.mark.parametrize("misalign", [0, 1, 2])
def test_batched_f32_to_bf16_matches_torch_bitwise(misalign):
    gen = torch.Generator().manual_seed(secrets.randbits(31))
    sizes = [1, 3, 4, 1027, 65536 + 1, 1 << 20]
    pairs = _pairs_in_flat_buffers(sizes, torch.float32, torch.bfloat16, gen, misalign)
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                            1e-40, -1e-45, 3.4e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8], device="cuda")
    pairs[-1][0][: special.numel()] = special
    copy = BatchedCopy(pairs)
    assert copy.path == "kernel", copy.why_foreach
    copy.run()
    torch.cuda.synchronize()
    for s, d in pairs:
        assert torch.equal(s.to(torch.bfloat16).view(torch.int16), d.view(torch.int16))


def test_batched_copy_of_strided_slices_runs_on_the_kernel():
    """Column slices (a row-split engine weight) and a strided source are one
    launch of contiguous runs; short runs stay with torch; both bit for bit."""
    gen = torch.Generator().manual_seed(secrets.randbits(31))
    src = torch.randn(300, 1024, generator=gen).to("cuda", torch.bfloat16)
    dst = torch.zeros(300, 2048, dtype=torch.bfloat16, device="cuda")
    narrow = torch.zeros(300, 8, dtype=torch.bfloat16, device="cuda")
    pairs = [(src, dst[:, 512:1536]), (src[:, 256:768], dst[:, 1536:]), (src[:, :8], narrow)]
    copy = BatchedCopy(pairs[:2])
    assert copy.path == "kernel" and copy.launches == 1, copy.why_foreach
    copy.run()
    mixed = BatchedCopy(pairs[2:])
    assert mixed.path == "foreach" and "short" in mixed.why_foreach
    mixed.run()
    torch.cuda.synchronize()
    for s, d in pairs:
        assert torch.equal(s.view(torch.int16), d.view(torch.int16))
    assert not dst[:, :512].any()


def test_foreach_fallback_gives_the_same_bytes(monkeypatch):
    gen = torch.Generator().manual_seed(secrets.randbits(31))
    pairs = _pairs_in_flat_buffers([5, 70000], torch.float32, torch.bfloat16, gen)
    monkeypatch.setenv("TORCH_IPC_WEIGHTS_COPY", "foreach")
    copy = BatchedCopy(pairs)
    assert copy.path == "foreach" and "TORCH_IPC_WEIGHTS_COPY" in copy.why_foreach
    copy.run()
    torch.cuda.synchronize()
    for s, d in pairs:
        assert torch.equal(s.to(torch.bfloat16).view(torch.int16), d.view(torch.int16))


def test_pull_in_process_bitwise_and_on_the_kernel_path():
    weights = make_weights("cuda", seed=1)
    pub, sub = pair(weights)
    pub.publish()
    model = make_weights("cuda", fill=0.0)
    sub.pull(model)
    torch.cuda.synchronize()
    assert bits(model) == bits(weights)
    assert sub.stats["path"] == "kernel" and sub.stats["launches"] == 1
    assert pub.stats["path"] == "kernel"


def test_dtype_conversion_and_name_map_on_gpu():
    weights = make_weights("cuda", seed=2)
    name_map = {"block.qkv.weight": ("block.q.weight", "block.k.weight", "block.v.weight")}
    pub, sub = pair(weights, name_map=name_map)
    pub.publish()
    model = {n: t for n, t in make_weights("cuda", torch.bfloat16, fill=0.0).items() if not n.startswith("block.")}
    model["block.qkv.weight"] = torch.zeros(32, 16, dtype=torch.bfloat16, device="cuda")
    model["block.norm"] = torch.zeros(16, dtype=torch.bfloat16, device="cuda")
    sub.pull(model)
    torch.cuda.synchronize()
    fused = torch.cat([weights["block.q.weight"], weights["block.k.weight"], weights["block.v.weight"]])
    assert torch.equal(model["block.qkv.weight"].view(torch.int16), fused.to(torch.bfloat16).view(torch.int16))
    embed = weights["embed.weight"].to(torch.bfloat16)
    assert torch.equal(model["embed.weight"].view(torch.int16), embed.view(torch.int16))
    assert sub.stats["path"] == "kernel" and sub.stats["launches"] == 1


def test_errors_on_gpu_before_any_copy():
    pub, sub = pair(make_weights("cuda", seed=3))
    pub.publish()
    model = make_weights("cuda", fill=0.0)
    model["embed.weight"] = torch.zeros(1, device="cuda")
    del model["step"]
    with pytest.raises(WeightsMismatchError) as info:
        sub.pull(model)
    assert len(info.value.problems) == 2
    assert bool((model["head.bias"] == 0).all())


def test_pull_in_another_process(ipc_peers):
    import weights_helpers as h

    address, key = listener_address()
    pub, sub = ipc_peers.get("cuda_pub"), ipc_peers.get("cuda_sub0")
    pub.start_call(h.pub_serve, address, key, device="cuda", seed=4)
    sub.call(h.sub_attach, address, key, device="cuda")
    assert pub.result() == 1
    expected = make_weights("cuda", seed=4)
    for version in (1, 2, 3):
        got, pulled, stats = sub.call(h.sub_pull, version - 1)
        assert got == version and pulled == bits(expected) and stats["path"] == "kernel"
        pub.call(h.pub_scale, 1.5)
        for t in expected.values():
            t.mul_(1.5)
        assert pub.call(h.pub_publish) == (version + 1, 1)
    sub.call(h.sub_close)
    pub.call(h.pub_close)


def test_no_torn_update_on_gpu(ipc_peers):
    import weights_helpers as h

    address, key = listener_address()
    pub_peer, sub_peer = ipc_peers.get("cuda_pub"), ipc_peers.get("cuda_sub0")
    pub_peer.start_call(h.pub_serve, address, key, device="cuda", fill=1.0, big=1 << 24)
    sub_peer.call(h.sub_attach, address, key, device="cuda", big=1 << 24)
    assert pub_peer.result() == 1
    pub_peer.start_call(h.pub_hammer, 2000)
    seen = sub_peer.call(h.sub_pull_until, 2001)
    assert pub_peer.result() == 2001 and seen[-1] == 2001
    sub_peer.call(h.sub_close)


def test_two_subscribers_on_gpu(ipc_peers):
    import weights_helpers as h

    address, key = listener_address()
    pub = ipc_peers.get("cuda_pub")
    pub.start_call(h.pub_serve, address, key, n_subscribers=2, device="cuda", seed=5)
    subs = [ipc_peers.get("cuda_sub0"), ipc_peers.get("cuda_sub1")]
    for p in subs:
        p.call(h.sub_attach, address, key, device="cuda")
    assert pub.result() == 1
    for p in subs:
        version, pulled, _ = p.call(h.sub_pull)
        assert version == 1 and pulled == bits(make_weights("cuda", seed=5))
    for p in subs:
        p.call(h.sub_close)
    pub.call(h.pub_close)


@pytest.mark.parametrize("bucket_bytes", [512, 1 << 20])
def test_bucketed_equals_direct_on_gpu(ipc_peers, bucket_bytes):
    import weights_helpers as h

    address, key = listener_address()
    pub, sub = ipc_peers.get("cuda_pub"), ipc_peers.get("cuda_sub0")
    pub.start_call(h.pub_serve, address, key, device="cuda", seed=6, bucket_bytes=bucket_bytes, publish=False)
    sub.call(h.sub_attach, address, key, device="cuda")
    assert pub.result() == 0
    expected = make_weights("cuda", seed=6)
    for version in (1, 2):
        sub.start_call(h.sub_pull)
        assert pub.call(h.pub_publish) == (version, 1)
        got, pulled, stats = sub.result()
        assert got == version and pulled == bits(expected) and stats["path"] == "kernel"
        pub.call(h.pub_scale, -3.0)
        for t in expected.values():
            t.mul_(-3.0)
    sub.call(h.sub_close)
    pub.call(h.pub_close)


def test_dead_publisher_on_gpu_keeps_the_model(ipc_peer):
    import weights_helpers as h

    address, key = listener_address()
    ipc_peer.start_call(h.pub_serve, address, key, device="cuda", seed=7)
    sub = Subscriber(h.Connector(address, key), timeout=10.0)
    ipc_peer.result()
    model = make_weights("cuda", fill=0.0)
    sub.pull(model)
    torch.cuda.synchronize()
    ipc_peer.kill(signal.SIGKILL)
    ipc_peer.close()
    with pytest.raises(PublisherGoneError):
        sub.pull(model)
    torch.cuda.synchronize()
    assert bits(model) == bits(make_weights("cuda", seed=7))
    sub.close()


def test_pull_into_a_cpu_model_from_a_gpu_publisher():
    weights = make_weights("cuda", seed=8)
    pub, sub = pair(weights)
    pub.publish()
    model = make_weights("cpu", fill=0.0)
    sub.pull(model)
    assert bits(model) == bits(weights) and sub.stats["path"] == "foreach"


@pytest.mark.gpus(2)
def test_pull_onto_another_gpu():
    weights = make_weights("cuda:0", seed=9)
    pub, sub = pair(weights)
    for version in (1, 2):
        pub.publish()
        model = make_weights("cuda:1", fill=0.0)
        sub.pull(model, newer_than=version - 1)
        torch.cuda.synchronize(1)
        assert bits(model) == bits(weights)
        for t in weights.values():
            t.add_(1)


def test_a_relayed_snapshot_is_pulled_range_by_range_as_it_lands():
    """A relay's publisher (its snapshot's ranges, an event each) whose fill
    lands each range after a GPU sleep: a pull queued while the bytes are
    still landing copies each range after its own event (a transposed model
    tensor after the whole version), bit for bit; once landed, one copy."""
    import multiprocessing as mp
    import time

    from torch_ipc.weights import Publisher
    from torch_ipc.weights._broadcast import buckets
    from torch_ipc.weights._layout import Layout

    shapes = {"a": (3000,), "t": (30, 40), "b": (7, 129), "s": ()}
    layout = Layout.build([(n, torch.float32, s) for n, s in shapes.items()])
    ranges = buckets(layout.total_bytes, 1024)
    pub = Publisher._for_layout(layout, torch.device("cuda", 0), max_subscribers=2, timeout=10.0, ranges=ranges)
    a, b = mp.Pipe()
    pub.attach(a)
    sub = Subscriber(b, timeout=10.0)
    model = {n: torch.zeros(s, device="cuda") for n, s in shapes.items()}
    model["t"] = torch.zeros(40, 30, device="cuda").t()  # not contiguous: copied whole
    gen = torch.Generator().manual_seed(secrets.randbits(31))
    # the pull's plan is made before: making it copies its tables to the GPU
    # from pageable memory, which waits for the fill queued before it
    sub._plan(model)
    try:
        for version in (1, 2):
            source = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=gen).cuda()
            torch.cuda.synchronize()

            def fill():
                for k, (lo, hi) in enumerate(ranges):
                    torch.cuda._sleep(20_000_000)  # ~10 ms a range: the pull is queued long before
                    pub._buffer[lo:hi].copy_(source[lo:hi])
                    pub.range_events[k].record()

            pub._publish_direct(time.monotonic() + 10.0, fill=fill, version=version)
            assert not pub.range_events[-1].query()
            assert sub.pull(model, newer_than=version - 1) == version
            plan = sub._plans[id(model)][1]
            assert ("range", len(ranges) - 1) in plan._copies
            torch.cuda.synchronize()
            want = {e.name: source[e.offset : e.offset + e.nbytes].view(torch.float32).view(e.shape)
                    for e in layout.entries}
            assert bits(model) == bits(want)
            model["a"].zero_()
            assert sub.pull(model) == version and pub.range_events[-1].query()  # landed: one copy
            torch.cuda.synchronize()
            assert bits(model) == bits(want)
    finally:
        sub.close()
        pub.close()
