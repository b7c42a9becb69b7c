#!/usr/bin/env python3
"""Across machines: torch_ipc over torch.distributed against torch.distributed
itself, in the same run. Two processes stand for two nodes (rank 0: the
trainer / prefill node, rank 1: the relay / decode node) and a third for an
inference process on rank 1's node.

    python benchmarks/distributed_bench.py --quick                      # CPU, gloo (CI smoke, ~10 s)
    python benchmarks/distributed_bench.py --budget-s 120               # CPU, gloo, full sizes
    python benchmarks/distributed_bench.py --device cuda --backend gloo --budget-s 170   # one GPU
    python benchmarks/distributed_bench.py --device cuda --backend nccl --budget-s 170   # two GPUs, one per rank
    ... --relay-stream on     # the relay's subscriber copies each piece as it lands (Relay(stream=True))

Each row is printed as soon as it is measured. Each section runs paired
rounds (torch_ipc and the raw call of the same bytes back to back, their
order alternating between rounds) until --iters rounds or its share of
--budget-s (seconds for the whole run, setup included; each section gets at
least one round, and --min-iters unless the budget is spent). Columns: the
median milliseconds of torch_ipc and of the raw call, torch_ipc's GiB/s,
and the ratio (the median over rounds of raw time / torch_ipc time, so 100%
is the raw speed).

local publish       The trainer's publish() on its own node (the snapshot
                    copy); no raw counterpart.
broadcast           The trainer's broadcast of a version (header + bucketed
                    broadcast of its snapshot) until the relay's receive()
                    has published it on its node, between two barriers.
                    Raw: one torch.distributed.broadcast of the same bytes
                    between the same barriers. Target: >= 90%. Also: the
                    whole publish() (the snapshot copied range by range,
                    each range's broadcast started after its copy).
latency             One version end to end: from before publish() on the
                    trainer to the return of pull() in the inference process
                    on the relay's node (a subscriber of the relay, copying
                    each bucket as it lands), the model in its own memory;
                    raw: the raw broadcast above.
local pull          pull() of the version in the inference process on the
                    relay's node against one device copy of the same bytes
                    there (3 back to back, CUDA events on a GPU). Target:
                    >= 85%.
kv                  --kv-blocks (256) blocks of a SharedKVPool (random ids)
                    to the other node's pool with send_blocks / recv_blocks,
                    between two barriers; raw: one send/recv of as many
                    bytes. Target: >= 90%. Also: consecutive ids.
CUDA tensors over gloo go through host memory: gloo's broadcast stages CUDA
tensors itself, and its send/recv take host memory only, so torch_ipc
stages pieces in pinned memory (Note [CUDA tensors over gloo] in
torch_ipc/_dist.py) and the raw send/recv row does the same (one copy to
pinned memory, send, receive, one copy back). The rows "raw ..., host
memory" are the same raw calls on host tensors: what staging costs.

State dict: --tensors (384) bf16 tensors of --tensor-kib each (4096 KiB:
1.5 GiB; --quick: 64 KiB). KV block: [2, 32, 16, 8, 128] bf16 (2 MiB;
--quick: [2, 4, 16, 8, 64], 128 KiB), pieces of --staging-mib (default:
send_blocks' default, 128; --quick: 4).
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import tempfile
import time

import torch

try:  # the installed torch_ipc, else the one of this checkout (built in place)
    import torch_ipc  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Sections in the order they run, with their weights: a section's share of the
# budget is the time left when it starts times its weight over the weights left.
SECTIONS = {"local": 0.5, "broadcast": 4.0, "latency": 2.0, "pull": 0.5, "kv": 3.0}


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _threads(cfg):
    """One intra-op thread per process on CPU runs: three processes share the
    machine, and OpenMP's spinning barriers with a descheduled thread made a
    copy of 384 tensors 80x slower than one thread on a loaded 2-core box."""
    if cfg["device"] == "cpu":
        torch.set_num_threads(1)


def _init(cfg, rank):
    import torch.distributed as dist

    _threads(cfg)
    if cfg["backend"] == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(cfg["backend"], init_method=cfg["url"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    return dist


def _device(cfg, rank):
    return f"cuda:{rank if cfg['backend'] == 'nccl' else 0}" if cfg["device"] == "cuda" else "cpu"


def _staged(cfg):
    """CUDA tensors over gloo: point-to-point goes through host memory."""
    return cfg["device"] == "cuda" and cfg["backend"] == "gloo"


def _state_dict(cfg, device):
    numel = cfg["tensor_kib"] * 1024 // 2
    return {f"layer{i}.weight": torch.randn(numel, device=device).to(torch.bfloat16) for i in range(cfg["tensors"])}


def _timed(dist, device, fn):
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    dist.barrier()
    return time.perf_counter() - start


def _share(cfg, section):
    """Seconds of the budget for `section` (None: no budget)."""
    if cfg["budget_s"] is None:
        return None
    names = list(SECTIONS)
    left = sum(SECTIONS[n] for n in names[names.index(section):])
    return max(0.0, cfg["deadline"] - time.monotonic()) * SECTIONS[section] / left


def _go_on(cfg, done, started, share):
    """Whether to run round `done` + 1 of a section that started at `started`."""
    if done >= cfg["iters"]:
        return False
    if share is None or done == 0:
        return True
    now = time.monotonic()
    per_round = (now - started) / done
    if now + per_round > cfg["deadline"]:
        return False  # the whole budget
    return done < cfg["min_iters"] or now - started + per_round <= share


def rounds(cfg, dist, rank, section):
    """Round numbers of a section, as many as rank 0 decides (every rank
    iterates with it: the decision is broadcast)."""
    share, started, done = _share(cfg, section), time.monotonic(), 0
    flag_device = _device(cfg, rank) if cfg["backend"] == "nccl" else "cpu"
    while True:
        flag = torch.tensor([int(rank == 0 and _go_on(cfg, done, started, share))], device=flag_device)
        dist.broadcast(flag, 0)
        if not flag.item():
            return
        yield done
        done += 1


def _paired(order, i):
    """The round's order of the calls: reversed every other round."""
    return order if i % 2 == 0 else order[::-1]


def _row(out, name, ours, raw, nbytes, target="", paired=True):
    """One row to print: `ours` and `raw` seconds, paired round by round or not."""
    out.put(("row", {"row": name, "seconds": ours, "raw_seconds": raw, "bytes": nbytes, "target": target,
                     "paired": paired}))


# ----------------------------------------------------------------------------- rank 0: trainer / prefill

def trainer(cfg, sub_conn, out):
    from torch_ipc.weights import Publisher

    dist, device = _init(cfg, 0), _device(cfg, 0)
    weights = _state_dict(cfg, device)
    pub = Publisher(weights)
    size = pub.layout.total_bytes
    local = [_timed(dist, device, pub.publish) for _ in rounds(cfg, dist, 0, "local")]
    _row(out, "local publish (snapshot copy)", local, None, size)
    pub.broadcast_to(bucket_bytes=cfg["bucket_bytes"])  # sends the layout and the current version
    raw = _broadcast_rounds(cfg, dist, 0, device, size, out,
                            {"publish": pub.publish, "broadcast": lambda: pub._broadcast(pub.version)})
    sub_conn.send(("follow", pub.version))  # not the subscriber's latest: the relay may be one ahead by then
    latency = []
    for _ in rounds(cfg, dist, 0, "latency"):
        dist.barrier()
        start = time.perf_counter()
        version = pub.publish()
        pulled, done = sub_conn.recv()
        assert pulled == version, (pulled, version)
        latency.append(done - start)
    _row(out, "latency publish -> remote pull", latency, raw, size, paired=False)
    sub_conn.send(("pull", _share(cfg, "pull"), cfg["iters"], cfg["min_iters"]))
    pulls, copies = sub_conn.recv()
    _row(out, "local pull on the relay's node", pulls, copies, size, ">= 85%")
    dist.barrier()  # the relay waited for the pull rounds
    sub_conn.send(("stop",))
    pub.close()
    kv_side(cfg, dist, 0, out)
    dist.destroy_process_group()
    out.put(("done", None))


def _broadcast_rounds(cfg, dist, rank, device, size, out, ours):
    """The broadcast section on either rank: `ours` maps the names "publish"
    and "broadcast" to this rank's side of them. Returns the raw times."""
    calls = dict(ours)
    raw = torch.empty(size, dtype=torch.uint8, device=device)
    calls["raw"] = lambda: dist.broadcast(raw, 0)
    if _staged(cfg):
        host = torch.empty(size, dtype=torch.uint8)
        calls["raw host"] = lambda: dist.broadcast(host, 0)
    for name in calls:
        if name.startswith("raw"):
            _timed(dist, device, calls[name])  # warm-up (gloo's pinned staging of CUDA tensors)
    times = {name: [] for name in calls}
    for i in rounds(cfg, dist, rank, "broadcast"):
        for name in _paired(list(calls), i):
            times[name].append(_timed(dist, device, calls[name]))
    if out is not None:
        _row(out, "broadcast to the relay's node", times["broadcast"], times["raw"], size, ">= 90%")
        _row(out, "publish + broadcast", times["publish"], times["raw"], size)
        if "raw host" in times:
            _row(out, "  raw broadcast, host memory", times["raw host"], None, size)
    return times["raw"]


# ----------------------------------------------------------------------------- rank 1: relay / decode

def relay(cfg, attach_conn):
    from torch_ipc.weights import Relay

    dist, device = _init(cfg, 1), _device(cfg, 1)
    for _ in rounds(cfg, dist, 1, "local"):
        _timed(dist, device, lambda: None)  # the trainer's local publishes
    r = Relay(src=0, device=device, timeout=cfg["timeout"], stream=cfg["stream"])
    r.attach(attach_conn)
    r.receive()  # the version sent on joining
    _broadcast_rounds(cfg, dist, 1, device, r._publisher.layout.total_bytes, None,
                      {"publish": r.receive, "broadcast": r.receive})
    for _ in rounds(cfg, dist, 1, "latency"):
        dist.barrier()
        r.receive()
    dist.barrier()  # the subscriber's pull rounds
    assert r.receive() is None  # the trainer closed
    kv_side(cfg, dist, 1, None)
    r.close()
    dist.destroy_process_group()


def subscriber(cfg, attach_conn, trainer_conn):
    from torch_ipc.weights import Subscriber

    _threads(cfg)
    device = _device(cfg, 1)
    if cfg["device"] == "cuda":
        torch.cuda.set_device(device)
    sub = Subscriber(attach_conn, timeout=cfg["timeout"])
    model = {k: torch.empty_like(v) for k, v in _state_dict(cfg, device).items()}
    while True:
        command, *args = trainer_conn.recv()
        if command == "follow":  # pull each version after args[0] until the next command
            (version,) = args
            while not trainer_conn.poll(0):
                try:
                    version = sub.pull(model, newer_than=version, timeout=0.05)
                except TimeoutError:
                    continue
                _sync(device)
                trainer_conn.send((version, time.perf_counter()))
        elif command == "pull":
            trainer_conn.send(_pull_rounds(sub, model, device, *args))
        else:
            break
    sub.close()


def _pull_rounds(sub, model, device, share, iters, min_iters, reps=3):
    """(pull seconds, device copy seconds) per round, each of `reps` calls."""
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    calls = {"pull": lambda: sub.pull(model), "copy": lambda: dst.copy_(src)}
    times = {name: [] for name in calls}
    started = time.monotonic()
    for name in calls:
        calls[name]()  # warm-up
    for i in range(iters):
        if share is not None and i >= min_iters and (time.monotonic() - started) * (i + 1) / i > share:
            break
        for name in _paired(list(calls), i):
            times[name].append(_device_seconds(calls[name], device, reps))
    return times["pull"], times["copy"]


def _device_seconds(fn, device, reps):
    """Seconds of one fn(), from `reps` calls back to back (CUDA events on a
    GPU): weights_bench's timing, so that this row compares with its."""
    from weights_bench import timed

    return timed(fn, 1, "cuda" if str(device).startswith("cuda") else "cpu", warmup=0, reps=reps) / 1e3


# ----------------------------------------------------------------------------- KV, both ranks

def kv_side(cfg, dist, rank, out):
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.kv.remote import recv_blocks, send_blocks

    device = _device(cfg, rank)
    shape, n = cfg["block_shape"], cfg["kv_blocks"]
    pool = SharedKVPool(2 * n, shape, torch.bfloat16, device)
    nbytes = n * pool.block_bytes
    if rank == 0:
        held = pool.allocate(2 * n)
        pool.scatter(held, torch.randn((2 * n, *shape), device=device).to(torch.bfloat16))
        scattered, run = random.Random(0).sample(held, n), held[n // 2 : n // 2 + n]
        ours = {name: (lambda ids=ids: send_blocks(pool, ids, 1, transfer=False, staging_bytes=cfg["staging_bytes"]))
                for name, ids in (("kv", scattered), ("kv run", run))}
    else:
        def receive():
            pool.free(recv_blocks(pool, 0).ids)
        ours = {"kv": receive, "kv run": receive}
    calls = dict(ours, **_raw_point_to_point(cfg, dist, rank, device, nbytes))
    for name in calls:
        _timed(dist, device, calls[name])  # warm-up
    times = {name: [] for name in calls}
    for i in rounds(cfg, dist, rank, "kv"):
        for name in _paired(list(calls), i):
            times[name].append(_timed(dist, device, calls[name]))
    if out is not None:
        _row(out, f"kv {n} blocks (random ids)", times["kv"], times["raw"], nbytes, ">= 90%")
        _row(out, f"  kv {n} consecutive blocks", times["kv run"], times["raw"], nbytes)
        if "raw host" in times:
            _row(out, "  raw send/recv, host memory", times["raw host"], None, nbytes)
    _kv_profiled(cfg, dist, rank, device, calls)
    pool.close()


def _kv_profiled(cfg, dist, rank, device, calls):
    """--profile DIR: each KV call once more under torch.profiler (between
    the same barriers), a trace per call and rank in DIR (the profiler
    inflates host time; the device timeline shows when each transfer ran)."""
    if not cfg.get("profile"):
        return
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(cfg["profile"], exist_ok=True)
    for name, fn in calls.items():
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _timed(dist, device, fn)
        prof.export_chrome_trace(os.path.join(cfg["profile"], f"{name.replace(' ', '_')}_rank{rank}.json"))


def _raw_point_to_point(cfg, dist, rank, device, nbytes):
    """The raw send/recv of `nbytes` from rank 0 to rank 1 ("raw"); for CUDA
    over gloo staged through pinned host memory as torch_ipc does, then also
    the same without staging ("raw host")."""
    data = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if not _staged(cfg):
        return {"raw": (lambda: dist.send(data, 1)) if rank == 0 else (lambda: dist.recv(data, 0))}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def staged():
        if rank == 0:
            host.copy_(data)
            dist.send(host, 1)
        else:
            dist.recv(host, 0)
            data.copy_(host)

    def plain():
        if rank == 0:
            dist.send(host, 1)
        else:
            dist.recv(host, 0)
    return {"raw": staged, "raw host": plain}


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU-friendly), few rounds")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                        help="gloo (default on CPU) or nccl (default on CUDA)")
    parser.add_argument("--tensors", type=int, default=384)
    parser.add_argument("--tensor-kib", type=int, default=None)
    parser.add_argument("--bucket-mib", type=int, default=128, help="broadcast_to's bucket_bytes (its default)")
    parser.add_argument("--relay-stream", default="off", choices=["on", "off"],
                        help="Relay(stream=...): pulls copy a version while it lands (off: the default)")
    parser.add_argument("--kv-blocks", type=int, default=256)
    parser.add_argument("--staging-mib", type=int, default=None, help="KV pieces (send_blocks' staging_bytes)")
    parser.add_argument("--iters", type=int, default=None, help="rounds per section at most (10; --quick: 5)")
    parser.add_argument("--min-iters", type=int, default=3, help="rounds per section at least, budget allowing")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole run, setup included (default: no limit: --iters rounds)")
    parser.add_argument("--timeout", type=float, default=600, help="kill everything after this many seconds")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--profile", help="write a torch.profiler trace of one more KV call per call and rank here")
    args = parser.parse_args(argv)
    for name in ("tensors", "tensor_kib", "bucket_mib", "kv_blocks", "staging_mib", "iters", "min_iters"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.device == "cpu" and args.backend == "nccl":
        parser.error("nccl moves CUDA tensors only: use --device cuda")
    return args


def _default_staging(quick):
    from torch_ipc.kv.remote import DEFAULT_STAGING_BYTES

    return 4 << 20 if quick else DEFAULT_STAGING_BYTES


def config(args):
    return {
        "device": args.device,
        "backend": args.backend or ("nccl" if args.device == "cuda" else "gloo"),
        "tensors": args.tensors,
        "tensor_kib": args.tensor_kib or (64 if args.quick else 4096),
        "bucket_bytes": args.bucket_mib << 20,
        "stream": args.relay_stream == "on",
        "kv_blocks": args.kv_blocks,
        "staging_bytes": args.staging_mib << 20 if args.staging_mib else _default_staging(args.quick),
        "iters": args.iters or (5 if args.quick else 10),
        "min_iters": args.min_iters,
        "budget_s": args.budget_s,
        "deadline": time.monotonic() + (args.budget_s or args.timeout),
        "timeout": args.timeout,
        "block_shape": [2, 4, 16, 8, 64] if args.quick else [2, 32, 16, 8, 128],
        "profile": args.profile,
        "url": "file://" + os.path.join(tempfile.mkdtemp(prefix="torch_ipc_dist_bench"), "rendezvous"),
    }


def main():
    args = parse_args()
    cfg = config(args)
    print(f"{cfg['device']}, {cfg['backend']}; state dict {cfg['tensors']} x {cfg['tensor_kib']} KiB = "
          f"{cfg['tensors'] * cfg['tensor_kib'] / 1024:.1f} MiB, buckets of {cfg['bucket_bytes'] >> 20} MiB; "
          f"KV {cfg['kv_blocks']} blocks of {cfg['block_shape']} bf16, pieces of {cfg['staging_bytes'] >> 20} MiB; "
          f"rounds per section {min(cfg['min_iters'], cfg['iters'])} to {cfg['iters']}"
          + (f" within {cfg['budget_s']:.0f} s" if cfg["budget_s"] else ""), flush=True)
    print(f"| {'row':34} | {'n':>3} | {'ms':>9} | {'GiB/s':>7} | {'raw ms':>9} | {'ratio':>6} | target |")
    print(f"|{'-' * 36}|{'-' * 5}|{'-' * 11}|{'-' * 9}|{'-' * 11}|{'-' * 8}|--------|", flush=True)
    rows = run(cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": rows}, f, indent=1)


def run(cfg):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    attach_relay, attach_sub = ctx.Pipe()
    trainer_end, sub_end = ctx.Pipe()
    procs = [ctx.Process(target=trainer, args=(cfg, trainer_end, out)),
             ctx.Process(target=relay, args=(cfg, attach_relay)),
             ctx.Process(target=subscriber, args=(cfg, attach_sub, sub_end))]
    for p in procs:
        p.start()
    rows, finished, deadline = [], False, time.monotonic() + cfg["timeout"]
    try:
        while not finished and time.monotonic() < deadline:
            try:
                kind, row = out.get(timeout=1)
            except queue.Empty:
                if any(p.exitcode for p in procs):
                    break  # one failed: its traceback is above
                continue
            if kind == "row":
                rows.append(print_row(row))
            finished = kind == "done"
        for p in procs:
            p.join(max(1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    if not finished or any(p.exitcode for p in procs):
        sys.exit(f"a process failed or timed out: exit codes {[p.exitcode for p in procs]}")
    return rows


def print_row(r):
    """Print one row as measured; returns it with its medians."""
    ours = statistics.median(r["seconds"]) * 1e3
    raw = statistics.median(r["raw_seconds"]) * 1e3 if r["raw_seconds"] else None
    ratio = None
    if raw is not None and r["paired"]:  # the median of the rounds' ratios
        ratio = statistics.median(theirs / mine for theirs, mine in zip(r["raw_seconds"], r["seconds"]))
    elif raw is not None:
        ratio = raw / ours
    raw_text, ratio_text = (f"{raw:.2f}", f"{ratio:.0%}") if raw is not None else ("", "")
    print(f"| {r['row']:34} | {len(r['seconds']):3} | {ours:9.2f} | {r['bytes'] / ours / 2**30 * 1e3:7.2f} | "
          f"{raw_text:>9} | {ratio_text:>6} | {r['target']:6} |", flush=True)
    return dict(r, median_ms=ours, median_raw_ms=raw, ratio=ratio)


if __name__ == "__main__":
    main()
