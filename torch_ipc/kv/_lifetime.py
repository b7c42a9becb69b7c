"""A pool's life in one process: open, closed, and the attachment of its own
that a forked child makes on first use."""
from __future__ import annotations

import os
import threading

from .. import _C
from . import _registry


class _Lifetime:
    """The part of :class:`SharedKVPool` that closes it, and re-attaches after fork."""

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("torch_ipc: this KV pool is closed")
        if self._pid != os.getpid():
            self._attach_after_fork()

    def _attach_after_fork(self) -> None:
        """Note [fork] in csrc/os/process.h: a forked child holds no blocks of its
        parent and uses the pool through an attachment of its own (it cannot
        grow the pool; CPU mappings inherited stay valid)."""
        creator = self._creator or (0, 0)
        timeout = self._allocator.lock_timeout
        self._allocator = _C.BlockAllocator.attach(self._name, *creator)
        self._allocator.lock_timeout = timeout
        self._pid = os.getpid()
        self._sender = (self._allocator.slot, *_C.self_process())
        self._owner = False
        self._exports = []
        self._events = {}
        self._pending_frees, self._pending_ids = [], set()
        self._lock = threading.RLock()

    def close(self) -> None:
        """Detach: the blocks this process holds go back to the pool and its
        mappings are released (after the work queued on them). The owner also
        stops new processes from attaching; those attached keep working.
        Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        _registry.unregister(self)
        if self._owner and self._pid == os.getpid():  # not in a forked child: the parent's
            self._allocator.unlink()
            for exported in self._exports:
                exported.revoke()
        if self._pid == os.getpid():
            self._finish_frees(wait=True)  # our reads end before the blocks go back
        self._allocator.detach()  # an inherited attachment detaches nothing
        self._exports = []
        self._chunks = []
        self._events = {}
        self._allocator = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
