"""Publisher: the trainer's side. Shares its weights once per subscriber, then
publishes each new version with a few counter stores and one launch."""

import secrets
import time
from typing import Dict, List, Optional, Tuple, Union

import torch

from .. import _serialize
from .._closing import Closeable
from ..pool import SharedPool
from . import _control as ctl
from ._copy import BESIDE_TRANSFERS, BatchedCopy
from ._errors import send_failed
from ._events import new_event
from ._layout import Layout, typed_view
from ._share import Share, named_tensors, send

__all__ = ["Publisher"]

DEFAULT_BUCKET_BYTES = 512 << 20


class Publisher(Closeable):
    """Publish the weights of ``source`` (an ``nn.Module`` or a mapping of
    tensors, all on one device) to subscribers in other processes.

    Direct mode (default): ``publish()`` copies the tensors into a shared
    snapshot (one launch on the current stream, no host wait) and announces
    the new version; subscribers pull from the snapshot while training goes
    on. Extra memory: one copy of the weights (in ``dtype``, default theirs).

    Bucketed mode (``bucket_bytes=N``): no snapshot; ``publish()`` streams the
    weights through two shared staging halves of N bytes each and returns
    when every attached subscriber has taken every bucket (each must be in
    :meth:`Subscriber.pull` meanwhile). Extra memory: 2 * N.

    The tensors are captured at construction: keep updating them in place
    (optimizer steps do); a model whose tensors are replaced needs a new
    Publisher. Call ``publish()`` on the stream that wrote the weights.

    Example::

        >>> pub = torch_ipc.weights.Publisher(model)            # doctest: +SKIP
        >>> pub.attach(conn)         # once per subscriber      # doctest: +SKIP
        >>> for batch in data:                                  # doctest: +SKIP
        ...     train_step(model, batch); pub.publish()
    """

    def __init__(
        self,
        source: Union[torch.nn.Module, Dict[str, torch.Tensor]],
        *,
        dtype: Optional[torch.dtype] = None,
        bucket_bytes: Optional[int] = None,
        max_subscribers: int = 8,
        timeout: float = 60.0,
    ):
        tensors = named_tensors(source, "the published source")
        if not tensors:
            raise ValueError("torch_ipc.weights: nothing to publish (no tensors)")
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"torch_ipc.weights: publish tensors of one device, not {sorted(map(str, devices))}")
        self.device = devices.pop()
        if bucket_bytes is not None:
            bad = [n for n, t in tensors.items() if not t.is_contiguous()]
            if bad:
                raise ValueError(f"torch_ipc.weights: bucketed mode needs contiguous tensors; these are not: {bad}")
        self.timeout = timeout
        layout = Layout.build([(n, dtype or t.dtype, tuple(t.shape)) for n, t in tensors.items()], bucket_bytes or 0)
        self._setup(layout, tensors, max_subscribers)

    @classmethod
    def _for_layout(cls, layout: Layout, device: torch.device, *, max_subscribers: int,
                    timeout: float, ranges=()) -> "Publisher":
        """A publisher of `layout` with no source tensors: whoever makes it
        fills the buffer through _publish_direct/_publish_bucketed's `fill`
        (a weights Relay). ``ranges``: byte ranges of a direct-mode snapshot
        that the filler streams, recording ``range_events[k]`` after each
        (Note [pulling a relayed version as it lands] in relay.py)."""
        self = cls.__new__(cls)
        self.device, self.timeout = device, timeout
        self._setup(layout, None, max_subscribers)
        if ranges and not layout.bucket_bytes:
            self.ranges = tuple(tuple(r) for r in ranges)
            self.range_events = tuple(new_event(device) for _ in self.ranges)  # None each on CPU
        return self

    def _setup(self, layout: Layout, tensors: Optional[Dict[str, torch.Tensor]], max_subscribers: int) -> None:
        self.layout = layout
        self._tensors = tensors
        self._buffer = self._new_buffer(self.layout.buffer_bytes)
        self._block = ctl.new_block(max_subscribers)
        self._counters = ctl.Counters(self._block)
        self._epoch = secrets.randbits(62)
        self._done: Dict[int, tuple] = {}  # slot -> its subscriber's done events (None on CPU)
        self.version = 0
        self._bucket_seq = 0
        self._closed = False
        self._broadcaster = None  # Note [relaying weights to other nodes] in relay.py
        self._by_range = None  # (ranges, their copies): Note [pipelined publish and broadcast]
        self.ranges, self.range_events = (), ()  # a relay's: see _for_layout
        if self.layout.bucket_bytes:
            self._publish_event = None
            self._staging_events = (new_event(self.device), new_event(self.device))
            self._packs: Dict[tuple, BatchedCopy] = {}
            self._snapshot = None
        else:
            self._publish_event = new_event(self.device)
            self._staging_events = ()
            self._snapshot = None if tensors is None else BatchedCopy(self._snapshot_pairs())
        self.stats = {"path": self._snapshot.path if self._snapshot else "", "publishes": 0, "last_publish_us": 0.0}

    def _snapshot_pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(source tensor, its view in the snapshot), entry by entry (direct mode)."""
        return [(t, typed_view(self._buffer, e.offset, e.dtype, e.numel).view(t.shape))
                for e, t in zip(self.layout.entries, self._tensors.values())]

    def _snapshot_by_engine(self) -> None:
        """Copy the snapshot on the copy engine where it can from now on
        (Note [sends beside the snapshot] in sharded.py): a direct-mode CUDA
        publisher with source tensors only."""
        if self.device.type == "cuda" and self._snapshot is not None:
            self._snapshot = BatchedCopy(self._snapshot_pairs(), by_engine=True)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cuda":
            # Note [weights in shareable memory]
            # The buffer is a cuMemCreate allocation of its own: a subscriber
            # maps exactly it (no neighbour of torch's caching allocator), and
            # what it mapped stays valid if the trainer dies mid-pull.
            return SharedPool(self.device).empty((nbytes,), torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8)

    # ---------------------------------------------------------------- attach

    def attach(self, conn) -> int:
        """Send one subscriber what it needs, once: a torch_ipc
        :class:`~torch_ipc.Connection`, an end of a ``multiprocessing.Pipe``
        or a ``multiprocessing`` queue (``put``) all work. The subscriber builds
        a :class:`Subscriber` from the other end. Returns its slot."""
        self._check_open()
        slot = self._free_slot()
        c = self._counters
        for field in (ctl.READING, ctl.PULLS):
            c.store(ctl.slot_index(slot, field), 0)
        c.store(ctl.slot_index(slot, ctl.TAKEN), self._bucket_seq)
        c.store(ctl.slot_index(slot, ctl.OWNER), -1)  # reserved until the subscriber claims it
        # One per staging half in bucketed mode, so that filling a half waits
        # for the subscriber's copy out of that half only, not of the other.
        done = tuple(new_event(self.device) for _ in range(2 if self.layout.bucket_bytes else 1))
        self._done[slot] = done
        descriptor = _serialize.dumps({"buffer": self._buffer, "control": self._block})
        send(conn, Share(descriptor, self.layout, slot, self._counters.load(ctl.PUBLISHER), self._epoch,
                         self._publish_event, self._staging_events, done, self.ranges, self.range_events))
        return slot

    def _free_slot(self) -> int:
        c = self._counters
        for r in range(ctl.slots(self._block)):
            owner = c.load(ctl.slot_index(r, ctl.OWNER))
            if owner == 0 or (owner > 0 and not ctl.word_alive(owner)):
                self._done.pop(r, None)
                return r
        raise RuntimeError(f"torch_ipc.weights: all {ctl.slots(self._block)} subscriber slots are taken "
                           "(see max_subscribers)")

    def _reap(self, slot: int) -> None:
        """Forget the subscriber of `slot` if its process died."""
        c = self._counters
        owner = c.load(ctl.slot_index(slot, ctl.OWNER))
        if owner > 0 and not ctl.word_alive(owner):
            c.store(ctl.slot_index(slot, ctl.READING), 0)
            c.store(ctl.slot_index(slot, ctl.OWNER), 0)
            self._done.pop(slot, None)

    def _wait_slot(self, slot: int, field: int, ready, deadline: float) -> None:
        index = ctl.slot_index(slot, field)
        ctl.spin_until(lambda: slot not in self._done or ready(self._counters.load(index)),
                       lambda: self._reap(slot), deadline)

    # ---------------------------------------------------------------- publish

    def publish(self) -> int:
        """Make the current values of the tensors the next version; returns
        its number (1, 2, ...). See Note [weights consistency protocol]."""
        self._check_open()
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        if self.layout.bucket_bytes:
            version = self._publish_bucketed(deadline)
        elif self._broadcaster is not None:
            version = self._publish_and_post(deadline)
        else:
            version = self._publish_direct(deadline)
        self.stats["publishes"] += 1
        self.stats["last_publish_us"] = (time.perf_counter() - start) * 1e6
        if self._broadcaster is not None:
            self._finish_broadcast(version, lambda b: b.finish(time.monotonic() + self.timeout))
        return version

    # Note [pipelined publish and broadcast]
    # With relays, publish() copies the snapshot range by range, one range
    # per broadcast bucket, and starts bucket k's broadcast right after the
    # copy of range k is queued (Note [posting a version ahead] in
    # _broadcast.py): NCCL's stream waits for the current stream when a
    # collective is posted, so broadcast k waits for copies 0..k only, and
    # copy k + 1 runs beside it. What the relays wait for before their first
    # byte is one range's copy, not the whole snapshot's. The local protocol
    # is unchanged: the copies and the posts run inside the write window of
    # Note [weights consistency protocol], the publish event is recorded
    # after the last copy, and the next publish writes only after finish()
    # ordered the current stream after every broadcast. A tensor that is not
    # contiguous is copied whole with the range of its first byte (its later
    # bytes are then written before their own ranges' broadcasts start).
    def _publish_and_post(self, deadline: float) -> int:
        broadcaster, version = self._broadcaster, self.version + 1
        copies = self._range_copies(broadcaster.ranges)
        try:
            return self._publish_direct(deadline, fill=lambda: broadcaster.post(version, lambda k: copies[k].run()))
        except BaseException:
            if broadcaster.posted:
                self._broadcaster = None  # part of a version is on the wire: this group is out of step
            raise

    def _range_copies(self, ranges) -> List[BatchedCopy]:
        """One BatchedCopy per byte range of the snapshot (Note [pipelined
        publish and broadcast]), built once per list of ranges."""
        if self._by_range is None or self._by_range[0] != ranges:
            groups: List[list] = [[] for _ in ranges]
            for k, (lo, hi) in enumerate(ranges):
                for e, first, count in self.layout.pieces_in(lo, hi):
                    src, dst = self._tensors[e.name], typed_view(self._buffer, e.offset, e.dtype, e.numel)
                    if src.is_contiguous():
                        groups[k].append((src.reshape(-1)[first : first + count], dst[first : first + count]))
                    elif first == 0:
                        groups[k].append((src, dst.view(src.shape)))
            # all but the first run beside a broadcast (Note [copies beside transfers] in _copy.py)
            self._by_range = (ranges, [BatchedCopy(g, items=None if k == 0 else BESIDE_TRANSFERS)
                                       for k, g in enumerate(groups)])
        return self._by_range[1]

    def _publish_direct(self, deadline: float, fill=None, version: Optional[int] = None) -> int:
        """`fill()` writes the snapshot instead of the copy from the source
        tensors, `version` replaces version + 1 (both: a weights Relay)."""
        c = self._counters
        c.store(ctl.WRITING, 1)
        try:
            for slot in list(self._done):
                self._reap(slot)  # a dead subscriber's event may never complete: never wait on it
                self._wait_slot(slot, ctl.READING, lambda reading: reading == 0, deadline)
                done = self._done.get(slot)
                if done and done[0] is not None:
                    done[0].wait()  # the snapshot write waits for its last pull, on the GPU
        except BaseException:
            c.store(ctl.WRITING, 0)  # nothing written yet
            raise
        # Note [a torn snapshot stays unpublished]: a fill that fails half way
        # (a relay's broadcast cut off) leaves WRITING set, so no pull reads the
        # mixed bytes; the next complete publish clears it.
        (fill or self._snapshot.run)()
        if self._publish_event is not None:
            self._publish_event.record()
        self.version = self.version + 1 if version is None else version
        c.store(ctl.PUBLISHED, self.version)
        c.store(ctl.WRITING, 0)
        return self.version

    def _publish_bucketed(self, deadline: float, fill=None, version: Optional[int] = None) -> int:
        """`fill(bucket, half)` fills a staging half instead of the copy from
        the source tensors (a weights Relay); `version` replaces version + 1."""
        c = self._counters
        base, version = self._bucket_seq, self.version + 1 if version is None else version
        members = 0
        for slot in list(self._done):
            self._reap(slot)
            if slot in self._done and c.load(ctl.slot_index(slot, ctl.OWNER)) > 0:
                taken = ctl.slot_index(slot, ctl.TAKEN)
                if c.load(taken) < base:  # joined since the last version: starts here
                    c.store(taken, base)
                members |= 1 << slot
        member_slots = [s for s in self._done if members >> s & 1]
        c.store(ctl.MEMBERS, members)
        c.store(ctl.STREAM_VERSION, version)
        c.store(ctl.STREAM_BASE, base)
        n = self.layout.n_buckets
        for k in range(n):
            seq = base + k + 1
            half = seq % 2
            for slot in member_slots:
                self._wait_slot(slot, ctl.TAKEN, lambda taken: taken >= seq - 2, deadline)
                done = self._done.get(slot)
                if done and done[half] is not None:
                    done[half].wait()
            if fill is None:
                self._pack(k, half).run()
            else:
                fill(k, half)
            if self._staging_events[half] is not None:
                self._staging_events[half].record()
            c.store(ctl.BUCKET_SEQ, seq)
        for slot in member_slots:
            self._wait_slot(slot, ctl.TAKEN, lambda taken: taken >= base + n, deadline)
        self._bucket_seq = base + n
        self.version = version
        c.store(ctl.PUBLISHED, version)
        return version

    def _pack(self, bucket: int, half: int) -> BatchedCopy:
        key = (bucket, half)
        if key not in self._packs:
            half_bytes = self.layout.buffer_bytes // 2
            pairs = []
            for e, first, count, offset in self.layout.pieces(bucket):
                src = self._tensors[e.name].view(-1)[first : first + count]
                pairs.append((src, typed_view(self._buffer, half * half_bytes + offset, e.dtype, count)))
            self._packs[key] = BatchedCopy(pairs)
            self.stats["path"] = self._packs[key].path
        return self._packs[key]

    # ---------------------------------------------------------------- other nodes

    def broadcast_to(self, group=None, *, src: Optional[int] = None, bucket_bytes: Optional[int] = None,
                     transport=None) -> None:
        """Also send every version from now on to the :class:`Relay` of each
        other node in the ``torch.distributed`` process ``group`` (None: the
        default group); ``src``: this process's global rank (default). A
        collective: every relay of the group constructs its ``Relay`` (or
        calls ``rejoin``) meanwhile. Each ``publish()`` then copies the
        snapshot and broadcasts it in ``bucket_bytes`` pieces (default 128
        MiB: Note [bucket size of a broadcast] in _broadcast.py), each piece
        as soon as it is copied, and returns once the broadcast completed
        here; one that fails or does not complete within the publisher's
        ``timeout`` raises :class:`BroadcastError` (the version is published
        here) and later publishes stay local until ``broadcast_to`` is
        called with a new group; so does ``broadcast_to`` itself when the
        relays do not take the current version (sent on joining) within
        ``timeout``. Direct mode only. ``transport``: another
        :class:`torch_ipc.Transport` instead of torch.distributed over ``group``
        (Note [cross-node transport]). See Note [relaying weights to other
        nodes] in relay.py."""
        self._check_open()
        if self.layout.bucket_bytes:
            raise ValueError("torch_ipc.weights: broadcast_to() needs a direct-mode Publisher "
                             "(it broadcasts from the snapshot)")
        from .._dist import transport_for
        from ._broadcast import DEFAULT_BUCKET_BYTES, Broadcaster

        self._broadcaster = None
        try:
            self._broadcaster = Broadcaster(self._buffer, self.layout, transport_for(transport, group), src,
                                            DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
                                            self.version, self.timeout)
        except TimeoutError as e:  # the current version, sent on joining, was not taken in time
            raise send_failed(self.version, "its broadcast to the relays", "broadcast_to", e) from e

    def _broadcast(self, version: int) -> None:
        """Broadcast the snapshot as `version` again (no local publish)."""
        self._finish_broadcast(version, lambda b: b.send(version))

    def _finish_broadcast(self, version: int, step) -> None:
        """`step(broadcaster)`; what fails there is the BroadcastError of `version`."""
        try:
            step(self._broadcaster)
        except Exception as e:
            self._broadcaster = None
            raise send_failed(version, "its broadcast to the relays", "broadcast_to", e) from e

    # ---------------------------------------------------------------- lifetime

    @property
    def subscribers(self) -> int:
        """Subscribers attached and alive (or not yet claimed their slot)."""
        for slot in list(self._done):
            self._reap(slot)
        return len(self._done)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("torch_ipc.weights.Publisher is closed")

    def close(self) -> None:
        """Stop publishing; idempotent. Subscribers keep the last version
        they pulled; their next pull raises PublisherGoneError once this
        process exits (or reattaches to a new publisher)."""
        if self._closed:
            return
        self._closed = True
        self._counters.store(ctl.PUBLISHER, 0)
        broadcaster, self._broadcaster = self._broadcaster, None
        if broadcaster is not None:
            broadcaster.close()  # the relays' serve() returns

    def _close_on_collect(self) -> None:
        self._broadcaster = None  # no collective from a finalizer
        self.close()

    def __repr__(self) -> str:
        mode = f"bucketed {self.layout.bucket_bytes} B" if self.layout.bucket_bytes else "direct"
        return (f"torch_ipc.weights.Publisher({len(self.layout.entries)} tensors, {self.layout.total_bytes} B, "
                f"{mode}, version {self.version})")
