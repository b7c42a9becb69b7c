"""Export lifetime across processes: a producer keeps an export while consumers
hold it, reclaims it when they release or die, counts loads (consumers=N),
refuses loads after reclaim, and a consumer can tell a dead producer; many
share/release cycles leak nothing; an open-ended export (consumers=None) has
any number of readers and ends once the producer and every reader dropped it. On CPU tensors everywhere; on CUDA (marked
``cuda``, skipped without a GPU) also: memory returns to the caching allocator
once consumers release or die, GPUs are found by UUID, a resent tensor shows
its new values, received tensors can be forwarded, and expandable-segment
memory is shared."""
import os
import signal
import time

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc import _serialize
from torch_ipc.testing import Peer, PeerError

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CUDA_ONLY = pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda)])

STATS_KEYS = (
    "exports", "exported_bytes", "imports", "pending_releases", "mappings_open",
    "mappings_idle", "events_open", "lease_segments", "host_segments",
)  # fmt: skip
RECLAIM_S = 5.0  # how long a producer may take to notice (collector every ~50 ms)


@pytest.fixture
def producer(ipc_peers):
    """The module's producer (CPU tensors)."""
    return ipc_peers.get("producer", timeout=120)


@pytest.fixture
def consumers(ipc_peers):
    """The module's two consumers (CPU tensors)."""
    return ipc_peers.get("consumer-1", timeout=120), ipc_peers.get("consumer-2", timeout=120)


@pytest.fixture(autouse=True)
def _clean(request):
    """Each test starts with no export live in the producer and no hold in the consumers."""
    peers = []
    if "producer" in request.fixturenames:
        peers.append(request.getfixturevalue("producer"))
    if "consumers" in request.fixturenames:
        peers += list(request.getfixturevalue("consumers"))
    for p in peers[1:]:
        p.call(u.drop)
    if peers:
        peers[0].call(u.drop)
        s = peers[0].call(u.wait_for_stats, "exports", 0, RECLAIM_S)
        assert s["exports"] == 0, f"an earlier test left an export behind: {s}"
    yield


def test_stats_keys_are_ints(producer):
    s = producer.call(u.stats)
    for key in STATS_KEYS:
        assert isinstance(s[key], int), key


def test_held_export_stays_until_released(producer, consumers):
    c1, _ = consumers
    data, want, nbytes = producer.call(u.export_random, "x", (1000, 3), "float32", 1, u.new_seed())
    s = producer.call(u.collect)
    assert s["exports"] == 1 and s["exported_bytes"] == nbytes, s
    # Nobody loaded it yet: the producer waits for the one load it was promised.
    producer.call(u.drop, "x")  # the producer's own reference does not matter
    assert producer.call(u.wait_for_stats, "exports", 0, 0.5)["exports"] == 1
    assert c1.call(u.load_bits, "x", data) == want
    assert c1.call(u.stats)["imports"] == 1
    s = producer.call(u.wait_for_stats, "exports", 0, 0.5)
    assert s["exports"] == 1, f"reclaimed while a consumer holds it: {s}"
    # Released: reclaimed.
    c = c1.call(u.drop, "x")
    assert c["imports"] == 0 and c["pending_releases"] == 0, c
    s = producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)
    assert s["exports"] == 0 and s["exported_bytes"] == 0, s


@pytest.mark.parametrize("how", ["SIGKILL", "exit"])
def test_consumer_ending_while_holding_releases(producer, how):
    data, want, _ = producer.call(u.export_random, "x", (4096,), "int32", 1, u.new_seed())
    producer.call(u.drop, "x")
    consumer = Peer(timeout=120, name="doomed-consumer")
    try:
        assert consumer.call(u.load_bits, "x", data) == want
        assert producer.call(u.wait_for_stats, "exports", 0, 0.5)["exports"] == 1
        if how == "SIGKILL":
            consumer.kill(signal.SIGKILL)
            assert consumer.exitcode == -signal.SIGKILL
        else:
            assert consumer.close(check=True) == 0  # exits holding the tensor
    finally:
        consumer.close()
    s = producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)
    assert s["exports"] == 0, f"not reclaimed {RECLAIM_S} s after the consumer ended ({how}): {s}"


def test_consumers_2_needs_two_loads(producer, consumers):
    c1, c2 = consumers
    data, want, _ = producer.call(u.export_random, "x", (77,), "float64", 2, u.new_seed())
    producer.call(u.drop, "x")
    assert c1.call(u.load_bits, "x", data) == want
    c1.call(u.drop, "x")
    s = producer.call(u.wait_for_stats, "exports", 0, 0.5)
    assert s["exports"] == 1, f"reclaimed after one of two loads: {s}"
    assert c2.call(u.load_bits, "x", data) == want
    c2.call(u.drop, "x")
    assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0


def test_extra_load_while_held_succeeds(producer, consumers):
    c1, c2 = consumers
    data, want, _ = producer.call(u.export_random, "x", (64, 64), "uint8", 1, u.new_seed())
    assert c1.call(u.load_bits, "x", data) == want
    # consumers=1 is spent, but c1 still holds it: a second load shares it.
    assert c2.call(u.load_bits, "x", data) == want
    c1.call(u.drop, "x")
    assert producer.call(u.wait_for_stats, "exports", 0, 0.5)["exports"] == 1
    c2.call(u.drop, "x")
    assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0


def test_load_after_release_raises_released(producer, consumers):
    c1, c2 = consumers
    data, want, _ = producer.call(u.export_random, "x", (10,), "int64", 1, u.new_seed())
    assert c1.call(u.load_bits, "x", data) == want
    c1.call(u.drop, "x")
    assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0
    for consumer in (c1, c2):
        with pytest.raises(PeerError) as info:
            consumer.call(u.load_bits, "again", data)
        assert isinstance(info.value.exception, torch_ipc.ReleasedError), info.value
    # ... and a new export of the same tensor is a new descriptor that loads.
    data = producer.call(_dumps_held, "x")
    assert c2.call(u.load_bits, "x", data) == want


def _dumps_held(key: str) -> bytes:
    return torch_ipc.dumps(u.HELD[key])


@pytest.mark.parametrize("how", ["SIGKILL", "exit"])
def test_descriptor_of_a_dead_producer_raises_producer_gone(consumers, how):
    c1, _ = consumers
    with Peer(timeout=120, name="short-lived-producer") as dead:
        data, _, _ = dead.call(u.export_random, "x", (16,), "float32", 1, u.new_seed())
        pid = dead.pid
        if how == "SIGKILL":
            dead.kill()
        else:
            dead.close(check=True)
    assert u.process_gone(pid)
    with pytest.raises(PeerError) as info:
        c1.call(u.load_bits, "x", data)
    assert isinstance(info.value.exception, torch_ipc.ProducerGoneError), info.value


def test_consumer_keeps_host_memory_after_the_producer_dies(consumers):
    """Host memory is mapped: it outlives a producer killed while it is held;
    releasing it afterwards is safe, and closes what the consumer opened for it."""
    c1, _ = consumers
    before = c1.call(u.collect, False)
    with Peer(timeout=120, name="killed-producer") as dead:
        data, want, _ = dead.call(u.export_random, "x", (5000,), "float32", 1, u.new_seed())
        assert c1.call(u.load_bits, "x", data) == want
        dead.kill()
    assert c1.call(u.held_fingerprint, "x")[-1] == want
    s = c1.call(u.drop, "x")
    assert s["imports"] == 0 and s["pending_releases"] == 0, s
    s = c1.call(u.collect, False)
    assert s["mappings_open"] == before["mappings_open"], f"a mapping of a dead producer stays open: {s}"
    assert s["lease_segments"] == before["lease_segments"], f"a dead producer's lease segment stays mapped: {s}"


def test_shared_memory_files_do_not_outlive_their_producer(consumers):
    """/dev/shm files are named after their producer: none may stay once it is
    gone, whether it exited (unlinked at exit) or was killed (swept by the next
    torch_ipc process)."""
    c1, _ = consumers
    with Peer(timeout=120, name="exiting-producer") as p:
        p.call(u.export_random, "x", (10,), "float32", 1, 0)  # never loaded: still live at exit
        pid = p.pid
        assert u.shm_files_of(pid), "the test expects the producer's files in /dev/shm"
        p.close(check=True)
    assert u.shm_files_of(pid) == [], "left in /dev/shm by a producer that exited"
    with Peer(timeout=120, name="killed-producer") as p:
        p.call(u.export_random, "x", (10,), "float32", 1, 0)
        pid = p.pid
        assert u.shm_files_of(pid), "the test expects the producer's files in /dev/shm"
        p.kill()  # it cannot clean up; the collector of any torch_ipc process beside this test may sweep them now
    # The next process that exports sweeps the files of dead producers.
    with Peer(timeout=120, name="sweeper") as sweeper:
        sweeper.call(u.export_random, "y", (10,), "float32", 1, 0)
    assert u.shm_files_of(pid) == [], "files of a dead producer survive the next producer's sweep"


def _deleted_shm_mappings() -> int:
    """Mappings of torch_ipc shared memory whose file is gone: memory nobody can reuse."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/torch_ipc." in line and line.rstrip().endswith("(deleted)"))


def _cpu_producer_state():
    s = u.wait_for_stats("exports", 0, RECLAIM_S)
    s["fds"] = u.open_fds()
    s["shm_files"] = len(u.shm_files_of(os.getpid()))
    return s


def _consumer_maps():
    torch_ipc.collect()
    return _deleted_shm_mappings(), torch_ipc.stats()


def _cycles_on_cpu(producer, consumers):
    c1, _ = consumers
    batches, per_batch = 6, 400
    first_p = first_c = None
    for b in range(batches):
        c = c1.call(u.load_batch, producer.call(u.share_batch, per_batch, b))
        p = producer.call(_cpu_producer_state)
        assert c["bad"] == 0, f"batch {b}: wrong values"
        assert c["imports"] == 0 and c["pending_releases"] == 0, c
        assert p["exports"] == 0, f"batch {b}: the producer did not reclaim: {p}"
        if b == 0:
            first_p, first_c = p, c
        else:
            assert c["fds"] <= first_c["fds"] + 4, f"consumer fds grow: {first_c['fds']} -> {c['fds']}"
            assert p["fds"] <= first_p["fds"] + 4, f"producer fds grow: {first_p['fds']} -> {p['fds']}"
            assert p["host_segments"] <= first_p["host_segments"], f"producer host segments grow: {p}"
            assert p["shm_files"] <= first_p["shm_files"], f"producer /dev/shm files grow: {p}"
            assert p["lease_segments"] <= first_p["lease_segments"] + 1, f"lease segments grow: {p}"
            assert c["lease_segments"] <= first_c["lease_segments"] + 1, f"lease segments grow: {c}"


@pytest.mark.parametrize("device", DEVICES)
def test_many_share_release_cycles_leak_nothing(device, producer, consumers):
    if device == "cpu":
        _cycles_on_cpu(producer, consumers)
    else:
        _cycles_on_cuda()


def test_consumer_does_not_keep_freed_host_memory_mapped(producer, consumers):
    """Host memory the producer freed (its shared memory file unlinked) can never
    be mapped again: a consumer that keeps it mapped as an idle mapping pins that
    memory for nothing."""
    c1, _ = consumers
    for b in range(3):
        c1.call(u.load_batch, producer.call(u.share_batch, 400, 100 + b))
        producer.call(u.drop)
        producer.call(_cpu_producer_state)
    deleted, s = c1.call(_consumer_maps)
    assert deleted <= 16, f"the consumer keeps {deleted} mappings of freed shared memory: {s}"


# ----------------------------------------------------------------------------- open-ended exports (consumers=None)


def _load_write_check(key, data, index):
    y = torch_ipc.loads(data)
    u.HELD[key] = y
    y[index] = index + 1
    if y.is_cuda:
        torch.cuda.synchronize()
    return u.fingerprint(y)


@pytest.mark.parametrize("device", DEVICES)
def test_open_ended_descriptor_has_any_number_of_readers(device, ipc_peers):
    x = torch.zeros(8, device=device)
    tokens_before = torch_ipc.stats()["tokens_pending"]
    export = _serialize.export_object(x, consumers=None)
    for round_ in range(2):
        for i, name in enumerate(("a", "b", "c")):
            ipc_peers.get(name).call(_load_write_check, "x", export.data, i)
            ipc_peers.get(name).call(u.drop, "x")  # released: the next reader loads after it
        torch_ipc.collect()
        assert export.live, f"round {round_}: reclaimed while the producer holds x"
    expected = torch.zeros(8)
    expected[:3] = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(x.cpu(), expected)
    assert torch_ipc.stats()["tokens_pending"] == tokens_before  # it asks for no count of loads
    del x
    assert u.collect_until(lambda: not export.live), "not reclaimed after the producer dropped x"
    assert ipc_peers.get("a").call(u.try_load, export.data)[0] == "ReleasedError"


@pytest.mark.parametrize("device", DEVICES)
def test_open_ended_export_outlives_its_producers_reference_while_read(device, ipc_peers):
    x = torch.zeros(8, device=device)
    export = _serialize.export_object(x, consumers=None)
    ipc_peers.get("a").call(_load_write_check, "x", export.data, 0)
    del x  # only reader a holds it now
    torch_ipc.collect()
    time.sleep(0.1)
    torch_ipc.collect()
    assert export.live, "reclaimed under a reader"
    ipc_peers.get("b").call(_load_write_check, "x", export.data, 1)  # a new reader still gets in
    assert ipc_peers.get("a").call(u.held_fingerprint, "x") == ipc_peers.get("b").call(u.held_fingerprint, "x")
    ipc_peers.get("a").call(u.drop, "x")
    torch_ipc.collect()
    assert export.live, "reclaimed while reader b holds it"
    ipc_peers.get("b").call(u.drop, "x")
    assert u.collect_until(lambda: not export.live), "not reclaimed once every reader released it"
    assert ipc_peers.get("c").call(u.try_load, export.data)[0] == "ReleasedError"


def test_open_ended_export_of_a_tensor_sent_twice_still_ends():
    x = torch.zeros(8)
    open_ended = _serialize.export_object(x, consumers=None)
    counted = _serialize.export_object(x, consumers=1)  # the records' own references are not the producer's
    del x
    assert u.collect_until(lambda: not open_ended.live)
    assert counted.live  # still waits for its one load
    counted.revoke()
    assert u.collect_until(lambda: not counted.live)


def _relay_open_ended(d):
    y = torch_ipc.loads(d)
    u.HELD["y"] = y
    return torch_ipc.dumps(y, consumers=None)


def test_open_ended_forwarding_lets_many_load_while_the_relay_holds(ipc_peers):
    x = torch.zeros(8)
    d = torch_ipc.dumps(x)
    d2 = ipc_peers.get("relay").call(_relay_open_ended, d)
    for i, name in enumerate(("a", "b", "c")):
        ipc_peers.get(name).call(_load_write_check, "x", d2, i)
        ipc_peers.get(name).call(u.drop, "x")
    assert torch.equal(x[:3], torch.tensor([1.0, 2.0, 3.0]))
    ipc_peers.get("relay").call(u.drop, "y")
    assert u.collect_until(lambda: torch_ipc.stats()["exports"] == 0 or torch_ipc.stats()["holders"] == 0)


def test_consumers_must_be_none_or_positive():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="consumers"):
            torch_ipc.dumps(torch.ones(1), consumers=bad)
    with pytest.raises(ValueError, match="isolated"):
        torch_ipc.dumps(torch.ones(1), consumers=None, isolated=True)


# ----------------------------------------------------------------------------- CUDA


def _init_cuda():
    torch.zeros(1, device="cuda")
    return torch.cuda.memory_allocated()


def _memory_allocated():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _export_cuda(key: str, n: int, seed: int, consumers: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = u.random_tensor((n,), torch.float32, gen, "cuda")
    u.HELD[key] = x
    return torch_ipc.dumps(x, consumers=consumers), u.digest(x)


def _load_digest(key: str, data: bytes):
    u.HELD[key] = torch_ipc.loads(data)
    return u.digest(u.HELD[key])


def _drop_and_wait_memory(key: str, baseline: int, timeout: float):
    """Drop our reference, then collect until the export is reclaimed and the
    caching allocator has the memory back; return (stats, memory_allocated)."""
    u.HELD.pop(key, None)
    s = u.wait_for_stats("exports", 0, timeout)
    deadline = time.monotonic() + timeout
    while _memory_allocated() != baseline and time.monotonic() < deadline:
        torch_ipc.collect()
        time.sleep(0.02)
    return s, _memory_allocated()


@CUDA_ONLY
@pytest.mark.parametrize("how", ["SIGKILL", "exit", "release"])
def test_memory_returns_after_the_consumer_releases_or_dies(how, device):
    with Peer(timeout=180, name="producer") as producer, Peer(timeout=180, name="consumer") as consumer:
        baseline = producer.call(_init_cuda)
        consumer.call(_init_cuda)
        data, want = producer.call(_export_cuda, "x", 16 << 20, u.new_seed())  # 64 MiB
        assert consumer.call(_load_digest, "x", data) == want
        # The producer drops its own tensor: the export keeps the memory.
        producer.call(u.drop, "x")
        held = producer.call(_memory_allocated)
        assert held >= baseline + (64 << 20), "the export must keep the block while a consumer holds it"
        if how == "SIGKILL":
            consumer.kill(signal.SIGKILL)
        elif how == "exit":
            assert consumer.close(check=True) == 0
        else:
            consumer.call(u.drop, "x")
        s, allocated = producer.call(_drop_and_wait_memory, "x", baseline, RECLAIM_S)
        assert s["exports"] == 0, s
        assert allocated == baseline, f"{allocated - baseline} bytes still allocated after reclaim ({how})"


def _share_batch(count: int, seed: int):
    return u.share_batch(count, seed, "cuda", u.digest)


def _load_batch(batch):
    s = u.load_batch(batch, u.digest)
    s["allocated"] = torch.cuda.memory_allocated()
    return s


def _producer_state():
    s = u.wait_for_stats("exports", 0, RECLAIM_S)
    s["fds"] = u.open_fds()
    s["allocated"] = _memory_allocated()
    return s


def _uuid0():
    s = str(torch.cuda.get_device_properties(0).uuid)
    return s if s.startswith("GPU-") else "GPU-" + s


@CUDA_ONLY
def test_consumer_with_cuda_visible_devices_as_uuid(device):
    with Peer(timeout=180, name="producer") as producer:
        uuid = producer.call(_uuid0)
        data, want = producer.call(_export_cuda, "x", 1 << 20, u.new_seed())
        with Peer(timeout=180, name="uuid-consumer", env={"CUDA_VISIBLE_DEVICES": uuid}) as consumer:
            assert consumer.call(_load_digest, "x", data) == want
            assert consumer.call(_visible) == uuid


def _visible():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def _export_after_slow_mutation(key: str, seed: int, seconds: float):
    """Queue slow GPU work, then overwrite the tensor, then export it again at once."""
    gen = torch.Generator().manual_seed(seed)
    x = u.HELD[key]
    src_host = u.random_tensor(tuple(x.shape), x.dtype, gen)
    want = u.digest(src_host)
    src = src_host.to("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(u.gpu_cycles_per_second() * seconds))
    x.copy_(src)
    return torch_ipc.dumps(x), want


@CUDA_ONLY
def test_resent_tensor_shows_its_new_values(device):
    """The second send of the same memory hits the consumer's mapping cache: it
    must still wait on the new export's event (torch's rebuild does not)."""
    with Peer(timeout=180, name="producer") as producer, Peer(timeout=180, name="consumer") as consumer:
        producer.call(_init_cuda)
        consumer.call(_init_cuda)
        data, want = producer.call(_export_cuda, "x", 16 << 20, u.new_seed())
        assert consumer.call(_load_digest, "y", data) == want
        consumer.call(u.drop, "y")
        for _ in range(2):
            data, want = producer.call(_export_after_slow_mutation, "x", u.new_seed(), 2.0)
            assert consumer.call(_load_digest, "y", data) == want
            consumer.call(u.drop, "y")


def _forward(key: str, data: bytes):
    """Load, then export what we received to somebody else."""
    u.HELD[key] = torch_ipc.loads(data)
    return torch_ipc.dumps(u.HELD[key][2:])


def _write_ones(key: str):
    u.HELD[key].fill_(1)
    torch.cuda.synchronize()
    return u.digest(u.HELD[key])


def _digest_slice(key: str, start: int, stop: int):
    return u.digest(u.HELD[key][start:stop])


@CUDA_ONLY
def test_forwarding_a_received_tensor_to_a_third_process(device):
    with Peer(timeout=180, name="owner") as owner, Peer(timeout=180, name="middle") as middle, \
            Peer(timeout=180, name="last") as last:  # fmt: skip
        owner.call(_init_cuda)
        data, _ = owner.call(_export_cuda, "x", 1000, u.new_seed())
        forwarded = middle.call(_forward, "x", data)
        written = last.call(_write_ones_after_load, "z", forwarded)
        assert owner.call(_digest_slice, "x", 2, 1000) == written, "the owner sees the third process's write"
        # The middle process lets go; the third still holds: the owner keeps the export.
        middle.call(u.drop, "x")
        owner.call(u.drop, "x")
        assert owner.call(u.wait_for_stats, "exports", 0, 0.5)["exports"] == 1
        last.call(u.drop, "z")
        assert owner.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0


def _write_ones_after_load(key: str, data: bytes):
    u.HELD[key] = torch_ipc.loads(data)
    return _write_ones(key)


@CUDA_ONLY
def test_expandable_segments_memory_is_shared(device):
    """Memory from cuMemCreate (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
    cannot go through legacy CUDA IPC: it takes the VMM path."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with Peer(timeout=180, name="vmm-producer", env=env) as producer, Peer(timeout=180, name="consumer") as consumer:
        data, want = producer.call(_export_cuda, "x", 1 << 20, u.new_seed())
        assert consumer.call(_load_digest, "x", data) == want
        written = consumer.call(_write_ones, "x")
        assert producer.call(u.digest_held, "x") == written


def _cycles_on_cuda():
    cycles, per_batch = 10_000, 500
    with Peer(timeout=300, name="producer") as producer, Peer(timeout=300, name="consumer") as consumer:
        producer.call(_init_cuda)
        consumer.call(_init_cuda)
        first_p = first_c = None
        for b in range(cycles // per_batch):
            c = consumer.call(_load_batch, producer.call(_share_batch, per_batch, b))
            p = producer.call(_producer_state)
            assert c["bad"] == 0, f"batch {b}: wrong values"
            assert c["imports"] == 0 and c["pending_releases"] == 0, c
            assert c["mappings_open"] <= 64 and c["events_open"] <= 16, f"batch {b}: consumer handles grow: {c}"
            assert p["exports"] == 0, f"batch {b}: the producer did not reclaim: {p}"
            if b == 1:  # after warm-up (caches, segments, the event pool)
                first_p, first_c = p, c
            elif b > 1:
                assert c["fds"] <= first_c["fds"] + 4, f"consumer fds grow: {first_c['fds']} -> {c['fds']}"
                assert p["fds"] <= first_p["fds"] + 4, f"producer fds grow: {first_p['fds']} -> {p['fds']}"
                assert c["allocated"] == first_c["allocated"], "the consumer's GPU memory grows"
                assert p["allocated"] <= first_p["allocated"], "the producer's GPU memory grows"
                assert c["mappings_open"] <= first_c["mappings_open"] + 8, f"mappings grow: {c}"
                assert c["lease_segments"] <= first_c["lease_segments"] + 1, f"lease segments grow: {c}"
                assert p["lease_segments"] <= first_p["lease_segments"] + 1, f"lease segments grow: {p}"
