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
  trainer sends the same version, newer than its last; a failure half way leaves its tensors with a partial
  update (say so, as bucketed mode does). A dead member breaks a
  torch.distributed group: form a new one and construct Sender / Receiver
  again (each has no state beyond its plan), as for the relay.

Note [sharded rounds]
Round r moves bucket r of every (trainer, engine) pair, all pairs in one
``batch`` (with NCCL one group call); two rounds are in flight (packing or
unpacking one overlaps the transfer of the other). Both sides compute the
buckets from the same plan, so the k-th send of a pair meets the k-th
receive. A piece of 256 KiB or more is a bucket of its own, sent from the
snapshot and received into the engine tensor in place when both sides are
contiguous; smaller pieces are packed. Measured on two H100s (NVLink, NCCL,
a 1.5 GB bf16 model of 105 tensors, 64 MiB buckets), against one raw send of
the same bytes (4.2 ms): this schedule 7.3-8.9 ms (57%-48% over two runs);
the same buckets grouped several to a round (one group call) 11.2 ms; every
piece packed into full buckets, staged on both sides, 7.6 ms. What remains
is NCCL's cost per operation of a pair (about 30 us each, 105 here), not
bytes; fewer, larger operations need the engine's tensors to be one
allocation, or a staging buffer of the whole model.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch

from .. import _dist
from .._closing import Closing
from ._errors import send_failed
from ._layout import typed_view
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
        self._publisher = Publisher(tensors, dtype=dtype, max_subscribers=max_subscribers, timeout=timeout)
        self._sender: Optional[Sender] = None

    @property
    def version(self) -> int:
        return self._publisher.version

    def attach(self, conn) -> int:
        """Attach one engine rank on this node: sends this rank's description, then its snapshot."""
        send(conn, shards_message(self.rank, self._held))
        return self._publisher.attach(conn)

    def send_to(self, *, trainers: Sequence[int], engines: Sequence[int], transport: Optional[_dist.Transport] = None,
                group: Any = None, bucket_bytes: int = 64 << 20) -> None:
        """From now on, also send every version to the engine ranks ``engines``
        of other nodes (ranks of ``group`` or ``transport``; ``trainers``: the
        trainer ranks' ranks, in trainer-rank order). A collective with every
        trainer rank's ``send_to`` and every engine rank's
        :class:`RemoteShardedSubscriber`. Each later ``publish()`` sends its
        version to every engine rank (they are in ``pull()`` meanwhile)."""
        transport = _dist.transport_for(transport, group)
        pub = self._publisher
        views = {e.name: typed_view(pub._buffer, e.offset, e.dtype, e.numel).view(e.shape) for e in pub.layout.entries}
        self._sender = None
        self._sender = Sender(transport, trainers, engines, self._held, views, int(bucket_bytes))

    def publish(self) -> int:
        """Publish the current values as the next version (here, then to
        remote engine ranks); returns its number."""
        version = self._publisher.publish()
        if self._sender is not None:
            try:
                self._sender.send(version)
            except Exception as e:
                self._sender = None
                raise send_failed(version, "sending it to the remote engine ranks", "send_to", e) from e
        return version

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
        import time

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
               transport: Optional[_dist.Transport] = None, group: Any = None) -> "RemoteShardedSubscriber":
        """An engine rank on another node than the trainer ranks
        (:class:`RemoteShardedSubscriber`): a collective with every trainer
        rank's :meth:`ShardedPublisher.send_to`."""
        return RemoteShardedSubscriber(into, trainers=trainers, engines=engines, wants=wants, strict=strict,
                                       transport=transport, group=group)


class RemoteShardedSubscriber:
    """An engine rank on another node than the trainer ranks': constructing
    it is a collective with every trainer rank's
    :meth:`ShardedPublisher.send_to` and the other engine ranks'
    constructors; ``pull()`` receives the next version into ``into`` (a
    collective with the trainers' ``publish()``)."""

    def __init__(self, into: Any, *, trainers: Sequence[int], engines: Sequence[int],
                 wants: Optional[Mapping[str, Take]] = None, strict: bool = True,
                 transport: Optional[_dist.Transport] = None, group: Any = None):
        dest = named_tensors(into, "the model pulled into")
        self._receiver = Receiver(_dist.transport_for(transport, group), trainers, engines, dest,
                                  dict(wants or {}), strict)

    @property
    def version(self) -> int:
        return self._receiver.version

    def pull(self) -> int:
        """Receive the next version; returns its number."""
        return self._receiver.pull()

    def plan_bytes(self) -> List[int]:
        """Bytes this rank receives per version from each trainer rank."""
        return [sum(ends) for ends in self._receiver.ends]
