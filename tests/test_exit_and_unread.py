"""Exports at the edges of a process's life and of a connection's.

A ``q.put(t)`` right before the main process returns still reaches the
consumer, and nothing stays in /dev/shm (Note [exit order] in _runtime.py);
an export after the shutdown is refused. Messages sent through a
multiprocessing Pipe whose reader died unread are given back (Note [unread
messages] in _channels.py), and stats() shows the live exports with their
age meanwhile. CPU tensors, real processes.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import Pipe

import pytest
import torch

import ipc_test_utils as u
import torch_ipc

TIMEOUT = 120
RECLAIM_S = 5.0

PUT_THEN_RETURN = textwrap.dedent("""
    import multiprocessing as mp
    import os
    import sys

    import torch
    import torch_ipc


    def consumer(q, ready, out_path):
        ready.send("ready")
        t = q.get(timeout=100)
        with open(out_path, "w") as f:
            f.write(f"{t.dtype} {t.numel()} {int(t.sum())}")


    if __name__ == "__main__":
        torch_ipc.init_reductions()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ready, child_end = ctx.Pipe()
        ctx.Process(target=consumer, args=(q, child_end, sys.argv[1])).start()
        print(os.getpid(), flush=True)
        # (multiprocessing itself unlinks the queue's semaphores at exit, so
        # the child must have them before the parent returns)
        assert ready.recv() == "ready"
        q.put(torch.arange(1000, dtype=torch.int64))
        # returns at once: the queue's feeder thread exports and sends at exit
""")


def test_put_then_return_delivers_and_leaves_nothing(tmp_path):
    script = tmp_path / "put_then_return.py"
    script.write_text(PUT_THEN_RETURN)
    out = tmp_path / "received"
    package_root = os.path.dirname(os.path.dirname(torch_ipc.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path, env=env
    )
    assert run.returncode == 0, run.stderr
    producer = int(run.stdout.split()[0])
    assert out.read_text() == f"torch.int64 1000 {sum(range(1000))}", run.stderr
    assert u.process_gone(producer)
    assert u.shm_files_of(producer) == [], "the producer left shared memory behind"


def _dumps_after_shutdown() -> str:
    torch_ipc.dumps(torch.ones(3))
    torch_ipc._runtime._at_exit()  # what the exit hook does
    try:
        torch_ipc.dumps(torch.ones(3))
    except RuntimeError as e:
        return str(e)
    return "exported"


def test_export_after_shutdown_is_refused(ipc_spawn):
    assert "is exiting" in ipc_spawn(_dumps_after_shutdown)


# ----------------------------------------------------------------------------- unread messages


def _send_unread(count: int, duplex: bool):
    """Send `count` tensors through a Pipe whose only reader is a process that
    never reads; return its pid and the exports it holds up."""
    torch_ipc.init_reductions()
    reader_end, writer_end = Pipe(duplex=duplex)
    reader = subprocess.Popen(["sleep", "600"], pass_fds=[reader_end.fileno()])
    reader_end.close()  # the reader process has the only reading end
    for i in range(count):
        writer_end.send(torch.full((1000,), i, dtype=torch.int64))
    u.HELD["unread"] = (writer_end, reader)
    return reader.pid, torch_ipc.stats()


def _reap_reader() -> int:
    writer_end, reader = u.HELD["unread"]
    return reader.wait(TIMEOUT)


@pytest.mark.parametrize("duplex", [False, True], ids=["pipe", "socketpair"])
def test_messages_of_a_dead_reader_are_given_back(ipc_peer, duplex):
    count = 10
    reader, s = ipc_peer.call(_send_unread, count, duplex)
    assert s["exports"] == count and s["tokens_pending"] == count, s
    time.sleep(0.3)  # several collections: a living reader keeps its messages
    s = ipc_peer.call(u.stats)
    assert s["exports"] == count, f"given back while the reader lives: {s}"
    oldest = s["oldest_exports"]
    assert len(oldest) == count and all(e["age_s"] >= 0.3 and e["bytes"] == 8000 for e in oldest), oldest
    assert [e["age_s"] for e in oldest] == sorted((e["age_s"] for e in oldest), reverse=True)
    os.kill(reader, signal.SIGKILL)
    assert ipc_peer.call(_reap_reader) == -signal.SIGKILL
    s = ipc_peer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)
    assert s["exports"] == 0 and s["oldest_exports"] == [], f"kept after the reader died: {s}"
