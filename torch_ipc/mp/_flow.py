"""Bounds on a connection's send path: bytes in flight and a time limit.

Note [bytes in flight]
What a connection sent stays pinned (exported) until the peer loaded and
released it, or dies: a peer that never reads pins it all. A connection counts
the bytes of the storages of each message it sent while its export lives;
send() refuses (InFlightLimitError) a message that would take the sum past
``max_bytes_in_flight``, or with a timeout waits that long for the peer to
release. Storages shared by several messages count once per message.

Note [send time limit]
With a timeout, send() writes the message itself, in multiprocessing's
framing, with non-blocking sends while select() says there is room, so that a
peer that does not read cannot hold it past its deadline. A message cut off
half-way leaves the stream unreadable: the connection is then closed.
"""

import select
import socket
import struct
import time
from typing import Optional

import torch

ROOM_POLL_S = 0.01  # the collector reclaims what a peer released every 50 ms


def seconds(timeout: float) -> float:
    if not timeout >= 0:
        raise ValueError(f"torch_ipc: timeout must be None or a number of seconds >= 0, not {timeout!r}")
    return float(timeout)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` that torch_ipc shares
    itself (sparse parts are counted once the pickler split them: not here)."""
    seen, total = set(), 0
    for t in tensors:
        if t.layout is not torch.strided or t.is_meta:
            continue
        s = t.untyped_storage()
        key = (t.device, s.data_ptr())
        if key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def frame(data: bytes) -> bytes:
    """``data`` as multiprocessing.connection frames a message (send_bytes)."""
    n = len(data)
    if n > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", n) + data
    return struct.pack("!i", n) + data


def write_by(fd: int, data: bytes, deadline: float) -> int:
    """Write ``data`` framed to the socket ``fd`` until ``deadline``; how many
    bytes of the frame went out (all of them, or fewer at the deadline)."""
    whole = frame(data)
    sock = socket.socket(fileno=fd)
    written = 0
    try:
        while written < len(whole):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [sock], [], left)[1]:
                break
            try:
                written += sock.send(memoryview(whole)[written:], socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                continue
    finally:
        sock.detach()
    return written if written < len(whole) else -1


def deadline_of(timeout: Optional[float]) -> Optional[float]:
    return None if timeout is None else time.monotonic() + seconds(timeout)
