"""``torch_ipc.reduce_tensor``: a drop-in for torch.multiprocessing.reductions.reduce_tensor.

Note [reduce_tensor handles]
RL frameworks (vLLM's colocated RLHF example, verl, SGLang) call torch's
``reduce_tensor(t)`` per weight, ship the ``(rebuild, args)`` pair over ZMQ,
Ray or HTTP, and call ``rebuild(*args)`` in each inference worker, after
rewriting ``args[6]``, the sender's device index, for the worker's
CUDA_VISIBLE_DEVICES. Here ``args`` is one descriptor, which names the GPU by
UUID: there is nothing to rewrite. The pair pickles with plain pickle (the
rebuild is a module-level function and ``args`` is bytes), and the rebuild
loads with ``weights_only=True``, so bytes from an HTTP endpoint run no code
of the sender's choosing. Lifetime is that of a payload a ForkingPickler
instance pickled (Note [one payload, several loaders] in _reductions.py):
any number of workers rebuild while the sender references the tensor, and
the first one after it dropped it.
"""

from typing import Callable, Tuple

import torch

from .. import _serialize

__all__ = ["reduce_tensor", "rebuild_tensor"]


def reduce_tensor(tensor: torch.Tensor) -> Tuple[Callable[[bytes], torch.Tensor], Tuple[bytes]]:
    """``(rebuild, args)`` such that ``rebuild(*args)`` in another process
    (or this one) is a tensor on the same memory as ``tensor``, on the same
    GPU whatever that process's ``CUDA_VISIBLE_DEVICES``.

    Example::

        >>> import pickle, torch, torch_ipc
        >>> x = torch.zeros(3)
        >>> func, args = pickle.loads(pickle.dumps(torch_ipc.reduce_tensor(x)))
        >>> func(*args).add_(1).data_ptr() == x.data_ptr(), x.tolist()
        (True, [1.0, 1.0, 1.0])
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"torch_ipc.reduce_tensor() takes a tensor, not {type(tensor).__name__}")
    return (rebuild_tensor, (_serialize.export_object(tensor, while_referenced=True).data,))


def rebuild_tensor(descriptor: bytes) -> torch.Tensor:
    """The tensor of a :func:`reduce_tensor` handle, on the sender's memory."""
    return _serialize.loads(descriptor, weights_only=True, expect=torch.Tensor, what="a reduce_tensor() handle")
