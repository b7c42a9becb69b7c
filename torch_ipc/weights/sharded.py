"""Sharded weights: every trainer rank publishes its own shard; every engine
rank pulls the slices its own layout needs.

Note [sharded weights]
A trainer that is FSDP2 or tensor parallel over N ranks holds each global
tensor as N slices (DTensor Shard/Replicate placements, or LocalShard
descriptions); an engine with tensor parallelism M wants other slices, under
its own names (fused qkv / gate_up: several global tensors, each cut, then
concatenated). Nothing needs the full tensor anywhere:
- each trainer rank publishes its slices through its own direct-mode
  Publisher (a snapshot per rank; a replica, a Replicate placement on a mesh
  dim, is published by the rank at coordinate 0 of that dim only) and
  describes them once: global shape, dtype, box (start and stop per dim);
- an engine rank collects the N descriptions and checks them (one global
  shape and dtype per name, slices that tile the tensor: no partial overlap,
  no hole), turns its wants (:class:`Take`) into boxes and intersects them
  with the trainer boxes once: the plan, a list of (trainer rank, box) ->
  (engine tensor, slices) copies;
- one node: the engine rank maps the N snapshots zero-copy (torch_ipc
  descriptors) and runs the plan's copies as one BatchedCopy (CUDA: batched
  launches, peer reads over NVLink; CPU: one foreach copy), with dtype
  conversion. No mixed versions: it sets READING on every snapshot, then
  reads every WRITING and PUBLISHED (the Dekker pairing of Note [weights
  consistency protocol], once per snapshot), and copies only when all N hold
  the same version v; otherwise it clears them and waits. A snapshot cannot
  change while its READING is set, so the copy is version v of every shard.
- across nodes: trainer and engine ranks share a Transport (a
  torch.distributed group by default: NCCL batch_isend_irecv, gloo for CPU).
  Constructing the Sender / Receiver exchanges the descriptions and the
  engines' wants once (JSON, every field checked, Note [counts from a peer]);
  both sides then compute the same schedule per (trainer, engine) pair: the
  intersections, cut into pieces of at most ``bucket_bytes``, packed into
  buckets. Each version: a header per pair (MAGIC, version, buckets), then
  rounds in which every trainer sends its k-th bucket to every engine at
  once (all sources in parallel, no rank-0 broadcast; Note [sharded
  rounds]); staging is two buckets per peer. The engine checks that every
  trainer sends the same version, newer than its last. A dead member:
  Note [a dead engine rank].

Note [sharded rounds]
Round r moves bucket r of every (trainer, engine) pair, all pairs in one
``batch`` (with NCCL one group call); two rounds are in flight (packing
bucket r+1 on the sender, unpacking bucket r-1 on the receiver, overlap the
transfer of bucket r). Both sides compute the buckets once, from the same
plan, so the k-th send of a pair meets the k-th receive: the intersections
of a pair, in plan order, packed into as few buckets of at most
``bucket_bytes`` (256 MiB by default) as that order allows, each piece
256-byte aligned in its bucket's staging (a piece larger than a bucket is
cut into row ranges first). A bucket of one piece is sent from the live
shard and received into the engine tensor in place when each side is
contiguous (and of the wire's dtype); every other bucket is packed into a
staging buffer by one BatchedCopy and unpacked by one (with the dtype
conversion the engine asks for). Staging: two buckets per peer, per side.
Why pack: NCCL costs about 30 us per operation of a pair whatever its size;
the earlier schedule (a piece of 256 KiB or more sent alone, in place)
spent 105 operations on a 1.5 GB model of 105 tensors and reached 55% of
one raw send of the same bytes on two H100s; packed, a version is
about bytes / bucket_bytes operations per pair, and a packing copy (device
memory, ~2 TB/s) is hidden behind the wire except for the first bucket's
pack and the last one's unpack. So a pair's buckets ramp: the first may
hold bucket_bytes / RAMP (8), each next one twice the one before, up to
bucket_bytes, and towards the end half of what is left (no less than the
first): on a 1.5 GB pair of 256 MiB buckets, 12 operations whose first and
last are ~22 MiB, instead of 7 whose first and last are ~250 MiB
(benchmarks/sharded_bench.py --bucket-mib and --ramp measure both).

Note [a dead engine rank]
A version is one collective of every trainer and engine rank: the trainers'
publish() and the engines' pull(). When an engine rank (or its node) dies,
the transfers to it never finish: NCCL's kernel spins until its watchdog
aborts the process, gloo's send fails once it sees the socket close or
waits once its buffer is full. So every transfer of a version is bounded:
publish() raises BroadcastError (its TimeoutError or ConnectionError names
the rank) when the version has not reached every engine rank within
send_to's ``timeout`` (that includes an engine rank that is alive but does
not call pull(): choose the timeout above the longest gap between its
pulls); an engine rank's pull() raises TimeoutError when a version it has
started to receive stops for the receiver's ``timeout`` (a trainer rank
died, or stopped sending after its own error), and waits for a version to
start as long as its own ``timeout`` argument says. The other engine ranks
do not keep going on the same group: a torch.distributed group with a dead
member is unusable with NCCL (its communicator must be aborted), and every
round is one batch over all pairs; with gloo a transfer is still posted on
the broken pair. The version published on the trainers' node stays local
(ShardedSubscriber keeps pulling it). To go on: destroy the group on the
survivors, form a new one without the dead rank (or with its replacement),
and construct ShardedPublisher.send_to() / ShardedSubscriber.remote() again:
neither has state beyond its plan. A failure half way leaves the engine's
tensors partly updated, as bucketed mode does. The sends read the trainer's
live shards (Note [sends beside the snapshot]): after a timeout the
transfers still queued to a slow engine rank are not waited for, so the
next optimizer step may overwrite bytes they have yet to read, and that
rank's pull, if it ever completes, holds a mix of two versions; it is to be
rebuilt with the group either way. A publish() or pull() stopped by Ctrl-C
leaves the group out of step as well: the trainer's later versions stay
local, the engine's later pulls raise.

Note [sends beside the snapshot]
A trainer rank that sends to other nodes packs each bucket from its live
shards, not from its local snapshot, and the snapshot copy runs on a side
stream beside the packs and sends. Before, publish() queued the whole
snapshot copy (1.5 GB: ~1 ms on an H100) and the version header behind it
on the current stream, and the engines learnt of the version only then: a
profile of one version to one engine rank (H100 x2) showed the copy, then
0.4 ms until the header was posted, then 0.75 ms until the engine posted
its first receive. Now the header is posted first, the engines post their
receives while the first buckets are packed, and the copy overlaps the
wire. In order: the local protocol waits until no engine rank on this
node reads the snapshot (a timeout there sends nothing), then the header
and the first two rounds are posted, then the snapshot copy is queued,
then the other rounds. The snapshot copy itself goes to the copy engine (one DMA copy per
tensor, csrc/cuda/copy_engine.cpp): as a kernel on the side stream its
thousands of blocks took every SM for its ~1 ms, and the packs and NCCL's
kernels queued behind them (the same profile, with the side stream: the
header and the first pack started only as the copy ended). A tensor the
copy engine cannot take (a dtype conversion, short strided rows) stays with
the kernel. The live shards cannot change meanwhile: publish() returns once every
transfer is done, and the current stream waits for the side stream before
it returns, so the next optimizer step writes after the copy has read. The
local protocol (Note [weights consistency protocol]) is unchanged: the
side stream is the publisher's current stream during its publish().

Note [no snapshot without local engine ranks]
The local snapshot is what engine ranks on the trainer's node pull. A
trainer rank that sends to other nodes and has no engine rank attached on
its own node (disaggregated engines) copies none: each publish() only
sends, and the snapshot keeps the last version it copied, with that
version's number in its control block (0 before any), so what a later
local engine rank finds is always labelled with its own version: it pulls
that one, or waits for the next publish(), which copies again. With a
local engine rank attached, the copy runs beside the sends on the copy
engine (Note [sends beside the snapshot]); there, on two H100s, it slowed
the NCCL sends it overlapped by about half (both read the same HBM).
"""

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch

from .. import _dist
from .._closing import Closing
from ._errors import send_failed
from ._shard_layout import LocalShard, Take, describe_shards, shards_message
from ._shard_local import LocalShards
from ._shard_remote import Receiver, Sender
from ._share import named_tensors, send
from .publisher import Publisher

__all__ = ["ShardedPublisher", "ShardedSubscriber", "Take", "LocalShard"]


class ShardedPublisher(Closing):
    """Publish one trainer rank's shards of a model (Note [sharded weights]).

    ``source``: {global name: DTensor | LocalShard | tensor} (an
    ``nn.Module`` of DTensors works too); ``rank``: this trainer rank (0..N-1,
    the order of the engine's sources). Engine ranks on this node attach
    with :meth:`attach` (one message per engine rank, as Publisher.attach);
    engine ranks on other nodes through :meth:`send_to`.

    Example (each FSDP2 trainer rank)::

        >>> pub = torch_ipc.weights.ShardedPublisher(model, rank=dist.get_rank())  # doctest: +SKIP
        >>> pub.attach(conn_to_engine_rank)                                         # doctest: +SKIP
        >>> train_step(); pub.publish()                                             # doctest: +SKIP
    """

    def __init__(self, source: Union[torch.nn.Module, Mapping[str, Any]], *, rank: int,
                 dtype: Optional[torch.dtype] = None, max_subscribers: int = 8, timeout: float = 60.0):
        items = source.state_dict(keep_vars=True) if isinstance(source, torch.nn.Module) else source
        tensors, held = describe_shards(items)
        if dtype is not None:
            held = [type(h)(h.name, dtype, h.global_shape, h.box) for h in held]
        self.rank = int(rank)
        self._held = held
        self._tensors = tensors
        self._publisher = Publisher(tensors, dtype=dtype, max_subscribers=max_subscribers, timeout=timeout)
        self._sender: Optional[Sender] = None
        self._side: Optional[torch.cuda.Stream] = None  # Note [sends beside the snapshot]

    @property
    def version(self) -> int:
        return self._publisher.version

    def attach(self, conn) -> int:
        """Attach one engine rank on this node: sends this rank's description, then its snapshot."""
        send(conn, shards_message(self.rank, self._held))
        return self._publisher.attach(conn)

    def send_to(self, *, trainers: Sequence[int], engines: Sequence[int], transport: Optional[_dist.Transport] = None,
                group: Any = None, bucket_bytes: int = 256 << 20, timeout: float = 300.0) -> None:
        """From now on, also send every version to the engine ranks ``engines``
        of other nodes (ranks of ``group`` or ``transport``; ``trainers``: the
        trainer ranks' ranks, in trainer-rank order). A collective with every
        trainer rank's ``send_to`` and every engine rank's
        :class:`RemoteShardedSubscriber`. Each later ``publish()`` sends its
        version to every engine rank (they are in ``pull()`` meanwhile) in
        buckets of at most ``bucket_bytes`` (Note [sharded rounds]; staging:
        two per engine rank); it raises BroadcastError when an engine rank
        has not taken it within ``timeout`` seconds (Note [a dead engine rank])."""
        transport = _dist.transport_for(transport, group)
        self._sender = None
        self._sender = Sender(transport, trainers, engines, self._held, self._tensors, int(bucket_bytes))
        self._send_timeout = float(timeout)
        self._publisher._snapshot_by_engine()  # Note [sends beside the snapshot]: the SMs stay the sends'

    def publish(self) -> int:
        """Publish the current values as the next version (here, then to
        remote engine ranks); returns its number."""
        if self._sender is None:
            return self._publisher.publish()
        pub = self._publisher
        if not pub._done:  # Note [no snapshot without local engine ranks]
            pub.version += 1
            pub.stats["publishes"] += 1
            self._send(pub.version)
            return pub.version
        # gloo waits for each transfer in turn: not inside the write window
        if pub.device.type != "cuda" or not self._sender.posts_ahead():
            version = pub.publish()
            self._send(version)
            return version
        # Note [sends beside the snapshot]
        current = torch.cuda.current_stream(pub.device)
        if self._side is None:
            self._side = torch.cuda.Stream(pub.device)
        self._side.wait_stream(current)
        version, failed = pub.version + 1, []

        def fill() -> None:  # once no local engine rank reads the snapshot
            with torch.cuda.stream(current):
                try:
                    self._send(version, self._sender.start)
                except BaseException as e:  # the version is still published here, then the error raised
                    failed.append(e)
            pub._snapshot.run()

        try:
            with torch.cuda.stream(self._side):
                pub._publish_direct(time.monotonic() + pub.timeout, fill, version)
            pub.stats["publishes"] += 1
            if failed:
                raise failed[0]
            self._send(version, lambda *_: self._sender.finish())
        finally:
            current.wait_stream(self._side)  # the next step's writes come after the snapshot's reads
        return version

    def _send(self, version: int, call=None) -> None:
        try:
            (call or self._sender.send)(version, self._send_timeout)
        except Exception as e:
            self._sender = None
            raise send_failed(version, "sending it to the remote engine ranks", "send_to", e) from e
        except BaseException:  # Ctrl-C half way: the group is out of step, later versions stay local
            self._sender = None
            raise

    def close(self) -> None:
        self._sender = None
        self._publisher.close()


class ShardedSubscriber(Closing):
    """An engine rank on the trainer ranks' node (Note [sharded weights]).

    ``sources``: one connection (or Pipe end, or queue) per trainer rank,
    each attached with :meth:`ShardedPublisher.attach`; ``wants``: {engine
    name: :class:`Take`} (an engine tensor without one takes the global
    tensor of its own name, whole). ``pull(into)`` copies the newest version
    that every trainer rank has published.

    Example (TP rank r of M)::

        >>> sub = torch_ipc.weights.ShardedSubscriber(conns, wants={                 # doctest: +SKIP
        ...     "qkv.weight": Take(["q.weight", "k.weight", "v.weight"], split=(0, r, M))})
        >>> sub.pull(into=engine_model)                                              # doctest: +SKIP
    """

    def __init__(self, sources: Sequence[Any], *, wants: Optional[Mapping[str, Take]] = None, strict: bool = True,
                 timeout: float = 60.0):
        self._shards = LocalShards(list(sources), timeout)
        self._wants, self._strict, self.timeout = dict(wants or {}), strict, timeout
        self._pulls: Dict[int, tuple] = {}
        self.version = 0
        self.stats: Dict[str, Any] = {"bytes": 0, "copies": 0, "path": ""}

    @property
    def latest(self) -> int:
        """The newest version every trainer rank has published (0: none yet)."""
        from . import _control as ctl

        return min(s._counters.load(ctl.PUBLISHED) for s in self._shards.subs)

    def pull(self, into: Any, *, newer_than: int = 0, timeout: Optional[float] = None) -> int:
        """Copy the newest version of every trainer rank's shard (the same on
        all) newer than ``newer_than`` into ``into``; returns it."""
        cached = self._pulls.get(id(into))
        if cached is None or cached[0] is not into:
            cached = (into, self._shards.plan(into, self._wants, self._strict))
            self._pulls[id(into)] = cached
            plan = cached[1]
            self.stats.update(bytes=plan.plan.bytes, copies=len(plan.plan.copies), path=plan.copy.path)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self.version = self._shards.pull(cached[1], newer_than, deadline)
        return self.version

    def close(self) -> None:
        self._shards.close()
        self._pulls.clear()

    @staticmethod
    def remote(into: Any, *, trainers: Sequence[int], engines: Sequence[int],
               wants: Optional[Mapping[str, Take]] = None, strict: bool = True,
               transport: Optional[_dist.Transport] = None, group: Any = None,
               timeout: float = 300.0) -> "RemoteShardedSubscriber":
        """An engine rank on another node than the trainer ranks
        (:class:`RemoteShardedSubscriber`): a collective with every trainer
        rank's :meth:`ShardedPublisher.send_to`."""
        return RemoteShardedSubscriber(into, trainers=trainers, engines=engines, wants=wants, strict=strict,
                                       transport=transport, group=group, timeout=timeout)


class RemoteShardedSubscriber:
    """An engine rank on another node than the trainer ranks': constructing
    it is a collective with every trainer rank's
    :meth:`ShardedPublisher.send_to` and the other engine ranks'
    constructors; ``pull()`` receives the next version into ``into`` (a
    collective with the trainers' ``publish()``). Once a version has
    started, its buckets must all arrive within ``timeout`` seconds, else
    ``pull()`` raises TimeoutError (Note [a dead engine rank])."""

    def __init__(self, into: Any, *, trainers: Sequence[int], engines: Sequence[int],
                 wants: Optional[Mapping[str, Take]] = None, strict: bool = True,
                 transport: Optional[_dist.Transport] = None, group: Any = None, timeout: float = 300.0):
        dest = named_tensors(into, "the model pulled into")
        self._receiver = Receiver(_dist.transport_for(transport, group), trainers, engines, dest,
                                  dict(wants or {}), strict, timeout)

    @property
    def version(self) -> int:
        return self._receiver.version

    def pull(self, timeout: Optional[float] = None) -> int:
        """Receive the next version; returns its number. ``timeout``: how long
        to wait for the trainers to start sending it (None: as long as it
        takes), TimeoutError past it."""
        return self._receiver.pull(timeout)

    def plan_bytes(self) -> List[int]:
        """Bytes this rank receives per version from each trainer rank."""
        return [sum(ends) for ends in self._receiver.ends]
