"""One liveness test everywhere: a process is its pid AND its start time
(torch_ipc._process), so a pid the kernel handed to another process never
passes for the one that had it: not for a connection's peer, not for a
weights subscriber's slot, not for the publisher."""
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import torch_ipc
from torch_ipc import _process
from torch_ipc.weights import _control as ctl

AUTHKEY = b"liveness"


def _recycled(process):
    """The same pid, another start time: what a recycled pid looks like."""
    pid, start_time, *rest = process  # (pid, start) or (pid, start, life key, PID namespace)
    return (pid, start_time + 100, *rest)  # a second later: a tick either way is the same process


def test_this_process_is_alive_and_a_recycled_pid_is_not():
    me = _process.self_process()
    assert me[0] == os.getpid() and me[1] > 0
    assert _process.alive(me)
    assert not _process.alive(_recycled(me))  # our pid runs, but not as that process


def test_a_reaped_child_is_dead():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = (child.pid, _start_time_of(child.pid))
        assert _process.alive(identity)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert not _process.alive(identity)


def _start_time_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22


def test_the_start_time_is_the_one_in_proc():
    assert _process.self_process()[1] == _start_time_of(os.getpid())


def _connected_pair():
    """(listener side, client side) of a torch_ipc connection inside this process."""
    listener = torch_ipc.listen(authkey=AUTHKEY)
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    t.start()
    client = torch_ipc.connect(listener.address, authkey=AUTHKEY)
    t.join(timeout=30)
    assert accepted, "accept() did not return"
    listener.close()
    return accepted[0], client


def test_a_connection_learns_its_peers_start_time():
    server, client = _connected_pair()
    try:
        assert server._peer == client._peer == _process.self_identity()
    finally:
        server.close()
        client.close()


def test_what_a_connection_sent_is_given_back_when_the_peers_pid_is_recycled():
    server, client = _connected_pair()
    try:
        x = torch.arange(8.0)
        client.send(x)
        torch_ipc.collect()
        (sent,) = client._sent
        assert sent.live  # the peer lives and may still read it
        client._peer = _recycled(client._peer)  # its pid now names another process
        deadline = time.monotonic() + 30
        while sent.live and time.monotonic() < deadline:  # the collector thread checks peers
            time.sleep(0.01)
        assert not sent.live
        assert client._sent == []
    finally:
        server.close()
        client.close()


@pytest.fixture
def weights_pair():
    """(publisher, its one attached subscriber, the publisher's end of the pipe), in this process."""
    pub = torch_ipc.weights.Publisher({"w": torch.zeros(4)}, max_subscribers=1)
    a, b = multiprocessing.Pipe()
    try:
        pub.attach(a)
        sub = torch_ipc.weights.Subscriber(b, timeout=30)
        yield pub, sub, a
        sub.close()
    finally:
        a.close()
        b.close()
        pub.close()


def _recycled_word() -> int:
    """A process word of our pid and a life key nobody holds: a process that died."""
    pid = _process.self_process()[0]
    key = next(k for k in range(0x1234567, 0x1235567) if not os.path.exists(f"/dev/shm/torch_ipc.life.{k:08x}"))
    return key << ctl._PID_BITS | pid


def test_a_weights_slot_held_by_a_dead_process_of_our_pid_is_taken_back(weights_pair):
    pub, sub, conn = weights_pair
    owner = ctl.slot_index(sub._slot, ctl.OWNER)
    assert pub._counters.load(owner) == ctl.self_word()
    assert pub.subscribers == 1
    pub._counters.store(owner, _recycled_word())  # our pid, another process
    assert pub.subscribers == 0
    assert pub.attach(conn) == sub._slot  # the only slot is free again


def test_a_publisher_whose_pid_is_recycled_is_gone(weights_pair):
    pub, sub, _ = weights_pair
    assert sub.publisher_alive()
    pub._counters.store(ctl.PUBLISHER, _recycled_word())
    sub._share.publisher = _recycled_word()
    assert not sub.publisher_alive()


def test_a_process_word_holds_pid_and_life_key():
    pid, _, key, _ = _process.self_identity()
    word = ctl.self_word()
    assert word > 0 and ctl.word_pid(word) == pid and word >> ctl._PID_BITS == key
    assert ctl.word_alive(word)
    assert not ctl.word_alive(0) and not ctl.word_alive(-1)
