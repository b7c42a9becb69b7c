"""CUDA device arguments of the public API, read one way."""

from typing import Union

import torch

from . import _C
from .errors import CudaUnavailableError

DeviceLike = Union[None, int, str, torch.device]


def cuda_device_index(device: DeviceLike, what: str) -> int:
    """The CUDA device index `device` names (None: the current device); `what`
    is the caller's name for the messages."""
    if not torch.cuda.is_available():
        ok, why = _C.cuda_available()
        raise CudaUnavailableError(f"{what} needs CUDA, and torch here cannot use it" + ("" if ok else f" ({why})"))
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{what} lives on a CUDA device, not {device}")
    return torch.cuda.current_device() if device.index is None else device.index
