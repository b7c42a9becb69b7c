"""Lifetime across three processes: a tensor passed on by the process that
received it (a relay) keeps its leases and its delivery, and gives it back
when the relay dies or its own peer never loads it. On host memory so that it
runs everywhere; the same code paths serve CUDA memory. Forked children:
test_fork.py."""
import os
import time

import ipc_test_utils as u
import torch

import torch_ipc
from torch_ipc import _C, _serialize
from torch_ipc.testing import Peer

TIMEOUT = 120


def _relay(d1, d2):
    """Load two messages, send them on as one, drop our own views."""
    import torch_ipc

    y1, y2 = torch_ipc.loads(d1), torch_ipc.loads(d2)
    data = torch_ipc.dumps({"a": y1, "b": y2})
    del y1, y2
    return data


def _relay_one(d):
    import torch_ipc

    y = torch_ipc.loads(d)
    data = torch_ipc.dumps(y)
    del y
    return data


def _export(obj, consumers=1):
    """An _C.Export: its .data is what torch_ipc.dumps(obj) returns."""
    return _serialize.export_parts(*_serialize.split(obj), consumers=consumers)


def _live(exports):
    return [e for e in exports if e.live]


def _wait_live(exports, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        torch_ipc.collect()
        if _live(exports) == want:
            return True
        time.sleep(0.05)
    return False


def test_relayed_tensors_from_one_allocation_keep_both_leases():
    x = torch.arange(8.0)
    e1, e2 = _export(x[:4]), _export(x[4:])  # two exports, one allocation
    d1, d2, keys = e1.data, e2.data, [e1, e2]
    with Peer(timeout=TIMEOUT) as relay, Peer(timeout=TIMEOUT) as third:
        d3 = relay.call(_relay, d1, d2)
        info = _C.describe(d3)
        assert sorted(a["lease"] for a in info["allocs"]) == [0, 1], "one alloc record per lease"
        third.call(u.load, "z", d3)
        relay.close()  # the relay is gone; the third process still holds both
        torch_ipc.collect()  # would reclaim now what nobody holds
        assert _live(keys) == keys, "an export was reclaimed under a living holder"
        assert third.call(u.held_fingerprint, "z") == u.fingerprint({"a": x[:4], "b": x[4:]})
        third.call(u.drop, "z")
        assert _wait_live(keys, []), "exports not reclaimed after the last holder dropped them"


def test_owner_revoking_its_tokens_keeps_a_forwarded_delivery():
    x = torch.randn(16)
    key = _export(x)
    d = key.data
    with Peer(timeout=TIMEOUT) as relay, Peer(timeout=TIMEOUT) as third:
        d2 = relay.call(_relay_one, d)  # the relay loaded (took the token) and dropped
        key.revoke()  # as a closing connection to the relay would
        torch_ipc.collect()  # would reclaim now what nobody holds
        third.call(u.load, "y", d2)  # still deliverable: the relay's extra hold kept it
        assert third.call(u.held_fingerprint, "y") == u.fingerprint(x)
        third.call(u.drop, "y")
        relay.close()
        assert _wait_live([key], [])


def test_forwarded_delivery_is_given_back_if_the_relay_dies_first():
    x = torch.randn(16)
    key = _export(x)
    d = key.data
    with Peer(timeout=TIMEOUT) as relay:
        relay.call(_relay_one, d)  # never delivered
        assert key.live
        relay.kill()
    assert _wait_live([key], []), "the relay's pending delivery pinned the export"


def _relay_and_keep(d):
    """Load, send on, and keep holding our own view."""
    import torch_ipc

    y = torch_ipc.loads(d)
    globals()["_kept"] = y
    return torch_ipc.dumps(y)


def test_extra_loads_of_a_forwarded_descriptor_do_not_take_the_relays_own_hold():
    x = torch.randn(16)
    key = _export(x)
    d = key.data
    with Peer(timeout=TIMEOUT) as relay, Peer(timeout=TIMEOUT) as third:
        d2 = relay.call(_relay_and_keep, d)
        third.call(u.load, "a", d2)
        third.call(u.load, "b", d2)  # one load more than the relay sent it for
        third.call(u.drop)  # host memory: released before the call returns
        torch_ipc.collect()
        assert key.live, "reclaimed while the relay still holds its view"
        relay.close()
        assert _wait_live([key], [])


def _listen_and_hang_up(path, authkey):
    import torch_ipc

    with torch_ipc.listen(path, authkey=authkey) as listener:
        conn = listener.accept()
        assert conn.recv() == "next comes a tensor"
        assert conn.poll(60)  # the tensor's message has arrived (a close before it would break the relay's send)
        conn.close()  # without loading it
    return True


def _relay_over_connection(d, path, authkey):
    import torch_ipc

    y = torch_ipc.loads(d)
    conn = torch_ipc.connect(path, authkey=authkey)
    conn.send("next comes a tensor")
    conn.send(y)
    del y
    globals()["_conn"] = conn  # keep our end open: the peer hangs up
    return True


def test_relay_gives_back_a_delivery_its_peer_never_loaded(tmp_path):
    x = torch.randn(64)
    key = _export(x)
    d = key.data
    path, authkey = str(tmp_path / "sock"), os.urandom(16)
    with Peer(timeout=TIMEOUT) as relay, Peer(timeout=TIMEOUT) as hangs_up:
        hangs_up.start_call(_listen_and_hang_up, path, authkey)
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert relay.call(_relay_over_connection, d, path, authkey)
        assert hangs_up.result(TIMEOUT)
        # the relay lives on and keeps its end open; its collector sees the
        # peer's end closed and gives the undelivered tensor back
        assert _wait_live([key], []), "the relay kept a delivery nobody will load"


def test_a_connection_over_a_pipe_does_not_break_the_checks():
    from multiprocessing import Pipe

    from torch_ipc._process import self_process
    from torch_ipc.mp.connection import Connection, _check_peers

    a, b = Pipe(duplex=False)
    conn = Connection(a, self_process())
    conn._sent.append(_export(torch.zeros(2)))  # as if it had been sent on it
    _check_peers()  # must not raise
    assert conn._peer_closed() is False
    conn.close()
    b.close()
