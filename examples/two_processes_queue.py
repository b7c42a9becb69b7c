"""A torch.multiprocessing Queue that carries tensors through torch_ipc.

    python examples/two_processes_queue.py

After ``torch_ipc.init_reductions()``, every multiprocessing Queue, Pipe and
Pool sends tensors (and whole dicts of them, as ONE message) through torch_ipc
instead of torch's own path: nothing else in the code changes. The parent puts
a dict of zeros on a queue; a spawned worker fills them in place and puts back
a tensor of its own; the parent sees both. Works on CPU when there is no GPU.
"""
import queue
import sys
import time

import torch
import torch.multiprocessing as mp

import torch_ipc

TIMEOUT = 60  # seconds


def get(q, peer):
    """q.get(), but give up when the peer process died or after TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            if not peer.is_alive():
                raise RuntimeError(f"{peer.name} exited with code {peer.exitcode}") from None
    raise TimeoutError(f"nothing from {peer.name} in {TIMEOUT} s")


def worker(tasks, results):
    torch_ipc.init_reductions()  # this process sends tensors back too
    parent = mp.parent_process()
    weights = get(tasks, parent)  # {"w": ..., "b": ...} on the parent's memory
    weights["w"].fill_(1.0)
    weights["b"].fill_(2.0)
    mine = torch.full((3,), 7.0, device=weights["w"].device)
    if mine.is_cuda:
        torch.cuda.synchronize()  # our writes are done before we report them
    results.put(("filled", mine))
    assert get(tasks, parent) == "bye"  # keep `mine` alive until the parent is done with it


def main():
    torch_ipc.init_reductions()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {device}" + ("" if device == "cuda" else " (no GPU: CPU tensors in shared memory)"))

    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    weights = {"w": torch.zeros(4, 4, device=device), "b": torch.zeros(4, device=device)}
    p = ctx.Process(target=worker, args=(tasks, results), name="worker")
    p.start()
    try:
        tasks.put(weights)  # one message, zero copies
        status, theirs = get(results, p)
        ok = (status == "filled"
              and bool((weights["w"] == 1).all()) and bool((weights["b"] == 2).all())
              and torch.equal(theirs.cpu(), torch.full((3,), 7.0)))
        print(f"parent sees the worker's writes: w = {weights['w'][0].tolist()}, b = {weights['b'].tolist()}")
        print(f"parent got the worker's own tensor: {theirs.tolist()}")
        del theirs  # drop it before the worker, its owner, exits
        tasks.put("bye")
        p.join(TIMEOUT)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    if not ok or p.exitcode != 0:
        sys.exit(f"FAILED (values ok: {ok}, worker exit code: {p.exitcode})")
    print("ok")


if __name__ == "__main__":
    try:
        main()
    except (OSError, RuntimeError, ValueError) as e:  # a one-line reason, not a traceback
        sys.exit(f"FAILED: {e}")
