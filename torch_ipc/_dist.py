"""Bytes between nodes: the Transport seam and its torch.distributed implementation.

Weights relays (torch_ipc/weights/relay.py), sharded weights across nodes
(torch_ipc/weights/_shard_remote.py) and KV blocks across nodes
(torch_ipc/kv/remote.py) move tensors and small JSON messages through a
:class:`Transport`; nothing else in torch_ipc talks to another node.

Note [cross-node transport]
A Transport is the six calls below, and nothing else: ``broadcast`` of a
contiguous tensor from one rank to the group, ``send`` / ``recv`` of one
between two ranks and ``batch`` (several sends and receives started
together, NCCL's batch_isend_irecv), each returning something to ``wait()``
on; ``check_device`` (which tensors it moves) and ``through_host`` (whether a
CUDA tensor is staged in host memory, so callers bound their staging);
``rank`` and ``control_device`` (where small control tensors live). The
small messages (int64 headers, JSON layouts) are built on those calls by the
functions of this module, the same for every transport, and every count a
peer sends is bounded before anything is allocated from it. The default,
:class:`DistTransport`, is torch.distributed over a process group (NCCL for
CUDA tensors, gloo for CPU ones, or CUDA tensors over gloo). Another engine
(NIXL, Mooncake's transfer engine, UCX) implements the same calls: it would
register the long-lived buffers once (a relay's snapshot, a KV pool's
chunks, a trainer's shards) and turn ``send`` / ``recv`` into one-sided
writes or reads of those ranges; tests/transport_helpers.py has one over
queues between threads, on which the weights and KV protocols run unchanged.
Control (versions, ids, layouts) travels as JSON, never pickle: a process
group is not authenticated.

Note [waiting for a control message]
A control message (a version header, a layout) may not come for a long time:
a relay waits for the trainer's next version. Its receive is polled
(``is_completed``, sleeping up to 1 ms; CUDA tensors, i.e. NCCL) and waited for only once it
completed. With NCCL, ``wait()`` makes the current stream wait for the
collective and a copy to the host then blocks in the driver until the peer
sends: the current stream of a relay stayed blocked between versions, so
everything queued on it meanwhile (the export event of a subscriber that
attaches, which that subscriber's copies wait for) waited for the next
version too: a subscriber that attached between versions found its first
synchronous CUDA call (a pageable copy) waiting for a version that its
trainer would publish only after it attached. Polling also lets Ctrl-C
interrupt the wait. The receive is still a posted collective: the process
group's timeout (NCCL's watchdog aborts the process at it) must be longer
than the longest gap between two versions.

Note [a bounded wait]
A peer that died leaves a transfer to it unfinished: NCCL's kernel spins
until the watchdog aborts the process, gloo's send waits once the socket's
buffer is full. Where a caller bounds a transfer (a sharded send to the
engine ranks, the buckets of a version an engine has started to receive),
``finish(..., deadline)`` polls a polled work until the deadline and gives
any other work ``wait(timeout)`` (torch.distributed's works take one; gloo
raises past it), then raises TimeoutError. The group is unusable afterwards
(a transfer is still posted on it): the caller says so and is not used again.
"""

# Note [counts from a peer]
# A process group is not authenticated, and a few hundred bytes of layout or
# header can announce 2**32 buckets or 2**39 pieces. Every count from a peer
# is checked against what this receiver can hold before a list, a buffer or
# a transfer is made of it: a JSON message's length (MAX_MESSAGE_BYTES), a
# weights layout's entries and buckets (weights/_broadcast.py: MAX_ENTRIES,
# MAX_BUCKETS, and the snapshot against the device's memory), a KV header's
# pieces (kv/remote.py: kept as (length, repeat) pairs; listed one by one
# only once their blocks are allocated here, drained one at a time
# otherwise), a sharded layout's boxes (weights/_shard_layout.py).

import datetime
import json
import threading
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

__all__ = ["Transport", "Work", "DistTransport", "transport_for", "MAX_MESSAGE_BYTES", "dtype_from_name",
           "broadcast_ints", "broadcast_json", "post_json", "send_json", "recv_json", "finish"]

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


class Work(Protocol):
    """A transfer started by a Transport."""

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> Any:
        """Return once the transfer is done (CUDA: ordered on the current
        stream); with ``timeout``, raise past it (Note [a bounded wait])."""


# ("send", tensor, dst) or ("recv", tensor, src): one transfer of Transport.batch
P2P = Tuple[str, torch.Tensor, int]


class Transport(Protocol):
    """What the cross-node protocols call (Note [cross-node transport]).
    Ranks are the implementation's own (torch.distributed: global ranks)."""

    rank: int
    control_device: torch.device  # where small control tensors (headers, JSON) live

    def check_device(self, tensor: torch.Tensor) -> None:
        """Raise ValueError if this transport cannot move `tensor`'s device."""

    def through_host(self, tensor: torch.Tensor) -> bool:
        """Whether moving `tensor` stages it in host memory (callers bound how many are in flight)."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        """Start a broadcast of `tensor` from rank `src` to every rank of the group."""

    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        """Start sending `tensor` to rank `dst`; the caller may reuse it after ``wait()``."""

    def recv(self, tensor: torch.Tensor, src: int) -> Work:
        """Start receiving into `tensor` from rank `src`."""

    def batch(self, ops: Sequence[P2P]) -> List[Work]:
        """Start several sends and receives at once (one Work each, in order)."""


def transport_for(transport: Optional[Transport], group: Any) -> Transport:
    """`transport`, or torch.distributed over `group` when it is None."""
    if transport is None:
        return DistTransport(group)
    if group is not None:
        raise ValueError("torch_ipc: pass a group or a transport, not both")
    return transport


def finish(work: Any, tensor: torch.Tensor, deadline: Optional[float] = None, poll: Optional[bool] = None,
           max_sleep: float = 1e-3, spin: float = 0.0) -> None:
    """Wait for a control transfer of `tensor` without blocking the current
    stream meanwhile (Note [waiting for a control message]). Only a CUDA
    tensor's is polled (``poll`` decides otherwise: a CUDA tensor staged
    through gloo is not): gloo's point-to-point works report completion only
    from inside wait(). ``deadline`` (time.monotonic()): TimeoutError past it
    (Note [a bounded wait]). ``max_sleep``: the longest sleep between two
    polls (how late the return may be). ``spin``: seconds of polling without
    sleeping first, for a message expected at once (a sleep of 10 us lasts
    ~60 us: the kernel's timer slack)."""
    is_completed = getattr(work, "is_completed", None)
    if poll is None:
        poll = tensor.device.type == "cuda"
    if is_completed is not None and poll:
        delay, spin_until = 0.0, time.monotonic() + spin
        while not is_completed():
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError("the transfer did not complete in time")
            if now < spin_until:
                time.sleep(0)  # lets other threads run; Ctrl-C raises in this loop
                continue
            if delay:
                time.sleep(delay)  # the GIL is free; Ctrl-C raises here
            delay = min(max(2 * delay, 1e-5), max_sleep)
        work.wait()
    elif deadline is None:
        work.wait()
    else:
        _wait_for(work, deadline)


# Note [an interruptible wait]
# A gloo work's wait() blocks in C++ with the GIL released, and Python runs a
# signal's handler only once the main thread is back in the interpreter: a
# Ctrl-C during a wait for a stuck peer raised at the wait's timeout (a minute
# by default) or, without one, never. So DistTransport's works on CPU tensors
# (gloo's sends, receives and broadcasts) wait in a helper thread when waited
# for in the main thread, which meanwhile waits on a lock that a signal
# interrupts (a thread start, ~50 us, beside gloo's milliseconds; other
# threads get no signals and wait themselves). After a KeyboardInterrupt the
# helper stays in wait(), holding the work, until the transfer ends or fails
# (at the latest the group's timeout): the transfer is still posted, so the
# caller treats the group as out of step, as after a timeout
# (Note [a bounded wait]). The error a wait raised is passed to the waiting
# thread without a reference cycle: a cycle through a frame kept the work,
# and through it the group, alive after destroy_process_group(), so a failed
# trainer's peers learned of it only at the group's timeout (30 s in the
# killed-relay test).
# Works on CUDA tensors stay in the caller's thread: their wait() orders the
# caller's current stream, which is the thread's own. NCCL's need nothing
# (finish() sleeps between polls). CUDA tensors over gloo (a relay's bucket, a
# staged piece: Note [CUDA tensors over gloo]) still wait in C++, bounded by
# the group's timeout (a staged piece's host work could wait in the helper
# too, its copy staying here).
def host_wait(work: Any, timeout: Optional[datetime.timedelta] = None) -> Any:
    """``work.wait()`` (``wait(timeout=timeout)``), which Ctrl-C interrupts
    in the main thread (Note [an interruptible wait]); returns what it returns."""
    def wait() -> Any:
        return work.wait() if timeout is None else work.wait(timeout=timeout)

    if threading.current_thread() is not threading.main_thread():
        return wait()
    done, outcome = threading.Event(), []

    def run() -> None:
        try:
            outcome.append((True, wait()))
        except BaseException as e:  # noqa: BLE001  (raised again in the waiting thread)
            outcome.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name="torch_ipc-wait", daemon=True).start()
    done.wait()  # a signal's handler runs here, and KeyboardInterrupt leaves
    ok, value = outcome.pop()
    if ok:
        return value
    try:
        raise value
    finally:
        del value  # no cycle through this frame: it would keep the work, and with it the group, alive


def _wait_for(work: Any, deadline: float) -> None:
    """Note [a bounded wait]: a torch.distributed work of gloo (and the
    in-memory test transport's) takes ``wait(timeout)`` and raises past it;
    gloo then leaves the pair's buffer waiting, so the group is not used again."""
    left = max(deadline - time.monotonic(), 1e-3)
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=left))
    except RuntimeError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise TimeoutError(f"the transfer did not complete in time ({e})") from None
        raise
    if done is False:
        raise TimeoutError("the transfer did not complete in time")


# ----------------------------------------------------------------------------- small messages, on any transport

# Note [control tensors without a sync]: a header or a JSON message made on
# the host reaches a CUDA control device through pinned memory, without
# blocking: a copy from pageable memory synchronizes the current stream, so a
# trainer's version header waited on the host for its snapshot copy (~1 ms for
# 1.5 GB) before it could even be posted, and the engines heard of the
# version that much later. The caching host allocator keeps the pinned block
# until the copy is done.
def to_control(host: torch.Tensor, transport: Transport) -> torch.Tensor:
    """A small host tensor on the transport's control device, without a sync."""
    device = transport.control_device
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _int64s(transport: Transport, values: List[int]) -> torch.Tensor:
    return to_control(torch.tensor(values, dtype=torch.int64), transport)


def broadcast_ints(transport: Transport, values: Optional[List[int]], n: int, src: int) -> List[int]:
    """``n`` int64s from ``src`` (which passes them) to every rank of the group."""
    t = _int64s(transport, values if transport.rank == src else [0] * n)
    finish(transport.broadcast(t, src), t)
    return list(values) if transport.rank == src else t.tolist()  # the sender does not wait for the GPU


def _json_bytes(obj: Any) -> bytearray:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"torch_ipc: a control message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    return bytearray(data)


def _encode(transport: Transport, obj: Any) -> torch.Tensor:
    return to_control(torch.frombuffer(_json_bytes(obj), dtype=torch.uint8), transport)


def _checked_length(n: int) -> int:
    if not 0 <= n <= MAX_MESSAGE_BYTES:
        raise ValueError(f"torch_ipc: a peer announced a control message of {n} bytes "
                         f"(at most {MAX_MESSAGE_BYTES})")
    return n


def _buffer(transport: Transport, n: int) -> torch.Tensor:
    return torch.empty(_checked_length(n), dtype=torch.uint8, device=transport.control_device)


def _decode(t: torch.Tensor) -> Any:
    try:
        return json.loads(bytes(t.cpu().numpy().tobytes()).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"torch_ipc: a peer sent a control message that is not JSON: {e}") from None


def broadcast_json(transport: Transport, obj: Any, src: int) -> Any:
    """``obj`` (JSON-serialisable) from ``src`` to every rank; others pass None."""
    data = _encode(transport, obj) if transport.rank == src else None
    (n,) = broadcast_ints(transport, [data.numel()] if data is not None else None, 1, src)
    if data is None:
        data = _buffer(transport, n)
    finish(transport.broadcast(data, src), data)
    return obj if transport.rank == src else _decode(data)


# One message of FIRST_BYTES carries the length and the start of a JSON
# message (all of a small one: one round trip, not two); the rest follows.
FIRST_BYTES = 4096


def post_json(transport: Transport, obj: Any, dst: int) -> List[Tuple[Any, torch.Tensor]]:
    """Start sending ``obj`` to ``dst``: (work, tensor) of each message, for
    :func:`finish` once the caller has posted what follows it (the pair's
    transfers are ordered). Built on the host, one copy to the device."""
    data = _json_bytes(obj)
    n, room = len(data), FIRST_BYTES - 8
    head = torch.zeros(FIRST_BYTES, dtype=torch.uint8)
    head[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
    head[8 : 8 + min(n, room)] = torch.frombuffer(data, dtype=torch.uint8)[:room]
    messages = [to_control(head, transport)]
    if n > room:
        messages.append(to_control(torch.frombuffer(data, dtype=torch.uint8)[room:], transport))
    return [(transport.send(t, dst), t) for t in messages]


def send_json(transport: Transport, obj: Any, dst: int) -> None:
    for work, tensor in post_json(transport, obj, dst):
        finish(work, tensor)


def recv_json(transport: Transport, src: int, spin: float = 0.0) -> Any:
    """A message of :func:`send_json` / :func:`post_json` from ``src``; one
    copy to the host when it fits the first message. ``spin``: as in finish()."""
    first = torch.empty(FIRST_BYTES, dtype=torch.uint8, device=transport.control_device)
    finish(transport.recv(first, src), first, spin=spin)
    first = first.cpu()
    (n,) = first[:8].view(torch.int64).tolist()
    room = FIRST_BYTES - 8
    if _checked_length(n) <= room:
        return _decode(first[8 : 8 + n])
    rest = _buffer(transport, n - room)
    transport.recv(rest, src).wait()
    return _decode(torch.cat([first[8:], rest.cpu()]))


# ----------------------------------------------------------------------------- torch.distributed

def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch_ipc: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group() first")
    return dist


class DistTransport:
    """The default :class:`Transport`: torch.distributed over ``group``
    (None: the default group). Ranks are global ranks, as in
    torch.distributed's own calls."""

    def __init__(self, group: Optional[Any] = None):
        self._dist = _dist()
        self.group = group
        self.rank = self._dist.get_rank()
        backend = str(self._dist.get_backend(group))
        # Small tensors (lengths, headers) on the CPU unless the group only has NCCL.
        self.nccl_only = "nccl" in backend and "gloo" not in backend
        self.backend = backend
        self.control_device = torch.device("cuda", torch.cuda.current_device()) if self.nccl_only \
            else torch.device("cpu")

    def check_device(self, tensor: torch.Tensor) -> None:
        if self.nccl_only and tensor.device.type != "cuda":
            raise ValueError(f"torch_ipc: a {self.backend} group moves CUDA tensors only, not {tensor.device} ones; "
                             "use a gloo group for CPU tensors")

    def broadcast(self, tensor: torch.Tensor, src: int):
        return self._on_host(self._dist.broadcast(tensor, src=src, group=self.group, async_op=True), tensor)

    def send(self, tensor: torch.Tensor, dst: int):
        if self.through_host(tensor):
            host = _pinned_like(tensor)
            host.copy_(tensor)  # after the work queued on the current stream; the host waits for it
            return _Staged(self._dist.isend(host, dst=dst, group=self.group), host)
        return self._on_host(self._dist.isend(tensor, dst=dst, group=self.group), tensor)

    def recv(self, tensor: torch.Tensor, src: int):
        if self.through_host(tensor):
            host = _pinned_like(tensor)
            return _Staged(self._dist.irecv(host, src=src, group=self.group), host, tensor)
        return self._on_host(self._dist.irecv(tensor, src=src, group=self.group), tensor)

    @staticmethod
    def _on_host(work: Any, tensor: torch.Tensor) -> Any:
        """A work on host memory waits where Ctrl-C reaches (Note [an interruptible wait])."""
        return _HostWork(work) if tensor.device.type == "cpu" else work

    def batch(self, ops: Sequence[P2P]) -> List[Any]:
        """NCCL: one ``batch_isend_irecv`` (the transfers of one group call
        go together, no ordering deadlock between pairs); otherwise one
        isend / irecv each (gloo moves them independently)."""
        ops = list(ops)
        for kind, _, _ in ops:
            if kind not in ("send", "recv"):
                raise ValueError(f"torch_ipc: a batch holds 'send' and 'recv' transfers, not {kind!r}")
        if "nccl" not in self.backend or not ops:
            return [self.send(t, peer) if kind == "send" else self.recv(t, peer) for kind, t, peer in ops]
        p2p = [self._dist.P2POp(self._dist.isend if kind == "send" else self._dist.irecv, t, peer, self.group)
               for kind, t, peer in ops]
        return list(self._dist.batch_isend_irecv(p2p))

    def through_host(self, tensor: torch.Tensor) -> bool:
        """Note [CUDA tensors over gloo]: gloo's point-to-point calls take host
        memory only (a CUDA tensor fails with EFAULT), its broadcast takes CUDA
        tensors and stages them itself. A staged piece is copied into page-
        locked memory from torch's caching host allocator (no allocation per
        piece once warm) with a synchronous copy, so the caller may overwrite
        its tensor as soon as send() returns, and the bytes of a piece are on
        the wire while the next piece is being copied; callers bound how many
        staged pieces are in flight (torch_ipc/kv/remote.py keeps two)."""
        return tensor.device.type == "cuda" and "nccl" not in self.backend


def _pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)


class _HostWork:
    """A gloo work on host memory whose wait() Ctrl-C interrupts (Note [an interruptible wait])."""

    def __init__(self, work: Any):
        self._work = work

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> Any:
        return host_wait(self._work, timeout)


class _Staged:
    """A send or receive through host memory (Note [CUDA tensors over gloo]):
    holds the host buffer until wait(), which also copies a received one
    into its destination."""

    def __init__(self, work: Any, host: torch.Tensor, into: Optional[torch.Tensor] = None):
        self._work, self._host, self._into = work, host, into

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        self._work.wait() if timeout is None else self._work.wait(timeout)
        if self._into is not None:
            self._into.copy_(self._host)  # synchronous: the host buffer goes back to the cache after it
            self._into = None
        self._host = None
        return True
