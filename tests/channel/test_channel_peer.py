"""The shared-memory channel against a peer that misbehaves, and at its limits:
the bells a peer shares, the segment's checks, two processes on one end, the
fd limit and Ctrl-C (Note [channel] in torch_ipc/mp/_ring.py). Hostile peers
are real second processes that hold only the other end's fds."""
import errno
import fcntl
import mmap
import multiprocessing as mp
import os
import resource
import signal
import struct
import time

import pytest

import torch_ipc
from torch_ipc import _C

TIMEOUT = 60.0
SMALL_RING = 4096


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _pipes_at_each_fd_limit(queue):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    while (fd := os.open("/dev/null", os.O_RDONLY)) < highest:  # no free fd below the highest open one
        pass
    os.close(fd)
    results = []
    for room in range(0, 16):
        before = _open_fds()
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + room, hard))  # `room` fds past the highest open one
        try:
            a, b = torch_ipc.Pipe()
        except OSError as e:
            outcome = f"raised {type(e).__name__}"
        else:
            a.close(), b.close()
            outcome = "made"
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        results.append((room, outcome, before, _open_fds()))
    queue.put(results)


def test_pipe_leaks_no_fd_at_any_fd_limit():
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_pipes_at_each_fd_limit, args=(queue,))
    p.start()
    try:
        results = queue.get(timeout=TIMEOUT)
        p.join(TIMEOUT)
    finally:
        if p.is_alive():
            p.kill()
    outcomes = {outcome for _, outcome, _, _ in results}
    assert "made" in outcomes and any(o.startswith("raised") for o in outcomes), results
    leaks = [(room, outcome, before, after) for room, outcome, before, after in results if after != before]
    assert not leaks, leaks


# ---------------------------------------------------------------- helpers

def _ring_word(end, ring, offset):
    """The 32-bit word at `offset` bytes past ring `ring`'s control (its head)."""
    head, _ = _C.channel_ring_offsets(ring)
    with mmap.mmap(end._channel.fds()[0], 4096) as m:
        return struct.unpack_from("<I", m, head + offset)[0]


def _set_ring_word(end, ring, offset, value):
    head, _ = _C.channel_ring_offsets(ring)
    with mmap.mmap(end._channel.fds()[0], 4096) as m:
        struct.pack_into("<I", m, head + offset, value)


READER_SLEEPS, WRITER_SLEEPS, FD_WAKEUPS = 128, 192, 256  # RingControl's cache lines (ring_segment.h)


def _wait_until(cond, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.005)


def _finish(p, timeout=TIMEOUT):
    """p's exit code; a process still there after `timeout` is killed and reported as hung."""
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return "hung"
    return p.exitcode


# ---------------------------------------------------------------- the bells (item: never block on a shared fd)

def _fill(fd):
    """Make a write of one more ring block: an eventfd's counter at its top, a pipe full."""
    if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]":
        try:
            os.write(fd, struct.pack("<Q", 0xFFFFFFFFFFFFFFFE))
        except BlockingIOError:
            pass
        return
    try:
        while True:
            os.write(fd, b"x" * 65536)
    except BlockingIOError:
        pass


def _empty(fd):
    try:
        while os.read(fd, 65536):
            pass
    except BlockingIOError:
        pass


def _hostile_bells(end, ready):
    """A peer that turns our bells against us with what it holds: our outgoing
    bell full, our incoming one empty, both blocking, fd wake-ups on both rings."""
    _, _, *bells = end._channel.fds()
    side = end._channel.side  # bell i rings for the messages of ring i, which side i writes
    _set_ring_word(end, 0, FD_WAKEUPS, 1)
    _set_ring_word(end, 1, FD_WAKEUPS, 1)
    end.send_bytes(b"hello")  # rings our incoming bell (its outgoing one) ...
    _empty(bells[side])  # ... which it empties again
    _fill(bells[1 - side])  # our outgoing bell: its own incoming one
    for fd in bells:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    ready.set()
    time.sleep(TIMEOUT)  # keep its fds open


def _victim(end):
    end.fileno()  # turns fd wake-ups on: empties the incoming bell
    assert end.recv_bytes() == b"hello"  # re-arms the incoming bell
    end.send_bytes(b"answer")  # rings the outgoing bell
    os._exit(0)


def test_a_peer_cannot_hang_us_through_the_bells():
    ctx = mp.get_context("fork")
    mine, theirs = torch_ipc.Pipe()
    ready = ctx.Event()
    hostile = ctx.Process(target=_hostile_bells, args=(theirs, ready), daemon=True)
    hostile.start()
    try:
        assert ready.wait(TIMEOUT)
        victim = ctx.Process(target=_victim, args=(mine,))
        victim.start()
        assert _finish(victim, 20.0) == 0  # old: "hung" in read()/write() of the eventfd
    finally:
        hostile.kill()
        hostile.join()
        mine.close(), theirs.close()


# ---------------------------------------------------------------- the segment's seals

def _shrink_and_seal_on_request(fd, requests, answers):
    for _ in iter(requests.recv, None):
        try:
            os.ftruncate(fd, 4096)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            answers.send("shrunk and sealed")
        except OSError as e:
            answers.send(f"refused: {e.strerror}")


@pytest.mark.parametrize("sealed", [False, True])
def test_seals_are_read_before_the_size(sealed):
    """A peer that shrinks and seals the segment between the receiver's checks
    (the checks run its request between their two reads)."""
    size = 4096 + 2 * SMALL_RING
    fd = os.memfd_create("peer-segment", os.MFD_ALLOW_SEALING)
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    ctx = mp.get_context("fork")
    requests, requests_there = ctx.Pipe()
    answers_there, answers = ctx.Pipe()
    peer = ctx.Process(target=_shrink_and_seal_on_request, args=(fd, requests_there, answers_there))
    peer.start()
    said = []

    def peer_acts():
        requests.send("go")
        said.append(answers.recv())

    try:
        if sealed:  # sealed first: the size it reads after the seals is the size for good
            _C.check_channel_memory(fd, SMALL_RING, peer_acts)
            assert said == ["refused: Operation not permitted"] and os.fstat(fd).st_size == size
        else:  # unsealed when the seals are read: refused, whatever the peer does next
            with pytest.raises(PermissionError, match="not sealed"):
                _C.check_channel_memory(fd, SMALL_RING, peer_acts)
    finally:
        requests.send(None)
        assert _finish(peer) == 0
        os.close(fd)


# ---------------------------------------------------------------- one process per end

def _send_and_report(end, report):
    try:
        end.send_bytes(b"from the child")
        report.send("sent")
    except OSError as e:
        report.send((e.errno, str(e)))


def _child_result(ctx, target, *args):
    here, there = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, there))
    p.start()
    try:
        assert here.poll(TIMEOUT)
        return here.recv()
    finally:
        assert _finish(p) == 0


def test_a_second_process_sending_on_an_end_is_refused_not_garbled():
    ctx = mp.get_context("fork")
    a, b = torch_ipc.Pipe()
    with a, b:
        a.send_bytes(b"from the parent")  # the parent sends on `a` ...
        errno_, message = _child_result(ctx, _send_and_report, a)  # ... and a forked child tries to
        assert errno_ == errno.EBUSY
        assert f"process {os.getpid()} sends on this end of the connection" in message
        assert b.recv_bytes() == b"from the parent" and not b.poll(0)


def _recv_and_report(end, report):
    try:
        report.send(end.recv_bytes())
    except OSError as e:
        report.send((e.errno, str(e)))


def test_a_second_process_receiving_from_an_end_is_refused():
    ctx = mp.get_context("fork")
    a, b = torch_ipc.Pipe()
    with a, b:
        a.send_bytes(b"one"), a.send_bytes(b"two")
        assert b.recv_bytes() == b"one"
        errno_, message = _child_result(ctx, _recv_and_report, b)
        assert errno_ == errno.EBUSY and f"process {os.getpid()} receives" in message
        assert b.recv_bytes() == b"two"


def _use_then_exit(end, report):
    end.send_bytes(b"child's")
    report.send(end.recv_bytes())


def test_an_end_passes_to_the_next_process_when_the_first_closes_or_exits():
    ctx = mp.get_context("fork")
    a, b = torch_ipc.Pipe()
    with a, b:
        b.send_bytes(b"to the child")
        assert _child_result(ctx, _use_then_exit, a) == b"to the child"  # the child used `a`, and exited
        assert b.recv_bytes() == b"child's"
        a.send_bytes(b"parent's again")  # a process that exited holds no claim
        b.send_bytes(b"to the parent")
        assert b.recv_bytes() == b"parent's again" and a.recv_bytes() == b"to the parent"


def _send_on_inherited(end, report):
    assert report.recv() == "closed"
    end.send_bytes(b"hand-over")
    report.send("sent")


def test_a_closed_end_can_be_used_by_a_child_that_inherited_it():
    ctx = mp.get_context("fork")
    a, b = torch_ipc.Pipe()
    with b:
        a.send_bytes(b"before")
        p_here, p_there = ctx.Pipe()
        p = ctx.Process(target=_send_on_inherited, args=(a, p_there))
        p.start()
        a.close()  # the parent's own copy; the child keeps its own fds
        p_here.send("closed")
        try:
            assert p_here.poll(TIMEOUT) and p_here.recv() == "sent"
        finally:
            assert _finish(p) == 0
        assert b.recv_bytes() == b"before" and b.recv_bytes() == b"hand-over"


# ---------------------------------------------------------------- Ctrl-C

def _blocked(call, report):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    report.send("ready")
    try:
        call()
    except KeyboardInterrupt:
        report.send(time.monotonic())
        os._exit(7)
    os._exit(1)


def _interrupt(ctx, call, blocked, settle=0.0):
    """Start `call()` in a forked child; once `blocked()` says it waits, SIGINT it:
    seconds from the signal to its KeyboardInterrupt."""
    here, there = ctx.Pipe()
    p = ctx.Process(target=_blocked, args=(call, there))
    p.start()
    try:
        assert here.poll(TIMEOUT) and here.recv() == "ready"
        _wait_until(blocked, "the child's wait")
        time.sleep(settle)
        sent = time.monotonic()
        os.kill(p.pid, signal.SIGINT)
        assert here.poll(10.0), "SIGINT did not end the wait"
        return here.recv() - sent
    finally:
        assert _finish(p, 10.0) == 7


@pytest.mark.parametrize("call", ["recv", "recv_bytes", "poll", "send on a full ring"])
def test_ctrl_c_ends_a_wait_of_a_pipe(call):
    ctx = mp.get_context("fork")
    a, b = torch_ipc.Pipe(ring_bytes=SMALL_RING)
    with a, b:
        if call == "send on a full ring":  # the child sends on `a`: the parent must not have
            waits, word = lambda: a.send_bytes(b"x" * (4 * SMALL_RING)), WRITER_SLEEPS
        else:
            waits = {"recv": b.recv, "recv_bytes": b.recv_bytes, "poll": lambda: b.poll(None)}[call]
            word = READER_SLEEPS
        assert _interrupt(ctx, waits, lambda: _ring_word(a, 0, word) == 1) < 1.0
        if call != "send on a full ring":  # nothing of a message was taken: the pipe goes on
            a.send_bytes(b"still in step")
            assert b.recv_bytes() == b"still in step"


def _send_an_end_and_wait(a, report):
    e0, e1 = torch_ipc.Pipe()
    a.send(e1)  # its fds wait in this process's fd server
    report.send("sent")
    time.sleep(60)


def test_ctrl_c_ends_a_fetch_from_a_stopped_sender():
    # The receiver of a Pipe end fetches its fds from the sender's fd server,
    # which a stopped sender never answers (Note [interruptible waits]).
    ctx = mp.get_context("fork")
    a, b = torch_ipc.Pipe()
    here, there = ctx.Pipe()
    sender = ctx.Process(target=_send_an_end_and_wait, args=(a, there))
    sender.start()
    try:
        assert here.poll(TIMEOUT) and here.recv() == "sent"
        os.kill(sender.pid, signal.SIGSTOP)
        assert _interrupt(ctx, b.recv, lambda: True, settle=0.5) < 1.0
    finally:
        os.kill(sender.pid, signal.SIGCONT)
        sender.kill()
        sender.join(TIMEOUT)


def _accept(address):
    with torch_ipc.listen(address, authkey=b"ctrl-c") as listener:
        listener.accept()


def test_ctrl_c_ends_accept(tmp_path):
    ctx = mp.get_context("fork")
    path = str(tmp_path / "l.sock")
    took = _interrupt(ctx, lambda: _accept(path), lambda: os.path.exists(path), settle=0.3)
    assert took < 1.0


def _client_waits(address):
    with torch_ipc.connect(address, authkey=b"ctrl-c") as conn:
        conn.recv()


def test_ctrl_c_ends_a_recv_of_a_connection_over_a_path(tmp_path):
    ctx = mp.get_context("fork")
    with torch_ipc.listen(str(tmp_path / "l.sock"), authkey=b"ctrl-c") as listener:
        here, there = ctx.Pipe()
        p = ctx.Process(target=_blocked, args=(lambda: _client_waits(listener.address), there))
        p.start()
        try:
            assert here.poll(TIMEOUT) and here.recv() == "ready"
            with listener.accept() as conn:
                assert isinstance(conn._conn, torch_ipc.mp._ring.RingConnection)
                _wait_until(lambda: _ring_word(conn._conn, 1, READER_SLEEPS) == 1, "the client's wait")
                sent = time.monotonic()
                os.kill(p.pid, signal.SIGINT)
                assert here.poll(10.0), "SIGINT did not end the wait"
                assert here.recv() - sent < 1.0
        finally:
            assert _finish(p, 10.0) == 7
