"""A trainer's publish with relays (Note [pipelined publish and broadcast] in
torch_ipc/weights/publisher.py, Note [posting a version ahead] in
_broadcast.py): the snapshot is copied range by range beside the broadcast,
must stay the same bytes a plain publish writes, and its waits are bounded
and interruptible."""

import multiprocessing as mp
import re
import time

import distributed_helpers as dh
import pytest
import torch
import transport_helpers as th
import weights_helpers as wh

from torch_ipc.testing import PeerGroup


def _odd_weights(gen: torch.Generator):
    """Tensors that cut bucket edges anywhere: odd sizes, a transposed (not
    contiguous) one, a sliced one, a scalar, an empty one."""
    wide = torch.randn(37, 50, generator=gen)
    return {"a": torch.randn(1000, generator=gen), "t": torch.randn(90, 33, generator=gen).t(),
            "s": torch.randn(()), "e": torch.empty(0), "cols": wide[:, 3:41], "b": torch.randn(3, 77, generator=gen),
            "big": torch.randn(5000, generator=gen)}


def _refill(weights, gen: torch.Generator) -> None:
    for t in weights.values():
        t.copy_(torch.randn(t.shape, generator=gen))


def _snapshot(pub) -> bytes:
    """The bytes of every entry of a publisher's snapshot (not the padding between them)."""
    return b"".join(pub._buffer[e.offset : e.offset + e.nbytes].numpy().tobytes() for e in pub.layout.entries)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_publish_with_relays_writes_the_same_snapshot_as_without(dtype):
    """Buckets of 512 bytes: every tensor spans several ranges or shares one;
    the trainer's snapshot, the relay's and a subscriber's pull equal a plain
    publisher's, bit for bit, version after version (with a conversion too)."""
    from torch_ipc.weights import Publisher, Relay, Subscriber

    gen = torch.Generator().manual_seed(4)
    weights = _odd_weights(gen)
    plain, pub = Publisher(weights, dtype=dtype), Publisher(weights, dtype=dtype)
    hub = th.Hub(2)
    pub.broadcast_to(transport=hub.transport(0), bucket_bytes=512)
    relay = Relay(transport=hub.transport(1), src=0)
    a, b = mp.Pipe()
    relay.attach(a)
    sub = Subscriber(b, timeout=10.0)
    model = {n: torch.zeros(t.shape, dtype=dtype or t.dtype) for n, t in weights.items()}
    try:
        assert len(pub._broadcaster.ranges) > 20
        for version in range(1, 4):
            _refill(weights, gen)
            assert plain.publish() == pub.publish() == version
            assert relay.receive() == version
            assert _snapshot(pub) == _snapshot(plain) == _snapshot(relay._publisher)
            assert sub.pull(model, newer_than=version - 1) == version
            assert wh.bits(model) == wh.bits({n: t.to(dtype or t.dtype) for n, t in weights.items()})
        assert pub.stats["publishes"] == 3
    finally:
        for closing in (sub, relay, pub, plain):
            closing.close()


def test_a_relay_joining_late_gets_the_current_version_then_pipelined_ones_in_other_buckets():
    """Three versions to relay A in buckets of 512 bytes; then a new group
    (buckets of 768) where A rejoins and B joins: B starts from version 3,
    and version 4, copied in the new ranges, reaches both bit for bit."""
    from torch_ipc.weights import Publisher, Relay

    gen = torch.Generator().manual_seed(6)
    weights = _odd_weights(gen)
    pub, plain = Publisher(weights), Publisher(weights)
    first = th.Hub(2)
    pub.broadcast_to(transport=first.transport(0), bucket_bytes=512)
    a = Relay(transport=first.transport(1), src=0)
    relays = [a]
    try:
        for version in range(1, 4):
            _refill(weights, gen)
            pub.publish()
            assert a.receive() == version
        second = th.Hub(3)
        pub.broadcast_to(transport=second.transport(0), bucket_bytes=768)  # sends version 3 (buffered)
        a.rejoin(transport=second.transport(1), src=0)
        b = Relay(transport=second.transport(2), src=0)
        relays.append(b)
        assert a.receive() == b.receive() == 3 and _snapshot(b._publisher) == _snapshot(pub)
        _refill(weights, gen)
        assert pub.publish() == plain.publish() + 3 == 4
        assert a.receive() == b.receive() == 4
        assert _snapshot(a._publisher) == _snapshot(b._publisher) == _snapshot(pub) == _snapshot(plain)
    finally:
        for closing in (*relays, pub, plain):
            closing.close()


def test_a_relay_that_stops_receiving_fails_the_publish_within_the_timeout():
    """A relay process alive but no longer receiving (gloo, 32 MB, more than
    the sockets buffer): publish() publishes here, then raises BroadcastError
    once the publisher's timeout (2 s) passed; main waited for the group's
    own timeout (30 s here) and raised gloo's error."""
    url, (address, key) = dh.group_url(), wh.listener_address()
    with PeerGroup(timeout=60.0) as group:
        trainer, relay = group.get("trainer"), group.get("relay")
        trainer.start_call(dh.trainer_start, url, 2, big=8 << 20, bucket_bytes=4 << 20, timeout=2.0)
        relay.call(dh.relay_start, url, 1, 2, address, key)
        assert relay.call(dh.relay_receive) == 1  # the version sent on joining; then it stops
        trainer.result()
        seconds, version, message = trainer.call(dh.trainer_publish_failing)
        assert version == 2 and "published on this node" in message and "TimeoutError" in message, message
        assert 1.5 < seconds < 15.0, seconds


def test_ctrl_c_ends_a_publish_waiting_for_a_stuck_relay():
    """The same stuck relay, a publisher's timeout of 60 s: a real SIGINT
    0.5 s into publish() raises KeyboardInterrupt at once (main's wait was
    in C++, deaf to it until gloo's own timeout, 30 s here)."""
    url, (address, key) = dh.group_url(), wh.listener_address()
    with PeerGroup(timeout=60.0) as group:
        trainer, relay = group.get("trainer"), group.get("relay")
        trainer.start_call(dh.trainer_start, url, 2, big=8 << 20, bucket_bytes=4 << 20, timeout=60.0)
        relay.call(dh.relay_start, url, 1, 2, address, key)
        assert relay.call(dh.relay_receive) == 1
        trainer.result()
        start = time.monotonic()
        assert trainer.call(dh.trainer_publish_interrupted, 0.5) < 5.0
        assert time.monotonic() - start < 10.0


@pytest.mark.parametrize("n", [1, 12, 64, 65, 130, 1000])
def test_a_relays_events_cover_its_buckets_in_order_and_stay_few(n):
    """Note [pulling a relayed version as it lands]: at most MAX_RANGE_EVENTS
    events, each the union of consecutive buckets, together the whole snapshot."""
    from torch_ipc.weights._broadcast import MAX_RANGE_EVENTS, buckets, event_ranges

    ranges = buckets(n * 512 - 256, 512)
    per, events = event_ranges(ranges)
    assert len(events) <= MAX_RANGE_EVENTS and len(events) == -(-n // per)
    assert events[0][0] == 0 and events[-1][1] == ranges[-1][1]
    assert all(a[1] == b[0] for a, b in zip(events, events[1:]))
    assert all(events[k // per][0] <= lo and hi <= events[k // per][1] for k, (lo, hi) in enumerate(ranges))


def test_a_streaming_relays_subscribers_pull_every_version_bit_for_bit_while_it_lands():
    """A streaming relay on the CPU (Relay(stream=True))
    with 64 buckets a version, a subscriber pulling continuously: every
    version it pulls is the trainer's bit for bit, some copied while they
    landed; a bf16 subscriber converts as usual."""
    url, last = dh.group_url(), 12
    with PeerGroup(timeout=90.0) as group:
        trainer, relay = group.get("trainer"), group.get("relay")
        (address, key) = wh.listener_address()
        trainer.start_call(dh.trainer_start, url, 2, big=64 * 512 - 100, bucket_bytes=512)
        relay.call(dh.relay_start, url, 1, 2, address, key, stream=True)
        relay.start_call(dh.relay_serve)
        expected = trainer.result()
        subs = []
        for i, dtype in enumerate((torch.float32, torch.bfloat16)):
            peer = group.get(f"sub{i}")
            peer.call(wh.sub_attach, address, key, dtype=dtype, big=64 * 512 - 100)
            peer.start_call(dh.sub_pull_streams, last)
            subs.append((peer, str(dtype).split(".")[1]))
        expected.update(trainer.call(dh.trainer_publish, last - 1, seed=3))
        streamed = 0
        for peer, name in subs:
            seen, n = peer.result()
            streamed += n
            assert max(seen) == last
            for version, pulled in seen.items():
                assert pulled == expected[version][name], (name, version)
        assert streamed > 0, "no pull met a version while it landed"
        trainer.call(dh.trainer_close)
        assert relay.result() == last


def test_a_version_cut_off_on_its_way_fails_a_streaming_pull_with_broadcast_error():
    """The trainer sends version 2's header and 4 of its 45 buckets, then is
    killed: a subscriber that was copying it gets BroadcastError naming the
    cut, and the relay's serve() fails keeping version 1."""
    url, (address, key) = dh.group_url(), wh.listener_address()
    with PeerGroup(timeout=90.0) as group:
        trainer, relay, sub = group.get("trainer"), group.get("relay"), group.get("sub")
        trainer.start_call(dh.trainer_start, url, 2, big=20 * 512, bucket_bytes=512)
        relay.call(dh.relay_start, url, 1, 2, address, key, stream=True)
        relay.start_call(dh.relay_serve)
        expected = trainer.result()
        sub.call(wh.sub_attach, address, key, big=20 * 512)
        assert sub.call(dh.sub_pull_versions, 1)[1] == expected[1]["float32"]
        sub.start_call(dh.sub_pull_cut_off, 1)
        trainer.call(dh.trainer_send_part, 2, 4)
        time.sleep(1.0)  # the subscriber copies what came meanwhile
        trainer.kill()
        message = sub.result()
        cut = re.search(r"version 2 was cut off on its way to this node after (\d+) of 45 pieces", message)
        assert cut and int(cut.group(1)) <= 4, message  # gloo may not deliver the last ones sent
        assert relay.result() == ("broken", 1)


@pytest.mark.cuda
def test_a_streaming_relay_on_a_gpu_gives_a_pulling_subscriber_every_version_bit_for_bit():
    """One GPU, the in-memory transport, threads for the two sides: a
    streaming relay of CUDA weights (~2000 buckets a version, events shared
    by 32) and a subscriber pulling all the while; every version pulled is
    the trainer's bit for bit, some copied while they landed."""
    from torch_ipc.weights import Publisher, Relay, Subscriber

    gen, last = torch.Generator().manual_seed(8), 5
    weights = {n: t.cuda() for n, t in dict(_odd_weights(gen), huge=torch.randn(1 << 18, generator=gen)).items()}
    pub = Publisher(weights)
    hub = th.Hub(2)
    pub.broadcast_to(transport=hub.transport(0), bucket_bytes=512)
    relay = Relay(transport=hub.transport(1), src=0, stream=True)
    a, b = mp.Pipe()
    relay.attach(a)
    sub = Subscriber(b, timeout=60.0)
    model = {n: torch.zeros(t.shape, device="cuda") for n, t in weights.items()}
    expected = {}

    def publish_and_relay():
        for version in range(1, last + 1):
            for t in weights.values():
                t.copy_(torch.randn(t.shape, generator=gen))
            expected[version] = wh.bits(weights)
            assert pub.publish() == version and relay.receive() == version

    def pull_all():
        seen, version = {}, 0
        while version < last:
            version = sub.pull(model, newer_than=version, timeout=60.0)
            torch.cuda.synchronize()
            seen[version] = wh.bits(model)
        return seen

    try:
        assert len(relay._publisher.range_events) <= 64 < len(pub._broadcaster.ranges)
        _, seen = th.run_ranks([publish_and_relay, pull_all], timeout=120.0)
        assert max(seen) == last and all(seen[v] == expected[v] for v in seen)
        assert sub.stats["streamed"] > 0
    finally:
        for closing in (sub, relay, pub):
            closing.close()
