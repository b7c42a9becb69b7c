"""Functions the cross-node tests run in child processes standing for nodes
(a trainer, relays, subscribers, KV pools), over torch.distributed groups of
gloo on this machine."""

import datetime
import os
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from weights_helpers import HELD, bits, make_weights, scratch_folder

from torch_ipc.weights import BroadcastError, Publisher, PublisherGoneError, Relay

STATE: Dict[str, object] = {}


def group_url() -> str:
    """A fresh file:// rendezvous for one group."""
    return "file://" + os.path.join(scratch_folder("torch_ipc_dist"), "rendezvous")


def init_group(url: str, rank: int, world: int, backend: str = "gloo") -> None:
    """Join the group at `url`, leaving the one joined before (a broken one)."""
    leave_group()
    # NCCL's watchdog aborts the process at its timeout: longer than the tests'
    # PeerGroup timeout (90 s), so that a hang shows every child's stacks.
    seconds = 150 if "nccl" in backend else 30
    dist.init_process_group(backend, init_method=url, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=seconds))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _expected(weights) -> Dict[str, Dict[str, bytes]]:
    return {"float32": bits(weights), "bfloat16": bits({n: t.to(torch.bfloat16) for n, t in weights.items()})}


# ----------------------------------------------------------------------------- trainer

def trainer_start(url: str, world: int, device: str = "cpu", seed: int = 0, big: int = 3000,
                  bucket_bytes: int = 2048, backend: str = "gloo",
                  timeout: float = 60.0) -> Dict[int, Dict[str, Dict[str, bytes]]]:
    """Publish version 1 here, then join the group and broadcast it."""
    init_group(url, 0, world, backend)
    weights = make_weights(device, seed=seed, big=big)
    pub = Publisher(weights, timeout=timeout)
    STATE.update(pub=pub, weights=weights, bucket_bytes=bucket_bytes)
    pub.publish()
    pub.broadcast_to(bucket_bytes=bucket_bytes)
    return {1: _expected(weights)}


def trainer_publish(n: int, seed: int) -> Dict[int, Dict[str, Dict[str, bytes]]]:
    """`n` more versions of fresh random values; the bytes of each."""
    pub, weights = STATE["pub"], STATE["weights"]
    gen, out = torch.Generator().manual_seed(seed), {}
    for _ in range(n):
        for t in weights.values():
            t.copy_(torch.randn(t.shape, generator=gen))
        version = pub.publish()
        out[version] = _expected(weights)
    return out


def trainer_publish_into_a_broken_group(seed: int):
    """Publish while a relay is dead: (version, the error's text, the bytes)."""
    pub, weights = STATE["pub"], STATE["weights"]
    gen = torch.Generator().manual_seed(seed)
    for t in weights.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    try:
        pub.publish()
    except BroadcastError as e:
        leave_group()  # the survivors' receive fails at once
        return pub.version, str(e), {pub.version: _expected(weights)}
    raise AssertionError("publish() into a group with a dead relay did not raise BroadcastError")


def trainer_publish_failing():
    """Publish into a group whose relay stopped receiving: (seconds, version, the BroadcastError's text)."""
    pub = STATE["pub"]
    start = time.monotonic()
    try:
        pub.publish()
    except BroadcastError as e:
        return time.monotonic() - start, pub.version, str(e)
    raise AssertionError("publish() to a relay that stopped receiving did not raise BroadcastError")


def trainer_publish_interrupted(after_s: float) -> float:
    """Publish; a real SIGINT to this process `after_s` into it: seconds from the signal to the KeyboardInterrupt."""
    return interrupted(STATE["pub"].publish, after_s)


def interrupted(call, after_s: float) -> float:
    """Run `call()` in this (the main) thread with a real SIGINT to this process
    `after_s` into it: seconds from the signal to the KeyboardInterrupt."""
    import signal
    import threading

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sent = []

    def interrupt():
        time.sleep(after_s)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    try:
        call()
    except KeyboardInterrupt:
        return time.monotonic() - sent[0]
    finally:
        signal.signal(signal.SIGINT, previous)
    raise AssertionError(f"{call} returned before the SIGINT")


def join(url: str, rank: int, world: int) -> int:
    init_group(url, rank, world)
    return rank


def send_unreceived_interrupted(nbytes: int, after_s: float, timeout_s) -> float:
    """Send `nbytes` (more than the sockets hold) to rank 1, which never
    receives, and wait for it as the sharded and KV paths do (a deadline of
    `timeout_s`, or none): seconds from a SIGINT `after_s` in to the KeyboardInterrupt."""
    from torch_ipc import _dist

    tensor = torch.zeros(nbytes, dtype=torch.uint8)
    work = _dist.DistTransport().send(tensor, 1)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    return interrupted(lambda: _dist.finish(work, tensor, deadline), after_s)


def trainer_send_part(version: int, pieces: int) -> None:
    """What a trainer that dies mid-broadcast sent: the header of `version`
    and the first `pieces` buckets of its snapshot (the test then kills it)."""
    from torch_ipc.weights import _broadcast as wire

    pub = STATE["pub"]
    dist.broadcast(torch.tensor([wire.MAGIC, wire.VERSION, version, pub.layout.total_bytes]), src=0)
    for lo, hi in pub._broadcaster.ranges[:pieces]:
        dist.broadcast(pub._buffer[lo:hi], src=0)


def trainer_rejoin(url: str, world: int) -> None:
    init_group(url, 0, world)
    STATE["pub"].broadcast_to(bucket_bytes=STATE["bucket_bytes"])


def trainer_close() -> None:
    STATE.pop("pub").close()  # the relays' serve() returns
    leave_group()


# ----------------------------------------------------------------------------- relay

def relay_start(url: str, rank: int, world: int, address: str, authkey: bytes, bucketed: bool = False,
                backend: str = "gloo", stream: bool = False) -> int:
    init_group(url, rank, world, backend)
    relay = Relay(src=0, bucketed=bucketed, timeout=30.0, stream=stream)
    if os.path.exists(address):
        os.unlink(address)  # the socket file of a relay killed before
    relay.listen(address, authkey=authkey)
    STATE["relay"] = relay
    return os.getpid()


def relay_receive():
    """One version (then this relay stops receiving until told)."""
    return STATE["relay"].receive()


def relay_serve():
    """Serve until the trainer closes: the last version; or ("broken", the version kept)."""
    relay = STATE["relay"]
    try:
        return relay.serve()
    except BroadcastError:
        return ("broken", relay.version)


def relay_rejoin(url: str, rank: int, world: int) -> None:
    init_group(url, rank, world)
    STATE["relay"].rejoin(src=0)


def relay_subscribers() -> int:
    return STATE["relay"].subscribers


def relay_close() -> None:
    STATE.pop("relay").close()
    leave_group()


# ----------------------------------------------------------------------------- subscriber (after weights_helpers.sub_attach)

def sub_pull_versions(last: int, timeout: float = 60.0) -> Dict[int, Dict[str, bytes]]:
    """Pull until version `last`: the bytes of every version pulled."""
    sub, model, seen = HELD["sub"], HELD["model"], {}
    version = sub.version
    while version < last:
        version = sub.pull(model, newer_than=version, timeout=timeout)
        seen[version] = bits(model)
    return seen


def sub_pull_streams(last: int, timeout: float = 60.0):
    """sub_pull_versions, and how many pulls copied a version while it landed."""
    return sub_pull_versions(last, timeout), HELD["sub"].stats["streamed"]


def sub_pull_cut_off(newer_than: int) -> str:
    """A pull of a version cut off on its way: the BroadcastError's text."""
    try:
        HELD["sub"].pull(HELD["model"], newer_than=newer_than, timeout=60.0)
    except BroadcastError as e:
        return str(e)
    raise AssertionError("a pull of a version cut off on its way did not raise BroadcastError")


def sub_pull_gone() -> str:
    """A pull after the relay died: the error's text; the model kept."""
    try:
        HELD["sub"].pull(HELD["model"], timeout=10.0)
    except PublisherGoneError as e:
        return str(e)
    raise AssertionError("a pull from a dead relay did not raise PublisherGoneError")


def sub_pull_reattached(newer_than: int, wait: float = 30.0):
    """Pull once a restarted relay has reattached this subscriber:
    (version, bytes, times reattached)."""
    sub, model = HELD["sub"], HELD["model"]
    deadline = time.monotonic() + wait
    while True:
        try:
            version = sub.pull(model, newer_than=newer_than, timeout=wait)
            return version, bits(model), sub.stats["reattached"]
        except PublisherGoneError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


# ----------------------------------------------------------------------------- KV pools

def kv_start(url: str, rank: int, world: int, num_blocks: int, block_shape, dtype, device: str = "cpu",
             backend: str = "gloo") -> int:
    from torch_ipc.kv import SharedKVPool

    init_group(url, rank, world, backend)
    STATE["pool"] = SharedKVPool(num_blocks, block_shape, dtype, device)
    return os.getpid()


def kv_write(ids_wanted: int, seed: int):
    """Allocate and fill `ids_wanted` blocks: (ids, their bytes)."""
    pool = STATE["pool"]
    ids = pool.allocate(ids_wanted)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn((len(ids), *pool.block_shape), generator=gen).to(pool.dtype).to(pool.device)
    pool.scatter(ids, data)
    return ids, data.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def kv_send(ids: List[int], dst: int, meta=None, transfer: bool = True, staging_bytes: int = 1 << 20) -> dict:
    from torch_ipc.kv.remote import send_blocks

    pool = STATE["pool"]
    send_blocks(pool, ids, dst, meta=meta, transfer=transfer, staging_bytes=staging_bytes)
    if pool.device.type == "cuda":
        torch.cuda.synchronize()
        pool.reclaim()  # finishes the deferred frees
    return {"held": pool.held(), "holders": {i: pool.holder_of(i) for i in ids}, "free": pool.free_blocks}


def kv_recv(src: int) -> dict:
    from torch_ipc.kv.remote import recv_blocks

    pool = STATE["pool"]
    try:
        handover = recv_blocks(pool, src)
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "held": pool.held(), "free": pool.free_blocks}
    data = pool.gather(handover.ids)
    return {"ids": handover.ids, "meta": handover.meta, "src": handover.src, "pid": os.getpid(),
            "bytes": data.cpu().contiguous().view(torch.uint8).numpy().tobytes(), "held": pool.held(),
            "holders": {i: pool.holder_of(i) for i in handover.ids}}


def kv_allocate(n: int) -> List[int]:
    return STATE["pool"].allocate(n)


def kv_free(ids: List[int], settle: bool = False) -> None:
    """Free `ids`; `settle`: a CUDA pool's deferred frees done before returning."""
    pool = STATE["pool"]
    pool.free(ids)
    if settle and pool.device.type == "cuda":
        torch.cuda.synchronize()
        pool.reclaim()  # finishes the deferred frees


def kv_close() -> None:
    STATE.pop("pool").close()
    leave_group()


# ----------------------------------------------------------------------------- hostile peers (raw torch.distributed)

def _limit_memory(extra_bytes: int = 1 << 30) -> None:
    """Cap this process's address space at what it maps now plus `extra_bytes`:
    a receiver that expands a peer's counts fails with MemoryError, fast."""
    import resource

    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, resource.RLIM_INFINITY))


def _raw_json_bytes(obj) -> torch.Tensor:
    import json

    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def hostile_layout(url: str, message) -> None:
    """Rank 0: broadcast `message` as a weights layout (length, then the JSON), as a Publisher would."""
    init_group(url, 0, 2)
    data = _raw_json_bytes(message)
    dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=0)
    dist.broadcast(data, src=0)


def hostile_kv_header(url: str, header, pieces: int, piece_bytes: int) -> None:
    """Rank 0: send `header` as a KV blocks header, then `pieces` pieces, then leave."""
    init_group(url, 0, 2)
    data = _raw_json_bytes(header)
    first = torch.zeros(4096, dtype=torch.uint8)
    first[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
    first[8 : 8 + data.numel()] = data
    dist.send(first, 1)
    for _ in range(pieces):
        dist.send(torch.zeros(piece_bytes, dtype=torch.uint8), 1)
    leave_group()  # the receiver's next receive fails


def victim_relay(url: str):
    """Rank 1 under a memory cap: construct a Relay; (error type, message)."""
    init_group(url, 1, 2)
    _limit_memory()
    try:
        Relay(src=0)
    except BaseException as e:  # noqa: B902 - MemoryError is the defect this reports
        return type(e).__name__, str(e)[:300]
    return None, ""


def victim_kv(url: str, shape, dtype):
    """Rank 1 under a memory cap: recv_blocks into a pool of 4 blocks; (error type, message, held)."""
    from torch_ipc.kv import SharedKVPool
    from torch_ipc.kv.remote import recv_blocks

    init_group(url, 1, 2)
    pool = SharedKVPool(4, shape, dtype)
    _limit_memory()
    try:
        recv_blocks(pool, 0)
    except BaseException as e:  # noqa: B902 - MemoryError is the defect this reports
        return type(e).__name__, str(e)[:300], pool.held()
    finally:
        _limit_memory(1 << 40)
    return None, "", pool.held()
