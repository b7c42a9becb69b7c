"""Across nodes: every trainer rank sends each engine rank exactly the
intersections it needs, point to point through a Transport, in bounded
buckets (Note [sharded weights] in sharded.py)."""

import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import _dist
from ._copy import BESIDE_TRANSFERS, BatchedCopy  # all but a pair's first pack and last unpack
from ._layout import typed_view
from ._shard_layout import (
    Box,
    Held,
    Part,
    Take,
    held_from_message,
    intersect,
    relative,
    shards_message,
    sources_of,
    volume,
    wants_from_message,
    wants_message,
)
from ._shard_plan import Piece, ShardPlan, buckets, landing, pair_boxes

MAGIC = 0x7368_6172_6473_0001  # "shards" and message version 1
HEADER_WORDS = 3  # MAGIC, version, buckets of this pair


def _check_ranks(transport: _dist.Transport, trainers: Sequence[int], engines: Sequence[int]) -> None:
    ranks = list(trainers) + list(engines)
    if not trainers or not engines or len(set(ranks)) != len(ranks):
        raise ValueError(f"torch_ipc.weights: trainers {list(trainers)} and engines {list(engines)} must be "
                         "distinct ranks, at least one of each")
    if transport.rank not in ranks:
        raise ValueError(f"torch_ipc.weights: this process (rank {transport.rank}) is neither a trainer nor an "
                         "engine rank")


def _descriptions(transport: _dist.Transport, trainers: Sequence[int], mine: Any) -> Tuple[List[List[Held]], int]:
    """Every trainer rank's description (a collective of the whole group):
    (what each holds, in trainer order; their bucket bytes)."""
    held_by_rank, bucket = [], None
    for index, rank in enumerate(trainers):
        message = _dist.broadcast_json(transport, mine if transport.rank == rank else None, rank)
        got_rank, got_bucket, held = held_from_message(message)
        if got_rank != index or got_bucket <= 0 or bucket not in (None, got_bucket):
            raise ValueError(f"torch_ipc.weights: trainer {rank} says it is trainer rank {got_rank} with buckets of "
                             f"{got_bucket} bytes (expected rank {index}, buckets of {bucket or 'any'})")
        bucket = got_bucket
        held_by_rank.append(held)
    return held_by_rank, bucket


def _wants(transport: _dist.Transport, engines: Sequence[int], mine: Any,
           globals_: Mapping[str, Held]) -> List[List[Tuple[str, Box]]]:
    return [wants_from_message(_dist.broadcast_json(transport, mine if transport.rank == rank else None, rank),
                               globals_) for rank in engines]


def _itemsizes(sources: Mapping[str, List[Tuple[int, Held]]]) -> Dict[str, int]:
    return {name: torch.empty(0, dtype=rows[0][1].dtype).element_size() for name, rows in sources.items()}


# Note [polling a version]: a version's transfers are polled with sleeps of
# at most 20 us once its headers came (ROUND_POLL_SLEEP), not the 1 ms of
# other control waits: a pull or a publish returns at most that late after
# its last transfer (a 1.5 GB version is ~4 ms on NVLink). 100 us there cost
# the two-node pull ~0.15 ms a version (5.71 -> 5.54 ms, sharded_timeline.py on two
# H100s, 2026-11-26), and a version's rounds are a few ms: a few hundred
# wake-ups. An engine waiting for the next version to start (the headers)
# sleeps up to 100 us (POLL_SLEEP): at most 10000 wake-ups a second for as
# long as the trainer takes.
POLL_SLEEP = 1e-4
ROUND_POLL_SLEEP = 2e-5

IN_FLIGHT = 2  # rounds in flight: packing or unpacking one overlaps the transfer of the other


class _Schedule:
    """One side's rounds per peer (round r: bucket r; Note [sharded rounds]),
    and where each staged bucket lands in that peer's staging: IN_FLIGHT
    buffers, each as large as the largest bucket this side stages; a bucket
    sent or received in place stages nothing."""

    def __init__(self, ends: Sequence[Sequence[int]], direct: Sequence[Sequence[Any]], device: torch.device):
        self.rounds = [[[k] for k in range(len(e))] for e in ends]
        self.at: List[Dict[int, Tuple[int, int]]] = []  # per peer: bucket -> (slot, byte offset)
        self.staging: List[List[torch.Tensor]] = []
        for rounds, sizes, inplace in zip(self.rounds, ends, direct):
            at, most = {}, 0
            for r, ks in enumerate(rounds):
                used = 0
                for k in ks:
                    if inplace[k] is None:
                        at[k] = (r % IN_FLIGHT, used)
                        used += -(-sizes[k] // 256) * 256
                most = max(most, used)
            self.at.append(at)
            self.staging.append([torch.empty(most, dtype=torch.uint8, device=device) for _ in range(IN_FLIGHT)])

    def buffer(self, peer: int, k: int, nbytes: int) -> torch.Tensor:
        slot, offset = self.at[peer][k]
        return self.staging[peer][slot][offset : offset + nbytes]

    def count(self) -> int:
        return max((len(r) for r in self.rounds), default=0)


def _as_bytes(view: torch.Tensor):
    """A contiguous tensor as its bytes (the wire carries bytes: NCCL pairs a
    send and a receive by count and type), else None."""
    return view.reshape(-1).view(torch.uint8) if view.is_contiguous() else None


def _polled(transport: _dist.Transport, tensor: torch.Tensor) -> bool:
    """Whether a transfer of `tensor` is polled (NCCL) rather than waited for in turn (gloo, host staging)."""
    return tensor.device.type == "cuda" and not transport.through_host(tensor)


class _Waits:
    """The transfers of one version, each waited for by one deadline (Note [a
    bounded wait]): a polled one (NCCL) is ordered on the current stream at
    once and polled at the end (the host keeps queueing rounds meanwhile),
    any other one is waited for in turn, a version header at the end. A
    failure names the peer and says the group is gone."""

    def __init__(self, transport: _dist.Transport, timeout: Optional[float], version: int,
                 poll_sleep: Optional[float] = None):
        self.transport, self.timeout, self.version = transport, timeout, version
        self.poll_sleep = ROUND_POLL_SLEEP if poll_sleep is None else poll_sleep
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.pending: List[Tuple[Any, torch.Tensor, int]] = []  # waited for by close()

    def wait(self, works: Sequence[Any], ops: Sequence[_dist.P2P], ordered: bool = True) -> None:
        """``ordered``: the current stream waits for a polled transfer now (the
        unpack of a bucket or the reuse of its staging follows it there), and
        any other transfer is waited for now; else both wait for close()."""
        for work, (_, tensor, peer) in zip(works, ops):
            if ordered and not _polled(self.transport, tensor):
                self._finish(work, tensor, peer)
                continue
            if ordered:
                work.wait()
            self.pending.append((work, tensor, peer))

    def close(self) -> None:
        for work, tensor, peer in self.pending:
            self._finish(work, tensor, peer)
        self.pending = []

    def control(self, works: Sequence[Any], ops: Sequence[_dist.P2P]) -> None:
        """Wait for control transfers (headers) now, a polled one polled before
        its wait() (Note [waiting for a control message])."""
        for work, (_, tensor, peer) in zip(works, ops):
            self._finish(work, tensor, peer)

    def _finish(self, work: Any, tensor: torch.Tensor, peer: int) -> None:
        try:
            _dist.finish(work, tensor, self.deadline, _polled(self.transport, tensor), self.poll_sleep)
        except (TimeoutError, RuntimeError, ConnectionError) as e:
            raise lost(peer, self.version, self.timeout, e) from e


REBUILD = ("the group cannot be used again: destroy it, form a new one, and call ShardedPublisher.send_to() and "
           "ShardedSubscriber.remote() on it (Note [a dead engine rank] in torch_ipc/weights/sharded.py)")


def lost(peer: int, version: int, timeout: Optional[float], error: BaseException) -> Exception:
    """The error of a transfer of `version` with rank `peer` that failed or did not finish in `timeout` s."""
    kind = TimeoutError if isinstance(error, TimeoutError) else ConnectionError
    within = "" if timeout is None else f" within {timeout} s"
    return kind(f"torch_ipc.weights: version {version} was not exchanged with rank {peer}{within} "
                f"({type(error).__name__}: {error}): that rank died or the group broke; {REBUILD}")


class _Rounds:
    """Round r of every peer, IN_FLIGHT rounds in flight: ``post(r)`` starts
    round r (returns its works), ``finish(r, works)`` waits for them.
    ``advance(n)`` posts the rounds before n (a caller does other work
    while they are on the wire), ``drain()`` the rest and waits for all."""

    def __init__(self, schedule: _Schedule, post, finish):
        self.count, self.post, self.finish = schedule.count(), post, finish
        self.next = 0
        self.pending: List[Tuple[int, Any]] = []

    def advance(self, upto: int) -> None:
        while self.next < min(upto, self.count):
            if len(self.pending) == IN_FLIGHT:
                self.finish(*self.pending.pop(0))
            self.pending.append((self.next, self.post(self.next)))
            self.next += 1

    def drain(self) -> None:
        self.advance(self.count)
        for r, works in self.pending:
            self.finish(r, works)
        self.pending = []


def _round_buckets(schedule: _Schedule, r: int) -> Iterator[Tuple[int, int]]:
    """(peer, bucket) of round r, peer by peer."""
    for i, rounds in enumerate(schedule.rounds):
        if r < len(rounds):
            for k in rounds[r]:
                yield i, k


def _piece_view(staging: torch.Tensor, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(b - a for a, b in piece.box)
    return typed_view(staging, piece.offset, dtype, volume(piece.box)).view(shape)


class Sender:
    """A trainer rank's side; constructing it is a collective with every
    engine rank's Receiver (the descriptions and wants are exchanged once)."""

    def __init__(self, transport: _dist.Transport, trainers: Sequence[int], engines: Sequence[int],
                 held: Sequence[Held], views: Mapping[str, torch.Tensor], bucket_bytes: int):
        _check_ranks(transport, trainers, engines)
        if transport.rank not in trainers:
            raise ValueError(f"torch_ipc.weights: rank {transport.rank} is not one of the trainers {list(trainers)}")
        if bucket_bytes <= 0 or bucket_bytes % 256:
            raise ValueError(f"bucket_bytes must be a positive multiple of 256, not {bucket_bytes}")
        for view in views.values():
            transport.check_device(view)
        me = list(trainers).index(transport.rank)
        held_by_rank, bucket = _descriptions(transport, trainers, shards_message(me, held, bucket_bytes))
        sources = sources_of(held_by_rank)
        wants = _wants(transport, engines, None, {n: rows[0][1] for n, rows in sources.items()})
        itemsize = _itemsizes(sources)
        self.transport, self.engines = transport, list(engines)
        self.plans = [buckets(list(pair_boxes(w, sources, me)), itemsize, bucket) for w in wants]
        self.ends = _ends(self.plans, itemsize)
        boxes, wire = {h.name: h.box for h in held}, {h.name: h.dtype for h in held}

        def source(p: Piece) -> torch.Tensor:
            return views[p.name][relative(p.box, boxes[p.name])]

        def in_place(b: List[Piece]):
            """The shard's own bytes, when a lone piece can be sent from there."""
            return _as_bytes(source(b[0])) if len(b) == 1 and views[b[0].name].dtype == wire[b[0].name] else None

        # per peer, per bucket: the live shard's bytes to send in place, or the
        # copies into staging (Note [sends beside the snapshot] in sharded.py)
        self.direct = [[in_place(b) for b in plan] for plan in self.plans]
        device = next(iter(views.values())).device
        self.schedule = _Schedule(self.ends, self.direct, device)
        # posts_ahead(): the buckets decide, not the headers (asked once, not per publish)
        self._posts_ahead = _polled(transport, torch.empty(0, device=device))
        # Note [headers in the first round's batch]
        # The headers are posted in the batch of the first round when both go
        # the same way (an NCCL group on the buckets' GPU: one group call,
        # where a group of both backends moves the headers over gloo): a
        # batch of its own cost each side 0.1-0.2 ms of host before the first
        # bucket was posted (a timeline of one version on two H100s), and
        # NCCL cannot move a bucket before both sides posted it. A trainer
        # does so only when it sends to one engine rank: an engine whose first
        # round lands in its tensors checks the headers on the host before it
        # posts that round, and with several engines the trainer's header to
        # one could wait in NCCL behind its first bucket to another whose
        # engine waits in turn for a header stuck the same way. An engine
        # does so only when its first round lands in staging (Note [receives
        # posted before the header]): it checks the headers once that batch
        # completed, before anything lands in its tensors; its second round
        # is posted meanwhile. So its wait for a version to start (pull()'s
        # own timeout) covers the first round too, the smallest bucket
        # (~24 MiB of 1.5 GB, ~0.1 ms): a trainer that dies within it leaves
        # the pull waiting as for a version not yet started, not for the
        # transfer timeout. NCCL pairs the k-th send of a pair with its k-th
        # receive whatever the group calls.
        self._headers_ride = len(self.engines) == 1 and self._posts_ahead and device == transport.control_device \
            and self.schedule.count() > 0
        self.packs = [[None if direct[k] is not None else
                       BatchedCopy([(source(p), _piece_view(self.schedule.buffer(i, k, self.ends[i][k]), p,
                                                            wire[p.name])) for p in b],
                                   items=None if k == 0 else BESIDE_TRANSFERS)
                       for k, b in enumerate(plan)]
                      for i, (plan, direct) in enumerate(zip(self.plans, self.direct))]
        self.round_ops = _round_ops(self.schedule, self.direct, self.ends, self.packs, "send", self.engines)
        # one header per pair, made once: a version changes one word of it (Note [a round's host time])
        # (a blocking copy: a publish() on another stream than this one then finds it there)
        self.headers = [torch.tensor([MAGIC, 0, len(plan)], dtype=torch.int64).to(transport.control_device)
                        for plan in self.plans]
        self._version_words = [header[1:2] for header in self.headers]

    def posts_ahead(self) -> bool:
        """Whether start() only posts (NCCL: the transfers are polled at the
        end); else (gloo, host staging) it waits for each transfer in turn.
        The buckets decide, not the headers: a group of both backends
        ("cuda:nccl,cpu:gloo", what init_process_group() makes by default)
        moves its headers over gloo and its buckets over NCCL, and start()
        leaves a header's wait to finish()."""
        return self._posts_ahead

    def send(self, version: int, timeout: float) -> None:
        """Send `version` (the live shards' values) to every engine rank;
        every transfer done within `timeout` seconds, else TimeoutError (Note
        [a dead engine rank] in sharded.py)."""
        self.start(version, timeout)
        self.finish()

    def start(self, version: int, timeout: float) -> None:
        """Post the header and the first IN_FLIGHT rounds of `version`;
        ``finish()`` posts the rest and waits (Note [sends beside the
        snapshot] in sharded.py: the snapshot is queued in between)."""
        waits = _Waits(self.transport, timeout, version)
        for word in self._version_words:  # the last version's sends are all done: finish() waited for them
            word.fill_(version)  # one kernel (the header is on the GPU in an NCCL group); header[1] = took ~60 us
        header_ops = [("send", header, e) for header, e in zip(self.headers, self.engines)]
        riding = self._headers_ride  # Note [headers in the first round's batch]
        if not riding:  # waited for by finish(): NCCL's buckets queue behind them, gloo's wait in turn
            waits.wait(_post(self.transport, header_ops), header_ops, ordered=False)

        def post(r: int) -> Tuple[List[Any], List[_dist.P2P]]:
            packs, ops = self.round_ops[r]
            for pack in packs:
                pack.run()
            if r == 0 and riding:
                ops = header_ops + ops
            return _post(self.transport, ops), ops

        self._waits = waits
        self._rounds = _Rounds(self.schedule, post, lambda r, posted: waits.wait(*posted))
        self._rounds.advance(IN_FLIGHT)

    def finish(self) -> None:
        """Post the remaining rounds of the started version and wait for every transfer."""
        rounds, waits = self._rounds, self._waits
        self._rounds = self._waits = None
        rounds.drain()
        waits.close()


# Note [receives posted before the header]
# An engine rank posts the receives of the first IN_FLIGHT rounds together
# with the version's headers, before it has seen them, when those rounds
# land in staging only: the trainer ranks post their first sends right
# after their headers, and waiting for the headers on the host first (poll,
# copy to the host, check) kept the wire idle for ~0.3 ms per version.
# Nothing reaches the model before the headers are checked: the unpacks of
# those rounds run after the check, and a round received in place (into an
# engine tensor) is never posted early. A bad header raises as before; the
# group is out of step then either way.

# Note [a round's host time]
# Every round costs the host its Python and torch.distributed's posting
# (~0.1-0.2 ms on the H100 machine's host), and a round whose bucket is
# small is on the wire for less than that: a profile of one version (1.5 GB,
# one trainer rank to one engine rank) showed the engine's receives posted
# 0.2-0.25 ms apart and the trainer's sends waiting for them. So each side
# lists its rounds' transfers and copies once, and the version headers are
# tensors made once (a pinned copy per version took ~0.2 ms before the
# header could be posted).
def _round_ops(schedule: _Schedule, direct, ends, copies, kind: str, peers: Sequence[int]):
    """Per round: (the packs to run before its transfers or the unpacks
    after them, its transfers), in the order of _round_buckets."""
    rounds = []
    for r in range(schedule.count()):
        runs, ops = [], []
        for i, k in _round_buckets(schedule, r):
            data = direct[i][k]
            if data is None:
                runs.append(copies[i][k])
                data = schedule.buffer(i, k, ends[i][k])
            ops.append((kind, data, peers[i]))
        rounds.append((runs, ops))
    return rounds


def _post(transport: _dist.Transport, ops: List[_dist.P2P]) -> List[Any]:
    """``transport.batch(ops)``; a peer that is gone may make the post itself
    raise (gloo, once it saw the socket close): that error names the peers."""
    try:
        return transport.batch(ops)
    except (RuntimeError, ConnectionError) as e:
        raise ConnectionError(f"torch_ipc.weights: starting transfers with ranks {sorted({p for _, _, p in ops})} "
                              f"failed ({e}): one of them died or the group broke; {REBUILD}") from e


def _ends(plans: Sequence[List[List[Piece]]], itemsize: Mapping[str, int]) -> List[List[int]]:
    """The bytes of each bucket: the end of its last piece."""
    return [[b[-1].offset + volume(b[-1].box) * itemsize[b[-1].name] for b in plan] for plan in plans]


class Receiver:
    """An engine rank's side: constructing it is a collective with every
    trainer rank's Sender; ``pull()`` with each of their ``send()``."""

    def __init__(self, transport: _dist.Transport, trainers: Sequence[int], engines: Sequence[int],
                 dest: Mapping[str, torch.Tensor], wants: Mapping[str, Take], strict: bool, timeout: float):
        _check_ranks(transport, trainers, engines)
        if transport.rank not in engines:
            raise ValueError(f"torch_ipc.weights: rank {transport.rank} is not one of the engines {list(engines)}")
        for tensor in dest.values():
            transport.check_device(tensor)
        held_by_rank, bucket = _descriptions(transport, trainers, None)
        sources = sources_of(held_by_rank)
        error, plan = None, None
        try:
            plan = ShardPlan(sources, dest, wants, strict)
        except ValueError as e:
            error = e  # the group still hears this rank's (empty) wants, so it stays in step
        mine = wants_message(plan.wanted() if plan else [])
        mine_wants = _wants(transport, engines, mine, {n: rows[0][1] for n, rows in sources.items()})
        if error is not None:
            raise error
        itemsize = _itemsizes(sources)
        me = list(engines).index(transport.rank)
        self.transport, self.trainers, self.plan, self.timeout = transport, list(trainers), plan, float(timeout)
        self.plans = [buckets(list(pair_boxes(mine_wants[me], sources, t)), itemsize, bucket)
                      for t in range(len(trainers))]
        device = next(iter(dest.values())).device if dest else torch.device("cpu")
        self.ends = _ends(self.plans, itemsize)
        dtypes = {n: rows[0][1].dtype for n, rows in sources.items()}
        by_name: Dict[str, List[Tuple[torch.Tensor, Part]]] = {}
        for tensor, part in plan.parts:
            by_name.setdefault(part.name, []).append((tensor, part))

        def landings(p: Piece) -> List[torch.Tensor]:
            return [t[landing(part, p.box)] for t, part in by_name.get(p.name, ())
                    if intersect(part.box, p.box) == p.box]

        def in_place(b: List[Piece]):
            """The engine tensor's bytes a lone piece lands in, when it can be received there."""
            dsts = landings(b[0]) if len(b) == 1 else []
            return _as_bytes(dsts[0]) if len(dsts) == 1 and dsts[0].dtype == dtypes[b[0].name] else None

        self.direct = [[in_place(b) for b in plan_] for plan_ in self.plans]
        self.schedule = _Schedule(self.ends, self.direct, device)
        self.unpacks = [[None if direct[k] is not None else
                         BatchedCopy([(_piece_view(self.schedule.buffer(i, k, self.ends[i][k]), p, dtypes[p.name]), d)
                                      for p in b for d in landings(p)],
                                     items=None if k == len(plan_) - 1 else BESIDE_TRANSFERS)
                         for k, b in enumerate(plan_)]
                        for i, (plan_, direct) in enumerate(zip(self.plans, self.direct))]
        self.round_ops = _round_ops(self.schedule, self.direct, self.ends, self.unpacks, "recv", self.trainers)
        # Note [receives posted before the header]: only into staging, never into the model
        self.early = all(self.direct[i][k] is None for r in range(min(IN_FLIGHT, self.schedule.count()))
                         for i, k in _round_buckets(self.schedule, r))
        self._headers_ride = self.early and self.schedule.count() > 0 and device == transport.control_device and \
            _polled(transport, torch.empty(0, device=device))
        self.headers = [torch.zeros(HEADER_WORDS, dtype=torch.int64, device=transport.control_device)
                        for _ in self.trainers]
        self.version = 0
        self.broken: Optional[str] = None

    def pull(self, timeout: Optional[float] = None) -> int:
        """Receive the next version from every trainer rank into the engine's
        tensors. ``timeout``: how long to wait for it to start (None: as
        long as it takes; over NCCL its first bucket may count as part of the
        start: Note [headers in the first round's batch]); its buckets then
        arrive within the transfer timeout, else TimeoutError. A pull that
        raised (Ctrl-C included) may have left receives posted: later ones
        raise (the group is out of step; Note [a dead engine rank] in
        sharded.py)."""
        if self.broken is not None:
            raise RuntimeError(f"torch_ipc.weights: an earlier pull() of this engine rank stopped half way "
                               f"({self.broken}); {REBUILD}")
        try:
            return self._pull(timeout)
        except BaseException as e:
            self.broken = type(e).__name__
            raise

    def _pull(self, timeout: Optional[float]) -> int:
        header_ops = [("recv", header, t) for header, t in zip(self.headers, self.trainers)]
        first = _Waits(self.transport, timeout, self.version + 1, POLL_SLEEP)  # Note [polling a version]
        riding = self._headers_ride  # Note [headers in the first round's batch]
        header_works = [] if riding else _post(self.transport, header_ops)
        rounds_waits: List[_Waits] = []  # made once the header came: the transfer timeout starts there

        def post(r: int) -> Tuple[List[Any], List[_dist.P2P]]:
            ops = self.round_ops[r][1]
            if r == 0 and riding:  # the header's work is round 0's: it completes once both landed
                ops = header_ops + ops
                header_works.extend(_post(self.transport, ops))
                return header_works, ops
            return _post(self.transport, ops), ops

        def finish(r: int, posted) -> None:
            rounds_waits[0].wait(*posted)
            for unpack in self.round_ops[r][0]:
                unpack.run()

        rounds = _Rounds(self.schedule, post, finish)
        if self.early:  # Note [receives posted before the header]
            rounds.advance(IN_FLIGHT)
        first.control(header_works, header_ops)
        version = self._check_headers([op[1].tolist() for op in header_ops])
        rounds_waits.append(_Waits(self.transport, self.timeout, version))
        rounds.drain()
        rounds_waits[0].close()
        self.version = version
        return version

    def _check_headers(self, got: List[List[int]]) -> int:
        version = got[0][1]
        for (magic, v, n), plan, rank in zip(got, self.plans, self.trainers):
            if magic != MAGIC or v != version or v <= self.version or n != len(plan):
                raise ValueError(f"torch_ipc.weights: trainer {rank} sent header {[magic, v, n]} (expected version "
                                 f"{version} > {self.version} in {len(plan)} buckets); the group is out of step")
        return version
