"""torch_ipc as a drop-in for programs written for torch.multiprocessing:
fork-started workers (DataLoader, Pool, mp.Process), relays that never called
init_reductions(), torch's pickling rules (non-leaf refusal, meta, sparse,
storages) and descriptors loaded by any number of readers (consumers=None).

CPU everywhere; the ``cuda`` params and tests run where there is a GPU.
"""
import contextlib
import gc
import inspect
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import torch_ipc
from torch_ipc import _C, _serialize
from torch_ipc.testing import Peer

import ipc_test_utils as u

TIMEOUT = 120
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


_wait = u.wait_collected


@contextlib.contextmanager
def _running(p):
    """Start process p; join it at the end of the block (it must exit cleanly),
    killing it if it is still there."""
    p.start()
    try:
        yield p
        p.join(TIMEOUT)
        assert p.exitcode == 0, p.exitcode
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def _run_forked(target, *args):
    """Run target(conn, *args) in a forked child; return what it sent."""
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    with _running(ctx.Process(target=target, args=(b, *args))):
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
    with _running(ctx.Process(target=_child_identity, args=(b, key.data))) as p:
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


def _echo_plus_one(inbox, outbox):
    x = inbox.get(timeout=TIMEOUT)
    x.add_(1)  # in place: the parent sees it
    outbox.put(torch.arange(5.0) * 3)  # a tensor of the child's own


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
        inbox, outbox = ctx.Queue(), ctx.Queue()
        with _running(ctx.Process(target=_echo_plus_one, args=(inbox, outbox))):
            x = torch.zeros(16)
            inbox.put(x)
            y = outbox.get(timeout=TIMEOUT)
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


# ----------------------------------------------------------------------------- relays and spawned children


def _relay_through_forking_pickler(d):
    """What a relay's own Queue/Pipe does with what it received, without init_reductions()."""
    assert torch_ipc.mp._reductions._saved is None  # reductions not on here
    y = torch_ipc.loads(d)
    u.HELD["relayed"] = y
    own = torch.arange(3.0, device=y.device)
    return bytes(ForkingPickler.dumps(y)), bytes(ForkingPickler.dumps(own))


def _unpickle_and_write(key, data):
    y = pickle.loads(data)
    u.HELD[key] = y
    y.fill_(5)
    if y.is_cuda:
        torch.cuda.synchronize()
    return _C.is_torch_ipc_storage(y)


@pytest.mark.parametrize("device", DEVICES)
def test_relay_without_init_reductions_forwards_through_torch_ipc(device):
    x = torch.zeros(32, device=device)
    d = torch_ipc.dumps(x)
    with Peer(timeout=TIMEOUT) as relay, Peer(timeout=TIMEOUT) as third:
        forwarded, own = relay.call(_relay_through_forking_pickler, d)
        assert b"torch_ipc" in forwarded and b"torch.multiprocessing" not in forwarded
        assert b"torch_ipc" not in own, "a tensor torch_ipc does not own must go through torch"
        assert third.call(_unpickle_and_write, "y", forwarded)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(x, torch.full_like(x, 5))


def _reductions_are_on(queue):
    queue.put(torch_ipc.mp._reductions._saved is not None)


def test_spawned_children_inherit_init_reductions():
    ctx = mp.get_context("spawn")
    with torch_ipc.reductions():
        queue = ctx.Queue()
        with _running(ctx.Process(target=_reductions_are_on, args=(queue,))):
            on = queue.get(timeout=TIMEOUT)
    assert on is True
    assert "torch_ipc.reductions" not in mp.current_process()._config  # restored


# ----------------------------------------------------------------------------- torch's pickling rules


NON_LEAF = "Cowardly refusing to serialize non-leaf tensor which requires_grad"


@pytest.mark.parametrize("device", DEVICES)
def test_non_leaf_requiring_grad_is_refused_with_torchs_message(device):
    x = torch.ones(3, device=device, requires_grad=True)
    y = x * 2
    exports_before = torch_ipc.stats()["exports"]
    for obj in (y, {"y": y}, [1, y], {"meta": torch.empty(2, device="meta"), "y": y}):
        with pytest.raises(RuntimeError, match=NON_LEAF):
            torch_ipc.dumps(obj)
    with torch_ipc.reductions(), pytest.raises(RuntimeError, match=NON_LEAF):
        ForkingPickler.dumps((0, y))
    assert torch_ipc.stats()["exports"] == exports_before, "a refused message left an export"
    torch_ipc.loads(torch_ipc.dumps(y.detach()))  # detached, it goes


def test_meta_tensors_travel_as_their_shape():
    m = torch.empty(3, 4, device="meta", dtype=torch.float16).t()
    w = torch.nn.Parameter(torch.empty(5, device="meta"))
    for obj in (m, {"m": m, "cpu": torch.ones(2)}, [w, m]):
        back = torch_ipc.loads(torch_ipc.dumps(obj))
        got = back if isinstance(back, torch.Tensor) else (back["m"] if isinstance(back, dict) else back[1])
        assert got.is_meta and got.shape == (4, 3) and got.stride() == (1, 4) and got.dtype == torch.float16
    back = torch_ipc.loads(torch_ipc.dumps([w, m]))
    assert type(back[0]) is torch.nn.Parameter and back[0].requires_grad and back[0].is_meta


def _sparse_cases(device):
    dense = torch.zeros(4, 6, device=device)
    dense[0, 1], dense[2, 3], dense[3, 5] = 1.5, -2.0, 7.0
    cases = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc()}
    if device == "cpu":  # blocked layouts: where torch converts to them everywhere
        cases.update(bsr=dense.to_sparse_bsr((2, 2)), bsc=dense.to_sparse_bsc((2, 3)))
    return cases


def _sparse_summary(key, data):
    obj = torch_ipc.loads(data)
    u.HELD[key] = obj
    return {name: (str(t.layout), t.to_dense().cpu().tolist()) for name, t in obj.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_tensors_arrive_in_their_layout(device, ipc_peer):
    cases = _sparse_cases(device)
    got = ipc_peer.call(_sparse_summary, "s", torch_ipc.dumps(cases))
    assert got == {name: (str(t.layout), t.to_dense().cpu().tolist()) for name, t in cases.items()}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no mkldnn")
def test_a_layout_that_cannot_be_shared_is_named():
    with pytest.raises(TypeError, match="_mkldnn"):
        torch_ipc.dumps({"x": torch.randn(2, 2).to_mkldnn()})


def _write_storage(key, data, value):
    s = torch_ipc.loads(data)
    u.HELD[key] = s
    untyped = s._untyped_storage if isinstance(s, torch.TypedStorage) else s
    torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped).fill_(value)
    if untyped.is_cuda:
        torch.cuda.synchronize()
    return type(s).__name__, getattr(s, "dtype", None) and str(s.dtype), untyped.nbytes()


@pytest.mark.parametrize("device", DEVICES)
def test_typed_and_untyped_storages_share_memory(device, ipc_peer):
    x = torch.zeros(10, dtype=torch.int16, device=device)
    got = ipc_peer.call(_write_storage, "typed", torch_ipc.dumps(x._typed_storage()), 1)
    assert got == ("TypedStorage", "torch.int16", 20)
    assert torch.equal(x, torch.full_like(x, 0x0101))
    got = ipc_peer.call(_write_storage, "untyped", torch_ipc.dumps(x.untyped_storage()), 2)
    assert got == ("UntypedStorage", None, 20)
    assert torch.equal(x, torch.full_like(x, 0x0202))


def test_objects_without_tensors_pickle_as_before():
    plain = {"a": [1, 2.5, "x"], "b": (None, b"bytes")}
    before = bytes(ForkingPickler.dumps(plain))
    with torch_ipc.reductions():
        assert bytes(ForkingPickler.dumps(plain)) == before


def _event_round_trip(data):
    event = pickle.loads(data)
    return type(event).__name__, event.query()


@pytest.mark.cuda
def test_cuda_events_pickle_as_torch_pickles_them(ipc_peer):
    event = torch.cuda.Event(interprocess=True)
    event.record()
    with torch_ipc.reductions():
        data = bytes(ForkingPickler.dumps(event))
    assert b"torch.multiprocessing" in data
    torch.cuda.synchronize()
    assert ipc_peer.call(_event_round_trip, data) == ("Event", True)


# ----------------------------------------------------------------------------- any number of readers


def _load_write_check(key, data, index):
    y = torch_ipc.loads(data)
    u.HELD[key] = y
    y[index] = index + 1
    if y.is_cuda:
        torch.cuda.synchronize()
    return u.fingerprint(y)


@pytest.mark.parametrize("device", DEVICES)
def test_open_ended_descriptor_has_any_number_of_readers(device, ipc_peers):
    x = torch.zeros(8, device=device)
    tokens_before = torch_ipc.stats()["tokens_pending"]
    export = _serialize.export_object(x, consumers=None)
    for round_ in range(2):
        for i, name in enumerate(("a", "b", "c")):
            ipc_peers.get(name).call(_load_write_check, "x", export.data, i)
            ipc_peers.get(name).call(u.drop, "x")  # released: the next reader loads after it
        torch_ipc.collect()
        assert export.live, f"round {round_}: reclaimed while the producer holds x"
    expected = torch.zeros(8)
    expected[:3] = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(x.cpu(), expected)
    assert torch_ipc.stats()["tokens_pending"] == tokens_before  # it asks for no count of loads
    del x
    assert _wait(lambda: not export.live), "not reclaimed after the producer dropped x"
    assert ipc_peers.get("a").call(u.try_load, export.data)[0] == "ReleasedError"


@pytest.mark.parametrize("device", DEVICES)
def test_open_ended_export_outlives_its_producers_reference_while_read(device, ipc_peers):
    x = torch.zeros(8, device=device)
    export = _serialize.export_object(x, consumers=None)
    ipc_peers.get("a").call(_load_write_check, "x", export.data, 0)
    del x  # only reader a holds it now
    torch_ipc.collect()
    time.sleep(0.1)
    torch_ipc.collect()
    assert export.live, "reclaimed under a reader"
    ipc_peers.get("b").call(_load_write_check, "x", export.data, 1)  # a new reader still gets in
    assert ipc_peers.get("a").call(u.held_fingerprint, "x") == ipc_peers.get("b").call(u.held_fingerprint, "x")
    ipc_peers.get("a").call(u.drop, "x")
    torch_ipc.collect()
    assert export.live, "reclaimed while reader b holds it"
    ipc_peers.get("b").call(u.drop, "x")
    assert _wait(lambda: not export.live), "not reclaimed once every reader released it"
    assert ipc_peers.get("c").call(u.try_load, export.data)[0] == "ReleasedError"


def test_open_ended_export_of_a_tensor_sent_twice_still_ends():
    x = torch.zeros(8)
    open_ended = _serialize.export_object(x, consumers=None)
    counted = _serialize.export_object(x, consumers=1)  # the records' own references are not the producer's
    del x
    assert _wait(lambda: not open_ended.live)
    assert counted.live  # still waits for its one load
    counted.revoke()
    assert _wait(lambda: not counted.live)


def _relay_open_ended(d):
    y = torch_ipc.loads(d)
    u.HELD["y"] = y
    return torch_ipc.dumps(y, consumers=None)


def test_open_ended_forwarding_lets_many_load_while_the_relay_holds(ipc_peers):
    x = torch.zeros(8)
    d = torch_ipc.dumps(x)
    d2 = ipc_peers.get("relay").call(_relay_open_ended, d)
    for i, name in enumerate(("a", "b", "c")):
        ipc_peers.get(name).call(_load_write_check, "x", d2, i)
        ipc_peers.get(name).call(u.drop, "x")
    assert torch.equal(x[:3], torch.tensor([1.0, 2.0, 3.0]))
    ipc_peers.get("relay").call(u.drop, "y")
    assert _wait(lambda: torch_ipc.stats()["exports"] == 0 or torch_ipc.stats()["holders"] == 0)


def test_consumers_must_be_none_or_positive():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="consumers"):
            torch_ipc.dumps(torch.ones(1), consumers=bad)
    with pytest.raises(ValueError, match="isolated"):
        torch_ipc.dumps(torch.ones(1), consumers=None, isolated=True)


# ----------------------------------------------------------------------------- Client


def _serve_one(address, authkey):
    with torch_ipc.Listener(address, authkey=authkey) as listener:
        with listener.accept() as conn:
            x = conn.recv()
            x.add_(1)
            conn.send("done")
    return True


def test_client_has_the_signature_of_multiprocessing_client(tmp_path, ipc_peer):
    from multiprocessing import connection as mpc

    assert list(inspect.signature(torch_ipc.Client).parameters) == list(inspect.signature(mpc.Client).parameters)
    with pytest.raises(TypeError, match="authkey"):
        torch_ipc.Client(str(tmp_path / "nowhere"))
    address, authkey = str(tmp_path / "sock"), b"key"
    ipc_peer.start_call(_serve_one, address, authkey)
    assert _wait(lambda: os.path.exists(address))
    x = torch.zeros(4)
    with torch_ipc.Client(address, "AF_UNIX", authkey) as conn:
        conn.send(x)
        assert conn.recv() == "done"
    assert ipc_peer.result(TIMEOUT) is True
    assert torch.equal(x, torch.ones(4))
    assert torch_ipc.connect is not None and torch_ipc.listen is not None  # kept as aliases
