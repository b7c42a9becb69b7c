"""Where the time of a torch_ipc round trip goes: the bare pipe, dumps() in the
producer, loads() and the release in the consumer, for one small tensor and
for a 384-tensor state_dict. Complements bench.py (which compares with torch).

    python benchmarks/breakdown.py [--json out.json]
"""
import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from bench import import_torch_ipc

torch_ipc = import_torch_ipc()  # the installed one, else this checkout's (built in place)

TIMEOUT = 60


def median_us(samples):
    return statistics.median(samples) / 1e3


def consumer(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, data, reps = msg
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
        held = None
        conn.send((median_us(load), median_us(drop)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
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
        a.send(None)
        p.join(TIMEOUT)
    finally:
        if p.is_alive():
            p.kill()
    print(f"\ntorch_ipc time breakdown ({device}; medians)")
    for name, us in rows:
        print(f"  {name:<50} {us:10.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
