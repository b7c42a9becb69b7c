"""Subscriber: the inference side. Attaches once, then pulls the newest
version into its own model (or views it in place)."""

import contextlib
import time
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import torch

from .. import _serialize
from .._closing import Closeable
from . import _control as ctl
from ._errors import BroadcastError, PublisherGoneError
from ._layout import typed_view
from ._plan import NameMap, PullPlan, Transform
from ._share import Share, named_tensors, receive

__all__ = ["Subscriber"]


def _wait_event(event, stream_device: torch.device) -> None:
    """Make the current stream of `stream_device` wait on `event` (host does not block)."""
    event.wait()  # the current stream of the event's own device
    if event.device == stream_device or stream_device.type != "cuda":
        return  # a copy to the CPU runs on that stream and returns when done
    hop = torch.cuda.Event()
    hop.record(torch.cuda.current_stream(event.device))
    torch.cuda.current_stream(stream_device).wait_event(hop)


def _record_event(event, stream_device: torch.device) -> None:
    """Record `event` after the work queued so far on the current stream of `stream_device`."""
    if event.device != stream_device and stream_device.type == "cuda":
        hop = torch.cuda.Event()
        hop.record(torch.cuda.current_stream(stream_device))
        torch.cuda.current_stream(event.device).wait_event(hop)
    event.record()


class Subscriber(Closeable):
    """Receive a :class:`Publisher`'s weights in another process.

    ``source`` is where the publisher's :meth:`Publisher.attach` message comes
    from: a torch_ipc :class:`~torch_ipc.Connection`, an end of a
    ``multiprocessing.Pipe``, a ``multiprocessing`` queue, or a function
    returning one of those (called again to reconnect after the publisher
    restarts). ``name_map``, ``transforms`` and ``strict`` say how published
    names meet the model's (Note [name maps] in _plan.py).

    Example::

        >>> sub = torch_ipc.weights.Subscriber(conn)            # doctest: +SKIP
        >>> version = sub.pull(into=model)                      # doctest: +SKIP
    """

    def __init__(
        self,
        source: Any,
        *,
        name_map: NameMap = None,
        transforms: Optional[Mapping[str, Transform]] = None,
        strict: bool = True,
        timeout: float = 60.0,
    ):
        self._source = source
        self._conn = None if callable(source) and not hasattr(source, "recv") and not hasattr(source, "get") else source
        self._name_map = name_map
        self._transforms = dict(transforms or {})
        self._strict = strict
        self.timeout = timeout
        self.version = 0  # the version last pulled into a model (0: none)
        self._share: Optional[Share] = None
        self._plans: Dict[int, tuple] = {}
        self.stats: Dict[str, Any] = {"path": "", "launches": 0, "bytes": 0, "pulls": 0, "reattached": 0,
                                      "transforms": 0, "last_pull_us": 0.0, "streamed": 0}
        share = self._next_share(timeout)
        if share is None:
            raise TimeoutError(f"torch_ipc.weights: no publisher attached within {timeout} s")
        self._attach(share)

    # ---------------------------------------------------------------- attach

    def _next_share(self, timeout: Optional[float]) -> Optional[Share]:
        if self._conn is None:
            try:
                self._conn = self._source()
            except (ConnectionError, FileNotFoundError, OSError):
                return None
        try:
            message = receive(self._conn, timeout)
        except (EOFError, ConnectionError, OSError):
            message = None
            if self._conn is not self._source:
                self._conn = None  # made by the function: ask it for a new one next time
        if message is not None and not isinstance(message, Share):
            raise TypeError(f"torch_ipc.weights: expected a Publisher.attach() message, got a {type(message).__name__}")
        return message

    def _attach(self, share: Share) -> None:
        self._detach()
        state = _serialize.loads(share.descriptor, weights_only=True)  # Note [weights_only] in _weights_only.py
        counters = ctl.Counters(state["control"])
        me = ctl.self_word()
        claimed = counters.compare_exchange(ctl.slot_index(share.slot, ctl.OWNER), -1, me)
        if claimed != -1:
            raise RuntimeError(f"torch_ipc.weights: subscriber slot {share.slot} is already claimed "
                               f"(by pid {ctl.word_pid(claimed)}): each attach() message is for one Subscriber")
        self._me = me
        self._share, self._buffer, self._counters = share, state["buffer"], counters
        self._slot = share.slot
        self._device = self._buffer.device
        self._index = {f: ctl.slot_index(share.slot, f) for f in (ctl.OWNER, ctl.READING, ctl.PULLS, ctl.TAKEN)}
        self._views = None

    def _detach(self) -> None:
        if self._share is None:
            return
        self._counters.compare_exchange(self._index[ctl.OWNER], self._me, 0)
        self._share = self._buffer = self._counters = self._views = None
        self._plans.clear()

    def publisher_alive(self) -> bool:
        """Whether the publisher this subscriber is attached to still runs."""
        share = self._share
        return share is not None and self._counters.load(ctl.PUBLISHER) == share.publisher \
            and ctl.word_alive(share.publisher)

    def _gone(self, during: str = "") -> PublisherGoneError:
        pid = ctl.word_pid(self._share.publisher) if self._share else "?"
        return PublisherGoneError(
            f"torch_ipc.weights: the publisher (pid {pid}) exited{during} and no new publisher has attached; "
            f"the model keeps version {self.version}")

    def _check_publisher(self) -> None:
        if not self.publisher_alive():
            raise self._gone()

    def _ensure_publisher(self) -> None:
        """Reattach to a restarted publisher if one has sent its message."""
        if self.publisher_alive():
            return
        share = self._next_share(0)
        if share is None:
            raise self._gone()
        self._attach(share)
        self.stats["reattached"] += 1

    # ---------------------------------------------------------------- pull

    @property
    def latest(self) -> int:
        """The newest published version (0: none yet)."""
        return self._counters.load(ctl.PUBLISHED) if self._share else 0

    def pull(self, into: Any, *, newer_than: int = 0, timeout: Optional[float] = None) -> int:
        """Copy the newest version into ``into`` (an ``nn.Module``: its
        state_dict's tensors; or a mapping of tensors), waiting up to
        ``timeout`` seconds for one newer than ``newer_than``. Returns the
        version copied. The copies are queued on the current stream (CUDA).

        Raises :class:`WeightsMismatchError` (nothing copied) when the model
        does not fit, :class:`PublisherGoneError` when the publisher exited
        and no new one attached (in direct mode the model keeps its previous
        weights), :class:`BroadcastError` when a streaming relay's version
        was cut off on its way while this pull copied it (the model holds
        part of it), ``TimeoutError``."""
        start = time.perf_counter()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._ensure_publisher()
        plan = self._plan(into)
        self._device = plan.device
        if self._share.layout.bucket_bytes:
            version = self._pull_bucketed(plan, deadline)
        else:
            version, streaming = self._enter_read(newer_than, deadline, streams=True)
            try:
                try:
                    if streaming:
                        self._copy_streaming(plan, version, deadline)
                        self.stats["streamed"] += 1
                    else:
                        self._copy_direct(plan)
                finally:  # whatever was queued must finish before the publisher overwrites
                    self._record_done()
            finally:
                self._counters.store(self._index[ctl.READING], 0)
        self.version = version
        self.stats["pulls"] += 1
        self.stats["last_pull_us"] = (time.perf_counter() - start) * 1e6
        return version

    def _copy_direct(self, plan: PullPlan) -> None:
        """Queue the copies of the snapshot; a relay's version still landing
        range by range, each range after its own event (Note [pulling a
        relayed version as it lands] in relay.py)."""
        events = self._share.range_events
        if events and events[-1] is not None and not events[-1].query():  # recorded in order: the last done, all are
            for k, ((lo, hi), event) in enumerate(zip(self._share.ranges, events)):
                self._after_publish(event)
                plan.copy_range(k, lo, hi).run()
            self._after_publish()
            plan.copy_rest().run()
        else:
            self._after_publish()
            plan.copy().run()
        plan.run_transforms()

    def _copy_streaming(self, plan: PullPlan, version: int, deadline: float) -> None:
        """Queue the copies of a relay's version while it lands: piece j once
        the relay counted it (then after its event, CUDA); the rest once it
        is published. A version cut off on the way raises BroadcastError (the
        model then holds part of it)."""
        c, ranges, events = self._counters, self._share.ranges, self._share.range_events
        for j, ((lo, hi), event) in enumerate(zip(ranges, events)):
            try:  # seq_cst: WRITING left STREAMING only after the last count was stored
                ctl.spin_until(lambda: c.load(ctl.BUCKET_SEQ) > j or c.load(ctl.WRITING) != ctl.STREAMING,
                               self._check_publisher, deadline, 2e-4)
            except PublisherGoneError:
                raise self._gone(f" during the pull of version {version} after {j} of {len(ranges)} pieces "
                                 "(a streaming relay: the model holds part of it)") from None
            if c.load(ctl.BUCKET_SEQ) <= j:
                raise BroadcastError(
                    f"torch_ipc.weights: version {version} was cut off on its way to this node after {j} of "
                    f"{len(ranges)} pieces; the model holds part of it: pull again")
            if event is not None:
                self._after_publish(event)
            plan.copy_range(j, lo, hi).run()
        if plan.needs_whole:
            ctl.spin_until(lambda: c.load(ctl.PUBLISHED) >= version, self._check_publisher, deadline, 2e-4)
            self._after_publish()
            plan.copy_rest().run()
            plan.run_transforms()

    def _plan(self, into: Any) -> PullPlan:
        cached = self._plans.get(id(into))
        if cached is not None and cached[0] is into:
            return cached[1]
        dest = named_tensors(into, "the model pulled into")
        plan = PullPlan(self._share.layout, self._buffer, dest, self._name_map, self._transforms, self._strict)
        self._plans[id(into)] = (into, plan)
        copy = plan.copy()
        self.stats.update(path=copy.path, launches=copy.launches, bytes=copy.bytes, transforms=len(plan.transforms),
                          why_foreach=copy.why_foreach)
        return plan

    def _enter_read(self, newer_than: int, deadline: float, streams: bool = False) -> Tuple[int, bool]:
        """Set READING and return the version to read (Note [weights
        consistency protocol]), and whether it is still landing on a
        streaming relay (``streams``: the caller takes one; Note [pulling a
        relayed version as it lands] in relay.py)."""
        c, reading = self._counters, self._index[ctl.READING]
        streams = streams and bool(self._share.ranges)

        def found() -> Optional[Tuple[int, bool]]:
            writing = c.load(ctl.WRITING)
            if not writing:
                version = c.load(ctl.PUBLISHED)
                return (version, False) if version > newer_than else None
            if writing == ctl.STREAMING and streams:
                version = c.load(ctl.STREAM_VERSION)
                return (version, True) if version > newer_than else None
            return None

        while True:
            c.store(reading, 1)
            got = found()
            if got is not None:
                return got
            c.store(reading, 0)
            # a relay's version is announced long before it landed: noticing it late delays
            # the copies of the pieces already there
            ctl.spin_until(lambda: found() is not None, self._check_publisher, deadline,
                           2e-4 if self._share.ranges else 1e-3)

    def _stream_device(self) -> torch.device:
        """The device whose current stream runs the copies: the model's."""
        device = self._device
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def _after_publish(self, event=None) -> None:
        """Order the current stream after the publish; a publisher that died
        before its copy completed leaves nothing to read."""
        event = self._share.publish_event if event is None else event
        if event is None or event.query():
            return
        if not self.publisher_alive():
            raise self._gone(" before its last publish completed")
        _wait_event(event, self._stream_device())

    def _record_done(self, half: int = 0) -> None:
        done = self._share.done_events[half]
        if done is not None:
            _record_event(done, self._stream_device())
        pulls = self._index[ctl.PULLS]
        self._counters.store(pulls, self._counters.load(pulls) + 1)

    def _pull_bucketed(self, plan: PullPlan, deadline: float) -> int:
        c, taken = self._counters, self._index[ctl.TAKEN]
        bit = 1 << self._slot

        def my_stream_started() -> bool:
            base = c.load(ctl.STREAM_BASE)
            return c.load(ctl.MEMBERS) & bit and c.load(taken) == base and c.load(ctl.BUCKET_SEQ) > base

        ctl.spin_until(my_stream_started, self._check_publisher, deadline)
        base, version = c.load(ctl.STREAM_BASE), c.load(ctl.STREAM_VERSION)
        n = self._share.layout.n_buckets
        for k in range(n):
            seq = base + k + 1
            try:
                ctl.spin_until(lambda: c.load(ctl.BUCKET_SEQ) >= seq, self._check_publisher, deadline)
                half = seq % 2
                event = self._share.staging_events[half]
                if event is not None:
                    self._after_publish(event)
            except PublisherGoneError:
                raise self._gone(f" during the pull of version {version} after {k} of {n} buckets "
                                 "(bucketed mode: the model holds a partial update)") from None
            plan.copy(k, half).run()
            self._record_done(half)
            c.store(taken, seq)
        return version

    # ---------------------------------------------------------------- view

    @contextlib.contextmanager
    def view(self, *, newer_than: int = 0, timeout: Optional[float] = None) -> Iterator[Dict[str, torch.Tensor]]:
        """Zero-copy views of the newest version, for the ``with`` block:
        ``{name: tensor}`` on the publisher's memory. Do not write to them.
        The publisher's next publish waits until the block ends (GPU reads
        queued inside it on the current stream are waited for on the GPU).
        Direct mode only."""
        if self._share is None or self._share.layout.bucket_bytes:
            raise RuntimeError("torch_ipc.weights: view() needs a direct-mode publisher")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._ensure_publisher()
        self._enter_read(newer_than, deadline)  # never a version still landing
        self._device = self._buffer.device
        try:
            self._after_publish()
            if self._views is None:
                self._views = {e.name: typed_view(self._buffer, e.offset, e.dtype, e.numel).view(e.shape)
                               for e in self._share.layout.entries}
            yield dict(self._views)
            self._record_done()
        finally:
            self._counters.store(self._index[ctl.READING], 0)

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Give the slot back and drop the mapping; idempotent."""
        self._detach()
