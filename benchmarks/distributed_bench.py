#!/usr/bin/env python3
"""Across machines: torch_ipc over torch.distributed against torch.distributed
itself, in the same run. Two processes stand for two nodes (rank 0: the
trainer / prefill node, rank 1: the relay / decode node) and a third for an
inference process on rank 1's node.

    python benchmarks/distributed_bench.py --quick                  # CPU, gloo
    python benchmarks/distributed_bench.py --device cuda --backend nccl   # two GPUs, one per rank
    python benchmarks/distributed_bench.py --device cuda --backend gloo   # CUDA tensors over gloo

Rows (medians; ratio = raw time / torch_ipc time, so 1.0 is the raw speed):

broadcast   The trainer's broadcast of a version (header + bucketed
            broadcast of its snapshot) until the relay's ``receive()`` has
            published it on its node, between two barriers. Raw: one
            ``torch.distributed.broadcast`` of the same bytes between the
            same barriers. Target: >= 90%. Also shown: the whole
            ``publish()`` (local snapshot copy + broadcast) and the local
            publish alone (the snapshot copy, which the raw row does not do).
latency     One version end to end: from before ``publish()`` on the trainer
            to the return of ``pull()`` in the inference process on the
            relay's node (a subscriber of the relay), the model in its own
            memory. Shown with the raw broadcast of the same bytes.
kv          256 blocks of a SharedKVPool (random ids, so gathered; pieces
            of --staging-mib, 64 MiB, --quick: 4 MiB) to the other node's
            pool with ``send_blocks`` / ``recv_blocks``, between two
            barriers. Raw: one send/recv of as many bytes. Target: >= 90%.
            Also shown: 256 consecutive ids (sent from the pool itself).

State dict: --tensors (384) bf16 tensors of --tensor-kib each (4096 KiB:
1.5 GiB; --quick: 64 KiB). KV block: [2, 32, 16, 8, 128] bf16 (2 MiB;
--quick: [2, 4, 16, 8, 64], 128 KiB).
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

TIMEOUT = 600


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _init(cfg, rank):
    import torch.distributed as dist

    if cfg["backend"] == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(cfg["backend"], init_method=cfg["url"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    return dist


def _device(cfg, rank):
    return f"cuda:{rank if cfg['backend'] == 'nccl' else 0}" if cfg["device"] == "cuda" else "cpu"


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


# ----------------------------------------------------------------------------- rank 0: trainer / prefill

def trainer(cfg, sub_conn, out):
    from torch_ipc.weights import Publisher

    dist, device = _init(cfg, 0), _device(cfg, 0)
    weights = _state_dict(cfg, device)
    pub = Publisher(weights)
    raw = torch.empty(pub.layout.total_bytes, dtype=torch.uint8, device=device)
    local = [_timed(dist, device, pub.publish) for _ in range(cfg["iters"])]
    pub.broadcast_to(bucket_bytes=cfg["bucket_bytes"])  # sends the layout and the current version
    ours, resent, theirs = [], [], []
    for _ in range(cfg["iters"]):  # interleaved, so all see the same machine
        ours.append(_timed(dist, device, pub.publish))
        resent.append(_timed(dist, device, lambda: pub._broadcast(pub.version)))  # the broadcast alone
        theirs.append(_timed(dist, device, lambda: dist.broadcast(raw, 0)))
    sub_conn.send("go")
    latency = []
    for _ in range(cfg["iters"]):
        dist.barrier()
        start = time.perf_counter()
        version = pub.publish()
        pulled, done = sub_conn.recv()
        assert pulled == version, (pulled, version)
        latency.append(done - start)
    sub_conn.send("stop")
    pub.close()
    out.put({"local": local, "publish": ours, "broadcast": resent, "raw_broadcast": theirs, "latency": latency,
             "bytes": pub.layout.total_bytes})
    kv_side(cfg, dist, 0, out)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- rank 1: relay / decode

def relay(cfg, attach_conn):
    from torch_ipc.weights import Relay

    dist, device = _init(cfg, 1), _device(cfg, 1)
    for _ in range(cfg["iters"]):
        _timed(dist, device, lambda: None)  # the trainer's local publishes
    r = Relay(src=0, device=device)
    r.attach(attach_conn)
    raw = torch.empty(r._publisher.layout.total_bytes, dtype=torch.uint8, device=device)
    r.receive()  # the version sent on joining
    for _ in range(cfg["iters"]):
        _timed(dist, device, r.receive)
        _timed(dist, device, r.receive)
        _timed(dist, device, lambda: dist.broadcast(raw, 0))
    for _ in range(cfg["iters"]):
        dist.barrier()
        r.receive()
    assert r.receive() is None  # the trainer closed
    kv_side(cfg, dist, 1, None)
    r.close()
    dist.destroy_process_group()


def subscriber(cfg, attach_conn, trainer_conn):
    from torch_ipc.weights import Subscriber

    device = _device(cfg, 1)
    sub = Subscriber(attach_conn, timeout=TIMEOUT)
    model = {k: torch.empty_like(v) for k, v in _state_dict(dict(cfg, tensors=cfg["tensors"]), device).items()}
    assert trainer_conn.recv() == "go"
    version = sub.latest
    while not trainer_conn.poll(0):
        try:
            version = sub.pull(model, newer_than=version, timeout=0.05)
        except TimeoutError:
            continue
        _sync(device)
        trainer_conn.send((version, time.perf_counter()))
    sub.close()


# ----------------------------------------------------------------------------- KV, both ranks

def kv_side(cfg, dist, rank, out):
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.kv.remote import recv_blocks, send_blocks

    device = _device(cfg, rank)
    shape, n = cfg["block_shape"], 256
    pool = SharedKVPool(2 * n, shape, torch.bfloat16, device)
    raw = torch.empty(n * pool.block_bytes, dtype=torch.uint8, device=device)
    if rank == 0:
        held = pool.allocate(2 * n)
        pool.scatter(held, torch.randn((2 * n, *shape), device=device).to(torch.bfloat16))
        scattered, run = random.Random(0).sample(held, n), held[n // 2 : n // 2 + n]
        send = lambda ids: send_blocks(pool, ids, 1, transfer=False, staging_bytes=cfg["staging_bytes"])  # noqa: E731
        raw_op = lambda: dist.send(raw, 1)  # noqa: E731
    else:
        scattered = run = None

        def send(_):
            handover = recv_blocks(pool, 0)
            pool.free(handover.ids)
        raw_op = lambda: dist.recv(raw, 0)  # noqa: E731
    ours, consecutive, theirs = [], [], []
    for _ in range(cfg["iters"]):
        ours.append(_timed(dist, device, lambda: send(scattered)))
        consecutive.append(_timed(dist, device, lambda: send(run)))
        theirs.append(_timed(dist, device, raw_op))
    if out is not None:
        out.put({"kv": ours, "kv_run": consecutive, "raw_kv": theirs, "kv_bytes": n * pool.block_bytes})
    pool.close()


# ----------------------------------------------------------------------------- main

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU-friendly), few iterations")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default=None, help="gloo (default on CPU) or nccl (default on CUDA)")
    parser.add_argument("--tensors", type=int, default=384)
    parser.add_argument("--tensor-kib", type=int, default=None)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--staging-mib", type=int, default=None, help="KV pieces (send_blocks' staging_bytes)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    cfg = {
        "device": args.device,
        "backend": args.backend or ("nccl" if args.device == "cuda" else "gloo"),
        "tensors": args.tensors,
        "tensor_kib": args.tensor_kib or (64 if args.quick else 4096),
        "bucket_bytes": args.bucket_mib << 20,
        "staging_bytes": (args.staging_mib or (4 if args.quick else 64)) << 20,
        "iters": args.iters or (5 if args.quick else 10),
        "block_shape": [2, 4, 16, 8, 64] if args.quick else [2, 32, 16, 8, 128],
        "url": "file://" + os.path.join(tempfile.mkdtemp(prefix="torch_ipc_dist_bench"), "rendezvous"),
    }
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    attach_relay, attach_sub = ctx.Pipe()
    trainer_end, sub_end = ctx.Pipe()
    procs = [ctx.Process(target=trainer, args=(cfg, trainer_end, out)),
             ctx.Process(target=relay, args=(cfg, attach_relay)),
             ctx.Process(target=subscriber, args=(cfg, attach_sub, sub_end))]
    for p in procs:
        p.start()
    try:
        results, parts, deadline = {}, 0, time.monotonic() + TIMEOUT
        while parts < 2 and time.monotonic() < deadline:  # the weights rows, then the KV rows
            try:
                results.update(out.get(timeout=1))
                parts += 1
            except queue.Empty:
                if any(p.exitcode for p in procs):
                    break  # one failed: its traceback is above
        for p in procs:
            p.join(max(1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    if parts < 2 or any(p.exitcode for p in procs):
        sys.exit(f"a process failed or timed out: exit codes {[p.exitcode for p in procs]}")
    print_table(cfg, results, args.json)


def print_table(cfg, r, json_path):
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    gib = lambda b, s: b / s / 2**30 * 1e3  # noqa: E731  (ms -> GiB/s)
    size = r["bytes"]
    rows = [
        ("broadcast to the relay's node", med(r["broadcast"]), med(r["raw_broadcast"]), size, ">= 90%"),
        ("publish + broadcast", med(r["publish"]), med(r["raw_broadcast"]), size, ""),
        ("  local publish alone", med(r["local"]), None, size, ""),
        ("latency publish -> remote pull", med(r["latency"]), med(r["raw_broadcast"]), size, ""),
        ("kv 256 blocks", med(r["kv"]), med(r["raw_kv"]), r["kv_bytes"], ">= 90%"),
        ("  kv 256 consecutive blocks", med(r["kv_run"]), med(r["raw_kv"]), r["kv_bytes"], ""),
    ]
    print(f"{cfg['device']}, {cfg['backend']}; state dict {cfg['tensors']} x {cfg['tensor_kib']} KiB = "
          f"{size / 2**20:.1f} MiB, buckets of {cfg['bucket_bytes'] >> 20} MiB; KV block {cfg['block_shape']} bf16; "
          f"medians of {cfg['iters']}")
    print(f"| {'row':32} | {'torch_ipc ms':>12} | {'GiB/s':>7} | {'raw ms':>8} | {'ratio':>6} | target |")
    print(f"|{'-' * 34}|{'-' * 14}|{'-' * 9}|{'-' * 10}|{'-' * 8}|--------|")
    for name, ours, raw, nbytes, target in rows:
        ratio = f"{raw / ours:.0%}" if raw else ""
        raw_text = f"{raw:.2f}" if raw else ""
        print(f"| {name:32} | {ours:12.2f} | {gib(nbytes, ours):7.2f} | {raw_text:>8} | {ratio:>6} | {target:6} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"config": cfg, "rows": [dict(zip(("row", "ms", "raw_ms", "bytes", "target"), row))
                                               for row in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
