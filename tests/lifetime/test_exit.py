"""Exports at the end of a process's life: a ``q.put(t)`` right before the
main process returns still reaches the consumer, and nothing stays in
/dev/shm (Note [exit order] in _runtime.py); an export after the shutdown is
refused. CPU tensors, real processes. Messages whose reader died unread:
channel/test_tensors_through_channels.py.
"""
import os
import subprocess
import sys
import textwrap

import ipc_test_utils as u
import torch

import torch_ipc

TIMEOUT = 120

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
