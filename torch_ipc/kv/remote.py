"""KV blocks to a pool on another node, over torch.distributed.

    >>> # prefill node (rank 0)                         # decode node (rank 1)
    >>> ids = pool.allocate(8); pool.scatter(ids, kv)   # doctest: +SKIP
    >>> send_blocks(pool, ids, dst=1, meta={"request": 7})  # doctest: +SKIP
    >>>                                                 # h = recv_blocks(pool, src=0)  # doctest: +SKIP
    >>>                                                 # pool.gather(h.ids)            # doctest: +SKIP

Note [KV blocks across nodes]
The local hand-over (Note [hand-over] in torch_ipc/kv/_handover.py) passes
ids; across nodes the bytes must move. ``send_blocks`` cuts the ids into
pieces of at most ``staging_bytes`` (Note [KV piece size]) and posts a JSON
header (count, layout, meta, the pieces' lengths run-length encoded), then
the pieces. A piece is either one run of consecutive blocks of a chunk, sent
straight from the pool's memory, or short runs gathered into one of two
staging buffers. On a CPU pool every run of at least DIRECT_MIN_BYTES (1 MiB)
goes straight: a host gather costs a copy of every byte, a message its own
overhead (gloo on loopback, 2 cores: 256 random blocks of 2 MiB went at ~95%
of one raw send straight and ~40% gathered into 64 MiB pieces; 256 of 128
KiB, straight, as 256 messages, at ~45%, gathered into 4 MiB pieces at
~60%). On a CUDA pool only runs that fill a piece go straight (a device
gather is cheap, a message is not).
The sender does not wait for the header before it gathers and posts the
pieces: the transfers of a pair are ordered, and nothing lands on the
receiver before it has posted the receive of a piece, which it does only
once it has checked the header and allocated the blocks. It waits for the
header (the receiver has taken it) and for the pieces at the end. Waiting
first put the sender's gathers and posts after a round trip (the
receiver's poll, copy to the host, check and allocation; the sender's poll)
instead of beside it. ``recv_blocks`` polls for the header without sleeping for
HEADER_SPIN_S first (a sleep lasts ~60 us at least), copies it to the host
once, allocates the blocks in its own pool, then receives each piece
straight into a run of them or into staging and scatters it. Pieces without
staging are all posted at once (a gloo send moves only once its receive is
posted: one posted at a time left the wire idle for a round trip per
piece); at most two staged pieces (staging buffers, or host memory for CUDA
tensors over gloo, Note [CUDA tensors over gloo] in _dist.py) are in flight
on each side, so the gather or copy of the next overlaps the transfer of
this one and staging memory stays bounded. With NCCL, waiting for a piece
(to reuse its buffer) makes the current stream wait, not the host: the host
posts every piece at once, and the device orders each gather after the send
that used its buffer. Each piece is one send and one receive, not a
``batch``: torch.distributed runs an NCCL batch on the group's communicator
(whose first use needs every rank of the group) and a single send on the
pair's, so both sides would have to batch the same transfers, for one host
call less per piece, which pieces of Note [KV piece size] do not need.
The semantics are the local hand-over's: the bytes sent are those written
on the sender's current stream before the call (the sends are ordered after
it), the receiver's current stream is ordered after the scatter (the host
does not wait for NCCL), the receiver holds the new blocks and frees them,
and with ``transfer`` (default) the sender's blocks go back to its pool once
the sends completed. A receiver whose pool cannot take the blocks (other
layout, too few free) still drains the pieces, so the pair stays in step,
then raises. Only the pool's public API is used. Another transport: Note
[cross-node transport] in torch_ipc/_dist.py.

Note [KV piece size]
DEFAULT_STAGING_BYTES, the largest piece, is 128 MiB. A piece costs the
posting host one NCCL call (0.1-0.25 ms in torch.distributed, profiled on
H100s) and, gathered, one gather launch (58 us, Note [kv copy default] in
_copies.py); on the wire it takes 128 MiB / ~400 GB/s = ~0.32 ms between two
H100s over NVLink, so the host stays ahead of the wire. Pieces of 64 MiB
(~0.16 ms) did not: 256 random blocks of 2 MiB went at 64% of one raw send
of the same bytes, consecutive ones at 67% (2026-11-26), the posting host
the limit. Staging (where blocks are gathered or scattered) is two pieces,
256 MiB, per side. The first gather overlaps the header's round trip; a
receiver whose blocks are not consecutive scatters the last piece after the
wire is done (128 MiB at ~2.3 TB/s: ~60 us). Pieces are not ramped (a small
first or last one): the first gather is hidden already, and smaller last
pieces would cost such a receiver one call and one scatter launch each,
which its host, barely ahead of the wire at 128 MiB, has no time for. Over
400 Gb/s (~50 GB/s) a piece takes ~2.7 ms: the host is idle and the copies
are ~1% of the time. Measured with this Note's other changes (two H100s,
2026-11-26 14:21 UTC, distributed_bench.py, one run each, same machine):
128 MiB pieces 2.79 ms for 256 random blocks (59% of a raw send) and 2.34 ms
for consecutive ones (70%), 64 MiB pieces 2.91 ms (60%) and 2.68 ms (64%):
128 is no worse and better on runs, and neither reaches 90%. A profile of
the sender showed the host still the limit: ~0.5 ms of host per piece
(profiled) against ~0.44 ms on the wire.
"""

import bisect
import collections
import functools
import itertools
import json
import math
from typing import Any, Callable, Deque, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import _dist
from .._dist import Transport, dtype_from_name
from . import LayoutMismatchError, OutOfBlocksError, SharedKVPool
from ._ids import pack

__all__ = ["send_blocks", "recv_blocks", "RemoteHandover"]

_KIND = "torch_ipc.kv.blocks/2"
DEFAULT_STAGING_BYTES = 128 << 20  # Note [KV piece size]
HEADER_SPIN_S = 2e-3  # a receiver polls for the header without sleeping this long first
MAX_PIECE_BYTES = 1 << 30  # a receiver stages at most this much per piece, whatever a sender announces
DIRECT_MIN_BYTES = 1 << 20  # a CPU pool's runs of at least this many bytes are sent without a gather
STAGED_IN_FLIGHT = 2  # staged pieces in flight per side (two staging buffers)


class RemoteHandover(NamedTuple):
    """What :func:`recv_blocks` returns: the blocks now held here (ids of the
    receiving pool), the sender's ``meta`` and its global rank."""

    ids: List[int]
    meta: Any
    src: int


class _ChunkRuns:
    """Where consecutive blocks of a pool lie: one view of a chunk per run."""

    def __init__(self, pool: SharedKVPool):
        self.chunks = pool.chunks
        self.ends = list(itertools.accumulate(c.shape[0] for c in self.chunks))

    def _chunk(self, block: int) -> int:
        """The chunk holding `block`, or len(chunks) (not mapped here: never straight)."""
        return bisect.bisect_right(self.ends, block) if block >= 0 else len(self.chunks)

    def view(self, ids: Sequence[int]) -> Optional[torch.Tensor]:
        """The pool's memory of `ids` as one tensor when they are consecutive
        blocks of one chunk (nothing to gather or scatter), else None."""
        first, n = ids[0], len(ids)
        if ids[-1] != first + n - 1 or any(ids[i] != first + i for i in range(1, n - 1)):
            return None
        chunk = self._chunk(first)
        if chunk >= len(self.chunks) or first + n > self.ends[chunk]:
            return None
        start = self.ends[chunk] - self.chunks[chunk].shape[0]
        return self.chunks[chunk][first - start : first - start + n]

    def runs(self, ids: Sequence[int]) -> Iterator[Tuple[int, int]]:
        """Positions [lo, hi) in `ids` of its maximal runs of consecutive blocks of one chunk."""
        # A run goes on where an id follows its predecessor in the same mapped chunk; the
        # breaks are found by one comprehension (Note [a KV send's host time]).
        if len(self.chunks) <= 1:
            mapped = self.ends[-1] if self.ends else 0
            breaks = [i for i, (a, b) in enumerate(zip(ids, ids[1:]), 1) if b != a + 1 or b >= mapped]
        else:
            chunk = [self._chunk(b) for b in ids]
            unmapped = len(self.chunks)
            breaks = [i for i in range(1, len(ids))
                      if ids[i] != ids[i - 1] + 1 or chunk[i] != chunk[i - 1] or chunk[i] == unmapped]
        yield from zip([0, *breaks], [*breaks, len(ids)])


def _plan(memory: _ChunkRuns, ids: Sequence[int], piece: int, direct_min: int) -> List[int]:
    """The lengths of the pieces (Note [KV blocks across nodes]): runs of at
    least `direct_min` blocks cut into pieces of at most `piece`, shorter runs
    packed together into pieces of `piece` blocks to gather."""
    lengths: List[int] = []
    packed = 0  # blocks of short runs waiting to fill a gathered piece
    for lo, hi in memory.runs(ids):
        if hi - lo < direct_min:
            packed += hi - lo
            while packed >= piece:
                lengths.append(piece)
                packed -= piece
            continue
        if packed:
            lengths.append(packed)
            packed = 0
        lengths.extend(min(piece, hi - a) for a in range(lo, hi, piece))
    if packed:
        lengths.append(packed)
    return lengths


def _encode_lengths(lengths: List[int]) -> List[List[int]]:
    """[[length, repeat], ...]: 256 single blocks are one pair, not 256 numbers."""
    return [[length, len(list(group))] for length, group in itertools.groupby(lengths)]


def _bounds(lengths: Sequence[int]) -> List[Tuple[int, int]]:
    ends = list(itertools.accumulate(lengths))
    return [(end - length, end) for length, end in zip(lengths, ends)]


class _InFlight:
    """Sends or receives of pieces started, oldest first, and the staging
    buffers: at most STAGED_IN_FLIGHT pieces that hold staging (a buffer, or
    host memory for CUDA over gloo) are in flight; the others are all posted
    at once."""

    def __init__(self, transport: Transport, pool: SharedKVPool, piece_blocks: int):
        self._transport, self._pool, self._piece_blocks = transport, pool, piece_blocks
        self._items: Deque[Tuple[Any, bool, Optional[torch.Tensor], Optional[Callable[[], None]]]] = \
            collections.deque()
        self._staged = 0
        self._buffers: List[torch.Tensor] = []  # the free staging buffers

    def prepare(self, view: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], bool]:
        """(a staging buffer or None, staged) for a piece whose pool memory is
        `view` (None: not one run), once one more staged piece fits."""
        staged = view is None or self._transport.through_host(view)
        if staged:
            while self._staged >= STAGED_IN_FLIGHT:
                self._pop()
        if view is not None:
            return None, staged
        if not self._buffers:  # at most STAGED_IN_FLIGHT are made: the loop above gave one back otherwise
            pool = self._pool
            self._buffers.append(torch.empty((self._piece_blocks, *pool.block_shape), dtype=pool.dtype,
                                             device=pool.device))
        return self._buffers.pop(), staged

    def add(self, work: Any, staged: bool, buffer: Optional[torch.Tensor],
            then: Optional[Callable[[], None]] = None) -> None:
        """A piece started; `then()` runs once it is done, before its buffer is reused."""
        self._items.append((work, staged, buffer, then))
        self._staged += staged

    def _pop(self) -> None:
        work, staged, buffer, then = self._items.popleft()
        self._staged -= staged
        work.wait()
        if then is not None:
            then()
        if buffer is not None:
            self._buffers.append(buffer)

    def drain(self) -> None:
        while self._items:
            self._pop()


# Note [a KV send's host time]
# A send's header goes on the wire only after its checks and plan, so their
# host time is the transfer's latency. A profile on the H100 machine showed
# ~1 ms of Python before the header of 256 random blocks. The ids are packed
# once (an array of int64: no int() per id); the allocator checks in C++ that
# this process holds each, listed once (the list of every block this
# process holds, made into a set, cost time in proportion to the pool, not to
# the send); and the runs of consecutive blocks are found by one list
# comprehension, not one generator step and chunk lookup per id.
def send_blocks(
    pool: SharedKVPool,
    ids: Sequence[int],
    dst: int,
    *,
    group: Any = None,
    meta: Any = None,
    transfer: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    transport: Optional[Transport] = None,
) -> None:
    """Send the blocks ``ids`` (held by this process) of ``pool`` to the
    process of global rank ``dst`` in ``group``, which calls
    :func:`recv_blocks`. ``meta``: any JSON value, travelling along (JSON,
    not pickle: a process group is not authenticated). ``transfer``: give
    the blocks back to this pool after the send (default), else keep them.
    ``staging_bytes``: the largest piece (two staging buffers of it at most;
    Note [KV piece size]).
    ``transport``: another :class:`torch_ipc.Transport` instead of
    torch.distributed over ``group`` (Note [cross-node transport]).
    See Note [KV blocks across nodes]."""
    ids = pack(ids)  # Note [a KV send's host time]
    if not ids:
        raise ValueError("torch_ipc: send_blocks() of no blocks")
    pool._check_open()  # its own calls below (check_held, the gathers) do not check it
    pool._ownership.check_held(ids.tobytes())  # held by this process, each listed once
    transport = _dist.transport_for(transport, group)
    transport.check_device(pool.chunks[0] if pool.chunks else pool.block(ids[0]))
    piece = max(1, min(len(ids), int(staging_bytes) // pool.block_bytes))
    memory = _ChunkRuns(pool)
    direct_min = piece if pool.device.type == "cuda" else -(-DIRECT_MIN_BYTES // pool.block_bytes)
    lengths = _plan(memory, ids, piece, direct_min)
    header = {"kind": _KIND, "n": len(ids), "pieces": _encode_lengths(lengths), "shape": list(pool.block_shape),
              "dtype": str(pool.dtype), "meta": meta}
    try:
        json.dumps(header)
    except (TypeError, ValueError) as e:
        raise TypeError(f"torch_ipc: meta must be a JSON value ({e})") from None
    _send_pieces(transport, pool, memory, ids, lengths, dst, _dist.post_json(transport, header, dst))
    if transfer:
        pool.free(ids)  # CUDA: once the current stream, which waited for the sends, gets there


def _send_pieces(transport: Transport, pool: SharedKVPool, memory: _ChunkRuns, ids: List[int],
                 lengths: List[int], dst: int, header: List[Tuple[Any, torch.Tensor]]) -> None:
    """Post the pieces behind the header's messages (posted, not waited for:
    Note [KV blocks across nodes]), then wait for the header and the pieces."""
    in_flight = _InFlight(transport, pool, max(lengths))
    for lo, hi in _bounds(lengths):
        data = memory.view(ids[lo:hi])
        buffer, staged = in_flight.prepare(data)
        if buffer is not None:  # the first piece's gather on every SM; the others beside the sends
            data = pool._copies.gather(ids[lo:hi], buffer[: hi - lo], beside_transfers=lo > 0)
        in_flight.add(transport.send(data, dst), staged, buffer)
    for work, message in header:
        _dist.finish(work, message)  # the receiver has taken the header
    in_flight.drain()


def _pairs_from(header: Dict[str, Any], n: int) -> List[Tuple[int, int]]:
    """The pieces' lengths of a peer's header as (length, repeat) pairs,
    checked (positive, adding up to n) without expanding them: a header of a
    few bytes may announce 2**39 pieces (Note [counts from a peer] in _dist.py)."""
    pairs = header.get("pieces")
    if not (isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 and all(type(v) is int and v > 0
                                                                                     for v in p) for p in pairs)
            and sum(repeat for _, repeat in pairs) <= n and sum(length * repeat for length, repeat in pairs) == n):
        raise ValueError(f"torch_ipc: a KV blocks header whose pieces {str(pairs)[:200]} do not add up to {n} "
                         "blocks; the pair is out of step")
    return [(length, repeat) for length, repeat in pairs]


def _expand(pairs: Sequence[Tuple[int, int]]) -> List[int]:
    """The pieces' lengths, one each: only once their blocks are allocated here (bounded by the pool)."""
    return [length for length, repeat in pairs for _ in range(repeat)]


def _check_header(pool: SharedKVPool, header: Any) -> Tuple[int, List[Tuple[int, int]], int, Optional[str]]:
    """(blocks, the pieces' (length, repeat) pairs, the sender's block bytes,
    why this pool cannot take them or None) of a peer's header, every field
    checked."""
    if not isinstance(header, dict) or header.get("kind") != _KIND:
        raise ValueError("torch_ipc: recv_blocks() got something that is not a KV blocks header "
                         f"of this version ({_KIND})")
    n, shape, dtype = header.get("n"), header.get("shape"), header.get("dtype")
    if type(n) is not int or not 0 < n < 2**40:
        raise ValueError(f"torch_ipc: a KV blocks header with n={n!r}; the pair is out of step")
    if not (isinstance(shape, list) and len(shape) <= 16 and all(type(d) is int and 0 < d < 2**40 for d in shape)
            and dtype_from_name(dtype) is not None):
        raise ValueError(f"torch_ipc: a KV blocks header with shape {str(shape)[:200]}, dtype {dtype!r}")
    pairs = _pairs_from(header, n)
    block_bytes = math.prod(shape) * torch.empty(0, dtype=dtype_from_name(dtype)).element_size()
    longest = max(length for length, _ in pairs)
    if longest * block_bytes > max(MAX_PIECE_BYTES, block_bytes):
        raise ValueError(f"torch_ipc: the sender's pieces of {longest * block_bytes} bytes are over "
                         f"{MAX_PIECE_BYTES}; the pair is out of step")
    if shape != list(pool.block_shape) or dtype != str(pool.dtype):
        return n, pairs, block_bytes, (f"the sender's blocks are {dtype} of shape {tuple(shape)}, "
                                       f"this pool's {pool.dtype} of shape {pool.block_shape}")
    return n, pairs, block_bytes, None


def recv_blocks(
    pool: SharedKVPool,
    src: int,
    *,
    group: Any = None,
    transport: Optional[Transport] = None,
) -> RemoteHandover:
    """Receive blocks that the process of global rank ``src`` sends with
    :func:`send_blocks`: allocate them in ``pool`` (this process holds them
    and frees them) and write them there, ordered on the current stream.
    Raises :class:`LayoutMismatchError` or :class:`OutOfBlocksError` (after
    draining what was sent, so the pair stays in step). ``transport``: as
    in :func:`send_blocks`."""
    transport = _dist.transport_for(transport, group)
    header = _dist.recv_json(transport, src, spin=HEADER_SPIN_S)
    n, pairs, block_bytes, mismatch = _check_header(pool, header)
    ids: List[int] = []
    error: Optional[Exception] = LayoutMismatchError(f"torch_ipc: cannot receive KV blocks: {mismatch}") \
        if mismatch else None
    if error is None:
        try:
            ids = pool.allocate(n)
        except OutOfBlocksError as e:
            error = e
    if error is not None:
        _drain(transport, pool, pairs, block_bytes, src)
        raise error
    try:
        _receive_pieces(transport, pool, ids, _expand(pairs), src)
    except BaseException:
        pool.free(ids)
        raise
    return RemoteHandover(ids, header.get("meta"), int(src))


def _receive_pieces(transport: Transport, pool: SharedKVPool, ids: List[int], lengths: List[int], src: int) -> None:
    memory, in_flight = _ChunkRuns(pool), _InFlight(transport, pool, max(lengths))
    for lo, hi in _bounds(lengths):
        target, then = memory.view(ids[lo:hi]), None
        buffer, staged = in_flight.prepare(target)
        if buffer is not None:  # every scatter but the last runs beside a receive
            target = buffer[: hi - lo]
            then = functools.partial(pool._copies.scatter, ids[lo:hi], target, beside_transfers=hi < len(ids))
        in_flight.add(transport.recv(target, src), staged, buffer, then)
    in_flight.drain()


def _drain(transport: Transport, pool: SharedKVPool, pairs: Sequence[Tuple[int, int]], block_bytes: int,
           src: int) -> None:
    """Receive and drop the pieces (checked in _check_header) that a sender
    sends and this pool cannot take, one at a time, never listing them."""
    scratch = torch.empty(max(length for length, _ in pairs) * block_bytes, dtype=torch.uint8, device=pool.device)
    for length, repeat in pairs:
        for _ in range(repeat):
            transport.recv(scratch[: length * block_bytes], src).wait()
