"""SharedKVPool: the facade. It checks its arguments and that the pool is
open, then hands each call to one of the pool's parts, all sharing one
PoolState (_state.py):

    _chunks     the chunks mapped here, growth, where a block id lies
    _copies     gather and scatter (Note [kv copies])
    _ownership  allocate, free (Note [deferred free]), holders, reclaim
    _handover   send and recv (Note [hand-over])
    _lifetime   open, closed, the forked child's own attachment
    _segment    attaching from bytes, a connection, a queue or a pool
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import _C, _runtime
from .._closing import Closeable
from .._cuda import cuda_device_index
from . import _registry, _segment
from ._chunks import Chunks
from ._copies import BlockCopies
from ._handover import Handover, HandoverEnds
from ._ids import Ids
from ._lifetime import Lifetime
from ._ownership import Ownership
from ._state import PoolState


class SharedKVPool(Closeable):
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
    with the writer's stream order (Note [hand-over] in _handover.py).

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

    # The state and the parts over it (_assemble), and nothing else; the registry holds weak references.
    __slots__ = ("_state", "_chunks", "_copies", "_ownership", "_handover", "_lifetime", "__weakref__")

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
        device = torch.device(device)
        if device.type == "cuda":
            device = torch.device("cuda", cuda_device_index(device, "a CUDA KV pool"))
        elif device.type != "cpu":
            raise ValueError(f"a KV pool lives on cpu or cuda, not {device}")
        chunk = num_blocks if blocks_per_chunk is None else int(blocks_per_chunk)
        if chunk < 1 or -(-num_blocks // chunk) > _C.BlockAllocator.max_chunks:
            raise ValueError(
                f"blocks_per_chunk must make 1 to {_C.BlockAllocator.max_chunks} chunks of the "
                f"{num_blocks} blocks, not {chunk}"
            )
        _runtime.ensure_started()
        allocator = _C.BlockAllocator.create([int(s) for s in block_shape], dtype, max_blocks)
        self._assemble(PoolState.of(allocator, owner=True, creator=_C.self_identity(), device=device,
                                    vmm=vmm and device.type == "cuda"))
        try:
            for first in range(0, num_blocks, chunk):
                self.grow(min(chunk, num_blocks - first))
        except BaseException:
            self.close()
            raise

    def _assemble(self, state: PoolState) -> None:
        """The parts over `state`, and the pool registered as open here."""
        self._state = state
        self._chunks = Chunks(state)
        self._copies = BlockCopies(state, self._chunks)
        self._ownership = Ownership(state)
        self._handover = HandoverEnds(state, self._chunks)
        self._lifetime = Lifetime(state, self._ownership)
        _registry.register(state.name, self)

    def _check_open(self) -> None:
        self._lifetime.check_open()

    # ------------------------------------------------------------- layout

    @property
    def block_shape(self) -> Tuple[int, ...]:
        """The shape of one block."""
        return self._state.block_shape

    @property
    def dtype(self) -> torch.dtype:
        """The blocks' dtype."""
        return self._state.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block."""
        return self._state.block_bytes

    def __repr__(self) -> str:
        if self._state.closed:
            return "SharedKVPool(closed)"
        return (
            f"SharedKVPool({self.num_blocks} blocks of {self.block_shape} {self.dtype} on {self._state.device}, "
            f"{self.free_blocks} free, {'owner' if self._state.owner else 'attached'})"
        )

    # --------------------------------------------- attaching, pickling (_segment)

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
        return _segment.attach(cls, source, block_shape, dtype)

    def __reduce__(self):
        # Beside _load_pool, the reducer pickles name (torch_ipc.kv._load_pool).
        self._check_open()
        return (_load_pool, (self._state.name, *self._state.creator))

    # ------------------------------------------------------ memory (_chunks)

    def refresh(self) -> int:
        """Map the chunks added since this process last looked (Note [growing a
        pool] in _chunks.py); returns the blocks now mapped here."""
        self._check_open()
        return self._chunks.refresh()

    def grow(self, n: int) -> List[int]:
        """Owner: add a chunk of ``n`` blocks (up to ``max_blocks``); returns
        its ids. See Note [growing a pool] for what other processes see."""
        self._check_open()
        return self._chunks.grow(n)

    @property
    def device(self) -> torch.device:
        """Where the blocks live (an attached pool learns it from its first chunk)."""
        if self._state.device is None:
            self.refresh()
        return self._state.device

    @property
    def chunks(self) -> List[torch.Tensor]:
        """The mapped chunks, each a tensor [blocks, *block_shape], in block id order."""
        return list(self._state.chunks)

    @property
    def tensor(self) -> torch.Tensor:
        """The whole pool as one tensor [num_blocks, *block_shape] (a pool of one chunk)."""
        self._check_open()
        return self._chunks.whole()

    def block(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` of the pool (a view: writes land in the pool)."""
        self._check_open()
        return self._chunks.block(block_id)

    # ----------------------------------------------------- copies (_copies)

    @property
    def copy_path(self) -> str:
        """How the last gather()/scatter() copied: "kernel" or "index_select (why)" (Note [kv copies])."""
        return self._state.copy_path

    def gather(self, ids: Ids, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The blocks ``ids`` copied into one contiguous tensor [len(ids), *block_shape]
        (into ``out`` when given), on the current stream. ``copy_path`` says how."""
        self._check_open()
        return self._copies.gather(ids, out)

    def scatter(self, ids: Ids, src: torch.Tensor) -> None:
        """Write ``src`` [len(ids), *block_shape] into the blocks ``ids``, on the current
        stream. ``copy_path`` says how."""
        self._check_open()
        self._copies.scatter(ids, src)

    # ------------------------------------------------- ownership (_ownership)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (grows with :meth:`grow`)."""
        self._check_open()
        return self._state.allocator.num_blocks

    @property
    def max_blocks(self) -> int:
        self._check_open()
        return self._state.allocator.max_blocks

    @property
    def free_blocks(self) -> int:
        self._check_open()
        return self._state.allocator.free_blocks

    def allocate(self, n: int) -> List[int]:
        """``n`` free blocks, now held by this process (until :meth:`free`,
        a hand-over, :meth:`close` or this process's exit); else
        :class:`OutOfBlocksError`. On a CUDA pool, where this process's own
        frees still waiting for the GPU would make up the difference, it
        waits for them first (Note [deferred free] in _ownership.py)."""
        self._check_open()
        return self._ownership.allocate(n)

    def free(self, ids: Ids, *, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Give back blocks this process holds. All or nothing: ``IndexError``
        for an id out of range, ``ValueError`` for a block this process does
        not hold (free already, or another's) or one listed twice.

        On a CUDA pool the blocks go back once the work queued so far on
        ``stream`` (default: the current stream) has finished, so that nobody
        writes into a block this process still reads (Note [deferred free] in
        _ownership.py); the host does not wait."""
        self._check_open()
        self._ownership.free(ids, stream)

    def held(self) -> List[int]:
        """The blocks this process holds."""
        self._check_open()
        return self._ownership.held()

    def holder_of(self, block_id: int) -> Optional[int]:
        """The pid holding block ``block_id``, or None when it is free."""
        self._check_open()
        return self._ownership.holder_of(block_id)

    def holders(self) -> Dict[int, int]:
        """pid -> blocks held, for every attached process (dead ones until reclaimed)."""
        self._check_open()
        return self._ownership.holders()

    def reclaim(self) -> int:
        """Give back now the blocks of attached processes that exited (each
        attached process also does it in the background, and ``allocate``
        when short); returns how many came back."""
        self._check_open()
        return self._ownership.reclaim()

    def _reclaim_unless_busy(self) -> int:
        """The background collector's reclaim (_registry.py): nothing when another
        process holds the lock now, nor in a forked child that has not used the pool."""
        if self._state.pid != os.getpid():
            return 0
        return self._ownership.reclaim_unless_busy()

    @property
    def lock_timeout(self) -> float:
        """Seconds an operation of this process waits for the pool's lock
        before it raises ``TimeoutError`` saying who holds it (default
        TORCH_IPC_KV_LOCK_TIMEOUT, else 10; Note [the pool's lock] in
        csrc/features/kv/pool_lock.h). Per process."""
        self._check_open()
        return self._state.allocator.lock_timeout

    @lock_timeout.setter
    def lock_timeout(self, seconds: float) -> None:
        self._check_open()
        self._state.allocator.lock_timeout = float(seconds)

    # ------------------------------------------------- hand-over (_handover)

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
        self._handover.send(ids, conn, stream, transfer, meta)

    def recv(self, conn: Any, *, stream: Optional[torch.cuda.Stream] = None) -> Handover:
        """Receive a hand-over from ``conn`` (anything with ``recv`` or
        ``get``): take the blocks over (when sent with ``transfer``) and make
        ``stream`` (default: the current stream) wait for the writer's work
        on them. The host does not wait."""
        self._check_open()
        return self._handover.recv(conn, stream)

    # -------------------------------------------------- lifetime (_lifetime)

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Detach: the blocks this process holds go back to the pool and its
        mappings are released (after the work queued on them). The owner also
        stops new processes from attaching; those attached keep working.
        Idempotent."""
        state = getattr(self, "_state", None)
        if state is None or state.closed:
            return
        _registry.unregister(state.name, self)
        self._lifetime.close()


def _load_pool(name: str, pid: int, start_time: int, life: int = 0, pidns: int = 0) -> SharedKVPool:
    """Unpickling a pool: this process's open pool of that name, or a new attachment (chunks mapped lazily).
    The creator's life key and PID namespace let a process of another PID
    namespace judge it (Note [pool slots across PID namespaces])."""
    pool = _registry.find(name)
    if pool is not None and not pool.closed:
        pool._check_open()  # a forked child's own attachment
        return pool
    _runtime.ensure_started()
    creator = (pid, start_time, life, pidns)
    allocator = _C.BlockAllocator.attach(name, *creator)
    pool = SharedKVPool.__new__(SharedKVPool)
    pool._assemble(PoolState.of(allocator, owner=False, creator=creator, device=None, vmm=False))
    return pool


_load_pool.__module__ = "torch_ipc.kv"  # pickles name it torch_ipc.kv._load_pool, where it is exported
