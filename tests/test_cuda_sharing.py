"""CUDA tensors through dumps/loads between spawned processes: every dtype and
view exact, writes seen both ways, stream ordering at export, containers and
parameters, mixed CPU/CUDA batches, and GPUs beyond the first.

Needs a CUDA GPU (skipped otherwise); the gpus(2) tests need two.
"""
import time

import pytest
import torch

import ipc_test_utils as u
import torch_ipc
from torch_ipc.testing import Peer

pytestmark = pytest.mark.cuda

REQUIRED_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "complex64", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip


@pytest.fixture(scope="module")
def pair():
    with u.peer_pair(timeout=180, names=("cuda-producer", "cuda-consumer"), init=_init_cuda) as (producer, consumer):
        yield producer, consumer


@pytest.fixture(autouse=True)
def _drop_between_tests(request):
    yield
    u.drop_pair_after(request)


# ----------------------------------------------------------------------------- child functions


def _init_cuda():
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    return torch.cuda.device_count()


def _export_views(seed: int, device: str = "cuda"):
    gen = torch.Generator().manual_seed(seed)
    batch = {}
    for dtype in u.dtypes(device):
        batch[u.dtype_name(dtype)] = u.views_of(u.random_tensor((7, 12), dtype, gen, device))
    batch["other"] = {
        "empty": torch.empty(0, device=device),
        "empty_2d": torch.empty(3, 0, dtype=torch.int16, device=device),
        "scalar": torch.tensor(3.5, dtype=torch.float64, device=device),
        "permuted_3d": u.random_tensor((4, 5, 6), torch.float32, gen, device).permute(2, 0, 1)[1:, ::2],
        # Carved by the caching allocator out of one segment with others: the
        # storage sits at an offset inside the shared base allocation.
        "offset_into_big": u.random_tensor((1000,), torch.int32, gen, device)[997:],
        "small_neighbour": u.random_tensor((3,), torch.float32, gen, device),
    }
    u.HELD["views"] = batch
    return torch_ipc.dumps(batch), u.fingerprint(batch), u.storage_groups(batch), [u.dtype_name(d) for d in u.dtypes(device)]


def _devices_of(key: str):
    return sorted({str(t.device) for t in u.tensors_in(u.HELD[key])})


# ----------------------------------------------------------------------------- tests


def test_every_dtype_and_view_exact(pair):
    producer, consumer = pair
    seed = u.new_seed()
    data, expected, groups, names = producer.call(_export_views, seed)
    for name in REQUIRED_DTYPES:
        assert name in names, f"{name} missing from the CUDA dtypes under test"
    got = consumer.call(u.load, "views", data)
    for (name, want), (got_name, have) in zip(expected[1], got[1]):
        assert got_name == name
        assert have == want, f"{name}: the consumer sees other values or metadata (seed {seed})"
    assert len(got[1]) == len(expected[1])
    assert consumer.call(u.held_groups, "views") == groups
    assert consumer.call(_devices_of, "views") == ["cuda:0"]


@pytest.mark.parametrize("view", u.WRITABLE)
def test_writes_are_seen_both_ways(pair, view):
    producer, consumer = pair
    seed = u.new_seed()
    data, before, _, _ = producer.call(_export_views, seed)
    consumer.call(u.load_quietly, "views", data)
    written = consumer.call(u.write_views, "views", view, seed + 1)
    assert producer.call(u.view_bits, "views", view) == written, f"seed {seed}"
    after = producer.call(u.held_fingerprint, "views")
    assert after != before and consumer.call(u.held_fingerprint, "views") == after
    written = producer.call(u.write_views, "views", view, seed + 2)
    assert consumer.call(u.view_bits, "views", view) == written, f"seed {seed}"
    assert consumer.call(u.held_fingerprint, "views") == producer.call(u.held_fingerprint, "views")


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


def test_consumer_sees_writes_queued_before_export(pair):
    producer, consumer = pair
    seconds = 3.0
    data, want, busy, exported_at = producer.call(_export_behind_slow_work, u.new_seed(), 16 << 20, seconds)
    digest, all_ones, started_at = consumer.call(_read_after_load, data)
    assert busy, "the producer's stream had finished before the export: the test proves nothing"
    late = started_at - exported_at
    assert late < seconds / 3, f"the consumer loaded {late:.2f} s after the export: the test proves nothing"
    assert all_ones, "the consumer read before the producer's fill_ ran (no wait on the export event)"
    assert digest == want, "the consumer read before the producer's copy_ ran (no wait on the export event)"


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


def test_modules_parameters_and_mixed_devices(pair):
    producer, consumer = pair
    data, expected = producer.call(_export_modules, u.new_seed())
    assert consumer.call(u.load, "modules", data) == expected
    devices, frozen_type, frozen_grad, weight = consumer.call(_use_model, "modules")
    assert devices == ["cpu", "cuda:0", "cuda:0"]
    assert frozen_type == "Parameter" and frozen_grad is False
    # The consumer's in-place update reaches the producer's module and its state_dict.
    assert producer.call(_weight_bits, "modules") == (weight, weight)


# ----------------------------------------------------------------------------- several GPUs


def _export_on(device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = u.random_tensor((257, 3), torch.bfloat16, gen, device)
    y = u.random_tensor((64,), torch.int32, gen, "cuda:0")
    u.HELD["multi"] = {"x": x, "x.t": x.t(), "y": y}
    return torch_ipc.dumps(u.HELD["multi"]), u.fingerprint(u.HELD["multi"])


@pytest.mark.gpus(2)
def test_tensors_on_two_gpus_in_one_batch(pair):
    producer, consumer = pair
    data, expected = producer.call(_export_on, "cuda:1", u.new_seed())
    assert consumer.call(u.load, "multi", data) == expected
    assert consumer.call(_devices_of, "multi") == ["cuda:0", "cuda:1"]
    written = consumer.call(_write_tensor, "multi", "x", u.new_seed())
    assert producer.call(_tensor_bits, "multi", "x") == written


def _write_tensor(key: str, name: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    t = u.HELD[key][name]
    src = u.random_tensor(tuple(t.shape), t.dtype, gen, str(t.device))
    t.copy_(src)
    return u.bits(src)


def _tensor_bits(key: str, name: str):
    return u.bits(u.HELD[key][name])


def _uuids():
    out = []
    for i in range(torch.cuda.device_count()):
        s = str(torch.cuda.get_device_properties(i).uuid)
        out.append(s if s.startswith("GPU-") else "GPU-" + s)
    return out


@pytest.mark.gpus(2)
def test_consumer_that_sees_only_the_second_gpu(pair):
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


def _tensor_device(key: str, name: str):
    return str(u.HELD[key][name].device)

