"""The errors of torch_ipc.kv."""
from ..errors import PoolCorruptedError

__all__ = ["LayoutMismatchError", "OutOfBlocksError", "PoolCorruptedError"]


class LayoutMismatchError(ValueError):
    """The pool's blocks are not of the shape or dtype the attaching process expects."""


class OutOfBlocksError(RuntimeError):
    """Fewer blocks are free than ``allocate`` asked for (after reclaiming dead holders' blocks)."""
