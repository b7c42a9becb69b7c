"""Tensors through channels: the tools people already use (multiprocessing
Queue, Pipe, Pool and connection) and torch_ipc's own Listener/Client; what
was sent to a reader that died unread is given back (Note [unread messages]
in torch_ipc/mp/_channels.py), and stats() shows the live exports with their
age meanwhile. Runs on CPU tensors everywhere and on CUDA tensors where a GPU
is present."""
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import time
from multiprocessing import AuthenticationError, Pipe
from multiprocessing.reduction import ForkingPickler

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc.testing import Peer

TIMEOUT = 60
RECLAIM_S = 5.0  # how long a producer may take to notice

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _state_dict(device, seed, layers=4):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(layers):
        sd[f"layers.{i}.w"] = torch.randn(64, 32, generator=g).to(device)
        sd[f"layers.{i}.b"] = torch.randn(64, generator=g).to(device)
    return sd


def _queue_child(q_in, q_out):
    import torch_ipc  # noqa: F401  (rebuilds what the parent's reducers made)

    msg = q_in.get(timeout=TIMEOUT)
    sd, note = msg["sd"], msg["note"]
    for t in sd.values():
        t.add_(1)  # the parent sees these writes
    if any(t.is_cuda for t in sd.values()):
        torch.cuda.synchronize()
    q_out.put({"note": note, "sums": {k: float(v.double().sum()) for k, v in sd.items()}})
    assert q_in.get(timeout=TIMEOUT) == "bye"


def _run_queue_roundtrip(device):
    torch_ipc.init_reductions()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_queue_child, args=(q_in, q_out))
    p.start()
    try:
        sd = _state_dict(device, seed=int.from_bytes(os.urandom(4), "little"))
        before = {k: v.clone() for k, v in sd.items()}
        q_in.put({"sd": sd, "note": "hello"})
        reply = q_out.get(timeout=TIMEOUT)
        assert reply["note"] == "hello"
        for k, v in sd.items():
            assert reply["sums"][k] == pytest.approx(float(before[k].double().sum() + v.numel()))
            assert torch.equal(v, before[k] + 1), "the child's write is not visible here"
        q_in.put("bye")
        p.join(TIMEOUT)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
        torch_ipc.restore_reductions()


@pytest.mark.parametrize("device", DEVICES)
def test_queue_shares_state_dict_both_ways(device):
    _run_queue_roundtrip(device)


def _pipe_child(conn):
    import torch_ipc  # noqa: F401

    x = conn.recv()
    x.mul_(3)
    if x.is_cuda:
        torch.cuda.synchronize()
    conn.send(("done", x.shape))
    conn.recv()


@pytest.mark.parametrize("device", DEVICES)
def test_pipe_shares_tensor(device):
    with torch_ipc.reductions():
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        p = ctx.Process(target=_pipe_child, args=(b,))
        p.start()
        try:
            x = torch.randn(1000, device=device)
            expected = x * 3
            a.send(x)
            assert a.poll(TIMEOUT)
            assert a.recv() == ("done", x.shape)
            assert torch.equal(x, expected)
            a.send("bye")
            p.join(TIMEOUT)
        finally:
            if p.is_alive():
                p.kill()


def _pool_fill(args):
    t, value = args
    t.fill_(value)
    if t.is_cuda:
        torch.cuda.synchronize()
    return value


def _pool_initializer():
    import torch_ipc

    torch_ipc.init_reductions()


@pytest.mark.parametrize("device", DEVICES)
def test_pool_workers_write_into_shared_tensors(device):
    with torch_ipc.reductions():
        chunks = [torch.zeros(256, device=device) for _ in range(4)]
        with mp.get_context("spawn").Pool(2, initializer=_pool_initializer) as pool:
            result = pool.map_async(_pool_fill, [(c, i + 1.0) for i, c in enumerate(chunks)])
            assert result.get(TIMEOUT) == [1.0, 2.0, 3.0, 4.0]
        for i, c in enumerate(chunks):
            assert torch.equal(c, torch.full_like(c, i + 1.0))


def test_message_without_tensors_is_plain_pickle():
    with torch_ipc.reductions():
        obj = {"a": [1, 2.5, "x"], "b": None}
        data = ForkingPickler.dumps(obj)
        assert pickle.loads(data) == obj
        assert b"torch_ipc" not in bytes(data)


def test_many_tensors_travel_as_one_descriptor():
    with torch_ipc.reductions():
        sd = _state_dict("cpu", seed=1, layers=8)
        data = bytes(ForkingPickler.dumps(sd))
        # one torch_ipc descriptor inside, holding all 16 tensors
        assert data.count(b"TIPC") == 1
        rebuilt = pickle.loads(data)
        assert rebuilt.keys() == sd.keys()
        for k in sd:
            assert rebuilt[k].data_ptr() == sd[k].data_ptr()


def test_init_and_restore_are_idempotent():
    torch_ipc.restore_reductions()
    torch_ipc.restore_reductions()
    original = ForkingPickler.__dict__["dumps"]
    original_reducer = ForkingPickler._extra_reducers.get(torch.Tensor)
    torch_ipc.init_reductions()
    installed = ForkingPickler.__dict__["dumps"]
    torch_ipc.init_reductions()
    assert ForkingPickler.__dict__["dumps"] is installed
    assert installed is not original
    torch_ipc.restore_reductions()
    assert ForkingPickler.__dict__["dumps"] is original
    assert ForkingPickler._extra_reducers.get(torch.Tensor) is original_reducer
    torch_ipc.restore_reductions()
    assert ForkingPickler.__dict__["dumps"] is original


def test_parameter_keeps_type_and_requires_grad():
    with torch_ipc.reductions():
        p = torch.nn.Parameter(torch.randn(5))
        frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
        out = pickle.loads(ForkingPickler.dumps({"p": p, "f": frozen}))
        assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
        assert type(out["f"]) is torch.nn.Parameter and not out["f"].requires_grad
        assert out["p"].data_ptr() == p.data_ptr()


# ---------------------------------------------------------------- Listener/Client


def _client_recv_and_write(address, authkey, n_messages):
    import torch_ipc

    sums = []
    with torch_ipc.connect(address, authkey=authkey) as conn:
        for _ in range(n_messages):
            obj = conn.recv()
            tensors = obj["sd"] if isinstance(obj, dict) else {"x": obj}
            for t in tensors.values():
                t.add_(1)
            if any(t.is_cuda for t in tensors.values()):
                torch.cuda.synchronize()
            sums.append(sorted(tensors))
        conn.send("done")
        conn.recv()  # wait until the server has checked
    return sums


def _client_wrong_key(address):
    import torch_ipc

    try:
        torch_ipc.connect(address, authkey=b"wrong key")
    except AuthenticationError as e:
        return "refused: " + str(e)
    return "accepted"


@pytest.mark.parametrize("device", DEVICES)
def test_listener_client_share_both_ways(device, ipc_peers):
    client = ipc_peers.get("client")
    key = os.urandom(16)
    with torch_ipc.listen(authkey=key) as listener:
        client.start_call(_client_recv_and_write, listener.address, key, 2)
        conn = listener.accept()
        sd = _state_dict(device, seed=3)
        before = {k: v.clone() for k, v in sd.items()}
        x = torch.randn(17, device=device)
        x_before = x.clone()
        conn.send({"sd": sd})
        conn.send(x)
        assert conn.poll(TIMEOUT) and conn.recv() == "done"
        for k in sd:
            assert torch.equal(sd[k], before[k] + 1)
        assert torch.equal(x, x_before + 1)
        conn.send("ok")
        assert client.result(TIMEOUT) == [sorted(sd), ["x"]]
        conn.close()


def _queued_connections(address) -> int:
    """How many connections wait, not yet accepted, at the Unix socket listening at `address`."""
    name = "@" + address[1:] if address.startswith("\0") else address
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    # columns: Num RefCount Protocol Flags Type St Inode Path; St 02: connecting
    return sum(1 for r in rows if len(r) == 8 and r[7] == name and r[5] == "02")


def test_wrong_authkey_is_refused_and_gets_nothing(ipc_peers):
    key = os.urandom(16)
    bad, good = ipc_peers.get("client"), ipc_peers.get("client-2")
    with torch_ipc.listen(authkey=key) as listener:
        bad.start_call(_client_wrong_key, listener.address)
        # let the bad client queue up first: accept() takes clients in order
        deadline = time.monotonic() + TIMEOUT
        while _queued_connections(listener.address) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _queued_connections(listener.address) == 1, "the bad client never connected"
        with pytest.warns(RuntimeWarning, match="refused"):
            # accept() skips the refused client; stop it with a good one
            good.start_call(_client_recv_and_write, listener.address, key, 0)
            conn = listener.accept()
            assert conn.poll(TIMEOUT) and conn.recv() == "done"
            conn.send("ok")
            good.result(TIMEOUT)
            conn.close()
        result = bad.result(TIMEOUT)
        assert result.startswith("refused"), result


def test_connect_requires_authkey():
    with pytest.raises(TypeError):
        torch_ipc.connect(("127.0.0.1", 1))  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        torch_ipc.connect(("127.0.0.1", 1), authkey=b"")


def _client_hold(address, authkey):
    import torch_ipc

    conn = torch_ipc.connect(address, authkey=authkey)
    held = conn.recv()
    conn.send("holding")
    globals()["_held"] = (conn, held)
    return held.shape[0]


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        torch_ipc.collect()
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("device", DEVICES)
def test_dead_client_releases_everything(device):
    key = os.urandom(16)
    # Exports of earlier tests in this process may still be on their way back:
    # let them go first, so that the count moves for this test's alone.
    _wait_for(lambda: torch_ipc.stats()["exports"] == 0, timeout=5.0)
    base = torch_ipc.stats()["exports"]
    with torch_ipc.listen(authkey=key) as listener:
        with Peer(timeout=TIMEOUT) as peer:
            peer.start_call(_client_hold, listener.address, key)
            conn = listener.accept()
            conn.send(torch.randn(1 << 16, device=device))  # loaded and held
            conn.send(torch.randn(8, device=device))  # never loaded
            assert conn.poll(TIMEOUT) and conn.recv() == "holding"
            assert peer.result(TIMEOUT) == 1 << 16
            assert torch_ipc.stats()["exports"] == base + 2
            peer.kill(signal.SIGKILL)
            assert _wait_for(lambda: torch_ipc.stats()["exports"] <= base), torch_ipc.stats()
            conn.close()


def _client_close_without_loading(address, authkey):
    import torch_ipc

    with torch_ipc.connect(address, authkey=authkey) as conn:
        conn.send("ready")
        assert conn.poll(TIMEOUT)  # the tensor has arrived; close without loading it
    return True


def test_peer_closing_gives_back_what_it_never_loaded(ipc_peers):
    client = ipc_peers.get("client")
    key = os.urandom(16)
    torch_ipc.collect()
    base = torch_ipc.stats()["exports"]
    with torch_ipc.listen(authkey=key) as listener:
        client.start_call(_client_close_without_loading, listener.address, key)
        conn = listener.accept()
        assert conn.recv() == "ready"
        conn.send(torch.randn(100))
        assert torch_ipc.stats()["exports"] == base + 1
        assert client.result(TIMEOUT)  # the client closed its end, its process lives on
        assert _wait_for(lambda: torch_ipc.stats()["exports"] == base), torch_ipc.stats()
        conn.close()


_CLIENT = {}


def _client_connect(address, authkey):
    import torch_ipc

    _CLIENT["conn"] = torch_ipc.connect(address, authkey=authkey)
    _CLIENT["conn"].send("ready")
    return True


def _client_recv_late():
    with _CLIENT.pop("conn") as conn:
        x = conn.recv()
        return x.tolist()


def test_send_then_close_still_delivers(ipc_peers):
    client = ipc_peers.get("client")
    key = os.urandom(16)
    with torch_ipc.listen(authkey=key) as listener:
        client.start_call(_client_connect, listener.address, key)
        conn = listener.accept()
        assert conn.recv() == "ready" and client.result(TIMEOUT)
        x = torch.randn(5)
        conn.send(x)
        conn.close()
        # the client reads only now, after the sender has closed its end
        assert client.call(_client_recv_late) == x.tolist()


# ---------------------------------------------------------------- messages nobody reads


def _send_unread(count: int, duplex: bool):
    """Send `count` tensors through a Pipe whose only reader is a process that
    never reads; return its pid and the exports it holds up."""
    torch_ipc.init_reductions()
    reader_end, writer_end = Pipe(duplex=duplex)
    reader = subprocess.Popen(["sleep", "600"], pass_fds=[reader_end.fileno()])
    reader_end.close()  # the reader process has the only reading end
    for i in range(count):
        writer_end.send(torch.full((1000,), i, dtype=torch.int64))
    u.HELD["unread"] = (writer_end, reader)
    return reader.pid, torch_ipc.stats()


def _reap_reader() -> int:
    writer_end, reader = u.HELD["unread"]
    return reader.wait(120)


@pytest.mark.parametrize("duplex", [False, True], ids=["pipe", "socketpair"])
def test_messages_of_a_dead_reader_are_given_back(ipc_peer, duplex):
    count = 10
    reader, s = ipc_peer.call(_send_unread, count, duplex)
    assert s["exports"] == count and s["tokens_pending"] == count, s
    time.sleep(0.3)  # several collections: a living reader keeps its messages
    s = ipc_peer.call(u.stats)
    assert s["exports"] == count, f"given back while the reader lives: {s}"
    oldest = s["oldest_exports"]
    assert len(oldest) == count and all(e["age_s"] >= 0.3 and e["bytes"] == 8000 for e in oldest), oldest
    assert [e["age_s"] for e in oldest] == sorted((e["age_s"] for e in oldest), reverse=True)
    os.kill(reader, signal.SIGKILL)
    assert ipc_peer.call(_reap_reader) == -signal.SIGKILL
    s = ipc_peer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)
    assert s["exports"] == 0 and s["oldest_exports"] == [], f"kept after the reader died: {s}"
