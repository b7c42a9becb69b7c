#!/usr/bin/env python3
"""The driver's own cost of sharing VMM (cuMemCreate) memory between two
processes, with no torch_ipc code in the way: the floor that torch_ipc's
expandable-segments path is measured against.

The producer creates N physical allocations of CHUNK bytes (as torch's
expandable segments do: 20 MiB each in the large pool) with POSIX file
descriptor handles and exports them; a spawned consumer receives the fds over a
Unix socket (SCM_RIGHTS), imports each, reserves one range, maps the
allocations back to back and enables access, then unmaps and releases. Each
step is timed on its own, several rounds, medians; "access" is measured both
per allocation and as one call over the whole range, and import + map also on
several threads.

    python benchmarks/vmm_floor.py [--chunks 77] [--chunk-mib 20] [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time

POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
LOC_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
TIMEOUT = 120


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


class Driver:
    """The few driver calls needed, through ctypes (they release the GIL)."""

    def __init__(self):
        import torch

        torch.zeros(1, device="cuda")  # the primary context, current on this thread
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device = torch.cuda.current_device()

    def __call__(self, name, *args):
        r = getattr(self.lib, name)(*args)
        if r != 0:
            raise RuntimeError(f"{name} failed with CUresult {r}")

    def prop(self):
        p = AllocProp()
        p.type, p.requestedHandleTypes = PINNED, POSIX_FD
        p.location.type, p.location.id = LOC_DEVICE, self.device
        return p

    def access(self):
        a = AccessDesc()
        a.location.type, a.location.id, a.flags = LOC_DEVICE, self.device, READWRITE
        return a

    def set_context(self):
        """Make torch's primary context current on a new thread."""
        import torch

        torch.cuda.set_device(self.device)
        torch.zeros(1, device="cuda")


def timed(fn):
    t0 = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - t0) / 1e3, out


def consume(sock, chunks, chunk_bytes, rounds, threads, results):
    cu = Driver()
    prop, access = cu.prop(), cu.access()
    gran = ctypes.c_size_t()
    cu("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
    total = chunks * chunk_bytes
    rows = {k: [] for k in ("recv_fds", "import", "reserve", "map", "access_each", "access_once",
                            "unmap", "release", "free", f"import_map_{threads}_threads", "whole")}

    def new_handles():
        return [ctypes.c_ulonglong() for _ in range(chunks)]

    def import_chunk(h, fd):
        cu("cuMemImportFromShareableHandle", ctypes.byref(h), ctypes.c_void_p(fd), POSIX_FD)

    def map_chunk(address, h):
        cu("cuMemMap", ctypes.c_ulonglong(address), ctypes.c_size_t(chunk_bytes), ctypes.c_size_t(0), h,
           ctypes.c_ulonglong(0))

    def set_access(address, nbytes):
        cu("cuMemSetAccess", ctypes.c_ulonglong(address), ctypes.c_size_t(nbytes), ctypes.byref(access),
           ctypes.c_size_t(1))

    def reserve():
        base = ctypes.c_ulonglong()
        cu("cuMemAddressReserve", ctypes.byref(base), ctypes.c_size_t(total), ctypes.c_size_t(gran.value),
           ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
        return base.value, [base.value + i * chunk_bytes for i in range(chunks)]

    def import_all(handles, fds):
        for h, fd in zip(handles, fds):
            import_chunk(h, fd)

    def map_all(addrs, handles):
        for a, h in zip(addrs, handles):
            map_chunk(a, h)

    def unmap_all(addrs):
        for a in addrs:
            cu("cuMemUnmap", ctypes.c_ulonglong(a), ctypes.c_size_t(chunk_bytes))

    def release_all(handles):
        for h in handles:
            cu("cuMemRelease", h)

    for _ in range(rounds):
        sock.sendall(b"go")
        t0 = time.perf_counter_ns()
        fds = []
        while len(fds) < chunks:
            _, got, _, _ = socket.recv_fds(sock, 16, 250)
            fds += got
        rows["recv_fds"].append((time.perf_counter_ns() - t0) / 1e3)

        # Each step on its own.
        handles = new_handles()
        rows["import"].append(timed(lambda: import_all(handles, fds))[0])
        us, (base, addrs) = timed(reserve)
        rows["reserve"].append(us)
        rows["map"].append(timed(lambda: map_all(addrs, handles))[0])
        rows["access_each"].append(timed(lambda: [set_access(a, chunk_bytes) for a in addrs])[0])
        rows["unmap"].append(timed(lambda: unmap_all(addrs))[0])
        map_all(addrs, handles)
        rows["access_once"].append(timed(lambda: set_access(base, total))[0])
        unmap_all(addrs)
        rows["release"].append(timed(lambda: release_all(handles))[0])
        rows["free"].append(timed(lambda: cu("cuMemAddressFree", ctypes.c_ulonglong(base), ctypes.c_size_t(total)))[0])

        # Import + map on several threads.
        handles = new_handles()
        base, addrs = reserve()

        def worker(k):
            cu.set_context()
            for i in range(k, chunks, threads):
                import_chunk(handles[i], fds[i])
                map_chunk(addrs[i], handles[i])

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        t0 = time.perf_counter_ns()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        rows[f"import_map_{threads}_threads"].append((time.perf_counter_ns() - t0) / 1e3)
        unmap_all(addrs)
        release_all(handles)

        # The whole sequence on one thread, as a consumer does it.
        handles = new_handles()

        def whole():
            import_all(handles, fds)
            map_all(addrs, handles)
            set_access(base, total)

        rows["whole"].append(timed(whole)[0])
        unmap_all(addrs)
        release_all(handles)
        cu("cuMemAddressFree", ctypes.c_ulonglong(base), ctypes.c_size_t(total))
        for fd in fds:
            os.close(fd)
    results.put({k: statistics.median(v) for k, v in rows.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=77)
    ap.add_argument("--chunk-mib", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("vmm_floor.py measures CUDA's VMM sharing and needs a GPU; torch here sees none "
                 f"(torch {torch.__version__}); run it on a machine with a CUDA GPU")
    chunk_bytes = args.chunk_mib << 20

    cu = Driver()
    prop = cu.prop()
    handles = [ctypes.c_ulonglong() for _ in range(args.chunks)]
    for h in handles:
        cu("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(chunk_bytes), ctypes.byref(prop), ctypes.c_ulonglong(0))

    ctx = mp.get_context("spawn")
    ours, theirs = socket.socketpair()
    results = ctx.Queue()
    child = ctx.Process(target=consume, args=(theirs, args.chunks, chunk_bytes, args.rounds, args.threads, results),
                        daemon=True)
    child.start()
    ours.settimeout(TIMEOUT)
    export_us = []
    for _ in range(args.rounds):
        ours.recv(2)
        fds = [ctypes.c_int(-1) for _ in handles]
        us, _ = timed(lambda: [cu("cuMemExportToShareableHandle", ctypes.byref(fd), h, POSIX_FD, ctypes.c_ulonglong(0))
                               for fd, h in zip(fds, handles)])
        export_us.append(us)
        values = [fd.value for fd in fds]
        for i in range(0, len(values), 250):
            socket.send_fds(ours, [b"f"], values[i:i + 250])
        for fd in values:
            os.close(fd)
    consumer = results.get(timeout=TIMEOUT)
    child.join(TIMEOUT)
    if child.is_alive():
        child.kill()
    for h in handles:
        cu("cuMemRelease", h)

    n = args.chunks
    rows = {"export (producer)": statistics.median(export_us), **consumer}
    print(f"VMM sharing floor: {n} allocations of {args.chunk_mib} MiB ({n * chunk_bytes / 2**30:.2f} GiB), medians of "
          f"{args.rounds} rounds")
    print(f"{'step':<28}{'all':>12}{'per allocation':>18}")
    for k, us in rows.items():
        print(f"{k:<28}{us / 1e3:>9.3f} ms{us / n:>15.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"chunks": n, "chunk_bytes": chunk_bytes, "us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
