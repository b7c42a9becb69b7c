"""Export lifetime across processes (CPU tensors, no GPU needed): a producer
keeps an export while consumers hold it, reclaims it when they release or die,
counts loads (consumers=N), refuses loads after reclaim, and a consumer can
tell a dead producer."""
import os
import signal

import pytest
import torch

import ipc_test_utils as u
import torch_ipc
from torch_ipc.testing import Peer, PeerError

STATS_KEYS = (
    "exports", "exported_bytes", "imports", "pending_releases", "mappings_open",
    "mappings_idle", "events_open", "lease_segments", "host_segments",
)  # fmt: skip
RECLAIM_S = 5.0  # how long a producer may take to notice (collector every ~50 ms)


@pytest.fixture(scope="module")
def producer():
    with Peer(timeout=120, name="producer") as p:
        yield p
        p.close(check=True)


@pytest.fixture(scope="module")
def consumers():
    with u.peer_pair(timeout=120, names=("consumer-1", "consumer-2")) as (c1, c2):
        yield c1, c2


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
        p.kill()
    assert u.shm_files_of(pid), "a SIGKILLed producer cannot clean up"
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


def test_many_share_release_cycles_leak_nothing(producer, consumers):
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
