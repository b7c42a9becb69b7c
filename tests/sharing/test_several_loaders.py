"""One payload, several loaders: what a ForkingPickler instance pickled
(SGLang's MultiprocessingSerializer) and a ``torch_ipc.reduce_tensor`` handle
(vLLM's and verl's ``(func, args)``) load in any number of processes while
the producer references the tensors, and once after it dropped them (Note
[one payload, several loaders] in torch_ipc/mp/_reductions.py); a message of
``ForkingPickler.dumps`` (Queue, Pipe) keeps its counted lifetime.

CPU everywhere; the ``cuda`` params and tests run where there is a GPU.
"""
import contextlib
import gc
import io
import pickle
import time
from multiprocessing.reduction import ForkingPickler

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc import _C, _serialize
from torch_ipc.mp import _reductions
from torch_ipc.testing import run_in_subprocess

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
SPAWN = {"TORCH_IPC_TEST_SPAWNED": "1"}  # an env= makes run_in_subprocess spawn a fresh interpreter


_wait = u.collect_until


def _settled_exports() -> int:
    """This process's live exports, once what earlier tests left is reclaimed."""
    counts = []
    while len(counts) < 3 or len(set(counts[-3:])) > 1:
        gc.collect()
        torch_ipc.collect()
        counts.append(torch_ipc.stats()["exports"])
        time.sleep(0.05)
    return counts[-1]


def _holders() -> int:
    s = torch_ipc.stats()
    return s["holders"] - s["dead_holders"]


@contextlib.contextmanager
def _without_reductions():
    was_on = _reductions._saved is not None
    torch_ipc.restore_reductions()
    try:
        yield
    finally:
        if was_on:
            torch_ipc.init_reductions()


def _ours(x: torch.Tensor) -> torch.Tensor:
    """x, moved into torch_ipc's shared memory (so a relay's guarded reducer
    sends it through torch_ipc), with nothing left exported."""
    export = _serialize.export_object(x)
    export.revoke()
    assert _wait(lambda: not export.live)
    return x


def _instance_pickle(obj) -> bytes:
    """SGLang's MultiprocessingSerializer.serialize, without its base64."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


# ---------------------------------------------------------------- run in the peers

def _load_write_release(data: bytes, index: int) -> None:
    """SGLang's deserialize (ForkingPickler.loads), a write, then let go."""
    w = ForkingPickler.loads(data)["w"]
    w[index] = index + 1
    if w.is_cuda:
        torch.cuda.synchronize()
    del w
    gc.collect()
    torch_ipc.collect()


def _try_instance_load(data: bytes):
    try:
        w = ForkingPickler.loads(data)["w"]
    except Exception as e:  # reported to the test, which decides
        return type(e).__name__
    values = w.cpu().tolist()
    del w
    gc.collect()
    torch_ipc.collect()
    return values


def _rebuild_write(pair: bytes, value: float) -> str:
    """What vLLM's worker does with a reduce_tensor pair: func(*args), here
    without rewriting args[6]."""
    func, args = pickle.loads(pair)
    t = func(*args)
    t.fill_(value)
    if t.is_cuda:
        torch.cuda.synchronize()
    return str(t.device)


# ---------------------------------------------------------------- ForkingPickler instances

@pytest.mark.parametrize("device", DEVICES)
def test_instance_pickle_loads_in_two_processes_at_different_times(device, ipc_peers):
    x = torch.zeros(4, device=device)
    with torch_ipc.reductions():
        data = _instance_pickle({"w": x})
    ipc_peers.get("a").call(_load_write_release, data, 0)
    assert _wait(lambda: _holders() == 0), "the first loader did not release"
    time.sleep(0.1)  # collector rounds in which a counted export would be reclaimed
    torch_ipc.collect()
    ipc_peers.get("b").call(_load_write_release, data, 1)  # torch lets a second rank load it too
    ipc_peers.get("a").call(_load_write_release, data, 2)  # and the first one again
    assert x.cpu().tolist() == [1.0, 2.0, 3.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_instance_pickle_loads_once_after_the_producer_dropped(device, ipc_peers):
    before = _settled_exports()
    with torch_ipc.reductions():
        data = _instance_pickle({"w": torch.full((4,), 7.0, device=device)})  # a temporary
    gc.collect()
    torch_ipc.collect()
    assert torch_ipc.stats()["exports"] == before + 1, "reclaimed before its first load"
    assert ipc_peers.get("a").call(_try_instance_load, data) == [7.0] * 4
    assert _wait(lambda: torch_ipc.stats()["exports"] == before), "not reclaimed after its load"
    assert ipc_peers.get("b").call(_try_instance_load, data) == "ReleasedError"


@pytest.mark.parametrize("reductions_on", [True, False], ids=["init_reductions", "relay"])
def test_queue_message_keeps_its_counted_lifetime(reductions_on, ipc_peers):
    x = _ours(torch.zeros(4))
    assert _C.is_torch_ipc_storage(x)
    before = _settled_exports()
    if reductions_on:
        with torch_ipc.reductions():
            data = bytes(ForkingPickler.dumps({"w": x}))
    else:
        with _without_reductions():
            data = bytes(ForkingPickler.dumps({"w": x}))  # the per-type reducer, inside a message
    assert torch_ipc.stats()["exports"] == before + 1
    ipc_peers.get("a").call(_load_write_release, data, 0)
    assert _wait(lambda: torch_ipc.stats()["exports"] == before), "a message loaded once was not reclaimed"
    assert x.tolist() == [1.0, 0.0, 0.0, 0.0]  # although the producer still holds x
    assert ipc_peers.get("b").call(_try_instance_load, data) == "ReleasedError"


def test_instance_pickle_without_init_reductions_lets_many_load(ipc_peers):
    x = _ours(torch.zeros(4))
    with _without_reductions():
        data = _instance_pickle({"w": x})
    for i, name in enumerate(("a", "b", "a")):
        ipc_peers.get(name).call(_load_write_release, data, i)
        assert _wait(lambda: _holders() == 0)
    assert x.tolist() == [1.0, 2.0, 3.0, 0.0]


# ---------------------------------------------------------------- reduce_tensor

@pytest.mark.parametrize("device", DEVICES)
def test_reduce_tensor_pair_plain_pickles_and_rebuilds_the_same_memory(device, ipc_peers):
    x = torch.zeros(4, device=device)
    pair = pickle.dumps(torch_ipc.reduce_tensor(x))  # plain pickle, as ZMQ and Ray send it
    assert run_in_subprocess(_rebuild_write, pair, 3.0, env=SPAWN, timeout=180) == str(x.device)
    assert x.cpu().tolist() == [3.0] * 4
    assert _wait(lambda: _holders() == 0)
    ipc_peers.get("a").call(_rebuild_write, pair, 4.0)  # every tensor-parallel worker rebuilds it
    assert x.cpu().tolist() == [4.0] * 4


def test_reduce_tensor_refuses_what_is_not_a_tensor():
    with pytest.raises(TypeError, match="takes a tensor"):
        torch_ipc.reduce_tensor(torch.zeros(2).untyped_storage())


def _visible_uuid(index: int) -> str:
    s = str(torch.cuda.get_device_properties(index).uuid)
    return s if s.startswith("GPU-") else "GPU-" + s


@pytest.mark.cuda
def test_reduce_tensor_finds_the_gpu_by_uuid_under_another_cuda_visible_devices():
    index = torch.cuda.device_count() - 1  # on several GPUs, not the child's cuda:0 by ordinal
    x = torch.zeros(1 << 16, device=f"cuda:{index}")
    pair = pickle.dumps(torch_ipc.reduce_tensor(x))
    env = {"CUDA_VISIBLE_DEVICES": _visible_uuid(index)}
    assert run_in_subprocess(_rebuild_write, pair, 5.0, env=env, timeout=180) == "cuda:0"
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 5.0))
