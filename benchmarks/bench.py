#!/usr/bin/env python3
"""Benchmark torch_ipc against stock torch.multiprocessing on the same workloads.

Each side runs in its own pair of spawned processes, a producer and a consumer,
joined by a channel: for floor and torch_ipc ``torch_ipc.Pipe`` (shared-memory
rings, the default) or, with ``--channel mp``, a ``multiprocessing.Pipe``; for
torch always a ``multiprocessing.Pipe`` (stock torch.multiprocessing as its
users run it: a torch process never imports torch_ipc, whose import wraps
ForkingPickler's reducers):

* floor:     no sharing at all: the producer sends only the structure of its
             object (once per loop), the consumer uses tensors of its own, already
             local. Same channel, same consumer work: what sharing cannot beat.
* torch:     the producer sends ``ForkingPickler.dumps(obj)`` (torch's own
             reduce_tensor / rebuild_cuda_tensor path), the consumer ``pickle.loads``.
* torch_ipc: the producer sends ``torch_ipc.dumps(obj)``, the consumer
             ``torch_ipc.loads``.

A round trip is: the producer serialises and sends, the consumer rebuilds the
object, reads it as an engine does (one ``torch._foreach_norm`` over every
received tensor, then one synchronize: the "first read"), keeps it until the
next one arrives (as an inference engine keeps its mapping) and answers with a
1-byte ack. The ``_idle`` workloads are the same with a consumer that touches
nothing. The producer times each round trip with time.perf_counter_ns and
reports the median after a warm-up. The final table gives the three sides,
torch_ipc's time over the floor's, and the speed-up over torch (torch time /
torch_ipc time).

Workloads (--only NAME[,NAME]; in this order):
    channel        a bare Pipe round trip of 64 bytes, no tensor: the channel itself
    small_same     one 4 KiB CUDA tensor, the same one each time
    small_new      one 4 KiB CUDA tensor, a new one each time
    small_same_idle, small_new_idle   the same, the consumer touching nothing
    stream_same    a one-way stream of 4 KiB CUDA tensors, the same one each time: the
                   consumer reads one element of each (.item()) and drops it; tensors/s
    stream_new     the same with a new tensor each time
    sd_first       a state_dict of 384 x 4 MiB bf16 (1.5 GiB), each one new (first share)
    sd_resend      the same state_dict again (the consumer keeps the previous one)
    big_resend     144 x 16 MiB bf16 (2.25 GiB) again
    per_tensor     messages of 1 to 10000 tensors of 1 KiB: cost per tensor
    weight_update  the consumer copies a received state_dict into its own params,
                   against one device copy of the same bytes (the ceiling)
    open           loads() of a tensor in a new allocation vs one already mapped
Each round trip is also split (in the progress lines and the JSON) into the
producer's dumps(), the consumer's loads(), its loads() + first read, and its
release of what it held before (dropping it: for torch_ipc, the release queued
behind the consumer's own GPU work, Note [deferred release]).

Usage:
    python benchmarks/bench.py                        # every workload, full sizes
    python benchmarks/bench.py --quick                # smoke run: small sizes, few iterations
    python benchmarks/bench.py --only small_same,sd_resend --json bench.json
    python benchmarks/bench.py --device cpu --quick   # every workload on CPU tensors
    python benchmarks/bench.py --channel mp           # over a multiprocessing.Pipe instead

Without a CUDA GPU (and without --device cpu) it says so, runs the small round
trip with CPU tensors and exits. Targets are for an H100 and are shown only for
full-size CUDA runs.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import os
import pickle
import platform
import signal
import statistics
import sys
import time
import traceback

import torch

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# The producer sends raw payloads and, between loops, pickled control tuples; the
# consumer knows from the protocol which to expect. The consumer answers with
# ACK, with REPLY + a pickled object, or with FAILED + its traceback.
ACK = b"\x01"
END = b""  # producer -> consumer: the timed loop is over
REPLY = b"R"
FAILED = b"E"

SIDES = ("floor", "torch", "torch_ipc")
CPU_FALLBACK = ("channel", "small_same", "small_new", "small_same_idle", "small_new_idle", "stream_same",
                "stream_new")
CHANNELS = {"ring": "torch_ipc.Pipe (shared-memory rings)", "mp": "multiprocessing.Pipe"}


class PeerError(RuntimeError):
    """The other process failed or sent something unexpected."""


# --------------------------------------------------------------------------- sizes


def plan(cfg: dict) -> dict:
    """Sizes and iteration counts; every process derives the same plan from cfg."""
    q = cfg["quick"]
    return {
        "small": {"numel": 1024, "warmup": 20 if q else 200, "iters": 100 if q else 2000},
        "small_new": {"numel": 1024, "warmup": 10 if q else 100, "iters": 50 if q else 1000},
        "stream": {"numel": 1024, "warmup": 50 if q else 500, "iters": 500 if q else 10000},
        # 64 layers x 6 tensors x 2048x1024 bf16 = 384 x 4 MiB = 1.5 GiB
        "sd": {"layers": 2 if q else 64, "shape": (256, 1024) if q else (2048, 1024)},
        "sd_first_reps": 2 if q else 5,
        "sd_resend": {"warmup": 2 if q else 5, "iters": 10 if q else 100, "budget_s": 1 if q else 3},
        # 24 layers x 6 tensors x 4096x2048 bf16 = 144 x 16 MiB = 2.25 GiB
        "big": {"layers": 2 if q else 24, "shape": (512, 1024) if q else (4096, 2048)},
        "big_resend": {"warmup": 2 if q else 5, "iters": 10 if q else 100, "budget_s": 1 if q else 3},
        "per_tensor": {
            "counts": (1, 10, 100) if q else (1, 10, 100, 1000, 10000),
            "numel": 256,  # float32: 1 KiB each
            "warmup": 2 if q else 3,
            "iters": 20 if q else 500,
            "budget_s": 0.3 if q else 2.0,
        },
        "update": {"warmup": 2 if q else 3, "iters": 5 if q else 20},
        "open": {"fresh": 4 if q else 20, "bytes": 1 * MiB if q else 16 * MiB,
                 "warmup": 2 if q else 10, "iters": 10 if q else 200},
    }


LAYER_TENSORS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def make_state_dict(layers: int, shape: tuple, device: str) -> dict:
    return {
        f"model.layers.{i}.{name}.weight": torch.empty(shape, dtype=torch.bfloat16, device=device)
        for i in range(layers)
        for name in LAYER_TENSORS
    }


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def empty_cache(device: str) -> None:
    """Give cached blocks back, so that what is allocated next is a new allocation."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ the two sides


class Side:
    """dumps/loads of one side, resolved once in each process."""

    def __init__(self, name: str, device: str):
        self.name = name
        self.device = device
        if name == "floor":
            local = LocalObjects(device)
            self.dumps, self.loads, self._ipc = local.dumps, local.loads, None
        elif name == "torch":
            from multiprocessing.reduction import ForkingPickler

            import torch.multiprocessing  # noqa: F401  (registers torch's reducers)

            # This process never imports torch_ipc; should something else have done
            # so and installed its reducers, put torch's back before measuring.
            if "torch_ipc" in sys.modules:
                sys.modules["torch_ipc"].restore_reductions()
            check_torch_reducers()
            self.dumps = ForkingPickler.dumps
            self.loads = pickle.loads
            self._ipc = None
        else:
            torch_ipc = import_torch_ipc()
            self.dumps = torch_ipc.dumps
            self.loads = torch_ipc.loads
            self._ipc = torch_ipc

    def cleanup(self) -> None:
        gc.collect()
        if self._ipc is not None:
            self._ipc.collect()
        elif self.device == "cuda":
            torch.cuda.ipc_collect()

    def stats(self) -> dict:
        return dict(self._ipc.stats()) if self._ipc is not None else {}

    def meta(self) -> dict:
        out = {"pid": os.getpid(), "torch": torch.__version__}
        if self._ipc is not None:
            out["torch_ipc"] = getattr(self._ipc, "__version__", "unknown")
        if self.device == "cuda":
            out["gpu"] = torch.cuda.get_device_name()
            out["cuda"] = torch.version.cuda
        return out


class LocalObjects:
    """The floor side: no sharing. The producer sends the structure of an object
    (only when it differs from the last one's: within a loop every object has
    the same structure), the consumer answers with tensors of its own, made once."""

    def __init__(self, device: str):
        self.device = device
        self._last_key = None
        self._obj = None

    def dumps(self, obj) -> bytes:
        key = structure_key(obj)
        if key == self._last_key:
            return b"S"
        self._last_key = key
        return b"N" + pickle.dumps(skeleton(obj))

    def loads(self, data: bytes):
        if data[:1] == b"N":
            self._obj = materialize(pickle.loads(data[1:]), self.device)
        return self._obj


def structure_key(obj):
    """Cheap: tensors by shape and dtype, containers by type and length."""
    if isinstance(obj, torch.Tensor):
        return (tuple(obj.shape), obj.dtype)
    return (type(obj), len(obj)) if isinstance(obj, (dict, list, tuple)) else obj


def skeleton(obj):
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: skeleton(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(skeleton(v) for v in obj)
    return obj


def materialize(spec, device: str):
    if isinstance(spec, tuple) and spec[:1] == ("tensor",):
        return torch.zeros(spec[1], dtype=spec[2], device=device)
    if isinstance(spec, dict):
        return {k: materialize(v, device) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(materialize(v, device) for v in spec)
    return spec


def tensors_of(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = obj.values()
    return [t for t in obj if isinstance(t, torch.Tensor)]


def read_all(obj) -> None:
    """What an engine does with what it received: one kernel over every tensor, one synchronize."""
    tensors = tensors_of(obj)
    torch._foreach_norm(tensors)
    sync(tensors[0].device.type)


def import_torch_ipc():
    """The installed torch_ipc, else the one of this checkout (built in place)."""
    try:
        import torch_ipc
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import torch_ipc
    return torch_ipc


def check_torch_reducers() -> None:
    """Fail unless ForkingPickler pickles tensors the way stock torch does."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor

    dumps = getattr(ForkingPickler.__dict__.get("dumps"), "__func__", None)
    if getattr(dumps, "__module__", None) != "multiprocessing.reduction":
        raise RuntimeError("ForkingPickler.dumps is not multiprocessing's own")
    for cls in (torch.Tensor, torch.nn.Parameter):
        if ForkingPickler._extra_reducers.get(cls) is not reduce_tensor:
            raise RuntimeError(f"ForkingPickler does not use torch's reduce_tensor for {cls.__name__}")


# ------------------------------------------------------------------ messaging


def recv(conn, timeout: float) -> bytes:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message from the other process within {timeout:g} s")
    return conn.recv_bytes()


def peer_error(msg: bytes) -> PeerError:
    if msg[:1] == FAILED:
        return PeerError("consumer failed:\n" + msg[1:].decode(errors="replace"))
    return PeerError(f"unexpected message from the consumer: {bytes(msg[:40])!r}")


def send_reply(conn, obj) -> None:
    conn.send_bytes(REPLY + pickle.dumps(obj))


def recv_reply(conn, timeout: float):
    msg = recv(conn, timeout)
    if msg[:1] != REPLY:
        raise peer_error(msg)
    return pickle.loads(msg[1:])


def send_control(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj))


def recv_control(conn, timeout: float):
    return pickle.loads(recv(conn, timeout))


# ------------------------------------------------------------------ timed loops


class Timings:
    """What one timed loop measured, in ns, warm-up excluded."""

    def __init__(self, rtt: list, dumps: list, loads: list, reads: list, drops: list):
        self.rtt = rtt  # producer: dumps + send + the consumer's loads + work + ack
        self.dumps = dumps  # producer: dumps alone
        self.loads = loads  # consumer: loads alone
        self.reads = reads  # consumer: loads + its work on what it loaded (the first read)
        self.drops = drops  # consumer: dropping what it held before (the release)


def round_trips(conn, side, next_obj, *, warmup: int, iters: int, timeout: float,
                budget_s: float | None = None, min_iters: int = 5) -> Timings:
    """Producer half of a timed loop: send next_obj() and wait for the ack, each timed.

    Each object stays alive until the next one has been made (after its ack),
    then it is dropped. With a budget, stops once it is spent and at least
    min_iters were timed. The consumer's loads() times come back at the end.
    """
    rtt, dumps = [], []
    start = time.perf_counter()
    for i in range(warmup + iters):
        obj = next_obj()  # drops the previous object, acked already
        t0 = time.perf_counter_ns()
        data = side.dumps(obj)
        t1 = time.perf_counter_ns()
        conn.send_bytes(data)
        ack = recv(conn, timeout)
        t2 = time.perf_counter_ns()
        if ack != ACK:
            raise peer_error(ack)
        if i >= warmup:
            rtt.append(t2 - t0)
            dumps.append(t1 - t0)
            if budget_s and len(rtt) >= min_iters and time.perf_counter() - start > budget_s:
                break
    conn.send_bytes(END)
    consumer = recv_reply(conn, timeout)[warmup:]
    return Timings(rtt, dumps, *([c[k] for c in consumer] for k in range(3)))


def serve(conn, side, timeout: float, *, hold: bool = True, on_obj=None) -> None:
    """Consumer half of a timed loop: load each message and ack it, until END.

    With hold, the object stays alive until the next one has been loaded (the
    cached path of a consumer that keeps what it received); without, it is
    dropped before the ack. Sends back, in ns, the time of each loads() and of
    loads() + on_obj().
    """
    held = None
    load_ns = []
    while True:
        data = recv(conn, timeout)
        if not data:
            break
        t0 = time.perf_counter_ns()
        obj = side.loads(data)
        t1 = time.perf_counter_ns()
        if on_obj is not None:
            on_obj(obj)
        t2 = time.perf_counter_ns()
        if hold:
            held = obj  # noqa: F841  (the previous one goes only now)
        del obj
        load_ns.append((t1 - t0, t2 - t0, time.perf_counter_ns() - t2))
        conn.send_bytes(ACK)
    del held
    send_reply(conn, load_ns)


def always(obj):
    """next_obj for round_trips: the same object every time."""
    return lambda: obj


def time_calls(fn, *, warmup: int, iters: int) -> list:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


def summary(ns: list) -> dict:
    us = sorted(x / 1e3 for x in ns)
    return {
        "n": len(us),
        "median_us": statistics.median(us),
        "mean_us": statistics.fmean(us),
        "min_us": us[0],
        "p90_us": us[min(len(us) - 1, int(0.9 * len(us)))],
    }


def metric(key, label, ns=None, *, unit="us", value=None, better="lower", target=None, **extra) -> dict:
    """One row of results; time metrics are given as raw ns (or Timings) and shown in `unit`."""
    out = {"key": key, "label": label, "unit": unit, "better": better, "target": target}
    if isinstance(ns, Timings):
        out["dumps"], out["loads"], out["reads"] = summary(ns.dumps), summary(ns.loads), summary(ns.reads)
        out["drops"] = summary(ns.drops)
        ns = ns.rtt
    if ns is not None:
        out["stats"] = summary(ns)
        value = out["stats"]["median_us"] / (1e3 if unit == "ms" else 1)
    out["value"] = value
    out.update(extra)
    return out


def h100_target(cfg: dict, **goal):
    """A target for torch_ipc's value, for full-size runs on an H100: any of
    max (the value itself), floor_x / torch_x (at most that ratio to the floor's
    or torch's value), above_floor (at most this much above the floor's)."""
    return goal if cfg["device"] == "cuda" and not cfg["quick"] else None


# ------------------------------------------------------------------ workloads
# Each workload is a producer function (returns a list of metrics) and a consumer
# function run in lockstep with it in the other process.


class Raw:
    """No serialisation: the bytes themselves (for the floor of the channel)."""

    name = "raw"

    @staticmethod
    def dumps(obj):
        return obj

    @staticmethod
    def loads(data):
        return data


def channel_producer(conn, side, cfg):
    p = plan(cfg)["small"]
    message = b"x" * 64
    t = round_trips(conn, Raw, lambda: message, warmup=p["warmup"], iters=p["iters"], timeout=cfg["timeout"])
    return [metric("rtt", "bare channel round trip, 64 B of bytes, no tensor", t.rtt)]


def channel_consumer(conn, side, cfg):
    serve(conn, Raw, cfg["timeout"])


def small_tensors(numel: int, device: str, same: bool):
    """next_obj of a float32 tensor of `numel`: the same one each time, or a new one."""
    if same:
        return always(torch.empty(numel, dtype=torch.float32, device=device))
    # no kernel: the producer does nothing on the GPU but share
    return lambda: torch.empty(numel, dtype=torch.float32, device=device)


def small_producer(same: bool, reading: bool):
    def producer(conn, side, cfg):
        p = plan(cfg)["small" if same else "small_new"]
        t = round_trips(conn, side, small_tensors(p["numel"], cfg["device"], same), warmup=p["warmup"],
                        iters=p["iters"], timeout=cfg["timeout"])
        what = f"{fmt_bytes(4 * p['numel'])} tensor, {'same' if same else 'new'} each time"
        if not reading:
            return [metric("rtt", f"{what}, consumer touches nothing", t)]
        goal = h100_target(cfg, floor_x=1.15, torch_x=0.5) if same else h100_target(cfg, torch_x=0.3)
        return [metric("rtt", f"{what}, consumer reads it", t, target=goal),
                metric("first_read", f"{what}: consumer's loads + first read", t.reads)]

    return producer


def stream_producer(same: bool):
    def producer(conn, side, cfg):
        """Send warm-up + iters tensors without waiting; the consumer acks the
        warm-up and then the whole stream: tensors/s of the timed part."""
        p = plan(cfg)["stream"]
        next_obj = small_tensors(p["numel"], cfg["device"], same)
        for _ in range(p["warmup"]):
            conn.send_bytes(side.dumps(next_obj()))
        if recv(conn, cfg["timeout"]) != ACK:
            raise PeerError("the consumer did not ack the warm-up")
        t0 = time.perf_counter_ns()
        for _ in range(p["iters"]):
            conn.send_bytes(side.dumps(next_obj()))
        ack = recv(conn, cfg["timeout"])
        elapsed = time.perf_counter_ns() - t0
        if ack != ACK:
            raise peer_error(ack)
        what = f"one-way stream of {fmt_bytes(4 * p['numel'])} tensors, {'same' if same else 'new'} each time, " \
               "consumer reads one element of each"
        return [metric("rate", what, unit="tensors/s", better="higher", value=p["iters"] * 1e9 / elapsed,
                       target=h100_target(cfg, max=40000), seconds=elapsed / 1e9)]

    return producer


def stream_consumer(conn, side, cfg):
    p = plan(cfg)["stream"]
    for count in (p["warmup"], p["iters"]):
        for _ in range(count):
            obj = side.loads(recv(conn, cfg["timeout"]))
            obj[0].item()  # one element of each reaches the host
            del obj
        conn.send_bytes(ACK)


def serve_reading(conn, side, cfg):
    serve(conn, side, cfg["timeout"], on_obj=read_all)


def serve_idle(conn, side, cfg):
    serve(conn, side, cfg["timeout"])


def sd_label(layers, shape):
    n = layers * len(LAYER_TENSORS)
    one = 2 * shape[0] * shape[1]
    return f"{n} x {fmt_bytes(one)} bf16 ({fmt_bytes(n * one)})"


def sd_first_producer(conn, side, cfg):
    p = plan(cfg)
    sd = p["sd"]
    empty_cache(cfg["device"])
    keep = []  # every dict stays alive, so each one lives in allocations never shared before

    def fresh():
        keep.append(make_state_dict(sd["layers"], sd["shape"], cfg["device"]))
        return keep[-1]

    t = round_trips(conn, side, fresh, warmup=1, iters=p["sd_first_reps"], timeout=cfg["timeout"])
    return [metric("rtt", f"state_dict {sd_label(sd['layers'], sd['shape'])}: first share", t,
                   unit="ms", target=h100_target(cfg, max=5))]


def sd_first_consumer(conn, side, cfg):
    serve(conn, side, cfg["timeout"], hold=False, on_obj=read_all)  # drops everything between repetitions


def resend(conn, side, cfg, shape_key, loop_key, label, goal=None):
    p = plan(cfg)
    s, loop = p[shape_key], p[loop_key]
    obj = make_state_dict(s["layers"], s["shape"], cfg["device"])
    t = round_trips(conn, side, always(obj), warmup=loop["warmup"], iters=loop["iters"],
                    timeout=cfg["timeout"], budget_s=loop["budget_s"])
    return [metric("rtt", label.format(sd_label(s["layers"], s["shape"])) + ": resend", t,
                   unit="ms", target=goal)]


def sd_resend_producer(conn, side, cfg):
    return resend(conn, side, cfg, "sd", "sd_resend", "state_dict {}", h100_target(cfg, above_floor=1))


def big_resend_producer(conn, side, cfg):
    return resend(conn, side, cfg, "big", "big_resend", "{} tensors")


def per_tensor_producer(conn, side, cfg):
    p = plan(cfg)["per_tensor"]
    size = fmt_bytes(4 * p["numel"])
    out, medians = [], {}
    for n in p["counts"]:
        tensors = [torch.empty(p["numel"], dtype=torch.float32, device=cfg["device"]) for _ in range(n)]
        t = round_trips(conn, side, always(tensors), warmup=p["warmup"], iters=p["iters"],
                        timeout=cfg["timeout"], budget_s=p["budget_s"], min_iters=3)
        m = metric(f"rtt_{n}", f"{n} x {size} tensors in one message: resend", t)
        medians[n] = m["value"]
        out.append(m)
    for n in p["counts"]:
        if n > 1:
            out.append(metric(f"per_tensor_{n}", f"{n} x {size} tensors: per tensor beyond the first",
                              value=(medians[n] - medians[1]) / (n - 1),
                              target=h100_target(cfg, above_floor=1) if n >= 100 else None))
    return out


def per_tensor_consumer(conn, side, cfg):
    for _ in plan(cfg)["per_tensor"]["counts"]:
        serve(conn, side, cfg["timeout"], on_obj=read_all)


def weight_update_producer(conn, side, cfg):
    p = plan(cfg)
    sd = make_state_dict(p["sd"]["layers"], p["sd"]["shape"], cfg["device"])
    conn.send_bytes(side.dumps(sd))  # the consumer keeps these handles and times its copies
    copies = recv_reply(conn, cfg["timeout"])
    u = p["update"]
    t = round_trips(conn, side, always(sd), warmup=u["warmup"], iters=u["iters"], timeout=cfg["timeout"])
    label = f"state_dict {sd_label(p['sd']['layers'], p['sd']['shape'])}"
    out = []
    for key, what in (("copy", f"{label}: p.copy_(src) into own params"),
                      ("foreach", f"{label}: torch._foreach_copy_ into own params"),
                      ("ceiling", f"one copy_ of {fmt_bytes(copies['bytes'])} in one process (ceiling)")):
        ns = copies.get(key)
        if ns and (key != "ceiling" or side.name == "floor"):  # GB/s counting bytes read and written
            out.append(metric(f"{key}_GBps", what, unit="GB/s", better="higher", stats=summary(ns),
                              value=2 * copies["bytes"] / statistics.median(ns)))
    out.append(metric("update_rtt", f"{label}: resend + p.copy_ all + ack", t, unit="ms"))
    return out


def copy_all(params, tensors, device) -> None:
    """What a consumer does on a weight update: p.copy_(src) for each, then synchronize."""
    for dst, src in zip(params, tensors):
        dst.copy_(src)
    sync(device)


def time_copies(params, src, device, warmup, iters) -> dict:
    """Copies of the received tensors into params, and the ceiling: one copy of as many bytes."""
    size = nbytes(src)
    out = {"bytes": size, "copy": time_calls(lambda: copy_all(params, src, device), warmup=warmup, iters=iters)}
    if hasattr(torch, "_foreach_copy_"):
        def foreach():
            torch._foreach_copy_(params, src)
            sync(device)

        out["foreach"] = time_calls(foreach, warmup=warmup, iters=iters)
    flat_src = torch.empty(size, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)

    def ceiling():
        flat_dst.copy_(flat_src)
        sync(device)

    out["ceiling"] = time_calls(ceiling, warmup=warmup, iters=iters)
    return out


def weight_update_consumer(conn, side, cfg):
    u = plan(cfg)["update"]
    device = cfg["device"]
    src = list(side.loads(recv(conn, cfg["timeout"])).values())
    params = [torch.empty_like(t) for t in src]
    copies = time_copies(params, src, device, u["warmup"], u["iters"])
    del src  # from here on, each update brings its own
    send_reply(conn, copies)
    serve(conn, side, cfg["timeout"], on_obj=lambda sd: copy_all(params, sd.values(), device))


def open_producer(conn, side, cfg):
    p = plan(cfg)["open"]
    empty_cache(cfg["device"])
    keep = []  # kept alive: no allocation is handed out twice

    def fresh():
        keep.append(torch.empty(p["bytes"], dtype=torch.uint8, device=cfg["device"]))
        return keep[-1]

    first = round_trips(conn, side, fresh, warmup=1, iters=p["fresh"], timeout=cfg["timeout"])
    same = keep[-1]
    out = [metric("first_us", f"loads, {fmt_bytes(p['bytes'])} tensor in a new allocation", first.loads)]
    for key, label in (("cached_held_us", "loads, same tensor again, previous one held"),
                       ("cached_idle_us", "loads, same tensor again, previous one dropped")):
        t = round_trips(conn, side, always(same), warmup=p["warmup"], iters=p["iters"], timeout=cfg["timeout"])
        out.append(metric(key, label, t.loads))
    return out


def open_consumer(conn, side, cfg):
    for hold in (True, True, False):
        serve(conn, side, cfg["timeout"], hold=hold)


WORKLOADS = {
    "channel": (channel_producer, channel_consumer),
    "small_same": (small_producer(same=True, reading=True), serve_reading),
    "small_new": (small_producer(same=False, reading=True), serve_reading),
    "small_same_idle": (small_producer(same=True, reading=False), serve_idle),
    "small_new_idle": (small_producer(same=False, reading=False), serve_idle),
    "stream_same": (stream_producer(same=True), stream_consumer),
    "stream_new": (stream_producer(same=False), stream_consumer),
    "sd_first": (sd_first_producer, sd_first_consumer),
    "sd_resend": (sd_resend_producer, serve_reading),
    "big_resend": (big_resend_producer, serve_reading),
    "per_tensor": (per_tensor_producer, per_tensor_consumer),
    "weight_update": (weight_update_producer, weight_update_consumer),
    "open": (open_producer, open_consumer),
}


# ------------------------------------------------------------------ child processes


def die_with_parent() -> None:
    """Ask Linux to kill this process when the benchmark's main process dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def init_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")  # create the context outside any timing
    else:
        # Four processes share the cores: with one thread each, no copy waits on
        # worker threads that another process keeps off the CPU.
        torch.set_num_threads(1)


def sanity_check(conn, side, cfg, producer: bool) -> None:
    """One exchange that checks values, so that no side is timed while broken."""
    if side.name == "floor":
        return  # nothing is shared: the consumer's tensors are its own
    expected = torch.arange(1024, dtype=torch.float32)
    if producer:
        x = expected.to(cfg["device"])
        conn.send_bytes(side.dumps(x))
        if not recv_reply(conn, cfg["timeout"]):
            raise RuntimeError(f"{side.name}: the consumer received wrong values")
    else:
        y = side.loads(recv(conn, cfg["timeout"]))
        send_reply(conn, torch.equal(y.cpu(), expected))


def producer_main(conn, results, side_name: str, names: list, cfg: dict) -> None:
    die_with_parent()
    current = None
    try:
        init_device(cfg["device"])
        side = Side(side_name, cfg["device"])
        consumer_meta = recv_reply(conn, cfg["startup_timeout"])
        results.send(("ready", {"producer": side.meta(), "consumer": consumer_meta}))
        sanity_check(conn, side, cfg, producer=True)
        for current in names:
            results.send(("begin", current))
            send_control(conn, ("begin", current))
            out = WORKLOADS[current][0](conn, side, cfg)
            send_control(conn, ("end",))
            consumer_stats = recv_reply(conn, cfg["timeout"])
            side.cleanup()
            results.send(("result", current, {"metrics": out, "producer_stats": side.stats(),
                                              "consumer_stats": consumer_stats}))
        send_control(conn, ("quit",))
        results.send(("done",))
    except BaseException:
        results.send(("error", current, traceback.format_exc()))


def consumer_main(conn, side_name: str, cfg: dict) -> None:
    die_with_parent()
    try:
        init_device(cfg["device"])
        side = Side(side_name, cfg["device"])
        send_reply(conn, side.meta())
        sanity_check(conn, side, cfg, producer=False)
        while True:
            msg = recv_control(conn, cfg["timeout"])
            if msg[0] == "quit":
                return
            WORKLOADS[msg[1]][1](conn, side, cfg)
            if recv_control(conn, cfg["timeout"]) != ("end",):
                raise PeerError("producer and consumer lost step")
            side.cleanup()
            send_reply(conn, side.stats())
    except BaseException:
        try:
            conn.send_bytes(FAILED + traceback.format_exc().encode())
        except OSError:
            pass
        sys.exit(1)


# ------------------------------------------------------------------ orchestration


def run_pair(side_name: str, names: list, cfg: dict, record) -> tuple:
    """Run `names` in one producer/consumer pair; record(name, result) for each.

    Returns (meta, failed, error): `failed` is the workload that failed (None
    when start-up did, or nothing did) and `error` its traceback or reason.
    """
    ctx = mp.get_context("spawn")
    if cfg["channel"] == "ring" and side_name != "torch":
        prod_conn, cons_conn = import_torch_ipc().Pipe(duplex=True)
    else:
        prod_conn, cons_conn = ctx.Pipe(duplex=True)
    results, results_w = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=producer_main, args=(prod_conn, results_w, side_name, names, cfg),
                    name=f"{side_name}-producer"),
        ctx.Process(target=consumer_main, args=(cons_conn, side_name, cfg),
                    name=f"{side_name}-consumer"),
    ]
    meta, current = None, None
    try:
        for p in procs:
            p.start()
        for c in (prod_conn, cons_conn, results_w):
            c.close()  # the children hold their ends: EOF when they die
        deadline = time.monotonic() + cfg["startup_timeout"]
        while True:
            if time.monotonic() > deadline:
                return meta, current, f"timed out ({'start-up' if current is None else current})"
            if not results.poll(0.5):
                if not procs[0].is_alive() and not results.poll(0):
                    return meta, current, f"producer exited with code {procs[0].exitcode}"
                continue
            try:
                msg = results.recv()
            except EOFError:
                procs[0].join(5)
                return meta, current, (f"producer exited with code {procs[0].exitcode}"
                                       f", consumer with code {procs[1].exitcode}")
            if msg[0] == "ready":
                meta = msg[1]
            elif msg[0] == "begin":
                current = msg[1]
                began = time.monotonic()
                deadline = began + cfg["workload_timeout"]
                print(f"[{side_name}] {current} ...", flush=True)
            elif msg[0] == "result":
                msg[2]["seconds"] = round(time.monotonic() - began, 2)
                record(msg[1], msg[2])
                current = None
            elif msg[0] == "error":
                return meta, msg[1], msg[2]
            elif msg[0] == "done":
                return meta, None, None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
        results.close()


def run_side(side_name: str, names: list, cfg: dict) -> dict:
    """Every workload of one side; a failed pair is replaced for the workloads after it."""
    out = {"meta": None, "results": {}, "errors": {}}

    def record(name, result):
        out["results"][name] = result
        for m in result["metrics"]:
            parts = ""
            if "dumps" in m:  # where a round trip goes: dumps in the producer, loads + work in the consumer
                parts = (f" (dumps {fmt_value(m['dumps']['median_us'], 'us')},"
                         f" loads {fmt_value(m['loads']['median_us'], 'us')},"
                         f" loads + read {fmt_value(m['reads']['median_us'], 'us')},"
                         f" release {fmt_value(m['drops']['median_us'], 'us')})")
            print(f"[{side_name}] {name}: {m['label']}: {fmt_value(m['value'], m['unit'])}{parts}", flush=True)
        print(f"[{side_name}] {name}: {result['seconds']:.1f} s", flush=True)

    pending = list(names)
    while pending:
        meta, failed, error = run_pair(side_name, pending, cfg, record)
        out["meta"] = out["meta"] or meta
        if error is None:
            break
        print(f"[{side_name}] {failed or 'start-up'} failed:\n{error}", file=sys.stderr, flush=True)
        if failed is None or failed not in pending:  # start-up failed: nothing can run
            for name in pending:
                if name not in out["results"]:
                    out["errors"][name] = error
            break
        out["errors"][failed] = error
        pending = pending[pending.index(failed) + 1:]
    return out


# ------------------------------------------------------------------ report


def fmt_value(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "us" and abs(v) >= 10000:
        v, unit = v / 1e3, "ms"
    digits = 0 if abs(v) >= 1000 else 1 if abs(v) >= 10 else 2 if abs(v) >= 1 else 3
    return f"{v:.{digits}f} {unit}"


def build_rows(names: list, sides: dict) -> list:
    rows = []
    for name in names:
        keyed = {}
        for side_name, side in sides.items():
            for m in side["results"].get(name, {}).get("metrics", []):
                row = keyed.setdefault(m["key"], {"workload": name, "metric": m["key"], "label": m["label"],
                                                  "unit": m["unit"], "better": m["better"], "target": None,
                                                  **{s: None for s in SIDES}})
                row[side_name] = m["value"]
                if side_name == "torch_ipc":
                    row["target"] = m["target"]
        if not keyed:
            keyed[None] = {"workload": name, "metric": None, "label": name, "unit": "", "better": "lower",
                           "target": None, **{s: None for s in SIDES}}
        for row in keyed.values():
            f, t, i = row["floor"], row["torch"], row["torch_ipc"]
            lower = row["better"] == "lower"
            row["speedup"] = (t / i if lower else i / t) if t and i else None
            row["over_floor"] = i / f if f and i and lower else None
            row["meets_target"] = meets(row["target"], f, t, i, lower)
            row["errors"] = [s for s, side in sides.items() if name in side["errors"]]
            rows.append(row)
    return rows


def meets(goal, floor, torch_value, value, lower: bool):
    """Whether torch_ipc's value meets every part of the goal it can be checked against."""
    if not goal or value is None:
        return None
    checks = []
    if "max" in goal:
        checks.append(value <= goal["max"] if lower else value >= goal["max"])
    if "floor_x" in goal and floor:
        checks.append(value <= goal["floor_x"] * floor)
    if "torch_x" in goal and torch_value:
        checks.append(value <= goal["torch_x"] * torch_value)
    if "above_floor" in goal and floor is not None:
        checks.append(value - floor <= goal["above_floor"])
    return all(checks) if checks else None


def describe_goal(goal, unit: str) -> str:
    parts = []
    if "max" in goal:
        parts.append(f"<= {goal['max']:g} {unit}")
    if "floor_x" in goal:
        parts.append(f"<= {goal['floor_x']:g}x floor")
    if "torch_x" in goal:
        parts.append(f"<= {goal['torch_x']:g}x torch")
    if "above_floor" in goal:
        parts.append(f"<= floor + {goal['above_floor']:g} {unit}")
    return ", ".join(parts)


def render(rows: list, title: str, channel: str) -> str:
    def cell(row, side):
        if row[side] is None:
            return "error" if side in row["errors"] else "-"
        return fmt_value(row[side], row["unit"])

    header = ["workload", "floor", "torch", "torch_ipc", "ipc/floor", "speed-up", "target"]
    lines = []
    for r in rows:
        goal = "-"
        if r["target"]:
            goal = describe_goal(r["target"], r["unit"]) + ("" if r["meets_target"] is not False else " MISSED")
        lines.append([f"{r['workload']}: {r['label']}", cell(r, "floor"), cell(r, "torch"), cell(r, "torch_ipc"),
                      "-" if r["over_floor"] is None else f"{r['over_floor']:.2f}x",
                      "-" if r["speedup"] is None else f"{r['speedup']:.1f}x", goal])
    widths = [max(len(x[i]) for x in [header] + lines) for i in range(len(header))]

    def line(cols):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths)))

    rule = "-" * len(line(header))
    return "\n".join([title, rule, line(header), rule] + [line(x) for x in lines] + [
        rule,
        "floor: same channel and consumer work, no sharing (tensors already local); "
        "ipc/floor = torch_ipc time / floor time",
        f"channel: floor and torch_ipc over {channel}, torch over multiprocessing.Pipe",
        "speed-up = torch time / torch_ipc time (GB/s rows: torch_ipc / torch); > 1: torch_ipc is faster"])


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, few iterations")
    ap.add_argument("--only", action="append", default=[], metavar="NAME[,NAME]",
                    help=f"workloads to run (default: all): {', '.join(WORKLOADS)}")
    ap.add_argument("--side", choices=("both",) + SIDES, default="both")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cpu runs every workload on CPU tensors (full sizes need several GiB of /dev/shm)")
    ap.add_argument("--channel", choices=tuple(CHANNELS), default="ring",
                    help="the channel between producer and consumer, for every side: torch_ipc.Pipe "
                         "(ring, default) or multiprocessing.Pipe (mp)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one message")
    ap.add_argument("--workload-timeout", type=float, default=None,
                    help="seconds for one workload of one side (default 300, 120 with --quick)")
    args = ap.parse_args(argv)
    names = [n for arg in args.only for n in arg.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    args.names = [n for n in WORKLOADS if not names or n in names]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks that kill children
    has_cuda = torch.cuda.is_available()
    notes = []
    names = args.names
    if args.device == "cuda" and not has_cuda:
        print("--device cuda: no CUDA GPU is available", file=sys.stderr)
        return 2
    device = "cuda" if args.device == "auto" and has_cuda else ("cpu" if args.device == "auto" else args.device)
    if args.device == "auto" and not has_cuda:
        notes.append("No CUDA GPU: this benchmark needs one. Ran the small round trip with CPU tensors "
                     "instead (torch: file descriptors, torch_ipc: POSIX shared memory).")
        print(notes[-1], flush=True)
        names = [n for n in names if n in CPU_FALLBACK]
        if not names:
            print("Nothing to run on CPU among the selected workloads.")
            return 0
    cfg = {
        "quick": args.quick,
        "device": device,
        "channel": args.channel,
        "timeout": args.timeout,
        "startup_timeout": max(args.timeout, 180.0),
        "workload_timeout": args.workload_timeout or (120.0 if args.quick else 300.0),
    }
    sides = {}
    for side_name in (SIDES if args.side == "both" else (args.side,)):
        sides[side_name] = run_side(side_name, names, cfg)
    rows = build_rows(names, sides)
    meta = next((s["meta"] for s in sides.values() if s["meta"]), None) or {}
    where = meta.get("producer", {}).get("gpu", "CPU tensors") if device == "cuda" else "CPU tensors"
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")  # e.g. expandable_segments:True (VMM memory)
    title = (f"torch_ipc vs torch.multiprocessing ({where}; torch {torch.__version__}"
             f"{'; PYTORCH_CUDA_ALLOC_CONF=' + alloc_conf if alloc_conf else ''}"
             f"{'; quick' if args.quick else ''}): medians")
    table = render(rows, title, CHANNELS[args.channel])
    errors = {s: side["errors"] for s, side in sides.items() if side["errors"]}
    if args.json:
        report = {
            "meta": {
                "argv": sys.argv, "time": datetime.datetime.now().isoformat(timespec="seconds"),
                "python": platform.python_version(), "torch": torch.__version__, "device": device,
                "quick": args.quick, "plan": plan(cfg), "notes": notes,
                "sides": {s: side["meta"] for s, side in sides.items()},
                "env": {k: v for k, v in os.environ.items() if k.startswith(("PYTORCH_", "CUDA_", "TORCH_IPC"))},
            },
            "rows": rows,
            "raw": {s: side["results"] for s, side in sides.items()},
            "errors": errors,
            "table": table,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print()
    for s, errs in errors.items():
        for name, tb in errs.items():
            last = [x for x in str(tb).strip().splitlines() if x.strip()][-1:] or ["?"]
            print(f"error: {s} {name}: {last[0]}")
    for note in notes:
        print(note)
    print(table, flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
