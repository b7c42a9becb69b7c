"""The plan of one engine rank: which bytes of which trainer rank's shard go
where in its tensors, computed once from both sides' descriptions
(Note [sharded weights] in sharded.py)."""

from typing import Iterator, List, Mapping, NamedTuple, Sequence, Tuple

import torch

from ._errors import WeightsMismatchError
from ._shard_layout import Box, Held, Part, Take, intersect, parts_of, relative, volume

MAX_PIECES = 1 << 22  # pieces of one (trainer, engine) pair in one version (Note [counts from a peer])


class Copy(NamedTuple):
    """One intersection: trainer `rank`'s `name`, elements `box` (global),
    read at `src` (slices of the trainer's local tensor), written at `dst`
    (slices of the engine tensor `into`)."""

    rank: int
    name: str
    box: Box
    src: Tuple[slice, ...]
    into: torch.Tensor
    dst: Tuple[slice, ...]


def landing(part: Part, box: Box) -> Tuple[slice, ...]:
    """Where the elements `box` (inside part.box) land in the engine tensor."""
    return tuple(slice(at.start + a - p0, at.start + b - p0) for (a, b), (p0, _), at in zip(box, part.box, part.at))


class ShardPlan:
    """Built once per (trainer layout, engine model): the parts of every
    engine tensor and their intersections with the trainer ranks' slices."""

    def __init__(self, sources: Mapping[str, List[Tuple[int, Held]]], dest: Mapping[str, torch.Tensor],
                 wants: Mapping[str, Take], strict: bool = True):
        globals_ = {name: rows[0][1] for name, rows in sources.items()}
        problems: List[str] = []
        self.parts: List[Tuple[torch.Tensor, Part]] = []
        for name, tensor in dest.items():
            take = wants.get(name)
            if take is None:
                if name not in globals_:
                    if strict:
                        problems.append(f"missing: {name} (published by no trainer rank; give it a Take)")
                    continue
                take = Take(name)
            self.parts += [(tensor, p) for p in parts_of(name, tensor, take, globals_, problems)]
        unknown = [n for n in wants if n not in dest]
        if unknown:
            problems.append(f"wants for tensors the engine does not have: {unknown}")
        if problems:
            raise WeightsMismatchError(problems)
        self.sources = sources
        self.copies = [Copy(rank, p.name, i, relative(i, h.box), tensor, landing(p, i))
                       for tensor, p in self.parts for rank, h in sources[p.name]
                       for i in [intersect(p.box, h.box)] if i is not None]
        self.bytes = sum(volume(c.box) * c.into.element_size() for c in self.copies)

    def wanted(self) -> List[Part]:
        return [p for _, p in self.parts]


# ----------------------------------------------------------------------------- across nodes

class Piece(NamedTuple):
    """Elements `box` of `name` in a bucket, at byte `offset`."""

    name: str
    box: Box
    offset: int


def pair_boxes(wants: Sequence[Tuple[str, Box]], sources: Mapping[str, List[Tuple[int, Held]]],
               trainer: int) -> Iterator[Tuple[str, Box]]:
    """What `trainer` sends an engine rank that wants `wants`, in a fixed order
    that both sides compute: the intersections of each want with the slices
    this trainer is the source of."""
    for name, want in wants:
        for rank, held in sources.get(name, ()):
            if rank == trainer:
                box = intersect(want, held.box)
                if box is not None:
                    yield name, box


def _split(box: Box, itemsize: int, limit: int, dim: int = 0) -> Iterator[Box]:
    """`box` cut into boxes of at most `limit` bytes, along its first dims."""
    if volume(box) * itemsize <= limit or dim >= len(box):
        yield box
        return
    lo, hi = box[dim]
    row = volume(box[:dim] + ((0, 1),) + box[dim + 1:]) * itemsize
    if row > limit:
        for r in range(lo, hi):
            yield from _split(box[:dim] + ((r, r + 1),) + box[dim + 1:], itemsize, limit, dim + 1)
        return
    step = max(1, limit // row)
    for r in range(lo, hi, step):
        yield box[:dim] + ((r, min(hi, r + step)),) + box[dim + 1:]


RAMP = 8  # a pair's first and last buckets hold about bucket_bytes / RAMP (Note [sharded rounds])


def _limit(k: int, left: int, bucket_bytes: int) -> int:
    """The bytes bucket `k` of a pair may hold with `left` bytes still to place:
    doubling from bucket_bytes / RAMP, halving towards the end."""
    smallest = max(256, bucket_bytes // RAMP)
    return min(bucket_bytes, smallest << min(k, 62), max(smallest, left // 2))


def buckets(boxes: Sequence[Tuple[str, Box]], itemsize: Mapping[str, int], bucket_bytes: int) -> List[List[Piece]]:
    """The pieces of one (trainer, engine) pair packed into buckets of at most
    `bucket_bytes`, few and large, the first and last ones smaller (Note
    [sharded rounds]: _limit): a piece larger than a bucket is cut first, a
    piece that does not fit in the room its bucket has left starts the next
    one; each piece starts 256-byte aligned. Raises ValueError past MAX_PIECES."""
    pieces: List[Tuple[str, Box, int]] = []
    for name, box in boxes:
        for sub in _split(box, itemsize[name], bucket_bytes):
            if len(pieces) == MAX_PIECES:
                raise ValueError(f"torch_ipc.weights: more than {MAX_PIECES} pieces in buckets of {bucket_bytes} "
                                 "bytes; use larger buckets")
            pieces.append((name, sub, -(-volume(sub) * itemsize[name] // 256) * 256))
    out: List[List[Piece]] = []
    left = sum(n for _, _, n in pieces)
    used = limit = 0
    for name, sub, nbytes in pieces:
        if not out or used + nbytes > limit:
            limit = _limit(len(out), left, bucket_bytes)
            out.append([])
            used = 0
        out[-1].append(Piece(name, sub, used))
        used += nbytes
        left -= nbytes
    return out
