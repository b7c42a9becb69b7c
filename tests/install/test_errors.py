"""The error vocabulary from Python, no GPU needed: each failure of the fd
server, shared memory and leases reaches Python as the class a caller can act
on (ReleasedError, ProducerGoneError, or OSError carrying the real errno, so
the builtin subclass that fits), never as a bare RuntimeError."""
import contextlib
import errno
import fcntl
import mmap
import os
import socket
import struct
import threading
import time

import pytest
import torch

import torch_ipc
from torch_ipc import _C
from torch_ipc.testing import Peer, run_in_subprocess

# ----------------------------------------------------------------------------- child functions
# (module level: the child imports this module to find them)

_STATE = {}
REPLY_MAGIC = 0x52464954  # "TIFR", Note [fd server protocol] in csrc/os/fd_passing.cpp
HAS_BLOBS = 2
SLOT_BYTES, SLOTS, HOLDERS = 128, 4096, 14  # Slot in csrc/os/refcount.cpp, Note [holder limit]
IDENTITY_BYTES = 4096  # before a segment's data: Note [segment identity] in csrc/os/shm.h


def _header(status=0, total=0, first=0, count=0, flags=0) -> bytes:
    return struct.pack("<Ii4I", REPLY_MAGIC, status, total, first, count, flags)


def _who():
    return _C.self_process()


def _publish_and_unpublish():
    """Start this process's fd server, then publish nothing; returns who it is
    and the id it published once."""
    fd = os.memfd_create("torch_ipc-test", os.MFD_CLOEXEC)
    _STATE.setdefault("fds", []).append(fd)
    ident = _C._testing.fd_publish([fd], [0])
    _C._testing.fd_unpublish(ident)
    return _C.self_process(), ident


def _publish(payload: bytes):
    fd = os.memfd_create("torch_ipc-test", os.MFD_CLOEXEC)
    os.pwrite(fd, payload, 0)
    _STATE.setdefault("fds", []).append(fd)
    ident = _C._testing.fd_publish([fd], [len(payload)])
    return (*_C.self_process(), ident, fd)


def _listen_on(name: str) -> int:
    """Hold another process's socket name (abstract namespace)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind("\0" + name)
    s.listen(4)
    _STATE.setdefault("sockets", []).append(s)
    return os.getpid()


def _serve_script(replies):
    """Stand in for this process's own fd server (it never starts one): answer
    the i-th connection with replies[i]; None hangs up without a word,
    "silent" never answers."""
    pid, start = _C.self_process()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind("\0" + _C._testing.fd_socket_name(pid, start, 1))  # the server of export id 1
    s.listen(8)
    _STATE["script"] = s

    def serve():
        for reply in replies:
            conn, _ = s.accept()
            conn.recv(64)
            if reply == "silent":
                _STATE.setdefault("kept", []).append(conn)
                continue
            if reply is not None:
                conn.send(reply)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return pid, start


def _fetch(owner, ident, remote_fds=(), mode="socket"):
    pid, start = owner
    items = _C._testing.fd_fetch(pid, start, ident, list(remote_fds), mode)
    for fd, _ in items:
        os.close(fd)
    return len(items)


def _dumps_cpu(consumers: int = 1) -> bytes:
    t = torch.arange(16, dtype=torch.float32)
    _STATE["tensor"] = t
    return torch_ipc.dumps(t, consumers=consumers)


def _shm_path(tag: str, pid: int = 0, start: int = 0) -> str:
    """The one /dev/shm file of kind `tag` (L: lease, H: host) of a process
    (this one by default), whatever the random part of its name."""
    if not pid:
        pid, start = _C.self_process()
    prefix = f"torch_ipc.{pid}.{start}.{tag}"
    [name] = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    return "/dev/shm/" + name


def _unlink_own(tag: str) -> str:
    path = _shm_path(tag)
    os.unlink(path)
    return path


def _dumps_when_every_name_is_taken():
    """Take the names this process will draw next (every attempt), then export."""
    pid, start = _C.self_process()
    taken = 0x5EA5E0005EA5E000
    path = f"/dev/shm/torch_ipc.{pid}.{start}.L{taken & 0xFFFFFFFF:08x}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    _C._testing.queue_random([taken] * 16)
    try:
        _dumps_cpu()
    except OSError as e:
        return type(e).__name__, e.errno, str(e)
    finally:
        os.unlink(path)
    return None


F_OFD_SETLK = 37


@contextlib.contextmanager
def _living_holders(n: int):
    """n life keys whose life files are locked (Note [life files] in csrc/os/life.h),
    as n living holders in other processes would have them."""
    keys, fds = [], []
    try:
        while len(keys) < n:
            key = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
            try:
                fd = os.open(f"/dev/shm/torch_ipc.life.{key:08x}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            fds.append(fd)
            keys.append(key)
            fcntl.fcntl(fd, F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
            os.pwrite(fd, b"x", 0)
        yield keys
    finally:
        for key, fd in zip(keys, fds):
            os.unlink(f"/dev/shm/torch_ipc.life.{key:08x}")
            os.close(fd)


def _fill_holders(pid: int, start: int, keys) -> int:
    """Take every holder word of every live lease slot of process pid (as if
    14 other processes, of life keys `keys`, held its exports). Returns how
    many slots were filled."""
    fd = os.open(_shm_path("L", pid, start), os.O_RDWR)
    try:
        m = mmap.mmap(fd, IDENTITY_BYTES + SLOT_BYTES * SLOTS)
    finally:
        os.close(fd)
    filled = 0
    for slot in range(SLOTS):
        base = IDENTITY_BYTES + slot * SLOT_BYTES
        (generation,) = struct.unpack_from("<Q", m, base)
        if generation == 0:
            continue
        for i in range(HOLDERS):
            struct.pack_into("<Q", m, base + 16 + 8 * i, (keys[i] << 32) | 1)  # holds once
        filled += 1
    m.close()
    return filled


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def peer():
    with Peer(timeout=60) as p:
        yield p


# ----------------------------------------------------------------------------- fd server


def test_unknown_id_of_a_live_server_is_released(peer):
    owner, published = peer.call(_publish_and_unpublish)  # its server runs, publishes nothing
    server = published >> 32 << 32  # ids of that server (Note [fd server name])
    for ident in (published, server | 1, server | 0xFFFFFFFF):
        with pytest.raises(torch_ipc.ReleasedError, match=r"no longer shares this memory"):
            _fetch(owner, ident)


def test_live_process_without_a_server_is_connection_refused(peer):
    owner = peer.call(_who)  # alive, never published: nobody listens on its name
    with pytest.raises(ConnectionRefusedError, match="cannot reach the fd server") as info:
        _fetch(owner, 1)
    assert info.value.errno == errno.ECONNREFUSED


def test_dead_producer_is_producer_gone_in_one_wording():
    with Peer(timeout=60) as p:
        pid, start, ident, fd = p.call(_publish, b"x")
    want = rf"^torch_ipc: the producer \(pid {pid}\) has exited; its file descriptors can no longer be fetched$"
    for mode, remote in (("socket", ()), ("pidfd", (fd,)), ("auto", (fd,))):
        with pytest.raises(torch_ipc.ProducerGoneError, match=want):
            _fetch((pid, start), ident, remote, mode)


def test_pidfd_failure_is_an_os_error_with_errno(peer):
    pid, start, ident, fd = peer.call(_publish, b"x")
    # A number that is no open fd of the producer: EBADF where pidfd_getfd is
    # allowed, EPERM (PermissionError, saying what rights it needs) where not.
    with pytest.raises(OSError) as info:
        _fetch((pid, start), ident, (fd + 1000,), "pidfd")
    assert info.value.errno in (errno.EBADF, errno.EPERM, errno.EACCES, errno.ENOSYS), info.value
    assert "pidfd" in str(info.value)
    if info.value.errno == errno.EPERM:
        assert isinstance(info.value, PermissionError) and "ptrace" in str(info.value)


def test_name_held_by_another_process(peer):
    # A living producer whose socket name another process holds: EPROTO.
    with Peer(timeout=60) as owner_peer:
        owner = owner_peer.call(_who)
        squatter = peer.call(_listen_on, _C._testing.fd_socket_name(*owner, 1))
        with pytest.raises(OSError, match=f"served by pid {squatter}, not by the producer") as info:
            _fetch(owner, 1)
        assert info.value.errno == errno.EPROTO
    # A producer that has exited (here: one that never was): ProducerGone.
    me, _ = _C.self_process()
    fake = (me, 1)
    squatter = peer.call(_listen_on, _C._testing.fd_socket_name(*fake, 1))
    with pytest.raises(torch_ipc.ProducerGoneError, match=rf"pid {me}\) has exited; .*served by pid {squatter}"):
        _fetch(fake, 1)


SCRIPT = [
    # (what the server sends, the class and errno the client must raise, message)
    (b"junk", OSError, errno.EPROTO, "shorter than a reply header"),
    (b"\0" * 24, OSError, errno.EPROTO, "wrong magic number"),
    (_header(status=-5), OSError, errno.EPROTO, "status -5"),
    (_header(status=1 << 20), OSError, errno.EPROTO, "status 1048576"),
    (_header(total=1, count=1, flags=HAS_BLOBS), OSError, errno.EPROTO, "does not match its header"),
    (_header(status=errno.EACCES), PermissionError, errno.EACCES, "runs as another user"),
    (_header(status=errno.EMFILE), OSError, errno.EMFILE, "refused the request"),
    (_header(status=errno.ENOENT), torch_ipc.ReleasedError, None, "no longer shares"),
    (None, ConnectionResetError, errno.ECONNRESET, "closed the fd socket without answering"),
]


def test_replies_that_break_the_protocol(peer):
    owner = peer.call(_serve_script, [reply for reply, *_ in SCRIPT])
    for reply, cls, code, message in SCRIPT:
        with pytest.raises(cls, match=message) as info:
            _fetch(owner, 1)
        if code is not None:
            assert info.value.errno == code, (reply, info.value)
        assert not isinstance(info.value, torch_ipc.ProducerGoneError)


def _fetch_timing_out(owner, ident):
    """_fetch, which must time out: (errno, message, seconds it waited)."""
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer from the fd server") as info:
        _fetch(owner, ident)
    return info.value.errno, str(info.value), time.monotonic() - t0


ANSWER_S = 0.5  # the client's limit here (TORCH_IPC_FD_ANSWER_SECONDS; the default, 10 s, in test_settings.py)


def test_a_server_that_never_answers_is_a_timeout(peer):
    owner = peer.call(_serve_script, ["silent"])
    code, message, waited = run_in_subprocess(_fetch_timing_out, owner, 1, timeout=60,
                                              env={"TORCH_IPC_FD_ANSWER_SECONDS": str(ANSWER_S)})
    assert code == errno.ETIMEDOUT
    assert f"within {ANSWER_S:g} s" in message, message
    assert ANSWER_S <= waited < 10, waited


# ----------------------------------------------------------------------------- shared memory and leases


def test_shm_failure_is_an_os_error_with_errno():
    name, code, message = run_in_subprocess(_dumps_when_every_name_is_taken, timeout=60)
    assert (name, code) == ("FileExistsError", errno.EEXIST), message
    assert "16 random names for a lease segment" in message and "/dev/shm" in message, message


def test_missing_host_segment_of_a_live_producer_is_released(peer):
    data = peer.call(_dumps_cpu)
    peer.call(_unlink_own, "H")
    with pytest.raises(torch_ipc.ReleasedError, match="already released by its producer"):
        torch_ipc.loads(data)


def test_missing_lease_segment_of_a_live_producer_is_released(peer):
    data = peer.call(_dumps_cpu)
    path = peer.call(_unlink_own, "L")
    with pytest.raises(torch_ipc.ReleasedError, match=f"no longer shares lease segment {path[len('/dev/shm'):]}"):
        torch_ipc.loads(data)


def test_holder_limit_is_a_clear_error_saying_what_to_do(peer):
    data = peer.call(_dumps_cpu, 2)
    with _living_holders(14) as keys:
        assert _fill_holders(*peer.call(_who), keys) == 1
        with pytest.raises(torch_ipc.HolderLimitError) as info:
            torch_ipc.loads(data)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "already has 14 holders" in message and "dumps() call each" in message, message
