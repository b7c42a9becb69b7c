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
from ._chunks import Chunks
from ._ids import Ids, pack_bytes
from ._state import PoolState

_MESSAGE_TAG = "torch_ipc.kv/2"  # 2: the sender with its life key (Note [pool slots across PID namespaces])
_EVENTS_PER_STREAM = 4  # Note [event pool] in csrc/cuda/events.cpp: fewer reuses, fewer over-waits


class Handover(NamedTuple):
    """What :meth:`SharedKVPool.recv` returns."""

    ids: List[int]
    meta: Any
    sender_pid: int


class HandoverEnds:
    """Both ends of a hand-over of one pool's blocks: the writer's send()
    and the reader's recv(). The caller has checked that the pool is open."""

    def __init__(self, state: PoolState, chunks: Chunks) -> None:
        self._state = state
        self._chunks = chunks

    def _event(self, stream: Optional[torch.cuda.Stream]) -> IpcEvent:
        s = self._state
        key = None if stream is None else stream.cuda_stream
        ring = s.events.get(key)
        if ring is None:
            ring = s.events[key] = [IpcEvent(s.device) for _ in range(_EVENTS_PER_STREAM)]
        s.next_event += 1
        return ring[s.next_event % len(ring)]

    def send(self, ids: Ids, conn: Any, stream: Optional[torch.cuda.Stream], transfer: bool, meta: Any) -> None:
        s = self._state
        packed = pack_bytes(ids)
        s.allocator.check_held(packed)
        event = None
        if self._chunks.device().type == "cuda":
            event = self._event(stream)
            event.record(stream)
        message = (_MESSAGE_TAG, s.name, *s.sender, bool(transfer), packed, event, meta)
        (conn.send if hasattr(conn, "send") else conn.put)(message)

    def recv(self, conn: Any, stream: Optional[torch.cuda.Stream]) -> Handover:
        s = self._state
        message = conn.recv() if hasattr(conn, "recv") else conn.get()
        if not (isinstance(message, tuple) and len(message) == 10 and message[0] == _MESSAGE_TAG):
            raise ValueError(f"torch_ipc: expected a KV pool hand-over, got {type(message).__name__}")
        _, name, slot, pid, start, life, transfer, packed, event, meta = message
        if name != s.name:
            raise ValueError(f"torch_ipc: a hand-over of KV pool {name}, not of this pool ({s.name})")
        ids = array("q")
        ids.frombytes(packed)
        if transfer:
            s.allocator.take_over(packed, slot, pid, start, life)
        if s.allocator.num_blocks != s.mapped:  # grown: map the new chunks first
            self._chunks.refresh()
        if event is not None:
            event.wait(stream)
        return Handover(ids.tolist(), meta, pid)
