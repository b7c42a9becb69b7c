"""A multiprocessing Pipe that carries tensors through torch_ipc.

    python examples/two_processes_pipe.py

``with torch_ipc.reductions():`` makes ``conn.send(obj)`` share the tensors in
``obj`` zero-copy (one descriptor per message) for the length of the block;
``conn.recv()`` on the other side needs nothing special. The parent sends a
list of tensors, the child scales them in place and sends back a tensor it
made; each side checks what it sees. Works on CPU when there is no GPU.
"""
import sys

import torch
import torch.multiprocessing as mp

import torch_ipc

TIMEOUT = 60  # seconds


def recv(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError("the other process did not answer")
    return conn.recv()  # raises EOFError if the other process died


def child(conn):
    batch = recv(conn)  # a list of tensors on the parent's memory
    for t in batch:
        t.mul_(2)
    total = torch.stack([t.sum() for t in batch])  # a new tensor, ours
    if total.is_cuda:
        torch.cuda.synchronize()  # writes done before we answer
    with torch_ipc.reductions():
        conn.send(total)
    assert recv(conn) == "done"  # keep `total` alive until the parent has let go


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {device}" + ("" if device == "cuda" else " (no GPU: CPU tensors in shared memory)"))
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=child, args=(child_end,))
    p.start()
    child_end.close()
    try:
        batch = [torch.full((1000,), float(i), device=device) for i in range(3)]
        with torch_ipc.reductions():
            parent_end.send(batch)
        total = recv(parent_end)
        scaled = [t[0].item() for t in batch]
        print(f"parent sees the child's in-place writes: {scaled}; child's sums: {total.tolist()}")
        ok = scaled == [0.0, 2.0, 4.0] and total.tolist() == [0.0, 2000.0, 4000.0]
        del total
        parent_end.send("done")
        p.join(TIMEOUT)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    if not ok or p.exitcode != 0:
        sys.exit(f"FAILED (values ok: {ok}, child exit code: {p.exitcode})")
    print("ok")


if __name__ == "__main__":
    try:
        main()
    except (OSError, EOFError, RuntimeError, ValueError) as e:  # a one-line reason, not a traceback
        sys.exit(f"FAILED: {e}")
