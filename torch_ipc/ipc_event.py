"""torch_ipc.IpcEvent: one CUDA event for several processes.

    >>> ev = torch_ipc.IpcEvent()          # producer  # doctest: +SKIP
    >>> x.add_(1); ev.record()             # after its writes  # doctest: +SKIP
    >>> conn.send(ev)                      # any pickler  # doctest: +SKIP
    >>> ev = conn.recv(); ev.wait()        # consumer: its stream waits  # doctest: +SKIP
"""

from typing import Optional

import torch

from . import _C
from ._cuda import DeviceLike, cuda_device_index

__all__ = ["IpcEvent"]


class IpcEvent:
    """A CUDA event that processes of one machine share.

    Like ``torch.cuda.Event(interprocess=True)``, with what sharing needs: it
    pickles with any pickler (``multiprocessing`` queues and pipes,
    :func:`torch_ipc.dumps`, ``pickle``), names its GPU by UUID (so a process
    with another ``CUDA_VISIBLE_DEVICES`` finds it), is opened once per process
    however often it arrives, and :meth:`wait` queues no stream wait when the
    event has completed already (a stream wait on an interprocess event delays
    the next kernel by ~0.2 ms). Any process may :meth:`record` it; it lives
    while any process holds it.
    """

    __slots__ = ("_event",)

    def __init__(self, device: DeviceLike = None):
        self._event = _C.IpcEvent(cuda_device_index(device, "torch_ipc.IpcEvent"))

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._event.device)

    def record(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Record the work queued so far on `stream` (default: the current stream of the event's device)."""
        self._event.record(self._stream_handle(stream))

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Make `stream`'s later work wait for the latest record; the host does not block."""
        self._event.wait(self._stream_handle(stream))

    def query(self) -> bool:
        """True when the work of the latest record has completed (or nothing was recorded)."""
        return self._event.query()

    def synchronize(self) -> None:
        """Block this thread (not the others) until the latest record completed."""
        self._event.synchronize()

    def _stream_handle(self, stream: Optional[torch.cuda.Stream]) -> Optional[int]:
        if stream is None:
            return None
        if stream.device != self.device:
            raise ValueError(f"torch_ipc.IpcEvent on {self.device} cannot be used with a stream of {stream.device}")
        return stream.cuda_stream

    def __reduce__(self):
        return (_rebuild_ipc_event, (self._event.state(),))

    def __repr__(self) -> str:
        return f"torch_ipc.IpcEvent(device={self.device})"


def _rebuild_ipc_event(state: bytes) -> IpcEvent:
    if not isinstance(state, bytes):
        raise TypeError(f"torch_ipc.IpcEvent state must be bytes, not {type(state).__name__}")
    event = IpcEvent.__new__(IpcEvent)
    event._event = _C.IpcEvent.from_state(state)
    return event
