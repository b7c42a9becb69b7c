"""VMM sharing (csrc/memory/vmm.*, torch_ipc/pool.py): torch's expandable segments,
SharedPool and isolated dumps, memory that outlives a killed producer, leaks."""
import os
import signal
import struct
import time

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc import _C
from torch_ipc.testing import Peer, PeerError, cuda_device_count

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
KIND_VMM = 2
MiB = 1 << 20

# ----------------------------------------------------------------------------- child functions
# (module level: the child imports this module to find them; no CUDA at import)

_STATE = {}


def _produce(numel, seed, how="plain", isolated=False):
    """Make a random float tensor (plain torch allocation or SharedPool), keep
    it, export it. -> (descriptor, CPU copy of the values)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if how == "pool":
        pool = _STATE.setdefault("pool", torch_ipc.SharedPool())
        x = pool.empty((numel,), torch.float32)
        x.normal_(generator=gen)
    else:
        x = torch.randn(numel, device="cuda", generator=gen)
    _STATE["x"] = x
    data = torch_ipc.dumps(x, isolated=isolated)
    torch.cuda.synchronize()
    return data, x.cpu()


def _produce_dict(count, numel, how="plain"):
    """A dict of `count` float tensors of `numel` elements (tensor i holds i),
    kept, exported in one message. -> descriptor."""
    pool = _STATE.setdefault("pool", torch_ipc.SharedPool()) if how == "pool" else None
    d = {}
    for i in range(count):
        d[f"w{i}"] = pool.empty((numel,), torch.float32) if pool else torch.empty(numel, device="cuda")
        d[f"w{i}"].fill_(float(i))
    _STATE["dict"] = d
    torch.cuda.synchronize()
    return torch_ipc.dumps(d)


def _dump_one_of_dict(name):
    return torch_ipc.dumps(_STATE["dict"][name])


def _load_dict(data):
    """Load and keep a dict; -> ({name: (first, last) value}, stats)."""
    d = torch_ipc.loads(data)
    torch.cuda.synchronize()
    _STATE["ydict"] = d
    return {k: (v[0].item(), v[-1].item()) for k, v in d.items()}, dict(_C.stats())


def _mapping_sizes_of_dict():
    return [_C._testing.vmm_mapping_view(v).numel() for v in _STATE["ydict"].values()]


def _producer_neighbour(value):
    """Fill a tensor that torch's allocator likely puts next to the last one."""
    _STATE["neighbour"] = torch.full((1000,), value, device="cuda")
    torch.cuda.synchronize()


def _producer_values():
    torch.cuda.synchronize()
    return _STATE["x"].cpu()


def _producer_mul(k):
    _STATE["x"].mul_(k)
    torch.cuda.synchronize()


def _load(data):
    y = torch_ipc.loads(data)
    torch.cuda.synchronize()
    _STATE["y"] = y
    return y.cpu(), dict(_C.stats())


def _consumer_values():
    torch.cuda.synchronize()
    return _STATE["y"].cpu()


def _consumer_add(k):
    _STATE["y"].add_(k)
    torch.cuda.synchronize()


def _consumer_drop():
    _STATE.pop("y", None)
    torch_ipc.collect(close_idle=True)


def _forward():
    return torch_ipc.dumps(_STATE["y"])


def _mapping_of_y(value):
    """The whole driver mapping behind y: its size, y's offset in it, whether
    the bytes past y are zero, whether `value` occurs anywhere in it."""
    y = _STATE["y"]
    view = _C._testing.vmm_mapping_view(y)
    torch.cuda.synchronize()
    tail = view[y.untyped_storage().nbytes() + (y.data_ptr() - view.data_ptr()):]
    floats = view[: view.numel() // 4 * 4].view(torch.float32)
    return (
        view.numel(),
        y.data_ptr() - view.data_ptr(),
        bool((tail == 0).all()),
        bool((floats == value).any()),
    )


def _granularity():
    return torch_ipc.SharedPool().granularity()


def _settle():
    """Finish deferred releases, reclaim exports, drop dead VMM exports (a
    second collect sweeps what the first reclaimed), give cached blocks back."""
    for _ in range(3):
        torch.cuda.synchronize()
        torch_ipc.collect(close_idle=True)
        time.sleep(0.1)
    torch.cuda.empty_cache()


def _resources(peer: int):
    """fds (leaving out the sweep's pidfds of processes other than `peer`:
    other programs' processes come and go), mappings, free GPU memory, stats."""
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    free, _ = torch.cuda.mem_get_info()
    return u.open_fds(peer), maps, free, dict(_C.stats()), dict(torch_ipc.stats())


def _cycle_produce(i):
    # Alternate a small-pool tensor (2 MiB chunks) and a large-pool one (20 MiB chunks).
    numel = 4096 if i % 2 else 6 * MiB
    x = torch.full((numel,), float(i), device="cuda")
    return torch_ipc.dumps(x)  # x dies here; the export keeps its storage


def _cycle_consume(data, i):
    y = torch_ipc.loads(data)
    ok = bool(y[0].item() == i and y[-1].item() == i)
    del y
    return ok


def _same_process_pool():
    pool = torch_ipc.SharedPool()
    before = _C.stats()["vmm_pool_allocations"]
    x = pool.empty((3, 5), torch.float16)
    assert x.shape == (3, 5) and x.dtype == torch.float16 and x.is_cuda and x.is_contiguous()
    assert torch_ipc.pool.is_pool_tensor(x) and not torch_ipc.pool.is_pool_tensor(torch.ones(2, device="cuda"))
    x.fill_(2.5)
    y = torch_ipc.loads(torch_ipc.dumps(x))
    assert y.data_ptr() == x.data_ptr() and bool((y == 2.5).all())
    assert _C.stats()["vmm_pool_allocations"] == before + 1
    del x, y
    torch_ipc.collect()
    time.sleep(0.2)
    torch_ipc.collect()
    return _C.stats()["vmm_pool_allocations"] == before


def _checksum(data):
    """The descriptor checksum (Note [descriptor checksum] in descriptor.cpp)."""
    mask = (1 << 64) - 1
    h = 0x9E3779B97F4A7C15 ^ len(data)
    i = 0
    while i + 8 <= len(data):
        w = 0 if i == 72 else int.from_bytes(data[i : i + 8], "little")
        h = ((h ^ w) * 0xFF51AFD7ED558CCD) & mask
        h ^= h >> 32
        i += 8
    for b in data[i:]:
        h = ((h ^ b) * 0xC4CEB9FE1A85EC53) & mask
    return h ^ (h >> 29)


def _reseal(data):
    """Forged bytes with a valid checksum, so that the check under test is reached."""
    out = bytearray(data)
    out[72:80] = struct.pack("<Q", _checksum(out))
    return bytes(out)


def _find_vmm_alloc(data, size):
    """Offset of the AllocRecord of kind VMM and this size (see descriptor.cpp)."""
    want = struct.pack("<Q", size)
    for i in range(80, len(data) - 80):
        if data[i] == KIND_VMM and data[i + 8 : i + 16] == want and data[i + 16] == 1:
            return i
    raise AssertionError("no VMM alloc record found")


def _publish_memfd(nbytes):
    fd = os.memfd_create("not-cuda", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    _STATE.setdefault("fds", []).append(fd)
    return _C._testing.fd_publish([fd], [nbytes])


# ----------------------------------------------------------------------------- CPU tests


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the error without CUDA")
def test_pool_without_cuda_is_a_clear_error():
    pool = torch_ipc.SharedPool()
    with pytest.raises(torch_ipc.CudaUnavailableError, match="SharedPool needs CUDA"):
        pool.empty((4,), torch.float32)


def test_pool_arguments():
    with pytest.raises(ValueError, match="handle_type"):
        torch_ipc.SharedPool(handle_type="carrier-pigeon")
    pool = torch_ipc.SharedPool(handle_type="fabric")
    assert "fabric" in repr(pool)
    with pool:
        pass
    pool.close()  # idempotent
    assert pool.closed
    with pytest.raises(RuntimeError, match="closed"):
        pool.empty((1,))


def test_isolated_leaves_cpu_tensors_alone():
    x = torch.arange(6.0)
    assert torch_ipc.pool.isolate_tensors([x])[0] is x
    y = torch_ipc.loads(torch_ipc.dumps({"x": x}, isolated=True))["x"]
    assert torch.equal(y, x)


def test_reseal_matches_the_descriptor_checksum():
    # The forging tests below rely on it; a change of the checksum breaks them here first.
    for obj in (torch.arange(3.0), {"a": torch.ones(2, 2), "b": torch.zeros(5, dtype=torch.int8)}, [torch.ones(1)] * 3):
        data = torch_ipc.dumps(obj)
        assert _reseal(data) == data
        n_devices, n_events, n_leases = struct.unpack_from("<HHH", data, 12)
        first_alloc_handle = 80 + 16 * n_devices + 72 * n_events + 40 * n_leases + 16
        flipped = bytearray(data)
        flipped[first_alloc_handle + 1] ^= 1  # a byte decode() leaves to the importer
        with pytest.raises(torch_ipc.DescriptorError, match="checksum"):
            _C.describe(bytes(flipped))
        _C.describe(_reseal(bytes(flipped)))


# ----------------------------------------------------------------------------- GPU tests


@pytest.fixture
def producer():
    with Peer(timeout=120, env=EXPANDABLE) as p:
        yield p


@pytest.fixture
def consumer():
    with Peer(timeout=120) as p:
        yield p


@pytest.mark.cuda
@pytest.mark.parametrize("numel", [1000, 64 * MiB], ids=["one-chunk", "many-chunks"])
def test_expandable_segments_share_and_write_both_ways(producer, consumer, numel):
    data, expected = producer.call(_produce, numel, 1)
    (alloc,) = _C.describe(data)["allocs"]
    assert alloc["kind"] == KIND_VMM  # chosen automatically: no legacy IPC on this memory
    assert alloc["size"] % (2 * MiB) == 0 and alloc["size"] >= numel * 4
    if numel > 1000:
        assert alloc["size"] > 20 * MiB  # spans several chunks of the segment
    got, stats = consumer.call(_load, data)
    assert torch.equal(got, expected)
    assert stats["vmm_mappings"] == 1 and stats["vmm_mapped_bytes"] == alloc["size"]
    consumer.call(_consumer_add, 1.0)
    assert torch.equal(producer.call(_producer_values), expected + 1)
    producer.call(_producer_mul, 2.0)
    assert torch.equal(consumer.call(_consumer_values), (expected + 1) * 2)


@pytest.mark.cuda
def test_state_dict_in_expandable_segments_is_one_run(producer, consumer):
    # 24 x 4 MiB: torch puts them back to back in ~5 chunks of 20 MiB; one run
    # of chunks (Note [VMM runs per message]), so one fetch and one mapping.
    data = producer.call(_produce_dict, 24, MiB)
    allocs = _C.describe(data)["allocs"]
    assert all(a["kind"] == KIND_VMM for a in allocs)
    assert len(allocs) <= 2, allocs  # one per tensor (24) without runs; 2 if torch split the segment
    assert sum(a["size"] for a in allocs) >= 24 * 4 * MiB
    got, stats = consumer.call(_load_dict, data)
    assert got == {f"w{i}": (float(i), float(i)) for i in range(24)}
    assert stats["vmm_mappings"] == len(allocs)
    assert stats["fd_via_socket"] + stats["fd_via_pidfd"] == len(allocs)
    # One tensor of the dict sent alone names the same run: the consumer,
    # which still holds the dict, maps nothing new.
    one = producer.call(_dump_one_of_dict, "w17")
    assert _C.describe(one)["allocs"][0]["handle"] in [a["handle"] for a in allocs]
    got, stats = consumer.call(_load, one)
    assert bool((got == 17.0).all())
    assert stats["vmm_mappings"] == len(allocs)


@pytest.mark.cuda
def test_pool_tensors_in_one_message_stay_isolated(producer, consumer):
    granularity = producer.call(_granularity)
    data = producer.call(_produce_dict, 4, 1000, "pool")
    allocs = _C.describe(data)["allocs"]
    assert len(allocs) == 4 and all(a["size"] == granularity for a in allocs), allocs
    got, _ = consumer.call(_load_dict, data)
    assert got == {f"w{i}": (float(i), float(i)) for i in range(4)}
    assert consumer.call(_mapping_sizes_of_dict) == [granularity] * 4


@pytest.mark.cuda
def test_forced_scm_rights_path(producer):
    data, expected = producer.call(_produce, 5000, 2)
    with Peer(timeout=120, env={"TORCH_IPC_FD_TRANSPORT": "socket"}) as c:
        got, stats = c.call(_load, data)
    assert torch.equal(got, expected)
    assert stats["fd_via_socket"] == 1 and stats["fd_via_pidfd"] == 0


@pytest.mark.cuda
def test_auto_transport_reports_what_it_used(producer, consumer):
    data, expected = producer.call(_produce, 5000, 3)
    got, stats = consumer.call(_load, data)
    assert torch.equal(got, expected)
    assert stats["fd_via_socket"] + stats["fd_via_pidfd"] == 1


@pytest.mark.cuda
def test_forwarded_vmm_tensor(producer, consumer):
    data, expected = producer.call(_produce, 3000, 4)
    consumer.call(_load, data)
    forwarded = consumer.call(_forward)
    with Peer(timeout=120) as third:
        got, _ = third.call(_load, forwarded)
    assert torch.equal(got, expected)


@pytest.mark.cuda
def test_pool_tensor_is_shared_isolated(producer, consumer):
    granularity = producer.call(_granularity)
    data, expected = producer.call(_produce, 1000, 5, "pool")
    producer.call(_producer_neighbour, 7.0)
    (alloc,) = _C.describe(data)["allocs"]
    assert alloc["kind"] == KIND_VMM and alloc["size"] == granularity
    got, stats = consumer.call(_load, data)
    assert torch.equal(got, expected)
    size, offset, tail_zero, has_neighbour = consumer.call(_mapping_of_y, 7.0)
    assert (size, offset) == (granularity, 0)  # exactly the tensor's own allocation
    assert tail_zero and not has_neighbour


@pytest.mark.cuda
def test_isolated_dumps_copies_an_ordinary_tensor(consumer):
    with Peer(timeout=120) as producer:  # default allocator: legacy IPC memory
        granularity = producer.call(_granularity)
        producer.call(_producer_neighbour, 7.0)
        data, expected = producer.call(_produce, 1000, 6, "plain", True)
        producer.call(_producer_neighbour, 7.0)
        (alloc,) = _C.describe(data)["allocs"]
        assert alloc["kind"] == KIND_VMM and alloc["size"] == granularity
        got, _ = consumer.call(_load, data)
        assert torch.equal(got, expected)
        size, offset, tail_zero, has_neighbour = consumer.call(_mapping_of_y, 7.0)
        assert (size, offset) == (granularity, 0) and tail_zero and not has_neighbour
        producer.call(_producer_mul, 3.0)  # the original; the consumer has a copy
        assert torch.equal(consumer.call(_consumer_values), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["plain", "pool"], ids=["expandable", "pool"])
def test_memory_outlives_sigkilled_producer(consumer, how):
    producer = Peer(timeout=120, env=EXPANDABLE)
    try:
        data, expected = producer.call(_produce, 3 * MiB, 7, how)
        got, _ = consumer.call(_load, data)
        assert torch.equal(got, expected)
        producer.kill(signal.SIGKILL)
    finally:
        producer.close()
    assert producer.exitcode == -signal.SIGKILL
    time.sleep(0.5)  # let the consumer's collector see the death
    assert torch.equal(consumer.call(_consumer_values), expected)
    consumer.call(_consumer_add, 1.0)
    assert torch.equal(consumer.call(_consumer_values), expected + 1)
    consumer.call(_consumer_drop)  # unmapping after the producer died is clean
    with pytest.raises(PeerError) as err:  # a new load is refused: the producer is gone
        consumer.call(_load, data)
    assert err.value.exc_type.endswith("ProducerGoneError")


@pytest.mark.cuda
@pytest.mark.serial  # free GPU memory is the device's: another test's allocations would move it
def test_share_release_cycles_do_not_leak(producer, consumer):
    for i in range(20):  # warm up: contexts, caches, collector threads
        assert consumer.call(_cycle_consume, producer.call(_cycle_produce, i), i)
    def measure():
        consumer.call(_settle)  # releases first, then the producer can reclaim
        producer.call(_settle)
        return producer.call(_resources, consumer.pid), consumer.call(_resources, producer.pid)

    p0, c0 = measure()
    for i in range(20, 1020):
        assert consumer.call(_cycle_consume, producer.call(_cycle_produce, i), i)
    p1, c1 = measure()
    for before, after, who in ((p0, p1, "producer"), (c0, c1, "consumer")):
        fds0, maps0, free0, _, _ = before
        fds1, maps1, free1, vmm, stats = after
        assert fds1 <= fds0, f"{who}: fds {fds0} -> {fds1}"
        assert maps1 <= maps0 + 8, f"{who}: mappings {maps0} -> {maps1}"
        assert free1 >= free0 - 64 * MiB, f"{who}: free GPU memory {free0} -> {free1}"
        assert vmm["vmm_mappings"] == 0, f"{who}: {vmm}"
    assert p1[3]["vmm_export_groups"] == 0 and p1[3]["vmm_exported_chunks"] == 0, p1[3]
    assert p1[4]["exports"] == 0, p1[4]


@pytest.mark.cuda
def test_pool_in_one_process():
    from torch_ipc.testing import run_in_subprocess

    assert run_in_subprocess(_same_process_pool, timeout=120)


@pytest.mark.cuda
def test_wrong_size_is_a_clear_error(producer, consumer):
    granularity = producer.call(_granularity)
    data, _ = producer.call(_produce, 1000, 8, "pool")
    at = _find_vmm_alloc(data, granularity)
    forged = _reseal(data[: at + 8] + struct.pack("<Q", 2 * granularity) + data[at + 16 :])
    kind, text = consumer.call(u.try_load, forged)
    assert kind == "DescriptorError" and "VMM handle field" in text, text


@pytest.mark.cuda
def test_fd_that_is_not_cuda_memory_is_a_clear_error(producer, consumer):
    granularity = producer.call(_granularity)
    data, _ = producer.call(_produce, 1000, 9, "pool")
    ident = producer.call(_publish_memfd, granularity)
    at = _find_vmm_alloc(data, granularity) + 16  # the handle field
    field = bytearray(data[at : at + 64])
    field[2:4] = b"\0\0"  # no fd numbers: ask the socket
    field[28:64] = struct.pack("<9i", *[-1] * 9)  # the slots they leave unused hold -1
    field[8:16] = struct.pack("<Q", ident)
    forged = _reseal(data[:at] + bytes(field) + data[at + 64 :])
    kind, text = consumer.call(u.try_load, forged)
    assert kind == "CudaError" and "not a CUDA allocation" in text, text
