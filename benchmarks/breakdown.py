"""Where the time of a torch_ipc round trip goes: the bare pipe, dumps() in the
producer, loads() and the release in the consumer, for one small tensor and
for a 384-tensor state_dict; then the cost per tensor of a message (1 vs 1000
tensors of 1 KiB, as bench.py's per_tensor row sends them), split into the
steps of dumps (Python split, the C++ export, the bytes), of loads (the C++
load, the Python rebuild, the commit) and of the release of the previous
load, in one process and in two; last, loads(weights_only=True/False) of a
state_dict and of an object with tensors, with the payload new or seen.
Complements bench.py (which compares with torch). Takes well under a minute.

    python benchmarks/breakdown.py [--device cuda|cpu] [--json out.json]
"""
import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch
from bench import import_torch_ipc

torch_ipc = import_torch_ipc()  # the installed one, else this checkout's (built in place)
from torch_ipc import _C, _serialize  # noqa: E402  (the steps of dumps and loads)

TIMEOUT = 60
PER_TENSOR_COUNTS = (1, 1000)
PER_TENSOR_REPS = {1: 2000, 1000: 150}


def median_us(samples):
    return statistics.median(samples) / 1e3


def load_steps(data, reps):
    """Median ns of each step of loads(data), and of dropping the previous load
    (held until the next one arrives, as bench.py's consumer holds it)."""
    steps = {"loads: C++ load (decode, map, build, wrap)": [], "loads: Python rebuild": [],
             "loads: commit": [], "loads: total": [], "release of the previous load": []}
    held = None
    for i in range(reps + 10):
        before_cuda = None if _serialize._cuda_ready else _serialize._ensure_cuda  # as loads() passes it
        t0 = time.perf_counter_ns()
        tensors, is_parameter, payload, pending = _C.load(data, before_cuda)
        t1 = time.perf_counter_ns()
        obj = _serialize._rebuild(tensors, is_parameter, payload, weights_only=False)
        t2 = time.perf_counter_ns()
        pending.commit()
        t3 = time.perf_counter_ns()
        del tensors, is_parameter, pending
        held = None
        t4 = time.perf_counter_ns()
        held = obj  # noqa: F841
        del obj
        if i >= 10:
            for name, ns in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, t4 - t3)):
                steps[name].append(ns)
    del held
    return {name: statistics.median(ns) for name, ns in steps.items()}


def dumps_steps(tensors, reps):
    """Median ns of each step of dumps(tensors); each export is revoked after
    the clock stopped, so that none piles up."""
    steps = {"dumps: Python split": [], "dumps: C++ export": [], "dumps: descriptor bytes": [],
             "dumps: total": []}
    for i in range(reps + 10):
        t0 = time.perf_counter_ns()
        parts = _serialize.split(tensors)
        t1 = time.perf_counter_ns()
        sent = _serialize.export_parts(*parts)
        t2 = time.perf_counter_ns()
        _ = sent.data
        t3 = time.perf_counter_ns()
        sent.revoke()
        if i >= 10:
            for name, ns in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                steps[name].append(ns)
    torch_ipc.collect()
    return {name: statistics.median(ns) for name, ns in steps.items()}


def weights_only_rows(device):
    """Rows (what, us) of loads(weights_only=True/False) in one process: the
    walk over a payload's opcodes, when the payload is new and when it was
    seen (Note [checked payloads] in torch_ipc/_weights_only.py)."""
    from torch_ipc import _weights_only

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2, device=device) for _ in range(192)])
    workloads = {
        "dict of 384 tensors": dict(model.state_dict()),
        "state_dict() (OrderedDict) of 384 tensors": model.state_dict(),
        "object with 20 tensors": {"step": 3, "model": [torch.zeros(2, device=device) for _ in range(20)],
                                   "cfg": {"lr": 1e-3, "betas": (0.9, 0.99)}},
    }
    rows = []
    for name, obj in workloads.items():
        data = torch_ipc.dumps(obj, consumers=None)
        for label, weights_only, new in (("weights_only=False", False, False),
                                         ("weights_only=True, payload seen", True, False),
                                         ("weights_only=True, payload new", True, True)):
            t = []
            for i in range(210):
                if new:
                    _weights_only._PASSED.clear()
                t0 = time.perf_counter_ns()
                torch_ipc.loads(data, weights_only=weights_only)
                if i >= 10:
                    t.append(time.perf_counter_ns() - t0)
            rows.append((f"{name}: loads, {label}", median_us(t)))
    return rows


def per_tensor(conn, device):
    """Rows (step, us for 1 tensor, us for 1000, us per tensor beyond the first)."""
    by_count = {}
    for n in PER_TENSOR_COUNTS:
        reps = PER_TENSOR_REPS[n]
        tensors = [torch.empty(256, device=device) for _ in range(n)]
        row = dumps_steps(tensors, reps)
        data = torch_ipc.dumps(tensors, consumers=reps + 10)
        row.update({f"{k} [one process]": v for k, v in load_steps(data, reps).items()})
        data = torch_ipc.dumps(tensors, consumers=reps + 10)
        conn.send(("steps", data, reps))
        if not conn.poll(TIMEOUT):
            raise TimeoutError("consumer did not answer")
        row.update({f"{k} [two processes]": v for k, v in conn.recv().items()})
        by_count[n] = row
        torch_ipc.collect()
    one, many = PER_TENSOR_COUNTS
    return [(name, by_count[one][name] / 1e3, by_count[many][name] / 1e3,
             (by_count[many][name] - by_count[one][name]) / (many - one) / 1e3) for name in by_count[one]]


def consumer(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, data, reps = msg
        if kind == "steps":
            conn.send(load_steps(data, reps))
            continue
        if kind == "pipe":
            for _ in range(reps):
                conn.recv_bytes()
                conn.send_bytes(b"k")
            continue
        load, drop = [], []
        held = None
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            obj = torch_ipc.loads(data)
            t1 = time.perf_counter_ns()
            held = None  # the previous load goes: its release is timed here
            t2 = time.perf_counter_ns()
            held = obj  # noqa: F841
            del obj
            load.append(t1 - t0)
            drop.append(t2 - t1)
        del held
        conn.send((median_us(load), median_us(drop)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where there is one")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=consumer, args=(b,), daemon=True)
    p.start()
    rows = []
    try:
        reps = 2000
        a.send(("pipe", None, reps))
        t = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            a.send_bytes(b"x" * 64)
            a.recv_bytes()
            t.append(time.perf_counter_ns() - t0)
        rows.append(("bare Pipe round trip, 64 B", median_us(t)))

        workloads = {
            "4 KiB tensor": torch.randn(1024, device=device),
            "state_dict 384 x 4 MiB bf16": {
                f"layers.{i}.w{j}": torch.randn(2048, 1024, device=device, dtype=torch.bfloat16)
                for i in range(64)
                for j in range(6)
            }
            if device == "cuda"
            else {f"layers.{i}.w{j}": torch.randn(16) for i in range(64) for j in range(6)},
        }
        for name, obj in workloads.items():
            n = 2000 if name.startswith("4") else 200
            for _ in range(10):
                torch_ipc.dumps(obj)
            t = []
            for _ in range(n):
                t0 = time.perf_counter_ns()
                torch_ipc.dumps(obj)
                t.append(time.perf_counter_ns() - t0)
            rows.append((f"{name}: dumps (producer)", median_us(t)))
            data = torch_ipc.dumps(obj, consumers=n + 10)
            a.send(("load", data, n))
            if not a.poll(TIMEOUT):
                raise TimeoutError("consumer did not answer")
            load_us, drop_us = a.recv()
            rows.append((f"{name}: loads (consumer)", load_us))
            rows.append((f"{name}: release on drop (consumer)", drop_us))
        steps = per_tensor(a, device)
        rows.extend(weights_only_rows(device))
        a.send(None)
        p.join(TIMEOUT)
    finally:
        if p.is_alive():
            p.kill()
    print(f"\ntorch_ipc time breakdown ({device}; medians)")
    for name, us in rows:
        print(f"  {name:<70} {us:10.2f} us")
    one, many = PER_TENSOR_COUNTS
    print(f"\nper tensor: messages of {one} and {many} tensors of 1 KiB ({device}; medians, us)")
    print(f"  {'step':<58} {one:>9} {many:>10} {'per tensor':>11}")
    for name, us_one, us_many, us_per in steps:
        print(f"  {name:<58} {us_one:9.2f} {us_many:10.1f} {us_per:11.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows, "per_tensor": steps}, f, indent=1)


if __name__ == "__main__":
    main()
