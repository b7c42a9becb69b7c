"""The cross-node seam (Note [cross-node transport] in torch_ipc/_dist.py):
the weights relay and the KV protocol run unchanged on a second Transport
(tests/transport_helpers.py, ranks as threads), and counts a peer sends are
bounded before anything is built from them (Note [counts from a peer])."""

import threading
import time

import distributed_helpers as dh
import pytest
import torch
import transport_helpers as th
import weights_helpers as wh

from torch_ipc import _dist
from torch_ipc.testing import PeerGroup


def test_the_torch_distributed_transport_and_the_test_one_fit_the_protocol():
    calls = ("check_device", "through_host", "broadcast", "send", "recv", "batch")
    for cls in (_dist.DistTransport, th.QueueTransport):
        assert all(callable(getattr(cls, name, None)) for name in calls), cls
    with pytest.raises(ValueError, match="not both"):
        _dist.transport_for(th.Hub(1).transport(0), group=object())


def test_a_relay_republishes_every_version_over_another_transport():
    """Trainer rank 0, relay rank 1, both on the in-memory hub; a subscriber
    of the relay pulls each version bit for bit under the trainer's number."""
    import multiprocessing as mp

    from torch_ipc.weights import Publisher, Relay, Subscriber

    hub = th.Hub(2)
    weights = wh.make_weights(seed=1, big=3000)
    pub = Publisher(weights)
    pub.publish()
    pub.broadcast_to(transport=hub.transport(0), bucket_bytes=2048)  # sends are buffered: one thread is enough
    relay = Relay(transport=hub.transport(1), src=0)
    a, b = mp.Pipe()
    relay.attach(a)
    sub = Subscriber(b, timeout=10.0)
    model = wh.make_weights(fill=0.0, big=3000)
    gen = torch.Generator().manual_seed(2)
    try:
        for version in range(1, 5):
            if version > 1:
                for t in weights.values():
                    t.copy_(torch.randn(t.shape, generator=gen))
                assert pub.publish() == version
            assert relay.receive() == version
            assert sub.pull(model, newer_than=version - 1, timeout=10.0) == version
            assert wh.bits(model) == wh.bits(weights)
        pub.close()
        assert relay.receive() is None  # the trainer closed
    finally:
        sub.close()
        relay.close()
        pub.close()


def test_kv_blocks_move_between_pools_over_another_transport():
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.kv.remote import recv_blocks, send_blocks

    hub = th.Hub(2)
    shape = (2, 3, 8)
    a, b = SharedKVPool(32, shape, torch.float16), SharedKVPool(32, shape, torch.float16)
    try:
        ids = a.allocate(12)
        data = torch.randn((12, *shape), generator=torch.Generator().manual_seed(3)).half()
        a.scatter(ids, data)
        order = ids[::2] + ids[1::2]
        send_blocks(a, order, 1, meta={"request": 9}, staging_bytes=3 * a.block_bytes, transport=hub.transport(0))
        got = recv_blocks(b, 0, transport=hub.transport(1))
        assert got.meta == {"request": 9} and got.src == 0 and len(got.ids) == 12
        want = torch.stack([data[ids.index(i)] for i in order])
        assert torch.equal(b.gather(got.ids), want)
        assert a.held() == [] and sorted(b.held()) == sorted(got.ids)
    finally:
        a.close()
        b.close()


def test_sending_kv_blocks_of_a_closed_pool_says_it_is_closed():
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.kv.remote import send_blocks

    hub = th.Hub(2)
    pool = SharedKVPool(8, (2, 3), torch.float16)
    ids = pool.allocate(2)
    pool.close()
    with pytest.raises(RuntimeError, match="this KV pool is closed"):
        send_blocks(pool, ids, 1, transport=hub.transport(0))


# ----------------------------------------------------------------------------- Note [counts from a peer]

BAD_LAYOUTS = [
    # 2**40 bytes in buckets of 256: 2**32 buckets
    ({"kind": "torch_ipc.weights.layout/1", "bucket_bytes": 256, "device": "cpu", "version": 0,
      "total_bytes": 2**40, "entries": [["w", "torch.uint8", [2**40]]]}, "buckets"),
    # one bucket, but more bytes than this machine has
    ({"kind": "torch_ipc.weights.layout/1", "bucket_bytes": 2**46, "device": "cpu", "version": 0,
      "total_bytes": 2**46, "entries": [["w", "torch.uint8", [2**46]]]}, "refused before allocating"),
]


@pytest.mark.parametrize("message,match", BAD_LAYOUTS)
def test_a_layout_of_absurd_counts_is_refused_before_anything_is_built(message, match):
    """Over the in-memory transport: the relay refuses at once (on main it
    listed 2**32 buckets, or allocated the snapshot)."""
    from torch_ipc.weights import Relay

    hub = th.Hub(2)
    _dist.broadcast_json(hub.transport(0), message, 0)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        Relay(transport=hub.transport(1), src=0)
    assert time.monotonic() - start < 5.0


def test_a_hostile_trainer_process_cannot_make_a_relay_list_its_buckets():
    """A real second process sends the 2**32-bucket layout over gloo to a relay
    whose address space is capped at +1 GiB: a clear ValueError (main ran out
    of memory building the list)."""
    url = dh.group_url()
    with PeerGroup(timeout=60.0) as group:
        hostile, victim = group.get("hostile"), group.get("victim")
        hostile.start_call(dh.hostile_layout, url, BAD_LAYOUTS[0][0])
        error, message = victim.call(dh.victim_relay, url)
        hostile.result()
        assert error == "ValueError" and "buckets" in message, (error, message)


def test_a_hostile_kv_header_of_2_39_pieces_is_drained_without_listing_them():
    """A real second process announces 2**39 one-block pieces, sends two and
    leaves: the receiver (address space capped at +1 GiB) drains what came,
    then fails on the broken group, holding nothing; main listed the pieces
    first and ran out of memory."""
    shape, dtype = (4, 8), torch.float16
    header = {"kind": "torch_ipc.kv.blocks/2", "n": 2**39, "pieces": [[1, 2**39]], "shape": list(shape),
              "dtype": str(dtype), "meta": None}
    url = dh.group_url()
    with PeerGroup(timeout=60.0) as group:
        hostile, victim = group.get("hostile"), group.get("victim")
        hostile.start_call(dh.hostile_kv_header, url, header, 2, 4 * 8 * 2)
        error, message, held = victim.call(dh.victim_kv, url, shape, dtype)
        hostile.result()
        assert error not in (None, "MemoryError") and held == [], (error, message)


def test_a_kv_header_of_2_39_pieces_over_the_in_memory_transport():
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.kv.remote import recv_blocks

    hub = th.Hub(2, wait_s=0.5)
    pool = SharedKVPool(4, (4, 8), torch.float16)
    try:
        _dist.send_json(hub.transport(0), {"kind": "torch_ipc.kv.blocks/2", "n": 2**39, "pieces": [[1, 2**39]],
                                           "shape": [4, 8], "dtype": "torch.float16", "meta": None}, 1)
        for _ in range(3):
            hub.transport(0).send(torch.zeros(4 * 8, dtype=torch.float16), 1)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="nothing arrived"):  # drained 3, then waited for the 4th
            recv_blocks(pool, 0, transport=hub.transport(1))
        assert time.monotonic() - start < 5.0 and pool.held() == []
    finally:
        pool.close()


# ----------------------------------------------------------------------------- Note [KV blocks across nodes]

@pytest.mark.parametrize("n", [0, _dist.FIRST_BYTES - 11, _dist.FIRST_BYTES - 10, _dist.FIRST_BYTES - 9, 20000])
def test_json_messages_around_the_room_of_the_first_message(n):
    """A string of n characters is n + 2 bytes of JSON: it fits the first
    message (FIRST_BYTES less the 8 of its length) or goes on in a second."""
    hub = th.Hub(2)
    works = _dist.post_json(hub.transport(0), "x" * n, 1)
    assert len(works) == 1 + (n + 2 > _dist.FIRST_BYTES - 8)
    _dist.send_json(hub.transport(0), {"n": n}, 1)
    assert _dist.recv_json(hub.transport(1), 0, spin=1e-3) == "x" * n
    assert _dist.recv_json(hub.transport(1), 0) == {"n": n}


def _kv_pools(n, dtype=torch.float16, shape=(2, 3, 8)):
    from torch_ipc.kv import SharedKVPool

    return SharedKVPool(n, shape, dtype)


def _kv_write(pool, n, seed):
    ids = pool.allocate(n)
    data = torch.randn((n, *pool.block_shape), generator=torch.Generator().manual_seed(seed)).to(pool.dtype)
    pool.scatter(ids, data)
    return ids, data


def test_kv_transfers_posted_back_to_back_land_in_order():
    """Three transfers posted before the receiver starts (the sender waits for
    nothing on this transport): each header is followed by its own pieces."""
    from torch_ipc.kv.remote import recv_blocks, send_blocks

    hub, a, b = th.Hub(2), _kv_pools(48), _kv_pools(48)
    try:
        sent = []
        for i, piece in enumerate([1, 4, 16]):
            ids, data = _kv_write(a, 12, seed=i)
            order = ids[::-1] if i % 2 else ids
            send_blocks(a, order, 1, meta=i, staging_bytes=piece * a.block_bytes, transport=hub.transport(0))
            sent.append(torch.stack([data[ids.index(k)] for k in order]))
        for i, want in enumerate(sent):
            got = recv_blocks(b, 0, transport=hub.transport(1))
            assert got.meta == i and torch.equal(b.gather(got.ids), want)
    finally:
        a.close()
        b.close()


def test_a_refused_kv_transfer_is_drained_and_the_next_one_lands():
    """Blocks of another layout, then too many blocks: each refused after its
    pieces were drained, nothing held; the transfer after each lands bit for bit."""
    from torch_ipc.kv import LayoutMismatchError, OutOfBlocksError
    from torch_ipc.kv.remote import recv_blocks, send_blocks

    hub, a, other, b = th.Hub(2, wait_s=5.0), _kv_pools(32), _kv_pools(32, torch.bfloat16), _kv_pools(10)
    try:
        for refuse_into, n, error in [(other, 8, LayoutMismatchError), (b, 12, OutOfBlocksError)]:
            ids, _ = _kv_write(a, n, seed=n)
            send_blocks(a, ids, 1, staging_bytes=3 * a.block_bytes, transport=hub.transport(0))
            ids, data = _kv_write(a, 6, seed=n + 1)
            order = ids[1::2] + ids[::2]
            send_blocks(a, order, 1, staging_bytes=4 * a.block_bytes, transport=hub.transport(0))
            with pytest.raises(error):
                recv_blocks(refuse_into, 0, transport=hub.transport(1))
            assert refuse_into.held() == []
            got = recv_blocks(b, 0, transport=hub.transport(1))
            assert torch.equal(b.gather(got.ids), torch.stack([data[ids.index(k)] for k in order]))
            b.free(got.ids)
    finally:
        for pool in (a, other, b):
            pool.close()


def test_a_spinning_finish_keeps_its_deadline_and_returns_once_the_message_is_there():
    hub = th.Hub(2)
    into = torch.empty(3, dtype=torch.uint8)
    start = time.monotonic()
    with pytest.raises(TimeoutError):  # spins past its deadline: the deadline wins
        _dist.finish(hub.transport(1).recv(into, 0), into, deadline=start + 0.05, poll=True, spin=10.0)
    assert time.monotonic() - start < 2.0
    hub = th.Hub(2)  # the receive above stays unmatched on the first
    threading.Timer(0.05, lambda: hub.transport(0).send(torch.tensor([1, 2, 3], dtype=torch.uint8), 1)).start()
    # spins, then sleeps until the message came
    _dist.finish(hub.transport(1).recv(into, 0), into, deadline=time.monotonic() + 20, poll=True, spin=0.01)
    assert into.tolist() == [1, 2, 3]
