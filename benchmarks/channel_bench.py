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

The second table sends objects (send/recv, pickled) instead: 64 B of bytes,
a small dict, a 4 KiB CPU tensor and a 4 KiB CUDA tensor (skipped without
CUDA; answered by 0, see _reply), each echoed by a spawned child, on the
same three channels and on multiprocessing's own Pipe and Queue (put/get, a
Queue each way) with init_reductions() on, beside the same calls on
multiprocessing's Pipe and Queue with torch's reductions. Each row's ratios
are over the multiprocessing channel of the same calls (column "vs"). The
floor is the bytes round trip of the channel underneath (none for a Queue)
plus pickling and unpickling the object twice, with what that channel
pickles with.

Usage:
    python benchmarks/channel_bench.py            # 30 batches of 2000 round trips
    python benchmarks/channel_bench.py --quick    # 10 batches of 500
    python benchmarks/channel_bench.py --spin     # also: torch_ipc.Pipe at several spin budgets
    python benchmarks/channel_bench.py --no-objects  # the bytes table only

Targets (issue 22): Connection <= 0.5x a multiprocessing Pipe on the 2-core CI
machine; <= 10 us on the H100 machine. Objects (issue 32): within 2x of the
floor, <= 0.5x a multiprocessing Pipe's send()/recv().
"""

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time

try:  # the installed torch_ipc, else the one of this checkout (built in place)
    import torch_ipc
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_ipc
from torch_ipc import _serialize  # noqa: E402
from torch_ipc.mp import _ring  # noqa: E402

AUTHKEY = b"channel-bench"
MESSAGE = b"x" * 64


def _echo(end, spin_us, objects=False):
    if spin_us is not None:
        _ring.set_spin_us(spin_us)
    send, recv = (end.send, end.recv) if objects else (end.send_bytes, end.recv_bytes)
    try:
        while True:
            send(_reply(recv()))
    except (EOFError, OSError):
        pass


def _reply(message):
    """The message back; a CUDA tensor is answered by 0 (torch cannot send
    back a CUDA tensor it received, and every channel does the same work)."""
    return 0 if getattr(message, "is_cuda", False) else message


def _echo_connection(address, spin_us):
    with torch_ipc.connect(address, authkey=AUTHKEY) as conn:
        _echo(conn, spin_us)


def _batch(end, n, obj=MESSAGE, objects=False):
    send, recv = (end.send, end.recv) if objects else (end.send_bytes, end.recv_bytes)
    start = time.perf_counter_ns()
    for _ in range(n):
        send(obj)
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


# ---- objects: send()/recv() of pickled objects, echoed by a spawned child


def _message(kind):
    import torch

    if kind == "64 B bytes":
        return MESSAGE
    if kind == "small dict":
        return {"step": 7, "loss": 0.25, "name": "layer.3", "ids": [1, 2, 3]}
    return torch.zeros(1024, device="cuda" if kind == "4 KiB CUDA tensor" else "cpu")


def _echo_objects(end, reductions):
    if reductions:
        torch_ipc.init_reductions()
    _echo(end, None, objects=True)


def _echo_objects_connection(address, reductions):
    with torch_ipc.connect(address, authkey=AUTHKEY) as conn:
        _echo_objects(conn, reductions)


_STOP = "channel_bench: stop"


class QueueEnds:
    """send()/recv() over a pair of multiprocessing Queues, one each way."""

    def __init__(self, out, back):
        self.out, self.back = out, back

    def send(self, obj):
        self.out.put(obj)

    def recv(self):
        obj = self.back.get()
        if isinstance(obj, str) and obj == _STOP:
            raise EOFError
        return obj

    def other(self):
        return QueueEnds(self.back, self.out)

    def close(self):
        self.out.put(_STOP)


# name, what it is, the multiprocessing channel it is compared with, the bytes channel of its floor
OBJECT_CHANNELS = [
    ("multiprocessing.Pipe", "mp pipe", "multiprocessing.Pipe", "multiprocessing.Pipe"),
    ("torch_ipc.Connection", "connection", "multiprocessing.Pipe", "torch_ipc.Connection"),
    ("torch_ipc.Pipe", "pipe", "multiprocessing.Pipe", "torch_ipc.Pipe"),
    ("multiprocessing.Pipe, init_reductions", "mp pipe+", "multiprocessing.Pipe", "multiprocessing.Pipe"),
    ("multiprocessing.Queue", "mp queue", "multiprocessing.Queue", None),
    ("multiprocessing.Queue, init_reductions", "mp queue+", "multiprocessing.Queue", None),
]


class ObjectChannel:
    """One channel to a spawned child that echoes objects; torch_ipc's
    reductions on in both processes for all but multiprocessing's own."""

    def __init__(self, name, kind, baseline, bytes_channel):
        self.name, self.kind, self.baseline, self.bytes_channel, self.times = name, kind, baseline, bytes_channel, {}
        self.reductions = kind not in ("mp pipe", "mp queue")
        ctx = mp.get_context("spawn")
        if kind == "connection":
            with torch_ipc.listen(authkey=AUTHKEY) as listener:
                self.proc = ctx.Process(target=_echo_objects_connection, args=(listener.address, True), daemon=True)
                self.proc.start()
                self.end = listener.accept()
            return
        if kind.startswith("mp queue"):
            self.end = QueueEnds(ctx.Queue(), ctx.Queue())
            b = self.end.other()
        else:
            self.end, b = mp.Pipe() if kind.startswith("mp pipe") else torch_ipc.Pipe()
        self.proc = ctx.Process(target=_echo_objects, args=(b, self.reductions), daemon=True)
        self.proc.start()
        if not kind.startswith("mp queue"):
            b.close()

    def dumps(self):
        """What this channel pickles a message with (in the reductions' state of run())."""
        from multiprocessing.reduction import ForkingPickler

        if self.kind == "connection":
            return lambda obj: _serialize.message(obj)[0]
        return ForkingPickler.dumps

    def run(self, message, obj, n):
        with torch_ipc.reductions() if self.reductions else _nothing():
            self.times.setdefault(message, []).append(_batch(self.end, n, obj, objects=True))

    def pickling(self, obj):
        with torch_ipc.reductions() if self.reductions else _nothing():
            return pickling_us(obj, self.dumps())

    def close(self):
        self.end.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def pickling_us(obj, dumps, reps=2000):
    """Pickling (with `dumps`) and unpickling `obj` twice: a round trip's."""
    start = time.perf_counter_ns()
    for _ in range(reps):
        pickle.loads(dumps(obj))
    return 2 * (time.perf_counter_ns() - start) / reps / 1000.0


def measure_objects(channels, messages, batches, n):
    objs = {m: _message(m) for m in messages}
    for m in messages:
        per = n if "tensor" not in m else max(n // 10, 20)
        for c in channels:  # warm-up
            c.run(m, objs[m], max(per // 10, 10))
            c.times[m].clear()
        for _ in range(batches):
            for c in channels:
                c.run(m, objs[m], per)
    return {(m, c.name): c.pickling(objs[m]) for m in messages if "tensor" not in m for c in channels}


def object_table(channels, messages, bytes_floor, pickling):
    by_name = {c.name: c for c in channels}
    lines = ["| message | channel | min us | median us | floor us | median / floor | vs | min / it "
             "| median / it |", "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for m in messages:
        for c in channels:
            base = by_name[c.baseline]
            bmin, bmed = min(base.times[m]), statistics.median(base.times[m])
            lo, med = min(c.times[m]), statistics.median(c.times[m])
            floor = None
            if (m, c.name) in pickling and c.bytes_channel in bytes_floor:
                floor = bytes_floor[c.bytes_channel] + pickling[m, c.name]
            f = f"{floor:.1f} | {med / floor:.2f}x" if floor else "- | -"
            lines.append(f"| {m} | {c.name} | {lo:.1f} | {med:.1f} | {f} | {c.baseline} | {lo / bmin:.2f}x "
                         f"| {med / bmed:.2f}x |")
    return "\n".join(lines)


def run_objects(args, batches, n, bytes_floor):
    import torch

    messages = ["64 B bytes", "small dict", "4 KiB CPU tensor"]
    if torch.cuda.is_available():
        messages.append("4 KiB CUDA tensor")
    channels = []
    try:
        for spec in OBJECT_CHANNELS:
            channels.append(ObjectChannel(*spec))
        pickling = measure_objects(channels, messages, batches, n)
    finally:
        for c in channels:
            c.close()
    print(f"\nobjects (send/recv; a Queue's put/get), {batches} paired batches of {n} ({max(n // 10, 20)} for "
          f"tensors); {_cpus()}, load average {os.getloadavg()[0]:.1f}; floor: the bytes median of the channel "
          "underneath + pickling and unpickling twice; vs: the multiprocessing channel of the same calls"
          + ("" if torch.cuda.is_available() else "; no CUDA: no CUDA row"))
    print(object_table(channels, messages, bytes_floor, pickling))


def _cpus():
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{os.cpu_count()} CPUs ({usable} usable here)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 batches of 500 round trips")
    ap.add_argument("--spin", action="store_true", help="torch_ipc.Pipe at several spin budgets too")
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("-n", type=int, default=None, help="round trips per batch")
    ap.add_argument("--no-objects", action="store_true", help="the bytes table only")
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
    print(f"64 B round trip, {batches} paired batches of {n}; {_cpus()}, "
          f"load average {os.getloadavg()[0]:.1f}; default spin {default_spin:g} us")
    print(table(channels, channels[0]))
    if not args.no_objects:
        run_objects(args, batches, n, {c.name: statistics.median(c.times) for c in channels[:3]})


if __name__ == "__main__":
    main()
