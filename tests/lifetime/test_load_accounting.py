"""What a load leaves behind when it dies or fails.

Consumers killed while holding an export must not use up its holder words
(Note [holder limit] in csrc/os/refcount.h): a later load still succeeds and the
export is reclaimed once its loads happened. A load that fails (a record the
producer's memory does not match, a payload that does not unpickle, Ctrl-C)
spends nothing at the producer (Note [a load spends last] in csrc/core/import.cpp):
the export stays, and a correct retry succeeds. CPU tensors, and one CUDA
test (an fd fetch that times out); the producers and consumers are real
processes, killed, stopped and interrupted for real.
"""
import gc
import os
import signal
import struct
import sys
import textwrap
import threading
import time

import ipc_test_utils as u
import pytest
import torch
from wire.test_descriptor import layout, seal

import torch_ipc
from torch_ipc.testing import Peer, PeerError

RECLAIM_S = 5.0
HOLDERS = 14  # kHoldersPerSlot


@pytest.fixture(scope="module")
def producer(ipc_peers):
    return ipc_peers.get("producer", timeout=120)


def _export_checked(producer, consumers=1):
    """(descriptor, bits) of a fresh int32 tensor the producer exported and dropped."""
    data, want, _ = producer.call(u.export_random, "x", (512,), "int32", consumers, u.new_seed())
    producer.call(u.drop, "x")
    return data, want


def _still_loadable(producer, data, want):
    """The failed load left nothing behind: the export waits for its one load,
    which now succeeds, and is reclaimed after it."""
    gc.collect()
    torch_ipc.collect()
    s = producer.call(u.wait_for_stats, "exports", 0, 0.3)  # a reclaim would have happened by now
    assert s["exports"] == 1 and s["tokens_pending"] == 1, f"the failed load spent the token: {s}"
    assert u.bits(torch_ipc.loads(data)) == want
    gc.collect()
    torch_ipc.collect()
    assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0


# ----------------------------------------------------------------------------- holder words


def test_dead_consumers_do_not_use_up_an_export():
    # The producer never collects by itself here: only a load that finds no
    # free word can clear the dead ones, then an explicit collect must.
    with Peer(timeout=120, env={"TORCH_IPC_COLLECT_INTERVAL": "3600"}, name="producer-no-collector") as producer:
        data, want = _export_checked(producer, consumers=HOLDERS + 3)
        doomed = [Peer(timeout=120, name=f"doomed-consumer-{i}") for i in range(HOLDERS)]
        try:
            for p in doomed:
                assert p.call(u.load_bits, "x", data) == want
            s = producer.call(u.stats)
            assert (s["holders"], s["dead_holders"]) == (HOLDERS, 0), s
            for p in doomed:
                p.kill(signal.SIGKILL)
            assert producer.call(u.stats)["dead_holders"] == HOLDERS
        finally:
            for p in doomed:
                p.close()
        # Every word is taken, by dead holders: the 15th load clears them itself.
        with Peer(timeout=120, name="late-consumer") as late:
            assert late.call(u.load_bits, "x", data) == want
            s = producer.call(u.stats)
            assert (s["holders"], s["dead_holders"]) == (1, 0), s
            late.kill(signal.SIGKILL)
        # A collect clears dead words although loads are still expected (2 tokens).
        s = producer.call(u.collect)
        assert (s["exports"], s["tokens_pending"], s["holders"], s["dead_holders"]) == (1, 2, 0, 0), s
        # The export is not pinned: its last two loads happen, it is reclaimed.
        for _ in range(2):
            assert u.bits(torch_ipc.loads(data)) == want
            gc.collect()
            torch_ipc.collect()
        assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0


def test_fourteen_living_holders_is_the_documented_limit(producer):
    data, want = _export_checked(producer, consumers=1)
    holders = [Peer(timeout=120, name=f"holder-{i}") for i in range(HOLDERS)]
    try:
        for p in holders:
            assert p.call(u.load_bits, "x", data) == want
        with pytest.raises(torch_ipc.HolderLimitError, match=f"already has {HOLDERS} holders"):
            torch_ipc.loads(data)
        holders.pop().close()  # one exits: its word is free again
        assert u.bits(torch_ipc.loads(data)) == want
    finally:
        for p in holders:
            p.close()
    gc.collect()
    torch_ipc.collect()
    assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0


# ----------------------------------------------------------------------------- failed loads


def _with_alloc_field(data: bytes, field: str, value: bytes) -> bytes:
    d, _ = layout(data)
    base = d["allocs"][0]["offset"]
    start = base + {"size": 8, "handle": 16}[field]
    return seal(data[:start] + value + data[start + len(value):])


def test_a_record_the_memory_does_not_match_spends_nothing(producer):
    data, want = _export_checked(producer)
    d, _ = layout(data)
    bigger = struct.pack("<Q", d["allocs"][0]["size"] * 2)  # found out only when mapping
    with pytest.raises(torch_ipc.DescriptorError, match="fewer than"):
        torch_ipc.loads(_with_alloc_field(data, "size", bigger))
    _still_loadable(producer, data, want)


def test_a_bad_shared_memory_name_is_refused_before_the_token(producer):
    data, want = _export_checked(producer)
    with pytest.raises(torch_ipc.DescriptorError, match="bad shared memory name"):
        torch_ipc.loads(_with_alloc_field(data, "handle", b"/torch_ipc.1.2.X0".ljust(64, b"\0")))
    _still_loadable(producer, data, want)


def _export_with_late_module(folder: str, name: str):
    """Export a tensor with an object of module `name` (found in `folder`)."""
    sys.path.insert(0, folder)
    try:
        module = __import__(name)
    finally:
        sys.path.remove(folder)
    t = torch.arange(300, dtype=torch.int64)
    u.HELD["x"] = t
    return torch_ipc.dumps({"t": t, "extra": module.Extra(7)}), u.bits(t)


def test_a_payload_that_does_not_unpickle_spends_nothing(producer, tmp_path):
    name = f"torch_ipc_late_module_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        class Extra:
            def __init__(self, n):
                self.n = n
    """))
    data, want = producer.call(_export_with_late_module, str(tmp_path), name)
    producer.call(u.drop, "x")
    with pytest.raises(torch_ipc.DescriptorError, match="does not unpickle.*No module named"):
        u.loads(data)  # this process cannot import the module ...
    sys.path.insert(0, str(tmp_path))  # ... until it can: the retry succeeds
    try:
        gc.collect()
        torch_ipc.collect()
        s = producer.call(u.wait_for_stats, "exports", 0, 0.3)
        assert s["exports"] == 1 and s["tokens_pending"] == 1, f"the failed load spent the token: {s}"
        obj = u.loads(data)
        assert u.bits(obj["t"]) == want and obj["extra"].n == 7
        del obj
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
    gc.collect()
    torch_ipc.collect()
    assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0


_INTERRUPT_NEXT = False


def _interrupt_this_process():
    """Unpickled from a payload: the first time, Ctrl-C arrives meanwhile."""
    global _INTERRUPT_NEXT
    if _INTERRUPT_NEXT:
        _INTERRUPT_NEXT = False
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5.0)  # the handler raises KeyboardInterrupt in here
    return "unpickled"


class _Interrupting:
    def __reduce__(self):
        return (_interrupt_this_process, ())


def _export_interrupting():
    t = torch.arange(100, dtype=torch.int16)
    u.HELD["x"] = t
    return torch_ipc.dumps({"t": t, "extra": _Interrupting()}), u.bits(t)


def _load_interrupted(data: bytes) -> str:
    """Load with a real SIGINT arriving during the load; what happened."""
    global _INTERRUPT_NEXT
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    _INTERRUPT_NEXT = True
    try:
        u.loads(data)
        return "loaded"
    except KeyboardInterrupt:
        return "interrupted"
    finally:
        signal.signal(signal.SIGINT, previous)
        gc.collect()
        torch_ipc.collect()


def test_ctrl_c_during_a_load_spends_nothing(producer, ipc_peer):
    data, want = producer.call(_export_interrupting)
    producer.call(u.drop, "x")
    assert ipc_peer.call(_load_interrupted, data) == "interrupted"
    s = producer.call(u.wait_for_stats, "exports", 0, 0.3)
    assert s["exports"] == 1 and s["tokens_pending"] == 1, f"the interrupted load spent the token: {s}"
    obj = u.loads(data)
    assert u.bits(obj["t"]) == want and obj["extra"] == "unpickled"
    del obj
    gc.collect()
    torch_ipc.collect()
    assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0


def test_a_load_that_succeeds_spends_its_token(producer, ipc_peer):
    data, want = _export_checked(producer)
    assert ipc_peer.call(u.load_bits, "x", data) == want
    s = producer.call(u.stats)
    assert s["tokens_pending"] == 0 and s["holders"] == 1, s
    ipc_peer.call(u.drop, "x")
    assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0
    with pytest.raises(PeerError) as info:
        ipc_peer.call(u.load_bits, "x", data)
    assert isinstance(info.value.exception, torch_ipc.ReleasedError)


def _export_cuda(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int32, device="cuda", generator=gen)
    u.HELD["x"] = x
    data = torch_ipc.dumps(x)
    torch.cuda.synchronize()
    return data, u.bits(x)


def _load_while_ticking(data: bytes):
    """u.try_load(data) while another thread ticks; also the longest gap
    between two ticks (the time the load kept that thread from the GIL)."""
    ticks, stop = [time.perf_counter()], threading.Event()

    def tick():
        while not stop.wait(0.01):
            ticks.append(time.perf_counter())

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        kind, message = u.try_load(data)
    finally:
        stop.set()
        ticker.join()
        ticks.append(time.perf_counter())
    return kind, message, max(b - a for a, b in zip(ticks, ticks[1:]))


@pytest.mark.cuda
def test_a_timed_out_fd_fetch_spends_nothing():
    # Expandable segments: the consumer fetches the memory's file descriptors
    # from the producer's fd server, which cannot answer while it is stopped.
    expandable = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with Peer(timeout=120, env=expandable, name="vmm-producer") as producer, Peer(
        timeout=120, env={"TORCH_IPC_FD_TRANSPORT": "socket", "TORCH_IPC_FD_ANSWER_SECONDS": "2"}, name="vmm-consumer"
    ) as consumer:
        data, want = producer.call(_export_cuda, u.new_seed())
        producer.call(u.drop, "x")
        os.kill(producer.pid, signal.SIGSTOP)
        try:
            kind, message, stall = consumer.call(_load_while_ticking, data)  # waits the fetch's 2 s
        finally:
            os.kill(producer.pid, signal.SIGCONT)
        assert kind == "TimeoutError" and "no answer from the fd server" in message and "within 2 s" in message, (
            kind, message)
        assert stall < 1.0, f"the load held the GIL: another thread stalled {stall:.1f} s"
        consumer.call(u.collect)
        s = producer.call(u.wait_for_stats, "exports", 0, 0.3)
        assert s["exports"] == 1 and s["tokens_pending"] == 1, f"the failed load spent the token: {s}"
        assert consumer.call(u.load_bits, "x", data) == want
        consumer.call(u.drop, "x")
        assert producer.call(u.wait_for_stats, "exports", 0, RECLAIM_S)["exports"] == 0
