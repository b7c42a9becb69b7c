"""KV blocks to a pool on another node, over torch.distributed.

    >>> # prefill node (rank 0)                         # decode node (rank 1)
    >>> ids = pool.allocate(8); pool.scatter(ids, kv)   # doctest: +SKIP
    >>> send_blocks(pool, ids, dst=1, meta={"request": 7})  # doctest: +SKIP
    >>>                                                 # h = recv_blocks(pool, src=0)  # doctest: +SKIP
    >>>                                                 # pool.gather(h.ids)            # doctest: +SKIP

Note [KV blocks across nodes]
The local hand-over (Note [hand-over] in torch_ipc/kv/__init__.py) passes
ids; across nodes the bytes must move. ``send_blocks`` sends a JSON header
(count, layout, meta, piece size), then the blocks in pieces of at most
``staging_bytes``: a piece whose ids are one run of consecutive blocks of a
chunk goes straight from the pool's memory, any other is gathered into one
of two staging buffers (the gather of piece k + 1 overlaps the send of piece
k). ``recv_blocks`` allocates the blocks in its own pool first, then receives
each piece straight into a run of them or into staging and scatters it. The
semantics are the local hand-over's: the bytes sent are those written on the
sender's current stream before the call (the sends are ordered after it),
the receiver's current stream is ordered after the scatter (the host does
not wait for NCCL), the receiver holds the new blocks and frees them, and
with ``transfer`` (default) the sender's blocks go back to its pool once the
sends completed. A receiver whose pool cannot take the blocks (other
layout, too few free) still drains the pieces, so the pair stays in step,
then raises. Only the pool's public API is used. Another transport: Note
[cross-node transport] in torch_ipc/_dist.py.
"""

import json
import math
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._dist import Transport, dtype_from_name
from . import LayoutMismatchError, OutOfBlocksError, SharedKVPool

__all__ = ["send_blocks", "recv_blocks", "RemoteHandover"]

_KIND = "torch_ipc.kv.blocks/1"
DEFAULT_STAGING_BYTES = 64 << 20
MAX_PIECE_BYTES = 1 << 30  # a receiver stages at most this much per piece, whatever a sender announces


class RemoteHandover(NamedTuple):
    """What :func:`recv_blocks` returns: the blocks now held here (ids of the
    receiving pool), the sender's ``meta`` and its global rank."""

    ids: List[int]
    meta: Any
    src: int


def _runs(pool: SharedKVPool, ids: Sequence[int]) -> Optional[torch.Tensor]:
    """The pool's memory of `ids` as one tensor when they are consecutive
    blocks of one chunk (nothing to gather), else None."""
    first = ids[0]
    if list(ids) != list(range(first, first + len(ids))):
        return None
    start = 0
    for chunk in pool.chunks:
        if start <= first and first + len(ids) <= start + chunk.shape[0]:
            return chunk[first - start : first - start + len(ids)]
        start += chunk.shape[0]
    return None


def _pieces(n: int, piece: int) -> List[Tuple[int, int]]:
    return [(lo, min(lo + piece, n)) for lo in range(0, n, piece)]


def send_blocks(
    pool: SharedKVPool,
    ids: Sequence[int],
    dst: int,
    *,
    group: Any = None,
    meta: Any = None,
    transfer: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> None:
    """Send the blocks ``ids`` (held by this process) of ``pool`` to the
    process of global rank ``dst`` in ``group``, which calls
    :func:`recv_blocks`. ``meta``: any JSON value, travelling along (JSON,
    not pickle: a process group is not authenticated). ``transfer``: give
    the blocks back to this pool after the send (default), else keep them.
    See Note [KV blocks across nodes]."""
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("torch_ipc: send_blocks() of no blocks")
    if len(set(ids)) != len(ids):
        raise ValueError("torch_ipc: send_blocks() of a block listed twice")
    not_held = sorted(set(ids) - set(pool.held()))
    if not_held:
        raise ValueError(f"torch_ipc: cannot send block {not_held[0]}: this process does not hold it")
    transport = Transport(group)
    transport.check_device(pool.chunks[0] if pool.chunks else pool.block(ids[0]))
    piece = max(1, min(len(ids), int(staging_bytes) // pool.block_bytes))
    header = {"kind": _KIND, "n": len(ids), "piece": piece, "shape": list(pool.block_shape),
              "dtype": str(pool.dtype), "meta": meta}
    try:
        json.dumps(header)
    except (TypeError, ValueError) as e:
        raise TypeError(f"torch_ipc: meta must be a JSON value ({e})") from None
    transport.send_json(header, dst)
    staging: List[torch.Tensor] = []
    works: List[Any] = [None, None]
    for k, (lo, hi) in enumerate(_pieces(len(ids), piece)):
        if works[k % 2] is not None:
            works[k % 2].wait()  # the send of piece k - 2 is done with its staging buffer
        data = _runs(pool, ids[lo:hi])
        if data is None:
            if len(staging) < 2:
                staging.append(torch.empty((piece, *pool.block_shape), dtype=pool.dtype, device=pool.device))
            data = pool.gather(ids[lo:hi], out=staging[k % 2][: hi - lo])
        works[k % 2] = transport.send(data, dst)
    for work in works:
        if work is not None:
            work.wait()
    if transfer:
        pool.free(ids)  # CUDA: once the current stream, which waited for the sends, gets there


def _check_header(pool: SharedKVPool, header: Any) -> Tuple[int, int, int, Optional[str]]:
    """(blocks, piece, the sender's block bytes, why this pool cannot take
    them or None) of a peer's header, every field checked."""
    if not isinstance(header, dict) or header.get("kind") != _KIND:
        raise ValueError("torch_ipc: recv_blocks() got something that is not a KV blocks header")
    n, piece, shape, dtype = header.get("n"), header.get("piece"), header.get("shape"), header.get("dtype")
    if type(n) is not int or type(piece) is not int or not 0 < piece <= n < 2**40:
        raise ValueError(f"torch_ipc: a KV blocks header with n={n!r}, piece={piece!r}; the pair is out of step")
    if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < 2**40 for d in shape)
            and dtype_from_name(dtype) is not None):
        raise ValueError(f"torch_ipc: a KV blocks header with shape {shape!r}, dtype {dtype!r}")
    block_bytes = math.prod(shape) * torch.empty(0, dtype=dtype_from_name(dtype)).element_size()
    if piece * block_bytes > max(MAX_PIECE_BYTES, pool.block_bytes):
        raise ValueError(f"torch_ipc: the sender's pieces of {piece * block_bytes} bytes are over "
                         f"{MAX_PIECE_BYTES}; the pair is out of step")
    if shape != list(pool.block_shape) or dtype != str(pool.dtype):
        return n, piece, block_bytes, (f"the sender's blocks are {dtype} of shape {tuple(shape)}, "
                                       f"this pool's {pool.dtype} of shape {pool.block_shape}")
    return n, piece, block_bytes, None


def recv_blocks(
    pool: SharedKVPool,
    src: int,
    *,
    group: Any = None,
) -> RemoteHandover:
    """Receive blocks that the process of global rank ``src`` sends with
    :func:`send_blocks`: allocate them in ``pool`` (this process holds them
    and frees them) and write them there, ordered on the current stream.
    Raises :class:`LayoutMismatchError` or :class:`OutOfBlocksError` (after
    draining what was sent, so the pair stays in step)."""
    transport = Transport(group)
    header = transport.recv_json(src)
    n, piece, block_bytes, mismatch = _check_header(pool, header)
    ids: List[int] = []
    error: Optional[Exception] = LayoutMismatchError(f"torch_ipc: cannot receive KV blocks: {mismatch}") \
        if mismatch else None
    if error is None:
        try:
            ids = pool.allocate(n)
        except OutOfBlocksError as e:
            error = e
    if error is not None:
        _drain(transport, pool, n * block_bytes, piece * block_bytes, src)
        raise error
    try:
        _receive_pieces(transport, pool, ids, piece, src)
    except BaseException:
        pool.free(ids)
        raise
    return RemoteHandover(ids, header.get("meta"), int(src))


def _receive_pieces(transport: Transport, pool: SharedKVPool, ids: List[int], piece: int, src: int) -> None:
    staging: List[torch.Tensor] = []
    pending: List[Tuple[Any, Optional[torch.Tensor], List[int]]] = []  # (work, staging or None, ids)

    def finish(work, buffer, piece_ids) -> None:
        work.wait()
        if buffer is not None:
            pool.scatter(piece_ids, buffer)

    for k, (lo, hi) in enumerate(_pieces(len(ids), piece)):
        target = _runs(pool, ids[lo:hi])
        buffer = None
        if target is None:
            if len(staging) < 2:
                staging.append(torch.empty((piece, *pool.block_shape), dtype=pool.dtype, device=pool.device))
            buffer = staging[k % 2][: hi - lo]
        if len(pending) == 2:  # the staging buffer of piece k - 2 is scattered before it is reused
            finish(*pending.pop(0))
        pending.append((transport.recv(target if buffer is None else buffer, src), buffer, ids[lo:hi]))
    for item in pending:
        finish(*item)


def _drain(transport: Transport, pool: SharedKVPool, total: int, piece: int, src: int) -> None:
    """Receive and drop the `total` bytes, in pieces of `piece` (checked in
    _check_header), that a sender sends and this pool cannot take."""
    scratch = torch.empty(piece, dtype=torch.uint8, device=pool.device)
    for lo in range(0, total, piece):
        transport.recv(scratch[: min(piece, total - lo)], src).wait()
