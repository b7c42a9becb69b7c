"""The stale-file sweep (Note [sweep] in csrc/os/sweep.h), no GPU needed: files
of dead processes go, files of live ones stay whatever pid they carry (another
PID namespace, a recycled pid, the same pid after execv), files of other users
are never touched, the collector sweeps on its own, and sweeping leaks no
pidfds."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc import _C
from torch_ipc.testing import Peer

# Children import the torch_ipc this process imported: the installed package,
# or the checkout's in-place build (the checkout has no _C after an install).
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torch_ipc.__file__)))
SHM = "/dev/shm"


def _alive_prefix() -> str:
    """torch_ipc.<pid>.<start>. of this (live) process: only the lock may
    decide about files named so (a pid check would call them alive)."""
    pid, start = _C.self_process()
    return f"torch_ipc.{pid}.{start}."


def _make_file(name: str, size: int, uid: int = -1) -> str:
    """A file named like torch_ipc's, of `size` bytes, that nobody holds a lock on."""
    path = os.path.join(SHM, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    if uid >= 0:
        os.chown(path, uid, -1)
    return path


def _export_cpu(key: str = "x"):
    t = torch.arange(1024, dtype=torch.float32)
    u.HELD[key] = t
    return torch_ipc.dumps(t)


def _own_files():
    return u.shm_files_of(os.getpid())


def _sweep_now():
    return _C.sweep()


def _pidfds() -> int:
    """pidfds this process has open."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:
            pass
    return n


def _pidfds_after_sweep():
    _C.sweep()
    return _pidfds()


def _run(script: str, *args: str, timeout: float = 120, prefix=()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


# ----------------------------------------------------------------------------- dead or alive by lock


def test_a_dead_producers_files_go_and_a_live_ones_stay():
    with Peer(timeout=120, name="live-producer") as live, Peer(timeout=120, name="dead-producer") as dead:
        live.call(_export_cpu)
        dead.call(_export_cpu)
        live_files, dead_files = u.shm_files_of(live.pid), u.shm_files_of(dead.pid)
        assert {f.split(".")[3][0] for f in dead_files} == {"L", "H"}, dead_files
        dead.kill()
        assert u.process_gone(dead.pid)
        live.call(_sweep_now)
        assert u.shm_files_of(dead.pid) == [], "the files of a killed producer survive a sweep"
        assert u.shm_files_of(live.pid) == live_files, "a sweep removed a live producer's files"


def test_a_young_anchor_without_bytes_is_being_created_and_an_old_one_is_stale():
    """The owner locks an anchor before giving it bytes; a sweeper that sees no
    bytes yet must wait (a minute), not remove it."""
    path = _make_file(_alive_prefix() + f"L{os.urandom(4).hex()}", 0)
    try:
        _C.sweep()
        assert os.path.exists(path), "an anchor being created was removed"
        old = time.time() - 120
        os.utime(path, (old, old))
        _C.sweep()
        assert not os.path.exists(path), "an anchor that never got bytes stays forever"
    finally:
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another uid needs root")
def test_files_of_another_user_are_never_swept():
    """Root may unlink anybody's files in /dev/shm: the sweep must still judge
    only its own uid's."""
    theirs = _make_file(_alive_prefix() + f"L{os.urandom(4).hex()}", 4096, uid=65534)
    ours = _make_file(_alive_prefix() + f"L{os.urandom(4).hex()}", 4096)
    try:
        _C.sweep()
        assert os.path.exists(theirs), "the sweep removed another user's file"
        assert not os.path.exists(ours), "the sweep left a stale file of ours"
    finally:
        for path in (theirs, ours):
            if os.path.exists(path):
                os.unlink(path)


# ----------------------------------------------------------------------------- namespaces, pid reuse, exec

_NAMESPACED_PRODUCER = """
import sys, torch, torch_ipc
t = torch.arange(1000, dtype=torch.float32)
data = torch_ipc.dumps(t)
pid, start_time = torch_ipc._C.self_identity()[:2]
print(pid, start_time, flush=True)   # its pid in its own namespace, and what its files are named by
sys.stdin.readline()             # until the test has swept
"""


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-Urpf", "--mount-proc", "true"], capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -Urpf (user and PID namespaces)")
def test_a_live_producer_in_another_pid_namespace_keeps_its_files():
    """docker --ipc=host: the producer's pid means nothing here (in its own
    namespace it is pid 1, here pid 1 is init); its lock says it lives."""
    env = dict(os.environ, PYTHONPATH=IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(["unshare", "-Urpf", "--mount-proc", sys.executable, "-c", _NAMESPACED_PRODUCER],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    inner = None  # (pid, start time): other namespaced producers running beside this test are pid 1 too
    try:
        pid, start_time = child.stdout.readline().split()
        inner = (int(pid), int(start_time))
        files = u.shm_files_of(*inner)
        assert files and inner[0] != child.pid, (inner, files)
        with Peer(timeout=120, name="sweeper") as sweeper:
            sweeper.call(_sweep_now)
        assert u.shm_files_of(*inner) == files, "a live producer's files were swept for its pid"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
        assert u.shm_files_of(*inner) == [], "the producer's exit hook left its files"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for name in u.shm_files_of(*inner) if inner else []:
            os.unlink(os.path.join(SHM, name))


_EXEC_TWICE = """
import json, os, sys, torch, torch_ipc
from torch_ipc import _C

def names():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"torch_ipc.{os.getpid()}."))

if sys.argv[1] == "before":
    t = torch.arange(1000, dtype=torch.float32)
    data = torch_ipc.dumps(t)
    before = names()
    os.execv(sys.executable, [sys.executable, "-c", SCRIPT, "after", json.dumps(before)])
else:
    before = json.loads(sys.argv[2])
    t = torch.arange(1000, dtype=torch.float32) * 2
    data = torch_ipc.dumps(t)          # the names of the image before exist still
    mine = names()
    back = torch_ipc.loads(data)
    _C.sweep()
    print(json.dumps(dict(before=before, mine=mine, equal=bool(torch.equal(back, t)),
                          left=[n for n in before if os.path.exists("/dev/shm/" + n)])))
"""


def test_after_execv_the_same_pid_exports_again_and_the_old_images_files_go():
    """execv keeps the pid and the start time: the new image's names must not
    collide with the old one's, and the old one's files, whose lock went with
    the exec, are stale although a process with their pid and start time lives
    (what a recycled pid looks like to a pid check)."""
    script = "SCRIPT = " + repr(_EXEC_TWICE) + "\n" + _EXEC_TWICE
    r = _run(script, "before")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["before"] and out["mine"], out
    assert out["equal"], "the export after exec does not load back"
    assert set(out["before"]).isdisjoint(out["mine"]), out
    assert out["left"] == [], f"files of the image before exec survive a sweep: {out}"


# ----------------------------------------------------------------------------- the collector sweeps


def test_the_collector_of_a_consumer_sweeps_a_killed_producers_files():
    """Without an exit hook (SIGKILL) a producer's files stay until somebody
    sweeps; a long-running consumer that never exports does it within its
    TORCH_IPC_SWEEP_INTERVAL."""
    quiet = {"TORCH_IPC_SWEEP_INTERVAL": "3600"}  # the source sweeps once, at its start
    with Peer(timeout=120, env=quiet, name="source") as source, \
         Peer(timeout=120, env={"TORCH_IPC_SWEEP_INTERVAL": "0.2"}, name="consumer") as consumer:  # fmt: skip
        consumer.call(u.load_quietly, "x", source.call(_export_cpu))  # starts its collector
        with Peer(timeout=120, env=quiet, name="killed") as killed:
            killed.call(_export_cpu)
            assert u.shm_files_of(killed.pid)
            killed.kill(signal.SIGKILL)
            pid = killed.pid
        assert u.process_gone(pid)
        start = time.monotonic()
        while u.shm_files_of(pid) and time.monotonic() < start + 2.0:
            time.sleep(0.02)
        took = time.monotonic() - start
        assert u.shm_files_of(pid) == [], f"a killed producer's files stay {took:.1f} s after its death"
        assert consumer.call(u.stats)["exports"] == 0, "the consumer exported: it would sweep anyway"


# ----------------------------------------------------------------------------- pidfds


def test_sweeping_keeps_no_pidfd_of_processes_that_exited():
    """A sweep judges by locks and opens no pidfd (it opened one per live
    producer, kept after that producer exited); the pidfds loads open for
    producers that exited since are closed by the next sweep."""
    with Peer(timeout=120, name="sweeper") as sweeper:
        base = sweeper.call(_pidfds)
        producers = [Peer(timeout=120, name=f"producer-{i}") for i in range(4)]
        try:
            descriptors = [p.call(_export_cpu) for p in producers]
            for i, data in enumerate(descriptors[:2]):  # the other two it only sees in /dev/shm
                sweeper.call(u.load_quietly, f"x{i}", data)
            sweeper.call(_export_cpu)  # its first export sweeps, all of them alive
            assert sweeper.call(_pidfds_after_sweep) <= base + 2, "the sweep opened pidfds"
            sweeper.call(u.drop)
        finally:
            for p in producers:
                p.kill()
        for p in producers:
            assert u.process_gone(p.pid)
        assert sweeper.call(_pidfds_after_sweep) == base, "pidfds of exited producers stay open"


_POOL_THEN_EXIT = """
import os, sys, torch, torch_ipc
import torch.multiprocessing as mp

def work(i):
    return os.getpid(), torch.full((1 << 18,), float(i))

if __name__ == "__main__":
    torch_ipc.init_reductions()
    with mp.get_context("fork").Pool(2) as pool:  # its workers end by SIGTERM: no exit hooks
        got = pool.map(work, range(8), chunksize=1)
    assert sum(float(t[0]) for _, t in got) == 28.0
    print(" ".join(sorted({str(pid) for pid, _ in got})))
"""


def _private_shm_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--mount", "--fork", "true"], capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(not _private_shm_works(), reason="needs root and unshare --mount (a /dev/shm of its own)")
def test_a_pools_results_leave_no_files_once_the_program_exits():
    # shutdown() sweeps what exited producers left; in a /dev/shm of its own, no
    # other torch_ipc process sweeps for it.
    shell = ("mount -t tmpfs tmpfs /dev/shm || exit 3; \"$0\" -c \"$1\" > /tmp/pool.pids.$$ || exit 4; "
             "test -s /tmp/pool.pids.$$ || exit 5; "
             "for p in $(cat /tmp/pool.pids.$$); do ls /dev/shm | grep \"^torch_ipc\\.$p\\.\" ; done; "
             "rm -f /tmp/pool.pids.$$; true")
    env = dict(os.environ, PYTHONPATH=IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(["unshare", "--mount", "--fork", "bash", "-c", shell, sys.executable, _POOL_THEN_EXIT],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [], f"files of the pool's workers left behind: {r.stdout.split()[:5]}"
