#!/usr/bin/env python3
"""Where one version of the sharded two-node pull goes: a timeline of each rank.

    python benchmarks/sharded_timeline.py                      # 2 GPUs, sharded_bench.py's model
    python benchmarks/sharded_timeline.py "{'item': 1048576}" "{'ramp': 1}"   # variants, one run each

Trainer rank 0 on GPU 0, engine rank 1 on GPU 1, one NCCL group, the model of
sharded_bench.py (105 bf16 tensors, 1.5 GB). Eight versions; the median time
per version of each rank, then the marks of the last one: host marks
(milliseconds since both ranks left a barrier: publish(), each batch posted,
each pack or unpack queued, each wait) and GPU marks (CUDA events recorded on
the current stream after each transfer is ordered there and after each copy,
against an event recorded at the barrier). Host marks of the two ranks share
a clock (CLOCK_MONOTONIC); GPU marks are per GPU.

A variant is a dict of knobs: 'ramp' (_shard_plan.RAMP), 'bucket' (MiB),
'inflight' (IN_FLIGHT), 'poll' (ROUND_POLL_SLEEP, seconds), 'item' (the
copy kernel's ITEM_BYTES), 'beside' (BESIDE_TRANSFERS, 0: every SM).
It measures through private hooks of torch_ipc.weights: a diagnostic for
the library's maintainers, not an API.
"""
from __future__ import annotations

import ast
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VERSIONS = 8
TIMEOUT = 200


def _knobs(variant):
    from torch_ipc import _batched_copy
    from torch_ipc.weights import _copy, _shard_plan
    from torch_ipc.weights import _shard_remote as sr

    _shard_plan.RAMP = variant.get("ramp", _shard_plan.RAMP)
    sr.IN_FLIGHT = variant.get("inflight", sr.IN_FLIGHT)
    sr.ROUND_POLL_SLEEP = variant.get("poll", sr.ROUND_POLL_SLEEP)
    _batched_copy.ITEM_BYTES = variant.get("item", _batched_copy.ITEM_BYTES)
    _copy.BESIDE_TRANSFERS = variant.get("beside", _copy.BESIDE_TRANSFERS)
    sr.BESIDE_TRANSFERS = _copy.BESIDE_TRANSFERS


class Marks:
    """Host and GPU marks of the version being traced."""

    def __init__(self):
        self.on, self.host, self.gpu = False, [], []

    def mark(self, label):
        if self.on:
            self.host.append((time.monotonic(), label))

    def gmark(self, label):
        if self.on:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.gpu.append((event, label))


def _hook(marks):
    """Wrap the points of the sharded protocol that the timeline marks."""
    from torch_ipc import _dist
    from torch_ipc.weights import _shard_remote as sr
    from torch_ipc.weights._copy import BatchedCopy

    post, run, wait, finish = sr._post, BatchedCopy.run, sr._Waits.wait, _dist.finish

    def posted(transport, ops):
        marks.mark(f"post {len(ops)} ops, {sum(t.numel() * t.element_size() for _, t, _ in ops) >> 20} MiB")
        works = post(transport, ops)
        marks.mark("  posted")
        return works

    def ran(self):
        marks.mark("copy queued")
        run(self)
        marks.gmark("copy done")

    def waited(self, works, ops, ordered=True):
        wait(self, works, ops, ordered)
        marks.gmark(f"{ops[0][0]} done")

    def finished(*args, **kwargs):
        marks.mark("wait")
        result = finish(*args, **kwargs)
        marks.mark("  waited")
        return result

    sr._post, BatchedCopy.run, sr._Waits.wait, _dist.finish = posted, ran, waited, finished


def rank_main(rank, url, variant, out):
    import sharded_bench as sb

    from torch_ipc.weights import ShardedPublisher, ShardedSubscriber

    _knobs(variant)
    marks = Marks()
    _hook(marks)
    cfg = {"device": "cuda", "layers": 15, "hidden": 2048, "ffn": 5632, "dtype": torch.bfloat16}
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=url, rank=rank, world_size=2, device_id=device,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    bucket = variant.get("bucket", 256) << 20
    if rank == 0:
        pub = ShardedPublisher(sb.trainer_shards(cfg, 0, 1, device), rank=0)
        pub.send_to(trainers=[0], engines=[1], bucket_bytes=bucket)
        step, name = pub.publish, "trainer"
    else:
        model = sb.engine_model(cfg, 0, 1, device)
        sub = ShardedSubscriber.remote(model, trainers=[0], engines=[1], wants=sb.engine_wants(cfg, 0, 1))
        step, name = sub.pull, "engine"
    times = []
    for i in range(VERSIONS):
        marks.on = i == VERSIONS - 1
        marks.host.clear()
        marks.gpu.clear()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.monotonic()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        marks.mark("returned")
        torch.cuda.synchronize()
        times.append((time.monotonic() - t0) * 1e3)
    lines = [f"rank {rank} ({name}): median {statistics.median(times[2:]):.3f} ms a version"]
    lines += [f"  host {1e3 * (t - t0):7.3f} ms  {label}" for t, label in marks.host]
    lines += [f"  gpu  {start.elapsed_time(e):7.3f} ms  {label}" for e, label in marks.gpu]
    out.put((rank, lines))
    if rank == 0:
        pub.close()
    dist.destroy_process_group()


def main():
    if torch.cuda.device_count() < 2:
        sys.exit("sharded_timeline.py needs two CUDA GPUs")
    variants = [ast.literal_eval(v) for v in sys.argv[1:]] or [{}]
    ctx = mp.get_context("spawn")
    for variant in variants:
        out = ctx.Queue()
        url = "file://" + os.path.join(tempfile.mkdtemp(prefix="torch_ipc_timeline"), "rdzv")
        procs = [ctx.Process(target=rank_main, args=(r, url, variant, out)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            got = dict(out.get(timeout=TIMEOUT) for _ in procs)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        print(f"=== variant {variant}")
        for r in sorted(got):
            print("\n".join(got[r]), flush=True)


if __name__ == "__main__":
    main()
