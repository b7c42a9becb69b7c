"""Life files (Note [life files] in csrc/os/life.h): the lock a process holds on
/dev/shm/torch_ipc.life.<key> is what a peer in another PID namespace judges it
by. No namespaces are needed here: an identity that names another PID
namespace is judged the same way (csrc/os/process.cpp, pid_visible)."""
import fcntl
import os
import signal
import stat
import struct
import tempfile
import time
from pathlib import Path

import ipc_test_utils as u
import pytest

from torch_ipc import _C
from torch_ipc.testing import Peer, run_in_subprocess

F_OFD_GETLK = 36


def _identity():
    return _C.self_identity()


def _elsewhere(identity):
    """The same process, as a peer in another PID namespace names it."""
    pid, start, life, pidns = identity
    return pid, start, life, pidns ^ 0x5A5A


def _life_path(life: int) -> str:
    return f"/dev/shm/torch_ipc.life.{life:08x}"


def _locked_by_another(path: str) -> bool:
    with open(path, "rb") as f:
        probe = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        got = fcntl.fcntl(f.fileno(), F_OFD_GETLK, probe)
        return struct.unpack("hhqqi4x", got)[0] != fcntl.F_UNLCK


def _fork_a_child_that_stays() -> dict:
    """Fork a child (its own session, so that killing this process's group spares it)."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        try:
            child = _C.self_identity()
            os.write(u.HELD["w"], repr(child).encode() + b"\n")
            time.sleep(120)
        finally:
            os._exit(0)
    return dict(child_pid=pid)


def _pipe() -> None:
    r, w = os.pipe()
    u.HELD["r"], u.HELD["w"] = r, w


def _read_child_identity() -> tuple:
    return eval(os.read(u.HELD["r"], 200).decode())  # noqa: S307 (our own child's repr of a tuple)


def _alive_at_fd_limit(identity) -> tuple:
    """process_alive of `identity` with no fd left, then with fds again."""
    with u.at_fd_limit(64):
        at_limit = _C.process_alive(*identity)
    return at_limit, _C.process_alive(*identity)


def test_a_process_holds_a_locked_life_file_of_its_own_uid_and_mode_0600():
    with Peer(timeout=60) as peer:
        pid, start, life, pidns = peer.call(_identity)
        assert life != 0 and pidns == os.stat("/proc/self/ns/pid").st_ino
        st = os.lstat(_life_path(life))
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
        with open(_life_path(life), "rb") as f:
            assert struct.unpack("<8sIIQ", f.read(24)) == (b"TIPCSEG1", pid, 0, start)
        assert _locked_by_another(_life_path(life))


def _maps_and_fds() -> tuple:
    """The lines of this process's memory map and the targets of its fds."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return maps, fds


def test_a_life_file_is_held_by_its_fd_alone_never_mapped():
    """Note [an anchor maps nothing]: a mapping would hold the lock as long as
    the memory map lives, which can be after the process was reaped."""
    with Peer(timeout=60) as peer:
        life = peer.call(_identity)[2]
        maps, fds = peer.call(_maps_and_fds)
    name = f"torch_ipc.life.{life:08x}"
    assert any(name in target for target in fds), fds
    assert name not in maps


def test_a_process_of_another_namespace_lives_until_killed_by_its_life_file():
    with Peer(timeout=60) as peer:
        identity = peer.call(_identity)
        assert _C.process_alive(*_elsewhere(identity))
        peer.kill()
    assert not _C.process_alive(*_elsewhere(identity))
    # The file is swept once its owner is gone; gone, it still reads as dead.
    assert u.poll_until(lambda: (_C.sweep(), not os.path.exists(_life_path(identity[2])))[1])
    assert not _C.process_alive(*_elsewhere(identity))


def test_a_life_file_made_by_another_process_does_not_vouch_for_this_one():
    with Peer(timeout=60) as a, Peer(timeout=60) as b:
        pid, start, _, pidns = a.call(_identity)
        other_life = b.call(_identity)[2]
        assert not _C.process_alive(pid, start, other_life, pidns ^ 0x5A5A)


def test_unknown_is_not_dead_when_no_fd_is_left_to_look():
    with Peer(timeout=60) as peer:
        identity = peer.call(_identity)
    dead = _elsewhere(identity)
    assert run_in_subprocess(_alive_at_fd_limit, dead, timeout=60) == (True, False)


def test_a_forked_child_has_its_own_life_file_and_does_not_keep_its_parent_alive():
    peer = Peer(timeout=60)
    try:
        parent = peer.call(_identity)
        peer.call(_pipe)
        child_pid = peer.call(_fork_a_child_that_stays)["child_pid"]
        child = peer.call(_read_child_identity)
        assert child[0] == child_pid and child[2] not in (0, parent[2])
        assert _C.process_alive(*_elsewhere(child)) and _C.process_alive(*_elsewhere(parent))
    finally:
        peer.kill()
    try:
        parent_dead = u.poll_until(lambda: not _C.process_alive(*_elsewhere(parent)))
        assert parent_dead, "the forked child's copy kept its parent's lock"
        assert _C.process_alive(*_elsewhere(child))
    finally:
        os.kill(child_pid, signal.SIGKILL)
    assert u.poll_until(lambda: not _C.process_alive(*_elsewhere(child)))


def _server_path_with(folder: str) -> str:
    from torch_ipc import _runtime

    _runtime.ensure_started()  # the exit hook, as any export through the Python API registers it
    fd = os.memfd_create("x", os.MFD_CLOEXEC)
    u.HELD["fd"] = fd
    _C._testing.fd_publish([fd], [1])
    return _C._testing.fd_server_path()


@pytest.fixture
def short_folder():
    """A folder with a short path: a socket's path must fit 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="tipc", dir="/tmp") as d:
        yield Path(d)


@pytest.mark.parametrize("mode", [0o755, 0o700])
def test_the_socket_folder_must_be_this_uids_with_mode_0700(short_folder, mode):
    folder = short_folder / "sockets"
    folder.mkdir()
    folder.chmod(mode)
    with Peer(timeout=60, env={"TORCH_IPC_SOCKET_DIR": str(folder)}) as peer:
        path = peer.call(_server_path_with, str(folder))
        if mode == 0o700:
            assert path.startswith(str(folder) + "/torch_ipc.") and stat.S_ISSOCK(os.stat(path).st_mode)
        else:
            assert path == "" and os.listdir(folder) == [], "a socket in a folder others may write to"
        peer.close()
    assert os.listdir(folder) == [], "the socket at a path outlived its server's clean exit"


def test_doctor_says_when_the_socket_folder_cannot_serve_peers_in_other_namespaces(short_folder, monkeypatch):
    from torch_ipc import doctor

    row = doctor._check_other_namespaces()
    assert row.status == doctor.OK and "life file" in row.detail, row
    folder = short_folder / "sockets"
    folder.mkdir()
    folder.chmod(0o755)
    monkeypatch.setenv("TORCH_IPC_SOCKET_DIR", str(folder))
    row = doctor._check_other_namespaces()
    assert row.status == doctor.WARN and "mode 0755, not 0700" in row.detail and "TORCH_IPC_SOCKET_DIR" in row.fix, row
