"""Share a tensor with an unrelated script: the server side.

Two terminals on one machine:

    python examples/listener_server.py              # prints the address and the key
    python examples/listener_client.py ADDRESS --authkey KEY

The server listens with ``torch_ipc.listen(address, authkey=...)``; the client
connects with ``torch_ipc.connect(address, authkey=...)`` (a wrong key is
refused). The server sends a tensor, zero-copy; the client negates it in place
and sends back a tensor of its own; the server checks both and exits non-zero
on a wrong value. ADDRESS is a Unix socket path (the default: a fresh one) or
HOST:PORT. The key can also come from the TORCH_IPC_AUTHKEY variable, which
keeps it off the command line. Works on CPU when there is no GPU.
"""
import argparse
import os
import secrets
import signal
import sys

import torch

import torch_ipc

REPLY_TIMEOUT = 60  # seconds to wait for the client once it is connected


def parse_address(text):
    """'HOST:PORT' -> (host, port); anything else is a Unix socket path."""
    host, sep, port = text.rpartition(":")
    return (host, int(port)) if sep and port.isdigit() and "/" not in text else text


def show_address(address):
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else address


def on_alarm(*_):
    raise TimeoutError("no client connected in time (--timeout)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="Unix socket path or HOST:PORT (default: a fresh Unix socket)")
    ap.add_argument("--authkey", default=os.environ.get("TORCH_IPC_AUTHKEY"),
                    help="shared secret (default: $TORCH_IPC_AUTHKEY, else a random one)")
    ap.add_argument("--timeout", type=int, default=0, help="seconds to wait for a client (default: forever)")
    args = ap.parse_args()
    authkey = args.authkey or secrets.token_hex(16)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    x = torch.arange(16.0, device=device)
    address = parse_address(args.address) if args.address else None
    with torch_ipc.listen(address, authkey=authkey.encode()) as listener:
        where = show_address(listener.address)
        print(f"listening on {where} (tensor on {device})")
        print(f"authkey: {authkey}")
        print(f"in another terminal: python examples/listener_client.py {where} --authkey {authkey}", flush=True)
        if args.timeout:
            signal.signal(signal.SIGALRM, on_alarm)
            signal.alarm(args.timeout)
        with listener.accept() as conn:
            signal.alarm(0)
            conn.send(x)  # the client gets our memory, not a copy
            if not conn.poll(REPLY_TIMEOUT):
                sys.exit("FAILED: the client did not answer")
            word, theirs = conn.recv()  # raises EOFError if the client died
            ok = (word == "negated" and torch.equal(x.cpu(), -torch.arange(16.0))
                  and torch.equal(theirs.cpu(), torch.full((4,), 3.0)))
            print(f"server sees the client's write: {x[:4].tolist()} ...; client's tensor: {theirs.tolist()}")
            del theirs  # let go of the client's memory before it exits
            conn.send("bye")
    if not ok:
        sys.exit("FAILED: wrong values")
    print("ok")


if __name__ == "__main__":
    try:
        main()
    except (OSError, EOFError, RuntimeError, ValueError) as e:  # a one-line reason, not a traceback
        sys.exit(f"FAILED: {e}")
