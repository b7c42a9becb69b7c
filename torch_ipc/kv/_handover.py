"""Handing blocks from a writer to a reader, in the writer's stream order.

Note [hand-over]
``send(ids, conn)`` records an IpcEvent on the writer's stream after its
writes and sends (pool, sender, ids, event); ``recv(conn)`` moves the blocks to
the reader (``transfer=True``: the reader now holds them and frees them) and
makes the reader's stream wait on the event. The host never blocks: a reader
that touches the blocks on its current stream sees the writer's bytes. Until
``recv`` the sender still holds the blocks: if it closes the pool or exits
first, they go back to the pool and ``recv`` raises.
"""
from __future__ import annotations

from array import array
from typing import Any, List, NamedTuple, Optional

import torch

from ..ipc_event import IpcEvent
from ._ids import Ids, pack_bytes

_MESSAGE_TAG = "torch_ipc.kv/1"
_EVENTS_PER_STREAM = 4  # Note [event pool] in csrc/cuda/events.cpp: fewer reuses, fewer over-waits


class Handover(NamedTuple):
    """What :meth:`SharedKVPool.recv` returns."""

    ids: List[int]
    meta: Any
    sender_pid: int


class _HandOver:
    """The part of :class:`SharedKVPool` that sends and receives blocks."""

    def _event(self, stream: Optional[torch.cuda.Stream]) -> IpcEvent:
        key = None if stream is None else stream.cuda_stream
        ring = self._events.get(key)
        if ring is None:
            ring = self._events[key] = [IpcEvent(self._device) for _ in range(_EVENTS_PER_STREAM)]
        self._next_event += 1
        return ring[self._next_event % len(ring)]

    def send(
        self,
        ids: Ids,
        conn: Any,
        *,
        stream: Optional[torch.cuda.Stream] = None,
        transfer: bool = True,
        meta: Any = None,
    ) -> None:
        """Hand the blocks ``ids`` (held by this process) to the process at
        the other end of ``conn`` (anything with ``send`` or ``put``), with an
        IpcEvent recorded on ``stream`` (default: the current stream) after the
        writes queued so far. ``transfer``: the reader takes the blocks over
        (it frees them); otherwise this process keeps holding them and the
        reader only reads. ``meta``: any picklable object that travels along."""
        self._check_open()
        packed = pack_bytes(ids)
        self._allocator.check_held(packed)
        event = None
        if self.device.type == "cuda":
            event = self._event(stream)
            event.record(stream)
        message = (_MESSAGE_TAG, self._name, *self._sender, bool(transfer), packed, event, meta)
        (conn.send if hasattr(conn, "send") else conn.put)(message)

    def recv(self, conn: Any, *, stream: Optional[torch.cuda.Stream] = None) -> Handover:
        """Receive a hand-over from ``conn`` (anything with ``recv`` or
        ``get``): take the blocks over (when sent with ``transfer``) and make
        ``stream`` (default: the current stream) wait for the writer's work
        on them. The host does not wait."""
        self._check_open()
        message = conn.recv() if hasattr(conn, "recv") else conn.get()
        if not (isinstance(message, tuple) and len(message) == 9 and message[0] == _MESSAGE_TAG):
            raise ValueError(f"torch_ipc: expected a KV pool hand-over, got {type(message).__name__}")
        _, name, slot, pid, start, transfer, packed, event, meta = message
        if name != self._name:
            raise ValueError(f"torch_ipc: a hand-over of KV pool {name}, not of this pool ({self._name})")
        ids = array("q")
        ids.frombytes(packed)
        if transfer:
            self._allocator.take_over(packed, slot, pid, start)
        if self._allocator.num_blocks != self._mapped:  # grown: map the new chunks first
            self.refresh()
        if event is not None:
            event.wait(stream)
        return Handover(ids.tolist(), meta, pid)

