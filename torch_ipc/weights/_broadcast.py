"""What a trainer's Publisher and the Relays of other nodes say to each other
over a torch.distributed group: the layout once (JSON), then per version a
header of int64s and the snapshot's bytes in buckets (Note [relaying weights
to other nodes] in relay.py)."""

import math
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

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


# Note [posting a version ahead]
# A version goes to the relays as one run of broadcasts, posted back to back
# and waited for only at the end: the header (never waited for on its own:
# with NCCL the buckets queue behind it on one stream, with gloo its tag
# orders it), then the buckets. Each NCCL call costs the host 0.1-0.25 ms
# (c10d and Python), about a 64 MiB bucket's time on NVLink, so the wire
# stays busy only if both sides post ahead of it; waiting for the header's
# round trip first (the relay's host reads it) held every bucket back by it.
# At the end the trainer polls each work until the deadline (a dead or stuck
# relay: TimeoutError, then BroadcastError; Ctrl-C interrupts). A CUDA
# work is polled spinning first (SPIN_S: the host has nothing else to do and
# a late return delays the next step), then sleeping at most POLL_S between
# polls; a relay waits for a header the same way. Host memory (gloo) is
# polled without spinning (it would take the CPU gloo's threads need). Only
# once a work completed does wait() order the current stream after it, so a
# dead relay never blocks the trainer's current stream.
SPIN_S = 0.05
POLL_S = 1e-4
CLOSE_S = 5.0  # a relay in serve() takes a CLOSE at once; a dead one never does

# Note [bucket size of a broadcast]
# Measured on two H100s (NVLink, 1.5 GiB): the wire moves ~340 GB/s (64 MiB
# in 0.2 ms); each broadcast costs each host 0.1-0.25 ms; the trainer's
# snapshot copy ~0.8 ms a GiB, a subscriber's pull ~1.3 ms a GiB. With
# buckets of B bytes the host keeps up with the wire only while a post costs
# less than a bucket's time (B >= ~85 MiB at 0.25 ms), and the pipelines add
# about one bucket's copy at each end (the trainer's first range, partly
# hidden behind the relay reading the header, and the subscriber's last):
#   64 MiB: 24 posts, ~4.8 ms of host time for 4.5 ms of wire: host-bound;
#   128 MiB: 12 posts (~2.4 ms, hidden), ~0.1 + 0.16 ms at the ends;
#   256 MiB: 6 posts, ~0.2 + 0.33 ms at the ends.
# 128 MiB it is; a bucketed relay's staging is two of them (256 MiB). On a
# 400 Gb/s network a bucket takes 2.7 ms on the wire: the ends are noise.
DEFAULT_BUCKET_BYTES = 128 << 20


MAX_RANGE_EVENTS = 64  # a relay's events per snapshot: each subscriber opens them all (~150 us each)


def event_ranges(ranges: List[Tuple[int, int]]) -> Tuple[int, List[Tuple[int, int]]]:
    """(buckets per event, the byte range of each event) for a relay's
    snapshot broadcast in `ranges` (Note [pulling a relayed version as it
    lands] in relay.py): consecutive buckets share an event past MAX_RANGE_EVENTS."""
    per = max(1, -(-len(ranges) // MAX_RANGE_EVENTS))
    return per, [(ranges[i][0], ranges[min(i + per, len(ranges)) - 1][1]) for i in range(0, len(ranges), per)]


def await_work(work: Any, tensor: torch.Tensor, deadline: Optional[float], max_sleep: float = POLL_S) -> None:
    """Note [posting a version ahead]: poll `work` (a broadcast) until done."""
    spin = SPIN_S if tensor.device.type == "cuda" else 0.0
    _dist.finish(work, tensor, deadline, poll=True, max_sleep=max_sleep, spin=spin)


def receive_header(transport: Transport, src: int) -> List[int]:
    """A relay's wait for the next header (as long as it takes; Ctrl-C
    interrupts); between versions a CPU relay polls every 1 ms."""
    t = _dist.to_control(torch.zeros(HEADER_WORDS, dtype=torch.int64), transport)
    await_work(transport.broadcast(t, src), t, None, POLL_S if t.device.type == "cuda" else 1e-3)
    return t.tolist()


class Broadcaster:
    """The trainer's side: after each publish, the snapshot to every relay.

    Constructing it sends the layout (a collective with every Relay's
    constructor), then the current version when there is one, so a relay
    that joins late starts from it."""

    def __init__(self, buffer: torch.Tensor, layout: Layout, transport: Transport, src: Optional[int],
                 bucket_bytes: int, version: int, timeout: float):
        self.transport = transport
        self.transport.check_device(buffer)
        self.src = self.transport.rank if src is None else int(src)
        if self.src != self.transport.rank:
            raise ValueError(f"torch_ipc.weights: src is the publisher's own rank ({self.transport.rank}), "
                             f"not {self.src}")
        bucket_bytes = int(bucket_bytes)
        if bucket_bytes <= 0 or bucket_bytes % 256:
            raise ValueError(f"bucket_bytes must be a positive multiple of 256, not {bucket_bytes}")
        self.buffer, self.layout, self.timeout = buffer, layout, timeout
        self.ranges = buckets(layout.total_bytes, bucket_bytes)
        self._pending: List[Tuple[Any, torch.Tensor]] = []  # posted, not finished: (work, its tensor)
        self._error: Optional[BaseException] = None  # a post that failed
        _dist.broadcast_json(self.transport, layout_message(layout, bucket_bytes, buffer.device, version), self.src)
        if version > 0:
            self.send(version)

    @property
    def posted(self) -> bool:
        """Whether a version's broadcasts were started and not finished."""
        return bool(self._pending) or self._error is not None

    def _post(self, tensor: torch.Tensor) -> None:
        if self._error is None:
            try:
                self._pending.append((self.transport.broadcast(tensor, self.src), tensor))
            except Exception as e:  # the group broke: finish() raises it
                self._error = e

    def post(self, version: int, before: Optional[Callable[[int], None]] = None, kind: int = VERSION) -> None:
        """Start the header and the buckets of `version` (Note [posting a
        version ahead]); `before(k)`: what must be queued before bucket k is
        (a publish's copy of its range: Note [pipelined publish and
        broadcast] in publisher.py). A broadcast that cannot start leaves
        the rest unposted but every `before(k)` still runs; finish() raises."""
        if self._pending:  # what an interrupted finish() left: the snapshot must not change under it
            try:
                self.finish(time.monotonic() + self.timeout)
            except Exception as e:
                self._error = e
        self._post(_dist.to_control(torch.tensor([MAGIC, kind, version, self.layout.total_bytes],
                                                 dtype=torch.int64), self.transport))
        if kind != VERSION:
            return
        for k, (lo, hi) in enumerate(self.ranges):
            if before is not None:
                before(k)
            self._post(self.buffer[lo:hi])

    def finish(self, deadline: float) -> None:
        """Wait for what post() started until `deadline` (time.monotonic());
        then the current stream is ordered after it (CUDA), so the next
        publish cannot overwrite bytes still in flight. Raises what failed."""
        if self._error is not None:
            error, self._error, self._pending = self._error, None, []
            raise error
        while self._pending:  # one at a time: an interrupted wait leaves the rest to the next finish()
            work, tensor = self._pending[0]
            await_work(work, tensor, deadline)
            self._pending.pop(0)

    def send(self, version: int) -> None:
        """Broadcast the snapshot as `version` and wait for it."""
        self.post(version)
        self.finish(time.monotonic() + self.timeout)

    def close(self) -> None:
        """Tell the relays that no version follows (their serve() returns);
        waits CLOSE_S at most for a relay to take it."""
        try:
            self.finish(time.monotonic() + self.timeout)
            self.post(0, kind=CLOSE)
            self.finish(time.monotonic() + min(self.timeout, CLOSE_S))
        except Exception:
            pass  # a broken group: the relays learn it from their own receive
