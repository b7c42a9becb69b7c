"""Sharded weights: which box of each global tensor a trainer rank holds, and
which box an engine rank wants; both checked before anything is built.

A box is one (start, stop) pair per dimension of a global tensor. A trainer
rank describes each tensor it publishes (a DTensor's device mesh and
placements, or a :class:`LocalShard`); an engine rank says what it wants with
:class:`Take`. Note [sharded weights] in sharded.py says how they meet.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .._dist import dtype_from_name

Box = Tuple[Tuple[int, int], ...]

# Bounds on a peer's description (Note [counts from a peer] in torch_ipc/_dist.py)
MAX_TENSORS = 1 << 20
MAX_DIMS = 8
MAX_NUMEL = 1 << 48

SHARDS_KIND = "torch_ipc.weights.shards/1"
WANTS_KIND = "torch_ipc.weights.wants/1"


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


def box_shape(box: Box) -> Tuple[int, ...]:
    return tuple(b - a for a, b in box)


def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Optional[Box]:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) or (not out and not a) else None


def relative(box: Box, origin: Box) -> Tuple[slice, ...]:
    """`box` as slices of the tensor that holds `origin` (box inside origin)."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def chunk_range(size: int, rank: int, world: int) -> Tuple[int, int]:
    """Rows of `rank` when `size` rows are cut in `world` parts as torch.chunk
    and DTensor's Shard cut them: parts of ceil(size / world), the last ones
    shorter or empty."""
    if not 0 <= rank < world:
        raise ValueError(f"torch_ipc.weights: rank {rank} of a split in {world}")
    step = -(-size // world)
    return min(rank * step, size), min((rank + 1) * step, size)


# ----------------------------------------------------------------------------- trainer side

@dataclass(frozen=True)
class LocalShard:
    """A plain tensor that is one trainer rank's slice of a global tensor:
    ``global_shape`` and where the slice starts (``offsets``, one per
    dimension; the slice's extent is the tensor's shape). Pass a replicated
    tensor (a norm, a bias) on one trainer rank only, as a LocalShard with
    zero offsets or as a plain tensor."""

    tensor: torch.Tensor
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]


@dataclass(frozen=True)
class Held:
    """What one trainer rank publishes of one global tensor."""

    name: str
    dtype: torch.dtype
    global_shape: Tuple[int, ...]
    box: Box


def _dtensor_shard(name: str, t: Any) -> Tuple[Optional[torch.Tensor], Held]:
    """(the local tensor, or None when another rank publishes this replica; what it is)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, tuple(t.placements)
    for p in placements:
        if isinstance(p, Partial) or not isinstance(p, (Shard, Replicate)) or type(p).__name__ == "_StridedShard":
            raise ValueError(f"torch_ipc.weights: {name} has placement {p}; publish Shard(dim) or Replicate() "
                             "placements (redistribute a Partial or strided one first)")
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    owner = all(coordinate[d] == 0 for d, p in enumerate(placements) if isinstance(p, Replicate))
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"torch_ipc.weights: {name}'s local tensor is {tuple(local.shape)}, its placements say "
                         f"{tuple(shape)}")
    box = tuple((o, o + s) for o, s in zip(offset, shape))
    return (local if owner else None), Held(name, local.dtype, tuple(t.shape), box)


def describe_shards(source: Mapping[str, Any]) -> Tuple[Dict[str, torch.Tensor], List[Held]]:
    """({name: local tensor to publish}, [what each is]) of a trainer rank's
    tensors: DTensors, LocalShards or plain tensors (a whole tensor)."""
    tensors: Dict[str, torch.Tensor] = {}
    held: List[Held] = []
    for name, t in source.items():
        if not isinstance(name, str):
            raise TypeError(f"torch_ipc.weights: tensor names are str, not {type(name).__name__}")
        if type(t).__name__ == "DTensor":
            local, h = _dtensor_shard(name, t)
        elif isinstance(t, LocalShard):
            local = t.tensor
            shape, offsets = tuple(int(s) for s in t.global_shape), tuple(int(o) for o in t.offsets)
            if len(shape) != local.dim() or len(offsets) != local.dim():
                raise ValueError(f"torch_ipc.weights: {name}: a {local.dim()}-d shard of a global shape {shape} "
                                 f"at offsets {offsets}")
            h = Held(name, local.dtype, shape, tuple((o, o + s) for o, s in zip(offsets, local.shape)))
        elif isinstance(t, torch.Tensor):
            local, h = t, Held(name, t.dtype, tuple(t.shape), full_box(t.shape))
        else:
            raise TypeError(f"torch_ipc.weights: {name} is a {type(t).__name__}, not a tensor, DTensor or LocalShard")
        if local is not None:
            local = local.detach()
            bad = [f"{a}:{b}" for (a, b), g in zip(h.box, h.global_shape) if not 0 <= a <= b <= g]
            if bad:
                raise ValueError(f"torch_ipc.weights: {name}'s slice {bad} is outside its global shape "
                                 f"{h.global_shape}")
            tensors[name] = local
            held.append(h)
    if not tensors:
        raise ValueError("torch_ipc.weights: this trainer rank publishes no tensors")
    return tensors, held


def shards_message(rank: int, held: Sequence[Held], bucket_bytes: int = 0) -> Dict[str, Any]:
    return {"kind": SHARDS_KIND, "rank": rank, "bucket_bytes": bucket_bytes,
            "tensors": [[h.name, str(h.dtype), list(h.global_shape), [list(p) for p in h.box]] for h in held]}


def _bad(why: str) -> ValueError:
    return ValueError(f"torch_ipc.weights: a trainer rank sent a malformed shard description: {why}")


def _int_list(v: Any, n: Optional[int] = None) -> bool:
    return isinstance(v, list) and len(v) <= MAX_DIMS and (n is None or len(v) == n) \
        and all(type(x) is int and 0 <= x < MAX_NUMEL for x in v)


def held_from_message(message: Any) -> Tuple[int, int, List[Held]]:
    """(rank, bucket bytes, what it holds) of a peer's description, every field checked."""
    if not isinstance(message, dict) or message.get("kind") != SHARDS_KIND:
        raise _bad("not a shard description of this version")
    rank, bucket, items = message.get("rank"), message.get("bucket_bytes"), message.get("tensors")
    if type(rank) is not int or rank < 0 or type(bucket) is not int or bucket < 0 or bucket % 256:
        raise _bad(f"rank {rank!r}, bucket_bytes {bucket!r}")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_TENSORS:
        raise _bad("no tensors, or too many")
    held, seen = [], set()
    for item in items:
        ok = isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and item[0] not in seen \
            and dtype_from_name(item[1]) is not None and _int_list(item[2]) and isinstance(item[3], list) \
            and len(item[3]) == len(item[2]) and all(_int_list(p, 2) for p in item[3])
        if not ok or math.prod(item[2]) >= MAX_NUMEL:
            raise _bad(f"entry {str(item)[:200]}")
        box = tuple((a, b) for a, b in item[3])
        if not all(0 <= a <= b <= g for (a, b), g in zip(box, item[2])):
            raise _bad(f"{item[0]}'s slice {box} is outside its global shape {item[2]}")
        seen.add(item[0])
        held.append(Held(item[0], dtype_from_name(item[1]), tuple(item[2]), box))
    return rank, bucket, held


def sources_of(held_by_rank: Sequence[Sequence[Held]]) -> Dict[str, List[Tuple[int, Held]]]:
    """{name: [(trainer rank, what it holds)]}: one source per distinct box
    (a replica published twice is read from the lowest rank), checked: one
    global shape and dtype per name, no partial overlap, every element held."""
    out: Dict[str, List[Tuple[int, Held]]] = {}
    for rank, held in enumerate(held_by_rank):
        for h in held:
            rows = out.setdefault(h.name, [])
            if rows and (rows[0][1].global_shape != h.global_shape or rows[0][1].dtype != h.dtype):
                first = rows[0][1]
                raise ValueError(f"torch_ipc.weights: trainer ranks disagree on {h.name}: rank {rows[0][0]} "
                                 f"has {first.dtype} {first.global_shape}, rank {rank} {h.dtype} {h.global_shape}")
            if any(other.box == h.box for _, other in rows):
                continue
            clash = [r for r, other in rows if intersect(other.box, h.box) is not None and volume(h.box)]
            if clash:
                raise ValueError(f"torch_ipc.weights: {h.name}: rank {rank}'s slice {h.box} overlaps rank "
                                 f"{clash[0]}'s without being the same slice")
            rows.append((rank, h))
    for name, rows in out.items():
        held = sum(volume(h.box) for _, h in rows)
        whole = math.prod(rows[0][1].global_shape)
        if held != whole:
            raise ValueError(f"torch_ipc.weights: the trainer ranks hold {held} of the {whole} elements of {name} "
                             f"{rows[0][1].global_shape}: their slices do not cover it")
    return out


# ----------------------------------------------------------------------------- engine side

@dataclass(frozen=True)
class Take:
    """What an engine rank's tensor is made of: the ``sources`` (one global
    name, or several concatenated along ``cat_dim``: a fused qkv or gate_up),
    each cut by ``split=(dim, rank, world)`` first (tensor parallelism: the
    rows of ``rank`` when ``dim`` is cut in ``world`` parts as DTensor's
    Shard(dim) cuts it), or whole (``split=None``).

    Example (vLLM-style TP rank r of M)::

        >>> wants = {"qkv.weight": Take(["q.weight", "k.weight", "v.weight"], split=(0, r, M)),  # doctest: +SKIP
        ...          "o.weight": Take("o.weight", split=(1, r, M)), "norm.weight": Take("norm.weight")}
    """

    sources: Union[str, Sequence[str]]
    split: Optional[Tuple[int, int, int]] = None
    cat_dim: int = 0

    def names(self) -> Tuple[str, ...]:
        return (self.sources,) if isinstance(self.sources, str) else tuple(self.sources)

    def box(self, global_shape: Tuple[int, ...]) -> Box:
        box = full_box(global_shape)
        if self.split is None:
            return box
        dim, rank, world = (int(v) for v in self.split)
        if not 0 <= dim < len(global_shape):
            raise ValueError(f"torch_ipc.weights: split dim {dim} of a {len(global_shape)}-d tensor")
        return box[:dim] + (chunk_range(global_shape[dim], rank, world),) + box[dim + 1:]


@dataclass(frozen=True)
class Part:
    """One source of an engine tensor: global `name`'s `box`, landing at `at` (slices of the tensor)."""

    name: str
    box: Box
    at: Tuple[slice, ...]


def parts_of(dest_name: str, dest: torch.Tensor, take: Take, globals_: Mapping[str, Held],
             problems: List[str]) -> List[Part]:
    """The parts of one engine tensor; a mismatch goes to `problems` (and [] returned)."""
    missing = [n for n in take.names() if n not in globals_]
    if missing:
        problems.append(f"missing: {dest_name} <- {missing} (published by no trainer rank)")
        return []
    parts, offset, shapes = [], 0, []
    for n in take.names():
        g = globals_[n]
        if not (g.dtype == dest.dtype or (g.dtype.is_floating_point and dest.dtype.is_floating_point)):
            problems.append(f"dtype mismatch: {dest_name}: engine {dest.dtype}, published {n} {g.dtype}")
            return []
        try:
            box = take.box(g.global_shape)
        except ValueError as e:
            problems.append(f"{dest_name}: {e}")
            return []
        shape = box_shape(box)
        fused = len(take.names()) > 1
        if len(shape) != dest.dim() or (fused and not 0 <= take.cat_dim < dest.dim()):
            problems.append(f"shape mismatch: {dest_name}: engine {tuple(dest.shape)}, {n}'s slice {shape}")
            return []
        at = [slice(0, s) for s in shape]
        if fused:
            at[take.cat_dim] = slice(offset, offset + shape[take.cat_dim])
            offset += shape[take.cat_dim]
        shapes.append(shape)
        parts.append(Part(n, box, tuple(at)))
    if len(parts) == 1:  # one source, any rank (a scalar too): its slice is the engine tensor
        if shapes[0] != tuple(dest.shape):
            problems.append(f"shape mismatch: {dest_name}: engine {tuple(dest.shape)}, published "
                            f"{parts[0].name}'s slice {shapes[0]}")
            return []
        return parts
    want = list(shapes[0])
    want[take.cat_dim] = offset
    others_agree = all(s[:take.cat_dim] + s[take.cat_dim + 1:] == shapes[0][:take.cat_dim] +
                       shapes[0][take.cat_dim + 1:] for s in shapes)
    if not others_agree or tuple(want) != tuple(dest.shape):
        got = " + ".join(f"{p.name} {box_shape(p.box)}" for p in parts)
        problems.append(f"shape mismatch: {dest_name}: engine {tuple(dest.shape)}, published {got} "
                        f"(concatenated on dim {take.cat_dim})")
        return []
    return parts


def wants_message(parts: Sequence[Part]) -> Dict[str, Any]:
    """The distinct (name, box) an engine rank wants, in a fixed order."""
    seen, out = set(), []
    for p in parts:
        if (p.name, p.box) not in seen:
            seen.add((p.name, p.box))
            out.append([p.name, [list(b) for b in p.box]])
    return {"kind": WANTS_KIND, "tensors": out}


def wants_from_message(message: Any, globals_: Mapping[str, Held]) -> List[Tuple[str, Box]]:
    """An engine rank's wants, every field checked against the global shapes."""
    if not isinstance(message, dict) or message.get("kind") != WANTS_KIND:
        raise ValueError("torch_ipc.weights: an engine rank sent something that is not a wants message")
    items = message.get("tensors")
    if not isinstance(items, list) or len(items) > MAX_TENSORS:
        raise ValueError("torch_ipc.weights: an engine rank's wants are not a list, or too long")
    out, seen = [], set()
    for item in items:
        ok = isinstance(item, list) and len(item) == 2 and item[0] in globals_ and isinstance(item[1], list) \
            and len(item[1]) == len(globals_[item[0]].global_shape) and all(_int_list(p, 2) for p in item[1])
        if not ok:
            raise ValueError(f"torch_ipc.weights: an engine rank wants {str(item)[:200]}")
        box = tuple((a, b) for a, b in item[1])
        if not all(0 <= a <= b <= g for (a, b), g in zip(box, globals_[item[0]].global_shape)):
            raise ValueError(f"torch_ipc.weights: an engine rank wants {item[0]}{box}, outside its global shape")
        if (item[0], box) in seen:
            raise ValueError(f"torch_ipc.weights: an engine rank wants {item[0]}{box} twice")
        seen.add((item[0], box))
        out.append((item[0], box))
    return out
