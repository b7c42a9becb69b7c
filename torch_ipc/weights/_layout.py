"""Where each published tensor lies in the publisher's shared buffer.

Direct mode: every tensor has its own 256-byte aligned range of one flat
buffer (the snapshot). Bucketed mode: the same ranges, but as a stream of
``bucket_bytes`` pieces through one of two staging halves; bucket k carries
the stream's bytes [k * bucket_bytes, (k + 1) * bucket_bytes). Both sides
compute their copies from this one description.
"""

from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import torch

ALIGN = 256  # bytes; every element size divides it, so a bucket edge never cuts an element


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int  # bytes, in the stream

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Layout:
    entries: Tuple[Entry, ...]
    total_bytes: int
    bucket_bytes: int = 0  # 0: direct mode

    @staticmethod
    def build(named: List[Tuple[str, torch.dtype, Tuple[int, ...]]], bucket_bytes: int = 0) -> "Layout":
        entries, offset = [], 0
        for name, dtype, shape in named:
            e = Entry(name, dtype, tuple(int(s) for s in shape), offset)
            entries.append(e)
            offset += -(-e.nbytes // ALIGN) * ALIGN
        if bucket_bytes:
            if bucket_bytes % ALIGN:
                raise ValueError(f"bucket_bytes must be a multiple of {ALIGN}, not {bucket_bytes}")
        return Layout(tuple(entries), max(offset, ALIGN), bucket_bytes)

    def by_name(self) -> Dict[str, Entry]:
        return {e.name: e for e in self.entries}

    @property
    def n_buckets(self) -> int:
        return -(-self.total_bytes // self.bucket_bytes) if self.bucket_bytes else 1

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the shared buffer: the snapshot, or two staging halves."""
        return 2 * min(self.bucket_bytes, self.total_bytes) if self.bucket_bytes else self.total_bytes

    def pieces(self, bucket: int) -> Iterator[Tuple[Entry, int, int, int]]:
        """(entry, first element, element count, byte offset in its half) of
        each entry's part in `bucket` (bucketed mode)."""
        lo = bucket * self.bucket_bytes
        for e, first, count in self.pieces_in(lo, lo + self.bucket_bytes):
            yield e, first, count, e.offset + first * e.itemsize - lo

    def pieces_in(self, lo: int, hi: int) -> Iterator[Tuple[Entry, int, int]]:
        """(entry, first element, element count) of each entry's part in the
        stream's bytes [lo, hi); `lo` and `hi` multiples of ALIGN."""
        for e in self.entries:
            a, b = max(lo, e.offset), min(hi, e.offset + e.nbytes)
            if a < b:
                yield e, (a - e.offset) // e.itemsize, (b - a) // e.itemsize


def typed_view(buffer: torch.Tensor, byte_offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A flat `dtype` view of `numel` elements at `byte_offset` of a uint8 buffer."""
    size = torch.empty(0, dtype=dtype).element_size()
    return buffer[byte_offset : byte_offset + numel * size].view(dtype)
