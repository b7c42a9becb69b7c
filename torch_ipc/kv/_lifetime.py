"""A pool's life in one process: open, closed, and the attachment of its own
that a forked child makes on first use."""
from __future__ import annotations

import os
import threading

from .. import _C
from ._ownership import Ownership
from ._state import PoolState, sender


class Lifetime:
    """Whether one pool is usable in this process, and closing it."""

    def __init__(self, state: PoolState, ownership: Ownership) -> None:
        self._state = state
        self._ownership = ownership

    def check_open(self) -> None:
        """Raise when the pool is closed; in a forked child, attach first (Note [fork] in csrc/base/fork.h)."""
        if self._state.closed:
            raise RuntimeError("torch_ipc: this KV pool is closed")
        if self._state.pid != os.getpid():
            self._attach_after_fork()

    def _attach_after_fork(self) -> None:
        """Note [fork] in csrc/base/fork.h: a forked child holds no blocks of
        its parent and uses the pool through an attachment of its own (it
        cannot grow the pool; CPU mappings inherited stay valid)."""
        s = self._state
        timeout = s.allocator.lock_timeout
        s.allocator = _C.BlockAllocator.attach(s.name, *s.creator)
        s.allocator.lock_timeout = timeout
        s.pid = os.getpid()
        s.sender = sender(s.allocator)
        s.owner = False
        s.exports = []
        s.events = {}
        s.pending_frees, s.pending_ids = [], set()
        s.lock = threading.RLock()

    def close(self) -> None:
        """Detach (the caller unregisters the pool first). Idempotent."""
        s = self._state
        if s.closed:
            return
        s.closed = True
        if s.owner and s.pid == os.getpid():  # not in a forked child: the parent's
            s.allocator.unlink()
            for exported in s.exports:
                exported.revoke()
        if s.pid == os.getpid():
            self._ownership.finish_frees(wait=True)  # our reads end before the blocks go back
        s.allocator.detach()  # an inherited attachment detaches nothing
        s.exports = []
        s.chunks = []
        s.events = {}
        s.allocator = None
