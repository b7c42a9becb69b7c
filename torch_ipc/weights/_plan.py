"""The pull plan of one (publisher, model) pair: which published tensor goes
where in the model, checked once, turned into BatchedCopy launches."""

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ._copy import BatchedCopy
from ._errors import WeightsMismatchError
from ._layout import Layout, typed_view

NameMap = Union[None, Mapping[str, Union[str, Sequence[str]]], Callable[[str], Union[None, str, Sequence[str]]]]
Transform = Tuple[Sequence[str], Callable[..., torch.Tensor]]

# Note [name maps]
# A destination name maps to one published name (a rename) or to several,
# concatenated along dim 0 (separate q, k, v into a fused qkv). Both are byte
# ranges of the destination, so they run inside the batched launches. Anything
# else is a transform: (source names, fn(*sources) -> tensor of the
# destination's shape), run by Python on each pull; ``stats["transforms"]``
# counts them.


def _sources(name: str, name_map: NameMap) -> Optional[Tuple[str, ...]]:
    if name_map is None:
        spec = name
    elif callable(name_map):
        spec = name_map(name)
    else:
        spec = name_map.get(name, name)
    if spec is None:
        return None
    return (spec,) if isinstance(spec, str) else tuple(spec)


def _shape(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src.is_floating_point and dst.is_floating_point)


class PullPlan:
    """Built once per (publisher, model); ``run(bucket, half)`` copies."""

    def __init__(self, layout: Layout, buffer: torch.Tensor, dest: Dict[str, torch.Tensor],
                 name_map: NameMap, transforms: Mapping[str, Transform], strict: bool):
        entries = layout.by_name()
        problems: List[str] = []
        used = set()
        # entry name -> [(flat destination, first element)]; plus whole-tensor pairs
        consumers: Dict[str, List[Tuple[torch.Tensor, int]]] = {}
        whole: List[Tuple[str, torch.Tensor]] = []  # (entry, non-contiguous destination)
        self.transforms: List[Tuple[torch.Tensor, Tuple[str, ...], Callable]] = []
        for name, dst in dest.items():
            if name in transforms:
                names, fn = transforms[name]
                names = (names,) if isinstance(names, str) else tuple(names)
                missing = [n for n in names if n not in entries]
                if missing:
                    problems.append(f"missing: {name} (transform reads {missing}, not published)")
                used.update(names)
                self.transforms.append((dst, names, fn))
                continue
            names = _sources(name, name_map)
            if names is None:
                continue
            used.update(names)
            missing = [n for n in names if n not in entries]
            if missing:
                what = names[0] if len(names) == 1 and names[0] == name else f"{name} <- {list(names)}"
                problems.append(f"missing: {what} (not published)")
                continue
            srcs = [entries[n] for n in names]
            bad = [e for e in srcs if not _convertible(e.dtype, dst.dtype)]
            if bad:
                problems.append(f"dtype mismatch: {name}: model {dst.dtype}, published {[str(e.dtype) for e in bad]}")
                continue
            if len(srcs) == 1:
                if srcs[0].shape != tuple(dst.shape):
                    problems.append(f"shape mismatch: {name}: model {_shape(dst.shape)}, "
                                    f"published {names[0]} {_shape(srcs[0].shape)}")
                    continue
            else:
                rows = sum(e.shape[0] if e.shape else 0 for e in srcs)
                same_rows = all(len(e.shape) > 0 and e.shape[1:] == tuple(dst.shape[1:]) for e in srcs)
                if not same_rows or dst.dim() == 0 or rows != dst.shape[0]:
                    parts = " + ".join(f"{e.name} {_shape(e.shape)}" for e in srcs)
                    problems.append(f"shape mismatch: {name}: model {_shape(dst.shape)}, "
                                    f"published {parts} (concatenated on dim 0)")
                    continue
            if not dst.is_contiguous():
                if len(srcs) > 1 or layout.bucket_bytes:
                    problems.append(f"not contiguous: {name} (needed for concatenation and bucketed mode)")
                    continue
                whole.append((srcs[0].name, dst))
                continue
            flat, first = dst.view(-1), 0
            for e in srcs:
                consumers.setdefault(e.name, []).append((flat, first))
                first += e.numel
        if layout.bucket_bytes and self.transforms:
            problems.append(f"transforms need direct mode: {[n for n in transforms if n in dest]}")
        if strict:
            extra = [e.name for e in layout.entries if e.name not in used]
            if extra:
                problems.append(f"extra (published, not in the model): {', '.join(extra)}")
        if problems:
            raise WeightsMismatchError(problems)
        devices = {t.device for t in dest.values()}
        self.device = devices.pop() if len(devices) == 1 else buffer.device
        self._layout, self._buffer, self._consumers, self._whole = layout, buffer, consumers, whole
        self._copies: Dict[Tuple[Any, int], BatchedCopy] = {}
        self.sources = {e.name: typed_view(buffer, e.offset, e.dtype, e.numel).view(e.shape) for e in layout.entries} \
            if not layout.bucket_bytes else {}

    def copy(self, bucket: int = 0, half: int = 0) -> BatchedCopy:
        key = (bucket, half)
        if key not in self._copies:
            self._copies[key] = BatchedCopy(self._pairs(bucket, half))
        return self._copies[key]

    def copy_range(self, k: int, lo: int, hi: int) -> BatchedCopy:
        """The copies of a direct-mode snapshot's bytes [lo, hi) into
        contiguous destinations (Note [pulling a relayed version as it
        lands] in relay.py); copy_rest() holds the others."""
        key = ("range", k)
        if key not in self._copies:
            pairs = []
            for e, first, count in self._layout.pieces_in(lo, hi):
                src = self.sources[e.name].view(-1)[first : first + count]
                pairs += [(src, flat[start + first : start + first + count])
                          for flat, start in self._consumers.get(e.name, ())]
            self._copies[key] = BatchedCopy(pairs)
        return self._copies[key]

    @property
    def needs_whole(self) -> bool:
        """Whether some destination needs whole tensors (not contiguous, or a transform)."""
        return bool(self._whole or self.transforms)

    def copy_rest(self) -> BatchedCopy:
        """The copies into destinations that are not contiguous (whole tensors)."""
        if ("rest", 0) not in self._copies:
            self._copies[("rest", 0)] = BatchedCopy([(self.sources[name], dst) for name, dst in self._whole])
        return self._copies[("rest", 0)]

    def _pairs(self, bucket: int, half: int):
        layout, pairs = self._layout, []
        if not layout.bucket_bytes:
            for name, targets in self._consumers.items():
                src = self.sources[name].view(-1)
                pairs += [(src, flat[first : first + src.numel()]) for flat, first in targets]
            pairs += [(self.sources[name], dst) for name, dst in self._whole]
            return pairs
        half_bytes = layout.buffer_bytes // 2
        for e, first, count, offset in layout.pieces(bucket):
            src = typed_view(self._buffer, half * half_bytes + offset, e.dtype, count)
            for flat, start in self._consumers.get(e.name, ()):
                pairs.append((src, flat[start + first : start + first + count]))
        return pairs

    def run_transforms(self) -> None:
        for dst, names, fn in self.transforms:
            out = fn(*(self.sources[n] for n in names))
            if tuple(out.shape) != tuple(dst.shape):
                raise WeightsMismatchError(
                    [f"transform output {_shape(out.shape)} for a model tensor of {_shape(dst.shape)}"])
            dst.copy_(out)
