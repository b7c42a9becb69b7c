"""Block ownership as a process sees it: allocate, free (after the GPU work
queued on the blocks, on a CUDA pool), who holds what, and reclaiming the
blocks of holders that exited. The allocator itself is C++, in the pool's
segment (csrc/features/kv/block_allocator.h)."""
from __future__ import annotations

from array import array
from typing import Dict, List, Optional

import torch

from ._errors import OutOfBlocksError
from ._ids import Ids, pack, pack_bytes


class _Ownership:
    """The part of :class:`SharedKVPool` that allocates and frees blocks."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (grows with :meth:`grow`)."""
        self._check_open()
        return self._allocator.num_blocks

    @property
    def max_blocks(self) -> int:
        self._check_open()
        return self._allocator.max_blocks

    @property
    def free_blocks(self) -> int:
        self._check_open()
        return self._allocator.free_blocks

    def allocate(self, n: int) -> List[int]:
        """``n`` free blocks, now held by this process (until :meth:`free`,
        a hand-over, :meth:`close` or this process's exit)."""
        self._check_open()
        n = int(n)
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n == 0:
            return []
        if self._pending_frees:
            self._finish_frees()
        ids = self._allocator.allocate(n)
        if not ids:
            raise OutOfBlocksError(
                f"torch_ipc: KV pool {self._name} has {self._allocator.free_blocks} free blocks of "
                f"{self._allocator.num_blocks}; {n} were asked for"
            )
        return ids

    def free(self, ids: Ids, *, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Give back blocks this process holds. All or nothing: ``IndexError``
        for an id out of range, ``ValueError`` for a block this process does
        not hold (free already, or another's) or one listed twice.

        On a CUDA pool the blocks go back once the work queued so far on
        ``stream`` (default: the current stream) has finished, so that nobody
        writes into a block this process still reads (Note [deferred free]);
        the host does not wait."""
        self._check_open()
        if self._device is None or self._device.type != "cuda":
            self._allocator.free(pack_bytes(ids))
            return
        packed = pack(ids)
        with self._lock:
            self._allocator.check_held(packed.tobytes())
            again = self._pending_ids.intersection(packed)
            if again:
                raise ValueError(f"torch_ipc: cannot free block {min(again)}: it is freed already (pending)")
            event = torch.cuda.Event()
            event.record(stream)
            self._pending_frees.append((event, packed))
            self._pending_ids.update(packed)
        self._finish_frees()

    # Note [deferred free]
    # A reader's gather is queued on its stream; freeing its blocks at once
    # would let a writer allocate and overwrite them while the gather still
    # runs. So a CUDA pool frees after an event on the freeing stream has
    # completed: checked at every free and allocate, and by the collector.
    def _finish_frees(self, wait: bool = False) -> None:
        with self._lock:
            while self._pending_frees and (wait or self._pending_frees[0][0].query()):
                event, packed = self._pending_frees.pop(0)
                event.synchronize()
                self._pending_ids.difference_update(packed)
                self._allocator.free(packed.tobytes())

    def held(self) -> List[int]:
        """The blocks this process holds."""
        self._check_open()
        return self._allocator.held_by_self()

    def holder_of(self, block_id: int) -> Optional[int]:
        """The pid holding block ``block_id``, or None when it is free."""
        self._check_open()
        pid, _ = self._allocator.holder_of(int(block_id))
        return pid or None

    def holders(self) -> Dict[int, int]:
        """pid -> blocks held, for every attached process (dead ones until reclaimed)."""
        self._check_open()
        return {pid: n for (pid, _), n in self._allocator.holders()}

    def reclaim(self) -> int:
        """Give back now the blocks of attached processes that exited (each
        attached process also does it in the background, and ``allocate``
        when short); returns how many came back."""
        self._check_open()
        if self._pending_frees:
            self._finish_frees()
        return self._allocator.reclaim_dead()


    def _reclaim_unless_busy(self) -> int:
        """The collector's reclaim: nothing when another process holds the lock now."""
        if self._pending_frees:
            self._finish_frees()
        return self._allocator.reclaim_dead(False)

    @property
    def lock_timeout(self) -> float:
        """Seconds an operation of this process waits for the pool's lock
        before it raises ``TimeoutError`` saying who holds it (default 10;
        Note [the pool's lock] in csrc/features/kv/pool_lock.h). Per process."""
        self._check_open()
        return self._allocator.lock_timeout

    @lock_timeout.setter
    def lock_timeout(self, seconds: float) -> None:
        self._check_open()
        self._allocator.lock_timeout = float(seconds)
