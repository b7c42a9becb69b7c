"""torch_ipc.kv: one paged KV cache pool shared once, then blocks handed over by id.

    >>> pool = SharedKVPool(1024, (2, 4, 16, 8, 64), torch.bfloat16, "cuda")  # owner  # doctest: +SKIP
    >>> conn.send(pool)                                 # once: peers attach     # doctest: +SKIP
    >>> ids = pool.allocate(8); pool.scatter(ids, kv)   # a writer               # doctest: +SKIP
    >>> pool.send(ids, conn)                            # ids + ordering signal  # doctest: +SKIP
    >>> ids, meta, _ = pool.recv(conn); pool.gather(ids)  # a reader             # doctest: +SKIP

Note [KV pool design]
Serving systems that split prefill and decode, or keep a cache server, share
one big pool once (its memory and who holds which block) and then pass only
block ids and an ordering signal per request. The pool is one or more chunks
of memory, each a tensor [blocks, *block_shape] exported once with
:func:`torch_ipc.dumps` (CPU: shared memory; CUDA: SharedPool memory by
default, so the memory outlives its owner), and one shared memory segment
(csrc/features/kv/block_allocator.*) that records the layout, the chunks' descriptors and
the holder of every block. A pickle of the pool is only the segment's name, so
any pickler carries it; whoever loads it attaches.

Note [hand-over]
``send(ids, conn)`` records an IpcEvent on the writer's stream after its
writes and sends (pool, sender, ids, event); ``recv(conn)`` moves the blocks to
the reader (``transfer=True``: the reader now holds them and frees them) and
makes the reader's stream wait on the event. The host never blocks: a reader
that touches the blocks on its current stream sees the writer's bytes. Until
``recv`` the sender still holds the blocks: if it closes the pool or exits
first, they go back to the pool and ``recv`` raises.

Note [growing a pool]
``grow(n)`` (the owner) appends a chunk of n blocks, ids [num_blocks,
num_blocks + n). Block ids never move and existing chunks stay mapped. Other
processes see the new ids in ``num_blocks``, may be handed them by
``allocate`` at once, and map the new chunk the first time they touch one of
its blocks (``block``, ``gather``, ``scatter``, ``recv``) or call ``refresh``.
``tensor`` covers one chunk only: after growth use ``chunks`` or the per-block
methods. A pool's size is bounded by ``max_blocks`` given at creation.
"""
from __future__ import annotations

import bisect
import functools
import os
import struct
import threading
import weakref
from array import array
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .. import _C, _runtime, _serialize
from .._cuda import cuda_device_index
from ..errors import DescriptorError, ProducerGoneError, ReleasedError
from ..ipc_event import IpcEvent
from ..pool import SharedPool

__all__ = ["SharedKVPool", "Handover", "LayoutMismatchError", "OutOfBlocksError"]

_UNLIMITED_LOADS = 2**32 - 1  # chunk exports: any number of peers may attach over time
_MESSAGE_TAG = "torch_ipc.kv/1"
_EVENTS_PER_STREAM = 4  # Note [event pool] in csrc/cuda/events.cpp: fewer reuses, fewer over-waits

Ids = Union[Sequence[int], torch.Tensor, array]


class LayoutMismatchError(ValueError):
    """The pool's blocks are not of the shape or dtype the attaching process expects."""


class OutOfBlocksError(RuntimeError):
    """Fewer blocks are free than ``allocate`` asked for (after reclaiming dead holders' blocks)."""


class Handover(NamedTuple):
    """What :meth:`SharedKVPool.recv` returns."""

    ids: List[int]
    meta: Any
    sender_pid: int


def _pack(ids: Ids) -> array:
    """Block ids as an array of int64 (what the allocator reads, no per-id conversion)."""
    if isinstance(ids, array) and ids.typecode == "q":
        return ids
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"block ids must be a 1-d integer tensor, not {ids.dtype} of shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, int):
        raise TypeError("block ids must be a sequence of ints, not one int")
    try:
        return array("q", ids)
    except OverflowError:
        raise IndexError(f"torch_ipc: a block id is out of range: {list(ids)!r}") from None
    except TypeError:
        raise TypeError(f"block ids must be ints, got {list(ids)!r}") from None


@functools.lru_cache(maxsize=64)
def _int64s(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


def _pack_bytes(ids: Ids) -> bytes:
    """Block ids as the bytes of int64s that the allocator reads (a list of
    ints goes through struct: ~3x faster than an array, in the hand-over path)."""
    if type(ids) is list or type(ids) is tuple:
        try:
            return _int64s(len(ids)).pack(*ids)
        except struct.error:
            pass  # _pack says what is wrong
    return _pack(ids).tobytes()


# Pools open in this process, by segment name: loading a pool that is already
# open here returns that object (one holder slot per process and pool).
_open_pools: "weakref.WeakValueDictionary[str, SharedKVPool]" = weakref.WeakValueDictionary()
_open_lock = threading.Lock()


def _reclaim_dead_holders() -> None:
    for pool in list(_open_pools.values()):
        if pool._pid != os.getpid():  # a forked child's inherited pool: not used here yet
            continue
        try:
            pool.reclaim()
        except Exception:  # a pool closed meanwhile
            pass


_runtime.on_collect(_reclaim_dead_holders)


class SharedKVPool:
    """A paged KV cache pool that several processes map, with block ownership.

    The owner creates it; other processes attach by loading its pickle (send
    the pool over a :class:`torch_ipc.Connection`, a ``multiprocessing`` queue
    or pipe, or carry ``torch_ipc.dumps(pool)``), best through
    :meth:`attach`, which checks the layout they expect. Every attached
    process sees the same memory: ``pool.tensor[i]`` (or ``pool.block(i)``) is
    block ``i``.

    Blocks are allocated and freed from any attached process; the allocator
    lives in shared memory, so no block is handed out twice, and the blocks of
    a process that exits (even by SIGKILL) or closes the pool go back to the
    pool. :meth:`send` / :meth:`recv` hand blocks from a writer to a reader
    with the writer's stream order (Note [hand-over]).

    Args:
        num_blocks: blocks to create now (ids 0 .. num_blocks - 1).
        block_shape: the shape of one block, e.g. ``(2, layers, block_size, heads, head_dim)``.
        dtype: the blocks' dtype.
        device: ``"cpu"`` (POSIX shared memory) or a CUDA device.
        blocks_per_chunk: blocks per allocation (default: all in one).
        max_blocks: the most blocks :meth:`grow` may reach (default: num_blocks).
        vmm: CUDA only: chunks from :class:`torch_ipc.SharedPool` (default; the
            memory outlives the owner) or from torch's caching allocator
            (legacy CUDA IPC; the memory dies with the owner).

    At most 14 processes besides the owner can map a pool at once (each
    chunk is one export, Note [holder limit] in csrc/os/refcount.h).
    """

    def __init__(
        self,
        num_blocks: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        device: Union[str, int, torch.device] = "cpu",
        *,
        blocks_per_chunk: Optional[int] = None,
        max_blocks: Optional[int] = None,
        vmm: bool = True,
    ) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, not {dtype!r}")
        num_blocks = int(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, not {num_blocks}")
        max_blocks = num_blocks if max_blocks is None else int(max_blocks)
        if max_blocks < num_blocks:
            raise ValueError(f"max_blocks ({max_blocks}) is below num_blocks ({num_blocks})")
        self._device = torch.device(device)
        if self._device.type == "cuda":
            self._device = torch.device("cuda", cuda_device_index(self._device, "a CUDA KV pool"))
        elif self._device.type != "cpu":
            raise ValueError(f"a KV pool lives on cpu or cuda, not {self._device}")
        chunk = num_blocks if blocks_per_chunk is None else int(blocks_per_chunk)
        if chunk < 1 or -(-num_blocks // chunk) > _C.BlockAllocator.max_chunks:
            raise ValueError(
                f"blocks_per_chunk must make 1 to {_C.BlockAllocator.max_chunks} chunks of the "
                f"{num_blocks} blocks, not {chunk}"
            )
        self._vmm = vmm and self._device.type == "cuda"
        _runtime.ensure_started()
        allocator = _C.BlockAllocator.create([int(s) for s in block_shape], dtype, max_blocks)
        self._setup(allocator, owner=True)
        try:
            for first in range(0, num_blocks, chunk):
                self.grow(min(chunk, num_blocks - first))
        except BaseException:
            self.close()
            raise

    def _setup(self, allocator: "_C.BlockAllocator", owner: bool) -> None:
        self._allocator = allocator
        self._name = allocator.name
        shape, dtype, block_bytes = allocator.layout
        self.block_shape: Tuple[int, ...] = tuple(shape)
        self.dtype: torch.dtype = dtype
        self.block_bytes: int = block_bytes
        self._owner = owner
        self._creator = _C.BlockAllocator.self_process() if owner else None
        self._chunks: List[torch.Tensor] = []
        self._starts: List[int] = []  # first block id of each chunk
        self._mapped = 0  # blocks of the chunks mapped here
        self._exports: List[Any] = []  # owner: the chunks' exports
        self._events: Dict[Any, List[IpcEvent]] = {}
        self._next_event = 0
        self._pending_frees: List[Tuple[Any, array]] = []  # Note [deferred free]
        self._pending_ids: set = set()
        self._lock = threading.RLock()
        self._closed = False
        self._pid = os.getpid()
        self._sender = (allocator.slot, *_C.BlockAllocator.self_process())  # what a hand-over names
        with _open_lock:
            _open_pools[self._name] = self

    # ------------------------------------------------------------------ attaching

    @classmethod
    def attach(
        cls,
        source: Any,
        block_shape: Optional[Sequence[int]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "SharedKVPool":
        """Attach to a pool and map its memory.

        ``source``: bytes from ``torch_ipc.dumps(pool)``, a connection or
        queue to receive the pool from (``recv()`` or ``get()``), or a pool
        already loaded. ``block_shape`` / ``dtype``: the layout this process
        expects; a pool of another layout raises :class:`LayoutMismatchError`
        (and is detached again).
        """
        if isinstance(source, (bytes, bytearray, memoryview)):
            try:
                pool = _serialize.loads(bytes(source))
            except DescriptorError as e:  # loads wraps what unpickling raised: say what it was
                if isinstance(e.__cause__, (ReleasedError, ProducerGoneError)):
                    raise e.__cause__ from None
                raise
        elif hasattr(source, "recv"):
            pool = source.recv()
        elif hasattr(source, "get"):
            pool = source.get()
        else:
            pool = source
        if not isinstance(pool, SharedKVPool):
            raise TypeError(f"expected a torch_ipc.kv.SharedKVPool, got {type(pool).__name__}")
        wrong = []
        if block_shape is not None and tuple(int(s) for s in block_shape) != pool.block_shape:
            wrong.append(f"block shape {pool.block_shape}, not {tuple(block_shape)}")
        if dtype is not None and dtype != pool.dtype:
            wrong.append(f"dtype {pool.dtype}, not {dtype}")
        if wrong:
            if not pool._owner:
                pool.close()
            raise LayoutMismatchError(f"torch_ipc: the KV pool {pool._name} has " + " and ".join(wrong))
        try:
            pool.refresh()
        except BaseException:
            if not pool._owner:
                pool.close()
            raise
        return pool

    def __reduce__(self):
        self._check_open()
        creator = self._creator
        if creator is None:
            creator = (0, 0)
        return (_load_pool, (self._name, creator[0], creator[1]))

    def refresh(self) -> int:
        """Map the chunks added since this process last looked (Note [growing a
        pool]); returns the blocks now mapped here."""
        self._check_open()
        with self._lock:
            for first, count, descriptor in self._allocator.chunks(len(self._chunks)):
                tensor = _serialize.loads(descriptor)
                if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (count, *self.block_shape):
                    raise DescriptorError(f"torch_ipc: KV pool {self._name} has a malformed chunk")
                self._add_chunk(first, tensor)
            return self._mapped

    def _add_chunk(self, first: int, tensor: torch.Tensor) -> None:
        if first != self._mapped:
            raise RuntimeError(f"torch_ipc: KV pool {self._name}: chunk at block {first}, expected {self._mapped}")
        self._chunks.append(tensor)
        self._starts.append(first)
        self._mapped = first + tensor.shape[0]
        if self._device is None:
            self._device = tensor.device

    def grow(self, n: int) -> List[int]:
        """Owner: add a chunk of ``n`` blocks (up to ``max_blocks``); returns
        its ids. See Note [growing a pool] for what other processes see."""
        self._check_open()
        if not self._owner:
            raise RuntimeError("torch_ipc: only the process that created a KV pool can grow it")
        n = int(n)
        with self._lock:
            if n < 1 or n > self.max_blocks - self._mapped:
                raise ValueError(
                    f"torch_ipc: the KV pool has {self._mapped} of at most {self.max_blocks} blocks; "
                    f"it cannot grow by {n} (max_blocks is set at creation)"
                )
            shape = (n, *self.block_shape)
            if self._vmm:
                tensor = SharedPool(self._device).empty(shape, self.dtype)
            else:
                tensor = torch.empty(shape, dtype=self.dtype, device=self._device)
            exported = _serialize.export([tensor], [False], b"", consumers=_UNLIMITED_LOADS)
            try:
                self._allocator.add_chunk(n, exported.data)
            except BaseException:
                exported.revoke()
                raise
            self._exports.append(exported)
            first = self._mapped
            self._add_chunk(first, tensor)
            return list(range(first, first + n))

    # ------------------------------------------------------------------ memory

    @property
    def device(self) -> torch.device:
        """Where the blocks live (an attached pool learns it from its first chunk)."""
        if self._device is None:
            self.refresh()
        return self._device

    @property
    def chunks(self) -> List[torch.Tensor]:
        """The mapped chunks, each a tensor [blocks, *block_shape], in block id order."""
        return list(self._chunks)

    @property
    def tensor(self) -> torch.Tensor:
        """The whole pool as one tensor [num_blocks, *block_shape] (a pool of one chunk)."""
        self._check_open()
        if len(self._chunks) != 1 or self._allocator.num_blocks != self._mapped:
            self.refresh()
        if len(self._chunks) != 1:
            raise RuntimeError(
                f"torch_ipc: KV pool {self._name} has {len(self._chunks)} chunks; use block(), gather(), "
                "scatter() or chunks"
            )
        return self._chunks[0]

    def block(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` of the pool (a view: writes land in the pool)."""
        self._check_open()
        block_id = int(block_id)
        chunk, local = self._locate(block_id)
        return self._chunks[chunk][local]

    def _locate(self, block_id: int) -> Tuple[int, int]:
        if block_id >= self._mapped:
            self.refresh()
        if not 0 <= block_id < self._mapped:
            raise IndexError(f"torch_ipc: block id {block_id} is out of range: the KV pool has {self._mapped} blocks")
        if len(self._starts) == 1:
            return 0, block_id
        chunk = bisect.bisect_right(self._starts, block_id) - 1
        return chunk, block_id - self._starts[chunk]

    def _index(self, packed: array) -> List[Tuple[int, torch.Tensor, Optional[List[int]]]]:
        """(chunk, ids within it on the pool's device, positions in `packed` or None for all)."""
        if len(packed) == 0:
            return []
        low, high = min(packed), max(packed)
        if high >= self._mapped:
            self.refresh()
        if low < 0 or high >= self._mapped:
            bad = low if low < 0 else high
            raise IndexError(f"torch_ipc: block id {bad} is out of range: the KV pool has {self._mapped} blocks")
        if len(self._chunks) == 1:
            return [(0, self._to_device(torch.frombuffer(packed, dtype=torch.int64)), None)]
        groups: Dict[int, Tuple[List[int], List[int]]] = {}
        for pos, block_id in enumerate(packed):
            chunk, local = self._locate(block_id)
            ids, positions = groups.setdefault(chunk, ([], []))
            ids.append(local)
            positions.append(pos)
        return [(c, self._to_device(torch.tensor(ids, dtype=torch.int64)), pos) for c, (ids, pos) in groups.items()]

    def _to_device(self, index: torch.Tensor) -> torch.Tensor:
        if self._device.type == "cpu":
            return index.clone()
        # Pinned, so the copy is queued on the stream and the host does not wait for it.
        return index.pin_memory().to(self._device, non_blocking=True)

    def _rows(self, *tensors: torch.Tensor) -> List[torch.Tensor]:
        """Each of `tensors` [n, *block_shape] as rows of the widest element that
        divides a block and suits every tensor's offset (index kernels move one
        element per thread: wider elements, fewer threads; copies are bitwise)."""
        raw = [t.reshape(t.shape[0], -1).view(torch.uint8) for t in tensors]
        for dtype, size in ((torch.complex128, 16), (torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
            if self.block_bytes % size == 0 and all(r.storage_offset() % size == 0 for r in raw):
                return [r.view(dtype) for r in raw]
        return raw

    def gather(self, ids: Ids, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The blocks ``ids`` copied into one contiguous tensor [len(ids), *block_shape]
        (into ``out`` when given), on the current stream."""
        self._check_open()
        packed = _pack(ids)
        device = self.device
        if out is None:
            out = torch.empty((len(packed), *self.block_shape), dtype=self.dtype, device=device)
        elif (
            tuple(out.shape) != (len(packed), *self.block_shape)
            or out.dtype != self.dtype
            or out.device != device
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be a contiguous {self.dtype} tensor of shape {(len(packed), *self.block_shape)} "
                f"on {self._device}"
            )
        for chunk, index, positions in self._index(packed):
            source, rows = self._rows(self._chunks[chunk], out)
            if positions is None:
                torch.index_select(source, 0, index, out=rows)
            else:
                rows[positions] = source.index_select(0, index)
        return out

    def scatter(self, ids: Ids, src: torch.Tensor) -> None:
        """Write ``src`` [len(ids), *block_shape] into the blocks ``ids``, on the current stream."""
        self._check_open()
        packed = _pack(ids)
        if tuple(src.shape) != (len(packed), *self.block_shape) or src.dtype != self.dtype:
            raise ValueError(f"src must be a {self.dtype} tensor of shape {(len(packed), *self.block_shape)}")
        if len(set(packed)) != len(packed):
            raise ValueError("torch_ipc: scatter() into a block listed twice")
        src = src.to(self.device).contiguous()
        for chunk, index, positions in self._index(packed):
            target, rows = self._rows(self._chunks[chunk], src)
            target.index_copy_(0, index, rows if positions is None else rows[positions])

    # ------------------------------------------------------------------ ownership

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
            self._allocator.free(_pack_bytes(ids))
            return
        packed = _pack(ids)
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

    # ------------------------------------------------------------------ hand-over

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
        packed = _pack_bytes(ids)
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

    # ------------------------------------------------------------------ lifetime

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
        self._allocator = _C.BlockAllocator.attach(self._name, *creator)
        self._pid = os.getpid()
        self._sender = (self._allocator.slot, *_C.BlockAllocator.self_process())
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
        with _open_lock:
            if _open_pools.get(self._name) is self:
                del _open_pools[self._name]
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

    def __enter__(self) -> "SharedKVPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self._closed:
            return "SharedKVPool(closed)"
        return (
            f"SharedKVPool({self.num_blocks} blocks of {self.block_shape} {self.dtype} on {self._device}, "
            f"{self.free_blocks} free, {'owner' if self._owner else 'attached'})"
        )


def _load_pool(name: str, pid: int, start_time: int) -> SharedKVPool:
    """Unpickling a pool: this process's open pool of that name, or a new attachment (chunks mapped lazily)."""
    with _open_lock:
        pool = _open_pools.get(name)
    if pool is not None and not pool.closed:
        pool._check_open()  # a forked child's own attachment
        return pool
    _runtime.ensure_started()
    pool = SharedKVPool.__new__(SharedKVPool)
    pool._device = None  # learnt from the first chunk
    pool._vmm = False
    allocator = _C.BlockAllocator.attach(name, pid, start_time)
    pool._setup(allocator, owner=False)
    pool._creator = (pid, start_time)
    return pool
