"""File descriptor passing between processes (csrc/os/fd_passing.*), no GPU needed:
the per-process fd server (SCM_RIGHTS), pidfd_getfd pulls, and their refusals."""
import os
import socket

import ipc_test_utils as u
import pytest

import torch_ipc
from torch_ipc import _C
from torch_ipc.testing import Peer, PeerError, run_in_subprocess

# ----------------------------------------------------------------------------- child functions
# (module level: the child imports this module to find them)

_STATE = {}


def _memfd(payload: bytes) -> int:
    fd = os.memfd_create("torch_ipc-test", os.MFD_CLOEXEC)
    os.pwrite(fd, payload, 0)
    return fd


def _publish(payloads):
    """Publish one memfd per payload; keep them open. -> (pid, start, id, fd numbers)."""
    fds = [_memfd(p) for p in payloads]
    ident = _C._testing.fd_publish(fds, [len(p) for p in payloads])
    _STATE.setdefault("fds", []).extend(fds)
    _STATE.setdefault("ids", []).append(ident)
    pid, start = _C.self_process()
    return pid, start, ident, fds


def _unpublish(ident):
    _C._testing.fd_unpublish(ident)


def _stats():
    return dict(_C.stats())


def _who():
    return _C.self_process()


def _read_all(items):
    out = []
    for fd, size in items:
        try:
            out.append((os.pread(fd, 1 << 16, 0), size))
        finally:
            os.close(fd)
    return out


def _fetch(owner, ident, remote_fds=(), mode=""):
    pid, start = owner
    return _read_all(_C._testing.fd_fetch(pid, start, ident, list(remote_fds), mode))


def _fetch_with_stats(owner, ident, remote_fds=(), mode=""):
    data = _fetch(owner, ident, remote_fds, mode)
    return data, dict(_C.stats())


def _impostor(name):
    """Listen on another process's socket name (abstract namespace)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind("\0" + name)
    s.listen(4)
    _STATE["impostor"] = s
    return os.getpid()


def _send_garbage(owner, ident):
    pid, start = owner
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect("\0" + _C._testing.fd_socket_name(pid, start, ident))
    s.send(b"not a request")
    reply = s.recv(4096)
    s.close()
    return reply


# ----------------------------------------------------------------------------- tests


@pytest.fixture
def producer(ipc_peers):
    """The module's producer: publishes, keeps what it published, counts what it served."""
    return ipc_peers.get("producer")


@pytest.fixture
def bystander(ipc_peers):
    """A torch_ipc process of the module that never publishes anything."""
    return ipc_peers.get("bystander")


def test_socket_passes_fd_and_bytes_arrive(producer):
    pid, start, ident, _ = producer.call(_publish, [b"hello over SCM_RIGHTS"])
    before = dict(_C.stats())["fd_via_socket"]
    served = producer.call(_stats)["fd_served"]
    assert _fetch((pid, start), ident, mode="socket") == [(b"hello over SCM_RIGHTS", 21)]
    assert dict(_C.stats())["fd_via_socket"] == before + 1
    assert producer.call(_stats)["fd_served"] == served + 1


def test_many_fds_arrive_in_order_across_batches(producer):
    payloads = [f"item {i} ".encode() * (i + 1) for i in range(150)]  # > one message of 64
    pid, start, ident, _ = producer.call(_publish, payloads)
    got = _fetch((pid, start), ident, mode="socket")
    assert got == [(p, len(p)) for p in payloads]


def test_pidfd_pull_or_clear_refusal(producer):
    pid, start, ident, fds = producer.call(_publish, [b"pulled"])
    try:
        got = _fetch((pid, start), ident, fds, mode="pidfd")
    except OSError as e:  # no ptrace rights (PermissionError) or no pidfd (ENOSYS) here: the message must say so
        assert "ptrace" in str(e) or "pidfd" in str(e)
        pytest.skip(f"pidfd_getfd not allowed here: {e}")
    assert got == [(b"pulled", 0)]  # pidfd does not carry sizes


def test_auto_uses_what_works(producer):
    pid, start, ident, fds = producer.call(_publish, [b"auto"])
    before = dict(_C.stats())
    assert _fetch((pid, start), ident, fds, mode="auto")[0][0] == b"auto"
    after = dict(_C.stats())
    assert (after["fd_via_pidfd"] - before["fd_via_pidfd"]) + (
        after["fd_via_socket"] - before["fd_via_socket"]
    ) == 1
    # Without fd numbers, auto can only ask the socket.
    assert _fetch((pid, start), ident, (), mode="auto")[0][0] == b"auto"
    assert dict(_C.stats())["fd_via_socket"] == after["fd_via_socket"] + 1


def test_env_forces_the_socket(producer):
    pid, start, ident, fds = producer.call(_publish, [b"forced"])
    data, stats = run_in_subprocess(
        _fetch_with_stats, (pid, start), ident, fds, "", env={"TORCH_IPC_FD_TRANSPORT": "socket"}, timeout=60
    )
    assert data == [(b"forced", 6)]
    assert stats["fd_via_socket"] == 1 and stats["fd_via_pidfd"] == 0


def test_bad_transport_env_is_an_error(producer):
    pid, start, ident, fds = producer.call(_publish, [b"x"])
    with pytest.raises(PeerError, match="TORCH_IPC_FD_TRANSPORT must be"):
        run_in_subprocess(_fetch, (pid, start), ident, fds, "", env={"TORCH_IPC_FD_TRANSPORT": "carrier-pigeon"})


def test_pidfd_forced_without_fd_numbers_is_an_error(producer):
    pid, start, ident, _ = producer.call(_publish, [b"x"])
    with pytest.raises(RuntimeError, match="fd numbers"):
        _fetch((pid, start), ident, (), mode="pidfd")


def test_unknown_id_is_released_error(producer):
    pid, start, ident, _ = producer.call(_publish, [b"x"])
    refused = producer.call(_stats)["fd_refused"]
    with pytest.raises(torch_ipc.ReleasedError, match="no longer shares"):
        _fetch((pid, start), ident ^ 1, mode="socket")
    producer.call(_unpublish, ident)
    with pytest.raises(torch_ipc.ReleasedError):
        _fetch((pid, start), ident, mode="socket")
    assert producer.call(_stats)["fd_refused"] == refused + 2


def test_exited_producer_is_producer_gone():
    with Peer(timeout=60) as p:
        pid, start, ident, fds = p.call(_publish, [b"x"])
    for mode, remote in (("socket", ()), ("pidfd", fds), ("auto", fds)):
        with pytest.raises(torch_ipc.ProducerGoneError, match="has exited"):
            _fetch((pid, start), ident, remote, mode=mode)


def test_process_without_server_is_a_clear_error(bystander):
    pid, start = bystander.call(_who)  # alive, never published anything
    with pytest.raises(ConnectionRefusedError, match="cannot reach the fd server"):
        _fetch((pid, start), 1, mode="socket")


def test_server_pid_must_match_the_producer(producer):
    # A process that listens on the name of another (here: of this test's
    # process with a made-up start time) is not the producer.
    me, _ = _C.self_process()
    fake = (me, 1)
    impostor_pid = producer.call(_impostor, _C._testing.fd_socket_name(*fake, 1))
    with pytest.raises(torch_ipc.ProducerGoneError, match=f"served by pid {impostor_pid}, not by the producer"):
        _fetch(fake, 1, mode="socket")


def test_malformed_request_is_refused_and_server_keeps_serving(producer):
    pid, start, ident, _ = producer.call(_publish, [b"still here"])
    refused = producer.call(_stats)["fd_refused"]
    reply = _send_garbage((pid, start), ident)
    assert reply[:4] == b"TIFR" and int.from_bytes(reply[4:8], "little", signed=True) != 0
    assert _fetch((pid, start), ident, mode="socket") == [(b"still here", 10)]
    assert producer.call(_stats)["fd_refused"] == refused + 1


def test_no_fd_leaks_on_either_side():
    """220 fetches leave no fd behind on either side. Counts move for reasons of
    their own meanwhile: the collector's sweep opens other tests' files while
    it runs, and the fd server closes a finished connection when it gets to it
    (later on a loaded machine). So each side's count must come back to at most
    what it was before, within a few seconds: a leak of one fd a fetch is 220."""
    # A producer of its own: what earlier tests left to a shared one (connections
    # its server closes when it gets to them) would change its count under us.
    with Peer(timeout=60, name="fd-counted-producer") as producer:
        pid, start, ident, fds = producer.call(_publish, [b"a", b"b", b"c"])
        # Warm up: the server thread, and the pidfd that process_alive() caches per producer.
        _fetch((pid, start), ident, mode="socket")
        _fetch((pid, start), ident, fds, mode="auto")
        _C.sweep()  # closes now the pidfds of processes of earlier tests, as the collector would
        theirs, ours = producer.call(u.open_fds, os.getpid()), u.open_fds(pid)
        for i in range(200):
            mode = "socket" if i % 2 else "auto"
            assert [d for d, _ in _fetch((pid, start), ident, fds, mode=mode)] == [b"a", b"b", b"c"]
        for bad in range(20):
            with pytest.raises(torch_ipc.ReleasedError):
                _fetch((pid, start), ident + 1 + bad, mode="socket")
        me = os.getpid()
        assert u.poll_until(lambda: producer.call(u.open_fds, me) <= theirs, timeout=10), \
            (producer.call(u.open_fds, me), theirs)
        assert u.poll_until(lambda: u.open_fds(pid) <= ours, timeout=10), (u.open_fds(pid), ours)
