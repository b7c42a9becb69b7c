"""Two processes share one tensor, and each sees what the other writes.

    python examples/demo.py

The parent makes a tensor and sends ``torch_ipc.dumps(x)`` (a few hundred bytes)
to a spawned child, which rebuilds it with ``torch_ipc.loads`` on the SAME
memory: no copy is made. Then they take turns writing to it. With a CUDA GPU
the tensor lives in GPU memory (CUDA IPC); without one the same code shares a
CPU tensor through shared memory. Exits non-zero if a process sees a wrong value.
"""
import sys

import torch
import torch.multiprocessing as mp

import torch_ipc

TIMEOUT = 60  # seconds to wait for the other process at each step


def recv(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError("the other process did not answer")
    return conn.recv()


def child(conn):
    x = torch_ipc.loads(recv(conn))  # same memory as the parent's tensor
    print(f"child : got a {tuple(x.shape)} tensor on {x.device}, sum = {x.sum().item():g}")
    if not torch.equal(x.cpu(), torch.arange(8.0)):
        sys.exit("child : wrong values")

    x.mul_(10)  # write in place: the parent sees it
    if x.is_cuda:
        torch.cuda.synchronize()  # the write is done before we say so
    conn.send("written")

    assert recv(conn) == "your turn to check"
    if not torch.equal(x.cpu(), torch.arange(8.0) * 10 + 1):
        sys.exit("child : did not see the parent's write")
    print(f"child : sees the parent's write: {x.tolist()}")


def main():
    if torch.cuda.is_available():
        device = "cuda"
        print(f"sharing GPU memory on {torch.cuda.get_device_name()} (CUDA IPC)")
    else:
        device = "cpu"
        print("No CUDA GPU here: showing the CPU path (shared memory) with the same API.")

    x = torch.arange(8.0, device=device)
    ctx = mp.get_context("spawn")  # never fork a process that may use CUDA
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=child, args=(child_end,))
    p.start()
    child_end.close()  # the child has its own: if it dies, recv() sees EOF
    try:
        # dumps exports x; x must stay alive while the child uses it (torch_ipc
        # also keeps it alive until the child has let go).
        parent_end.send(torch_ipc.dumps(x))

        assert recv(parent_end) == "written"
        print(f"parent: sees the child's write: {x.tolist()}")
        if not torch.equal(x.cpu(), torch.arange(8.0) * 10):
            sys.exit("parent: did not see the child's write")

        x.add_(1)
        if x.is_cuda:
            torch.cuda.synchronize()  # the child's GPU work does not wait for ours
        parent_end.send("your turn to check")
        p.join(TIMEOUT)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    if p.exitcode != 0:
        sys.exit(f"parent: the child failed (exit code {p.exitcode})")
    print("ok: both processes saw each other's writes on one tensor")


if __name__ == "__main__":
    main()
