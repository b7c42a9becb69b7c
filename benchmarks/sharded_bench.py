#!/usr/bin/env python3
"""Sharded weights (torch_ipc.weights.ShardedPublisher / ShardedSubscriber /
ShardedSubscriber.remote) against the floors of the same bytes, in one run.

    python benchmarks/sharded_bench.py --quick                 # CPU, gloo (smoke, ~20 s)
    python benchmarks/sharded_bench.py --device cuda           # GPU machine, 2 GPUs, bf16, ~1.5 GiB model
    python benchmarks/sharded_bench.py --device cuda --peer-copy engine,kernel --bucket-mib 64,256 --ramp 1,8
                                                               # the copy paths and bucket schedules side by side

Model: --layers transformer blocks of q, k, v, o (hidden x hidden) and
gate, up, down (hidden x ffn), bf16 on CUDA (fp32 on CPU): 15 x 2048 x 5632
is 1.54 GB; --quick: 2 x 128 x 352. Engines fuse q,k,v and gate,up (Take).
Rows (medians over --rounds, milliseconds; each process its own GPU of
trainer rank i = GPU i, engine rank j = GPU j):

one node   tp2->tp1   Two trainer ranks (TP=2) publish their shards; one
                      engine rank (TP=1, GPU 0) pulls both (GPU 1's over the
                      peer link). Floor: one device copy of the same bytes
                      from each trainer's GPU into the engine's, all queued,
                      then synchronized (target: pull >= 85% of it).
                      Colocated: what users run today: the trainer ranks
                      all-gather full tensors (a collective over their
                      group), rank 0 publishes them with a Publisher, the
                      engine pulls the full model (TP=1: nothing to slice).
           tp1->tp2   One trainer rank publishes the whole model; two
                      engine ranks (GPUs 0, 1) pull their TP halves (fused).
                      Floor: each engine's bytes as one copy from GPU 0.
                      Colocated: the engines pull the full model and slice.
two nodes  tp1->tp1   Trainer rank on GPU 0, engine rank on GPU 1, one
                      NCCL group (gloo on CPU): ShardedSubscriber.remote's
                      pull against one raw send/recv of the same bytes
                      between the same barriers (target: >= 90%); per
                      --bucket-mib and --ramp (Note [sharded rounds]).
                      --groups both: a group of both backends
                      ("cuda:nccl,cpu:gloo", what init_process_group()
                      makes when given none): headers over gloo.
--peer-copy engine|kernel: how one-node pulls copy pieces from the other GPU
(TORCH_IPC_PEER_COPY; Note [peer pieces on the copy engine]); each engine
row says the path its pull took.
"""
from __future__ import annotations

import argparse
import datetime
import os
import secrets
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def model_shapes(cfg):
    h, f = cfg["hidden"], cfg["ffn"]
    shapes = {}
    for i in range(cfg["layers"]):
        shapes.update({f"l{i}.q": (h, h), f"l{i}.k": (h, h), f"l{i}.v": (h, h), f"l{i}.o": (h, h),
                       f"l{i}.gate": (f, h), f"l{i}.up": (f, h), f"l{i}.down": (h, f)})
    return shapes


def _row(name: str) -> bool:
    return name.endswith(".o") or name.endswith(".down")


def trainer_shards(cfg, rank, world, device):
    from torch_ipc.weights import LocalShard
    from torch_ipc.weights._shard_layout import chunk_range

    out = {}
    for name, shape in model_shapes(cfg).items():
        dim = 1 if _row(name) else 0
        lo, hi = chunk_range(shape[dim], rank, world)
        local = list(shape)
        local[dim] = hi - lo
        offsets = [0, 0]
        offsets[dim] = lo
        t = torch.randn(local, device=device).to(cfg["dtype"])
        out[name] = LocalShard(t, shape, tuple(offsets)) if world > 1 else t
    return out


def engine_wants(cfg, rank, world):
    from torch_ipc.weights import Take

    wants = {}
    for i in range(cfg["layers"]):
        split0, split1 = (0, rank, world), (1, rank, world)
        wants[f"l{i}.qkv"] = Take([f"l{i}.q", f"l{i}.k", f"l{i}.v"], split=split0)
        wants[f"l{i}.gate_up"] = Take([f"l{i}.gate", f"l{i}.up"], split=split0)
        wants[f"l{i}.o"] = Take(f"l{i}.o", split=split1)
        wants[f"l{i}.down"] = Take(f"l{i}.down", split=split1)
    return wants


def engine_model(cfg, rank, world, device):
    from torch_ipc.weights._shard_layout import chunk_range

    h, f = cfg["hidden"], cfg["ffn"]
    (h0, h1), (f0, f1) = chunk_range(h, rank, world), chunk_range(f, rank, world)
    hr, fr = h1 - h0, f1 - f0
    model = {}
    for i in range(cfg["layers"]):
        model.update({f"l{i}.qkv": (3 * hr, h), f"l{i}.gate_up": (2 * fr, h), f"l{i}.o": (h, hr),
                      f"l{i}.down": (h, fr)})
    return {n: torch.empty(s, dtype=cfg["dtype"], device=device) for n, s in model.items()}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(cfg, index):
    if cfg["device"] == "cuda":
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _timed(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


# ----------------------------------------------------------------------------- one node

def one_node_trainer(cfg, rank, world, engines, address, key, barrier, out):
    import torch.distributed as dist

    import torch_ipc
    from torch_ipc.weights import Publisher, ShardedPublisher

    torch.set_num_threads(1)
    device = _device(cfg, rank)
    shards = trainer_shards(cfg, rank, world, device)
    pub = ShardedPublisher(shards, rank=rank)
    with torch_ipc.listen(address + f".{rank}", authkey=key) as listener:
        conns = [listener.accept() for _ in range(engines)]
        for conn in conns:
            pub.attach(conn)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=cfg["url"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    full = {n: torch.empty(s, dtype=cfg["dtype"], device=device) for n, s in model_shapes(cfg).items()}
    colocated = Publisher(full) if rank == 0 else None
    if colocated is not None:
        with torch_ipc.listen(address + ".full", authkey=key) as listener:
            conns += [listener.accept() for _ in range(engines)]
            for conn in conns[engines:]:
                colocated.attach(conn)
    times = {"publish": [], "gather+publish": []}
    for _ in range(cfg["rounds"]):
        barrier.wait()
        times["publish"].append(_timed(pub.publish, device))
        barrier.wait()  # the engines pull
        barrier.wait()
        times["gather+publish"].append(_timed(lambda: _gather_publish(cfg, shards, full, colocated, world), device))
        barrier.wait()
    out.put(("trainer", rank, {k: statistics.median(v) for k, v in times.items()}))
    barrier.wait()
    dist.destroy_process_group()
    pub.close()


def _gather_publish(cfg, shards, full, colocated, world):
    """The colocated recipe's trainer half: all-gather every tensor, rank 0 publishes."""
    import torch.distributed as dist

    for name, t in shards.items():
        local = t.tensor if hasattr(t, "tensor") else t
        if world == 1:
            full[name].copy_(local)
            continue
        dim = 1 if _row(name) else 0
        parts = [torch.empty_like(local) for _ in range(world)]  # even cuts in this model
        dist.all_gather(parts, local.contiguous())
        full[name].copy_(torch.cat(parts, dim=dim))
    if colocated is not None:
        colocated.publish()


def one_node_engine(cfg, rank, world, trainers, address, key, barrier, out):
    from torch_ipc.weights import ShardedSubscriber, Subscriber

    torch.set_num_threads(1)
    device = _device(cfg, rank)
    conns = [_connect(address + f".{t}", key) for t in range(trainers)]
    sub = ShardedSubscriber(conns, wants=engine_wants(cfg, rank, world))
    model = engine_model(cfg, rank, world, device)
    full_sub = Subscriber(_connect(address + ".full", key))
    full = {n: torch.empty(s, dtype=cfg["dtype"], device=device) for n, s in model_shapes(cfg).items()}
    plan = sub._shards.plan(model, sub._wants, True).plan
    per_trainer = [sum(c.into[c.dst].numel() * c.into.element_size() for c in plan.copies if c.rank == t)
                   for t in range(trainers)]
    srcs = [torch.empty(n, dtype=torch.uint8, device=_trainer_device(cfg, t)) for t, n in enumerate(per_trainer)]
    dsts = [torch.empty(n, dtype=torch.uint8, device=device) for n in per_trainer]
    times = {"sharded pull": [], "floor": [], "colocated pull+slice": []}
    version = 0
    for _ in range(cfg["rounds"]):
        barrier.wait()
        barrier.wait()  # the trainers published
        times["sharded pull"].append(_timed(lambda: sub.pull(model, newer_than=version), device))
        version = sub.version
        times["floor"].append(_timed(lambda: [d.copy_(s, non_blocking=True) for d, s in zip(dsts, srcs)], device))
        barrier.wait()
        barrier.wait()  # the colocated publish
        times["colocated pull+slice"].append(_timed(lambda: _pull_and_slice(cfg, full_sub, full, model, rank, world),
                                                    device))
    out.put(("engine", rank, {k: statistics.median(v) for k, v in times.items()} | {"bytes": sum(per_trainer),
                                                                                     "path": sub.stats["path"]}))
    barrier.wait()
    sub.close()
    full_sub.close()


def _trainer_device(cfg, t):
    return torch.device("cuda", t) if cfg["device"] == "cuda" else torch.device("cpu")


def _pull_and_slice(cfg, full_sub, full, model, rank, world):
    from torch_ipc.weights._shard_layout import chunk_range

    full_sub.pull(full, newer_than=full_sub.version)
    for i in range(cfg["layers"]):
        h0, h1 = chunk_range(cfg["hidden"], rank, world)
        f0, f1 = chunk_range(cfg["ffn"], rank, world)
        torch.cat([full[f"l{i}.{n}"][h0:h1] for n in "qkv"], out=model[f"l{i}.qkv"])
        torch.cat([full[f"l{i}.gate"][f0:f1], full[f"l{i}.up"][f0:f1]], out=model[f"l{i}.gate_up"])
        model[f"l{i}.o"].copy_(full[f"l{i}.o"][:, h0:h1])
        model[f"l{i}.down"].copy_(full[f"l{i}.down"][:, f0:f1])


def _connect(address, key):
    import torch_ipc

    deadline = time.monotonic() + 60
    while True:
        try:
            return torch_ipc.connect(address, authkey=key)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def run_one_node(cfg, trainers, engines):
    ctx = mp.get_context("spawn")
    address = os.path.join(tempfile.mkdtemp(prefix="torch_ipc_sharded_bench"), "sock")
    cfg = dict(cfg, url="file://" + address + ".rdzv")
    key, barrier, out = secrets.token_bytes(16), ctx.Barrier(trainers + engines), ctx.Queue()
    procs = [ctx.Process(target=one_node_trainer, args=(cfg, r, trainers, engines, address, key, barrier, out))
             for r in range(trainers)]
    procs += [ctx.Process(target=one_node_engine, args=(cfg, r, engines, trainers, address, key, barrier, out))
              for r in range(engines)]
    return _collect(procs, out, trainers + engines, cfg["timeout"])


def _collect(procs, out, n, timeout):
    for p in procs:
        p.start()
    try:
        rows = [out.get(timeout=timeout) for _ in range(n)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return rows


def report_one_node(name, rows):
    engines = [r[2] for r in rows if r[0] == "engine"]
    trainer0 = next(r[2] for r in rows if r[0] == "trainer" and r[1] == 0)
    pull = max(e["sharded pull"] for e in engines)
    floor = max(e["floor"] for e in engines)
    colocated = max(e["colocated pull+slice"] for e in engines)
    mib = sum(e["bytes"] for e in engines) / 2**20
    paths = "/".join(e["path"] for e in engines)
    print(f"{name:10s} sharded pull {pull:8.2f} ms ({mib:.0f} MiB over {len(engines)} engine ranks, {paths})  "
          f"floor {floor:8.2f} ms = {100 * floor / pull:5.1f}%  | publish {trainer0['publish']:.2f} ms | "
          f"colocated: gather+publish {trainer0['gather+publish']:.2f} ms + pull+slice {colocated:.2f} ms = "
          f"{trainer0['gather+publish'] + colocated:.2f} ms vs sharded {trainer0['publish'] + pull:.2f} ms",
          flush=True)


# ----------------------------------------------------------------------------- two nodes

def two_nodes_rank(cfg, rank, out):
    import torch.distributed as dist

    from torch_ipc.weights import ShardedPublisher, ShardedSubscriber, _shard_plan

    _shard_plan.RAMP = cfg["ramp"]  # Note [sharded rounds]: 1 makes every bucket of a pair full size
    torch.set_num_threads(1)
    device = _device(cfg, rank)
    backend = "gloo" if device.type != "cuda" else "nccl" if cfg["group"] == "nccl" else "cuda:nccl,cpu:gloo"
    dist.init_process_group(backend, init_method=cfg["url"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    times = {"sharded": [], "raw": []}
    if rank == 0:
        pub = ShardedPublisher(trainer_shards(cfg, 0, 1, device), rank=0)
        pub.send_to(trainers=[0], engines=[1], bucket_bytes=cfg["bucket_bytes"])
        nbytes = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(nbytes, 1)
        raw = torch.empty(int(nbytes.item()), dtype=torch.uint8, device=device)
        for _ in range(cfg["rounds"]):
            dist.barrier()
            pub.publish()
            dist.barrier()
            dist.send(raw, 1)
            sync(device)
        _profiled(cfg, rank, device, pub.publish)
        pub.close()
    else:
        model = engine_model(cfg, 0, 1, device)
        sub = ShardedSubscriber.remote(model, trainers=[0], engines=[1], wants=engine_wants(cfg, 0, 1))
        nbytes = sum(sub.plan_bytes())
        dist.send(torch.tensor([nbytes], device=device), 0)
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for _ in range(cfg["rounds"]):
            dist.barrier()
            times["sharded"].append(_timed(sub.pull, device))
            dist.barrier()
            times["raw"].append(_timed(lambda: dist.recv(raw, 0), device))
        _profiled(cfg, rank, device, sub.pull)
        out.put({k: statistics.median(v) for k, v in times.items()} | {"bytes": nbytes,
                                                                        "ops": sum(map(len, sub._receiver.plans))})
    dist.destroy_process_group()


def _profiled(cfg, rank, device, fn):
    """--profile DIR: one more version under torch.profiler, its trace in DIR."""
    import torch.distributed as dist

    if not cfg.get("profile"):
        return
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.barrier()
        fn()
        sync(device)
    name = f"two_nodes_{cfg['bucket_bytes'] >> 20}mib_ramp{cfg['ramp']}_rank{rank}.json"
    prof.export_chrome_trace(os.path.join(cfg["profile"], name))


def run_two_nodes(cfg):
    ctx = mp.get_context("spawn")
    cfg = dict(cfg, url="file://" + os.path.join(tempfile.mkdtemp(prefix="torch_ipc_sharded_bench"), "rdzv"))
    out = ctx.Queue()
    procs = [ctx.Process(target=two_nodes_rank, args=(cfg, r, out)) for r in range(2)]
    (row,) = _collect(procs, out, 1, cfg["timeout"])
    gib = row["bytes"] / 2**30
    name = f"two nodes, buckets {cfg['bucket_bytes'] >> 20} MiB, ramp {cfg['ramp']}, {row['ops']} sends"
    if cfg["group"] != "nccl":
        name += ", headers over gloo"
    print(f"{name}: sharded pull {row['sharded']:8.2f} ms ({gib * 1024:.0f} MiB, "
          f"{gib / row['sharded'] * 1e3:.1f} GiB/s)  raw send/recv {row['raw']:8.2f} ms = "
          f"{100 * row['raw'] / row['sharded']:5.1f}%", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CPU, small model, few rounds")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--ffn", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--bucket-mib", default="256", help="two nodes: bucket sizes to measure, e.g. 64,256")
    parser.add_argument("--ramp", default="8", help="two nodes: bucket ramps to measure, e.g. 1,8 (1: flat)")
    parser.add_argument("--peer-copy", default="kernel",
                        help="one node: TORCH_IPC_PEER_COPY values to measure, e.g. engine,kernel")
    parser.add_argument("--groups", default="nccl",
                        help="two nodes on CUDA: nccl, both (cuda:nccl,cpu:gloo) or nccl,both")
    parser.add_argument("--rows", default="tp2->tp1,tp1->tp2,two-nodes", help="rows to run")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--profile", help="two nodes: write a torch.profiler trace of one more version per rank here")
    args = parser.parse_args()
    quick = args.quick
    cfg = {"device": "cpu" if quick else args.device,
           "layers": args.layers or (2 if quick else 15), "hidden": args.hidden or (128 if quick else 2048),
           "ffn": args.ffn or (352 if quick else 5632), "rounds": args.rounds or (3 if quick else 10),
           "timeout": args.timeout, "profile": args.profile}
    cfg["dtype"] = torch.bfloat16 if cfg["device"] == "cuda" else torch.float32
    size = sum(a * b for a, b in model_shapes(cfg).values()) * (2 if cfg["device"] == "cuda" else 4)
    print(f"model: {len(model_shapes(cfg))} tensors, {size / 2**20:.0f} MiB, {cfg['dtype']}, {cfg['device']}",
          flush=True)
    rows = args.rows.split(",")
    for mode in args.peer_copy.split(","):
        os.environ["TORCH_IPC_PEER_COPY"] = mode  # the spawned ranks inherit it
        for name, trainers, engines in (("tp2->tp1", 2, 1), ("tp1->tp2", 1, 2)):
            if name in rows:
                report_one_node(f"{name} {mode}", run_one_node(cfg, trainers, engines))
    if "two-nodes" in rows:
        for mib in [int(m) for m in args.bucket_mib.split(",")]:
            for ramp in [int(r) for r in args.ramp.split(",")]:
                for group in args.groups.split(","):
                    run_two_nodes(dict(cfg, bucket_bytes=(1 << 20) if quick else mib << 20, ramp=ramp, group=group))

if __name__ == "__main__":
    main()
