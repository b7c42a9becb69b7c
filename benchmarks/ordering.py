#!/usr/bin/env python3
"""How a consumer's stream can wait for a producer's writes, and what each way costs.

Two spawned processes share one 4 KiB CUDA tensor (once, before timing). In
each round the producer writes the round's number into the tensor on its
stream, signals through the way under test, and sends the number through a
Pipe; the consumer orders its stream after the signal, reads the tensor
(``x[0].item()``, the consumer's first read) and checks the value. Timed on
the consumer, from receiving the message to the read's result: the median in
microseconds.

Ways (rows):
    none           no ordering at all (reads may be stale: shown as a count)
    event_wait     stream.wait_event(ipc event), always
    event_query    query the ipc event; stream wait only when it has not completed
    event_sync     the host waits on the ipc event (cuEventSynchronize)
    value_host     cuStreamWriteValue32 / cuStreamWaitValue32 on shared host memory
    value_device   cuStreamWriteValue32 / cuStreamWaitValue32 on the shared device memory
    torch_ipc      torch_ipc.IpcEvent.wait (what torch_ipc does)
Each runs twice: "idle" (the producer's writes are done before the message
leaves) and "busy" (the producer queues ~200 us of GPU work before its write,
so the consumer really has to wait).

Usage: python benchmarks/ordering.py [--iters N]
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

WAYS = ("none", "event_wait", "event_query", "event_sync", "value_host", "value_device", "torch_ipc")
CU_STREAM_WAIT_VALUE_GEQ = 0
CU_MEMHOSTREGISTER_PORTABLE, CU_MEMHOSTREGISTER_DEVICEMAP = 1, 2
BUSY_CYCLES = 400_000  # torch.cuda._sleep: ~200 us on a 2 GHz GPU


class Driver:
    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def fn(self, *names):
        for n in names:
            f = getattr(self.lib, n, None)
            if f is not None:
                return f
        raise RuntimeError(f"no {names[0]} in libcuda")

    def check(self, name, r):
        if r != 0:
            raise RuntimeError(f"{name} failed: CUresult {r}")

    def host_register(self, buf) -> int:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self.check("cuMemHostRegister", self.fn("cuMemHostRegister_v2", "cuMemHostRegister")(
            ctypes.c_void_p(addr), ctypes.c_size_t(len(buf)),
            ctypes.c_uint(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)))
        dptr = ctypes.c_uint64()
        self.check("cuMemHostGetDevicePointer", self.fn("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")(
            ctypes.byref(dptr), ctypes.c_void_p(addr), ctypes.c_uint(0)))
        return dptr.value

    def write_value(self, stream, dptr, value):
        self.check("cuStreamWriteValue32", self.fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32")(
            ctypes.c_void_p(stream), ctypes.c_uint64(dptr), ctypes.c_uint32(value), ctypes.c_uint(0)))

    def wait_value(self, stream, dptr, value):
        self.check("cuStreamWaitValue32", self.fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32")(
            ctypes.c_void_p(stream), ctypes.c_uint64(dptr), ctypes.c_uint32(value),
            ctypes.c_uint(CU_STREAM_WAIT_VALUE_GEQ)))


def shared_page(path: str, create: bool):
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    if create:
        os.ftruncate(fd, 4096)
    buf = mmap.mmap(fd, 4096)
    os.close(fd)
    return buf


def producer(conn, path, iters, busy):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import faulthandler

    import torch_ipc
    from torch.multiprocessing.reductions import reduce_tensor

    faulthandler.enable()

    drv = Driver()
    torch.cuda.init()
    x = torch.zeros(1024, dtype=torch.int32, device="cuda")  # data; x[512]: the device-side value word
    torch.cuda.synchronize()
    ev = torch.cuda.Event(interprocess=True, blocking=False)
    ipc_ev = torch_ipc.IpcEvent()
    page = shared_page(path, create=True)
    host_word = drv.host_register(page)
    conn.send((reduce_tensor(x), bytes(ev.ipc_handle()), ipc_ev))
    ready = conn.recv()
    if ready is not None:
        print(f"consumer failed:\n{ready[1]}", file=sys.stderr, flush=True)
        return
    stream = torch.cuda.current_stream().cuda_stream
    seq = 0
    for way in WAYS:
        for _ in range(iters):
            seq += 1
            if busy:
                torch.cuda._sleep(BUSY_CYCLES)
            x[0].fill_(seq)
            if way.startswith("event"):
                ev.record()
            elif way == "value_host":
                drv.write_value(stream, host_word, seq)
            elif way == "value_device":
                drv.write_value(stream, x.data_ptr() + 512 * 4, seq)
            elif way == "torch_ipc":
                ipc_ev.record()
            if not busy:
                torch.cuda.synchronize()
            conn.send(seq)
            conn.recv()
        torch.cuda.synchronize()
    conn.send(None)


def consumer(conn, path, iters):
    import faulthandler
    import traceback

    faulthandler.enable()
    try:
        consume(conn, path, iters)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        raise


def consume(conn, path, iters):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch_ipc  # noqa: F401

    drv = Driver()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    (rebuild, args), handle, ipc_ev = conn.recv()
    x = rebuild(*args)
    ev = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)
    page = shared_page(path, create=False)
    host_word = drv.host_register(page)
    conn.send(None)
    s = torch.cuda.current_stream()
    stream = s.cuda_stream
    out = {}
    for way in WAYS:
        times, stale = [], 0
        for _ in range(iters):
            seq = conn.recv()
            t0 = time.perf_counter_ns()
            if way == "event_wait":
                s.wait_event(ev)
            elif way == "event_query":
                if not ev.query():
                    s.wait_event(ev)
            elif way == "event_sync":
                ev.synchronize()
            elif way == "value_host":
                drv.wait_value(stream, host_word, seq)
            elif way == "value_device":
                drv.wait_value(stream, x.data_ptr() + 512 * 4, seq)
            elif way == "torch_ipc":
                ipc_ev.wait()
            v = x[0].item()
            times.append(time.perf_counter_ns() - t0)
            stale += v != seq
            conn.send(None)
        out[way] = (statistics.median(times[len(times) // 10:]) / 1e3, stale)
    assert conn.recv() is None
    conn.send(out)


def run(iters: int, busy: bool) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    path = f"/dev/shm/torch_ipc_ordering_bench.{os.getpid()}"
    procs = [ctx.Process(target=producer, args=(a, path, iters, busy), daemon=True),
             ctx.Process(target=consumer, args=(b, path, iters), daemon=True)]
    procs[0].start()
    time.sleep(0.5)  # the producer creates the shared page
    procs[1].start()
    try:
        if not a.poll(300):
            raise TimeoutError("the ordering benchmark did not finish in 300 s")
        return a.recv()
    finally:
        for p in procs:
            p.kill()
            p.join(5)
        if os.path.exists(path):
            os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/ordering.py measures CUDA stream ordering: it needs a CUDA GPU, and torch here has none.")
        return 2
    rows = {mode: run(args.iters, busy=mode == "busy") for mode in ("idle", "busy")}
    print(f"Ordering a consumer's first read after a producer's write ({torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}): median us from message to read result; stale reads counted")
    print(f"{'way':<14}{'idle us':>10}{'stale':>7}{'busy us':>10}{'stale':>7}")
    for way in WAYS:
        (ti, si), (tb, sb) = rows["idle"][way], rows["busy"][way]
        print(f"{way:<14}{ti:>10.1f}{si:>7}{tb:>10.1f}{sb:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
