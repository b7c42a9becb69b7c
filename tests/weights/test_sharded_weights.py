"""Sharded weights (Note [sharded weights] in torch_ipc/weights/sharded.py):
trainer ranks publish their shards, engine ranks of another tensor-parallel
layout pull exactly their slices, bit for bit, never mixing versions."""

import math
import signal

import distributed_helpers as dh
import pytest
import sharded_helpers as sh
import torch
import transport_helpers as th
import weights_helpers as wh

import torch_ipc
from torch_ipc.testing import PeerGroup
from torch_ipc.weights import LocalShard, Take, WeightsMismatchError
from torch_ipc.weights._shard_layout import Held, chunk_range, describe_shards, sources_of
from torch_ipc.weights._shard_plan import ShardPlan, buckets

TIMEOUT = 90.0


# ----------------------------------------------------------------------------- geometry and refusals

def test_chunk_ranges_cut_as_dtensor_shard_does():
    for size in (1, 5, 6, 7, 14):
        for world in (1, 2, 3, 4):
            ranges = [chunk_range(size, r, world) for r in range(world)]
            want = [(c[0].item(), c[-1].item() + 1) for c in torch.arange(size).chunk(world)]
            assert [r for r in ranges if r[0] < r[1]] == want


def _held(rank_boxes, shape=(6, 4), dtype=torch.float32):
    return [[Held("w", dtype, shape, box)] for box in rank_boxes]


def test_trainer_slices_must_tile_the_tensor():
    assert set(sources_of(_held([((0, 3), (0, 4)), ((3, 6), (0, 4))]))) == {"w"}
    same = sources_of(_held([((0, 6), (0, 4)), ((0, 6), (0, 4))]))  # a replica: read from rank 0 only
    assert [rank for rank, _ in same["w"]] == [0]
    with pytest.raises(ValueError, match="do not cover"):
        sources_of(_held([((0, 3), (0, 4)), ((4, 6), (0, 4))]))
    with pytest.raises(ValueError, match="overlaps"):
        sources_of(_held([((0, 4), (0, 4)), ((3, 6), (0, 4))]))
    with pytest.raises(ValueError, match="disagree"):
        sources_of([[Held("w", torch.float32, (6, 4), ((0, 3), (0, 4)))],
                    [Held("w", torch.float32, (7, 4), ((3, 7), (0, 4)))]])
    with pytest.raises(ValueError, match="outside its global shape"):
        describe_shards({"w": LocalShard(torch.zeros(3, 4), (6, 4), (4, 0))})


def test_an_engine_layout_that_does_not_fit_is_refused_with_every_problem():
    sources = sources_of(_held([((0, 3), (0, 4)), ((3, 6), (0, 4))]))
    dest = {"a": torch.zeros(3, 4), "b": torch.zeros(2, 4), "c": torch.zeros(6, 4, dtype=torch.int32),
            "d": torch.zeros(1)}
    wants = {"a": Take("w", split=(0, 0, 2)), "b": Take("w", split=(0, 1, 2)), "c": Take("w"), "d": Take("x")}
    with pytest.raises(WeightsMismatchError) as e:
        ShardPlan(sources, dest, wants)
    text = str(e.value)
    assert "shape mismatch: b" in text and "dtype mismatch: c" in text and "missing: d" in text and "a:" not in text


def test_a_piece_larger_than_a_bucket_is_cut_and_buckets_stay_bounded(monkeypatch):
    boxes = [("w", ((0, 10), (0, 100))), ("b", ((0, 3),))]
    out = buckets(boxes, {"w": 4, "b": 4}, 1024)  # rows of 400 bytes: two per bucket
    assert all(p.offset + 400 <= 1024 for b in out for p in b)
    covered = sorted((p.box[0] for b in out for p in b if p.name == "w"))
    assert covered[0][0] == 0 and covered[-1][1] == 10 and sum(hi - lo for lo, hi in covered) == 10
    # The bound on pieces, lowered so that reaching it takes milliseconds, not a minute.
    monkeypatch.setattr("torch_ipc.weights._shard_plan.MAX_PIECES", 1000)
    assert len([p for b in buckets([("w", ((0, 1000), (0, 64)))], {"w": 4}, 256) for p in b]) == 1000
    with pytest.raises(ValueError, match="more than 1000 pieces in buckets of 256 bytes"):
        buckets([("w", ((0, 1001), (0, 64)))], {"w": 4}, 256)


def test_a_pairs_buckets_grow_from_an_eighth_and_shrink_towards_the_end():
    """Note [sharded rounds]: 140 pieces of 11 KiB in buckets of at most
    256 KiB: the first bucket (packed before anything is on the wire) and the
    last (unpacked after) hold about 32 KiB, the ones between up to 256 KiB."""
    boxes = [(f"t{i}", ((0, 11 << 9),)) for i in range(140)]  # 11 KiB of bf16 each
    out = buckets(boxes, {name: 2 for name, _ in boxes}, 256 << 10)
    sizes = [sum((p.box[0][1] - p.box[0][0]) * 2 for p in b) for b in out]
    assert sizes[0] <= 32 << 10 and sizes[-1] <= 32 << 10 and max(sizes) > 200 << 10
    assert all(s <= 256 << 10 for s in sizes) and sum(sizes) == 140 * (11 << 10)
    assert sizes[:4] == sorted(sizes[:4]) and sizes[-4:] == sorted(sizes[-4:], reverse=True)


# ----------------------------------------------------------------------------- across nodes, in-memory transport

@pytest.mark.parametrize("trainers,engines,layout,bucket_bytes", [
    (2, 1, "tp", 512), (1, 2, "tp", 512), (2, 4, "tp", 512), (2, 2, "fsdp", 512), (3, 2, "fsdp", 512),
    (2, 2, "tp", 256), (2, 1, "tp", 1 << 20), (1, 2, "tp", 1 << 20)])
def test_remote_sharded_pull_over_the_in_memory_transport(trainers, engines, layout, bucket_bytes):
    """Trainer ranks and engine ranks as threads on the in-memory transport:
    every engine rank gets every version of its slices bit for bit (bf16 on
    odd engine ranks: converted in the unpack). Buckets of 1 MiB: one
    transfer per pair and version, everything packed; of 256 bytes: pieces
    cut into row ranges, a bucket of one piece received in place where the
    engine tensor is contiguous and fp32."""
    hub = th.Hub(trainers + engines)
    t_ranks, e_ranks = list(range(trainers)), list(range(trainers, trainers + engines))
    fns = [lambda i=i: sh.remote_rank(hub.transport(i), "trainer", i, t_ranks, e_ranks, layout, 4,
                                      bucket_bytes=bucket_bytes) for i in range(trainers)]
    fns += [lambda j=j: sh.remote_rank(hub.transport(trainers + j), "engine", j, t_ranks, e_ranks, layout, 4,
                                       torch.bfloat16 if j % 2 else torch.float32) for j in range(engines)]
    results = th.run_ranks(fns)
    received = [sum(r[0]) for r in results[trainers:]]
    in_place = [r[1] for r in results[trainers:]]
    per_pair = [r[2] for r in results[trainers:]]
    assert in_place[1::2] == [0] * (engines // 2)  # never into bf16 tensors
    if bucket_bytes == 1 << 20:
        assert per_pair == [[1] * trainers] * engines and in_place == [0] * engines
    elif bucket_bytes == 256:
        assert in_place[0] > 0 and max(per_pair[0]) > 4
    for j, got in enumerate(received):  # exactly the bytes of its slices, in the trainer's dtype (fp32)
        want = sum(t.numel() * 4 for t in sh.engine_expected(sh.full_model(0), j, engines).values())
        assert got <= want + 256 * 64 and got >= want


@pytest.mark.parametrize("bucket_bytes", [256, 1 << 20])
def test_remote_sharded_pull_in_the_publishers_dtype(bucket_bytes):
    """fp32 trainer shards published as bf16 (``dtype=``): the sender packs
    from the live fp32 shards, so its packs convert; a lone contiguous piece
    is never sent in place from an fp32 shard. Every engine rank (fp32 and
    bf16) gets the bf16 values bit for bit, and (256-byte buckets, with an
    engine rank on the trainers' node) so does the local snapshot."""
    hub = th.Hub(4)
    fns = [lambda i=i: sh.remote_rank(hub.transport(i), "trainer", i, [0, 1], [2, 3], "tp", 3,
                                      bucket_bytes=bucket_bytes, wire_dtype=torch.bfloat16,
                                      local_engine=bucket_bytes == 256) for i in range(2)]
    fns += [lambda j=j: sh.remote_rank(hub.transport(2 + j), "engine", j, [0, 1], [2, 3], "tp", 3,
                                       torch.bfloat16 if j else torch.float32, wire_dtype=torch.bfloat16)
            for j in range(2)]
    results = th.run_ranks(fns)
    received = [sum(r[0]) for r in results[2:]]
    for j, got in enumerate(received):  # the bytes of its slices in bf16, the wire's dtype
        want = sum(t.numel() * 2 for t in sh.engine_expected(sh.full_model(0), j, 2).values())
        assert want <= got <= want + 256 * 64


def test_pieces_of_a_pair_share_buckets_whatever_their_size(monkeypatch):
    """Three pieces of 300 KiB and a small one in buckets of 1 MiB, without
    the ramp: one bucket, one transfer (a piece of 256 KiB or more used to be
    a bucket, and a transfer, of its own: four)."""
    monkeypatch.setattr("torch_ipc.weights._shard_plan.RAMP", 1)
    boxes = [("w", ((0, 300), (0, 256))), ("x", ((0, 300), (0, 256))), ("y", ((0, 300), (0, 256))), ("b", ((0, 3),))]
    out = buckets(boxes, {"w": 4, "x": 4, "y": 4, "b": 4}, 1 << 20)
    assert [[p.name for p in b] for b in out] == [["w", "x", "y", "b"]]
    assert [p.offset for p in out[0][:3]] == [0, 300 << 10, 600 << 10]


# ----------------------------------------------------------------------------- one node, processes

def _one_node(group, trainers: int, engines: int, layout: str, dtype=torch.float32, devices=None):
    """Trainer and engine peers attached; `devices`: (trainer devices, engine devices) for GPU runs."""
    t_devices, e_devices = devices or (["cpu"] * trainers, ["cpu"] * engines)
    addresses, key = [wh.listener_address()[0] for _ in range(trainers)], b"k" * 16
    t_peers = [group.get(f"trainer{i}") for i in range(trainers)]
    e_peers = [group.get(f"engine{j}") for j in range(engines)]
    for i, peer in enumerate(t_peers):
        peer.start_call(sh.trainer_serve, addresses[i], key, i, trainers, layout, engines, t_devices[i])
    for j, peer in enumerate(e_peers):
        peer.start_call(sh.engine_attach, addresses, key, j, engines, dtype, e_devices[j])
    assert [p.result() for p in t_peers] == [1] * trainers
    for peer in e_peers:
        peer.result()
    return t_peers, e_peers


@pytest.mark.parametrize("trainers,engines,layout", [(2, 1, "tp"), (1, 2, "tp"), (2, 4, "fsdp")])
def test_one_node_sharded_pull_under_continuous_publishing(trainers, engines, layout):
    """Trainer ranks publish 12 versions, each on its own schedule; every engine
    rank pulls all the while and each pull is one version of every shard."""
    with PeerGroup(timeout=TIMEOUT) as group:
        t_peers, e_peers = _one_node(group, trainers, engines, layout)
        for peer in e_peers:
            peer.start_call(sh.engine_pull_until, 12)
        for i, peer in enumerate(t_peers):
            peer.start_call(sh.trainer_publish, 12, 0.002 * (i + 1))
        assert [p.result() for p in t_peers] == [12] * trainers
        for peer in e_peers:
            seen = peer.result()
            assert seen[-1] == 12 and seen == sorted(set(seen))
        for peer in e_peers:
            peer.call(sh.engine_close)
        for peer in t_peers:
            peer.call(sh.trainer_close)


def test_one_node_engine_of_another_dtype():
    with PeerGroup(timeout=TIMEOUT) as group:
        t_peers, e_peers = _one_node(group, 2, 2, "tp", torch.bfloat16)
        for peer in t_peers:
            peer.call(sh.trainer_publish, 3)
        for peer in e_peers:
            assert peer.call(sh.engine_pull_until, 3)[-1] == 3


# ----------------------------------------------------------------------------- across nodes, gloo

def test_remote_sharded_pull_over_gloo_tp2_to_tp2_in_bf16():
    url = dh.group_url()
    with PeerGroup(timeout=TIMEOUT) as group:
        peers = [group.get(f"rank{r}") for r in range(4)]
        roles = [("trainer", 0), ("trainer", 1), ("engine", 0), ("engine", 1)]
        for r, (peer, (role, index)) in enumerate(zip(peers, roles)):
            peer.start_call(sh.group_rank, url, r, 4, role, index, [0, 1], [2, 3], "tp", 3,
                            torch.bfloat16 if role == "engine" else torch.float32)
        results = [p.result() for p in peers]
        assert results[:2] == [3, 3] and all(sum(r[0]) > 0 for r in results[2:])


@pytest.mark.parametrize("trainers,engines,bucket_bytes", [(2, 1, 512), (1, 2, 512), (2, 4, 1 << 16)])
def test_remote_sharded_pull_over_gloo_in_buckets_under_continuous_publishing(trainers, engines, bucket_bytes):
    """Processes over gloo: TP 2->1, 1->2 and 2->4 (uneven: 10, 6, 14 rows in
    4), fused qkv and gate_up; buckets of 512 bytes: several packed buckets
    per pair and version. Trainer ranks publish 6 versions each on its own
    schedule; every engine pull is one version of every shard, bit for bit."""
    url, world = dh.group_url(), trainers + engines
    t_ranks, e_ranks = list(range(trainers)), list(range(trainers, world))
    with PeerGroup(timeout=TIMEOUT) as group:
        peers = [group.get(f"rank{r}") for r in range(world)]
        for r, peer in enumerate(peers):
            role, index = ("trainer", r) if r < trainers else ("engine", r - trainers)
            peer.start_call(sh.group_rank, url, r, world, role, index, t_ranks, e_ranks, "tp", 6,
                            bucket_bytes=bucket_bytes, pause_s=0.01)
        results = [p.result() for p in peers]
    assert results[:trainers] == [6] * trainers
    per_pair = [r[2] for r in results[trainers:]]
    if bucket_bytes == 512:
        assert max(max(p) for p in per_pair) >= 2  # several buckets per version


def _dead_engine(backend: str, devices):
    """A trainer rank, engine ranks 0 and 1 (ranks 1, 2; `devices` per rank);
    version 1 reaches both; then engine rank 1 is killed."""
    url, timeout = dh.group_url(), 3.0
    group = PeerGroup(timeout=TIMEOUT)
    peers = [group.get(name) for name in ("trainer", "engine0", "engine1")[:len(devices)]]
    for r, (peer, device) in enumerate(zip(peers, devices)):
        role, index = ("trainer", 0) if r == 0 else ("engine", r - 1)
        peer.start_call(sh.group_join, url, r, len(devices), role, index, [0], list(range(1, len(devices))), timeout,
                        backend, device)
    assert [p.result() for p in peers] == list(range(len(devices)))
    peers[0].start_call(sh.group_publish, 1)
    for peer in peers[1:]:
        peer.start_call(sh.group_pull, 1, TIMEOUT)
    for peer in peers[1:]:
        got = peer.result()
        assert got == ([1], None), got
    assert peers[0].result() == ([1], None)
    peers[-1].kill(signal.SIGKILL)
    return group, peers, timeout


def test_a_dead_engine_rank_fails_the_next_sends_in_bounded_time_over_gloo():
    """Note [a dead engine rank]: once engine rank 1 is dead, the trainer's
    publish raises BroadcastError naming it and saying the group must be
    rebuilt, within the send timeout (3 s; gloo may still buffer a version
    or two for a socket it has not seen close: up to 4 tries), and never
    hangs; the surviving engine rank's pull raises TimeoutError within its
    timeout instead of waiting forever for buckets that will not come."""
    group, peers, timeout = _dead_engine("gloo", ["cpu"] * 3)
    with group:
        peers[1].start_call(sh.group_pull, 4, timeout)
        published, error = peers[0].call(sh.group_publish, 4)
        assert error is not None, f"versions {published} went out with engine rank 1 dead"
        kind, cause, message, seconds = error
        assert kind == "BroadcastError" and cause in ("TimeoutError", "ConnectionError"), error
        assert "rank 2" in message or "ranks [1, 2]" in message or "ranks [2]" in message, message
        assert "form a new one" in message and seconds < timeout + 5, error
        pulled, error = peers[1].result()
        assert pulled == published and error is not None and error[0] == "TimeoutError", (pulled, error)
        assert "rank 0" in error[2] and "form a new one" in error[2] and error[3] < 2 * timeout + 5, error


@pytest.mark.gpus(2)
def test_a_dead_engine_rank_fails_the_next_send_in_bounded_time_over_nccl():
    """The same over NCCL (trainer on GPU 0, engine on GPU 1): a send to the
    killed engine stops completing; that publish raises BroadcastError with
    the TimeoutError of its bounded wait, instead of spinning until the
    watchdog aborts the process."""
    group, peers, timeout = _dead_engine("nccl", ["cuda:0", "cuda:1"])
    with group:  # NCCL may complete a few small sends into the dead peer's buffers before it blocks
        published, error = peers[0].call(sh.group_publish, 12)
        assert error is not None and error[0] == "BroadcastError", (published, error)
        assert "form a new one" in error[2] and error[3] < timeout + 5, error


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["tp2", "dp2xtp2"])
def test_dtensor_trainer_ranks_on_a_cpu_mesh_to_tp_engines(mesh_shape):
    """Trainer ranks hold the model as DTensors on init_device_mesh("cpu",
    mesh_shape) over gloo; three TP=3 engine ranks pull them (uneven cuts).
    tp2: Shard(0) columns, Shard(1) rows, a Replicate norm published by rank
    0 only. dp2xtp2 (FSDP x TP, sharded_helpers._placement): every weight cut
    on both dims over four ranks, embed replicated over dp, norm over both."""
    trainers = math.prod(mesh_shape)
    url, key = dh.group_url(), b"d" * 16
    addresses = [wh.listener_address()[0] for _ in range(trainers)]
    with PeerGroup(timeout=TIMEOUT) as group:
        t_peers = [group.get(f"trainer{i}") for i in range(trainers)]
        e_peers = [group.get(f"engine{j}") for j in range(3)]
        for i, peer in enumerate(t_peers):
            peer.start_call(sh.dtensor_trainer_serve, url, addresses[i], key, i, mesh_shape, 3)
        for j, peer in enumerate(e_peers):
            peer.start_call(sh.engine_attach, addresses, key, j, 3)
        assert [p.result() for p in t_peers] == [1] * trainers
        for peer in e_peers:
            peer.result()
        for peer in t_peers:
            peer.start_call(sh.dtensor_trainer_publish, 3)
        for peer in e_peers:
            assert peer.call(sh.engine_pull_until, 3)[-1] == 3
        assert [p.result() for p in t_peers] == [3] * trainers
        for peer in e_peers:
            peer.call(sh.engine_close)
        for peer in t_peers:
            peer.call(sh.dtensor_trainer_close)


# ----------------------------------------------------------------------------- GPUs

@pytest.mark.gpus(2)
@pytest.mark.parametrize("trainers,engines,dtype", [(2, 1, torch.bfloat16), (1, 2, torch.bfloat16),
                                                    (2, 1, torch.float32), (1, 2, torch.float32)])
def test_one_node_sharded_pull_on_two_gpus(trainers, engines, dtype):
    """Trainer TP=2 on GPUs 0,1 -> engine TP=1 on GPU 0 (it reads GPU 1's
    shard over the peer link), and TP=1 on GPU 0 -> TP=2 on GPUs 0,1; bf16
    engines (converted by the kernel) and fp32 ones (no conversion; the copy
    engine's path is compared with the kernel's in test_copy_engine_pieces.py),
    every version bit for bit under continuous publishing."""
    devices = ([f"cuda:{i}" for i in range(trainers)], [f"cuda:{j}" for j in range(engines)])
    with PeerGroup(timeout=TIMEOUT) as group:
        t_peers, e_peers = _one_node(group, trainers, engines, "tp", dtype, devices)
        for peer in e_peers:
            peer.start_call(sh.engine_pull_until, 8)
        for peer in t_peers:
            peer.start_call(sh.trainer_publish, 8, 0.001)
        assert [p.result() for p in t_peers] == [8] * trainers
        for peer in e_peers:
            assert peer.result()[-1] == 8
            peer.call(sh.engine_close)
        for peer in t_peers:
            peer.call(sh.trainer_close)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl,cpu:gloo"])
@pytest.mark.parametrize("local_engine", [False, True])
def test_remote_sharded_pull_over_nccl_on_two_gpus(local_engine, backend):
    """A trainer rank on GPU 0 and an engine rank on GPU 1 in one NCCL group
    (standing for two nodes): batch_isend_irecv of the intersections. With
    an engine rank attached on the trainer's node too, the snapshot is copied
    on the copy engine beside the sends (Note [sends beside the snapshot])
    and checked after every publish. A group of both backends (what
    init_process_group() makes when given none) moves the headers over
    gloo and the buckets over NCCL, and still posts ahead."""
    url = dh.group_url()
    with PeerGroup(timeout=TIMEOUT) as group:
        peers = [group.get(f"rank{r}") for r in range(2)]
        for r, (peer, role) in enumerate(zip(peers, ("trainer", "engine"))):
            peer.start_call(sh.group_rank, url, r, 2, role, 0, [0], [1], "tp", 3, torch.float32, backend, f"cuda:{r}",
                            local_engine=local_engine)
        results = [p.result() for p in peers]
        assert results[0] == 3 and sum(results[1][0]) > 0
        assert peers[0].call(sh.held, "posts_ahead") is True


def _remote_pair(hub, before: int):
    """Trainer 0 (that published `before` versions locally first), trainer 1, one engine; all set up."""
    from torch_ipc.weights import ShardedPublisher, ShardedSubscriber

    pubs = [ShardedPublisher(sh.trainer_shards(sh.full_model(0), "tp", i, 2), rank=i) for i in range(2)]
    for _ in range(before):
        pubs[0].publish()
    model = sh.engine_model(0, 1)
    fns = [lambda i=i: pubs[i].send_to(trainers=[0, 1], engines=[2], transport=hub.transport(i)) for i in range(2)]
    fns.append(lambda: ShardedSubscriber.remote(model, trainers=[0, 1], engines=[2], wants=sh.engine_wants(0, 1),
                                                transport=hub.transport(2)))
    return pubs, th.run_ranks(fns)[2]


def test_an_engine_refuses_trainer_ranks_that_send_different_versions():
    """The engine posts its first rounds' receives before it has the headers
    (Note [receives posted before the header]); refusing them leaves its
    tensors untouched: those rounds land in staging, unpacked only after the check."""
    pubs, sub = _remote_pair(th.Hub(3), before=1)
    assert sub._receiver.early
    assert [p.publish() for p in pubs] == [2, 1]  # sends are buffered on the in-memory transport
    with pytest.raises(ValueError, match="out of step"):
        sub.pull()
    assert all(not t.any() for t, _ in sub._receiver.plan.parts)


def test_a_failed_send_is_a_broadcast_error_and_later_versions_stay_local():
    from torch_ipc.weights import BroadcastError

    hub = th.Hub(3)
    pubs, sub = _remote_pair(hub, before=0)
    pubs[0]._sender.transport.batch = lambda ops: (_ for _ in ()).throw(ConnectionError("peer gone"))
    with pytest.raises(BroadcastError, match="published on this node.*peer gone"):
        pubs[0].publish()
    assert pubs[0].publish() == 2 and pubs[0]._sender is None


def test_a_trainer_without_local_engine_ranks_copies_no_snapshot_and_labels_it_truly():
    """Note [no snapshot without local engine ranks]: versions 1-2 only go to
    the remote engine; an engine rank that attaches on the trainer's node
    then finds version 0 (the snapshot holds no version yet, and says so), and
    gets version 3 bit for bit once it is published (the snapshot is copied
    again, with a local engine rank attached)."""
    from torch_ipc.weights import ShardedPublisher, ShardedSubscriber

    hub = th.Hub(2)
    shards = sh.trainer_shards(sh.full_model(0), "tp", 0, 1)
    pub = ShardedPublisher(shards, rank=0)
    model = sh.engine_model(0, 1)
    sub = th.run_ranks([lambda: pub.send_to(trainers=[0], engines=[1], transport=hub.transport(0)),
                        lambda: ShardedSubscriber.remote(model, trainers=[0], engines=[1],
                                                         wants=sh.engine_wants(0, 1), transport=hub.transport(1))])[1]
    for v in (1, 2):
        sh._set_version(shards, "tp", 0, 1, v)
        assert pub.publish() == v and sub.pull() == v
        assert not sh.mismatched(model, sh.engine_expected(sh.full_model(v), 0, 1))
    assert pub._publisher.stats["publishes"] == 2 and sh.snapshot_mismatches(pub)  # never copied
    a, b = torch_ipc.Pipe()
    pub.attach(a)
    local = ShardedSubscriber([b], wants=sh.engine_wants(0, 1), timeout=5)
    assert local.latest == 0
    sh._set_version(shards, "tp", 0, 1, 3)
    assert pub.publish() == 3 and sub.pull() == 3
    local_model = sh.engine_model(0, 1)
    assert local.pull(local_model) == 3
    assert not sh.mismatched(local_model, sh.engine_expected(sh.full_model(3), 0, 1))
    local.close()
    pub.close()


def test_an_engine_waits_for_a_started_version_within_its_timeout_only():
    """Note [a dead engine rank], on the in-memory transport: with no version
    coming, pull(timeout=0.3) raises TimeoutError; with the headers of version 1
    sent and no bucket after them (the trainers died half way), pull() raises
    TimeoutError after the receiver's 0.5 s, naming a trainer rank and saying
    the group must be rebuilt (before: it waited for ever)."""
    import time

    from torch_ipc.weights._shard_remote import MAGIC

    start = time.monotonic()
    _, sub = _remote_pair(th.Hub(3), before=0)
    with pytest.raises(TimeoutError, match="rank 0 within 0.3 s.*form a new one"):
        sub.pull(timeout=0.3)
    with pytest.raises(RuntimeError, match="stopped half way.*TimeoutError.*form a new one"):
        sub.pull(timeout=0.3)  # its headers' receives are still posted: never a second set
    pubs, sub = _remote_pair(th.Hub(3), before=0)  # a timed-out group is not used again
    sub._receiver.timeout = 0.5
    for pub in pubs:
        sender = pub._sender
        sender.transport.send(torch.tensor([MAGIC, 1, len(sender.plans[0])]), 2)
    with pytest.raises(TimeoutError, match="version 1 was not exchanged with rank [01] within 0.5 s.*form a new one"):
        sub.pull()
    assert time.monotonic() - start < 5 and sub.version == 0


def test_scalars_and_whole_tensors_are_taken_as_they_are():
    sources = sources_of([[Held("step", torch.int64, (), ()), Held("b", torch.float32, (4,), ((0, 4),))]])
    plan = ShardPlan(sources, {"step": torch.zeros((), dtype=torch.int64), "b": torch.zeros(4)}, {})
    assert sorted(c.name for c in plan.copies) == ["b", "step"]


def test_an_engine_wanting_a_slice_twice_is_refused_by_the_trainer():
    from torch_ipc.weights._shard_layout import wants_from_message

    globals_ = {"w": Held("w", torch.float32, (6, 4), ((0, 6), (0, 4)))}
    message = {"kind": "torch_ipc.weights.wants/1", "tensors": [["w", [[0, 3], [0, 4]]]] * 2}
    with pytest.raises(ValueError, match="twice"):
        wants_from_message(message, globals_)
    with pytest.raises(ValueError, match="outside"):
        wants_from_message({**message, "tensors": [["w", [[0, 7], [0, 4]]]]}, globals_)


def test_a_remote_engine_that_does_not_fit_is_refused_and_the_group_stays_in_step():
    """The engine raises WeightsMismatchError after telling the trainers it
    wants nothing, so their send_to() returns and they publish on."""
    from torch_ipc.weights import ShardedPublisher, ShardedSubscriber

    hub = th.Hub(3)
    pubs = [ShardedPublisher(sh.trainer_shards(sh.full_model(0), "tp", i, 2), rank=i) for i in range(2)]
    model = dict(sh.engine_model(0, 1), norm=torch.zeros(7))
    fns = [lambda i=i: pubs[i].send_to(trainers=[0, 1], engines=[2], transport=hub.transport(i)) for i in range(2)]
    fns.append(lambda: ShardedSubscriber.remote(model, trainers=[0, 1], engines=[2], wants=sh.engine_wants(0, 1),
                                                transport=hub.transport(2)))
    with pytest.raises(WeightsMismatchError, match="shape mismatch: norm"):
        th.run_ranks(fns)
    assert [p.publish() for p in pubs] == [1, 1]
