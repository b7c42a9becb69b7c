"""Channels handed to a process of other PID, network and IPC namespaces over
a socket at a path: with init_reductions(), CPU tensors through
multiprocessing's own connection (Listener/Client at a filesystem address);
and one end of a torch_ipc.Pipe sent over a torch_ipc Connection at a path
(its fds through the fd server: Note [fds for one fetch] in
csrc/os/fd_passing.cpp; multiprocessing's own fd sharing would need one
authkey and one temporary folder on both sides). Both ways the consumer maps the
producer's memory, and one SIGKILLed in its namespace is reclaimed. The
consumer runs tests/ns_child.py under unshare (tests/namespace_helpers.py)."""
import os
import secrets
from multiprocessing import connection as mpc

import ipc_test_utils as u
import torch
from namespace_helpers import NamespacedChild, needs_namespaces

import torch_ipc
from torch_ipc.testing import Peer

pytestmark = needs_namespaces()

# ----------------------------------------------------------------------------- producer functions


def _serve_multiprocessing(address: str, authkey: bytes) -> dict:
    torch_ipc.init_reductions()
    listener = mpc.Listener(address, authkey=authkey)
    conn = listener.accept()
    x = torch.zeros(4)
    conn.send(x)
    total = conn.recv()
    u.HELD["kept"] = (listener, conn, x)
    return dict(total=total, seen=x.tolist())


def _serve_pipe_end(address: str, authkey: bytes) -> dict:
    torch_ipc.init_reductions()  # tensors through torch_ipc, not torch's own fd sharing
    with torch_ipc.listen(address, authkey=authkey) as listener:
        with listener.accept() as conn:
            mine, theirs = torch_ipc.Pipe()
            conn.send(theirs)
            theirs.close()
            x = torch.zeros(4)
            mine.send(x)
            total = mine.recv()
    u.HELD["kept"] = (mine, x)
    return dict(total=total, seen=x.tolist())


def _take_both_ends(address: str, authkey: bytes) -> list:
    with torch_ipc.listen(address, authkey=authkey) as listener:
        with listener.accept() as conn:
            e0, e1 = conn.recv(), conn.recv()
            conn.send("got")
            try:
                conn.recv()  # until the other process has exited
            except EOFError:
                pass
    e0.send("after")
    return [e1.recv()]


def _exports() -> int:
    torch_ipc.collect()
    return torch_ipc.stats()["exports"]


# ----------------------------------------------------------------------------- tests


def _hand_over_and_kill(serve, job: str, address: str, key: bytes, *flags: str) -> None:
    with Peer(timeout=60) as producer:
        producer.start_call(serve, address, key)
        assert u.poll_until(lambda: os.path.exists(address), timeout=30)
        with NamespacedChild(job, address, key.hex(), "hold", *flags) as consumer:
            got = consumer.next()
            served = producer.result()
            assert got["values"] == [1.0] * 4 and served == dict(total=4.0, seen=[1.0] * 4), (got, served)
            assert got["pidns"] != os.stat("/proc/self/ns/pid").st_ino
            # Held by a living consumer that the producer cannot see by pid: kept.
            assert all(producer.call(_exports) >= 1 for _ in range(5)), "a living consumer's hold was reclaimed"
            consumer.kill()
            assert u.poll_until(lambda: producer.call(_exports) == 0, timeout=20), "a killed consumer's hold stayed"


def test_init_reductions_over_a_multiprocessing_connection_at_a_path(tmp_path):
    _hand_over_and_kill(_serve_multiprocessing, "mp_client", str(tmp_path / "mp.sock"), secrets.token_bytes(16))


def test_a_pipe_end_sent_over_a_connection_at_a_path(tmp_path):
    _hand_over_and_kill(_serve_pipe_end, "pipe_end", str(tmp_path / "conn.sock"), secrets.token_bytes(16))


def test_pipe_ends_used_by_a_process_of_another_namespace_that_exited(tmp_path):
    # Their claims named pid 1 of the other namespace, which here is init:
    # a claim names a life key (Note [one process per end] in csrc/os/channel.cpp).
    address, key = str(tmp_path / "pair.sock"), secrets.token_bytes(16)
    with Peer(timeout=60) as receiver:
        receiver.start_call(_take_both_ends, address, key)
        assert u.poll_until(lambda: os.path.exists(address), timeout=30)
        with NamespacedChild("pipe_pair", address, key.hex()) as child:
            assert child.next() == dict(pid=1, handed="got")
            child.wait()
        assert receiver.result() == ["after"]
