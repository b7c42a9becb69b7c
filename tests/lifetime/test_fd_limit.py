"""A process at its fd limit: "could not check" is never "dead" (Note [unknown is
not dead] in csrc/os/sweep.cpp). Its sweep keeps a live producer's files, and a
load that cannot read /proc says so (OSError EMFILE), not "the producer has
exited". CPU only; the process at its limit is a child of its own."""
import errno
import os
import resource

import ipc_test_utils as u
import torch

import torch_ipc
from torch_ipc import _C
from torch_ipc.testing import Peer, run_in_subprocess

_HELD = {}


def _export_and_hold(n: int):
    t = torch.arange(n, dtype=torch.float32)
    _HELD["t"] = t
    return torch_ipc.dumps(t, consumers=None)


def _write_first(value: float) -> None:
    _HELD["t"][0] = value


def _fill_fds(leave_free: int):
    """Lower RLIMIT_NOFILE a little above what is open and open fds until
    ``leave_free`` are left; the fds to close afterwards."""
    open_now = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 16, hard))
    fds = []
    while True:
        try:
            fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as e:
            assert e.errno == errno.EMFILE, e
            break
    for _ in range(leave_free):
        os.close(fds.pop())
    return fds


def _sweep_at_fd_limit() -> dict:
    """Sweep (and collect, as the collector does) with one fd free: enough to
    list /dev/shm, not to open an anchor. -> what the sweeps removed."""
    torch_ipc.dumps(torch.zeros(1))  # this process's own segments exist first
    fds = _fill_fds(leave_free=1)
    try:
        removed = [_C.sweep() for _ in range(5)]
        torch_ipc.collect()
    finally:
        for fd in fds:
            os.close(fd)
    return {"removed": removed, "swept_files": torch_ipc.stats()["swept_files"]}


def test_sweep_at_fd_limit_keeps_live_producers_files():
    with Peer() as producer:
        data = producer.call(_export_and_hold, 1024)
        files = u.shm_files_of(producer.pid)
        assert files, "the producer made no /dev/shm file"
        result = run_in_subprocess(_sweep_at_fd_limit)
        # What the sweeps removed is not checked by count: tests running beside
        # this one leave files of processes that really died, which a sweep may
        # remove (a pid found dead needs no fd). The live producer's must stay.
        assert u.shm_files_of(producer.pid) == files, \
            f"a sweep at its fd limit removed a live producer's files ({result})"
        t = torch_ipc.loads(data)  # a consumer loads afterwards, on the same memory
        producer.call(_write_first, 42.0)
        assert t[0].item() == 42.0 and t[1:].tolist() == list(range(1, 1024))


def _load_at_fd_limit(data: bytes) -> dict:
    """Load with no fd free, then with fds again."""
    torch_ipc.dumps(torch.zeros(1))  # what a process reads once (the boot id) is read
    fds = _fill_fds(leave_free=0)
    try:
        try:
            torch_ipc.loads(data)
            first = ("loaded", "")
        except Exception as e:  # reported to the test
            first = (type(e).__name__, str(e), getattr(e, "errno", None))
    finally:
        for fd in fds:
            os.close(fd)
    t = torch_ipc.loads(data)
    return {"first": first, "then": t[:4].tolist()}


def test_load_at_fd_limit_says_what_failed_not_producer_gone():
    with Peer() as producer:
        data = producer.call(_export_and_hold, 16)
        result = run_in_subprocess(_load_at_fd_limit, data)
        name, message, err = result["first"]
        assert name != "ProducerGoneError" and "has exited" not in message, result
        assert name == "OSError" and err == errno.EMFILE, result
        assert f"pid {producer.pid}" in message and "Too many open files" in message, message
        assert result["then"] == [0.0, 1.0, 2.0, 3.0]


def test_first_dumps_at_fd_limit_removes_nothing():
    """A process's first dumps() sweeps before it makes its segment; with one
    fd free it lists /dev/shm and can open no anchor."""
    with Peer() as producer:
        data = producer.call(_export_and_hold, 64)
        files = u.shm_files_of(producer.pid)
        run_in_subprocess(_first_dumps_at_fd_limit, 1)
        assert u.shm_files_of(producer.pid) == files
        assert torch_ipc.loads(data)[:3].tolist() == [0.0, 1.0, 2.0]


def _first_dumps_at_fd_limit(leave_free: int) -> None:
    fds = _fill_fds(leave_free=leave_free)
    try:
        torch_ipc.dumps(torch.zeros(4))
    except OSError as e:
        assert e.errno in (errno.EMFILE, errno.ENFILE), e
    finally:
        for fd in fds:
            os.close(fd)


# ----------------------------------------------------------------------------- KV pool members


def _kv_attach_and_write(data: bytes, n: int, value: int) -> list:
    from torch_ipc.kv import SharedKVPool

    pool = _HELD["pool"] = SharedKVPool.attach(data, KV_SHAPE, torch.int32)
    ids = pool.allocate(n)
    for i in ids:
        pool.block(i).fill_(value)
    return ids


def _kv_read(ids: list) -> list:
    return [_HELD["pool"].block(i).reshape(-1).unique().tolist() for i in ids]


def _kv_reclaim_at_fd_limit(data: bytes) -> int:
    """Attach, then reclaim with no fd free: at once, before this process's
    collector has looked at the other members (it would keep a pidfd of them)."""
    from torch_ipc.kv import SharedKVPool

    pool = _HELD["pool"] = SharedKVPool.attach(data, KV_SHAPE, torch.int32)
    fds = _fill_fds(leave_free=0)
    try:
        return pool.reclaim()
    finally:
        for fd in fds:
            os.close(fd)


KV_SHAPE = (2, 1, 4, 8)


def test_kv_member_at_fd_limit_keeps_a_live_peers_blocks():
    from torch_ipc.kv import SharedKVPool

    with SharedKVPool(16, KV_SHAPE, torch.int32, "cpu") as pool, Peer() as holder, Peer() as reclaimer:
        ids = holder.call(_kv_attach_and_write, torch_ipc.dumps(pool), 4, 7)
        assert reclaimer.call(_kv_reclaim_at_fd_limit, torch_ipc.dumps(pool)) == 0
        assert pool.holders()[holder.pid] == 4, pool.holders()
        mine = pool.allocate(12)
        assert not set(mine) & set(ids), "a live member's blocks were handed out again"
        for i in mine:
            pool.block(i).fill_(-1)
        assert holder.call(_kv_read, ids) == [[7]] * 4
