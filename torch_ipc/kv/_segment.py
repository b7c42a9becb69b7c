"""Attaching to a pool's segment from what another process sent (bytes, a
connection, a queue or a pool), checked against the layout this process
expects. A pickle of a pool is the segment's name (SharedKVPool.__reduce__
in pool.py); the chunks are mapped by _chunks.py.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .. import _serialize
from ..errors import DescriptorError, ProducerGoneError, ReleasedError
from ._errors import LayoutMismatchError, PoolCorruptedError


def attach(
    cls: type,
    source: Any,
    block_shape: Optional[Sequence[int]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Any:
    """SharedKVPool.attach: the pool `source` delivers, of the layout asked
    for and its chunks mapped, or an error (and an attachment made here is
    closed again)."""
    pool = _receive_pool(source, cls)
    wrong = []
    if block_shape is not None and tuple(int(s) for s in block_shape) != pool.block_shape:
        wrong.append(f"block shape {pool.block_shape}, not {tuple(block_shape)}")
    if dtype is not None and dtype != pool.dtype:
        wrong.append(f"dtype {pool.dtype}, not {dtype}")
    if wrong:
        if not pool._state.owner:
            pool.close()
        raise LayoutMismatchError(f"torch_ipc: the KV pool {pool._state.name} has " + " and ".join(wrong))
    try:
        pool.refresh()
    except BaseException:
        if not pool._state.owner:
            pool.close()
        raise
    return pool


def _receive_pool(source: Any, cls: type) -> Any:
    """The pool `source` is, holds or delivers (what attach() accepts)."""
    if isinstance(source, cls):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        try:
            pool = _serialize.loads(bytes(source))
        except DescriptorError as e:  # loads wraps what unpickling raised: say what it was
            if isinstance(e.__cause__, (ReleasedError, ProducerGoneError, PoolCorruptedError, TimeoutError)):
                raise e.__cause__ from None
            raise
    elif hasattr(source, "recv"):
        pool = source.recv()
    elif hasattr(source, "get"):
        pool = source.get()
    else:
        pool = source
    if not isinstance(pool, cls):
        raise TypeError(f"expected a torch_ipc.kv.SharedKVPool, got {type(pool).__name__}")
    return pool
