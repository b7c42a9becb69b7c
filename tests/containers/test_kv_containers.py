"""The KV pool between processes of different PID, network and IPC namespaces
(containers sharing /dev/shm and a uid). Its process slots name each process
by life key and PID namespace too (Note [pool slots across PID namespaces] in
csrc/features/kv/pool_segment.h): a living peer of another namespace keeps its
blocks, one SIGKILLed in its namespace gives them back, and a dead owner is
gone for those who attach after it. Peers in other namespaces run
tests/ns_child.py under unshare (tests/namespace_helpers.py)."""
import os
import secrets

import ipc_test_utils as u
import pytest
import torch
from namespace_helpers import NamespacedChild, needs_namespaces

import torch_ipc
from torch_ipc.kv import SharedKVPool
from torch_ipc.testing import Peer

pytestmark = needs_namespaces()

SHAPE = (2, 4)  # ns_child.KV_SHAPE
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _attach_error(data: bytes) -> str:
    try:
        SharedKVPool.attach(data, SHAPE, torch.int32).close()
    except Exception as e:  # the test checks which error
        return type(e).__name__
    return "attached"


@pytest.mark.parametrize("device", DEVICES)
def test_a_peer_in_other_namespaces_keeps_its_blocks_and_returns_them_when_killed(tmp_path, device):
    path = str(tmp_path / "pool.tipc")
    with SharedKVPool(8, SHAPE, torch.int32, device) as pool:
        mine = pool.allocate(2)
        with open(path, "wb") as f:
            f.write(torch_ipc.dumps(pool))
        with NamespacedChild("kv_attach", path, "4", timeout=120) as peer:
            got = peer.next()
            assert got["pidns"] != os.stat("/proc/self/ns/pid").st_ino and got["device"].startswith(device)
            # The peer cannot see this process's pid; it must not take it for dead.
            assert got["reclaimed"] == 0 and got["free"] == 2 and got["holders"] == 2, got
            # Nor this process the peer's (its number here is another process, or none).
            assert sum(pool.reclaim() for _ in range(3)) == 0
            for _ in range(3):
                torch_ipc.collect()
            assert pool.free_blocks == 2 and sorted(pool.held()) == sorted(mine)
            assert pool.holder_of(got["ids"][0]) == got["pid"]  # its pid in its own namespace
            assert bool(pool.gather(got["ids"]).eq(got["pid"]).all())
            life = {ident[2] for ident, _ in pool._state.allocator.holder_identities()}
            assert torch_ipc._C.self_identity()[2] in life and len(life) == 2 and 0 not in life
            peer.kill()
        assert u.poll_until(lambda: (pool.reclaim(), pool.free_blocks == 6)[1], timeout=20), pool.holders()
        assert pool.holders() == {os.getpid(): 2}


def test_an_owner_in_other_namespaces_is_judged_by_its_life_file(tmp_path):
    path = str(tmp_path / "pool.tipc")
    with NamespacedChild("kv_own", path, timeout=120) as owner:
        made = owner.next()
        data = open(path, "rb").read()
        pool = SharedKVPool.attach(data, SHAPE, torch.int32)
        try:
            assert pool.free_blocks == 5
            assert sum(pool.reclaim() for _ in range(3)) == 0, "a living owner's blocks were reclaimed"
            assert bool(pool.gather(made["ids"]).eq(7).all())
            ids = pool.allocate(5)
            pool.scatter(ids, torch.full((5, *SHAPE), 9, dtype=torch.int32))
            owner.kill()
            # Its blocks come back; the memory of a CPU pool stays with those attached.
            assert u.poll_until(lambda: (pool.reclaim(), pool.free_blocks == 3)[1], timeout=20), pool.holders()
            assert bool(pool.gather(ids).eq(9).all())
            assert pool.holders() == {os.getpid(): 5}
        finally:
            pool.close()
    # A process that attaches after the owner died is told so.
    with Peer(timeout=60) as late:
        assert late.call(_attach_error, data) == "ProducerGoneError"


def test_blocks_handed_over_to_a_peer_in_other_namespaces(tmp_path):
    # The hand-over names its sender by slot, pid, start time and life key;
    # the reader takes the blocks over from a sender whose pid it cannot see.
    address, key = str(tmp_path / "kv.sock"), secrets.token_bytes(16)
    with SharedKVPool(8, SHAPE, torch.int32) as pool, torch_ipc.listen(address, authkey=key) as listener:
        with NamespacedChild("kv_recv", address, key.hex(), timeout=120) as reader:
            with listener.accept() as conn:
                conn.send(pool)
                ids = pool.allocate(3)
                pool.scatter(ids, torch.full((3, *SHAPE), 5, dtype=torch.int32))
                pool.send(ids, conn, meta="prefill done")
                got = reader.next()
            assert got["ids"] == ids and got["held"] == sorted(ids) and got["meta"] == "prefill done", got
            assert got["seen"] == [5] * (3 * 2 * 4)
            assert pool.held() == [] and pool.holder_of(ids[0]) == got["pid"] and pool.free_blocks == 5
            assert pool.reclaim() == 0
            reader.kill()
        assert u.poll_until(lambda: (pool.reclaim(), pool.free_blocks == 8)[1], timeout=20), pool.holders()


def test_a_pool_of_the_previous_layout_is_refused_clearly():
    pool = SharedKVPool(2, SHAPE, torch.int32)
    try:
        name = pool._state.name
        offset, size = pool._state.allocator.field_offsets()["magic"]
        assert size == 8
        with open(f"/dev/shm{name}", "r+b") as f:  # what torch_ipc before version 3 of the layout wrote
            f.seek(offset)
            f.write(b"TIPCKV02")
        with pytest.raises(torch_ipc.DescriptorError, match="layout version 2, made by another torch_ipc version"):
            torch_ipc._C.BlockAllocator.attach(name, *torch_ipc._C.self_process())
    finally:
        pool.close()
