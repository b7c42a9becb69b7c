"""Bounds on pinned memory and a way out: torch_ipc.export(...).revoke() (Note
[revoking an export] in torch_ipc/_export.py), a connection's
max_bytes_in_flight (Note [bytes in flight]) and send(timeout=...) (Note [send
time limit] in torch_ipc/mp/connection.py). CPU only."""
import time

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc.testing import Peer

AUTHKEY = b"revoke-and-limits"
JOIN_S = 30.0
_STATE = {}


def _load_and_hold(data: bytes) -> float:
    _STATE["held"] = torch_ipc.loads(data)
    return _STATE["held"][0].item()


def _read_held() -> float:
    return _STATE["held"][0].item()


def _drop_held() -> None:
    _STATE.pop("held", None)
    torch_ipc.collect()


def _try_load(data: bytes):
    try:
        torch_ipc.loads(data)
        return ("loaded", "")
    except Exception as e:  # reported to the test
        return (type(e).__name__, str(e))


def _live_exports() -> int:
    torch_ipc.collect()
    return torch_ipc.stats()["exports"]


@pytest.mark.parametrize("consumers", [2, None])
def test_revoke_refuses_later_loads_and_keeps_earlier_ones(consumers):
    t = torch.zeros(256)
    before = _live_exports()
    e = torch_ipc.export(t, consumers=consumers)
    assert isinstance(e, torch_ipc.Export) and e.live
    with Peer() as early, Peer() as late:
        assert early.call(_load_and_hold, e.data) == 0.0
        e.revoke()
        e.revoke()  # idempotent
        name, message = late.call(_try_load, e.data)
        assert name == "ReleasedError" and "revoked" in message, (name, message)
        t[0] = 5.0  # the early loader still has the same memory
        assert early.call(_read_held) == 5.0
        assert _live_exports() == before + 1, "reclaimed under a holder"
        early.call(_drop_held)
        assert u.poll_until(lambda: _live_exports() == before), "a revoked export stayed pinned after its holder let go"
    assert not e.live


@pytest.mark.parametrize("consumers", [1, 3, None])
def test_a_load_after_revoke_says_it_was_revoked(consumers, ipc_peer):
    t = torch.arange(4.0)
    e = torch_ipc.export(t, consumers=consumers)
    e.revoke()  # nobody holds it: reclaimed at once, and still said to be revoked
    assert not e.live
    with pytest.raises(torch_ipc.ReleasedError, match="revoked by its producer"):
        torch_ipc.loads(e.data)
    name, message = ipc_peer.call(_try_load, e.data)
    assert name == "ReleasedError" and "revoked by its producer" in message, message
    assert "consumers=N" not in message


def test_export_data_loads_as_dumps_does():
    t = torch.arange(8.0)
    e = torch_ipc.export({"t": t})
    got = torch_ipc.loads(e.data)["t"]
    t[3] = -1.0
    assert got[3].item() == -1.0


# ----------------------------------------------------------------------------- connections


def _connect_and_idle(address) -> int:
    _STATE["conn"] = torch_ipc.connect(address, authkey=AUTHKEY)
    return _STATE["conn"].peer_pid


def _recv_and_drop(n: int) -> None:
    for _ in range(n):
        got = _STATE["conn"].recv()
        del got
    torch_ipc.collect()


def _close_conn() -> None:
    _STATE.pop("conn").close()


def _connected_pair(peer, **listen_kwargs):
    listener = torch_ipc.listen(authkey=AUTHKEY, **listen_kwargs)
    peer.start_call(_connect_and_idle, listener.address)
    conn = listener.accept()
    peer.result(timeout=JOIN_S)
    return listener, conn


def test_max_bytes_in_flight_refuses_then_waits_for_the_peer(ipc_peer):
    block = 4096 * 4  # float32 x 4096
    listener, conn = _connected_pair(ipc_peer, max_bytes_in_flight=3 * block)
    with listener, conn:
        for _ in range(3):
            conn.send(torch.zeros(4096))
        assert conn.bytes_in_flight() == 3 * block
        with pytest.raises(torch_ipc.InFlightLimitError, match="max_bytes_in_flight"):
            conn.send(torch.zeros(4096))
        with pytest.raises(torch_ipc.InFlightLimitError, match="more than the connection's"):
            conn.send(torch.zeros(4 * 4096))
        ipc_peer.start_call(_recv_and_drop, 3)  # the peer reads and releases
        start = time.monotonic()
        conn.send(torch.zeros(4096), timeout=JOIN_S)  # waits for room, then sends
        assert time.monotonic() - start < 10
        ipc_peer.result(timeout=JOIN_S)
        ipc_peer.call(_recv_and_drop, 1)
        ipc_peer.call(_close_conn)


def test_send_timeout_to_a_peer_that_never_reads(ipc_peer):
    listener, conn = _connected_pair(ipc_peer)
    with listener, conn:
        big = torch.zeros(1)
        exports_before = torch_ipc.stats()["exports"]
        sent = 0
        with pytest.raises(TimeoutError, match="did not finish within its timeout"):
            while sent < 100000:
                start = time.monotonic()
                conn.send({"t": big, "pad": b"x" * 65536}, timeout=0.5)
                sent += 1
        took = time.monotonic() - start
        assert sent > 0 and took < 2.0, (sent, took)
        # what was sent stays pinned until the peer reads or goes; the refused one does not
        torch_ipc.collect()
        assert torch_ipc.stats()["exports"] == exports_before + sent
        ipc_peer.call(_close_conn)


def test_send_timeout_must_be_a_number_of_seconds(ipc_peer):
    listener, conn = _connected_pair(ipc_peer)
    with listener, conn:
        with pytest.raises(ValueError, match="timeout"):
            conn.send(torch.zeros(1), timeout=-1)
        ipc_peer.call(_close_conn)
