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

The package: ``pool`` (the facade, SharedKVPool, over parts that share
one declared state, ``_state.PoolState``), ``_chunks`` (mapping chunks,
growth: Note [growing a pool]), ``_copies`` (gather, scatter: Note [kv
copies]), ``_ownership`` (allocate, free: Note [deferred free]),
``_handover`` (send, recv: Note [hand-over]), ``_lifetime`` (close, fork),
``_segment`` (attaching), ``_registry`` (the pools open here), ``_ids``,
``_errors``; ``remote`` moves blocks to another node.
"""
from ._errors import LayoutMismatchError, OutOfBlocksError, PoolCorruptedError
from ._handover import Handover
from .pool import SharedKVPool, _load_pool  # noqa: F401  (_load_pool: the reducer pickles name)

__all__ = ["SharedKVPool", "Handover", "LayoutMismatchError", "OutOfBlocksError", "PoolCorruptedError"]
