"""The ordering signal between trainer and subscribers: torch_ipc.IpcEvent
(any process may record it or wait on it; it pickles with any pickler)."""

from typing import Optional

import torch

import torch_ipc


class _TorchEvent:
    """``torch.cuda.Event(interprocess=True)`` behind IpcEvent's API, for a
    build of torch_ipc that lacks ``torch_ipc.IpcEvent``."""

    def __init__(self, device=None, _handle: Optional[bytes] = None):
        index = device if isinstance(device, int) else None if device is None else torch.device(device).index
        if index is None:
            index = torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        if _handle is None:
            self._event = torch.cuda.Event(interprocess=True)
            with torch.cuda.device(self.device):
                self._event.record()  # creates it on its device
        else:
            self._event = torch.cuda.Event.from_ipc_handle(self.device, _handle)

    def record(self, stream=None) -> None:
        self._event.record(torch.cuda.current_stream(self.device) if stream is None else stream)

    def wait(self, stream=None) -> None:
        if not self._event.query():
            self._event.wait(torch.cuda.current_stream(self.device) if stream is None else stream)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def __reduce__(self):
        return (_TorchEvent, (self.device.index, self._event.ipc_handle()))


IpcEvent = getattr(torch_ipc, "IpcEvent", None) or _TorchEvent


def new_event(device: torch.device):
    """An interprocess event on `device`; None on CPU, where copies are synchronous."""
    return IpcEvent(device) if device.type == "cuda" else None
