"""Share a tensor through a file holding torch_ipc.dumps(...) bytes.

    python examples/handle_file.py            # both roles: starts the consumer itself

or, in two terminals:

    python examples/handle_file.py --role producer --path /tmp/tensor.tipc
    python examples/handle_file.py --role consumer --path /tmp/tensor.tipc

A descriptor is a few hundred bytes that any process on this machine can turn
back into the tensor, so it can travel by any channel: a file, a database row,
an HTTP response. It refers to the producer's memory; it is not a copy of the
data, so the producer must stay alive until the consumer is done. Here the
consumer adds 100 in place and leaves PATH.done; the producer then checks that
it sees the write. ``loads`` unpickles, so read descriptors only from files you
trust (this one is written readable by its owner only). Works on CPU when
there is no GPU. Exits non-zero on a wrong value.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

import torch_ipc


def write_atomically(path, data):
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a reader never sees half a file


def producer(path, timeout, spawn_consumer):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(1000.0, device=device)
    write_atomically(path, torch_ipc.dumps(x))
    print(f"producer: wrote a descriptor of a tensor on {device} to {path} ({os.path.getsize(path)} bytes)")
    done = f"{path}.done"
    try:
        if spawn_consumer:
            cmd = [sys.executable, os.path.abspath(__file__), "--role", "consumer", "--path", path]
            try:
                subprocess.run(cmd, check=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                sys.exit(f"FAILED: the consumer did not finish in {timeout:g} s")
            except subprocess.CalledProcessError as e:
                sys.exit(f"FAILED: the consumer exited with code {e.returncode}")
        else:
            print(f"producer: waiting for a consumer: python {sys.argv[0]} --role consumer --path {path}")
            deadline = time.monotonic() + timeout
            while not os.path.exists(done):  # x must stay alive meanwhile
                if time.monotonic() > deadline:
                    sys.exit("FAILED: no consumer came")
                time.sleep(0.1)
        ok = torch.equal(x.cpu(), torch.arange(1000.0) + 100)
        print(f"producer: sees the consumer's write: {x[:3].tolist()} ...")
    finally:
        for f in (path, done):
            if os.path.exists(f):
                os.remove(f)
    if not ok:
        sys.exit("FAILED: wrong values")
    print("ok")


def consumer(path):
    if not os.path.exists(path):
        sys.exit(f"FAILED: no descriptor at {path}; start the producer first: "
                 f"python {sys.argv[0]} --role producer --path {path}")
    with open(path, "rb") as f:
        y = torch_ipc.loads(f.read())  # the producer's memory
    print(f"consumer: loaded a {tuple(y.shape)} tensor on {y.device}")
    if not torch.equal(y.cpu(), torch.arange(1000.0)):
        sys.exit("FAILED: wrong values from the producer")
    y.add_(100)
    if y.is_cuda:
        torch.cuda.synchronize()  # the write is done before we say so
    write_atomically(f"{path}.done", b"")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("producer", "consumer"),
                    help="run one side only (default: the producer, which starts the consumer itself)")
    ap.add_argument("--path", help="the descriptor file (default: a fresh temporary file)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds the producer waits for the consumer")
    args = ap.parse_args()
    if args.role == "consumer":
        if not args.path:
            ap.error("--role consumer needs --path")
        consumer(args.path)
    elif args.path:
        producer(args.path, args.timeout, spawn_consumer=args.role is None)
    else:
        with tempfile.TemporaryDirectory() as folder:
            producer(os.path.join(folder, "tensor.tipc"), args.timeout, spawn_consumer=args.role is None)


if __name__ == "__main__":
    try:
        main()
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:  # a one-line reason, not a traceback
        sys.exit(f"FAILED: {e}")
