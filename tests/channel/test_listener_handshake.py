"""Listener.accept() against clients that misbehave during the handshake, and
the peer pid a connection believes (Note [handshake time limit], Note [peer
pid] in torch_ipc/connection.py). CPU only; the clients are raw sockets, a
thread of this process, or another process."""
import os
import socket
import struct
import threading
import time
import warnings
from multiprocessing import connection as mpc

import torch

import torch_ipc

AUTHKEY = b"handshake-test-key"
JOIN_S = 30.0


def _accept_in_thread(listener):
    """Run listener.accept() in a thread (a test must not hang if it blocks)."""
    result = {}

    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["caught"] = caught  # filled as accept() warns
            try:
                result["conn"] = listener.accept()
            except BaseException as e:  # reported to the test
                result["error"] = e
        result["warnings"] = [str(w.message) for w in caught]

    thread = threading.Thread(target=run, name="accept", daemon=True)
    thread.start()
    return thread, result


def _raw_client(address) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address)
    return s


def test_hang_up_and_silent_clients_are_skipped():
    with torch_ipc.listen(authkey=AUTHKEY, handshake_timeout=0.5) as listener:
        silent = _raw_client(listener.address)  # connects, never says a word
        _raw_client(listener.address).close()  # connects and hangs up at once
        try:
            thread, result = _accept_in_thread(listener)
            with torch_ipc.connect(listener.address, authkey=AUTHKEY) as client:
                thread.join(JOIN_S)
                assert not thread.is_alive(), "accept() is blocked by a client that says nothing"
                assert "error" not in result, f"accept() raised {result['error']!r}"
                with result["conn"] as server:
                    client.send(torch.arange(5))
                    assert server.recv().tolist() == [0, 1, 2, 3, 4]
            # The silent client is refused at its deadline, reported by the next accept();
            # the one that hung up without a word is skipped without a warning (a probe).
            later, later_result = _accept_in_thread(listener)
            deadline = time.monotonic() + JOIN_S
            while len(result["warnings"]) + len(later_result.get("caught", ())) < 1:
                assert time.monotonic() < deadline, "the silent client was never refused"
                time.sleep(0.01)
        finally:
            silent.close()
    later.join(JOIN_S)
    assert isinstance(later_result.get("error"), OSError), later_result  # the listener closed
    refused = result["warnings"] + later_result["warnings"]
    assert len(refused) == 1, refused
    assert "did not finish the handshake within 0.5 s" in refused[0], refused


def test_hang_up_alone_does_not_raise():
    with torch_ipc.listen(authkey=AUTHKEY) as listener:
        _raw_client(listener.address).close()
        thread, result = _accept_in_thread(listener)
        with torch_ipc.connect(listener.address, authkey=AUTHKEY):
            thread.join(JOIN_S)
        assert "conn" in result, result
        result["conn"].close()


def test_handshake_timeout_must_be_positive():
    for bad in (0, -1.0):
        try:
            torch_ipc.listen(authkey=AUTHKEY, handshake_timeout=bad)
        except ValueError as e:
            assert "handshake_timeout" in str(e)
        else:
            raise AssertionError(f"handshake_timeout={bad} was accepted")


def _lying_client(address, authkey: bytes, claimed_pid: int) -> int:
    """Connect as a torch_ipc client that says it is `claimed_pid` (with its
    own start time); return the pid the listener says it is."""
    conn = mpc.Client(address, authkey=authkey)
    try:
        conn.send_bytes(struct.pack("<IQII", claimed_pid, torch_ipc._C.self_process()[1], 0, 0))
        return struct.unpack("<IQII", conn.recv_bytes(32))[0]
    finally:
        conn.close()


def test_peer_pid_comes_from_the_kernel_not_from_the_peer(ipc_peer):
    with torch_ipc.listen(authkey=AUTHKEY) as listener:
        ipc_peer.start_call(_lying_client, listener.address, AUTHKEY, 1)  # "I am init"
        with listener.accept() as conn:
            assert conn.peer_pid == ipc_peer.pid != 1
        assert ipc_peer.result() == os.getpid()


def _connect_and_report(address, authkey: bytes) -> int:
    with torch_ipc.connect(address, authkey=authkey) as conn:
        return conn.peer_pid


def test_client_knows_the_listener_pid(ipc_peer):
    with torch_ipc.listen(authkey=AUTHKEY) as listener:
        ipc_peer.start_call(_connect_and_report, listener.address, AUTHKEY)
        with listener.accept() as conn:
            assert conn.peer_pid == ipc_peer.pid
        assert ipc_peer.result() == os.getpid()
