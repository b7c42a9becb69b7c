"""torch_ipc.weights on CPU tensors (the same API as on GPUs): validation,
name maps, dtype conversion, bucketed == direct, torn updates, several
subscribers, publisher restart. The GPU twin is test_weights_cuda.py."""

import multiprocessing as mp
import signal
import threading

import ipc_test_utils as u
import pytest
import torch
from weights_helpers import SHAPES, bits, listener_address, make_weights, pair

from torch_ipc.weights import Publisher, PublisherGoneError, Subscriber, WeightsMismatchError


def test_pull_copies_the_published_version():
    weights = make_weights(seed=1)
    pub, sub = pair(weights)
    model = make_weights(fill=0.0)
    assert pub.publish() == 1
    assert sub.pull(into=model) == 1
    assert bits(model) == bits(weights)
    for t in weights.values():  # training goes on: the next pull sees the change
        t.add_(1)
    assert pub.publish() == 2
    assert sub.pull(model, newer_than=1) == 2
    assert bits(model) == bits(weights)
    assert sub.stats["path"] == "foreach" and sub.stats["launches"] == 1


def test_attach_sends_one_message_and_publish_none():
    a, b = mp.Pipe()
    pub = Publisher(make_weights(seed=19))
    pub.attach(a)
    assert b.poll(0)
    sub = Subscriber(b, timeout=5.0)
    for _ in range(3):
        pub.publish()
    assert not b.poll(0)  # versions travel through the control block, not the connection
    assert sub.latest == 3


def test_attach_through_a_queue_and_reattach_from_it():
    queue = mp.get_context("spawn").Queue()
    first = make_weights(seed=20)
    pub = Publisher(first)
    pub.attach(queue)
    sub = Subscriber(queue, timeout=5.0)
    pub.publish()
    model = make_weights(fill=0.0)
    sub.pull(model)
    assert bits(model) == bits(first)
    pub.close()  # the trainer stops; a new one puts its message on the same queue
    with pytest.raises(PublisherGoneError):
        sub.pull(model)
    assert bits(model) == bits(first)
    second = make_weights(seed=21)
    restarted = Publisher(second)
    restarted.attach(queue)
    restarted.publish()
    import time

    deadline = time.monotonic() + 5
    while True:  # the queue's feeder thread delivers the message shortly
        try:
            assert sub.pull(model) == 1
            break
        except PublisherGoneError:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert bits(model) == bits(second) and sub.stats["reattached"] == 1


def test_publish_snapshots_so_later_writes_are_not_seen():
    weights = make_weights(seed=2)
    pub, sub = pair(weights)
    pub.publish()
    expected = bits(weights)
    for t in weights.values():
        t.fill_(123.0)
    model = make_weights(fill=0.0)
    sub.pull(model)
    assert bits(model) == expected


def test_pull_into_a_module():
    src = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    dst = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    pub, sub = pair(src)
    pub.publish()
    sub.pull(into=dst)
    assert bits(dst.state_dict()) == bits(src.state_dict())


def test_missing_extra_and_shape_mismatch_in_one_error_before_any_copy():
    weights = make_weights(seed=3)
    pub, sub = pair(weights)
    pub.publish()
    model = make_weights(fill=0.0)
    del model["head.bias"]                            # extra on the publisher's side
    model["unknown.weight"] = torch.zeros(3)          # missing
    model["embed.weight"] = torch.zeros(32, 16)       # shape mismatch
    before = bits(model)
    with pytest.raises(WeightsMismatchError) as info:
        sub.pull(model)
    message = str(info.value)
    assert "missing: unknown.weight" in message
    assert "extra (published, not in the model): head.bias" in message
    assert "shape mismatch: embed.weight: model (32, 16), published embed.weight (33, 16)" in message
    assert len(info.value.problems) == 3
    assert bits(model) == before  # nothing copied
    assert sub.version == 0


def test_dtype_mismatch_is_listed():
    pub, sub = pair({"w": torch.ones(4)})
    pub.publish()
    with pytest.raises(WeightsMismatchError, match="dtype mismatch: w"):
        sub.pull({"w": torch.zeros(4, dtype=torch.int32)})


def test_strict_false_ignores_extra():
    weights = make_weights(seed=4)
    pub, sub = pair(weights, strict=False)
    pub.publish()
    model = {"embed.weight": torch.zeros(33, 16)}
    sub.pull(model)
    assert torch.equal(model["embed.weight"], weights["embed.weight"])


def test_dtype_conversion_matches_torch():
    weights = make_weights(seed=5)
    weights["embed.weight"][0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    pub, sub = pair(weights)
    pub.publish()
    model = make_weights(dtype=torch.bfloat16, fill=0.0)
    sub.pull(model)
    assert bits(model) == bits({n: t.to(torch.bfloat16) for n, t in weights.items()})


def test_publisher_dtype_converts_at_publish():
    weights = make_weights(seed=6)
    pub, sub = pair(weights, dtype=torch.bfloat16)
    pub.publish()
    model = make_weights(dtype=torch.bfloat16, fill=0.0)
    sub.pull(model)
    assert bits(model) == bits({n: t.to(torch.bfloat16) for n, t in weights.items()})


def test_name_map_fuses_qkv_and_renames():
    weights = make_weights(seed=7)
    name_map = {"block.qkv.weight": ("block.q.weight", "block.k.weight", "block.v.weight"), "norm": "block.norm"}
    pub, sub = pair(weights, name_map=name_map)
    pub.publish()
    model = {n: torch.zeros(s) for n, s in SHAPES.items() if not n.startswith("block.")}
    model["block.qkv.weight"] = torch.zeros(32, 16)
    model["norm"] = torch.zeros(16)
    sub.pull(model)
    fused = torch.cat([weights["block.q.weight"], weights["block.k.weight"], weights["block.v.weight"]])
    assert torch.equal(model["block.qkv.weight"], fused)
    assert torch.equal(model["norm"], weights["block.norm"])
    assert torch.equal(model["embed.weight"], weights["embed.weight"])


def test_name_map_shape_mismatch_of_a_concatenation():
    pub, sub = pair(make_weights(seed=8), strict=False,
                    name_map={"qkv": ("block.q.weight", "block.k.weight")})
    pub.publish()
    with pytest.raises(WeightsMismatchError, match=r"qkv: model \(32, 16\).*concatenated on dim 0"):
        sub.pull({"qkv": torch.zeros(32, 16)})


def test_transform_hook():
    weights = make_weights(seed=9)
    pub, sub = pair(weights, strict=False,
                    transforms={"norm_t": ("block.norm", lambda t: t.flip(0) * 2)})
    pub.publish()
    model = {"norm_t": torch.zeros(16)}
    sub.pull(model)
    assert torch.equal(model["norm_t"], weights["block.norm"].flip(0) * 2)
    assert sub.stats["transforms"] == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_view_is_zero_copy_of_the_newest_version(device):
    weights = make_weights(device, seed=10)
    pub, sub = pair(weights)
    pub.publish()
    with sub.view() as views:
        assert bits(views) == bits(weights)
        first = views["embed.weight"].data_ptr()
    for t in weights.values():
        t.add_(1)
    pub.publish()
    with sub.view(newer_than=1) as views:
        assert views["embed.weight"].data_ptr() == first  # the same shared memory, no copy
        assert bits(views) == bits(weights)


def test_publish_waits_for_an_open_view():
    weights = {"w": torch.zeros(1000)}
    pub, sub = pair(weights)
    pub.publish()
    published = threading.Event()
    with sub.view() as views:
        weights["w"].fill_(1)
        t = threading.Thread(target=lambda: (pub.publish(), published.set()))
        t.start()
        assert not published.wait(0.2)  # publish cannot overwrite what the view shows
        assert bool((views["w"] == 0).all())
    t.join(5)
    assert published.is_set() and sub.latest == 2


def test_pull_waits_for_the_first_version_and_times_out():
    pub, sub = pair({"w": torch.zeros(4)})
    with pytest.raises(TimeoutError):
        sub.pull({"w": torch.zeros(4)}, timeout=0.1)
    pub.publish()
    assert sub.pull({"w": torch.zeros(4)}, timeout=0.1) == 1
    with pytest.raises(TimeoutError):
        sub.pull({"w": torch.zeros(4)}, newer_than=1, timeout=0.1)


@pytest.mark.parametrize("bucket_bytes", [256, 1024, 1 << 20])
def test_bucketed_equals_direct(bucket_bytes):
    weights = make_weights(seed=11)
    direct_pub, direct_sub = pair(weights)
    bucket_pub, bucket_sub = pair(weights, bucket_bytes=bucket_bytes)
    assert bucket_pub.layout.n_buckets >= (2 if bucket_bytes < 4096 else 1)
    for version in (1, 2):
        direct_pub.publish()
        direct_model, bucket_model = make_weights(fill=0.0), make_weights(fill=0.0)
        direct_sub.pull(direct_model, newer_than=version - 1)
        pulled = []
        t = threading.Thread(target=lambda: pulled.append(bucket_sub.pull(bucket_model)))
        t.start()
        assert bucket_pub.publish() == version  # returns once the subscriber took every bucket
        t.join(10)
        assert pulled == [version]
        assert bits(bucket_model) == bits(direct_model) == bits(weights)
        for w in weights.values():
            w.mul_(-1)


def test_bucketed_publish_without_subscribers_and_view_refused():
    pub, sub = pair({"w": torch.arange(100.0)}, bucket_bytes=256)
    sub.close()
    assert pub.publish() == 1
    a, b = mp.Pipe()
    pub.attach(a)
    sub = Subscriber(b, timeout=5.0)
    with pytest.raises(RuntimeError, match="direct-mode"):
        with sub.view():
            pass


def test_bucketed_needs_contiguous_tensors():
    with pytest.raises(ValueError, match="contiguous"):
        Publisher({"w": torch.zeros(4, 4).t()}, bucket_bytes=256)


def test_bad_arguments():
    with pytest.raises(TypeError):
        Publisher([torch.zeros(1)])
    with pytest.raises(ValueError, match="nothing to publish"):
        Publisher({})
    with pytest.raises(ValueError, match="max_subscribers"):
        Publisher({"w": torch.zeros(1)}, max_subscribers=0)
    with pytest.raises(ValueError, match="multiple of 256"):
        Publisher({"w": torch.zeros(1)}, bucket_bytes=100)
    a, b = mp.Pipe()
    a.send("not a share")
    with pytest.raises(TypeError, match="attach"):
        Subscriber(b, timeout=1.0)
    with pytest.raises(TimeoutError):
        Subscriber(mp.Pipe()[1], timeout=0.05)


def test_slot_limit_and_reuse_after_close():
    pub = Publisher({"w": torch.zeros(1)}, max_subscribers=1)
    a, b = mp.Pipe()
    pub.attach(a)
    sub = Subscriber(b, timeout=1.0)
    c, d = mp.Pipe()
    with pytest.raises(RuntimeError, match="slots are taken"):
        pub.attach(c)
    sub.close()
    pub.attach(c)
    Subscriber(d, timeout=1.0).close()


# ----------------------------------------------------------------------------- across processes

def test_two_subscribers_in_other_processes(ipc_peers):
    import weights_helpers as h

    address, key = listener_address()
    pub = ipc_peers.get("pub")
    pub.start_call(h.pub_serve, address, key, n_subscribers=2, seed=12)
    subs = [ipc_peers.get("sub0"), ipc_peers.get("sub1")]
    for p in subs:
        p.call(h.sub_attach, address, key)
    assert pub.result() == 1
    for p in subs:
        version, pulled, stats = p.call(h.sub_pull)
        assert version == 1 and pulled == bits(make_weights(seed=12))
    assert pub.call(h.pub_publish) == (2, 2)
    for p in subs:
        p.call(h.sub_close)
    pub.call(h.pub_close)


def test_no_torn_update_while_the_publisher_hammers(ipc_peers):
    import weights_helpers as h

    address, key = listener_address()
    pub_peer, sub_peer = ipc_peers.get("pub"), ipc_peers.get("sub0")
    pub_peer.start_call(h.pub_serve, address, key, fill=1.0, big=1 << 20)  # copies long enough to overlap
    sub_peer.call(h.sub_attach, address, key, big=1 << 20)
    assert pub_peer.result() == 1
    pub_peer.start_call(h.pub_hammer, 100)
    seen = sub_peer.call(h.sub_pull_until, 101)
    assert pub_peer.result() == 101
    assert seen[-1] == 101 and seen == sorted(set(seen))
    sub_peer.call(h.sub_close)


def test_publisher_restart(ipc_peer, ipc_peers):
    """The publisher is killed; pulls fail clearly and keep the model; a new
    publisher attaches and the next pull gets its weights."""
    import weights_helpers as h

    address, key = listener_address()
    ipc_peer.start_call(h.pub_serve, address, key, seed=13)
    sub = Subscriber(h.Connector(address, key), timeout=10.0)
    assert ipc_peer.result() == 1
    model = make_weights(fill=0.0)
    assert sub.pull(model) == 1
    assert bits(model) == bits(make_weights(seed=13))
    ipc_peer.kill(signal.SIGKILL)
    ipc_peer.close()
    assert not sub.publisher_alive()
    with pytest.raises(PublisherGoneError, match="exited.*keeps version 1"):
        sub.pull(model)
    assert bits(model) == bits(make_weights(seed=13))
    second = ipc_peers.get("pub2")
    second.start_call(h.pub_serve, address, key, seed=14)
    import time

    deadline = time.monotonic() + 10
    while True:  # the Connector reconnects once the new publisher listens
        try:
            version = sub.pull(model)
            break
        except PublisherGoneError:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert second.result() == 1 and version == 1
    assert bits(model) == bits(make_weights(seed=14))
    assert sub.stats["reattached"] == 1
    sub.close()


def test_publisher_dying_while_it_writes_fails_the_pull_fast(ipc_peer):
    import time

    import weights_helpers as h

    address, key = listener_address()
    ipc_peer.start_call(h.pub_serve, address, key, seed=16)
    sub = Subscriber(h.Connector(address, key), timeout=30.0)
    assert ipc_peer.result() == 1
    model = make_weights(fill=0.0)
    sub.pull(model)
    ipc_peer.call(h.pub_start_writing)
    raised = []

    def pull():
        try:
            sub.pull(model, newer_than=1)
        except Exception as e:
            raised.append(e)

    puller = threading.Thread(target=pull)
    puller.start()
    puller.join(0.2)
    assert puller.is_alive()  # waiting for the publish to finish
    start = time.monotonic()
    ipc_peer.kill(signal.SIGKILL)
    puller.join(10)
    assert time.monotonic() - start < 5  # noticed, not timed out (30 s)
    assert len(raised) == 1 and isinstance(raised[0], PublisherGoneError), raised
    assert "keeps version 1" in str(raised[0])
    assert bits(model) == bits(make_weights(seed=16))
    ipc_peer.close()
    sub.close()


def test_dead_subscriber_does_not_block_publish(ipc_peer, ipc_peers):
    import weights_helpers as h

    address, key = listener_address()
    pub = ipc_peers.get("pub")
    pub.start_call(h.pub_serve, address, key, bucket_bytes=256, timeout=10.0, publish=False)
    ipc_peer.call(h.sub_attach, address, key)
    assert pub.result() == 0
    ipc_peer.start_call(h.sub_pull)
    assert pub.call(h.pub_publish) == (1, 1)  # returns once the subscriber took every bucket
    version, pulled, _ = ipc_peer.result()
    assert version == 1 and pulled == bits(make_weights())
    ipc_peer.kill(signal.SIGKILL)
    ipc_peer.close()
    assert pub.call(h.pub_publish) == (2, 0)  # the dead member is reaped, not waited for
    pub.call(h.pub_close)



# ----------------------------------------------------------------------------- the kernels' item tables

def test_item_tables_cover_every_byte_once():
    from torch_ipc import _C
    from torch_ipc.weights._copy import item_table

    chunk = _C.batched_item_bytes
    gen = torch.Generator().manual_seed(0)
    flat = torch.randint(0, 256, (3 * chunk + 4096,), dtype=torch.uint8, generator=gen)
    out = torch.zeros_like(flat)
    # mixed dtypes (bytes are bytes), odd sizes, starts off 16-byte alignment, one larger than an item
    spans = [(0, 12, torch.float32), (13, 13 + 2 * chunk + 7, torch.uint8),
             (2 * chunk + 40, 2 * chunk + 40 + 8 * 999, torch.int64), (3 * chunk, 3 * chunk + 4000, torch.bfloat16)]
    pairs = [(flat[a:b].view(dt), out[a:b].view(dt)) for a, b, dt in spans]
    table = item_table(pairs, 0, torch.device("cpu"))
    assert int(table[:, 2].max()) <= chunk and int(table[:, 2].sum()) == sum(b - a for a, b, _ in spans)
    u.run_table_on_cpu(table, 0)
    for a, b, _ in spans:
        assert torch.equal(out[a:b], flat[a:b])
    assert not out[12:13].any() and not out[3 * chunk + 4000 :].any()  # nothing outside the pairs


@pytest.mark.parametrize("kind", [0, 1])
def test_a_copy_beside_transfers_is_cut_into_about_that_many_items(kind):
    """Note [copies beside transfers]: ``items`` makes the items larger (a
    few tens of blocks, not one per ITEM_BYTES), never smaller, and the
    table still covers every element once, as torch copies them."""
    from torch_ipc import _C
    from torch_ipc.weights._copy import item_table

    n = _C.batched_item_bytes * 10 + 12345  # elements: 40 items of fp32 by default, 10 of bytes per ITEM
    src = torch.randn(n + 1)[1:]  # off 16-byte alignment
    dst = torch.zeros(n, dtype=torch.bfloat16 if kind else torch.float32)
    default = item_table([(src, dst)], kind, torch.device("cpu"))
    table = item_table([(src, dst)], kind, torch.device("cpu"), items=8)
    assert default.shape[0] > 32 and 8 <= table.shape[0] <= 9, (default.shape, table.shape)
    assert item_table([(src, dst)], kind, torch.device("cpu"), items=1 << 20).shape == default.shape
    u.run_table_on_cpu(table, kind)
    assert torch.equal(dst, src.to(dst.dtype))


def test_conversion_item_tables_match_torch():
    from torch_ipc import _C
    from torch_ipc.weights._copy import item_table

    n = _C.batched_item_bytes // 4 * 2 + 5  # three items, the last partial
    src = torch.randn(n + 1)[1:]  # off 16-byte alignment
    src[:3] = torch.tensor([float("nan"), float("inf"), 1e-40])
    dst = torch.zeros(n, dtype=torch.bfloat16)
    small_src, small_dst = torch.randn(7), torch.zeros(7, dtype=torch.bfloat16)
    table = item_table([(src, dst), (small_src, small_dst)], 1, torch.device("cpu"))
    assert table.shape[0] == 4
    u.run_table_on_cpu(table, 1)
    assert torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(small_dst.view(torch.int16), small_src.to(torch.bfloat16).view(torch.int16))


def test_shared_counters_check_their_arguments():
    from torch_ipc import _C

    block = torch.zeros(4, dtype=torch.int64)
    _C.counter_store(block, 3, 7)
    assert _C.counter_load(block, 3) == 7
    assert _C.counter_compare_exchange(block, 3, 6, 9) == 7 and int(block[3]) == 7
    assert _C.counter_compare_exchange(block, 3, 7, 9) == 7 and int(block[3]) == 9
    with pytest.raises(IndexError):
        _C.counter_load(block, 4)
    with pytest.raises(IndexError):
        _C.counter_load(block, -1)
    with pytest.raises(ValueError):
        _C.counter_load(torch.zeros(4, dtype=torch.int32), 0)
    with pytest.raises(ValueError):
        _C.counter_load(torch.zeros(8, dtype=torch.int64)[::2], 0)


def test_dead_subscriber_is_forgotten_by_a_direct_publish(ipc_peer, ipc_peers):
    import weights_helpers as h

    address, key = listener_address()
    pub = ipc_peers.get("pub")
    pub.start_call(h.pub_serve, address, key)
    ipc_peer.call(h.sub_attach, address, key)
    assert pub.result() == 1
    assert pub.call(h.pub_publish) == (2, 1)
    ipc_peer.kill(signal.SIGKILL)
    ipc_peer.close()
    assert pub.call(h.pub_publish) == (3, 0)
    pub.call(h.pub_close)


@pytest.mark.parametrize("case", ["columns", "strided source", "whole", "3-d block"])
def test_byte_runs_cover_a_strided_copy_exactly(case):
    """The runs a strided copy becomes for the copy kernel, replayed with
    memmove on CPU tensors: the same bytes as torch's copy_, nothing else written."""
    import ctypes

    from torch_ipc.weights._copy import MIN_RUN_BYTES, byte_runs

    big = torch.arange(4 * 64 * 512, dtype=torch.float32).view(4, 64, 512)
    where = {"columns": lambda d: d[:, 256:], "strided source": lambda d: d, "whole": lambda d: d,
             "3-d block": lambda d: d[:, 4:36, 32:288]}[case]
    src, dst_full = {
        "columns": (big[0, :, :256].contiguous(), torch.zeros(64, 512)),
        "strided source": (big[1, :, 128:], torch.zeros(64, 384)),
        "whole": (big[2], torch.zeros(64, 512)),
        "3-d block": (big[:, 8:40, 64:320], torch.zeros(4, 40, 512)),
    }[case]
    dst = where(dst_full)
    runs = byte_runs(src, dst)
    assert runs is not None
    src_at, dst_at, nbytes = runs
    assert nbytes >= MIN_RUN_BYTES and len(src_at) == len(dst_at) == src.numel() * 4 // nbytes
    for s, d in zip(src_at.tolist(), dst_at.tolist()):
        ctypes.memmove(d, s, nbytes)
    want = torch.zeros_like(dst_full)
    where(want).copy_(src)
    assert torch.equal(dst_full, want)


def test_byte_runs_refuse_short_runs_and_overlapping_destinations():
    from torch_ipc.weights._copy import byte_runs

    src = torch.zeros(64, 8)
    assert byte_runs(src, torch.zeros(64, 16)[:, :8]) is None  # 32-byte runs
    assert byte_runs(torch.zeros(4, 256), torch.zeros(1, 256).expand(4, 256)) is None
