"""The shared-memory channel against a peer that misbehaves, and at its limits:
the bells a peer shares, the segment's checks, two processes on one end, the
fd limit and Ctrl-C (Note [channel] in torch_ipc/mp/_ring.py). Hostile peers
are real second processes that hold only the other end's fds."""
import multiprocessing as mp
import os
import resource

import torch_ipc

TIMEOUT = 60.0


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _pipes_at_each_fd_limit(queue):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
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
