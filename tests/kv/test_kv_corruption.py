"""A KV pool whose shared memory another process scribbles over (Note [nothing
trusted from the pool's segment] in csrc/features/kv/pool_segment.h): a
scribbler writes garbage into every shared field (free stack, counts, holder
words, process slots, chunk records, the lock's words, the geometry), and the
owner, a third member and a newcomer then use the pool. Each runs in a child
process of its own, so a crash fails the test instead of killing pytest.
Every member must keep running, keep its blocks' bytes, never be handed a
block that another holds, and see the damage as a clear error:
``PoolCorruptedError``, or ``TimeoutError`` naming the holder of a lock that
is never released. Chunk records that hold a pickle are never unpickled."""
import mmap
import os
import random

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc.kv import OutOfBlocksError, PoolCorruptedError, SharedKVPool

SHAPE = (2, 4)
BLOCKS = 16
HELD_EACH = 4
LOCK_TIMEOUT = 0.1  # each member operation on a lock that is never released waits this long
# What a member may see after a scribble, besides success.
CLEAR_ERRORS = (PoolCorruptedError, TimeoutError, OutOfBlocksError, ValueError, IndexError, torch_ipc.ReleasedError)


# ----------------------------------------------------------------------------- run in peers


def make_pool_and_hold() -> tuple:
    """The owner: a pool whose HELD_EACH blocks it holds carry its pid."""
    pool = SharedKVPool(BLOCKS, SHAPE, torch.int64)
    pool.lock_timeout = LOCK_TIMEOUT
    ids = pool.allocate(HELD_EACH)
    for b in ids:
        pool.block(b).fill_(os.getpid())
    u.HELD["kv"] = (pool, ids)
    return torch_ipc.dumps(pool), pool._state.name, ids, pool._state.allocator.field_offsets()


def attach_and_hold(data: bytes) -> list:
    """A third member: attach, hold HELD_EACH blocks that carry its pid."""
    pool = SharedKVPool.attach(data, SHAPE, torch.int64)
    pool.lock_timeout = LOCK_TIMEOUT
    ids = pool.allocate(HELD_EACH)
    for b in ids:
        pool.block(b).fill_(os.getpid())
    u.HELD["kv"] = (pool, ids)
    return ids


def _outcome(fn):
    """("ok", value) or (exception class name, message); any other exception propagates."""
    try:
        return ("ok", fn())
    except CLEAR_ERRORS as e:
        return (type(e).__name__, str(e))


def use_after_scribble() -> dict:
    """Every operation a member has, after the scribble: each succeeds or
    raises a clear error. The member's own blocks must still carry its pid."""
    pool, ids = u.HELD["kv"]
    me = os.getpid()
    out = {"intact": all(bool(pool.block(b).eq(me).all()) for b in ids)}
    out["held"] = _outcome(pool.held)
    out["holder_of"] = _outcome(lambda: pool.holder_of(ids[0]))
    out["holders"] = _outcome(pool.holders)
    out["free_blocks"] = _outcome(lambda: pool.free_blocks)
    out["num_blocks"] = _outcome(lambda: pool.num_blocks)
    out["reclaim"] = _outcome(pool.reclaim)
    out["allocate"] = _outcome(lambda: pool.allocate(2))
    out["free"] = _outcome(lambda: pool.free(ids[:1]))
    out["gather"] = _outcome(lambda: pool.gather(ids).eq(me).all().item())
    torch_ipc.collect()  # the collector's reclaim runs too
    return out


def close_member() -> None:
    pool, _ = u.HELD.pop("kv")
    pool.close()


def attach_newcomer(data: bytes) -> tuple:
    def attach_and_close():
        pool = SharedKVPool.attach(data, SHAPE, torch.int64)
        pool.close()

    return _outcome(attach_and_close)


# ----------------------------------------------------------------------------- the scribbler


class Segment:
    """The pool's segment file, mapped by the test (the scribbler)."""

    def __init__(self, name: str, fields: dict):
        self.fields = fields
        fd = os.open("/dev/shm" + name, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)

    def offset(self, field: str, index: int = 0) -> int:
        offset, size = self.fields[field]
        return offset + index * (4 if field in ("holder", "free_stack") else 0)

    def read(self, offset: int, size: int) -> int:
        return int.from_bytes(self.map[offset:offset + size], "little")

    def write(self, offset: int, value: int, size: int) -> None:
        self.map[offset:offset + size] = (value % (1 << (8 * size))).to_bytes(size, "little")

    def set(self, field: str, value: int) -> None:
        self.write(self.fields[field][0], value, self.fields[field][1])

    def get(self, field: str) -> int:
        return self.read(*self.fields[field])

    def slot(self, index: int, field: str, value: int) -> None:
        start = self.fields["processes"][0] + index * self.fields["slot"][0]
        offset, size = self.fields["slot." + field]
        self.write(start + offset, value, size)

    def chunk(self, index: int, field: str, value) -> None:
        start = self.fields["chunks"][0] + index * self.fields["chunk"][0]
        offset, size = self.fields["chunk." + field]
        if isinstance(value, bytes):
            self.map[start + offset:start + offset + len(value)] = value
        else:
            self.write(start + offset, value, size)

    def table(self, field: str, index: int, value: int) -> None:
        self.write(self.fields[field][0] + 4 * index, value, 4)

    def fill_random(self, field: str, seed: int) -> None:
        offset, size = self.fields[field]
        self.map[offset:offset + size] = random.Random(seed).randbytes(size)


def _top_of_free_stack(seg: Segment) -> int:
    return seg.get("free_count") - 1


LIVE_LOCK = "lock word names a live thread"
# Each scenario: (what it writes, who must notice). "members": the owner or the
# third member raises; "newcomer": a process attaching afterwards is refused;
# None: the pool repairs itself or the write changes nothing that matters.
SCENARIOS = {
    "free stack top names a held block": (
        lambda seg, held: seg.table("free_stack", _top_of_free_stack(seg), held[0]), "members"),
    "free stack lists one block twice": (
        lambda seg, held: seg.table("free_stack", _top_of_free_stack(seg) - 1,
                                    seg.read(seg.offset("free_stack", _top_of_free_stack(seg)), 4)), "members"),
    "free stack entry past the blocks": (
        lambda seg, held: seg.table("free_stack", _top_of_free_stack(seg), 0xFFFFFFFF), "members"),
    "free count 2^40": (lambda seg, held: seg.set("free_count", 1 << 40), "members"),
    "free count 0": (lambda seg, held: seg.set("free_count", 0), "members"),
    "num_blocks 2^40": (lambda seg, held: seg.set("num_blocks", 1 << 40), "members"),
    "num_chunks 1000": (lambda seg, held: seg.set("num_chunks", 1000), "members"),
    "chunk count 2^40": (lambda seg, held: seg.chunk(0, "count", 1 << 40), "members"),
    "holder word out of range": (lambda seg, held: seg.table("holder", held[0], 0xFFFFFFFF), "members"),
    "holder word names another member": (lambda seg, held: seg.table("holder", held[0], 2), "members"),
    "holder word cleared": (lambda seg, held: seg.table("holder", held[0], 0), "members"),
    "holder word names a free slot": (lambda seg, held: seg.table("holder", held[0], 77), "members"),
    "slot count 2^63": (lambda seg, held: seg.slot(0, "held", 1 << 63), "members"),
    "owner's slot cleared": (lambda seg, held: seg.slot(0, "in_use", 0), "members"),
    "slot in_use garbage": (lambda seg, held: seg.slot(9, "in_use", 7), "members"),
    LIVE_LOCK: (lambda seg, held: seg.set("mutex.lock_word", os.getpid()), "members"),
    "lock word says its owner died": (lambda seg, held: seg.set("mutex.lock_word", 0x40000000), None),
    "lock type word": (lambda seg, held: seg.set("mutex.kind", 0x20), "members"),
    "lock's robust list pointers": (lambda seg, held: seg.fill_random("mutex.robust_list", 1), None),
    "max_blocks 2^40": (lambda seg, held: seg.set("max_blocks", 1 << 40), "newcomer"),
    "max_blocks 2": (lambda seg, held: seg.set("max_blocks", 2), "newcomer"),
    "ndim 100": (lambda seg, held: seg.set("ndim", 100), "newcomer"),
    "dtype 1000": (lambda seg, held: seg.set("dtype", 1000), "newcomer"),
    "magic": (lambda seg, held: seg.set("magic", 0), "newcomer"),
    "chunk descriptor length": (lambda seg, held: seg.chunk(0, "descriptor_bytes", 0xFFFFFFFF), "newcomer"),
    "chunk descriptor bytes": (lambda seg, held: seg.chunk(0, "descriptor", random.Random(2).randbytes(64)),
                               "newcomer"),
    "random process slots": (lambda seg, held: seg.fill_random("processes", 3), "members"),
    "random holder table": (lambda seg, held: seg.fill_random("holder", 4), "members"),
    "random free stack": (lambda seg, held: seg.fill_random("free_stack", 5), "members"),
    "random chunk table": (lambda seg, held: seg.fill_random("chunks", 6), "members"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_scribbled_pool_raises_clear_errors_and_never_crashes(scenario, ipc_peers):
    scribble, noticed_by = SCENARIOS[scenario]
    owner, member = ipc_peers.get("owner"), ipc_peers.get("member")
    # Under a lock that is never released the newcomer's attach waits out the
    # default lock timeout (it has no pool to set one on yet): its process's
    # default is LOCK_TIMEOUT (TORCH_IPC_KV_LOCK_TIMEOUT; 10 s unset).
    newcomer = ipc_peers.get("newcomer", env={"TORCH_IPC_KV_LOCK_TIMEOUT": str(LOCK_TIMEOUT)})
    data, name, owner_ids, fields = owner.call(make_pool_and_hold)
    member_ids = member.call(attach_and_hold, data)
    seg = Segment(name, fields)
    try:
        scribble(seg, owner_ids)
        # The newcomer's attach waits beside the members, whose calls cannot
        # release the lock either.
        if scenario == LIVE_LOCK:
            newcomer.start_call(attach_newcomer, data)
        results = {"owner": owner.call(use_after_scribble), "member": member.call(use_after_scribble)}
        joined = newcomer.result() if scenario == LIVE_LOCK else newcomer.call(attach_newcomer, data)
    finally:
        seg.map.close()
    # Never a block that somebody holds: the owner went first (allocate 2,
    # free its first block), then the member.
    held = set(owner_ids) | set(member_ids)
    for who, r in results.items():
        assert r["intact"], f"{scenario}: the {who}'s blocks were overwritten: {r}"
        assert r["gather"] == ("ok", True) or r["gather"][0] != "ok", r
        if r["allocate"][0] == "ok":
            taken = set(r["allocate"][1])
            assert len(taken) == 2 and not taken & held, f"{scenario}: {who} got held blocks: {r}"
            held |= taken
        if who == "owner" and r["free"][0] == "ok":
            held.discard(owner_ids[0])
    errors = {res[0] for r in results.values() for res in r.values() if isinstance(res, tuple)} - {"ok"}
    if noticed_by == "members":
        assert errors & {"PoolCorruptedError", "TimeoutError"}, f"{scenario}: nobody noticed: {results}"
    elif noticed_by == "newcomer":
        assert joined[0] in ("PoolCorruptedError", "DescriptorError"), f"{scenario}: newcomer got {joined}"
    if scenario == LIVE_LOCK:
        assert joined[0] == "TimeoutError" and f"within {LOCK_TIMEOUT} s" in joined[1], joined
    if "PoolCorruptedError" in errors:
        message = next(res[1] for r in results.values() for res in r.values()
                       if isinstance(res, tuple) and res[0] == "PoolCorruptedError")
        assert "is corrupted" in message
    if "TimeoutError" in errors:
        message = next(res[1] for r in results.values() for res in r.values()
                       if isinstance(res, tuple) and res[0] == "TimeoutError")
        assert f"names thread {os.getpid()}" in message and f"within {LOCK_TIMEOUT} s" in message, message
    member.call(close_member)
    owner.call(close_member)
    assert owner.is_alive() and member.is_alive() and newcomer.is_alive()


# ----------------------------------------------------------------------------- chunk records are data


def test_a_chunk_record_holding_a_pickle_is_never_unpickled(tmp_path, ipc_peer):
    marker = str(tmp_path / "pickle-ran")
    with SharedKVPool(BLOCKS, SHAPE, torch.int64) as pool:
        descriptor = u.pickled_descriptor(marker)
        torch_ipc.loads(descriptor, weights_only=False).close()  # the bait works: a full unpickle runs it
        assert os.path.exists(marker)
        os.unlink(marker)
        seg = Segment(pool._state.name, pool._state.allocator.field_offsets())
        seg.chunk(0, "descriptor_bytes", len(descriptor))
        seg.chunk(0, "descriptor", descriptor)
        seg.map.close()
        joined = ipc_peer.call(attach_newcomer, torch_ipc.dumps(pool))
        assert joined[0] == "PoolCorruptedError" and "one tensor and nothing else" in joined[1], joined
        assert not os.path.exists(marker)


def test_a_chunk_record_of_a_strided_tensor_is_refused(ipc_peer):
    """Note [kv copies]: gather and scatter address a block from its chunk's
    start, so a chunk record must describe one contiguous tensor."""
    from torch_ipc import _serialize

    with SharedKVPool(BLOCKS, SHAPE, torch.int64) as pool:
        strided = torch.zeros(BLOCKS, *SHAPE, 2, dtype=torch.int64)[..., 0]  # the pool's shape, every other element
        exported = _serialize.export_single_tensor(strided, consumers=2)
        seg = Segment(pool._state.name, pool._state.allocator.field_offsets())
        seg.chunk(0, "descriptor_bytes", len(exported.data))
        seg.chunk(0, "descriptor", exported.data)
        seg.map.close()
        joined = ipc_peer.call(attach_newcomer, torch_ipc.dumps(pool))
        assert joined[0] == "PoolCorruptedError" and "not contiguous" in joined[1], joined
        exported.revoke()
