"""A small transformer-shaped model (uneven sizes), the trainer and engine
layouts the sharded-weights tests use, and the functions their child
processes run."""

import math
import os
import time
from typing import Dict, List

import torch

import torch_ipc
from torch_ipc.weights import LocalShard, Take
from torch_ipc.weights._shard_layout import chunk_range

HELD: Dict[str, object] = {}


def held(key: str):
    """What this peer process keeps under `key` (set by a call before)."""
    return HELD[key]


SHAPES = {"embed": (11, 6), "q": (10, 6), "k": (6, 6), "v": (6, 6), "o": (6, 10), "gate": (14, 6), "up": (14, 6),
          "down": (6, 14), "norm": (6,)}
COLUMN, ROW = ("q", "k", "v", "gate", "up", "embed"), ("o", "down")


def full_model(version: int) -> Dict[str, torch.Tensor]:
    """Version `version` of the global model: random values of its own seed."""
    gen = torch.Generator().manual_seed(1000 + version)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _cut(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    lo, hi = chunk_range(t.shape[dim], rank, world)
    return t.narrow(dim, lo, hi - lo)


def trainer_shards(full: Dict[str, torch.Tensor], layout: str, rank: int, world: int):
    """{name: LocalShard} of trainer `rank`: "tp" (column/row parallel, norm on
    rank 0 only) or "fsdp" (every tensor cut along dim 0)."""
    out = {}
    for name, t in full.items():
        if layout == "fsdp" or name in COLUMN:
            dim = 0
        elif name in ROW:
            dim = 1
        else:
            if rank == 0:
                out[name] = t.clone()  # replicated: published once
            continue
        lo, _ = chunk_range(t.shape[dim], rank, world)
        offsets = [0] * t.dim()
        offsets[dim] = lo
        out[name] = LocalShard(_cut(t, dim, rank, world).clone(), tuple(t.shape), tuple(offsets))
    return out


def engine_wants(rank: int, world: int) -> Dict[str, Take]:
    split0, split1 = (0, rank, world), (1, rank, world)
    return {"qkv": Take(["q", "k", "v"], split=split0), "gate_up": Take(["gate", "up"], split=split0),
            "o_proj": Take("o", split=split1), "down": Take("down", split=split1), "embed": Take("embed", split=split0),
            "norm": Take("norm")}


def engine_expected(full: Dict[str, torch.Tensor], rank: int, world: int, dtype=torch.float32):
    """What engine TP rank `rank` of `world` must hold of `full`."""
    def c(name, dim):
        return _cut(full[name], dim, rank, world)

    out = {"qkv": torch.cat([c("q", 0), c("k", 0), c("v", 0)]), "gate_up": torch.cat([c("gate", 0), c("up", 0)]),
           "o_proj": c("o", 1), "down": c("down", 1), "embed": c("embed", 0), "norm": full["norm"]}
    return {n: t.to(dtype) for n, t in out.items()}


def engine_model(rank: int, world: int, dtype=torch.float32, device: str = "cpu"):
    want = engine_expected(full_model(0), rank, world, dtype)
    return {n: torch.zeros_like(t, device=device) for n, t in want.items()}


def _on(shards, device: str):
    """The shards on `device` (a CUDA device: GPU tests)."""
    if device == "cpu":
        return shards
    return {n: LocalShard(s.tensor.to(device), s.global_shape, s.offsets) if isinstance(s, LocalShard) else s.to(device)
            for n, s in shards.items()}


def mismatched(model, expected) -> List[str]:
    if next(iter(model.values())).is_cuda:
        torch.cuda.synchronize()
    return [n for n in expected if not torch.equal(model[n].cpu(), expected[n])]


def _set_version(shards, layout: str, rank: int, world: int, version: int) -> None:
    for name, new in trainer_shards(full_model(version), layout, rank, world).items():
        old = shards[name]
        (old.tensor if isinstance(old, LocalShard) else old).copy_(new.tensor if isinstance(new, LocalShard) else new)


# ----------------------------------------------------------------------------- one node: child processes

def _attach_and_publish(pub, address, authkey: bytes, engines: int) -> int:
    """Attach `engines` engine ranks connecting at `address`, publish version 1."""
    with torch_ipc.listen(address, authkey=authkey) as listener:
        for _ in range(engines):
            conn = listener.accept()
            pub.attach(conn)
            HELD["conns"].append(conn)
    return pub.publish()


def trainer_serve(address, authkey: bytes, rank: int, world: int, layout: str, engines: int,
                  device: str = "cpu") -> int:
    from torch_ipc.weights import ShardedPublisher

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    shards = _on(trainer_shards(full_model(1), layout, rank, world), device)
    pub = ShardedPublisher(shards, rank=rank)
    HELD.update(pub=pub, shards=shards, layout=layout, rank=rank, world=world, conns=[])
    return _attach_and_publish(pub, address, authkey, engines)


def trainer_publish(last: int, pause_s: float = 0.0) -> int:
    pub = HELD["pub"]
    while pub.version < last:
        _set_version(HELD["shards"], HELD["layout"], HELD["rank"], HELD["world"], pub.version + 1)
        pub.publish()
        time.sleep(pause_s)
    return pub.version


def trainer_close() -> None:
    HELD.pop("pub").close()
    for conn in HELD.pop("conns"):
        conn.close()


def engine_attach(addresses, authkey: bytes, rank: int, world: int, dtype=torch.float32, device: str = "cpu") -> int:
    from weights_helpers import Connector

    from torch_ipc.weights import ShardedSubscriber

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    conns = [Connector(a, authkey, wait=30.0)() for a in addresses]
    HELD.update(sub=ShardedSubscriber(conns, wants=engine_wants(rank, world)),
                model=engine_model(rank, world, dtype, device),
                rank=rank, world=world, dtype=dtype, conns=conns)
    return os.getpid()


def engine_pull_until(last: int, timeout: float = 60.0) -> List[int]:
    """Pull until version `last`; every version pulled must be that version of
    the full model, sliced, bit for bit (no mixed versions)."""
    sub, model, seen = HELD["sub"], HELD["model"], []
    version = 0
    while version < last:
        version = sub.pull(model, newer_than=version, timeout=timeout)
        want = engine_expected(full_model(version), HELD["rank"], HELD["world"], HELD["dtype"])
        bad = mismatched(model, want)
        if bad:
            raise AssertionError(f"version {version} pulled wrong or mixed: {bad}")
        seen.append(version)
    return seen


def engine_close() -> None:
    HELD.pop("sub").close()
    for conn in HELD.pop("conns"):
        conn.close()


# ----------------------------------------------------------------------------- across nodes

def remote_rank(transport, role: str, index: int, trainers, engines, layout: str, versions: int, dtype=torch.float32,
                bucket_bytes: int = 512, device: str = "cpu", pause_s: float = 0.0, wire_dtype=None,
                local_engine: bool = False):
    """One rank of the remote protocol (any transport): a trainer publishes
    versions 1..`versions` (sleeping `pause_s` x its index before each: each
    trainer on its own schedule), in `wire_dtype` when given; an engine
    pulls each and checks it bit for bit (a mixed version would not be).
    ``local_engine``: an engine rank attaches on the trainer's node too, so
    the local snapshot is copied and checked after every publish (else it is
    never copied: Note [no snapshot without local engine ranks])."""
    from torch_ipc.weights import ShardedPublisher, ShardedSubscriber

    if role == "trainer":
        shards = _on(trainer_shards(full_model(0), layout, index, len(trainers)), device)
        pub = ShardedPublisher(shards, rank=index, dtype=wire_dtype)
        pub.send_to(trainers=trainers, engines=engines, transport=transport, bucket_bytes=bucket_bytes)
        if local_engine:  # an engine rank on this node too: the snapshot is copied beside the sends
            import torch_ipc

            a, b = torch_ipc.Pipe()
            pub.attach(a)
        for v in range(1, versions + 1):
            _set_version(shards, layout, index, len(trainers), v)
            time.sleep(pause_s * index)
            pub.publish()
            bad = snapshot_mismatches(pub)
            assert bool(bad) != local_engine, f"trainer {index}, version {v}: the local snapshot differs in {bad}"
        HELD["posts_ahead"] = pub._sender.posts_ahead()
        pub.close()
        return versions
    model = engine_model(index, len(engines), dtype, device)
    sub = ShardedSubscriber.remote(model, trainers=trainers, engines=engines, wants=engine_wants(index, len(engines)),
                                  transport=transport)
    for v in range(1, versions + 1):
        assert sub.pull() == v
        full = full_model(v)
        if wire_dtype is not None:
            full = {k: t.to(wire_dtype) for k, t in full.items()}
        want = engine_expected(full, index, len(engines), dtype)
        bad = mismatched(model, want)
        assert not bad, f"engine {index}, version {v}: {bad}"
    in_place = sum(d is not None for plan in sub._receiver.direct for d in plan)
    return sub.plan_bytes(), in_place, [len(plan) for plan in sub._receiver.plans]


def snapshot_mismatches(pub) -> List[str]:
    """The names whose local snapshot (what this node's engine ranks pull)
    differs from the trainer's shards, read on the current stream after
    publish() (Note [sends beside the snapshot])."""
    from torch_ipc.weights._layout import typed_view

    p = pub._publisher
    return [e.name for e, t in zip(p.layout.entries, pub._tensors.values())
            if not torch.equal(typed_view(p._buffer, e.offset, e.dtype, e.numel).view(t.shape), t.to(e.dtype))]


def group_rank(url: str, rank: int, world: int, role: str, index: int, trainers, engines, layout: str,
               versions: int, dtype=torch.float32, backend: str = "gloo", device: str = "cpu",
               bucket_bytes: int = 1 << 16, pause_s: float = 0.0, local_engine: bool = False):
    from distributed_helpers import init_group, leave_group

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    init_group(url, rank, world, backend)
    try:
        return remote_rank(None, role, index, trainers, engines, layout, versions, dtype, bucket_bytes, device,
                           pause_s, local_engine=local_engine)
    finally:
        leave_group()


def group_join(url: str, rank: int, world: int, role: str, index: int, trainers, engines, timeout: float,
               backend: str = "gloo", device: str = "cpu") -> int:
    """Join the group and set up one rank of the remote protocol ("tp"
    layout), kept for group_publish / group_pull (Note [a dead engine rank])."""
    from distributed_helpers import init_group

    from torch_ipc.weights import ShardedPublisher, ShardedSubscriber

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    init_group(url, rank, world, backend)
    if role == "trainer":
        shards = _on(trainer_shards(full_model(0), "tp", index, len(trainers)), device)
        pub = ShardedPublisher(shards, rank=index)
        pub.send_to(trainers=trainers, engines=engines, bucket_bytes=512, timeout=timeout)
        HELD.update(pub=pub, shards=shards, index=index, world=len(trainers))
    else:
        model = engine_model(index, len(engines), torch.float32, device)
        HELD.update(model=model, index=index, world=len(engines), sub=ShardedSubscriber.remote(
            model, trainers=trainers, engines=engines, wants=engine_wants(index, len(engines)), timeout=timeout))
    return rank


def _outcome(fn):
    """(result, None) or (None, (error type name, message, seconds it took))."""
    start = time.monotonic()
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - reported to the test
        cause = e.__cause__ if e.__cause__ is not None else e
        return None, (type(e).__name__, type(cause).__name__, str(e), time.monotonic() - start)


def group_publish(versions: int):
    """Publish up to `versions` more versions; stops at the first error:
    ([versions published], error or None)."""
    pub, done = HELD["pub"], []
    for _ in range(versions):
        _set_version(HELD["shards"], "tp", HELD["index"], HELD["world"], pub.version + 1)
        version, error = _outcome(pub.publish)
        if error is not None:
            return done, error
        done.append(version)
    return done, None


def group_pull(versions: int, timeout: float):
    """Pull up to `versions` versions (each checked bit for bit); stops at the first error."""
    sub, done = HELD["sub"], []
    for _ in range(versions):
        version, error = _outcome(lambda: sub.pull(timeout=timeout))
        if error is not None:
            return done, error
        bad = mismatched(HELD["model"], engine_expected(full_model(version), HELD["index"], HELD["world"]))
        assert not bad, f"version {version}: {bad}"
        done.append(version)
    return done, None


# ----------------------------------------------------------------------------- DTensor trainers

def _placement(name: str, mesh_dims: int = 1):
    """1-D mesh (tp): columns Shard(0), rows Shard(1), the rest Replicate.
    2-D mesh (dp, tp), FSDP x TP as trainers lay it out: the tp dim as on a
    1-D mesh, the dp dim shards the other dim (no strided shard); embed is
    replicated over dp (HSDP-like: published by the dp=0 ranks), norm over
    both (published by rank (0, 0) alone)."""
    from torch.distributed.tensor import Replicate, Shard

    if mesh_dims == 1:
        return [Shard(0)] if name in COLUMN else [Shard(1)] if name in ROW else [Replicate()]
    if name == "embed":
        return [Replicate(), Shard(0)]
    return [Shard(1), Shard(0)] if name in COLUMN else [Shard(0), Shard(1)] if name in ROW else [Replicate()] * 2


def dtensor_trainer_serve(url: str, address, authkey: bytes, rank: int, mesh_shape: tuple, engines: int) -> int:
    """A trainer rank whose weights are DTensors on a CPU mesh of `mesh_shape` over gloo."""
    from distributed_helpers import init_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from torch_ipc.weights import ShardedPublisher

    init_group(url, rank, math.prod(mesh_shape))
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    full = full_model(1)
    dtensors = {n: distribute_tensor(t, mesh, _placement(n, mesh.ndim)) for n, t in full.items()}
    pub = ShardedPublisher(dtensors, rank=rank)
    HELD.update(pub=pub, dtensors=dtensors, mesh=mesh, conns=[])
    return _attach_and_publish(pub, address, authkey, engines)


def dtensor_trainer_publish(last: int) -> int:
    from torch.distributed.tensor import distribute_tensor

    pub, dtensors, mesh = HELD["pub"], HELD["dtensors"], HELD["mesh"]
    while pub.version < last:
        for name, t in full_model(pub.version + 1).items():  # every rank makes the full model: no collective
            local = distribute_tensor(t, mesh, _placement(name, mesh.ndim), src_data_rank=None).to_local()
            dtensors[name].to_local().copy_(local)
        pub.publish()
    return pub.version


def dtensor_trainer_close() -> None:
    from distributed_helpers import leave_group

    trainer_close()
    HELD.pop("dtensors")
    leave_group()
