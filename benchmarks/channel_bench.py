#!/usr/bin/env python3
"""The channel itself: a 64-byte round trip through torch_ipc's Connection
(listen/connect, on the shared-memory rings once connected) and through
torch_ipc.Pipe, against a multiprocessing Pipe, in the same run.

Each channel joins the parent to a forked child that echoes every message
back (recv_bytes, send_bytes). The parent times batches of round trips with
time.perf_counter_ns; the channels take turns batch by batch (paired), so
that a loaded machine slows them alike. The table gives, per channel, the
fastest batch's mean round trip (min) and the median batch's, and each over
the multiprocessing Pipe's in the same run.

Usage:
    python benchmarks/channel_bench.py            # 30 batches of 2000 round trips
    python benchmarks/channel_bench.py --quick    # 10 batches of 500
    python benchmarks/channel_bench.py --spin     # also: torch_ipc.Pipe at several spin budgets

Targets (issue 22): Connection <= 0.5x a multiprocessing Pipe on the 2-core CI
machine; <= 10 us on the H100 machine.
"""

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch_ipc  # noqa: E402
from torch_ipc.mp import _ring  # noqa: E402

AUTHKEY = b"channel-bench"
MESSAGE = b"x" * 64


def _echo(end, spin_us):
    if spin_us is not None:
        _ring.set_spin_us(spin_us)
    try:
        while True:
            end.send_bytes(end.recv_bytes())
    except (EOFError, OSError):
        pass


def _echo_connection(address, spin_us):
    with torch_ipc.connect(address, authkey=AUTHKEY) as conn:
        _echo(conn, spin_us)


def _batch(end, n):
    send, recv = end.send_bytes, end.recv_bytes
    start = time.perf_counter_ns()
    for _ in range(n):
        send(MESSAGE)
        recv()
    return (time.perf_counter_ns() - start) / n / 1000.0


class Channel:
    """One channel to an echoing child."""

    def __init__(self, name, kind, spin_us=None):
        self.name, self.times = name, []
        ctx = mp.get_context("fork")
        if kind == "connection":
            with torch_ipc.listen(authkey=AUTHKEY) as listener:
                self.proc = ctx.Process(target=_echo_connection, args=(listener.address, spin_us), daemon=True)
                self.proc.start()
                self.end = listener.accept()
        else:
            a, b = mp.Pipe() if kind == "mp" else torch_ipc.Pipe()
            self.proc = ctx.Process(target=_echo, args=(b, spin_us), daemon=True)
            self.proc.start()
            b.close()
            self.end = a
        self.spin_us = spin_us if spin_us is not None else _ring._C.channel_spin_ns() / 1000

    def run(self, n):
        _ring.set_spin_us(self.spin_us)
        self.times.append(_batch(self.end, n))

    def close(self):
        self.end.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def measure(channels, batches, n):
    for c in channels:  # warm-up
        c.run(max(n // 10, 50))
        c.times.clear()
    for _ in range(batches):
        for c in channels:
            c.run(n)


def table(channels, base):
    bmin, bmed = min(base.times), statistics.median(base.times)
    lines = ["| channel | min us | median us | min / mp Pipe | median / mp Pipe |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for c in channels:
        lo, med = min(c.times), statistics.median(c.times)
        lines.append(f"| {c.name} | {lo:.1f} | {med:.1f} | {lo / bmin:.2f}x | {med / bmed:.2f}x |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 batches of 500 round trips")
    ap.add_argument("--spin", action="store_true", help="torch_ipc.Pipe at several spin budgets too")
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("-n", type=int, default=None, help="round trips per batch")
    args = ap.parse_args()
    batches = args.batches or (10 if args.quick else 30)
    n = args.n or (500 if args.quick else 2000)
    default_spin = _ring._C.channel_spin_ns() / 1000
    channels = [Channel("multiprocessing.Pipe", "mp"),
                Channel("torch_ipc.Connection", "connection"),
                Channel("torch_ipc.Pipe", "pipe")]
    if args.spin:
        channels += [Channel(f"torch_ipc.Pipe, spin {us:g} us", "pipe", us) for us in (0, 2, 5, 10, 20, 50, 100)]
    try:
        measure(channels, batches, n)
    finally:
        for c in channels:
            c.close()
    print(f"64 B round trip, {batches} paired batches of {n}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; default spin {default_spin:g} us")
    print(table(channels, channels[0]))


if __name__ == "__main__":
    main()
