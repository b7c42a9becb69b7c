"""The ordering signal between trainer and subscribers: torch_ipc.IpcEvent
(any process may record it or wait on it; it pickles with any pickler)."""

import torch

from ..ipc_event import IpcEvent


def new_event(device: torch.device):
    """An interprocess event on `device`; None on CPU, where copies are synchronous."""
    return IpcEvent(device) if device.type == "cuda" else None
