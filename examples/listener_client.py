"""Share a tensor with an unrelated script: the client side.

    python examples/listener_client.py ADDRESS --authkey KEY

Run examples/listener_server.py first: it prints ADDRESS and KEY. The client
receives the server's tensor (zero-copy), checks it, negates it in place, and
sends back a tensor of its own. Exits non-zero on a wrong value.
"""
import argparse
import os
import sys
from multiprocessing import AuthenticationError

import torch

import torch_ipc

TIMEOUT = 60  # seconds


def parse_address(text):
    """'HOST:PORT' -> (host, port); anything else is a Unix socket path."""
    host, sep, port = text.rpartition(":")
    return (host, int(port)) if sep and port.isdigit() and "/" not in text else text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("address", help="what the server printed: a Unix socket path or HOST:PORT")
    ap.add_argument("--authkey", default=os.environ.get("TORCH_IPC_AUTHKEY"),
                    help="the server's key (default: $TORCH_IPC_AUTHKEY)")
    args = ap.parse_args()
    if not args.authkey:
        ap.error("give the server's key with --authkey or TORCH_IPC_AUTHKEY")

    conn = torch_ipc.connect(parse_address(args.address), authkey=args.authkey.encode())
    with conn:
        if not conn.poll(TIMEOUT):
            sys.exit("FAILED: the server sent nothing")
        x = conn.recv()  # the server's memory
        print(f"client got a {tuple(x.shape)} tensor on {x.device}: {x[:4].tolist()} ...")
        if not torch.equal(x.cpu(), torch.arange(16.0)):
            sys.exit("FAILED: wrong values from the server")
        x.neg_()
        mine = torch.full((4,), 3.0, device=x.device)
        if x.is_cuda:
            torch.cuda.synchronize()  # our writes are done before we say so
        conn.send(("negated", mine))
        if not conn.poll(TIMEOUT) or conn.recv() != "bye":  # keep `mine` alive until then
            sys.exit("FAILED: the server did not finish")
    print("ok")


if __name__ == "__main__":
    try:
        main()
    except (OSError, EOFError, RuntimeError, ValueError, AuthenticationError) as e:
        # a one-line reason, not a traceback
        sys.exit(f"FAILED: {e}")
