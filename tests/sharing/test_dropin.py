"""torch_ipc as a drop-in for programs written for torch.multiprocessing:
relays that never called init_reductions(), spawned children that inherit
it, torch's pickling rules (non-leaf refusal, meta, sparse, storages, events)
and a Client with multiprocessing's signature. Fork-started workers
(DataLoader, Pool, mp.Process): test_fork.py; descriptors any number of
readers load (consumers=None): test_lifetime.py.

CPU everywhere; the ``cuda`` params and tests run where there is a GPU.
"""
import inspect
import multiprocessing as mp
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc import _C
from torch_ipc.testing import Peer

TIMEOUT = 120
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


# ----------------------------------------------------------------------------- relays and spawned children


def _relay_through_forking_pickler(d):
    """What a relay's own Queue/Pipe does with what it received, without init_reductions()."""
    assert torch_ipc.mp._reductions._saved is None  # reductions not on here
    y = torch_ipc.loads(d)
    u.HELD["relayed"] = y
    own = torch.arange(3.0, device=y.device)
    return bytes(ForkingPickler.dumps(y)), bytes(ForkingPickler.dumps(own))


def _unpickle_and_write(key, data):
    y = pickle.loads(data)
    u.HELD[key] = y
    y.fill_(5)
    if y.is_cuda:
        torch.cuda.synchronize()
    return _C.is_torch_ipc_storage(y)


@pytest.mark.parametrize("device", DEVICES)
def test_relay_without_init_reductions_forwards_through_torch_ipc(device):
    x = torch.zeros(32, device=device)
    d = torch_ipc.dumps(x)
    with Peer(timeout=TIMEOUT) as relay, Peer(timeout=TIMEOUT) as third:
        forwarded, own = relay.call(_relay_through_forking_pickler, d)
        assert b"torch_ipc" in forwarded and b"torch.multiprocessing" not in forwarded
        assert b"torch_ipc" not in own, "a tensor torch_ipc does not own must go through torch"
        assert third.call(_unpickle_and_write, "y", forwarded)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(x, torch.full_like(x, 5))


def _reductions_are_on(queue):
    queue.put(torch_ipc.mp._reductions._saved is not None)


def test_spawned_children_inherit_init_reductions():
    ctx = mp.get_context("spawn")
    with torch_ipc.reductions():
        queue = ctx.Queue()
        with u.running(ctx.Process(target=_reductions_are_on, args=(queue,))):
            on = queue.get(timeout=TIMEOUT)
    assert on is True
    assert "torch_ipc.reductions" not in mp.current_process()._config  # restored


def _share_memory_and_write(queue, done):
    x = queue.get(timeout=TIMEOUT)
    shared_before = x.is_shared()
    x.share_memory_()  # as code that makes sure does; torch moved anything not in its own segment
    x.fill_(9.0)
    done.put(shared_before)


def test_share_memory_on_a_received_tensor_keeps_the_senders_memory():
    # Note [torch never sees our storages] in torch_ipc/mp/_reductions.py.
    ctx = mp.get_context("fork")
    with torch_ipc.reductions():
        queue, done = ctx.Queue(), ctx.Queue()
        x = torch.zeros(4)
        with u.running(ctx.Process(target=_share_memory_and_write, args=(queue, done))):
            queue.put(x)
            shared_there = done.get(timeout=TIMEOUT)
    assert x.tolist() == [9.0] * 4, "share_memory_() moved the received tensor away from the sender's memory"
    assert shared_there and x.is_shared()  # as stock torch says of both ends
    assert torch.zeros(2).is_shared() is False  # torch's own answer for the rest


class _CachedRows(torch.utils.data.Dataset):
    """A cache in torch's shared memory, made before the workers fork, filled by them."""

    def __init__(self, n):
        self.cache = torch.zeros(n, 4).share_memory_()

    def __len__(self):
        return len(self.cache)

    def __getitem__(self, i):
        self.cache[i] = float(i)
        return self.cache[i]  # a view of the cache, sent back through the result queue


def test_a_shared_cache_filled_by_forked_dataloader_workers_reaches_the_main_process():
    # Note [torch's shared memory through multiprocessing] in torch_ipc/_serialize.py:
    # sending a view of the cache moved it away from the memory the main process maps.
    ds = _CachedRows(16)
    with torch_ipc.reductions():
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork",
                                             timeout=TIMEOUT)
        for epoch in range(2):
            assert sum(float(x.sum()) for x in loader) == sum(4.0 * i for i in range(16)), epoch
    assert ds.cache[:, 0].tolist() == [float(i) for i in range(16)], "the workers' fills never reached the cache"


class _MyTensor(torch.Tensor):
    pass


def _write_what_arrives(queue, done):
    sub, nested = queue.get(timeout=TIMEOUT)
    sub.fill_(7.0)
    done.put((type(sub).__name__, [t.tolist() for t in nested.unbind()]))


def test_subclasses_and_nested_tensors_arrive_as_torch_sends_them():
    # Note [tensors torch_ipc does not share itself]: a subclass by its own
    # __reduce_ex__ on shared storage, a nested tensor by torch's reducer.
    ctx = mp.get_context("fork")
    with torch_ipc.reductions():
        queue, done = ctx.Queue(), ctx.Queue()
        sub = torch.zeros(3).as_subclass(_MyTensor)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
        with u.running(ctx.Process(target=_write_what_arrives, args=(queue, done))):
            queue.put((sub, nested))
            kind, parts = done.get(timeout=TIMEOUT)
    assert kind == "_MyTensor" and parts == [[1.0, 1.0], [0.0, 1.0, 2.0]]
    assert sub.tolist() == [7.0] * 3, "the subclass arrived as a copy"


# ----------------------------------------------------------------------------- torch's pickling rules


NON_LEAF = "Cowardly refusing to serialize non-leaf tensor which requires_grad"


@pytest.mark.parametrize("device", DEVICES)
def test_non_leaf_requiring_grad_is_refused_with_torchs_message(device):
    x = torch.ones(3, device=device, requires_grad=True)
    y = x * 2
    exports_before = torch_ipc.stats()["exports"]
    for obj in (y, {"y": y}, [1, y], {"meta": torch.empty(2, device="meta"), "y": y}):
        with pytest.raises(RuntimeError, match=NON_LEAF):
            torch_ipc.dumps(obj)
    with torch_ipc.reductions(), pytest.raises(RuntimeError, match=NON_LEAF):
        ForkingPickler.dumps((0, y))
    assert torch_ipc.stats()["exports"] == exports_before, "a refused message left an export"
    torch_ipc.loads(torch_ipc.dumps(y.detach()))  # detached, it goes


def test_meta_tensors_travel_as_their_shape():
    m = torch.empty(3, 4, device="meta", dtype=torch.float16).t()
    w = torch.nn.Parameter(torch.empty(5, device="meta"))
    for obj in (m, {"m": m, "cpu": torch.ones(2)}, [w, m]):
        back = torch_ipc.loads(torch_ipc.dumps(obj))
        got = back if isinstance(back, torch.Tensor) else (back["m"] if isinstance(back, dict) else back[1])
        assert got.is_meta and got.shape == (4, 3) and got.stride() == (1, 4) and got.dtype == torch.float16
    back = torch_ipc.loads(torch_ipc.dumps([w, m]))
    assert type(back[0]) is torch.nn.Parameter and back[0].requires_grad and back[0].is_meta


def _sparse_cases(device):
    dense = torch.zeros(4, 6, device=device)
    dense[0, 1], dense[2, 3], dense[3, 5] = 1.5, -2.0, 7.0
    cases = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc()}
    if device == "cpu":  # blocked layouts: where torch converts to them everywhere
        cases.update(bsr=dense.to_sparse_bsr((2, 2)), bsc=dense.to_sparse_bsc((2, 3)))
    return cases


def _sparse_summary(key, data):
    obj = torch_ipc.loads(data)
    u.HELD[key] = obj
    return {name: (str(t.layout), t.to_dense().cpu().tolist()) for name, t in obj.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_tensors_arrive_in_their_layout(device, ipc_peer):
    cases = _sparse_cases(device)
    got = ipc_peer.call(_sparse_summary, "s", torch_ipc.dumps(cases))
    assert got == {name: (str(t.layout), t.to_dense().cpu().tolist()) for name, t in cases.items()}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no mkldnn")
def test_a_layout_that_cannot_be_shared_is_named():
    with pytest.raises(TypeError, match="_mkldnn"):
        torch_ipc.dumps({"x": torch.randn(2, 2).to_mkldnn()})


def _write_storage(key, data, value):
    s = torch_ipc.loads(data)
    u.HELD[key] = s
    untyped = s._untyped_storage if isinstance(s, torch.TypedStorage) else s
    torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped).fill_(value)
    if untyped.is_cuda:
        torch.cuda.synchronize()
    return type(s).__name__, getattr(s, "dtype", None) and str(s.dtype), untyped.nbytes()


@pytest.mark.parametrize("device", DEVICES)
def test_typed_and_untyped_storages_share_memory(device, ipc_peer):
    x = torch.zeros(10, dtype=torch.int16, device=device)
    got = ipc_peer.call(_write_storage, "typed", torch_ipc.dumps(x._typed_storage()), 1)
    assert got == ("TypedStorage", "torch.int16", 20)
    assert torch.equal(x, torch.full_like(x, 0x0101))
    got = ipc_peer.call(_write_storage, "untyped", torch_ipc.dumps(x.untyped_storage()), 2)
    assert got == ("UntypedStorage", None, 20)
    assert torch.equal(x, torch.full_like(x, 0x0202))


def test_objects_without_tensors_pickle_as_before():
    plain = {"a": [1, 2.5, "x"], "b": (None, b"bytes")}
    before = bytes(ForkingPickler.dumps(plain))
    with torch_ipc.reductions():
        assert bytes(ForkingPickler.dumps(plain)) == before


def _event_round_trip(data):
    event = pickle.loads(data)
    return type(event).__name__, event.query()


@pytest.mark.cuda
def test_cuda_events_pickle_as_torch_pickles_them(ipc_peer):
    event = torch.cuda.Event(interprocess=True)
    event.record()
    with torch_ipc.reductions():
        data = bytes(ForkingPickler.dumps(event))
    assert b"torch.multiprocessing" in data
    torch.cuda.synchronize()
    assert ipc_peer.call(_event_round_trip, data) == ("Event", True)


# ----------------------------------------------------------------------------- Client


def _serve_one(address, authkey):
    with torch_ipc.Listener(address, authkey=authkey) as listener:
        with listener.accept() as conn:
            x = conn.recv()
            x.add_(1)
            conn.send("done")
    return True


def test_client_has_the_signature_of_multiprocessing_client(tmp_path, ipc_peer):
    from multiprocessing import connection as mpc

    assert list(inspect.signature(torch_ipc.Client).parameters) == list(inspect.signature(mpc.Client).parameters)
    with pytest.raises(TypeError, match="authkey"):
        torch_ipc.Client(str(tmp_path / "nowhere"))
    address, authkey = str(tmp_path / "sock"), b"key"
    ipc_peer.start_call(_serve_one, address, authkey)
    assert u.collect_until(lambda: os.path.exists(address))
    x = torch.zeros(4)
    with torch_ipc.Client(address, "AF_UNIX", authkey) as conn:
        conn.send(x)
        assert conn.recv() == "done"
    assert ipc_peer.result(TIMEOUT) is True
    assert torch.equal(x, torch.ones(4))
    assert torch_ipc.connect is not None and torch_ipc.listen is not None  # kept as aliases
