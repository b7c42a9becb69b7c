"""The shared-memory channel (Note [channel] in torch_ipc/mp/_ring.py):
torch_ipc.Pipe and torch_ipc's Connection once the rings run."""

import errno
import mmap
import multiprocessing as mp
import os
import pickle
import random
import select
import signal
import struct
import threading
import time
from multiprocessing import connection as mpc

import pytest
import torch

import torch_ipc
from torch_ipc import _C
from torch_ipc.mp._ring import RingConnection

TIMEOUT = 60.0
SMALL_RING = 4096
AUTHKEY = b"channel-test"


def _wait_until(cond, timeout=TIMEOUT, what="the condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.001)


def _stop(*procs):
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(TIMEOUT)


# ---------------------------------------------------------------- one process


def test_pipe_round_trip_and_mp_semantics():
    a, b = torch_ipc.Pipe()
    with a, b:
        a.send({"x": [1, 2, 3]})
        assert b.poll(TIMEOUT)
        assert b.recv() == {"x": [1, 2, 3]}
        assert not a.poll(0) and not b.poll(0.01)
        b.send_bytes(b"0123456789", 2, 5)
        assert a.recv_bytes() == b"23456"
        b.send_bytes(b"")
        assert a.recv_bytes() == b""
        buf = bytearray(8)
        b.send_bytes(b"abc")
        assert a.recv_bytes_into(buf, 4) == 3 and buf[4:7] == b"abc"
        b.send_bytes(b"too long")
        with pytest.raises(OSError, match="bad message length"):
            a.recv_bytes(maxlength=3)
        b.send_bytes(b"next")  # the long one was skipped whole: the stream is still in step
        assert a.recv_bytes() == b"next"
        with pytest.raises(ValueError):
            a.send_bytes(b"abc", 2, 5)
    with pytest.raises(OSError, match="closed"):
        a.send(1)


def test_one_way_pipe():
    r, w = torch_ipc.Pipe(duplex=False)
    with r, w:
        w.send_bytes(b"one way")
        assert r.recv_bytes() == b"one way"
        with pytest.raises(OSError):
            r.send_bytes(b"x")
        with pytest.raises(OSError):
            w.recv_bytes()


def test_messages_larger_than_the_ring_stream_through():
    a, b = torch_ipc.Pipe(ring_bytes=SMALL_RING)
    payload = os.urandom(10 * SMALL_RING + 123)
    received = []
    reader = threading.Thread(target=lambda: received.append(b.recv_bytes()))
    reader.start()
    a.send_bytes(payload)
    reader.join(TIMEOUT)
    assert received == [payload]
    a.close(), b.close()


def _send_numbered(end, sender, count, seed, sizes):
    rng = random.Random(seed)
    for seq in range(count):
        size = rng.choice(sizes)
        head = struct.pack("<II", sender, seq)
        end.send_bytes(head + bytes([(sender + seq) & 0xFF]) * size)


def _receive_numbered(end, count, out):
    last = {}
    for _ in range(count):
        data = end.recv_bytes()
        sender, seq = struct.unpack_from("<II", data)
        body = data[8:]
        assert body == bytes([(sender + seq) & 0xFF]) * len(body), "a message came back changed"
        assert seq > last.get(sender, -1), "a sender's messages came out of order"
        last[sender] = seq
        out.append((sender, seq))


def _stress_side(end, my_senders, peer_senders, per_sender, receivers, sizes):
    """Two threads send, `receivers` threads receive; returns what was received."""
    got = [[] for _ in range(receivers)]
    total_in = per_sender * len(peer_senders)
    counts = [total_in // receivers + (i < total_in % receivers) for i in range(receivers)]
    threads = [threading.Thread(target=_send_numbered, args=(end, s, per_sender, s, sizes)) for s in my_senders]
    threads += [threading.Thread(target=_receive_numbered, args=(end, counts[i], got[i])) for i in range(receivers)]
    errors = []

    def guarded(t):
        run = t.run
        def go():
            try:
                run()
            except BaseException as e:  # reported below
                errors.append(e)
        t.run = go
        return t

    for t in threads:
        guarded(t).start()
    for t in threads:
        t.join(TIMEOUT * 4)
        assert not t.is_alive(), "a stress thread hung"
    if errors:
        raise errors[0]
    return [m for g in got for m in g]


def _stress_child(end, per_sender, sizes):
    received = _stress_side(end, (2, 3), (0, 1), per_sender, 2, sizes)
    end.send(sorted(received))
    end.close()


# Note [the stress test's size]
# Races in the ring need its threads to run at the same time: with four
# threads on two cores they interleave only where the scheduler preempts
# them, so messages beyond ~500,000 there buy CPU time (~4 CPU-s of a suite
# that keeps both cores busy) rather than interleavings. Machines with 4 or
# more cores send 1,000,000; scripts/soak sends as many as asked, for hours.
_CORES = len(os.sched_getaffinity(0))
STRESS_MESSAGES = int(os.environ.get("TORCH_IPC_CHANNEL_STRESS", "1000000" if _CORES >= 4 else "500000"))


@pytest.mark.parametrize("start", ["fork"])
def test_ordered_no_loss_both_ways_two_threads_per_side(start):
    """STRESS_MESSAGES messages in all (1,000,000; 500,000 on fewer than 4 cores;
    TORCH_IPC_CHANNEL_STRESS=N sets it),
    half each way, two sending and two receiving threads per side, sizes from
    0 to 3x the ring."""
    sizes = [0, 1, 7, 64, 200, 1000, 3000, 3 * SMALL_RING]
    per_sender = STRESS_MESSAGES // 4
    ctx = mp.get_context(start)
    mine, theirs = torch_ipc.Pipe(ring_bytes=SMALL_RING)
    p = ctx.Process(target=_stress_child, args=(theirs, per_sender, sizes))
    p.start()
    theirs.close()
    try:
        received = _stress_side(mine, (0, 1), (2, 3), per_sender, 2, sizes)
        assert mine.poll(TIMEOUT * 4)
        child_received = mine.recv()
        p.join(TIMEOUT)
        assert p.exitcode == 0
    finally:
        _stop(p)
    assert sorted(received) == [(s, q) for s in (2, 3) for q in range(per_sender)]
    assert child_received == [(s, q) for s in (0, 1) for q in range(per_sender)]


# ---------------------------------------------------------------- children


def _echo_child(end, inherited=None):
    if inherited is not None:  # a forked child holds our end too: close it, or our close is no end of file
        inherited.close()
    while True:
        try:
            msg = end.recv()
        except EOFError:
            return
        end.send(("echo", msg))


def _tensor_child(end):
    import torch_ipc  # noqa: F401  (the reductions come on with the spawned child's config)

    t = end.recv()
    t.add_(1)
    if t.is_cuda:
        torch.cuda.synchronize()
    end.send("written")
    end.recv()


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_pipe_to_a_child(start):
    ctx = mp.get_context(start)
    mine, theirs = torch_ipc.Pipe()
    p = ctx.Process(target=_echo_child, args=(theirs, mine if start == "fork" else None))
    p.start()
    theirs.close()
    try:
        for i in range(100):
            mine.send(i)
            assert mine.recv() == ("echo", i)
        big = os.urandom(3 * torch_ipc.mp._ring.RING_BYTES)
        mine.send(big)
        assert mine.recv() == ("echo", big)
        mine.close()  # the child's recv raises EOFError and it exits
        p.join(TIMEOUT)
        assert p.exitcode == 0
    finally:
        _stop(p)


@pytest.mark.parametrize("start, device", [("fork", "cpu"), ("spawn", "cpu"),
                                           pytest.param("spawn", "cuda", marks=pytest.mark.cuda)])
def test_pipe_carries_tensors_zero_copy(start, device):
    with torch_ipc.reductions():
        ctx = mp.get_context(start)
        mine, theirs = torch_ipc.Pipe()
        p = ctx.Process(target=_tensor_child, args=(theirs,))
        p.start()
        theirs.close()
        try:
            x = torch.zeros(1024, device=device)  # 4 KiB
            mine.send(x)
            assert mine.poll(TIMEOUT) and mine.recv() == "written"
            assert torch.equal(x, torch.ones(1024, device=device))  # the child wrote into our memory
            mine.send("bye")
            p.join(TIMEOUT)
            assert p.exitcode == 0
        finally:
            _stop(p)
            mine.close()


def _send_forever(end, size):
    end.send_bytes(b"x" * size)  # larger than the ring: blocks until killed


def test_peer_killed_mid_message_gives_eof():
    ctx = mp.get_context("fork")
    mine, theirs = torch_ipc.Pipe(ring_bytes=SMALL_RING)
    p = ctx.Process(target=_send_forever, args=(theirs, 100 * SMALL_RING))
    p.start()
    theirs.close()
    try:
        assert mine.poll(TIMEOUT)  # the child is in the middle of its message
        os.kill(p.pid, signal.SIGKILL)
        p.join(TIMEOUT)
        start = time.monotonic()
        with pytest.raises(EOFError):
            mine.recv_bytes()
        assert time.monotonic() - start < 2.0
        with pytest.raises(BrokenPipeError):  # and a send to it does not hang either
            for _ in range(10):
                mine.send_bytes(b"y" * SMALL_RING)
    finally:
        _stop(p)
        mine.close()


def _recv_once(end, inherited):
    inherited.close()
    try:
        end.recv_bytes()
    except EOFError:
        os._exit(7)
    os._exit(1)


def test_close_while_the_other_side_waits():
    # another process waits in recv; we close
    ctx = mp.get_context("fork")
    mine, theirs = torch_ipc.Pipe()
    p = ctx.Process(target=_recv_once, args=(theirs, mine))
    p.start()
    theirs.close()
    try:
        _wait_until(lambda: _reader_sleeps(mine), what="the child sleeping in recv")
        start = time.monotonic()
        mine.close()
        p.join(TIMEOUT)
        assert p.exitcode == 7  # EOFError
        assert time.monotonic() - start < 2.0
    finally:
        _stop(p)
    # a thread of ours waits; the other end closes, then our own end
    for close_own in (False, True):
        a, b = torch_ipc.Pipe()
        raised = []

        def wait():
            try:
                a.recv_bytes()
            except (EOFError, OSError) as e:
                raised.append(e)

        t = threading.Thread(target=wait)
        t.start()
        _wait_until(lambda: _reader_sleeps(b), what="the thread sleeping in recv")  # a sleeper, not a spinner
        (a if close_own else b).close()
        t.join(2.0)
        assert not t.is_alive()
        assert len(raised) == 1
        assert isinstance(raised[0], OSError if close_own else EOFError)
        a.close(), b.close()


def _reader_sleeps(end):
    """Whether the other end sleeps waiting for our messages (its futex word is set)."""
    fds = end._channel.fds()
    ring = end._channel.side  # the ring we write is the one the other end reads
    with mmap.mmap(fds[0], 4096) as m:
        head, _ = _C.channel_ring_offsets(ring)
        return m[head + 128:head + 132] == b"\x01\x00\x00\x00"


# ---------------------------------------------------------------- trust


def _scribble(end, ring, which, value):
    fds = end._channel.fds()
    offsets = dict(zip(("head", "tail"), _C.channel_ring_offsets(ring)))
    with mmap.mmap(fds[0], 4096) as m:
        m[offsets[which]:offsets[which] + 8] = struct.pack("<Q", value)


@pytest.mark.parametrize("which", ["head", "tail"])
def test_scribbled_ring_index_is_a_clear_error(which):
    a, b = torch_ipc.Pipe(ring_bytes=SMALL_RING)
    a.send_bytes(b"hello")
    _scribble(a, 0, which, 1 << 40)
    with pytest.raises(OSError, match="impossible indices") as e:
        if which == "head":
            b.recv_bytes()  # the reader checks the head it reads
        else:
            a.send_bytes(b"more")  # the writer checks the tail it reads
    assert e.value.errno == errno.EPROTO
    a.close(), b.close()


def test_scribbled_message_length_is_a_clear_error():
    a, b = torch_ipc.Pipe(ring_bytes=SMALL_RING)
    a.send_bytes(b"hello")
    with mmap.mmap(a._channel.fds()[0], 4096 + SMALL_RING) as m:
        m[4096:4104] = struct.pack("<Q", 1 << 60)  # the first frame's length
    with pytest.raises(OSError, match="impossible message length"):
        b.recv_bytes()
    a.close(), b.close()


def _segment(ring_bytes=SMALL_RING):
    memory, bell0, bell1 = _C.channel_segment(ring_bytes)
    sock_a, sock_b = __import__("socket").socketpair()
    sock_b.close()
    return memory, sock_a.detach(), bell0, bell1


def test_segment_checks_refuse_what_another_end_could_abuse(tmp_path):
    memory, sock, bell0, bell1 = _segment()
    os.fchmod(memory, 0o644)
    with pytest.raises(PermissionError, match="mode"):
        _C.Channel(memory, sock, bell0, bell1, 1, SMALL_RING)
    memory, sock, bell0, bell1 = _segment()
    with pytest.raises(PermissionError, match="bytes, not"):
        _C.Channel(memory, sock, bell0, bell1, 1, 2 * SMALL_RING)  # another geometry than the segment's
    memory, sock, bell0, bell1 = _segment()
    os.close(memory)
    memory = os.memfd_create("unsealed")
    os.fchmod(memory, 0o600)
    os.ftruncate(memory, 4096 + 2 * SMALL_RING)
    with pytest.raises(PermissionError, match="sealed"):
        _C.Channel(memory, sock, bell0, bell1, 1, SMALL_RING)
    memory, sock, bell0, bell1 = _segment()
    os.close(bell1)
    bell1 = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    with pytest.raises(PermissionError, match="not a pipe"):
        _C.Channel(memory, sock, bell0, bell1, 1, SMALL_RING)
    assert os.path.getsize(tmp_path / "file") == 0


# ---------------------------------------------------------------- Connection


def _client_echo(address, count):
    with torch_ipc.connect(address, authkey=AUTHKEY) as conn:
        assert isinstance(conn._conn, RingConnection)
        for _ in range(count):
            conn.send_bytes(conn.recv_bytes())
        x = conn.recv()
        x.mul_(2)
        conn.send("doubled")
        conn.recv()


def _accept_client(peer, client, *args):
    """The connection from `client(address, *args)`, started in `peer`."""
    with torch_ipc.listen(authkey=AUTHKEY) as listener:
        peer.start_call(client, listener.address, *args)
        return listener.accept()


def test_connection_rides_the_rings_and_shares_tensors(ipc_peer):
    with _accept_client(ipc_peer, _client_echo, 50) as conn:
        assert isinstance(conn._conn, RingConnection)
        for i in range(50):
            conn.send_bytes(b"m%d" % i)
            assert conn.recv_bytes() == b"m%d" % i
        x = torch.ones(100)
        conn.send(x)
        assert conn.recv() == "doubled"
        assert torch.equal(x, torch.full((100,), 2.0))
        conn.send(None)
        ipc_peer.result()


def _client_sends_later(address, delay):
    with torch_ipc.connect(address, authkey=AUTHKEY) as conn:
        conn.recv()  # go
        time.sleep(delay)
        conn.send("late")
        conn.send("second")
        conn.recv()


def test_connection_fileno_works_with_select_and_wait(ipc_peer):
    with _accept_client(ipc_peer, _client_sends_later, 0.2) as conn:
        fd = conn.fileno()
        assert select.select([fd], [], [], 0)[0] == []
        conn.send("go")
        assert select.select([fd], [], [], TIMEOUT)[0] == [fd]
        assert conn.recv() == "late"
        assert mpc.wait([conn], TIMEOUT) == [conn]  # the second one is there
        assert conn.recv() == "second"
        assert select.select([fd], [], [], 0.05)[0] == []  # nothing left: not readable
        conn.send("bye")
        ipc_peer.result()
        assert mpc.wait([conn], TIMEOUT) == [conn]  # the peer's end wakes it too
        with pytest.raises(EOFError):
            conn.recv()


def _client_sends_objects(address):
    with torch_ipc.connect(address, authkey=AUTHKEY) as conn:
        message = {"step": 3, "ids": [1, 2], "name": "a"}
        conn.send(message)
        conn.send(message)
        x = torch.arange(4.0)
        conn.send(x)
        conn.send_bytes(b"\x80\x05")  # a pickle cut short
        conn.recv()  # done: x may go


def test_connection_sends_a_message_without_tensors_as_its_pickle(ipc_peer):
    # Note [pickles beside descriptors] in torch_ipc/mp/connection.py
    with _accept_client(ipc_peer, _client_sends_objects) as conn:
        message = {"step": 3, "ids": [1, 2], "name": "a"}
        assert conn.recv_bytes() == pickle.dumps(message, pickle.HIGHEST_PROTOCOL)  # no descriptor around it
        assert conn.recv() == message
        x = conn.recv()  # a tensor: still a descriptor, on the sender's memory
        assert torch.equal(x, torch.arange(4.0)) and _C.is_torch_ipc_storage(x)
        with pytest.raises(torch_ipc.DescriptorError, match="does not unpickle"):
            conn.recv()  # not the EOFError of a closed peer
        conn.send("done")
        ipc_peer.result()


# ---------------------------------------------------------------- features over it


def test_kv_hand_over_and_weights_attach_ride_the_pipe():
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.weights import Publisher, Subscriber

    a, b = torch_ipc.Pipe()
    with a, b:
        with SharedKVPool(8, (2, 4), torch.int32) as pool:
            ids = pool.allocate(3)
            pool.block(ids[0]).fill_(5)
            pool.send(ids, a, meta={"step": 1})
            got = pool.recv(b)
            assert got.ids == ids and got.meta == {"step": 1}
            assert torch.equal(pool.block(got.ids[0]), torch.full((2, 4), 5, dtype=torch.int32))
        weights = {"w": torch.randn(4, 4), "b": torch.randn(4)}
        pub = Publisher(weights)
        pub.attach(a)
        sub = Subscriber(b, timeout=5.0)
        pub.publish()
        model = {n: torch.zeros_like(t) for n, t in weights.items()}
        sub.pull(into=model)
        assert all(torch.equal(model[n], weights[n]) for n in weights)
        sub.close(), pub.close()


def test_poll_zero_reports_a_dead_peer_like_a_socket():
    ctx = mp.get_context("fork")
    mine, theirs = torch_ipc.Pipe()
    p = ctx.Process(target=os._exit, args=(0,))
    p.start()
    theirs.close()  # the child's copy went with it: nobody holds the other end now
    try:
        p.join(TIMEOUT)
        assert mine.poll(0)  # readable: what is there to read is the end of file
        with pytest.raises(EOFError):
            mine.recv_bytes()
    finally:
        _stop(p)
        mine.close()


class _Holder:
    def __init__(self, value):
        self.value = value


def test_objects_without_a_reducer_are_pickled_as_forkingpickler_would():
    """Note [objects without a reducer] in torch_ipc/mp/_reductions.py."""
    from multiprocessing.reduction import ForkingPickler

    from torch_ipc import _serialize

    plain = [b"x" * 64, {"step": 1, "ids": [1, 2], "name": "a"}, (1.5, None, True), _Holder({"k": [3]})]
    for obj in plain:
        assert _serialize.plain_dumps(obj) == bytes(ForkingPickler.dumps(obj))
    mp_end, other = mp.Pipe()
    with mp_end, other:
        class Sub(torch.Tensor):
            pass

        full = [torch.zeros(2), torch.nn.Parameter(torch.zeros(1)), torch.zeros(2).as_subclass(Sub),
                torch.zeros(2).untyped_storage(), [1, {"a": torch.zeros(1)}], _Holder(torch.zeros(1)), [mp_end]]
        for obj in full:
            assert _serialize.plain_dumps(obj) is None, obj
    a, b = torch_ipc.Pipe()
    with a, b:
        for obj in plain[:3]:
            a.send(obj)
            assert b.recv() == obj
        a.send(_Holder(torch.arange(3)))
        assert torch.equal(b.recv().value, torch.arange(3))


def _load_end_and_echo(data: bytes) -> str:
    import pickle

    try:
        end = pickle.loads(data)
    except Exception as e:  # the test checks which error
        return f"{type(e).__name__}: {e}"
    end.send(("echo", end.recv()))
    end.close()
    return "echoed"


def test_an_end_pickled_for_a_process_it_did_not_start_is_fetched_once():
    # Not a child being started: the end travels as an id of the fd server
    # (Note [fds for one fetch] in csrc/os/fd_passing.cpp), not through
    # multiprocessing's fd sharing, which refuses an unrelated process whose
    # authkey differs. The second load finds nothing: the fds went once.
    import pickle

    from torch_ipc.testing import Peer

    mine, theirs = torch_ipc.Pipe()
    data = pickle.dumps(theirs)
    theirs.close()
    served = _C.stats()["fd_served"]
    with Peer(timeout=TIMEOUT) as first, Peer(timeout=TIMEOUT) as second:
        first.start_call(_load_end_and_echo, data)
        mine.send(7)
        assert mine.recv() == ("echo", 7) and first.result() == "echoed"
        assert _C.stats()["fd_served"] == served + 1
        assert second.call(_load_end_and_echo, data).startswith("ReleasedError")
    mine.close()


class _PicklesAnotherMessage:
    """A __reduce__ that pickles a message of its own while the outer one is pickled."""

    def __reduce__(self):
        from torch_ipc import _serialize

        return (bytes, (_serialize.plain_dumps({"inner": [1, 2]}),))


def test_the_kept_plain_pickler_holds_nothing_and_serves_nested_messages():
    # Note [messages without tensors] in torch_ipc/_serialize.py: picklers are kept between messages.
    import gc
    import weakref

    from torch_ipc import _serialize

    held = _Holder([1])
    gone = weakref.ref(held)
    assert _serialize.plain_dumps(held) is not None
    del held
    gc.collect()
    assert gone() is None  # the pickler's memo let it go
    outer = pickle.loads(_serialize.plain_dumps([_PicklesAnotherMessage(), "after"]))
    assert pickle.loads(outer[0]) == {"inner": [1, 2]} and outer[1] == "after"
    assert _serialize.plain_dumps({"x": 1}) == pickle.dumps({"x": 1})  # the kept one still right after that
