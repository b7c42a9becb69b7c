"""Quick CUDA smoke check between two spawned processes (used while developing)."""
import multiprocessing as mp
import os
import sys
import time

import torch

import torch_ipc


def consumer(conn):
    import torch_ipc
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, data = msg
        t0 = time.perf_counter()
        obj = torch_ipc.loads(data)
        dt = time.perf_counter() - t0
        if kind == "write":
            obj["x"].add_(1)
            torch.cuda.synchronize()
            conn.send(("done", dt, obj["x"][:4].tolist(), torch_ipc.stats()))
        elif kind == "check":
            conn.send(("done", dt, [float(v.float().sum()) for v in obj.values()], torch_ipc.stats()))
        elif kind == "hold":
            globals()["held"] = obj
            conn.send(("done", dt, None, torch_ipc.stats()))
        del obj


def main():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=consumer, args=(b,))
    p.start()
    try:
        x = torch.zeros(1 << 20, device="cuda")
        a.send(("write", torch_ipc.dumps({"x": x})))
        print("write", a.recv()[1:3], x[:4].tolist())
        sd = {f"w{i}": torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) for i in range(64)}
        ref = [float(v.float().sum()) for v in sd.values()]
        for rep in range(3):
            t0 = time.perf_counter()
            d = torch_ipc.dumps(sd)
            t1 = time.perf_counter()
            a.send(("check", d))
            r = a.recv()
            print(f"sd rep {rep}: dumps {1e3*(t1-t0):.3f} ms loads {1e3*r[1]:.3f} ms ok={r[2]==ref}")
        print(r[3])
        time.sleep(0.3)
        print("producer", torch_ipc.stats())
        a.send(None)
        p.join(10)
    finally:
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
