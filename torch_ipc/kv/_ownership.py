"""Block ownership as a process sees it: allocate, free (after the GPU work
queued on the blocks, on a CUDA pool), who holds what, and reclaiming the
blocks of holders that exited. The allocator itself is C++, in the pool's
segment (csrc/features/kv/block_allocator.h)."""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

from ._errors import OutOfBlocksError
from ._ids import Ids, pack, pack_bytes
from ._state import PoolState

PENDING_POLL_S = 5e-5


class Ownership:
    """Who holds the blocks of one pool (state.allocator), and the frees that
    wait for the GPU (state.pending_frees). The caller has checked that the
    pool is open, except for reclaim_unless_busy (the collector's)."""

    def __init__(self, state: PoolState) -> None:
        self._state = state

    def allocate(self, n: int) -> List[int]:
        s = self._state
        n = int(n)
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n == 0:
            return []
        if s.pending_frees:
            self.finish_frees()
        ids = s.allocator.allocate(n)
        if not ids and s.pending_frees and s.allocator.free_blocks + len(s.pending_ids) >= n:
            self._wait_for_pending_frees()  # Note [deferred free]: our own frees make up the difference
            ids = s.allocator.allocate(n)
        if not ids:
            raise OutOfBlocksError(
                f"torch_ipc: KV pool {s.name} has {s.allocator.free_blocks} free blocks of "
                f"{s.allocator.num_blocks}; {n} were asked for"
            )
        return ids

    def free(self, ids: Ids, stream: Optional[torch.cuda.Stream]) -> None:
        """All or nothing; on a CUDA pool once `stream` gets there (Note [deferred free])."""
        s = self._state
        if s.device is None or s.device.type != "cuda":
            s.allocator.free(pack_bytes(ids))
            return
        packed = pack(ids)
        with s.lock:
            s.allocator.check_held(packed.tobytes())
            again = s.pending_ids.intersection(packed)
            if again:
                raise ValueError(f"torch_ipc: cannot free block {min(again)}: it is freed already (pending)")
            event = torch.cuda.Event()
            event.record(stream)
            s.pending_frees.append((event, packed))
            s.pending_ids.update(packed)
        self.finish_frees()

    # Note [deferred free]
    # A reader's gather is queued on its stream; freeing its blocks at once
    # would let a writer allocate and overwrite them while the gather still
    # runs. So a CUDA pool frees after an event on the freeing stream has
    # completed: checked at every free and allocate, and by the collector.
    # An allocate that finds too few free blocks, where this process's own
    # pending frees would make up the difference, waits for them (polled:
    # Ctrl-C raises) rather than report a pool out of blocks that are only
    # the GPU's queue away from free: under a busy GPU, three processes
    # churning 36 blocks starved one of them to 46 successes in 500 rounds.
    def finish_frees(self, wait: bool = False) -> None:
        s = self._state
        with s.lock:
            while s.pending_frees and (wait or s.pending_frees[0][0].query()):
                event, packed = s.pending_frees.pop(0)
                event.synchronize()
                s.pending_ids.difference_update(packed)
                s.allocator.free(packed.tobytes())

    def _wait_for_pending_frees(self) -> None:
        s = self._state
        with s.lock:
            events = [event for event, _ in s.pending_frees]
        for event in events:
            while not event.query():
                time.sleep(PENDING_POLL_S)
        self.finish_frees()

    def check_held(self, packed: bytes) -> None:
        """Every id of `packed` (int64 bytes) is a block this process holds, listed once; else
        IndexError or ValueError naming the first that is not (in C++: no list of every held block)."""
        self._state.allocator.check_held(packed)

    def held(self) -> List[int]:
        return self._state.allocator.held_by_self()

    def holder_of(self, block_id: int) -> Optional[int]:
        pid, _ = self._state.allocator.holder_of(int(block_id))
        return pid or None

    def holders(self) -> Dict[int, int]:
        """pid -> blocks; two processes of two PID namespaces with one pid add up under it."""
        out: Dict[int, int] = {}
        for (pid, _), n in self._state.allocator.holders():
            out[pid] = out.get(pid, 0) + n
        return out

    def reclaim(self) -> int:
        if self._state.pending_frees:
            self.finish_frees()
        return self._state.allocator.reclaim_dead()

    def reclaim_unless_busy(self) -> int:
        """The collector's reclaim: nothing when another process holds the lock now."""
        if self._state.pending_frees:
            self.finish_frees()
        return self._state.allocator.reclaim_dead(False)
