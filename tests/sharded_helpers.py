"""A small transformer-shaped model (uneven sizes), the trainer and engine
layouts the sharded-weights tests use, and the functions their child
processes run."""

import os
import time
from typing import Dict, List

import torch

import torch_ipc
from torch_ipc.weights import LocalShard, Take
from torch_ipc.weights._shard_layout import chunk_range

HELD: Dict[str, object] = {}

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


def engine_model(rank: int, world: int, dtype=torch.float32):
    return {n: torch.zeros_like(t) for n, t in engine_expected(full_model(0), rank, world, dtype).items()}


def mismatched(model, expected) -> List[str]:
    return [n for n in expected if not torch.equal(model[n], expected[n])]


def _set_version(shards, layout: str, rank: int, world: int, version: int) -> None:
    for name, new in trainer_shards(full_model(version), layout, rank, world).items():
        old = shards[name]
        (old.tensor if isinstance(old, LocalShard) else old).copy_(new.tensor if isinstance(new, LocalShard) else new)


# ----------------------------------------------------------------------------- one node: child processes

def trainer_serve(address, authkey: bytes, rank: int, world: int, layout: str, engines: int) -> int:
    from torch_ipc.weights import ShardedPublisher

    shards = trainer_shards(full_model(1), layout, rank, world)
    pub = ShardedPublisher(shards, rank=rank)
    HELD.update(pub=pub, shards=shards, layout=layout, rank=rank, world=world, conns=[])
    with torch_ipc.listen(address, authkey=authkey) as listener:
        for _ in range(engines):
            conn = listener.accept()
            pub.attach(conn)
            HELD["conns"].append(conn)
    return pub.publish()


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


def engine_attach(addresses, authkey: bytes, rank: int, world: int, dtype=torch.float32) -> int:
    from torch_ipc.weights import ShardedSubscriber

    from weights_helpers import Connector

    conns = [Connector(a, authkey, wait=30.0)() for a in addresses]
    HELD.update(sub=ShardedSubscriber(conns, wants=engine_wants(rank, world)), model=engine_model(rank, world, dtype),
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
                bucket_bytes: int = 512):
    """One rank of the remote protocol (any transport): a trainer publishes
    versions 1..`versions`; an engine pulls each and checks it bit for bit."""
    from torch_ipc.weights import RemoteShardedSubscriber, ShardedPublisher

    if role == "trainer":
        shards = trainer_shards(full_model(0), layout, index, len(trainers))
        pub = ShardedPublisher(shards, rank=index)
        pub.send_to(trainers=trainers, engines=engines, transport=transport, bucket_bytes=bucket_bytes)
        for v in range(1, versions + 1):
            _set_version(shards, layout, index, len(trainers), v)
            pub.publish()
        pub.close()
        return versions
    model = engine_model(index, len(engines), dtype)
    sub = RemoteShardedSubscriber(model, trainers=trainers, engines=engines, wants=engine_wants(index, len(engines)),
                                  transport=transport)
    for v in range(1, versions + 1):
        assert sub.pull() == v
        want = engine_expected(full_model(v), index, len(engines), dtype)
        bad = mismatched(model, want)
        assert not bad, f"engine {index}, version {v}: {bad}"
    return sub.plan_bytes()


def gloo_rank(url: str, rank: int, world: int, role: str, index: int, trainers, engines, layout: str,
              versions: int, dtype=torch.float32):
    from distributed_helpers import init_group, leave_group

    init_group(url, rank, world)
    try:
        return remote_rank(None, role, index, trainers, engines, layout, versions, dtype)
    finally:
        leave_group()
