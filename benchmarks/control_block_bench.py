#!/usr/bin/env python3
"""The cost of the two shared control blocks, on the CPU, in one process
(Note [two control blocks] in torch_ipc/weights/_control.py).

Rows (median of --samples, each the mean over --calls calls, in microseconds):
    counter_load, counter_store, counter_compare_exchange
                     one seq_cst atomic on the weights control block, one
                     Python call each
    pull protocol    a direct-mode pull's whole handshake, as Subscriber.pull
                     runs it: READING = 1, WRITING?, PUBLISHED, READING = 0,
                     PULLS += 1 (six calls)
    publish protocol publish()'s handshake with one subscriber slot: WRITING,
                     the slot's OWNER and READING, PUBLISHED, WRITING (five calls)
    kv allocate+free one block taken and given back on a KV pool's block
                     table: two calls, each under its robust mutex
    pull, 1 tensor   Subscriber.pull of one 4-float tensor, end to end

Usage:
    python benchmarks/control_block_bench.py [--calls 20000] [--samples 15]
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import struct
import sys
import time

import torch

try:  # the installed torch_ipc, else the one of this checkout (built in place)
    import torch_ipc
except ImportError:
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
    import torch_ipc
from torch_ipc import _C
from torch_ipc.weights import _control as ctl


def per_call_us(fn, calls: int, samples: int, per: int = 1) -> float:
    """Median over samples of the mean time of one fn() call, divided by `per`."""
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls / per * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--samples", type=int, default=15)
    args = parser.parse_args()
    calls, samples = args.calls, args.samples

    block = ctl.new_block(8)
    torch_ipc.dumps(block)  # moves it into shared memory, as the publisher's first attach does
    c = ctl.Counters(block)
    reading, pulls = ctl.slot_index(0, ctl.READING), ctl.slot_index(0, ctl.PULLS)
    owner = ctl.slot_index(0, ctl.OWNER)

    def pull_protocol():
        c.store(reading, 1)
        if not c.load(ctl.WRITING):
            c.load(ctl.PUBLISHED)
        c.store(reading, 0)
        c.store(pulls, c.load(pulls) + 1)

    def publish_protocol():
        c.store(ctl.WRITING, 1)
        c.load(owner)
        c.load(reading)
        c.store(ctl.PUBLISHED, 1)
        c.store(ctl.WRITING, 0)

    allocator = _C.BlockAllocator.create([4], torch.float32, 64)  # the C++ of torch_ipc.kv, without its Python
    allocator.add_chunk(64, torch_ipc.dumps(torch.zeros(64, 4), consumers=None))

    def kv_allocate_free():
        (block_id,) = allocator.allocate(1)
        allocator.free(struct.pack("<q", block_id))

    pub = torch_ipc.weights.Publisher({"w": torch.zeros(4)}, max_subscribers=1)
    a, b = multiprocessing.Pipe()
    pub.attach(a)
    sub = torch_ipc.weights.Subscriber(b)
    model = {"w": torch.zeros(4)}
    pub.publish()

    rows = [
        ("counter_load", per_call_us(lambda: _C.counter_load(block, 1), calls, samples)),
        ("counter_store", per_call_us(lambda: _C.counter_store(block, 2, 0), calls, samples)),
        ("counter_compare_exchange", per_call_us(lambda: _C.counter_compare_exchange(block, 2, 0, 0), calls, samples)),
        ("pull protocol (6 calls)", per_call_us(pull_protocol, calls, samples)),
        ("publish protocol (5 calls)", per_call_us(publish_protocol, calls, samples)),
        ("kv allocate+free (2 calls)", per_call_us(kv_allocate_free, calls // 4, samples)),
        ("pull, 1 tensor, end to end", per_call_us(lambda: sub.pull(model), calls // 4, samples)),
    ]
    allocator.detach()
    allocator.unlink()
    sub.close()
    pub.close()
    print(f"| operation | us (median of {samples}) |")
    print("| --- | --- |")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
