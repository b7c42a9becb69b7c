#!/usr/bin/env python3
"""Benchmark torch_ipc.weights: a trainer (this process) publishes, an
inference process (spawned) pulls, against the floor and the naive way.

Rows, all measured in the same run (H100 targets in brackets):
    floor            one contiguous device-to-device copy of the same bytes
    pull bf16        pull of a bf16 state_dict into existing bf16 params   [>= 85% of floor]
    pull foreach     the same through torch._foreach_copy_ (the fallback)
    naive copy loop  the same copy as `for p, t in zip(...): p.copy_(t)`
    pull fp32->bf16  fp32 published, bf16 params: against the memory-bound
                     time (4 + 2 bytes per element at the floor's bandwidth) [>= 85%]
    publish          the trainer's host time of publish() after the first   [<= 50 us]
    direct cycle     publish + pull + the subscriber's synchronize, end to end
    bucketed cycle   the same in bucketed mode (2 x bucket_bytes staging)   [<= 1.5x direct]
    naive mp cycle   torch.multiprocessing: send the state_dict (torch's CUDA
                     IPC), rebuild it, copy in a loop, synchronize
Copy rows are CUDA-event times of 5 back-to-back calls (median of 30 samples);
publish and the cycles are the trainer's wall clock (median).

Usage:
    python benchmarks/weights_bench.py                 # 384 x 4 MiB bf16 (1.5 GiB)
    python benchmarks/weights_bench.py --quick         # small sizes
    python benchmarks/weights_bench.py --device cpu --quick   # the script itself, no GPU
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's CUDA reductions: the naive rows)

try:  # the installed torch_ipc, else the one of this checkout (built in place)
    import torch_ipc  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_state_dict(n: int, shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(shape, generator=gen).to(dtype).to(device) for i in range(n)}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters, device, warmup=3, reps=5):
    """Median milliseconds of one fn() call, each sample `reps` calls back to
    back so that the GPU never waits for the host (GPU time with events on CUDA)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(times)


# ----------------------------------------------------------------------------- inference process

def inference(ctl, attach_ends, cfg):
    from torch_ipc.weights import Subscriber

    device = cfg["device"]
    subs = {key: Subscriber(end, timeout=120.0) for key, end in attach_ends.items()}
    model = make_state_dict(cfg["n"], cfg["shape"], torch.bfloat16, device, seed=1)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    while True:
        cmd, *args = ctl.recv()
        if cmd == "stop":
            ctl.send("bye")
            return
        if cmd == "floor":
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            ctl.send(timed(lambda: dst.copy_(src), cfg["iters"], device))
            del src, dst
        elif cmd == "pull":
            key, foreach = args
            if foreach:
                os.environ["TORCH_IPC_WEIGHTS_COPY"] = "foreach"
                subs[key]._plans.clear()  # a fresh plan, built for the fallback
            subs[key].pull(model)
            ms = timed(lambda: subs[key].pull(model), cfg["iters"], device)
            host = [subs[key].stats["last_pull_us"]]
            os.environ.pop("TORCH_IPC_WEIGHTS_COPY", None)
            stats = dict(subs[key].stats)
            subs[key]._plans.clear()
            ctl.send((ms, host[0], stats))
        elif cmd == "loop":
            src = list(make_state_dict(cfg["n"], cfg["shape"], torch.bfloat16, device, seed=2).values())
            dst = list(model.values())

            def loop():
                for d, s in zip(dst, src):
                    d.copy_(s)

            ctl.send(timed(loop, cfg["iters"], device))
            del src
        elif cmd == "cycle":
            key, newer_than = args
            version = subs[key].pull(model, newer_than=newer_than)
            sync(device)
            ctl.send(version)
        elif cmd == "naive":
            received = ctl.recv()  # torch's own CUDA IPC (ForkingPickler reductions)
            for d, s in zip(model.values(), received.values()):
                d.copy_(s)
            sync(device)
            del received
            ctl.send("ok")


# ----------------------------------------------------------------------------- trainer (this process)

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tensors", type=int, default=384)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("weights_bench: no CUDA GPU here (use --device cpu --quick to run the script on CPU)")
    from torch_ipc.weights import Publisher

    n = 16 if args.quick else args.tensors
    shape = (256, 256) if args.quick else (2048, 1024)  # 4 MiB of bf16 each
    iters = 5 if args.quick else 30
    bucket = (64 << 10) if args.quick else args.bucket_mib << 20
    cfg = dict(device=device, n=n, shape=shape, iters=iters)

    bf16 = make_state_dict(n, shape, torch.bfloat16, device)
    fp32 = make_state_dict(n, shape, torch.float32, device)
    bucketed_src = make_state_dict(n, shape, torch.bfloat16, device, seed=3)
    publishers = {"bf16": Publisher(bf16), "fp32": Publisher(fp32),
                  "bucketed": Publisher(bucketed_src, bucket_bytes=bucket)}
    ctx = mp.get_context("spawn")
    ctl, ctl_child = ctx.Pipe()
    ends = {key: ctx.Pipe() for key in publishers}
    proc = ctx.Process(target=inference, args=(ctl_child, {k: b for k, (a, b) in ends.items()}, cfg), daemon=True)
    proc.start()
    for key, pub in publishers.items():
        pub.attach(ends[key][0])
    publishers["bf16"].publish()
    publishers["fp32"].publish()
    sync(device)

    def ask(*cmd):
        ctl.send(cmd)
        if not ctl.poll(300):
            proc.kill()
            sys.exit(f"weights_bench: the inference process did not answer {cmd[0]}")
        return ctl.recv()

    nbytes = sum(t.numel() * t.element_size() for t in bf16.values())
    rows = []

    def row(name, ms, note=""):
        rows.append({"row": name, "ms": ms, "note": note})
        print(f"{name:<18} {ms:9.3f} ms  {note}", flush=True)

    print(f"{n} tensors of {shape} bf16 = {nbytes / 2**30:.3f} GiB on {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    floor = ask("floor")
    bw = 2 * nbytes / floor / 1e6  # GB/s, read + write
    row("floor", floor, f"{bw:.0f} GB/s read+write")
    pull, pull_host, stats = ask("pull", "bf16", False)
    row("pull bf16", pull, f"{floor / pull:.0%} of floor [>= 85%]; path {stats['path']}, "
        f"{stats['launches']} launch(es), host {pull_host:.0f} us")
    pull_fe, _, stats_fe = ask("pull", "bf16", True)
    row("pull foreach", pull_fe, f"{floor / pull_fe:.0%} of floor; path {stats_fe['path']}")
    loop = ask("loop")
    row("naive copy loop", loop, f"{floor / loop:.0%} of floor; pull is {loop / pull:.1f}x faster")
    conv, _, stats_c = ask("pull", "fp32", False)
    membound = 6 * (nbytes // 2) / bw / 1e6
    row("pull fp32->bf16", conv,
        f"{membound / conv:.0%} of memory-bound {membound:.3f} ms [>= 85%]; path {stats_c['path']}")
    conv_fe, _, _ = ask("pull", "fp32", True)
    row("fp32->bf16 foreach", conv_fe, f"{membound / conv_fe:.0%} of memory-bound")

    pub = publishers["bf16"]
    host = []
    for _ in range(iters + 5):
        sync(device)
        t0 = time.perf_counter()
        pub.publish()
        host.append((time.perf_counter() - t0) * 1e6)
    publish_us = statistics.median(host[5:])
    row("publish", publish_us / 1e3, f"{publish_us:.1f} us host [<= 50 us]")

    def cycle(key):
        times = []
        for _ in range(iters + 2):
            sync(device)
            t0 = time.perf_counter()
            p = publishers[key]
            if key == "bucketed":
                ctl.send(("cycle", key, p.version))
                p.publish()
            else:
                p.publish()
                ctl.send(("cycle", key, p.version - 1))
            if not ctl.poll(300):
                sys.exit("weights_bench: no answer to cycle")
            ctl.recv()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[2:])

    direct = cycle("bf16")
    row("direct cycle", direct, "publish (snapshot copy) + pull + synchronize")
    bucketed = cycle("bucketed")
    row("bucketed cycle", bucketed, f"{bucketed / direct:.2f}x direct [<= 1.5x]; {bucket >> 20} MiB halves")

    naive = []
    for _ in range(iters + 2):
        sync(device)
        t0 = time.perf_counter()
        ctl.send(("naive",))
        ctl.send(bf16)
        ctl.poll(300)
        ctl.recv()
        naive.append((time.perf_counter() - t0) * 1e3)
    naive_ms = statistics.median(naive[2:])
    row("naive mp cycle", naive_ms,
        f"torch.multiprocessing send + rebuild + copy loop; direct cycle is {naive_ms / direct:.1f}x faster")
    ask("stop")
    proc.join(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
