"""Producer and consumers in different PID, network and IPC namespaces that
share /dev/shm, a socket folder and the uid (containers without hostPID or
hostNetwork; issue 29). Liveness and holder identity come from life files
(Note [life files] in csrc/os/life.h), never from a pid the other side cannot
see; VMM file descriptors travel through the fd server's socket at a path
(Note [fd server at a path] in csrc/os/fd_passing.cpp). Consumers run under
`unshare --pid --net --ipc --fork --mount-proc` (tests/namespace_helpers.py)."""
import os
import secrets
import stat

import ipc_test_utils as u
import pytest
import torch
from namespace_helpers import UNSHARE_PID_ONLY, UNSHARE_TIME, NamespacedChild, needs_namespaces, run_namespaced

import torch_ipc
from torch_ipc import _C
from torch_ipc.testing import Peer

pytestmark = needs_namespaces()

# ----------------------------------------------------------------------------- producer functions
# (module level: the Peer imports this module to find them)


def _export_to_file(path: str, consumers) -> dict:
    x = torch.arange(6.0)
    e = torch_ipc.export(x, consumers=consumers)
    u.HELD["x"], u.HELD["export"] = x, e
    with open(path, "wb") as f:
        f.write(e.data)
    return dict(pid=os.getpid(), pidns=os.stat("/proc/self/ns/pid").st_ino)


def _held_values() -> list:
    return u.HELD["x"].tolist()


def _export_stays_live(collections: int) -> bool:
    for _ in range(collections):
        torch_ipc.collect()
    return u.HELD["export"].live


def _export_reclaimed() -> bool:
    return u.collect_until(lambda: not u.HELD["export"].live, timeout=20)


def _serve_one(address: str, authkey: bytes) -> dict:
    x = torch.zeros(4)
    with torch_ipc.listen(address, authkey=authkey) as listener:
        with listener.accept() as c:
            c.send(x)
            total = c.recv()
            seen = x.tolist()
            peer_alive = c._peer_alive()
            c.send("bye")
    return dict(total=total, seen=seen, me=list(_C.self_identity()), peer_alive=peer_alive)


def _publish_memfd(payload: bytes) -> dict:
    fd = os.memfd_create("torch_ipc-test", os.MFD_CLOEXEC)
    os.pwrite(fd, payload, 0)
    u.HELD.setdefault("fds", []).append(fd)
    ident = _C._testing.fd_publish([fd], [len(payload)])
    return dict(identity=list(_C.self_identity()), id=ident, fd=fd, path=_C._testing.fd_server_path(),
                served=_C.stats()["fd_served"])  # fmt: skip


def _fd_served() -> int:
    return _C.stats()["fd_served"]


def _load_file(path: str) -> list:
    y = torch_ipc.loads(open(path, "rb").read())
    return y.tolist()


# ----------------------------------------------------------------------------- tests


def test_a_cpu_tensor_goes_through_a_file_to_a_consumer_in_other_namespaces(tmp_path):
    path = str(tmp_path / "x.tipc")
    with Peer(timeout=60) as producer:
        host = producer.call(_export_to_file, path, None)
        (got,) = run_namespaced("load", path, "write")
        assert "error" not in got, got
        assert got["pidns"] != host["pidns"] and got["values"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        assert got["lease_segments"] == 1, "a collection took the living producer for dead"
        assert producer.call(_held_values) == got["values"]  # the same memory


def test_listener_and_client_at_a_socket_path_across_namespaces(tmp_path):
    address, key = str(tmp_path / "listener.sock"), secrets.token_bytes(16)
    with Peer(timeout=60) as producer:
        producer.start_call(_serve_one, address, key)
        u.poll_until(lambda: os.path.exists(address), timeout=30)
        (got,) = run_namespaced("client", address, key.hex())
        served = producer.result()
    assert got["values"] == [1.0] * 4 and (served["total"], served["seen"]) == (4.0, [1.0] * 4)
    # Each end takes the other for alive: here by the pid the kernel shows, there by the life key.
    assert served["peer_alive"] and got["peer_alive"], (served, got)
    assert got["peer"][1:3] == served["me"][1:3]  # start time and life key, as the listener sent them


@needs_namespaces(UNSHARE_TIME)
def test_a_consumer_in_a_time_namespace_takes_the_living_producer_for_alive(tmp_path):
    # /proc/<pid>/stat's start times count from boot as the reader's time
    # namespace sees it: a day off here (Note [start times across time namespaces]).
    path = str(tmp_path / "x.tipc")
    with Peer(timeout=60) as producer:
        producer.call(_export_to_file, path, None)
        (got,) = run_namespaced("load", path, "write", unshare=UNSHARE_TIME)
        assert "error" not in got, got
        assert got["values"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and producer.call(_held_values) == got["values"]
        assert got["lease_segments"] == 1, "a collection took the living producer for dead"


@needs_namespaces(UNSHARE_PID_ONLY)
def test_a_client_in_a_pid_namespace_without_its_own_proc(tmp_path):
    # getpid() counts in the new namespace, /proc in the old one (Note [whose
    # pid]): the client's start time must still be its own, or the listener
    # takes it for dead and revokes what it sends.
    address, key = str(tmp_path / "listener.sock"), secrets.token_bytes(16)
    with Peer(timeout=60) as producer:
        producer.start_call(_serve_one, address, key)
        u.poll_until(lambda: os.path.exists(address), timeout=30)
        (got,) = run_namespaced("client", address, key.hex(), unshare=UNSHARE_PID_ONLY)
        served = producer.result()
    assert got["values"] == [1.0] * 4 and (served["total"], served["seen"]) == (4.0, [1.0] * 4)
    assert served["peer_alive"] and got["peer_alive"], (served, got)


def test_a_consumer_killed_in_its_namespace_is_reclaimed_and_a_living_one_is_not(tmp_path):
    # Its pid names nothing, or another process, in the producer's namespace:
    # the producer must judge it by its life file both ways.
    path = str(tmp_path / "x.tipc")
    with Peer(timeout=60) as producer:
        producer.call(_export_to_file, path, 1)
        with NamespacedChild("load", path, "hold") as consumer:
            got = consumer.next()
            assert got["values"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], got
            assert producer.call(_export_stays_live, 20), "a living consumer's hold was reclaimed"
            consumer.kill()
            assert producer.call(_export_reclaimed), "the hold of a consumer killed in its namespace was kept"


def test_a_killed_producer_is_gone_for_a_consumer_in_other_namespaces(tmp_path):
    path = str(tmp_path / "x.tipc")
    producer = Peer(timeout=60)
    try:
        producer.call(_export_to_file, path, None)
    finally:
        producer.kill()
    (got,) = run_namespaced("load", path, timeout=60)
    assert got["error"] == "ProducerGoneError", got


def test_the_sweep_keeps_a_living_foreign_producers_files_and_removes_a_dead_ones(tmp_path):
    path = str(tmp_path / "x.tipc")
    with NamespacedChild("produce", path) as foreign:
        made = foreign.next()
        assert made["pidns"] != os.stat("/proc/self/ns/pid").st_ino
        files = made["files"]
        assert f"torch_ipc.life.{made['life']:08x}" in files and any(".L" in f for f in files), files
        _C.sweep()
        assert all(os.path.exists(f"/dev/shm/{f}") for f in files), "the sweep removed a living producer's files"
        # And a consumer here loads from it, judging it by its life file.
        with Peer(timeout=60) as consumer:
            assert consumer.call(_load_file, path) == [float(i) for i in range(8)]
        foreign.kill()
    assert u.poll_until(lambda: (_C.sweep(), not any(os.path.exists(f"/dev/shm/{f}") for f in files))[1], timeout=10)


def test_fds_reach_a_consumer_in_other_namespaces_through_the_socket_folder():
    # The abstract socket of the producer is in another network namespace and
    # pidfd_getfd cannot name it from another PID namespace (VMM memory,
    # expandable segments and SharedPool, travels this way).
    with Peer(timeout=60) as producer:
        pub = producer.call(_publish_memfd, b"across namespaces")
        assert pub["path"] and stat.S_ISSOCK(os.stat(pub["path"]).st_mode), pub
        (got,) = run_namespaced("fetch_fds", *map(str, pub["identity"]), str(pub["id"]))
        assert got == {"contents": ["across namespaces"]}, got
        assert producer.call(_fd_served) == pub["served"] + 1


def test_pidfd_is_never_used_on_a_pid_of_another_namespace():
    # There the producer's number may be this very consumer (both pid 1 of
    # their containers): pulling its fd numbers would take the wrong files.
    with Peer(timeout=60) as producer:
        pub = producer.call(_publish_memfd, b"x")
        (got,) = run_namespaced("fetch_fds", *map(str, pub["identity"]), str(pub["id"]), "pidfd", str(pub["fd"]))
        assert got["error"] in ("OSError", "ProcessLookupError") and "another PID namespace" in got["message"], got
        (auto,) = run_namespaced("fetch_fds", *map(str, pub["identity"]), str(pub["id"]), "auto", str(pub["fd"]))
        assert auto == {"contents": ["x"]}, auto


# ----------------------------------------------------------------------------- GPU (issue 29's table)

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def _export_cuda_to_file(path: str) -> dict:
    x = torch.arange(6.0, device="cuda")
    e = torch_ipc.export(x, consumers=1)
    torch.cuda.synchronize()
    u.HELD["x"], u.HELD["export"] = x, e
    with open(path, "wb") as f:
        f.write(e.data)
    return dict(kind=torch_ipc._C.describe(e.data)["allocs"][0]["kind"], fd_stats=_C.stats()["fd_served"])


@pytest.mark.cuda
@pytest.mark.parametrize("env, kind", [({}, 1), (EXPANDABLE, 2)], ids=["cudaMalloc", "expandable-segments"])
def test_cuda_memory_reaches_a_consumer_in_other_namespaces(tmp_path, env, kind):
    # In a new PID namespace pidfd_getfd cannot name the producer, and in a new
    # network namespace its abstract socket cannot be reached: VMM fds take the
    # socket folder; legacy IPC handles need neither.
    path = str(tmp_path / "x.tipc")
    with Peer(timeout=120, env=env) as producer:
        made = producer.call(_export_cuda_to_file, path)
        assert made["kind"] == kind
        with NamespacedChild("load", path, "write", "hold", timeout=120) as consumer:
            got = consumer.next()
            assert got.get("values") == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], got
            assert producer.call(_held_values) == got["values"]
            if kind == 2:
                assert producer.call(_fd_served) == made["fd_stats"] + 1
            consumer.kill()
            assert producer.call(_export_reclaimed)
