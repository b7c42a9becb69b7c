"""Relay: a trainer's weights on another node. One process per node receives
each version over torch.distributed and publishes it there with a Publisher,
so the node's Subscribers attach and pull as on the trainer's node.

Note [relaying weights to other nodes]
CUDA IPC ends at the machine's edge. The trainer's Publisher joins a
torch.distributed group with one Relay per other node
(``publisher.broadcast_to(group)``) and, after each local publish,
broadcasts its snapshot: a header of int64s (MAGIC, kind, version, total
bytes), then the snapshot's bytes in ``bucket_bytes`` pieces, straight from
the snapshot (no staging on the trainer). The layout goes once, as JSON, when
the group forms (never pickle: the group is not authenticated; the relay
checks every field and computes the offsets itself). Each relay publishes
what it receives through a local Publisher made for the layout, with the
trainer's version number, so versions are the same end to end:
  direct mode (default): the buckets land in the local snapshot itself,
    inside the Publisher's write window (Note [weights consistency
    protocol] in _control.py): no staging memory; local pulls of the
    previous version run until the header of the next one arrives; on a
    streaming relay pulls of the new one copy each bucket as it lands (Note
    [pulling a relayed version as it lands]). A broadcast cut off half way
    leaves WRITING set (Note [a torn snapshot stays unpublished] in
    publisher.py).
  bucketed (``Relay(..., bucketed=True)``): the local Publisher is in
    bucketed mode with the broadcast's bucket size, and each bucket lands in
    a staging half that the local subscribers copy out of while the next
    bucket is on the wire (checkpoint-engine's pipeline). Staging memory:
    two buckets; the node's subscribers must be in pull() meanwhile.
A relay that dies takes its local Publisher with it: its subscribers get
PublisherGoneError, and reattach to a restarted relay listening at the same
address. The group itself does not survive a member's death: the trainer's
publish raises BroadcastError and the survivors' receive raises it; form a
new group, then ``broadcast_to(new_group)`` on the trainer and
``rejoin(new_group)`` on the surviving relays (their subscribers notice
nothing) while the restarted one constructs its Relay. Where another
transport would plug in: Note [cross-node transport] in torch_ipc/_dist.py.

Note [pulling a relayed version as it lands]
With NCCL a direct relay published a version once its buckets were posted
(the publish event after the current stream waits for them): a subscriber's
whole copy (1.95 ms for 1.5 GiB on an H100) ran after the wire (4.5 ms
over NVLink), publish -> remote pull at 58% of a raw broadcast. A streaming
relay (``stream=True``) lets a pull copy bucket k while bucket k + 1 is on
the wire. In its write window it stores STREAM_VERSION = v, BUCKET_SEQ = 0,
then WRITING = STREAMING (Note [weights consistency protocol] in
_control.py); as each bucket lands (NCCL: once the current stream waits for
it; host memory: once it arrived) it records that bucket's IpcEvent
(``Publisher.range_events``, sent in the Share; consecutive buckets share
one past MAX_RANGE_EVENTS, as each subscriber opens them all) and counts it
in BUCKET_SEQ; then it publishes v as usual. A pull that sees STREAMING
with a newer STREAM_VERSION (after setting READING, as always) copies piece
j once BUCKET_SEQ > j, behind its event, then waits for the publish for
whatever needs whole tensors (non-contiguous destinations, transforms). A
pull that finds v published but not landed (the relay posted faster than
the wire) does the same with the events alone. It never reads a byte
before it landed, and the next version's write waits for its done event as
before. The price is the partial update: a version cut off on its way (its
trainer died) leaves such a model with part of it, and the pull raises
BroadcastError (the relay stores WRITING = 1, "writing, not streaming");
with NCCL a copy queued behind an unfinished transfer ran on whatever landed
if NCCL aborted it, before this too. Host memory over gloo stays all or
nothing unless ``stream=True``. Why not a bucketed relay by default, which
pipelines the same way: the relay then waits (host) for every subscriber to
take every bucket, so an engine that is not in pull() holds back the relay,
the group's broadcast and so the trainer; a streaming relay never waits for
its subscribers within a version. A subscriber of a streaming relay polls
every 0.2 ms at most (1 ms otherwise): noticing a version late leaves the
landed buckets to be copied in a burst after the wire.
Measured, and so off by default: on two H100s (NVLink, 2026-11-26 14:2x
UTC, `distributed_bench.py --device cuda --backend nccl --budget-s 35
--iters 6`, one run each on one machine, 1.5 GiB in 128 MiB buckets),
publish -> remote pull took 7.51 ms streaming against 6.57 ms with
``stream=False`` (61% and 70% of a raw broadcast), and the broadcast
itself 89% against 91%: the pull's stream waits on up to 12 interprocess
events, each wait delaying the next copy, and the relay records one per
bucket; the overlap does not pay for that at these sizes.

Note [closing a group]
``Publisher.close()`` broadcasts a CLOSE header (the relays' ``serve()``
returns) and leaves the group to its owner, as ``Relay.close()`` does. With
NCCL, ``destroy_process_group()`` on one rank returns only once every rank
of the group on the same host has destroyed its communicator as well (NCCL
tears down what the ranks of one host share together): a trainer and a relay
on one machine (a test, a benchmark) must close and destroy concurrently,
each in its own process, not one after the other's return. Ranks on other
hosts do not hold it up, and a rank that died no longer counts.
"""

import threading
import time
from typing import Any, List, Optional, Union

import torch

from .. import _dist
from .._closing import Closeable
from . import _broadcast as wire
from . import _control as ctl
from ._errors import BroadcastError
from ._layout import Layout
from .publisher import Publisher

__all__ = ["Relay"]


class Relay(Closeable):
    """Receive a trainer's versions on another node and publish them here.

    ``group``: the ``torch.distributed`` process group shared with the
    trainer's :meth:`Publisher.broadcast_to` (None: the default group);
    ``src``: the trainer's global rank. Constructing the Relay receives the
    layout (a collective with the trainer's ``broadcast_to``). Then
    :meth:`serve` (or :meth:`receive`, one version at a time) receives and
    publishes each version; subscribers on this node attach with
    :meth:`attach` or through :meth:`listen`, and pull as from a Publisher.
    ``transport``: another :class:`torch_ipc.Transport` instead of
    torch.distributed over ``group`` (Note [cross-node transport]).
    ``stream``: let pulls copy a direct relay's version while it lands
    (Note [pulling a relayed version as it lands]; off by default: slower
    end to end where it was measured).

    Example::

        >>> dist.init_process_group("gloo", ...)                # doctest: +SKIP
        >>> relay = torch_ipc.weights.Relay(src=0)              # doctest: +SKIP
        >>> relay.listen(address, authkey=key)                  # doctest: +SKIP
        >>> relay.serve()          # until the trainer closes   # doctest: +SKIP
    """

    def __init__(
        self,
        group: Any = None,
        src: int = 0,
        *,
        device: Union[None, str, torch.device] = None,
        bucketed: bool = False,
        stream: bool = False,
        max_subscribers: int = 8,
        timeout: float = 60.0,
        transport: Optional[_dist.Transport] = None,
    ):
        self._device = None if device is None else torch.device(device)
        self._bucketed = bool(bucketed)
        self._stream = bool(stream)
        self._max_subscribers = max_subscribers
        self.timeout = timeout
        self.version = 0
        self._lock = threading.RLock()  # attach (listener thread) against publish
        self._conns: List[Any] = []  # attached subscribers' connections: re-attached to a new local publisher
        self._listener = None
        self._publisher: Optional[Publisher] = None
        self._closed = False
        self._join(_dist.transport_for(transport, group), src)

    # ---------------------------------------------------------------- the group

    def _join(self, transport: _dist.Transport, src: int) -> None:
        src = int(src)
        if src == transport.rank:
            raise ValueError(f"torch_ipc.weights: a Relay receives from the publisher's rank; src={src} is its own")
        layout, bucket, device_type, _ = wire.layout_from_message(_dist.broadcast_json(transport, None, src))
        device = self._device or (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
                                  else torch.device("cpu"))
        wire.check_fits(layout.total_bytes, device)
        local = Layout.build([(e.name, e.dtype, e.shape) for e in layout.entries], bucket if self._bucketed else 0)
        self._transport, self.src, self._ranges = transport, src, wire.buckets(layout.total_bytes, bucket)
        with self._lock:
            old = self._publisher
            stream = self._stream  # Note [pulling a relayed version as it lands]
            self._per_event, events = wire.event_ranges(self._ranges) if stream and not self._bucketed else (1, [])
            if old is None or old.layout != local or old.device != device or \
                    list(old.ranges) != events:
                self._replace_publisher(Publisher._for_layout(local, device, max_subscribers=self._max_subscribers,
                                                              timeout=self.timeout, ranges=events))
        self._transport.check_device(self._publisher._buffer)

    def rejoin(self, group: Any = None, src: int = 0, *, transport: Optional[_dist.Transport] = None) -> None:
        """Join a new group after the old one broke (a member died): a
        collective with the trainer's ``broadcast_to(group)``. The local
        publisher and its subscribers stay when the layout is the same."""
        self._check_open()
        self._join(_dist.transport_for(transport, group), src)

    def _replace_publisher(self, publisher: Publisher) -> None:
        old, self._publisher = self._publisher, publisher
        if old is not None:
            old.close()  # its subscribers' next pull reattaches to the new one through their connection
        conns, self._conns = self._conns, []
        for conn in conns:
            self._attach_locked(conn)

    # ---------------------------------------------------------------- subscribers

    def attach(self, conn: Any) -> int:
        """Attach one subscriber on this node, as :meth:`Publisher.attach`."""
        self._check_open()
        with self._lock:
            return self._attach_locked(conn)

    def _attach_locked(self, conn: Any) -> int:
        slot = self._publisher.attach(conn)
        self._conns.append(conn)
        return slot

    def listen(self, address: Any = None, *, authkey: Optional[bytes] = None):
        """Accept subscribers at ``address`` (as :func:`torch_ipc.listen`) in
        a background thread and attach each; returns the Listener. A
        Subscriber made with a function that connects here (e.g.
        ``lambda: torch_ipc.connect(address, authkey=key)``) reattaches to a
        restarted relay by itself."""
        from ..mp.connection import listen

        self._check_open()
        if self._listener is not None:
            raise RuntimeError("torch_ipc.weights: this Relay listens already")
        self._listener = listen(address, authkey=authkey)
        threading.Thread(target=self._accept_loop, args=(self._listener,), name="torch_ipc-relay-accept",
                         daemon=True).start()
        return self._listener

    def _accept_loop(self, listener) -> None:
        while not self._closed:
            try:
                conn = listener.accept()
            except Exception:
                return  # closed
            try:
                self.attach(conn)
            except Exception:
                conn.close()  # no free slot, or closed meanwhile: the subscriber sees EOF

    @property
    def subscribers(self) -> int:
        """Subscribers attached on this node and alive."""
        with self._lock:
            return self._publisher.subscribers if self._publisher else 0

    # ---------------------------------------------------------------- versions

    def receive(self) -> Optional[int]:
        """Receive the next version and publish it here; returns its number,
        or None when the trainer closed its Publisher. Raises
        :class:`BroadcastError` when the group broke (this node keeps its
        last complete version; see :meth:`rejoin`)."""
        self._check_open()
        try:
            magic, kind, version, total = wire.receive_header(self._transport, self.src)
        except Exception as e:
            raise self._broken(e) from e
        layout = self._publisher.layout
        if magic != wire.MAGIC or kind not in (wire.VERSION, wire.CLOSE) or total != layout.total_bytes:
            raise ValueError(f"torch_ipc.weights: a malformed version header from rank {self.src}: "
                             f"{[magic, kind, version, total]} (layout of {layout.total_bytes} bytes)")
        if kind == wire.CLOSE:
            return None
        if version <= 0:
            raise ValueError(f"torch_ipc.weights: version {version} from rank {self.src}")
        deadline = time.monotonic() + self.timeout
        with self._lock:
            try:
                if self._bucketed:
                    self._publisher._publish_bucketed(deadline, fill=self._fill_half, version=version)
                else:
                    self._publisher._publish_direct(deadline, fill=lambda: self._fill_snapshot(version),
                                                    version=version)
            except TimeoutError:
                raise
            except Exception as e:
                if self._bucketed:  # a stream cut off: its subscribers get PublisherGoneError, then reattach
                    self._replace_publisher(Publisher._for_layout(
                        self._publisher.layout, self._publisher.device, max_subscribers=self._max_subscribers,
                        timeout=self.timeout))
                raise self._broken(e) from e
        self.version = version
        return version

    def serve(self, versions: Optional[int] = None) -> int:
        """Receive and publish versions until the trainer closes its Publisher
        (or ``versions`` of them arrived); returns the last version."""
        n = 0
        while versions is None or n < versions:
            if self.receive() is None:
                break
            n += 1
        return self.version

    def _fill_snapshot(self, version: int) -> None:
        """Post every bucket, then wait (Note [posting a version ahead] in
        _broadcast.py). A CUDA snapshot is published once the current stream
        waits for the buckets (its subscribers' copies queue behind them);
        host memory once they arrived, each within the relay's timeout. A
        streaming relay says how far the version has come as it goes (Note
        [pulling a relayed version as it lands])."""
        pub = self._publisher
        c, buffer, deadline = pub._counters, pub._buffer, time.monotonic() + self.timeout
        if pub.ranges:
            c.store(ctl.STREAM_VERSION, version)
            c.store(ctl.BUCKET_SEQ, 0)
            c.store(ctl.WRITING, ctl.STREAMING)
        try:
            pieces = [buffer[lo:hi] for lo, hi in self._ranges]
            as_posted = bool(pub.ranges) and buffer.is_cuda  # landed = ordered on the stream: say so at once
            works = []
            for k, piece in enumerate(pieces):
                works.append(self._transport.broadcast(piece, self.src))
                if as_posted:
                    works[k].wait()
                    self._landed(k)
            for k, (work, piece) in enumerate(zip(works, pieces)):
                if not as_posted:
                    self._await_bucket(work, piece, deadline)
                    self._landed(k)
        except BaseException:
            if pub.ranges:
                c.store(ctl.WRITING, 1)  # cut off: streaming subscribers stop; the snapshot stays unpublished
            raise

    def _await_bucket(self, work: Any, piece: torch.Tensor, deadline: float) -> None:
        if piece.is_cuda:
            work.wait()  # gloo: the host waits; NCCL: the stream does
            return
        try:
            wire.await_work(work, piece, deadline)
        except TimeoutError:
            raise RuntimeError(f"a bucket did not arrive within {self.timeout} s") from None

    def _landed(self, k: int) -> None:
        """Bucket k is there (CUDA: ordered on the current stream): record the
        event of its group once the group is complete, and count it."""
        pub = self._publisher
        if not pub.ranges or ((k + 1) % self._per_event and k + 1 != len(self._ranges)):
            return
        j = k // self._per_event
        if pub.range_events[j] is not None:
            pub.range_events[j].record()
        pub._counters.store(ctl.BUCKET_SEQ, j + 1)

    def _fill_half(self, bucket: int, half: int) -> None:
        lo, hi = self._ranges[bucket]
        start = half * (self._publisher.layout.buffer_bytes // 2)
        self._transport.broadcast(self._publisher._buffer[start : start + hi - lo], self.src).wait()

    def _broken(self, e: Exception) -> BroadcastError:
        return BroadcastError(
            f"torch_ipc.weights: the broadcast from rank {self.src} failed ({type(e).__name__}: {e}); this node "
            f"keeps version {self.version}; form a new group and call rejoin()")

    # ---------------------------------------------------------------- lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("torch_ipc.weights.Relay is closed")

    def close(self) -> None:
        """Stop listening and close the local publisher (its subscribers keep
        the last version they pulled); idempotent. Leaves the group alone."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        if self._publisher is not None:
            self._publisher.close()
        for conn in self._conns:
            try:
                conn.close()
            except Exception:
                pass
        self._conns = []


    def __repr__(self) -> str:
        mode = "bucketed" if self._bucketed else "direct"
        return f"torch_ipc.weights.Relay(from rank {getattr(self, 'src', '?')}, {mode}, version {self.version})"
