"""What a trainer's Publisher and the Relays of other nodes say to each other
over a torch.distributed group: the layout once (JSON), then per version a
header of int64s and the snapshot's bytes in buckets (Note [relaying weights
to other nodes] in relay.py)."""

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _dist
from .._dist import Transport, dtype_from_name
from ._layout import Layout

MAGIC = 0x7769_7265_6C61_7901  # "wirelay" and message version 1
VERSION, CLOSE = 1, 2  # header kinds
HEADER_WORDS = 4  # MAGIC, kind, version, total bytes
# Bounds on what a peer's layout may make a relay build (Note [counts from a
# peer]): every count is checked before a list, a buffer or a broadcast is made of it.
MAX_ENTRIES = 1 << 20
MAX_BUCKETS = 1 << 20

def layout_message(layout: Layout, bucket_bytes: int, device: torch.device, version: int) -> Dict[str, Any]:
    return {"kind": "torch_ipc.weights.layout/1", "bucket_bytes": bucket_bytes, "device": device.type,
            "version": version, "total_bytes": layout.total_bytes,
            "entries": [[e.name, str(e.dtype), list(e.shape)] for e in layout.entries]}


def _bad(why: str) -> ValueError:
    return ValueError(f"torch_ipc.weights: the publisher sent a malformed layout: {why}")


def layout_from_message(message: Any) -> Tuple[Layout, int, str, int]:
    """(layout, bucket bytes, the publisher's device type, its version) from a
    peer's message, every field checked; offsets are recomputed here."""
    if not isinstance(message, dict) or message.get("kind") != "torch_ipc.weights.layout/1":
        raise _bad("not a layout message of this version")
    entries, bucket = message.get("entries"), message.get("bucket_bytes")
    if not isinstance(entries, list) or not entries:
        raise _bad("no entries")
    if type(bucket) is not int or bucket <= 0 or bucket % 256:
        raise _bad(f"bucket_bytes {bucket!r} is not a positive multiple of 256")
    if len(entries) > MAX_ENTRIES:
        raise _bad(f"{len(entries)} entries (at most {MAX_ENTRIES})")
    named, seen = [], set()
    for item in entries:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and dtype_from_name(item[1]) is not None and isinstance(item[2], list)
                and all(type(s) is int and 0 <= s < 2**48 for s in item[2])):
            raise _bad(f"entry {str(item)[:200]}")
        if item[0] in seen:
            raise _bad(f"{item[0]!r} listed twice")
        seen.add(item[0])
        if math.prod(item[2]) >= 2**48:
            raise _bad(f"{item[0]!r} is too large")
        named.append((item[0], dtype_from_name(item[1]), tuple(item[2])))
    layout = Layout.build(named)
    if layout.total_bytes != message.get("total_bytes"):
        raise _bad(f"{message.get('total_bytes')!r} bytes announced, {layout.total_bytes} in its entries")
    if -(-layout.total_bytes // bucket) > MAX_BUCKETS:
        raise _bad(f"{layout.total_bytes} bytes in buckets of {bucket} make more than {MAX_BUCKETS} buckets")
    device, version = message.get("device"), message.get("version")
    if device not in ("cpu", "cuda") or type(version) is not int or version < 0:
        raise _bad(f"device {device!r}, version {version!r}")
    return layout, bucket, device, version


def buckets(total_bytes: int, bucket_bytes: int) -> List[Tuple[int, int]]:
    """The byte ranges [lo, hi) of the stream, one per broadcast."""
    if -(-total_bytes // bucket_bytes) > MAX_BUCKETS:
        raise ValueError(f"torch_ipc.weights: {total_bytes} bytes in buckets of {bucket_bytes} make more than "
                         f"{MAX_BUCKETS} buckets; use larger buckets")
    return [(lo, min(lo + bucket_bytes, total_bytes)) for lo in range(0, total_bytes, bucket_bytes)]


def check_fits(total_bytes: int, device: torch.device) -> None:
    """Refuse a snapshot larger than `device`'s memory before allocating it."""
    if device.type == "cuda":
        room = torch.cuda.get_device_properties(device).total_memory
    else:
        import os

        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total_bytes > room:
        raise ValueError(f"torch_ipc.weights: the publisher's layout holds {total_bytes} bytes, more than "
                         f"{device}'s {room}; refused before allocating")


class Broadcaster:
    """The trainer's side: after each publish, the snapshot to every relay.

    Constructing it sends the layout (a collective with every Relay's
    constructor), then the current version when there is one, so a relay
    that joins late starts from it."""

    def __init__(self, buffer: torch.Tensor, layout: Layout, transport: Transport, src: Optional[int],
                 bucket_bytes: int, version: int):
        self.transport = transport
        self.transport.check_device(buffer)
        self.src = self.transport.rank if src is None else int(src)
        if self.src != self.transport.rank:
            raise ValueError(f"torch_ipc.weights: src is the publisher's own rank ({self.transport.rank}), "
                             f"not {self.src}")
        bucket_bytes = int(bucket_bytes)
        if bucket_bytes <= 0 or bucket_bytes % 256:
            raise ValueError(f"bucket_bytes must be a positive multiple of 256, not {bucket_bytes}")
        self.buffer, self.layout = buffer, layout
        self.ranges = buckets(layout.total_bytes, bucket_bytes)
        _dist.broadcast_json(self.transport, layout_message(layout, bucket_bytes, buffer.device, version), self.src)
        if version > 0:
            self.send(version)

    def _header(self, kind: int, version: int) -> None:
        _dist.broadcast_ints(self.transport, [MAGIC, kind, version, self.layout.total_bytes], HEADER_WORDS, self.src)

    def send(self, version: int) -> None:
        """Broadcast the snapshot as `version`. The broadcasts are queued
        after the snapshot copy on the current stream (CUDA) and the current
        stream waits for them, so the next publish cannot overwrite bytes
        still in flight."""
        self._header(VERSION, version)
        works = [self.transport.broadcast(self.buffer[lo:hi], self.src) for lo, hi in self.ranges]
        for work in works:
            work.wait()

    def close(self) -> None:
        """Tell the relays that no version follows (their serve() returns)."""
        try:
            self._header(CLOSE, 0)
        except Exception:
            pass  # a broken group: the relays learn it from their own receive
