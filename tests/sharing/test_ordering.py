"""Stream ordering between processes, hammered: a producer queues slow GPU work
and a write right before each send, and a consumer reads at once; it must never
see the old value. Every path of the ordering is covered: an event still
pending (stream wait), an event completed before the load (no wait queued),
pooled events re-recorded on other streams of the producer, several producers,
several devices; and the public IpcEvent on its own.

CPU-only machines run the IpcEvent state checks, which come before any CUDA call.
"""
import pickle
import struct

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc.ipc_event import _rebuild_ipc_event

ROUNDS = 1000
BUSY_SECONDS = 50e-6  # GPU work queued before each write: the consumer must wait for it


def _init_cuda():
    torch.cuda.init()
    torch.zeros(1, device="cuda")


@pytest.fixture
def consumer(ipc_peers):
    return ipc_peers.get("ordering-consumer", init=_init_cuda, timeout=180)


def _busy(seconds: float = BUSY_SECONDS) -> None:
    torch.cuda._sleep(int(u.gpu_cycles_per_second() * seconds))


# ----------------------------------------------------------------------------- consumer side

def _load_and_read(data: bytes) -> int:
    """Load one tensor and read its first element at once (torch's current stream)."""
    return int(torch_ipc.loads(data)[0].item())


def _load_and_read_all(messages: list) -> list:
    return [_load_and_read(d) for d in messages]


def _load_many_and_read(data: bytes) -> dict:
    return {k: int(v[0].item()) for k, v in torch_ipc.loads(data).items()}


def _hold_tensor(data: bytes) -> None:
    u.HELD["ordering"] = torch_ipc.loads(data)


def _wait_event_and_read(event: "torch_ipc.IpcEvent") -> tuple:
    event.wait()
    return int(u.HELD["ordering"][0].item()), torch_ipc.stats()["events_open"]


def _query_event(event: "torch_ipc.IpcEvent") -> bool:
    return event.query()


def _synchronize_event(event: "torch_ipc.IpcEvent") -> bool:
    event.synchronize()
    return event.query()


# ----------------------------------------------------------------------------- descriptors

@pytest.mark.cuda
@pytest.mark.parametrize("finished_before_send", [False, True], ids=["pending", "completed"])
def test_consumer_never_reads_before_the_producers_write(consumer, finished_before_send):
    """pending: the producer's stream is still busy when the consumer loads (the
    consumer's stream must wait); completed: the write landed before the send
    (the consumer queues no wait and must still see it)."""
    x = torch.zeros(1024, dtype=torch.int64, device="cuda")
    stale = []
    for i in range(1, ROUNDS + 1):
        _busy()
        x.fill_(i)
        if finished_before_send:
            torch.cuda.synchronize()
        seen = consumer.call(_load_and_read, torch_ipc.dumps(x))
        if seen != i:
            stale.append((i, seen))
    assert not stale, f"{len(stale)} of {ROUNDS} reads saw an older value, e.g. {stale[:3]}"


@pytest.mark.cuda
def test_an_export_carries_an_event_only_while_its_stream_has_work():
    """Note [ordering without waiting]: no GPU command (and no consumer wait)
    when the writes landed already; one event while they are in flight."""
    x = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    idle = torch_ipc.dumps(x)
    assert torch_ipc._C.describe(idle)["n_events"] == 0
    _busy(0.1)
    x.fill_(1)
    busy = torch_ipc.dumps(x)
    assert torch_ipc._C.describe(busy)["n_events"] == 1
    for data in (idle, busy):
        assert torch_ipc.loads(data)[0].item() == 1  # loaded here, after the fill


@pytest.mark.cuda
def test_pooled_events_rerecorded_on_another_stream(consumer):
    """Note [event pool]: an export made behind slow work on stream A, then more
    exports than the pool has events on an idle stream B. A pool shared by the
    two streams would have re-recorded A's event on B, where it completes at
    once: the consumer would skip the wait and read before A's write."""
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1024, dtype=torch.int64, device="cuda")
    y = torch.zeros(1024, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    stale = []
    for i in range(1, ROUNDS // 10 + 1):
        with torch.cuda.stream(a):
            _busy(300e-6)
            x.fill_(i)
            slow = torch_ipc.dumps(x)
        quick = []
        with torch.cuda.stream(b):
            for k in range(6):
                y.fill_(10 * i + k)
                quick.append(torch_ipc.dumps(y, consumers=1))
        b.synchronize()
        seen = consumer.call(_load_and_read_all, [slow] + quick)
        if seen[0] != i:
            stale.append((i, seen[0]))
        assert seen[1:] == [10 * i + 5] * 6  # y holds its last write; all of b's work is done
    torch.cuda.synchronize()
    assert not stale, f"{len(stale)} reads of the slow export saw an older value, e.g. {stale[:3]}"


def _produce_behind_slow_work(i: int, seconds: float) -> bytes:
    x = u.HELD.setdefault("ordering-x", torch.zeros(1024, dtype=torch.int64, device="cuda"))
    _busy(seconds)
    x.fill_(i)
    return torch_ipc.dumps(x)


@pytest.mark.cuda
def test_several_producers_one_consumer(ipc_peers):
    """Two producers, each busy when it sends; this process loads and reads."""
    producers = [ipc_peers.get(f"ordering-producer-{k}", init=_init_cuda, timeout=180) for k in range(2)]
    torch.zeros(1, device="cuda")
    stale = []
    for i in range(1, ROUNDS // 2 + 1):
        for k, producer in enumerate(producers):
            value = 2 * i + k
            data = producer.call(_produce_behind_slow_work, value, 2e-3)  # still busy when it arrives
            seen = _load_and_read(data)
            if seen != value:
                stale.append((k, value, seen))
    assert not stale, f"{len(stale)} reads saw an older value, e.g. {stale[:3]}"


@pytest.mark.cuda
@pytest.mark.gpus(2)
def test_writes_on_two_devices_in_one_message(consumer):
    xs = {f"cuda:{d}": torch.zeros(1024, dtype=torch.int64, device=f"cuda:{d}") for d in (0, 1)}
    stale = []
    for i in range(1, ROUNDS // 2 + 1):
        for d, x in enumerate(xs.values()):
            with torch.cuda.device(d):
                _busy()
                x.fill_(i + d)
        seen = consumer.call(_load_many_and_read, torch_ipc.dumps(xs))
        if seen != {"cuda:0": i, "cuda:1": i + 1}:
            stale.append((i, seen))
    assert not stale, f"{len(stale)} messages had an older value, e.g. {stale[:3]}"


# ----------------------------------------------------------------------------- IpcEvent

@pytest.mark.cuda
def test_ipc_event_orders_the_consumers_stream(consumer):
    """The event travels with standard pickle each round and is opened once."""
    x = torch.zeros(1024, dtype=torch.int64, device="cuda")
    consumer.call(_hold_tensor, torch_ipc.dumps(x))
    event = torch_ipc.IpcEvent()
    stale, opened = [], set()
    for i in range(1, ROUNDS + 1):
        _busy()
        x.fill_(i)
        event.record()
        seen, events_open = consumer.call(_wait_event_and_read, event)
        opened.add(events_open)
        if seen != i:
            stale.append((i, seen))
    assert not stale, f"{len(stale)} of {ROUNDS} reads saw an older value, e.g. {stale[:3]}"
    assert len(opened) == 1, f"the consumer opened the event more than once: events_open took {opened}"
    consumer.call(u.drop, "ordering")


@pytest.mark.cuda
def test_ipc_event_query_and_synchronize(consumer):
    event = torch_ipc.IpcEvent("cuda:0")
    assert event.device == torch.device("cuda", 0)
    assert event.query()  # never recorded
    _busy(0.5)
    event.record()
    assert consumer.call(_query_event, event) is False  # the producer's stream is still busy
    assert consumer.call(_synchronize_event, event) is True
    assert event.query()


@pytest.mark.cuda
def test_ipc_event_pickled_in_its_own_process():
    """Unpickled where it was made, it is the same event (a process cannot
    open its own IPC handle): a record through one is waited on through the other."""
    event = torch_ipc.IpcEvent()
    again = pickle.loads(pickle.dumps(event))
    x = torch.zeros(1024, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    _busy(0.2)
    x.fill_(7)
    again.record()
    assert not event.query()
    reader = torch.cuda.Stream()
    event.wait(reader)
    with torch.cuda.stream(reader):
        seen = x.clone()
    reader.synchronize()
    assert seen[0].item() == 7


@pytest.mark.cuda
@pytest.mark.gpus(2)
def test_ipc_event_refuses_a_stream_of_another_gpu():
    event = torch_ipc.IpcEvent("cuda:0")
    with pytest.raises(ValueError, match="cannot be used with a stream of cuda:1"):
        event.record(torch.cuda.Stream(device=1))


# ----------------------------------------------------------------------------- IpcEvent state (CPU too)

def _state(**fields) -> bytes:
    values = {"magic": b"TIEV", "version": 2, "handle": bytes(64), "uuid": bytes(16), "boot": bytes(16),
              "pid": 1, "reserved": 0, "start": 0, "life": 0, "pidns": 0}
    values.update(fields)
    return struct.pack("<4sI64s16s16sIIQII", values["magic"], values["version"], values["handle"], values["uuid"],
                       values["boot"], values["pid"], values["reserved"], values["start"], values["life"],
                       values["pidns"])


@pytest.mark.parametrize(
    "state, message",
    [
        (b"", "0 bytes, expected 128"),
        (_state()[:-1], "127 bytes"),
        (_state(magic=b"XXXX"), "not an IpcEvent"),
        (_state(version=3), "format version 3"),
        (_state(version=1)[:120], "format version 1 .*another torch_ipc version"),  # pid and start time only
        (_state(reserved=7), "reserved"),
        (_state(pid=0), "no producer"),
        (_state(), "another machine or an earlier boot"),  # boot id of zeros
    ],
    ids=["empty", "short", "magic", "version", "version-1", "reserved", "pid", "boot"],
)
def test_ipc_event_state_is_checked_before_use(state, message):
    with pytest.raises(torch_ipc.DescriptorError, match=message):
        _rebuild_ipc_event(state)


def test_ipc_event_state_must_be_bytes():
    with pytest.raises(TypeError, match="must be bytes"):
        _rebuild_ipc_event("not bytes")


def test_ipc_event_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(torch_ipc.CudaUnavailableError, match="IpcEvent needs CUDA"):
        torch_ipc.IpcEvent()
