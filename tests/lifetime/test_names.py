"""Names another local user cannot take first (Note [names] in csrc/os/names.h),
no GPU needed: every name a process shares by has a random part from the OS,
and a taken name is retried with another. The test takes, before a process
exports, every name it can predict: the names of the old scheme (pid and start
time only) and the names the process will draw next (queued with
_C._testing.queue_random), as another user where the test can be one."""
import os
import socket

import ipc_test_utils as u
import pytest
import torch
from wire.test_descriptor import seal

import torch_ipc
from torch_ipc import _C
from torch_ipc.testing import Peer

SHM = "/dev/shm"
MASK48 = (1 << 48) - 1
# The random values the producer draws next, in order: its first lease
# segment (taken, then free), its host segment (taken, then free), its fd
# server's socket tag (taken, then free).
LEASE_TAKEN, LEASE_FREE = 0x1111_0000_5EA5E001, 0x2222_0000_5EA5E002
HOST_TAKEN, HOST_FREE = 0x0000_A5A5_0000_0001, 0x0000_A5A5_0000_0002
TAG_TAKEN, TAG_FREE = 0x0000_0000_7A9_00001, 0x0000_0000_7A9_00002

_STATE = {}


def _queue(values):
    _C._testing.queue_random(list(values))
    return _C.self_process()


def _export_and_publish():
    t = torch.arange(4096, dtype=torch.float64)
    u.HELD["t"] = t
    data = torch_ipc.dumps(t)
    fd = os.memfd_create("torch_ipc-test", os.MFD_CLOEXEC)
    os.pwrite(fd, b"published", 0)
    _STATE["fd"] = fd
    ident = _C._testing.fd_publish([fd], [9])
    names = sorted(n for n in os.listdir(SHM) if n.startswith(f"torch_ipc.{os.getpid()}."))
    return data, ident, names


def _fetch_text(pid, start, ident):
    [(fd, size)] = _C._testing.fd_fetch(pid, start, ident, [], "socket")
    try:
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def _squat_file(name: str, uid: int) -> str:
    path = os.path.join(SHM, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.ftruncate(fd, 1 << 20)
    os.close(fd)
    if uid >= 0:
        os.chown(path, uid, -1)
    return path


def _squat_socket(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind("\0" + name)
    s.listen(1)
    return s


def test_names_taken_in_advance_do_not_block_exports():
    squatter_uid = 65534 if os.geteuid() == 0 else -1  # another user where we can be one
    paths, sockets = [], []
    with Peer(timeout=120, name="producer") as producer, Peer(timeout=120, name="consumer") as consumer:
        pid, start = producer.call(_queue, [LEASE_TAKEN, LEASE_FREE, HOST_TAKEN, HOST_FREE, TAG_TAKEN, TAG_FREE])
        prefix = f"torch_ipc.{pid}.{start}."
        try:
            # The old scheme: pid and start time, counters from 0.
            for name in ("L0", "H0", "L00000000"):
                paths.append(_squat_file(prefix + name, squatter_uid))
            sockets.append(_squat_socket(prefix[:-1] + ".fd"))
            # What the producer draws next.
            lease_taken = f"L{LEASE_TAKEN & 0xFFFFFFFF:08x}"
            paths.append(_squat_file(prefix + lease_taken, squatter_uid))
            anchor = f"{LEASE_FREE & 0xFFFFFFFF:08x}"
            paths.append(_squat_file(prefix + f"H{anchor}.{HOST_TAKEN & MASK48:012x}", squatter_uid))
            sockets.append(_squat_socket(_C._testing.fd_socket_name(pid, start, TAG_TAKEN << 32)))

            data, ident, names = producer.call(_export_and_publish)

            mine = [n for n in names if prefix + n.split(".", 3)[3] not in map(os.path.basename, paths)]
            assert sorted(mine) == sorted([prefix + "L" + anchor, prefix + f"H{anchor}.{HOST_FREE & MASK48:012x}"]), names
            assert ident >> 32 == TAG_FREE & 0xFFFFFFFF, hex(ident)
            assert consumer.call(u.load_bits, "t", data) == u.bits(torch.arange(4096, dtype=torch.float64))
            assert consumer.call(_fetch_text, pid, start, ident) == b"published"
        finally:
            for s in sockets:
                s.close()
            for path in paths:
                os.unlink(path)


def test_fd_server_ids_are_random_per_id_and_name_their_server():
    with Peer(timeout=120, name="a") as a, Peer(timeout=120, name="b") as b:
        ids_a = [a.call(_publish_one) for _ in range(8)]
        ids_b = [b.call(_publish_one) for _ in range(8)]
    assert len({i >> 32 for i in ids_a}) == 1 and len({i >> 32 for i in ids_b}) == 1
    assert ids_a[0] >> 32 != ids_b[0] >> 32, "two processes drew the same socket tag"
    assert len({i & 0xFFFFFFFF for i in ids_a + ids_b}) == 16, "an id repeats"


def _publish_one() -> int:
    fd = os.memfd_create("torch_ipc-test", os.MFD_CLOEXEC)
    _STATE.setdefault("fds", []).append(fd)
    return _C._testing.fd_publish([fd], [0])


@pytest.mark.parametrize(
    "name",
    [
        "/torch_ipc.12.34.H0",  # the old scheme
        "/torch_ipc.12.34.L0000abcd",  # a lease segment, not data
        "/torch_ipc.12.34.H0000abcd.0123456789AB",  # upper-case hex
        "/torch_ipc.12.34.H0000abcd.0123456789a",  # too short
        "/torch_ipc.012.34.H0000abcd.0123456789ab",  # a leading zero
        "/torch_ipc.0.34.H0000abcd.0123456789ab",  # pid 0
        "/torch_ipc.12.34.H0000abcd.0123456789ab/../x",
    ],
)
def test_a_host_name_not_of_the_scheme_is_a_descriptor_error(name, ipc_peers):
    """The loader accepts exactly the names Note [names] makes."""
    t = torch.arange(4, dtype=torch.float32)
    data = torch_ipc.dumps(t)
    d = _C.describe(data)
    [alloc] = d["allocs"]
    good = alloc["handle"].rstrip(b"\0").decode()
    assert good.startswith("/torch_ipc.") and len(good) <= 62
    forged = seal(data.replace(alloc["handle"], name.encode().ljust(64, b"\0")))
    kind, message = ipc_peers.get("consumer").call(u.try_load, forged)
    assert (kind, "bad shared memory name" in message) == ("DescriptorError", True), message
