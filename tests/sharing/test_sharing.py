"""Tensors through dumps/loads between processes, on CPU and on CUDA: every
dtype and view exact, writes seen both ways, nested containers, parameters and
modules, loads in the producer itself; on CUDA also stream ordering at export,
mixed CPU/CUDA batches and GPUs beyond the first.

Tests parametrized over ``device`` run on ``cpu`` everywhere and on ``cuda``
where there is a GPU (the ``cuda`` param is marked ``cuda``); the ``gpus(2)``
tests need two. The others run on CPU tensors only (``device`` is then "cpu").
"""
import collections
import gc
import time

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc.testing import Peer, run_in_subprocess

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CUDA_ONLY = pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda)])

REQUIRED_DTYPES = {
    "cpu": (
        "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
        "float32", "float64", "complex64", "complex128",
    ),
    "cuda": (
        "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
        "float64", "complex64", "float8_e4m3fn", "float8_e5m2",
    ),
}  # fmt: skip
DEVICE_NAME = {"cpu": "cpu", "cuda": "cuda:0"}


@pytest.fixture
def device():
    """The device of a test that is not parametrized over it."""
    return "cpu"


@pytest.fixture
def pair(device, ipc_peers):
    """A producer and a consumer process, shared by this module's tests on `device`
    (a CUDA pair initialised CUDA first). After the test, the consumer and then
    the producer drop what they hold."""
    if device == "cuda":
        producer = ipc_peers.get("cuda-producer", init=_init_cuda, timeout=180)
        consumer = ipc_peers.get("cuda-consumer", init=_init_cuda, timeout=180)
    else:
        producer = ipc_peers.get("producer", timeout=120)
        consumer = ipc_peers.get("consumer", timeout=120)
    yield producer, consumer
    if consumer.is_alive() and producer.is_alive() and not (consumer.busy or producer.busy):
        consumer.call(u.drop)
        producer.call(u.drop)


# ----------------------------------------------------------------------------- child functions


def _init_cuda():
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    return torch.cuda.device_count()


def _export_views(seed: int, device: str):
    gen = torch.Generator().manual_seed(seed)
    batch = {}
    for dtype in u.dtypes(device):
        batch[u.dtype_name(dtype)] = u.views_of(u.random_tensor((7, 12), dtype, gen, device))
    batch["other"] = {
        "empty": torch.empty(0, device=device),
        "empty_2d": torch.empty(3, 0, dtype=torch.int16, device=device),
        "scalar": torch.tensor(3.5, dtype=torch.float64, device=device),
        "permuted_3d": u.random_tensor((4, 5, 6), torch.float32, gen, device).permute(2, 0, 1)[1:, ::2],
        # On CUDA, carved by the caching allocator out of one segment with
        # others: the storage sits at an offset inside the shared base allocation.
        "offset_into_big": u.random_tensor((1000,), torch.int32, gen, device)[997:],
        "small_neighbour": u.random_tensor((3,), torch.float32, gen, device),
    }
    u.HELD["views"] = batch
    return torch_ipc.dumps(batch), u.fingerprint(batch), u.storage_groups(batch), [u.dtype_name(d) for d in u.dtypes(device)]


def _devices_of(key: str):
    return sorted({str(t.device) for t in u.tensors_in(u.HELD[key])})


# ----------------------------------------------------------------------------- every dtype and view


@pytest.mark.parametrize("device", DEVICES)
def test_every_dtype_and_view_exact(pair, device):
    producer, consumer = pair
    seed = u.new_seed()
    data, expected, groups, names = producer.call(_export_views, seed, device)
    for name in REQUIRED_DTYPES[device]:
        assert name in names, f"{name} missing from the {device} dtypes under test"
    got = consumer.call(u.load, "views", data)
    assert len(got[1]) == len(expected[1])
    for (name, want), (got_name, have) in zip(expected[1], got[1]):
        assert got_name == name
        assert have == want, f"{name}: the consumer sees other values or metadata (seed {seed})"
    # Views of one storage still share one storage in the consumer.
    assert consumer.call(u.held_groups, "views") == groups
    assert consumer.call(_devices_of, "views") == [DEVICE_NAME[device]]


@pytest.mark.parametrize("view", u.WRITABLE)
@pytest.mark.parametrize("device", DEVICES)
def test_writes_are_seen_both_ways(pair, device, view):
    producer, consumer = pair
    seed = u.new_seed()
    data, before, _, _ = producer.call(_export_views, seed, device)
    consumer.call(u.load_quietly, "views", data)
    # consumer -> producer
    written = consumer.call(u.write_views, "views", view, seed + 1)
    assert producer.call(u.view_bits, "views", view) == written, f"seed {seed}"
    after_consumer = producer.call(u.held_fingerprint, "views")
    assert after_consumer != before
    assert consumer.call(u.held_fingerprint, "views") == after_consumer
    # producer -> consumer
    written = producer.call(u.write_views, "views", view, seed + 2)
    assert consumer.call(u.view_bits, "views", view) == written, f"seed {seed}"
    assert consumer.call(u.held_fingerprint, "views") == producer.call(u.held_fingerprint, "views")


# ----------------------------------------------------------------------------- containers and parameters


def _export_nested(seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = u.random_tensor((5, 6), torch.float32, gen)
    b = u.random_tensor((9,), torch.int64, gen)
    c = u.random_tensor((2, 3, 4), torch.bfloat16, gen)
    obj = {
        "list": [a, (b, "text", 3), {"inner": [a[1:], None, c]}],
        "tuple": (b[::2], c.transpose(0, 2)),
        "ordered": collections.OrderedDict(w=a, b=b),
        "same_twice": [a, a],
        "deep": [[[[[{"x": c[1]}]]]]],
        "values": {"int": 5, "float": 1.5, "str": "s", "bytes": b"\x00\x01", "none": None, "bool": True},
    }
    u.HELD["nested"] = obj
    return torch_ipc.dumps(obj), u.fingerprint(obj), u.storage_groups(obj)


def test_nested_containers_keep_shape_types_and_aliasing(pair):
    producer, consumer = pair
    seed = u.new_seed()
    data, expected, groups = producer.call(_export_nested, seed)
    assert consumer.call(u.load, "nested", data) == expected, f"seed {seed}"
    assert consumer.call(u.held_groups, "nested") == groups


def _export_parameters(seed: int):
    torch.manual_seed(seed)
    obj = {
        "param": torch.nn.Parameter(torch.randn(3, 4)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "int_param": torch.nn.Parameter(torch.arange(3), requires_grad=False),
        "leaf_requires_grad": torch.randn(5, requires_grad=True),
        "plain": torch.randn(2),
        "linear": torch.nn.Linear(4, 3),
        "state_dict": torch.nn.Linear(2, 2).state_dict(),
    }
    u.HELD["params"] = obj
    return torch_ipc.dumps(obj), u.fingerprint(obj)


def _use_parameters(key: str):
    obj = u.HELD[key]
    p, lin = obj["param"], obj["linear"]
    types = {k: type(v).__name__ for k, v in obj.items()}
    requires = {k: v.requires_grad for k, v in obj.items() if isinstance(v, torch.Tensor)}
    lin_types = [type(q).__name__ for q in lin.parameters()]
    out = lin(torch.ones(2, 4)).sum() + p.sum()
    out.backward()
    grads = p.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        lin.weight.mul_(2)  # the producer must see this
    return types, requires, lin_types, grads


def _linear_weight_bits(key: str):
    return u.bits(u.HELD[key]["linear"].weight)


def test_parameters_keep_type_and_requires_grad(pair):
    producer, consumer = pair
    data, expected = producer.call(_export_parameters, u.new_seed())
    assert consumer.call(u.load, "params", data) == expected
    before = producer.call(_linear_weight_bits, "params")
    types, requires, lin_types, grads = consumer.call(_use_parameters, "params")
    assert types["param"] == types["frozen"] == types["int_param"] == "Parameter"
    assert types["leaf_requires_grad"] == types["plain"] == "Tensor" and types["linear"] == "Linear"
    assert types["state_dict"] == "OrderedDict"
    assert requires == {"param": True, "frozen": False, "int_param": False, "leaf_requires_grad": True, "plain": False}
    assert lin_types == ["Parameter", "Parameter"] and grads
    after = producer.call(_linear_weight_bits, "params")
    doubled = (torch.frombuffer(bytearray(before), dtype=torch.float32) * 2).numpy().tobytes()
    assert after == doubled, "the consumer's in-place update of a module weight reaches the producer"


def _export_modules(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).cuda()
    obj = {
        "state_dict": model.state_dict(),
        "model": model,
        "frozen": torch.nn.Parameter(torch.randn(3, device="cuda"), requires_grad=False),
        "mixed": [torch.randn(5), torch.randn(5, device="cuda"), torch.arange(4, device="cuda")[1:]],
    }
    u.HELD["modules"] = obj
    return torch_ipc.dumps(obj), u.fingerprint(obj)


def _use_model(key: str):
    obj = u.HELD[key]
    model = obj["model"]
    devices = [str(t.device) for t in obj["mixed"]]
    out = model(torch.ones(2, 8, device="cuda")).sum()
    out.backward()
    with torch.no_grad():
        model[0].weight.add_(1)
    return devices, type(obj["frozen"]).__name__, obj["frozen"].requires_grad, u.bits(model[0].weight)


def _weight_bits(key: str):
    return u.bits(u.HELD[key]["model"][0].weight), u.bits(u.HELD[key]["state_dict"]["0.weight"])


@CUDA_ONLY
def test_modules_parameters_and_mixed_devices(pair, device):
    producer, consumer = pair
    data, expected = producer.call(_export_modules, u.new_seed())
    assert consumer.call(u.load, "modules", data) == expected
    devices, frozen_type, frozen_grad, weight = consumer.call(_use_model, "modules")
    assert devices == ["cpu", "cuda:0", "cuda:0"]
    assert frozen_type == "Parameter" and frozen_grad is False
    # The consumer's in-place update reaches the producer's module and its state_dict.
    assert producer.call(_weight_bits, "modules") == (weight, weight)


# ----------------------------------------------------------------------------- loads in the producer itself


def _same_process(seed: int):
    """In one process: dumps moves the storage into shared memory once, views
    follow it, and loads returns the very same memory."""
    problems = []
    gen = torch.Generator().manual_seed(seed)
    x = u.random_tensor((64, 33), torch.float64, gen)
    v = x[1:, 3:]
    before = u.bits(x)
    data = torch_ipc.dumps({"x": x, "v": v})
    if u.bits(x) != before:
        problems.append("values changed when moved to shared memory")
    if v.data_ptr() != x.data_ptr() + (33 + 3) * 8:
        problems.append("a view of the exported tensor no longer aliases it")
    x[1, 3] = 12345.0
    if v[0, 0].item() != 12345.0:
        problems.append("a write through the tensor does not reach its view after the move")
    moved = x.data_ptr()
    torch_ipc.dumps(x)
    torch_ipc.dumps({"again": v})
    if x.data_ptr() != moved:
        problems.append("a second export moved the storage again")
    y = torch_ipc.loads(data)
    if y["x"].data_ptr() != x.data_ptr() or y["v"].data_ptr() != v.data_ptr():
        problems.append("loads in the producer returned other memory")
    if y["x"].stride() != x.stride() or y["v"].shape != v.shape:
        problems.append("loads in the producer returned other metadata")
    y["x"][0, 0] = -1.0
    if x[0, 0].item() != -1.0:
        problems.append("a write through the loaded tensor does not reach the original")
    # A tensor that loads() returned can be exported again, in the same process.
    z = torch_ipc.loads(torch_ipc.dumps(y["v"]))
    if z.data_ptr() != v.data_ptr():
        problems.append("re-exporting a loaded tensor in the producer gives other memory")
    return problems


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


@pytest.mark.parametrize("device", DEVICES)
def test_loads_in_the_producer_returns_the_same_memory(device):
    if device == "cpu":
        assert run_in_subprocess(_same_process, u.new_seed(), timeout=120) == []
    else:
        assert run_in_subprocess(_same_process_cuda, u.new_seed(), timeout=180) == []


# ----------------------------------------------------------------------------- big tensors, mutation, storages


def _export_big(seed: int, n: int):
    gen = torch.Generator().manual_seed(seed)
    x = u.random_tensor((n,), torch.float32, gen)
    u.HELD["big"] = x
    return torch_ipc.dumps(x), u.digest(x)


def _load_digest(key: str, data: bytes):
    u.HELD[key] = torch_ipc.loads(data)
    return u.digest(u.HELD[key])


def test_big_tensor_exact(pair):
    producer, consumer = pair
    data, want = producer.call(_export_big, u.new_seed(), 8 << 20)  # 32 MiB
    assert consumer.call(_load_digest, "big", data) == want


def _mutate(key: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = u.HELD[key]
    x.copy_(u.random_tensor(tuple(x.shape), x.dtype, gen))
    return u.digest(x)


def _dumps_held(key: str, consumers: int = 1) -> bytes:
    return torch_ipc.dumps(u.HELD[key], consumers=consumers)


def test_mutation_after_export_and_resend(pair):
    producer, consumer = pair
    data, _ = producer.call(_export_big, u.new_seed(), 1 << 16)
    # Shared memory, not a snapshot: what the producer writes after dumps() shows.
    mutated = producer.call(_mutate, "big", u.new_seed())
    assert consumer.call(_load_digest, "x", data) == mutated
    consumer.call(u.drop, "x")
    # The same tensor again, after another mutation: the new values.
    mutated = producer.call(_mutate, "big", u.new_seed())
    data = producer.call(_dumps_held, "big")
    assert consumer.call(_load_digest, "x", data) == mutated


def _export_and_forget(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = u.random_tensor((333, 7), torch.int16, gen)
    data, want = torch_ipc.dumps(x[5:, 1:]), u.bits(x[5:, 1:])
    del x
    gc.collect()
    torch_ipc.collect()
    return data, want


def test_producer_dropping_its_reference_keeps_the_export(pair):
    producer, consumer = pair
    data, want = producer.call(_export_and_forget, u.new_seed())
    assert consumer.call(u.load_bits, "x", data) == want


def _export_storage(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = u.random_tensor((100,), torch.uint8, gen)
    u.HELD["storage"] = x
    return torch_ipc.dumps({"s": x.untyped_storage()}), u.fingerprint(x.untyped_storage())


def _poke_storage(key: str):
    s = u.HELD[key]["s"]
    torch.empty(0, dtype=torch.uint8).set_(s)[7] = 99
    return type(s).__name__


def _byte_at(key: str, i: int):
    return int(u.HELD[key][i])


def test_untyped_storage(pair):
    producer, consumer = pair
    data, want = producer.call(_export_storage, u.new_seed())
    got = consumer.call(u.load, "s", data)
    assert got[1] == [("s", want)]
    assert consumer.call(_poke_storage, "s") == "UntypedStorage"
    assert producer.call(_byte_at, "storage", 7) == 99


def _dumps_value(value):
    return torch_ipc.dumps(value)


def _loads_value(data):
    return torch_ipc.loads(data)


@pytest.mark.parametrize("value", [{"a": 1, "b": [None, "x"]}, "just a string", (1, 2.5), []])
def test_objects_without_tensors(pair, value):
    producer, consumer = pair
    assert consumer.call(_loads_value, producer.call(_dumps_value, value)) == value


class _CountsReductions:
    reductions = 0

    def __init__(self, tag):
        self.tag = tag

    def __reduce__(self):
        type(self).reductions += 1
        return (_CountsReductions, (self.tag,))


class _ReducedByMultiprocessing:
    def __init__(self, tag):
        self.tag = tag


def _rebuild_registered(tag):
    return ("registered", tag)


def test_an_object_without_tensors_is_reduced_once():
    # Note [messages without tensors]: the C pickler's pass is the payload.
    _CountsReductions.reductions = 0
    data = torch_ipc.dumps({"meta": _CountsReductions("a"), "n": [1, 2]})
    assert _CountsReductions.reductions == 1
    out = torch_ipc.loads(data, weights_only=False)
    assert out["meta"].tag == "a" and out["n"] == [1, 2]


def test_multiprocessing_reducers_apply_to_messages_without_tensors():
    # A type registered with ForkingPickler is pickled by its reducer (which may
    # have effects, e.g. share a file descriptor), never by its own __reduce__.
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(_ReducedByMultiprocessing, lambda obj: (_rebuild_registered, (obj.tag,)))
    try:
        data = torch_ipc.dumps(("x", _ReducedByMultiprocessing("b")))
    finally:
        ForkingPickler._extra_reducers.pop(_ReducedByMultiprocessing, None)
    assert torch_ipc.loads(data, weights_only=False) == ("x", ("registered", "b"))


def test_tensors_inside_other_objects_are_shared():
    x = torch.arange(6.0)
    out = torch_ipc.loads(torch_ipc.dumps(("tag", {"w": [x]}, _CountsReductions("c"))), weights_only=False)
    assert out[1]["w"][0].data_ptr() == x.data_ptr() and out[2].tag == "c"


def test_consumers_must_be_positive():
    with pytest.raises(ValueError):
        torch_ipc.dumps(torch.zeros(1), consumers=0)


# ----------------------------------------------------------------------------- stream ordering (CUDA)


def _export_behind_slow_work(seed: int, n: int, seconds: float):
    """Queue `seconds` of GPU work, then the writes, then export at once (no sync).

    A consumer that does not wait on the export's event reads the old zeros."""
    gen = torch.Generator().manual_seed(seed)
    src_host = u.random_tensor((n,), torch.float32, gen)
    want = u.digest(src_host)
    src = src_host.to("cuda")
    x = torch.zeros(n, device="cuda")
    ones = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    cycles = int(u.gpu_cycles_per_second() * seconds)
    torch.cuda._sleep(cycles)  # the current stream is busy for `seconds`
    x.copy_(src)
    ones.fill_(1)
    u.HELD["slow"] = (x, ones)
    data = torch_ipc.dumps({"x": x, "ones": ones})
    exported_at = time.time()
    busy = not torch.cuda.current_stream().query()
    return data, want, busy, exported_at


def _read_after_load(data: bytes):
    started_at = time.time()
    obj = torch_ipc.loads(data)
    u.HELD["slow"] = obj
    return u.digest(obj["x"]), bool((obj["ones"] == 1).all().item()), started_at


@CUDA_ONLY
def test_consumer_sees_writes_queued_before_export(pair, device):
    producer, consumer = pair
    seconds = 3.0
    data, want, busy, exported_at = producer.call(_export_behind_slow_work, u.new_seed(), 16 << 20, seconds)
    digest, all_ones, started_at = consumer.call(_read_after_load, data)
    assert busy, "the producer's stream had finished before the export: the test proves nothing"
    late = started_at - exported_at
    assert late < seconds / 3, f"the consumer loaded {late:.2f} s after the export: the test proves nothing"
    assert all_ones, "the consumer read before the producer's fill_ ran (no wait on the export event)"
    assert digest == want, "the consumer read before the producer's copy_ ran (no wait on the export event)"


# ----------------------------------------------------------------------------- several GPUs


def _export_on(device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = u.random_tensor((257, 3), torch.bfloat16, gen, device)
    y = u.random_tensor((64,), torch.int32, gen, "cuda:0")
    u.HELD["multi"] = {"x": x, "x.t": x.t(), "y": y}
    return torch_ipc.dumps(u.HELD["multi"]), u.fingerprint(u.HELD["multi"])


def _write_tensor(key: str, name: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    t = u.HELD[key][name]
    src = u.random_tensor(tuple(t.shape), t.dtype, gen, str(t.device))
    t.copy_(src)
    return u.bits(src)


def _tensor_bits(key: str, name: str):
    return u.bits(u.HELD[key][name])


def _tensor_device(key: str, name: str):
    return str(u.HELD[key][name].device)


def _uuids():
    out = []
    for i in range(torch.cuda.device_count()):
        s = str(torch.cuda.get_device_properties(i).uuid)
        out.append(s if s.startswith("GPU-") else "GPU-" + s)
    return out


@CUDA_ONLY
@pytest.mark.gpus(2)
def test_tensors_on_two_gpus_in_one_batch(pair, device):
    producer, consumer = pair
    data, expected = producer.call(_export_on, "cuda:1", u.new_seed())
    assert consumer.call(u.load, "multi", data) == expected
    assert consumer.call(_devices_of, "multi") == ["cuda:0", "cuda:1"]
    written = consumer.call(_write_tensor, "multi", "x", u.new_seed())
    assert producer.call(_tensor_bits, "multi", "x") == written


@CUDA_ONLY
@pytest.mark.gpus(2)
def test_consumer_that_sees_only_the_second_gpu(pair, device):
    """The descriptor names GPUs by UUID: a consumer whose CUDA_VISIBLE_DEVICES
    holds only the producer's cuda:1 finds it as its cuda:0; one that cannot see
    it raises DeviceNotFoundError."""
    producer, _ = pair
    uuids = producer.call(_uuids)
    data, expected = producer.call(_export_on, "cuda:1", u.new_seed())
    with Peer(timeout=180, env={"CUDA_VISIBLE_DEVICES": f"{uuids[1]},{uuids[0]}"}) as swapped:
        assert swapped.call(u.load, "multi", data) == expected
        # x lives on the producer's cuda:1, which is this process's cuda:0.
        assert swapped.call(_tensor_device, "multi", "x") == "cuda:0"
        assert swapped.call(_tensor_device, "multi", "y") == "cuda:1"
        written = swapped.call(_write_tensor, "multi", "x", u.new_seed())
        assert producer.call(_tensor_bits, "multi", "x") == written
    with Peer(timeout=180, env={"CUDA_VISIBLE_DEVICES": uuids[0]}) as blind:
        err = blind.call(u.try_load, data)
        assert err[0] == "DeviceNotFoundError", err


def _held_fingerprint(name: str):
    return u.fingerprint(u.HELD[name])


def _export_one_on(device: str, seed: int, consumers: int = 1):
    gen = torch.Generator().manual_seed(seed)
    u.HELD["one"] = {"x": u.random_tensor((1000,), torch.float32, gen, device)}
    return torch_ipc.dumps(u.HELD["one"], consumers=consumers), u.fingerprint(u.HELD["one"])


@CUDA_ONLY
@pytest.mark.gpus(2)
def test_reversed_indices_and_a_consumer_that_sees_only_the_second_gpu(pair, device):
    producer, _ = pair
    uuids = producer.call(_uuids)
    data, _ = producer.call(_export_one_on, "cuda:1", u.new_seed(), 2)  # one descriptor, two readers
    for visible in ("1,0", uuids[1]):  # reversed by index; only the second GPU, by UUID
        expected = producer.call(_held_fingerprint, "one")  # what the reader before wrote, too
        with Peer(timeout=180, env={"CUDA_VISIBLE_DEVICES": visible}) as consumer:
            assert consumer.call(u.load, "one", data) == expected, visible
            assert consumer.call(_tensor_device, "one", "x") == "cuda:0", visible
            written = consumer.call(_write_tensor, "one", "x", u.new_seed())
            assert producer.call(_tensor_bits, "one", "x") == written, visible


def _export_behind_slow_work_on_two_gpus(seed: int, n: int, seconds: float):
    """On each GPU: `seconds` of GPU work, then a write; export both at once (no sync)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, wants = {}, {}
    for device in ("cuda:0", "cuda:1"):
        src_host = u.random_tensor((n,), torch.float32, gen)
        wants[device] = u.digest(src_host)
        with torch.cuda.device(device):
            src = src_host.to(device)
            x = torch.zeros(n, device=device)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(u.gpu_cycles_per_second() * seconds))
            x.copy_(src)
        tensors[device] = x
    u.HELD["slow2"] = tensors
    data = torch_ipc.dumps(tensors)
    busy = all(not torch.cuda.current_stream(d).query() for d in tensors)
    return data, wants, busy


def _digests_after_load(data: bytes):
    obj = torch_ipc.loads(data)
    u.HELD["slow2"] = obj
    return {device: u.digest(t) for device, t in obj.items()}


@CUDA_ONLY
@pytest.mark.gpus(2)
def test_events_of_two_gpus_in_one_message(pair, device):
    """One message, tensors written behind slow work on two GPUs: the consumer's
    stream on each GPU waits on that GPU's export event."""
    producer, consumer = pair
    data, wants, busy = producer.call(_export_behind_slow_work_on_two_gpus, u.new_seed(), 4 << 20, 2.0)
    got = consumer.call(_digests_after_load, data)
    assert busy, "a producer stream had finished before the export: the test proves nothing"
    assert got == wants, "the consumer read a GPU's tensor before its write ran"
