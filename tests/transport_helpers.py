"""A second Transport (Note [cross-node transport] in torch_ipc/_dist.py):
ranks are threads of one process, messages are copies held by a shared hub.
The cross-node protocols run on it unchanged; tests also use it to play a
peer that sends what it likes."""

import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

WAIT_S = 60.0


class Hub:
    """What the ranks of one in-memory group share: messages by key."""

    def __init__(self, world: int, wait_s: float = WAIT_S):
        self.world, self.wait_s = world, wait_s
        self.cv = threading.Condition()
        self.mail: Dict[Tuple, List[Any]] = {}  # key -> [bytes tensor, readers left]
        self.counters: Dict[Tuple, int] = {}

    def transport(self, rank: int) -> "QueueTransport":
        return QueueTransport(self, rank)

    def next(self, key: Tuple) -> int:
        with self.cv:
            n = self.counters.get(key, 0)
            self.counters[key] = n + 1
            return n

    def put(self, key: Tuple, data: torch.Tensor, readers: int) -> None:
        with self.cv:
            self.mail[key] = [data, readers]
            self.cv.notify_all()

    def ready(self, key: Tuple) -> bool:
        with self.cv:
            return key in self.mail

    def take(self, key: Tuple, wait_s: Optional[float] = None) -> torch.Tensor:
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        with self.cv:
            while key not in self.mail:
                if not self.cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"in-memory transport: nothing arrived for {key}")
            entry = self.mail[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self.mail[key]
            return entry[0]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().clone()


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


class _Arrival:
    """A receive: wait() copies the message into the tensor (same byte count, as NCCL requires)."""

    def __init__(self, hub: Hub, key: Tuple, into: torch.Tensor):
        self._hub, self._key, self._into = hub, key, into

    def is_completed(self) -> bool:
        return self._into is None or self._hub.ready(self._key)

    def wait(self, timeout=None) -> bool:
        if self._into is None:
            return True
        wait_s = None if timeout is None else timeout.total_seconds()
        data, into, self._into = self._hub.take(self._key, wait_s), self._into, None
        nbytes = into.numel() * into.element_size()
        if data.numel() != nbytes:
            raise RuntimeError(f"in-memory transport: {data.numel()} bytes arrived for a tensor of {nbytes}")
        into.copy_(data.to(into.device).view(into.dtype).view(into.shape))
        return True


class QueueTransport:
    """One rank of a :class:`Hub`: the calls of torch_ipc's Transport protocol."""

    control_device = torch.device("cpu")

    def __init__(self, hub: Hub, rank: int):
        self.hub, self.rank = hub, rank

    def check_device(self, tensor: torch.Tensor) -> None:
        pass  # any device: the hub copies through host memory

    def through_host(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def broadcast(self, tensor: torch.Tensor, src: int):
        key = ("broadcast", self.hub.next(("broadcast", self.rank)))
        if self.rank == src:
            self.hub.put(key, _bytes_of(tensor), self.hub.world - 1)
            return _Done()
        return _Arrival(self.hub, key, tensor)

    def send(self, tensor: torch.Tensor, dst: int):
        self.hub.put(("p2p", self.rank, dst, self.hub.next(("send", self.rank, dst))), _bytes_of(tensor), 1)
        return _Done()

    def recv(self, tensor: torch.Tensor, src: int):
        return _Arrival(self.hub, ("p2p", src, self.rank, self.hub.next(("recv", src, self.rank))), tensor)

    def batch(self, ops: Sequence[Tuple[str, torch.Tensor, int]]) -> List[Any]:
        return [self.send(t, peer) if kind == "send" else self.recv(t, peer) for kind, t, peer in ops]


def run_ranks(fns, timeout: float = WAIT_S) -> List[Any]:
    """Run fns[r]() in one thread per rank; their results, or re-raise the first error."""
    results: List[Any] = [None] * len(fns)
    errors: List[BaseException] = []

    def run(r):
        try:
            results[r] = fns[r]()
        except BaseException as e:  # noqa: B902 - reported to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("a rank of the in-memory group did not finish")
    if errors:
        raise errors[0]
    return results
