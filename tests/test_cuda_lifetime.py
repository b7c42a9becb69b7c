"""CUDA export lifetime across processes: memory returns to the caching
allocator once consumers release or die, many share/release cycles leak
nothing, GPUs are found by UUID, a resent tensor shows its new values, received
tensors can be forwarded, and loads in the producer gives back its own memory.

Needs a CUDA GPU (skipped otherwise).
"""
import os
import signal
import time

import pytest
import torch

import ipc_test_utils as u
import torch_ipc
from torch_ipc.testing import Peer, run_in_subprocess

pytestmark = pytest.mark.cuda

RECLAIM_S = 5.0


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


@pytest.mark.parametrize("how", ["SIGKILL", "exit", "release"])
def test_memory_returns_after_the_consumer_releases_or_dies(how):
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


def test_many_share_release_cycles_leak_nothing():
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


def _uuid0():
    s = str(torch.cuda.get_device_properties(0).uuid)
    return s if s.startswith("GPU-") else "GPU-" + s


def test_consumer_with_cuda_visible_devices_as_uuid():
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


def test_resent_tensor_shows_its_new_values():
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


def test_forwarding_a_received_tensor_to_a_third_process():
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


def _same_process_cuda(seed: int):
    problems = []
    gen = torch.Generator().manual_seed(seed)
    x = u.random_tensor((300, 7), torch.float32, gen, "cuda")
    v = x[5:, 2:]
    y = torch_ipc.loads(torch_ipc.dumps({"x": x, "v": v}))
    if y["x"].data_ptr() != x.data_ptr() or y["v"].data_ptr() != v.data_ptr():
        problems.append("loads in the producer returned other memory")
    y["v"].fill_(7)
    if not bool((x[5:, 2:] == 7).all()):
        problems.append("a write through the loaded tensor does not reach the original")
    return problems


def test_loads_in_the_producer_returns_the_same_memory():
    assert run_in_subprocess(_same_process_cuda, u.new_seed(), timeout=180) == []


def test_expandable_segments_memory_is_shared():
    """Memory from cuMemCreate (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
    cannot go through legacy CUDA IPC: it takes the VMM path."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with Peer(timeout=180, name="vmm-producer", env=env) as producer, Peer(timeout=180, name="consumer") as consumer:
        data, want = producer.call(_export_cuda, "x", 1 << 20, u.new_seed())
        assert consumer.call(_load_digest, "x", data) == want
        written = consumer.call(_write_ones, "x")
        assert producer.call(u.digest_held, "x") == written
