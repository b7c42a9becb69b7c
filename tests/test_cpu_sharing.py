"""CPU tensors through dumps/loads between spawned processes: exact values on
fresh random data, writes seen both ways, every view kind and dtype, nested
containers, parameters, and loads in the producer itself. No GPU needed."""
import collections
import gc

import pytest
import torch

import ipc_test_utils as u
import torch_ipc
from torch_ipc.testing import run_in_subprocess

VIEWS = [
    "full", "row_slice", "col_step", "transposed", "row", "element", "empty_slice",
    "expanded", "overlapping", "unsqueezed", "flat_window",
]  # fmt: skip


@pytest.fixture(scope="module")
def pair():
    """A producer and a consumer process for this module's tests."""
    with u.peer_pair(timeout=120) as (producer, consumer):
        yield producer, consumer


@pytest.fixture(autouse=True)
def _drop_between_tests(request):
    yield
    u.drop_pair_after(request)


# ----------------------------------------------------------------------------- child functions


def _export_views(seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch = {}
    for dtype in u.dtypes():
        batch[u.dtype_name(dtype)] = u.views_of(u.random_tensor((7, 12), dtype, gen))
    batch["other"] = {
        "empty": torch.empty(0),
        "empty_2d": torch.empty(3, 0, dtype=torch.int16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "permuted_3d": u.random_tensor((4, 5, 6), torch.float32, gen).permute(2, 0, 1)[1:, ::2],
        "offset_into_big": u.random_tensor((1000,), torch.int32, gen)[997:],
    }
    u.HELD["views"] = batch
    return torch_ipc.dumps(batch), u.fingerprint(batch), u.storage_groups(batch)


def _dtypes_here():
    return [u.dtype_name(d) for d in u.dtypes()]


# ----------------------------------------------------------------------------- tests


def test_every_dtype_and_view_exact(pair):
    producer, consumer = pair
    seed = u.new_seed()
    data, expected, groups = producer.call(_export_views, seed)
    got = consumer.call(u.load, "views", data)
    names = producer.call(_dtypes_here)
    for want_dtype in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                       "float32", "float64", "complex64", "complex128"):  # fmt: skip
        assert want_dtype in names, f"{want_dtype} missing from the dtypes under test"
    assert len(got[1]) == len(expected[1])
    for (name, want), (got_name, have) in zip(expected[1], got[1]):
        assert got_name == name
        assert have == want, f"{name}: the consumer sees other values or metadata (seed {seed})"
    # Views of one storage still share one storage in the consumer.
    assert consumer.call(u.held_groups, "views") == groups


@pytest.mark.parametrize("view", u.WRITABLE)
def test_writes_are_seen_both_ways(pair, view):
    producer, consumer = pair
    seed = u.new_seed()
    data, before, _ = producer.call(_export_views, seed)
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


def test_loads_in_the_producer_returns_the_same_memory():
    assert run_in_subprocess(_same_process, u.new_seed(), timeout=120) == []


def _export_big(seed: int, n: int):
    gen = torch.Generator().manual_seed(seed)
    x = u.random_tensor((n,), torch.float32, gen)
    u.HELD["big"] = x
    return torch_ipc.dumps(x), u.digest(x)


def _digest_of(key: str):
    return u.digest(u.HELD[key])


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


def test_consumers_must_be_positive():
    with pytest.raises(ValueError):
        torch_ipc.dumps(torch.zeros(1), consumers=0)
