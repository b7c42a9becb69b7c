#!/usr/bin/env python3
"""How the CUDA driver's legacy IPC calls scale with threads: the floor under
bench.py's sd_first row (Note [opening many allocations] in csrc/memory/legacy_ipc_memory.cpp).

A producer makes N allocations of one size with cuMemAlloc and exports them
(cuIpcGetMemHandle, 1 and 4 threads); a spawned consumer opens all N handles
(cuIpcOpenMemHandle) from 1, 2, 4, 8 and 16 threads, closes them, and again.
It also counts the base allocations torch's caching allocator makes for the
same tensors (what torch_ipc opens: one per base allocation).

    python benchmarks/ipc_open_threads.py            # 384 x 4 MiB and 96 x 16 MiB
"""
import ctypes
import multiprocessing as mp
import sys
import threading
import time

import torch

THREADS = (1, 2, 4, 8, 16)


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def driver():
    lib = ctypes.CDLL("libcuda.so.1")
    u64, ptr = ctypes.c_uint64, ctypes.POINTER
    lib.cuIpcOpenMemHandle_v2.argtypes = [ptr(u64), IpcHandle, ctypes.c_uint]
    lib.cuIpcGetMemHandle.argtypes = [ptr(IpcHandle), u64]
    lib.cuIpcCloseMemHandle.argtypes = [u64]
    lib.cuMemAlloc_v2.argtypes = [ptr(u64), ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [u64]
    lib.cuMemGetAddressRange_v2.argtypes = [ptr(u64), ptr(ctypes.c_size_t), u64]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuCtxGetCurrent.argtypes = [ptr(ctypes.c_void_p)]
    return lib


def current_context(lib):
    torch.empty(1, device="cuda")  # torch makes the primary context current
    ctx = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(ctx))
    return ctx


def in_threads(n_items: int, threads: int, ctx, lib, body) -> float:
    """Seconds for body(i) over every item, the items split among `threads`."""
    def work(lo, hi):
        lib.cuCtxSetCurrent(ctx)
        for i in range(lo, hi):
            body(i)

    ts = [threading.Thread(target=work, args=(k * n_items // threads, (k + 1) * n_items // threads))
          for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def check(r: int, what: str) -> None:
    if r != 0:
        raise RuntimeError(f"{what} failed: CUresult {r}")


def consumer(handles, results) -> None:
    lib = driver()
    ctx = current_context(lib)
    ptrs = [0] * len(handles)

    def open_one(i):
        p, h = ctypes.c_uint64(), IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handles[i], 64)
        check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(p), h, 1), "cuIpcOpenMemHandle")
        ptrs[i] = p.value

    rows = []
    for threads in THREADS + (1,):
        opened = in_threads(len(handles), threads, ctx, lib, open_one)
        t0 = time.perf_counter()
        for p in ptrs:
            check(lib.cuIpcCloseMemHandle(p), "cuIpcCloseMemHandle")
        rows.append((threads, opened, time.perf_counter() - t0))
    results.put(rows)


def torch_base_allocations(lib, n: int, nbytes: int) -> int:
    tensors = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(n)]
    bases = set()
    for t in tensors:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), t.data_ptr()), "range")
        bases.add(base.value)
    del tensors
    torch.cuda.empty_cache()
    return len(bases)


def measure(n: int, nbytes: int) -> None:
    lib = driver()
    ctx = current_context(lib)
    print(f"{n} x {nbytes >> 20} MiB: torch's caching allocator puts them in "
          f"{torch_base_allocations(lib, n, nbytes)} base allocations", flush=True)
    ptrs = []
    for _ in range(n):
        p = ctypes.c_uint64()
        check(lib.cuMemAlloc_v2(ctypes.byref(p), nbytes), "cuMemAlloc")
        ptrs.append(p.value)
    handles = [None] * n

    def export_one(i):
        h = IpcHandle()
        check(lib.cuIpcGetMemHandle(ctypes.byref(h), ptrs[i]), "cuIpcGetMemHandle")
        handles[i] = ctypes.string_at(ctypes.addressof(h), 64)

    for threads in (1, 4):
        s = in_threads(n, threads, ctx, lib, export_one)
        print(f"  cuIpcGetMemHandle, {threads:2d} thread(s): {s * 1e3:7.2f} ms ({s * 1e6 / n:.1f} us each)")
    ctxm = mp.get_context("spawn")
    results = ctxm.Queue()
    child = ctxm.Process(target=consumer, args=(handles, results))
    child.start()
    try:
        rows = results.get(timeout=300)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    for threads, opened, closed in rows:
        print(f"  cuIpcOpenMemHandle, {threads:2d} thread(s): {opened * 1e3:7.2f} ms ({opened * 1e6 / n:.1f} us each);"
              f" closing them: {closed * 1e3:.2f} ms", flush=True)
    for p in ptrs:
        lib.cuMemFree_v2(p)


def main() -> int:
    if not torch.cuda.is_available():
        print("ipc_open_threads.py needs a CUDA GPU")
        return 0
    print(f"{torch.cuda.get_device_name()}; the first 1-thread open is cold, the last one warm")
    for n, nbytes in ((384, 4 << 20), (96, 16 << 20)):
        measure(n, nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
