#!/usr/bin/env python3
"""torch_ipc.kv.SharedKVPool against its floors, each measured in the same run.

    python benchmarks/kv_bench.py [--only handover,attach,gather,contention] [--pool-gib 40] [--json out.json]
    python benchmarks/kv_bench.py --quick                                # ~1 min on an H100
    python benchmarks/kv_bench.py --device cpu --only handover,gather   # no GPU: the CPU pool

Rows (medians; the ratio or difference against the floor, and the target):

handover  A writer process hands 256 block ids with its ordering signal to a
          reader (``pool.send`` / ``pool.recv`` over a torch_ipc Connection,
          the blocks taken over), which then reads one element of the first
          block (a device-to-host copy); timed by the reader from its "go" to
          the read's return. Floor: the same Connection's round trip with a
          message of the same size and no pool (the writer writes the same
          element before either reply), its rounds alternating with the
          hand-over's. Target: <= +30 us. Also shown:
          the read alone, so the hand-over's own cost is visible.
          --handover-settled (GPU): the same again with the writer's GPU
          work finished before it sends (both loops), so the event has
          completed when it arrives and the reader's stream waits on
          nothing: what the two runs differ by is the GPU side of the
          ordering (a stream wait on an interprocess event, Note
          [ordering without waiting] in csrc/cuda/events.cpp), the rest
          is the host's.
attach    A fresh process attaches to a pool of --pool-gib GiB (SharedPool
          memory, --attach-chunks allocations) and maps it: from
          ``SharedKVPool.attach`` to its return. Floor: the driver's own fd
          transfer (SCM_RIGHTS) + cuMemImportFromShareableHandle + reserve +
          cuMemMap + cuMemSetAccess of allocations of the same sizes, in
          another fresh process. Target: <= 1.5x.
gather    That process gathers 256 random blocks into one contiguous buffer
          (``pool.gather``); floor: one device copy of as many bytes. Target:
          >= 90% of the copy's bandwidth (bytes read + written per second).
          The row names the path gather took (``pool.copy_path``: the batched
          copy kernel, or index_select and why); also shown: the same gather
          through index_select (TORCH_IPC_KV_COPY=index_select), through the
          kernel with one item a block instead of items of at most 256 KiB
          (Note [block items] in torch_ipc/_batched_copy.py), and the host time of
          one gather call (building and queueing its copy). The gathered
          bytes are checked against index_select's.
          On a GPU, each path of TORCH_IPC_KV_COPY (Note [kv copies] in
          torch_ipc/kv/_copies.py) again, gather and scatter of the same 256
          blocks against the device copy: the kernel; the copy engines by one
          cuMemcpyBatchAsync (with the driver's overlap-with-compute hint,
          and without it) and by one cuMemcpyAsync per merged range;
          index_select. A path the driver could not take names the one taken.
contention
          GPU only. A loop of bf16 matmuls (8192^3, as many as take
          --contention-ms alone) on one stream and, on another stream of the
          same GPU, as many gathers of the 256 blocks as the fastest path
          does alone in that time, released together. Per path: the matmuls'
          time beside the gathers (x: their slowdown), one gather's time
          beside the matmuls (x: vs alone), and the time until both are done
          (x: vs running one after the other; below 1 the overlap pays).
          What Note [kv copy default] in torch_ipc/kv/_copies.py records.

--quick: a 4 GiB pool in one allocation, 40 iterations, a 100 ms matmul
loop (about a minute on an H100). Without CUDA the GPU rows are skipped
with a message; the rest runs on the CPU.

The block is [2, layers, block_size, heads, head_dim] = [2, 32, 16, 8, 128]
bfloat16 (2 MiB) unless --block-shape says otherwise.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMEOUT = 300
AUTHKEY = b"torch_ipc-kv-bench"
N_IDS = 256


def median_us(ns):
    return statistics.median(ns) / 1e3


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- hand-over


def handover_writer(address, data, block_shape, dtype, settle):
    import torch_ipc
    from torch_ipc.kv import SharedKVPool

    pool = SharedKVPool.attach(data, block_shape, dtype)
    with torch_ipc.connect(address, authkey=AUTHKEY) as conn:
        # The channel's own round trip: a message of the hand-over's size.
        plain = ("x" * 16, "y" * 30, 1, 2, 3, True, bytes(8 * N_IDS), b"e" * 90, None)
        ids = pool.allocate(N_IDS)
        while True:
            what = conn.recv()
            if what == b"end":
                break
            pool.block(ids[0]).view(-1)[:1].fill_(1)  # the writes the signal orders (the same for the floor)
            if settle:  # the event is complete when it arrives: the reader's stream waits for nothing
                sync(str(pool.device))
            if what == b"floor":
                conn.send(plain)
            else:
                pool.send(ids, conn)
                ids = pool.allocate(N_IDS)  # the next round's, while the reader works
    pool.close()


def bench_handover(args, device, dtype, block_shape, settle=False):
    import torch_ipc
    from torch_ipc.kv import SharedKVPool

    num_blocks = 8 * N_IDS  # in flight: the writer's next, the reader's, frees pending on the GPU
    pool = SharedKVPool(num_blocks, block_shape, dtype, device)
    data = torch_ipc.dumps(pool)
    ctx = mp.get_context("spawn")
    with torch_ipc.listen(authkey=AUTHKEY) as listener:
        writer = ctx.Process(
            target=handover_writer,
            args=(listener.address, data, block_shape, dtype, settle),
        )
        writer.start()
        try:
            conn = listener.accept()
            floor, handover, read = [], [], []
            # floor and hand-over alternate, so that a drift of the machine (clocks, other load)
            # between two loops does not show as the hand-over's cost
            for i in range(args.warmup + args.iters):
                t0 = time.perf_counter_ns()
                conn.send(b"floor")
                conn.recv()
                if i >= args.warmup:
                    floor.append(time.perf_counter_ns() - t0)
                t0 = time.perf_counter_ns()
                conn.send(b"go")
                got = pool.recv(conn)
                pool.block(got.ids[0]).view(-1)[0].item()  # the first read returns
                t1 = time.perf_counter_ns()
                pool.block(got.ids[1]).view(-1)[0].item()  # a read alone, for comparison
                t2 = time.perf_counter_ns()
                if i >= args.warmup:
                    handover.append(t1 - t0)
                    read.append(t2 - t1)
                pool.free(got.ids)
            conn.send(b"end")
            conn.close()
            writer.join(TIMEOUT)
        finally:
            if writer.is_alive():
                writer.kill()
    pool.close()
    f, h, r = median_us(floor), median_us(handover), median_us(read)
    name = "handover, writer synchronized first" if settle else "handover"
    return [
        row(f"{name}: channel round trip (floor)", f, "us"),
        row(f"{name}: {N_IDS} ids + signal until first read", h, "us", delta=h - f,
            **({} if settle else {"target": "<= +30 us", "ok": h - f <= 30})),
        row(f"{name}: one read alone (in the above)", r, "us"),
        row(f"{name}: own cost without the read", h - f - r, "us"),
    ]


# ----------------------------------------------------------------------------- attach and gather


def floor_consumer(sock, sizes, results):
    """The driver's open/map of allocations of `sizes` bytes, fds from the producer."""
    from vmm_floor import POSIX_FD, Driver

    cu = Driver()
    prop, access = cu.prop(), cu.access()
    gran = ctypes.c_size_t()
    cu("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
    sock.sendall(b"go")
    t0 = time.perf_counter_ns()
    fds = []
    while len(fds) < len(sizes):
        _, got, _, _ = socket.recv_fds(sock, 16, 250)
        fds += got
    handles, mapped = [], []
    for fd, size in zip(fds, sizes):
        h = ctypes.c_ulonglong()
        cu("cuMemImportFromShareableHandle", ctypes.byref(h), ctypes.c_void_p(fd), POSIX_FD)
        os.close(fd)
        va = ctypes.c_ulonglong()
        cu("cuMemAddressReserve", ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(gran.value),
           ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
        cu("cuMemMap", va, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0))
        cu("cuMemSetAccess", va, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1))
        handles.append(h)
        mapped.append((va, size))
    elapsed = time.perf_counter_ns() - t0
    for (va, size), h in zip(mapped, handles):
        cu("cuMemUnmap", va, ctypes.c_size_t(size))
        cu("cuMemRelease", h)
        cu("cuMemAddressFree", va, ctypes.c_size_t(size))
    results.put(elapsed)


def measure_floor(sizes):
    """Create allocations of `sizes` with cuMemCreate, time a fresh process's open/map, free them."""
    from vmm_floor import POSIX_FD, Driver

    cu = Driver()
    prop = cu.prop()
    gran = ctypes.c_size_t()
    cu("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
    sizes = [(s + gran.value - 1) // gran.value * gran.value for s in sizes]
    handles = []
    for size in sizes:
        h = ctypes.c_ulonglong()
        cu("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
        handles.append(h)
    ctx = mp.get_context("spawn")
    ours, theirs = socket.socketpair()
    results = ctx.Queue()
    child = ctx.Process(target=floor_consumer, args=(theirs, sizes, results))
    child.start()
    try:
        ours.settimeout(TIMEOUT)
        ours.recv(2)
        fds = []
        for h in handles:
            fd = ctypes.c_int(-1)
            cu("cuMemExportToShareableHandle", ctypes.byref(fd), h, POSIX_FD, ctypes.c_ulonglong(0))
            fds.append(fd.value)
        for i in range(0, len(fds), 250):
            socket.send_fds(ours, [b"f"], fds[i:i + 250])
        for fd in fds:
            os.close(fd)
        elapsed = results.get(timeout=TIMEOUT)
        child.join(TIMEOUT)
    finally:
        if child.is_alive():
            child.kill()
        for h in handles:
            cu("cuMemRelease", h)
    return elapsed


def timed(fn, device, iters):
    """Median ns of fn() with the device drained after each call."""
    fn()
    sync(device)
    ns = []
    for _ in range(iters):
        t = time.perf_counter_ns()
        fn()
        sync(device)
        ns.append(time.perf_counter_ns() - t)
    return statistics.median(ns)


def host_ns(fn, device, iters):
    """Median ns the host spends in fn() (building and queueing its work)."""
    ns = []
    for _ in range(iters):
        sync(device)
        t = time.perf_counter_ns()
        fn()
        ns.append(time.perf_counter_ns() - t)
    sync(device)
    return statistics.median(ns)


# The copy paths the GPU rows compare: (label, TORCH_IPC_KV_COPY, copy-engine knobs of torch_ipc.kv._copies).
ENGINE = ("copy_engine", "copy_engine", {})
PATHS = [
    ("kernel", "kernel", {}),
    ENGINE,
    ("copy_engine, no overlap hint", "copy_engine", {"ENGINE_PREFER_OVERLAP": False}),
    ("copy_engine, cuMemcpyAsync per range", "copy_engine", {"ENGINE_BATCH": False}),
    ("index_select", "index_select", {}),
]


class CopyPath:
    """`with CopyPath(path):` gathers and scatters take that path of PATHS."""

    def __init__(self, path):
        self.method, self.knobs = path[1], path[2]

    def __enter__(self):
        from torch_ipc.kv import _copies

        self.saved = {k: getattr(_copies, k) for k in self.knobs}
        for k, v in self.knobs.items():
            setattr(_copies, k, v)
        os.environ["TORCH_IPC_KV_COPY"] = self.method

    def __exit__(self, *exc):
        from torch_ipc.kv import _copies

        for k, v in self.saved.items():
            setattr(_copies, k, v)
        del os.environ["TORCH_IPC_KV_COPY"]


def same_bytes(a, b):
    return torch.equal(a.view(a.shape[0], -1).view(torch.uint8), b.view(b.shape[0], -1).view(torch.uint8))


def gather_paths(pool, ids, out, device, iters):
    """Each GPU path's gather and scatter of `ids` (ns), and whether its gather's bytes are index_select's.
    The scatters write back the bytes the blocks hold (`ids` are distinct)."""
    with CopyPath(PATHS[-1]):
        want = pool.gather(ids)
    got = {}
    for path in PATHS:
        with CopyPath(path):
            gather_ns = timed(lambda: pool.gather(ids, out=out), device, iters)
            same = same_bytes(out, want)
            scatter_ns = timed(lambda: pool.scatter(ids, want), device, iters)
            host = host_ns(lambda: pool.gather(ids, out=out), device, iters)
            got[path[0]] = {"gather_ns": gather_ns, "scatter_ns": scatter_ns, "host_ns": host, "same": same,
                            "copy_path": pool.copy_path}
    return got


def attach_and_gather(data, block_shape, dtype, num_blocks, gather_iters, contention_ms, results):
    import torch_ipc  # noqa: F401
    from torch_ipc.kv import SharedKVPool

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.zeros(1, device=device)  # the context, before timing
    t0 = time.perf_counter_ns()
    pool = SharedKVPool.attach(data, block_shape, dtype)
    attach_ns = time.perf_counter_ns() - t0
    device = str(pool.device)
    rng = random.Random(0)
    ids = rng.sample(range(num_blocks), N_IDS)
    out = torch.empty((N_IDS, *block_shape), dtype=dtype, device=device)
    src = torch.empty_like(out)
    dst = torch.empty_like(out)
    r = {"attach_ns": attach_ns, "nbytes": out.numel() * out.element_size()}
    r["gather_ns"] = timed(lambda: pool.gather(ids, out=out), device, gather_iters)
    r["path"] = pool.copy_path
    r["gather_host_ns"] = host_ns(lambda: pool.gather(ids, out=out), device, gather_iters)
    # The kernel with items of at most ITEM_BYTES (Note [block items]), for comparison.
    from torch_ipc import _batched_copy

    largest, _batched_copy.LARGEST_ITEM = _batched_copy.LARGEST_ITEM, 1 << 62
    saved, _batched_copy.ITEM_BYTES = _batched_copy.ITEM_BYTES, 1 << 62
    r["block_items_ns"] = timed(lambda: pool.gather(ids, out=out), device, gather_iters)
    _batched_copy.LARGEST_ITEM, _batched_copy.ITEM_BYTES = largest, saved
    r["copy_ns"] = timed(lambda: dst.copy_(src), device, gather_iters)
    with CopyPath(PATHS[-1]):
        r["index_select_ns"] = timed(lambda: pool.gather(ids, out=dst), device, gather_iters)
    r["same"] = same_bytes(out, dst)
    if device.startswith("cuda"):
        r["paths"] = gather_paths(pool, ids, out, device, gather_iters)
        if contention_ms:
            r["contention"] = contention(pool, ids, out, contention_ms, gather_iters)
    pool.close()
    results.put(r)


# ----------------------------------------------------------------------------- contention


MATMUL_N = 8192


def run_together(matmul, matmuls, copy, copies):
    """Queue `matmuls` matmul() on one stream and `copies` copy() on another,
    both released at once by one event; ms of (the matmuls, the copies, both
    from the release to the last one's end)."""
    mm_stream, cp_stream = torch.cuda.Stream(), torch.cuda.Stream()
    go, mm_start, mm_end, cp_start, cp_end = (torch.cuda.Event(enable_timing=True) for _ in range(5))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s: the host queues everything below meanwhile
    go.record()
    for stream, start, end, fn, n in ((mm_stream, mm_start, mm_end, matmul, matmuls),
                                      (cp_stream, cp_start, cp_end, copy, copies)):
        with torch.cuda.stream(stream):
            stream.wait_event(go)
            start.record()
            for _ in range(n):
                fn()
            end.record()
    torch.cuda.synchronize()
    return (mm_start.elapsed_time(mm_end), cp_start.elapsed_time(cp_end),
            max(go.elapsed_time(mm_end), go.elapsed_time(cp_end)))


def contention(pool, ids, out, window_ms, iters):
    """Each path's gathers while a bf16 matmul loop runs on the same GPU
    (another stream): the matmuls' and the copies' times alone and together.
    As many matmuls as take ~window_ms alone; as many gathers as the fastest
    path does alone in that time, the same for every path."""
    a, b = (torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    c = torch.empty_like(a)

    def matmul():
        torch.matmul(a, b, out=c)

    def gather():
        pool.gather(ids, out=out)

    run_together(matmul, 3, gather, 0)  # warm: cuBLAS picks its kernel
    one_ms = statistics.median(run_together(matmul, 5, gather, 0)[0] / 5 for _ in range(3))
    matmuls = max(5, int(window_ms / one_ms))
    matmul_alone = statistics.median(run_together(matmul, matmuls, gather, 0)[0] for _ in range(3))
    rough = {}
    for path in PATHS:
        with CopyPath(path):
            run_together(matmul, 0, gather, 2)
            rough[path[0]] = run_together(matmul, 0, gather, 8)[1] / 8
    copies = max(4, int(matmul_alone / min(rough.values())))
    got = {"matmul_n": MATMUL_N, "matmuls": matmuls, "matmul_alone_ms": matmul_alone, "copies": copies}
    for path in PATHS:
        with CopyPath(path):
            # Once first: the caching host allocator then holds a pinned table (index) for each
            # gather in flight; making one waits for the device (Note [kv copies]).
            run_together(matmul, 0, gather, copies)
            alone = run_together(matmul, 0, gather, copies)[1] / copies
            runs = [run_together(matmul, matmuls, gather, copies) for _ in range(max(1, min(3, iters // 8)))]
        mm, cp, both = (statistics.median(x) for x in zip(*runs))
        got[path[0]] = {"copy_alone_ms": alone, "matmul_ms": mm, "copy_ms": cp / copies, "both_ms": both}
    return got


def release_pool_memory(device: str) -> None:
    """Give the closed pool's memory back before the next size is made: the
    reader's release of the export reaches us through the collector, which
    collect() runs now; 40 GiB twice does not fit an 80 GB GPU."""
    import torch_ipc

    gc.collect()
    deadline = time.monotonic() + TIMEOUT
    while True:
        torch_ipc.collect(close_idle=True)
        if device != "cuda":
            return
        torch.cuda.empty_cache()
        if torch_ipc.stats()["vmm_pool_bytes"] == 0 or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def bench_attach_gather(args, device, dtype, block_shape, only):
    import torch_ipc
    from torch_ipc.kv import SharedKVPool

    block_bytes = torch.empty(block_shape, dtype=dtype, device="meta").numel() * dtype.itemsize
    num_blocks = max(N_IDS, int(args.pool_gib * 2**30) // block_bytes)
    rows = []
    ctx = mp.get_context("spawn")
    for chunks in [int(c) for c in args.attach_chunks.split(",")] if "attach" in only else [1]:
        first_run = chunks == int(args.attach_chunks.split(",")[0]) or "attach" not in only
        per_chunk = -(-num_blocks // chunks)
        sizes = [min(per_chunk, num_blocks - first) * block_bytes for first in range(0, num_blocks, per_chunk)]
        floor_ns = measure_floor(sizes) if device == "cuda" and "attach" in only else None
        pool = SharedKVPool(num_blocks, block_shape, dtype, device, blocks_per_chunk=per_chunk)
        sync(device)
        results = ctx.Queue()
        contention_ms = args.contention_ms if "contention" in only and first_run and device == "cuda" else 0
        child = ctx.Process(
            target=attach_and_gather,
            args=(torch_ipc.dumps(pool), block_shape, dtype, num_blocks, args.iters // 4 or 1, contention_ms,
                  results),
        )
        child.start()
        try:
            r = results.get(timeout=TIMEOUT)
            child.join(TIMEOUT)
        finally:
            if child.is_alive():
                child.kill()
        pool.close()
        del pool
        release_pool_memory(device)
        gib = num_blocks * block_bytes / 2**30
        if "attach" in only:
            rows += attach_rows(f"attach: {gib:.1f} GiB in {len(sizes)} allocation(s)", r["attach_ns"], floor_ns)
        if "gather" in only and first_run:
            rows += gather_rows(r)
        if "contention" in r:
            rows += contention_rows(r["contention"])
    return rows


def attach_rows(label, attach_ns, floor_ns):
    if floor_ns is None:
        return [row(label, attach_ns / 1e6, "ms")]
    return [row(label + " (driver floor)", floor_ns / 1e6, "ms"),
            row(label, attach_ns / 1e6, "ms", ratio=attach_ns / floor_ns, target="<= 1.5x",
                ok=attach_ns <= 1.5 * floor_ns)]


def gather_rows(r):
    nbytes, path, same = r["nbytes"], r["path"], r["same"]
    copy_bw = 2 * nbytes / r["copy_ns"]  # bytes read + written per ns

    def bw(ns):
        return 2 * nbytes / ns

    rows = [row(f"gather: device copy of {nbytes / 2**20:.0f} MiB (floor)", copy_bw, "GB/s"),
            row(f"gather: {N_IDS} random blocks into one buffer [{path}]", bw(r["gather_ns"]), "GB/s",
                ratio=bw(r["gather_ns"]) / copy_bw, target=">= 0.9x", ok=same and bw(r["gather_ns"]) >= 0.9 * copy_bw),
            row("gather: the same through index_select", bw(r["index_select_ns"]), "GB/s",
                ratio=bw(r["index_select_ns"]) / copy_bw)]
    if path == "kernel":
        rows.append(row("gather: the same, kernel items of one block", bw(r["block_items_ns"]), "GB/s",
                        ratio=bw(r["block_items_ns"]) / copy_bw))
    rows.append(row("gather: host time of one call (no sync)", r["gather_host_ns"] / 1e3, "us"))
    if not same:
        rows.append(row("gather: MISMATCH against index_select's bytes", 0, "", ok=False))
    for label, p in r.get("paths", {}).items():
        shown = label if p["copy_path"].startswith(label.split(",")[0]) else f"{label}: took {p['copy_path']}"
        rows.append(row(f"gather [{shown}]", bw(p["gather_ns"]), "GB/s", ratio=bw(p["gather_ns"]) / copy_bw,
                        ok=None if p["same"] else False))
        rows.append(row(f"scatter [{shown}]", bw(p["scatter_ns"]), "GB/s", ratio=bw(p["scatter_ns"]) / copy_bw))
        rows.append(row(f"gather [{label}]: host time of one call", p["host_ns"] / 1e3, "us"))
    return rows


def contention_rows(c):
    alone = c["matmul_alone_ms"]
    rows = [row(f"contention: {c['matmuls']} bf16 matmuls {c['matmul_n']}^3 alone (floor; "
                f"{c['copies']} gathers beside them)", alone, "ms")]
    for label, p in ((k, v) for k, v in c.items() if isinstance(v, dict)):
        serial = alone + c["copies"] * p["copy_alone_ms"]
        rows += [
            row(f"contention [{label}]: the matmuls beside the gathers", p["matmul_ms"], "ms",
                ratio=p["matmul_ms"] / alone),
            row(f"contention [{label}]: one gather beside the matmuls", p["copy_ms"], "ms",
                ratio=p["copy_ms"] / p["copy_alone_ms"]),
            row(f"contention [{label}]: all done (vs one after the other)", p["both_ms"], "ms",
                ratio=p["both_ms"] / serial),
        ]
    return rows


# ----------------------------------------------------------------------------- report


def row(name, value, unit, *, delta=None, ratio=None, target=None, ok=None):
    return {"name": name, "value": value, "unit": unit, "delta": delta, "ratio": ratio, "target": target, "ok": ok}


def print_rows(rows):
    width = max([58] + [len(r["name"]) + 2 for r in rows])
    print(f"{'measurement':<{width}}{'value':>14}  {'vs floor':>12}  target")
    for r in rows:
        vs = ""
        if r["delta"] is not None:
            vs = f"{r['delta']:+.1f} {r['unit']}"
        elif r["ratio"] is not None:
            vs = f"{r['ratio']:.2f}x"
        verdict = "" if r["ok"] is None else ("ok" if r["ok"] else "MISSED")
        print(f"{r['name']:<{width}}{r['value']:>10.2f} {r['unit']:<4}  {vs:>12}  {r['target'] or ''} {verdict}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="handover,attach,gather,contention")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pool-gib", type=float, default=40.0)
    ap.add_argument("--attach-chunks", default="1,40", help="allocations of the attach pool, one run each")
    ap.add_argument("--block-shape", default="2,32,16,8,128")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--contention-ms", type=float, default=400.0, help="the matmul loop's length alone")
    ap.add_argument("--quick", action="store_true",
                    help="a 4 GiB pool in one allocation, 40 iterations, a 100 ms matmul loop (~1 min on an H100)")
    ap.add_argument("--handover-settled", action="store_true",
                    help="the hand-over again with the writer's GPU work finished before it sends (no stream wait)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.quick:
        args.pool_gib, args.attach_chunks, args.iters, args.warmup = 4.0, "1", 40, 5
        args.contention_ms = 100.0
    only = set(args.only.split(","))
    device = args.device
    dtype = getattr(torch, args.dtype)
    block_shape = tuple(int(s) for s in args.block_shape.split(","))
    if device == "cpu":
        only.discard("attach")  # the floor is the CUDA driver's
        args.pool_gib = min(args.pool_gib, 1.0)
        if only & {"gather", "contention"}:
            print("no CUDA: the copy-engine and kernel rows and the contention rows are skipped (they need a GPU)")
        only.discard("contention")
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
          + f"; block {list(block_shape)} {args.dtype}")
    rows = []
    if "handover" in only:
        rows += bench_handover(args, device, dtype, block_shape)
        if args.handover_settled and device.startswith("cuda"):
            rows += bench_handover(args, device, dtype, block_shape, settle=True)
    if only & {"attach", "gather", "contention"}:
        rows += bench_attach_gather(args, device, dtype, block_shape, only)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "block_shape": block_shape, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
