"""Bytes between nodes: the one module that calls torch.distributed.

Weights relays (torch_ipc/weights/relay.py) and KV blocks across nodes
(torch_ipc/kv/remote.py) move tensors and small JSON messages through a
:class:`Transport`; nothing else in torch_ipc talks to another node.

Note [cross-node transport]
torch_ipc moves bulk data between nodes only through torch.distributed
(NCCL for CUDA tensors, gloo for CPU ones, or CUDA tensors over gloo). Every
transfer is one of three calls: ``broadcast`` of a contiguous byte range from
one rank to a group, and ``send`` / ``recv`` of one between two ranks, each
returning something to ``wait()`` on, plus small JSON messages built on them.
Another engine (NIXL, Mooncake's transfer engine, UCX) plugs in here, behind
the same three calls: it would register the long-lived buffers once (a
relay's snapshot or staging halves, a KV pool's chunks) and turn ``send`` /
``recv`` into one-sided writes or reads of those ranges, so a KV transfer
could skip the staging buffer altogether. Control (versions, ids, layouts)
travels as JSON, never pickle: a process group is not authenticated.
"""

import json
from typing import Any, Dict, List, Optional

import torch

__all__ = ["Transport", "MAX_MESSAGE_BYTES", "dtype_from_name"]

MAX_MESSAGE_BYTES = 64 << 20  # a JSON message longer than this is refused before allocating

_DTYPES: Dict[str, torch.dtype] = {
    str(d): d for d in (getattr(torch, n, None) for n in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "complex64", "complex128", "int64", "int32", "int16", "int8", "uint8", "bool",
        "uint16", "uint32", "uint64"))
    if isinstance(d, torch.dtype)
}


def dtype_from_name(name: Any) -> Optional[torch.dtype]:
    """The dtype that ``str(dtype)`` names (``"torch.bfloat16"``), or None:
    how a dtype read from a peer's JSON becomes a dtype, from a fixed list."""
    return _DTYPES.get(name) if isinstance(name, str) else None


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch_ipc: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group() first")
    return dist


class Transport:
    """torch.distributed over ``group`` (None: the default group). Ranks are
    global ranks, as in torch.distributed's own calls."""

    def __init__(self, group: Optional[Any] = None):
        self._dist = _dist()
        self.group = group
        self.rank = self._dist.get_rank()
        backend = str(self._dist.get_backend(group))
        # Small tensors (lengths, headers) on the CPU unless the group only has NCCL.
        self.nccl_only = "nccl" in backend and "gloo" not in backend
        self.backend = backend

    def small_device(self) -> torch.device:
        if self.nccl_only:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def check_device(self, tensor: torch.Tensor) -> None:
        if self.nccl_only and tensor.device.type != "cuda":
            raise ValueError(f"torch_ipc: a {self.backend} group moves CUDA tensors only, not {tensor.device} ones; "
                             "use a gloo group for CPU tensors")

    # ------------------------------------------------------------- bulk bytes

    def broadcast(self, tensor: torch.Tensor, src: int):
        """Start a broadcast of ``tensor`` from rank ``src``; returns the work to ``wait()`` on."""
        return self._dist.broadcast(tensor, src=src, group=self.group, async_op=True)

    def send(self, tensor: torch.Tensor, dst: int):
        """Start sending ``tensor`` to rank ``dst``; returns the work to ``wait()`` on."""
        if self.through_host(tensor):
            host = _pinned_like(tensor)
            host.copy_(tensor)  # after the work queued on the current stream; the host waits for it
            return _Staged(self._dist.isend(host, dst=dst, group=self.group), host)
        return self._dist.isend(tensor, dst=dst, group=self.group)

    def recv(self, tensor: torch.Tensor, src: int):
        """Start receiving ``tensor`` from rank ``src``; its ``wait()`` returns
        once the bytes are in ``tensor`` (CUDA: ordered on the current stream)."""
        if self.through_host(tensor):
            host = _pinned_like(tensor)
            return _Staged(self._dist.irecv(host, src=src, group=self.group), host, tensor)
        return self._dist.irecv(tensor, src=src, group=self.group)

    def through_host(self, tensor: torch.Tensor) -> bool:
        """Whether a send or receive of ``tensor`` is staged in host memory.
        Note [CUDA tensors over gloo]: gloo's point-to-point calls take host
        memory only (a CUDA tensor fails with EFAULT), its broadcast takes CUDA
        tensors and stages them itself. A staged piece is copied into page-
        locked memory from torch's caching host allocator (no allocation per
        piece once warm) with a synchronous copy, so the caller may overwrite
        its tensor as soon as send() returns, and the bytes of a piece are on
        the wire while the next piece is being copied; callers bound how many
        staged pieces are in flight (torch_ipc/kv/remote.py keeps two)."""
        return tensor.device.type == "cuda" and "nccl" not in self.backend

    # ------------------------------------------------------------- small messages

    def _int64s(self, values: List[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.small_device())

    def broadcast_ints(self, values: Optional[List[int]], n: int, src: int) -> List[int]:
        """``n`` int64s from ``src`` (which passes them) to every rank of the group."""
        t = self._int64s(values if self.rank == src else [0] * n)
        self.broadcast(t, src).wait()
        return list(values) if self.rank == src else t.tolist()  # the sender does not wait for the GPU

    def _encode(self, obj: Any) -> torch.Tensor:
        data = json.dumps(obj, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"torch_ipc: a control message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.small_device())

    def _buffer(self, n: int) -> torch.Tensor:
        if not 0 <= n <= MAX_MESSAGE_BYTES:
            raise ValueError(f"torch_ipc: a peer announced a control message of {n} bytes "
                             f"(at most {MAX_MESSAGE_BYTES})")
        return torch.empty(n, dtype=torch.uint8, device=self.small_device())

    @staticmethod
    def _decode(t: torch.Tensor) -> Any:
        try:
            return json.loads(bytes(t.cpu().numpy().tobytes()).decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"torch_ipc: a peer sent a control message that is not JSON: {e}") from None

    def broadcast_json(self, obj: Any, src: int) -> Any:
        """``obj`` (JSON-serialisable) from ``src`` to every rank; others pass None."""
        data = self._encode(obj) if self.rank == src else None
        (n,) = self.broadcast_ints([data.numel()] if data is not None else None, 1, src)
        if data is None:
            data = self._buffer(n)
        self.broadcast(data, src).wait()
        return obj if self.rank == src else self._decode(data)

    # One message of FIRST_BYTES carries the length and the start of a JSON
    # message (all of a small one: one round trip, not two); the rest follows.
    FIRST_BYTES = 4096

    def send_json(self, obj: Any, dst: int) -> None:
        data = self._encode(obj)
        n, room = data.numel(), self.FIRST_BYTES - 8
        first = torch.zeros(self.FIRST_BYTES, dtype=torch.uint8, device=data.device)
        first[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8).to(data.device)
        first[8 : 8 + min(n, room)] = data[:room]
        self.send(first, dst).wait()
        if n > room:
            self.send(data[room:], dst).wait()

    def recv_json(self, src: int) -> Any:
        first = torch.empty(self.FIRST_BYTES, dtype=torch.uint8, device=self.small_device())
        self.recv(first, src).wait()
        first = first.cpu()
        (n,) = first[:8].view(torch.int64).tolist()
        data, room = self._buffer(n), self.FIRST_BYTES - 8
        data[: min(n, room)] = first[8 : 8 + min(n, room)].to(data.device)
        if n > room:
            self.recv(data[room:], src).wait()
        return self._decode(data)


def _pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)


class _Staged:
    """A send or receive through host memory (Note [CUDA tensors over gloo]):
    holds the host buffer until wait(), which also copies a received one
    into its destination."""

    def __init__(self, work: Any, host: torch.Tensor, into: Optional[torch.Tensor] = None):
        self._work, self._host, self._into = work, host, into

    def wait(self) -> bool:
        self._work.wait()
        if self._into is not None:
            self._into.copy_(self._host)  # synchronous: the host buffer goes back to the cache after it
            self._into = None
        self._host = None
        return True
