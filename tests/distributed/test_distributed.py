"""Across machines: weights relayed to other nodes and KV blocks sent to
another node's pool, over torch.distributed. Each node is a separate process
(gloo over this machine's loopback); every process is a Peer of a PeerGroup,
killed with its group when the test ends or times out."""

import random
import signal

import distributed_helpers as dh
import ipc_test_utils as u
import pytest
import torch
import weights_helpers as wh

from torch_ipc.testing import PeerGroup

TIMEOUT = 90.0


def _relays_and_subscribers(group, url, world, names, bucketed=()):
    """Start the trainer and relays (a collective), return {relay: (peer, address, key)}."""
    trainer = group.get("trainer")
    trainer.start_call(dh.trainer_start, url, world)
    relays = {}
    for rank, name in enumerate(names, start=1):
        address, key = wh.listener_address()
        peer = group.get(name)
        peer.start_call(dh.relay_start, url, rank, world, address, key, bucketed=name in bucketed)
        relays[name] = (peer, address, key)
    for peer, _, _ in relays.values():
        peer.result()
        peer.start_call(dh.relay_serve)  # the trainer sends version 1 right after the layout
    return trainer, relays, trainer.result()


def test_relays_publish_every_version_bit_for_bit_on_their_nodes():
    """A trainer, a direct and a bucketed relay, two subscribers each (one of
    them converting to bf16): every version any of them pulls is the
    trainer's, bit for bit, under the trainer's version number."""
    url, last = dh.group_url(), 6
    with PeerGroup(timeout=TIMEOUT) as group:
        trainer, relays, expected = _relays_and_subscribers(group, url, 3, ["direct", "bucketed"],
                                                            bucketed=("bucketed",))
        subscribers = []
        for name, (_, address, key) in relays.items():
            for i, dtype in enumerate((torch.float32, torch.bfloat16)):
                peer = group.get(f"{name}-sub{i}")
                peer.call(wh.sub_attach, address, key, dtype=dtype, big=3000)
                peer.start_call(dh.sub_pull_versions, last)
                subscribers.append((name, dtype, peer))
        expected.update(trainer.call(dh.trainer_publish, last - 1, seed=5))
        for name, dtype, peer in subscribers:
            seen = peer.result()
            assert seen and max(seen) == last, (name, sorted(seen))
            for version, pulled in seen.items():
                assert pulled == expected[version][str(dtype).split(".")[1]], (name, dtype, version)
        trainer.call(dh.trainer_close)
        for peer, _, _ in relays.values():
            assert peer.result() == last  # serve() returned when the trainer closed
            peer.call(dh.relay_close)
        for _, _, peer in subscribers:
            peer.call(wh.sub_close)
        group.close(check=True)


def test_a_killed_relay_fails_its_subscribers_and_a_restarted_one_reattaches_them():
    url = dh.group_url()
    with PeerGroup(timeout=TIMEOUT) as group:
        trainer, relays, expected = _relays_and_subscribers(group, url, 3, ["doomed", "survivor"])
        subs = {}
        for name, (_, address, key) in relays.items():
            peer = group.get(f"{name}-sub")
            peer.call(wh.sub_attach, address, key, big=3000)
            subs[name] = peer
        expected.update(trainer.call(dh.trainer_publish, 2, seed=7))
        for peer in subs.values():
            assert peer.call(dh.sub_pull_versions, 3)[3] == expected[3]["float32"]

        doomed, address, key = relays["doomed"]
        doomed.kill(signal.SIGKILL)
        gone = subs["doomed"].call(dh.sub_pull_gone)
        assert "exited" in gone and "keeps version 3" in gone
        version, message, more = trainer.call(dh.trainer_publish_into_a_broken_group, seed=8)
        assert version == 4 and "published on this node" in message
        expected.update(more)
        survivor = relays["survivor"][0]
        assert survivor.result() == ("broken", 3)  # its receive failed; its node keeps version 3

        # a new group: the trainer, the surviving relay (rejoins) and a restarted relay
        url2 = dh.group_url()
        trainer.start_call(dh.trainer_rejoin, url2, 3)
        restarted = group.get("restarted")
        restarted.start_call(dh.relay_start, url2, 1, 3, address, key)
        survivor.call(dh.relay_rejoin, url2, 2, 3)
        restarted.result()
        for peer in (restarted, survivor):
            peer.start_call(dh.relay_serve)
        trainer.result()
        # the trainer sent its current version (4) on joining: both nodes have it
        version, pulled, reattached = subs["doomed"].call(dh.sub_pull_reattached, 3)
        assert (version, reattached) == (4, 1) and pulled == expected[4]["float32"]
        version, pulled, reattached = subs["survivor"].call(dh.sub_pull_reattached, 3)
        assert (version, reattached) == (4, 0) and pulled == expected[4]["float32"]
        expected.update(trainer.call(dh.trainer_publish, 2, seed=9))
        for peer in subs.values():
            seen = peer.call(dh.sub_pull_versions, 6)
            assert seen[6] == expected[6]["float32"]
        trainer.call(dh.trainer_close)
        for peer in (restarted, survivor):
            assert peer.result() == 6
            peer.call(dh.relay_close)


def test_relay_refuses_its_own_rank_and_a_trainer_in_bucketed_mode(tmp_path):
    from torch_ipc.weights import Publisher, Relay

    url = "file://" + str(tmp_path / "rendezvous")
    dh.init_group(url, 0, 1)
    try:
        with pytest.raises(ValueError, match="its own"):
            Relay(src=0)
        with pytest.raises(ValueError, match="direct-mode"):
            Publisher({"w": torch.zeros(64)}, bucket_bytes=256).broadcast_to()
        with pytest.raises(ValueError, match="own rank"):
            Publisher({"w": torch.zeros(64)}).broadcast_to(src=3)
    finally:
        dh.leave_group()


def test_layout_messages_are_checked_field_by_field():
    from torch_ipc.weights._broadcast import layout_from_message, layout_message
    from torch_ipc.weights._layout import Layout

    layout = Layout.build([("a", torch.float32, (3, 4)), ("b", torch.bfloat16, (5,))])
    good = layout_message(layout, 1024, torch.device("cpu"), 2)
    assert layout_from_message(good) == (layout, 1024, "cpu", 2)
    bad = [
        {**good, "kind": "other"},
        {**good, "entries": [["a", "torch.float32", [3, 4]], ["a", "torch.float32", [1]]]},
        {**good, "entries": [["a", "os.system", [3, 4]]]},
        {**good, "entries": [["a", "torch.float32", [-1]]]},
        {**good, "entries": [["a", "torch.float32", [2**40, 2**40]]]},
        {**good, "total_bytes": 10},
        {**good, "bucket_bytes": 100},
        {**good, "device": "tpu"},
        [1, 2],
    ]
    for message in bad:
        with pytest.raises(ValueError, match="malformed layout"):
            layout_from_message(message)


@pytest.mark.parametrize("timeout_s", [20.0, None], ids=["deadline", "no-deadline"])
def test_ctrl_c_ends_a_wait_for_a_peer_that_does_not_receive(timeout_s):
    """Note [an interruptible wait]: gloo's wait() is deaf to signals; a real
    SIGINT 0.5 s into the wait for a send that the peer never receives raises
    KeyboardInterrupt at once, not at the deadline (20 s) or never."""
    url = dh.group_url()
    with PeerGroup(timeout=60.0) as group:
        sender, idle = group.get("sender"), group.get("idle")
        idle.start_call(dh.join, url, 1, 2)
        assert sender.call(dh.join, url, 0, 2) == 0 and idle.result() == 1
        assert sender.call(dh.send_unreceived_interrupted, 64 << 20, 0.5, timeout_s) < 5.0


# ----------------------------------------------------------------------------- KV blocks across nodes

SHAPE, DTYPE = (2, 3, 4, 8), torch.float16


@pytest.mark.parametrize("staging_bytes", [1 << 20, 3 * 2 * 3 * 4 * 8 * 2])  # all at once; 3 blocks a piece
def test_kv_blocks_move_to_another_nodes_pool_with_their_ownership(staging_bytes):
    url = dh.group_url()
    with PeerGroup(timeout=TIMEOUT) as group:
        prefill, decode = group.get("prefill"), group.get("decode")
        prefill.start_call(dh.kv_start, url, 0, 2, 64, SHAPE, DTYPE)
        decode_pid = decode.call(dh.kv_start, url, 1, 2, 64, SHAPE, DTYPE)
        prefill.result()
        ids, data = prefill.call(dh.kv_write, 20, seed=3)
        decode.call(dh.kv_allocate, 5)  # the receiving pool's free blocks are not 0..19
        order = ids[::2] + ids[1::2]  # not one run: gathered; consecutive ids: sent from the pool itself
        row = len(data) // len(ids)
        want = b"".join(data[ids.index(i) * row : (ids.index(i) + 1) * row] for i in order)
        decode.start_call(dh.kv_recv, 0)
        sender = prefill.call(dh.kv_send, order, 1, meta={"request": 7, "tokens": [1, 2]},
                              staging_bytes=staging_bytes)
        got = decode.result()
        assert got["bytes"] == want
        assert got["meta"] == {"request": 7, "tokens": [1, 2]} and got["src"] == 0
        assert len(got["ids"]) == 20 and set(got["ids"]).isdisjoint(range(5))
        assert set(got["held"]) == set(got["ids"]) | set(range(5))
        assert set(got["holders"].values()) == {decode_pid}
        # transfer: the sender's blocks went back to its pool
        assert sender["held"] == [] and set(sender["holders"].values()) == {None} and sender["free"] == 64
        for peer in (prefill, decode):
            peer.call(dh.kv_close)
        group.close(check=True)


def test_kv_pieces_runs_straight_and_short_runs_gathered():
    """On a CPU pool, runs of at least DIRECT_MIN_BYTES become pieces of their
    own (cut at the piece size), shorter runs are packed into gathered pieces,
    and a run across two chunks is two runs."""
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.kv.remote import DIRECT_MIN_BYTES, _ChunkRuns, _encode_lengths, _plan

    pool = SharedKVPool(64, (DIRECT_MIN_BYTES // 4,), torch.float16)  # blocks of half DIRECT_MIN_BYTES
    try:
        memory = _ChunkRuns(pool)
        ids = [0, 1, 2, 3, 4, 9, 7, 11, 12, 13, 20, 30, 31, 40, 50]
        # runs: 0-4 (5), 9, 7, 11-13 (3), 20, 30-31 (2), 40, 50
        assert list(memory.runs(ids)) == [(0, 5), (5, 6), (6, 7), (7, 10), (10, 11), (11, 13), (13, 14), (14, 15)]
        assert _plan(memory, ids, 3, 2) == [3, 2, 2, 3, 1, 2, 2]
        assert _plan(memory, ids, 3, 10**6) == [3, 3, 3, 3, 3]  # everything gathered
        assert _encode_lengths([1] * 256 + [3, 3, 2]) == [[1, 256], [3, 2], [2, 1]]
        assert memory.view([5, 6, 7]).data_ptr() == pool.block(5).data_ptr() and memory.view([5, 7]) is None
    finally:
        pool.close()
    pool = SharedKVPool(32, (4,), torch.float16, blocks_per_chunk=8)  # chunks of blocks 0-7, 8-15, ...
    try:
        memory = _ChunkRuns(pool)
        assert list(memory.runs([5, 6, 7, 8, 9, 3, 16, 15, 14])) == [(0, 3), (3, 5), (5, 6), (6, 7), (7, 8), (8, 9)]
        rng = random.Random(u.new_seed())
        for _ in range(200):  # the same runs as one step per id would find
            ids = [rng.randrange(32) if rng.random() < 0.3 else None for _ in range(rng.randrange(1, 40))]
            ids = [b if b is not None else (ids[i - 1] or 0) + 1 for i, b in enumerate(ids)]
            assert list(memory.runs(ids)) == _runs_one_id_at_a_time(memory, ids), ids
    finally:
        pool.close()


def _runs_one_id_at_a_time(memory, ids):
    out, lo = [], 0
    for i in range(1, len(ids) + 1):
        if i < len(ids) and ids[i] == ids[i - 1] + 1 and memory._chunk(ids[i]) == memory._chunk(ids[lo]) \
                and memory._chunk(ids[i]) < len(memory.chunks):
            continue
        out.append((lo, i))
        lo = i
    return out


def test_kv_headers_are_checked_field_by_field():
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.kv.remote import MAX_PIECE_BYTES, _check_header

    pool = SharedKVPool(8, SHAPE, DTYPE)
    try:
        good = {"kind": "torch_ipc.kv.blocks/2", "n": 5, "pieces": [[2, 2], [1, 1]], "shape": list(SHAPE),
                "dtype": str(DTYPE), "meta": None}
        assert _check_header(pool, good) == (5, [(2, 2), (1, 1)], pool.block_bytes, None)
        assert "bfloat16" in _check_header(pool, {**good, "dtype": "torch.bfloat16"})[3]  # refused after draining
        huge = MAX_PIECE_BYTES // pool.block_bytes + 1
        for bad, match in [
            ({**good, "kind": "torch_ipc.kv.blocks/1"}, "not a KV blocks header"),
            ({**good, "n": 0}, "n=0"),
            ({**good, "pieces": [[2, 2]]}, "do not add up"),
            ({**good, "pieces": [[5, 1], [0, 3]]}, "do not add up"),
            ({**good, "pieces": [[1, 10**12], [-1, 10**12 - 5]]}, "do not add up"),
            ({**good, "pieces": [[2.5, 2]]}, "do not add up"),
            ({**good, "pieces": "5"}, "do not add up"),
            ({**good, "n": huge, "pieces": [[huge, 1]]}, "over"),
            ({**good, "dtype": "os.system"}, "dtype"),
        ]:
            with pytest.raises(ValueError, match=match):
                _check_header(pool, bad)
    finally:
        pool.close()


def test_kv_blocks_of_mixed_pieces_land_in_a_fragmented_pool():
    """Blocks of half DIRECT_MIN_BYTES: some pieces straight from the sending
    pool, some gathered; the receiving pool's free blocks are fragmented at
    first, so some pieces land straight and some through staging."""
    from torch_ipc.kv.remote import DIRECT_MIN_BYTES

    shape, url = (DIRECT_MIN_BYTES // 4,), dh.group_url()
    with PeerGroup(timeout=TIMEOUT) as group:
        prefill, decode = group.get("prefill"), group.get("decode")
        prefill.start_call(dh.kv_start, url, 0, 2, 64, shape, torch.float16)
        decode.call(dh.kv_start, url, 1, 2, 64, shape, torch.float16)
        prefill.result()
        ids, data = prefill.call(dh.kv_write, 40, seed=9)
        held = decode.call(dh.kv_allocate, 10)
        decode.call(dh.kv_free, held[::2])  # free: 0, 2, 4, 6, 8, then 10 on
        order = [0, 1, 2, 3, 4, 9, 7, 11, 12, 13, 20, 30, 31, 33, 21, 22, 23, 24, 25, 26, 27]
        row = len(data) // len(ids)
        want = b"".join(data[ids.index(i) * row : (ids.index(i) + 1) * row] for i in order)
        decode.start_call(dh.kv_recv, 0)
        prefill.call(dh.kv_send, order, 1, staging_bytes=3 * DIRECT_MIN_BYTES // 2)  # 3 blocks a piece
        got = decode.result()
        assert got["bytes"] == want and got["ids"][:5] == [0, 2, 4, 6, 8]
        for peer in (prefill, decode):
            peer.call(dh.kv_close)
        group.close(check=True)


def test_kv_send_without_transfer_keeps_the_blocks_and_refusals_keep_the_pair_in_step():
    url = dh.group_url()
    with PeerGroup(timeout=TIMEOUT) as group:
        prefill, decode = group.get("prefill"), group.get("decode")
        prefill.start_call(dh.kv_start, url, 0, 2, 32, SHAPE, DTYPE)
        decode.call(dh.kv_start, url, 1, 2, 8, SHAPE, DTYPE)
        prefill.result()
        ids, _ = prefill.call(dh.kv_write, 10, seed=4)
        # too many blocks for the receiving pool: drained, then OutOfBlocksError; nothing held there
        decode.start_call(dh.kv_recv, 0)
        sender = prefill.call(dh.kv_send, ids, 1, transfer=False, staging_bytes=4096)
        refused = decode.result()
        assert refused["error"] == "OutOfBlocksError" and refused["held"] == [] and refused["free"] == 8
        assert sorted(sender["held"]) == sorted(ids)  # transfer=False: still the sender's
        # the pair is still in step: the next hand-over goes through (a meta longer than the first message)
        decode.start_call(dh.kv_recv, 0)
        prefill.call(dh.kv_send, ids[:4], 1, meta={"tokens": list(range(3000))})
        got = decode.result()
        assert len(got["ids"]) == 4 and got["meta"] == {"tokens": list(range(3000))}
        with pytest.raises(Exception, match="cannot hand over block .*: it is free"):
            prefill.call(dh.kv_send, ids[:4], 1)  # given away above
        for peer in (prefill, decode):
            peer.call(dh.kv_close)


def test_kv_blocks_of_another_layout_are_refused_after_draining():
    url = dh.group_url()
    with PeerGroup(timeout=TIMEOUT) as group:
        prefill, decode = group.get("prefill"), group.get("decode")
        prefill.start_call(dh.kv_start, url, 0, 2, 16, SHAPE, DTYPE)
        decode.call(dh.kv_start, url, 1, 2, 16, SHAPE, torch.bfloat16)
        prefill.result()
        ids, _ = prefill.call(dh.kv_write, 4, seed=5)
        decode.start_call(dh.kv_recv, 0)
        prefill.call(dh.kv_send, ids, 1, transfer=False)
        refused = decode.result()
        assert refused["error"] == "LayoutMismatchError" and "float16" in refused["message"]
        assert refused["held"] == []
        for peer in (prefill, decode):
            peer.call(dh.kv_close)


# (blocks a piece, order of the ids) of each transfer of _kv_rounds
KV_ROUNDS = [(1, "random"), (3, "consecutive"), (5, "mixed"), (64, "random"), (64, "consecutive")]


def _kv_order(ids, kind: str, seed: int):
    if kind == "random":
        return random.Random(seed).sample(ids, len(ids))
    if kind == "consecutive":
        order = sorted(ids)
        assert order == list(range(order[0], order[0] + len(order)))  # the sender's pool gave a run
        return order
    return [i for i in ids if i % 3] + [i for i in ids if not i % 3]  # short runs and single blocks


def _kv_rounds(sender, receiver, device: str, backend: str, seed: int) -> None:
    """Blocks of half DIRECT_MIN_BYTES from one pool to another's, bit for
    bit, in pieces of 1, 3, 5 blocks or all at once, random, consecutive and
    mixed ids (KV_ROUNDS; the first into a fragmented pool); then a transfer
    the receiver cannot take (too few free blocks) is drained and the next
    one lands: the sender posts each header and its pieces without waiting in
    between (Note [KV blocks across nodes])."""
    from torch_ipc.kv.remote import DIRECT_MIN_BYTES

    shape, url = (DIRECT_MIN_BYTES // 4,), dh.group_url()
    sender.start_call(dh.kv_start, url, 0, 2, 32, shape, DTYPE, device, backend=backend)
    receiver.call(dh.kv_start, url, 1, 2, 16 * len(KV_ROUNDS) + 18, shape, DTYPE, device, backend=backend)
    sender.result()
    held = receiver.call(dh.kv_allocate, 10)
    receiver.call(dh.kv_free, held[::2], True)  # free: 5 blocks apart, then the rest
    block_bytes = DIRECT_MIN_BYTES // 2
    for i, (piece, kind) in enumerate(KV_ROUNDS + [(3, "mixed"), (3, "random")]):
        n = 8 if i == len(KV_ROUNDS) + 1 else 16
        ids, data = sender.call(dh.kv_write, n, seed=seed + i)
        order = _kv_order(ids, kind, seed + i)
        receiver.start_call(dh.kv_recv, 0)
        meta = {"round": i, "tokens": list(range(3000 * (i == 2)))}  # round 2: a header of two messages
        sender.call(dh.kv_send, order, 1, meta=meta, staging_bytes=piece * block_bytes)
        got = receiver.result()
        if i == len(KV_ROUNDS):  # 13 free blocks for 16
            assert got["error"] == "OutOfBlocksError" and len(got["held"]) == 5 + 16 * len(KV_ROUNDS), got
            continue
        row = len(data) // len(ids)
        assert got["bytes"] == b"".join(data[ids.index(b) * row : (ids.index(b) + 1) * row] for b in order), i
        assert got["meta"] == meta and len(got["ids"]) == n
        if i == 0:  # through staging into the 5 blocks apart, then straight into a run
            assert got["ids"][:5] == held[::2], got["ids"]


def test_kv_transfers_of_every_piece_size_and_order_and_a_drained_one_over_gloo():
    with PeerGroup(timeout=TIMEOUT) as group:
        prefill, decode = group.get("prefill"), group.get("decode")
        _kv_rounds(prefill, decode, "cpu", "gloo", seed=21)
        for peer in (prefill, decode):
            peer.call(dh.kv_close)
        group.close(check=True)


def test_kv_send_checks_its_arguments_before_sending(tmp_path):
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.kv.remote import send_blocks

    dh.init_group("file://" + str(tmp_path / "rendezvous"), 0, 1)
    pool = SharedKVPool(8, SHAPE, DTYPE)
    try:
        ids = pool.allocate(2)
        with pytest.raises(ValueError, match="cannot hand over block 7: it is free"):
            send_blocks(pool, [ids[0], 7], 0)
        with pytest.raises(ValueError, match="twice"):
            send_blocks(pool, [ids[0], ids[0]], 0)
        with pytest.raises(ValueError, match="no blocks"):
            send_blocks(pool, [], 0)
        with pytest.raises(TypeError, match="JSON"):
            send_blocks(pool, ids, 0, meta=object())
        assert sorted(pool.held()) == sorted(ids)
    finally:
        pool.close()
        dh.leave_group()


# ----------------------------------------------------------------------------- GPU variants

def _cuda_relay_round_trip(trainer, relay, sub, backend: str, last: int, seed: int) -> None:
    """Versions 1..last from `trainer` through `relay` to `sub`, CUDA tensors, bit for bit."""
    url, (address, key) = dh.group_url(), wh.listener_address()
    trainer.start_call(dh.trainer_start, url, 2, device="cuda", backend=backend)
    relay.call(dh.relay_start, url, 1, 2, address, key, backend=backend)
    relay.start_call(dh.relay_serve)
    expected = trainer.result()
    sub.call(wh.sub_attach, address, key, device="cuda", big=3000)
    sub.start_call(dh.sub_pull_versions, last)
    expected.update(trainer.call(dh.trainer_publish, last - 1, seed=seed))
    seen = sub.result()
    assert max(seen) == last and all(seen[v] == expected[v]["float32"] for v in seen)
    # Both close at once: NCCL's destroy_process_group returns only once every
    # rank of the group on this host has destroyed its communicator too
    # (Note [closing a group] in relay.py); here both "nodes" share one host.
    trainer.start_call(dh.trainer_close)
    assert relay.result() == last
    relay.call(dh.relay_close)
    trainer.result()


def _cuda_kv_round_trip(sender, receiver, backend: str, seed: int) -> None:
    """_kv_rounds between two CUDA pools, then both close at once (as the
    relay's close: Note [closing a group] in relay.py)."""
    _kv_rounds(sender, receiver, "cuda", backend, seed)
    for peer in (sender, receiver):
        peer.start_call(dh.kv_close)
    for peer in (sender, receiver):
        peer.result()


@pytest.mark.cuda
def test_cuda_weights_and_kv_blocks_over_gloo_on_one_gpu():
    with PeerGroup(timeout=TIMEOUT) as group:
        trainer, relay, sub = group.get("trainer"), group.get("relay"), group.get("sub")
        _cuda_relay_round_trip(trainer, relay, sub, "gloo", last=4, seed=11)
        _cuda_kv_round_trip(trainer, relay, "gloo", seed=6)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl,cpu:gloo"])
def test_nccl_weights_and_kv_blocks_on_two_gpus(backend):
    """One GPU per process (NCCL needs distinct devices): a trainer on GPU 0,
    a relay and its subscriber on GPU 1; then KV blocks from GPU 0's pool to
    GPU 1's. Also in a group of both backends (what init_process_group()
    makes when given none): control messages over gloo, the data over NCCL."""
    with PeerGroup(timeout=TIMEOUT) as group:
        trainer = group.get("trainer", env={"CUDA_VISIBLE_DEVICES": "0"})
        relay = group.get("relay", env={"CUDA_VISIBLE_DEVICES": "1"})
        sub = group.get("sub", env={"CUDA_VISIBLE_DEVICES": "1"})
        _cuda_relay_round_trip(trainer, relay, sub, backend, last=3, seed=12)
        _cuda_kv_round_trip(trainer, relay, backend, seed=13)


@pytest.mark.gpus(2)
def test_nccl_kv_blocks_of_every_piece_size_and_order_on_two_gpus():
    """_kv_rounds alone (the test above runs them after the relay's round trip)."""
    with PeerGroup(timeout=TIMEOUT) as group:
        sender = group.get("prefill", env={"CUDA_VISIBLE_DEVICES": "0"})
        receiver = group.get("decode", env={"CUDA_VISIBLE_DEVICES": "1"})
        _cuda_kv_round_trip(sender, receiver, "nccl", seed=31)


@pytest.mark.gpus(2)
def test_nccl_trainer_closes_after_its_relay_was_killed():
    """A relay killed while it waits for the next version: the trainer's
    Publisher.close() and destroy_process_group() still return."""
    with PeerGroup(timeout=TIMEOUT) as group:
        trainer = group.get("trainer", env={"CUDA_VISIBLE_DEVICES": "0"})
        relay = group.get("relay", env={"CUDA_VISIBLE_DEVICES": "1"})
        url, (address, key) = dh.group_url(), wh.listener_address()
        trainer.start_call(dh.trainer_start, url, 2, device="cuda", backend="nccl")
        relay.call(dh.relay_start, url, 1, 2, address, key, backend="nccl")
        relay.start_call(dh.relay_serve)
        trainer.result()
        relay.kill(signal.SIGKILL)
        trainer.call(dh.trainer_close)
