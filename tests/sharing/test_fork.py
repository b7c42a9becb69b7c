"""Forked children: a child forked from a process that shares has its own
identity, shares both ways, never releases its parent's holds nor removes its
parent's segments, and cannot use CUDA (torch's error); real programs that
fork (DataLoader workers, a Pool created after use, mp.Process with the
default context, forks while the collector runs) work and never hang.

CPU everywhere; the ``cuda`` tests run where there is a GPU.
"""
import gc
import multiprocessing as mp
import os
import subprocess
import sys

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc import _C, _serialize
from torch_ipc.testing import Peer

TIMEOUT = 120
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _run_forked(target, *args):
    """Run target(conn, *args) in a forked child; return what it sent."""
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    with u.running(ctx.Process(target=target, args=(b, *args))):
        assert a.poll(TIMEOUT), "the forked child sent nothing"
        return a.recv()


# ----------------------------------------------------------------------------- fork: identity


def _child_identity(conn, parent_d):
    """In a forked child: who am I, what did I inherit, can I share both ways."""
    before = torch_ipc.stats()
    y = torch_ipc.loads(parent_d)  # the parent's tensor, through the parent's lease
    y.add_(1)
    mine = torch.full((4,), 7.0)
    d = torch_ipc.dumps(mine, consumers=1)
    conn.send(
        {
            "self": tuple(_C.self_process()),
            "before": before,
            "after": torch_ipc.stats(),
            "descriptor": d,
            "my_segments": u.shm_files_of(os.getpid()),
        }
    )
    assert conn.poll(TIMEOUT)  # keep `mine` alive until the parent loaded it
    conn.recv()
    conn.close()


@needs_fork
def test_forked_child_has_its_own_identity_and_shares_both_ways(ipc_peer):
    x = torch.zeros(8)
    key = _serialize.export_object(x, consumers=2)
    d, _, _ = ipc_peer.call(u.export_random, "w", (16,))
    holds_before = torch_ipc.stats()["imports"]
    u.load("w", d)  # a hold at the peer: the child must not inherit it
    parent_before = torch_ipc.stats()
    assert parent_before["imports"] == holds_before + 1
    parent_segments = u.shm_files_of(os.getpid())
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    with u.running(ctx.Process(target=_child_identity, args=(b, key.data))) as p:
        assert a.poll(TIMEOUT), "the forked child sent nothing"
        out = a.recv()
        # The child's message loads here: its own export, its own lease segment.
        z = torch_ipc.loads(out["descriptor"])
        assert torch.equal(z, torch.full((4,), 7.0))
        del z
        a.send("done")
    assert out["self"] != tuple(_C.self_process())
    assert out["self"][0] == p.pid
    before = out["before"]
    assert (before["exports"], before["imports"], before["lease_segments"], before["host_segments"]) == (0, 0, 0, 0), before
    assert out["after"]["exports"] == 1
    assert out["my_segments"] and all(n.startswith(f"torch_ipc.{p.pid}.") for n in out["my_segments"])
    assert torch.equal(x, torch.ones(8)), "the child's write did not reach the parent"
    assert key.live, "the child released the parent's export"
    assert set(parent_segments) <= set(u.shm_files_of(os.getpid())), "the child unlinked the parent's names"
    s = torch_ipc.stats()
    assert (s["exports"], s["imports"]) == (parent_before["exports"], parent_before["imports"])
    assert ipc_peer.call(u.collect)["holders"] == 1, "the child released our hold"
    u.drop("w")


def _drop_inherited_and_exit(conn, key):
    u.HELD.pop(key)  # the parent's hold, seen from the child
    gc.collect()
    torch_ipc.collect()
    conn.send(torch_ipc.stats()["imports"])
    conn.close()


@needs_fork
def test_forked_child_never_releases_the_parents_hold():
    with Peer(timeout=TIMEOUT) as producer:
        d, _, _ = producer.call(u.export_random, "x", (64,))
        holds_before = torch_ipc.stats()["imports"]
        u.load("x", d)  # this process holds the producer's export
        try:
            assert torch_ipc.stats()["imports"] == holds_before + 1
            assert _run_forked(_drop_inherited_and_exit, "x") == 0  # the child holds nothing itself
            s = producer.call(u.collect)
            assert s["exports"] == 1 and s["holders"] == 1, s  # our hold survived the child
        finally:
            u.drop("x")
        s = producer.call(u.wait_for_stats, "exports", 0)
        assert s["exports"] == 0, "released by us, the export was not reclaimed"


@needs_fork
def test_forked_child_dropping_a_shared_tensor_keeps_the_parents_segment():
    x = torch.arange(1000.0)
    key = _serialize.export_parts(*_serialize.split(x), consumers=1)
    d = key.data
    with Peer(timeout=TIMEOUT) as consumer:
        consumer.call(u.load, "x", d)
        consumer.call(u.drop, "x")
        assert u.collect_until(lambda: not key.live)
        segments = [n for n in u.shm_files_of(os.getpid()) if ".H" in n]
        assert segments, "x lives in a shared memory segment of ours"
        pid = os.fork()
        if pid == 0:  # the child drops its copy of x and exits
            try:
                del x
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert set(segments) <= set(u.shm_files_of(os.getpid())), "the child removed our segment"
        consumer.call(u.load, "x", torch_ipc.dumps(x))  # shared again, same segment
        assert consumer.call(u.held_fingerprint, "x") == u.fingerprint(x)


# ----------------------------------------------------------------------------- fork: real programs


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((3,), float(i * i)), i


@needs_fork
def test_dataloader_with_fork_workers_over_three_epochs():
    torch_ipc.dumps(torch.ones(1))  # the process used torch_ipc before its workers fork
    loader = torch.utils.data.DataLoader(
        _Squares(), batch_size=4, num_workers=2, multiprocessing_context="fork", timeout=TIMEOUT
    )
    with torch_ipc.reductions():
        for epoch in range(3):
            seen = []
            for values, index in loader:
                assert _C.is_torch_ipc_storage(values), "the batch did not come through torch_ipc"
                assert torch.equal(values, (index.float() ** 2)[:, None].expand(-1, 3))
                seen += index.tolist()
            assert sorted(seen) == list(range(24)), f"epoch {epoch}"


def _fill(buffer, value):
    buffer.fill_(value)
    return os.getpid()


@needs_fork
def test_fork_pool_created_after_use_fills_shared_buffers_in_place():
    buffers = [torch.zeros(1000) for _ in range(6)]
    with torch_ipc.reductions():
        torch_ipc.loads(torch_ipc.dumps(buffers[0]))  # used before the pool forks
        with mp.get_context("fork").Pool(2) as pool:
            pids = pool.starmap_async(_fill, [(b, i + 1) for i, b in enumerate(buffers)]).get(TIMEOUT)
    assert os.getpid() not in pids
    for i, b in enumerate(buffers):
        assert torch.equal(b, torch.full((1000,), float(i + 1))), i


def _echo_plus_one(inbox, outbox, loaded):
    x = inbox.get(timeout=TIMEOUT)
    x.add_(1)  # in place: the parent sees it
    outbox.put(torch.arange(5.0) * 3)  # a tensor of the child's own
    # A producer's exports end with it (a load after its exit is refused):
    # stay until the parent has loaded.
    assert loaded.wait(TIMEOUT)


FORK_WHILE_COLLECTING = """
import os, sys, time
import torch, torch_ipc
held = [torch_ipc.loads(torch_ipc.dumps(torch.zeros(64))) for _ in range(8)]  # work for collections
torch_ipc.collect()
for i in range(300):
    pid = os.fork()
    if pid == 0:  # what a Pool worker does first: export, collect, exit
        torch_ipc.dumps(torch.ones(4))
        torch_ipc.collect()
        os._exit(0)
    deadline = time.monotonic() + 10
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            sys.exit(f"forked child {i} hung")
        time.sleep(0.001)
print("ok")
"""


@needs_fork
def test_forks_while_the_collector_runs_never_hang():
    # Note [no first use at fork] (csrc/base/fork.h): a fork while the collector
    # thread held a lock or a first-use guard left the child waiting forever.
    env = dict(os.environ, TORCH_IPC_COLLECT_INTERVAL="0.0005")
    r = subprocess.run([sys.executable, "-c", FORK_WHILE_COLLECTING], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@needs_fork
def test_default_context_process_shares_cpu_tensors_both_ways():
    ctx = mp.get_context("fork")
    with torch_ipc.reductions():
        torch_ipc.dumps(torch.ones(1))
        inbox, outbox, loaded = ctx.Queue(), ctx.Queue(), ctx.Event()
        with u.running(ctx.Process(target=_echo_plus_one, args=(inbox, outbox, loaded))):
            x = torch.zeros(16)
            inbox.put(x)
            y = outbox.get(timeout=TIMEOUT)
            loaded.set()
    assert torch.equal(x, torch.ones(16))
    assert torch.equal(y, torch.arange(5.0) * 3)
    assert _C.is_torch_ipc_storage(y)


def _try_cuda_after_fork(conn, d, x):
    out = []
    for call in (lambda: torch_ipc.loads(d), lambda: torch_ipc.dumps(x)):
        try:
            call()
            out.append("ok")
        except RuntimeError as e:
            out.append(str(e))
    conn.send(out)
    conn.close()


@needs_fork
@pytest.mark.cuda
def test_cuda_in_a_forked_child_raises_torchs_error():
    x = torch.ones(4, device="cuda")
    key = _serialize.export_object(x, consumers=2)
    out = _run_forked(_try_cuda_after_fork, key.data, x)
    assert all("Cannot re-initialize CUDA in forked subprocess" in m for m in out), out
    assert key.live
    with Peer(timeout=TIMEOUT) as consumer:  # the parent's export is intact
        consumer.call(u.load, "x", key.data)
        assert consumer.call(u.held_fingerprint, "x") == u.fingerprint(x)
