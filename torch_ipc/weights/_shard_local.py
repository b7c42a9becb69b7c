"""One node: an engine rank reads every trainer rank's snapshot where it is
(torch_ipc descriptors, zero-copy) and copies its intersections into its own
tensors, only when all of them hold the same version.

Note [peer reads of a snapshot]
A trainer rank's snapshot on another GPU than the engine rank's is mapped
here for its own GPU only (cuMemSetAccess at import). Copying it with
torch (one copy_ per intersection, a peer memcpy each, a strided one through
a temporary) reached half of the peer-copy floor. Where the two GPUs can
reach each other (NVLink, PCIe P2P), the engine grants its own GPU access to
the mapping once (_C.vmm_grant_device_access) and the plan's copies, strided
ones as their contiguous runs, become one launch of the batched copy kernel
on the engine's GPU, reading the peer's memory in place. Ordering is the
local pull's: the engine's stream waits for each trainer's publish event
before the launch, and records each done event after it.
"""

from typing import Any, Dict, List, Mapping, Optional

import torch

from .. import _C
from . import _control as ctl
from ._copy import BatchedCopy
from ._layout import typed_view
from ._shard_layout import Held, Take, held_from_message, sources_of
from ._shard_plan import ShardPlan
from ._share import named_tensors, receive
from .subscriber import Subscriber


def _versions(subs: List[Subscriber]) -> Optional[List[int]]:
    """Each snapshot's PUBLISHED, or None while one of them is being written."""
    out = []
    for s in subs:
        if s._counters.load(ctl.WRITING):
            return None
        out.append(s._counters.load(ctl.PUBLISHED))
    return out


def enter_all(subs: List[Subscriber], newer_than: int, deadline: float) -> int:
    """Set READING on every trainer rank's snapshot once all hold the same
    version, newer than `newer_than`; returns it (Note [sharded weights]).
    Each side stores its flag, then loads the other's (Dekker, per snapshot,
    as Note [weights consistency protocol]): with READING set everywhere and
    every WRITING clear, no snapshot changes until READING is cleared."""

    def agreed() -> bool:
        v = _versions(subs)
        return v is not None and len(set(v)) == 1 and v[0] > newer_than

    def check() -> None:
        for s in subs:
            s._check_publisher()

    while True:
        for s in subs:
            s._counters.store(s._index[ctl.READING], 1)
        versions = _versions(subs)
        if versions is not None and len(set(versions)) == 1 and versions[0] > newer_than:
            return versions[0]
        leave_all(subs)
        ctl.spin_until(agreed, check, deadline)


def leave_all(subs: List[Subscriber]) -> None:
    for s in subs:
        s._counters.store(s._index[ctl.READING], 0)


class LocalShards:
    """The trainer ranks' snapshots as an engine rank on their node sees them."""

    def __init__(self, sources: List[Any], timeout: float):
        self.subs: List[Subscriber] = []
        held_by_rank: Dict[int, List[Held]] = {}
        try:
            for conn in sources:
                message = receive(conn, timeout)
                if message is None:
                    raise TimeoutError(f"torch_ipc.weights: no ShardedPublisher attached within {timeout} s")
                rank, _, held = held_from_message(message)
                if rank in held_by_rank:
                    raise ValueError(f"torch_ipc.weights: two sources are trainer rank {rank}")
                held_by_rank[rank] = held
                self.subs.append(Subscriber(conn, timeout=timeout))
            if sorted(held_by_rank) != list(range(len(sources))):
                raise ValueError(f"torch_ipc.weights: the sources are trainer ranks {sorted(held_by_rank)}, not "
                                 f"0..{len(sources) - 1}")
            self.sources = sources_of([held_by_rank[r] for r in range(len(sources))])
        except BaseException:
            self.close()
            raise
        self._granted: Dict[tuple, bool] = {}
        self.ranks = list(held_by_rank)  # self.subs[i] is trainer rank self.ranks[i]
        self.views: Dict[int, Dict[str, torch.Tensor]] = {}
        for rank, sub in zip(self.ranks, self.subs):
            layout = sub._share.layout
            self.views[rank] = {e.name: typed_view(sub._buffer, e.offset, e.dtype, e.numel).view(e.shape)
                                for e in layout.entries}

    def plan(self, into: Any, wants: Mapping[str, Take], strict: bool) -> "LocalPull":
        dest = named_tensors(into, "the model pulled into")
        plan = ShardPlan(self.sources, dest, wants, strict)
        devices = {c.into.device for c in plan.copies}
        peers = len(devices) == 1 and all(self._readable_from(sub, next(iter(devices))) for sub in self.subs)
        return LocalPull(plan, self.views, peers)

    def _readable_from(self, sub: Subscriber, device: torch.device) -> bool:
        """Whether a kernel on `device` may read `sub`'s snapshot (Note [peer
        reads of a snapshot]): same GPU, or a peer GPU granted access here."""
        src = sub._buffer.device
        if device.type != "cuda" or src.type != "cuda" or src == device:
            return True
        key = (id(sub), device.index)
        if key not in self._granted:
            ok = torch.cuda.can_device_access_peer(device.index, src.index)
            if ok:
                try:
                    _C.vmm_grant_device_access(sub._buffer, device.index)
                except RuntimeError:
                    ok = False  # not a VMM mapping, or the driver refused: copies through torch
            self._granted[key] = ok
        return self._granted[key]

    def pull(self, pull: "LocalPull", newer_than: int, deadline: float) -> int:
        version = enter_all(self.subs, newer_than, deadline)
        try:
            device = pull.device
            for sub in self.subs:
                sub._device = device
                sub._after_publish()
            try:
                pull.copy.run()
            finally:
                for sub in self.subs:
                    sub._record_done()
        finally:
            leave_all(self.subs)
        return version

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        self.subs = []


class LocalPull:
    """The copies of one (trainer layout, engine model) pair, batched once."""

    def __init__(self, plan: ShardPlan, views: Mapping[int, Mapping[str, torch.Tensor]], peers: bool):
        self.plan = plan
        pairs = [(views[c.rank][c.name][c.src], c.into[c.dst]) for c in plan.copies]
        self.copy = BatchedCopy(pairs, peer_sources=peers)
        devices = {c.into.device for c in plan.copies}
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
