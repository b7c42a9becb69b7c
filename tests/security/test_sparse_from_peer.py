"""Sparse tensors a load builds are checked on private copies of their
indices (Note [sparse tensors from a peer] in torch_ipc/_weights_only.py): an
index out of bounds is refused with torch's message, never a crash later; a
producer that rewrites the indices in its shared memory after the load cannot
reach the consumer's tensor. The consumers are real other processes, so that a
crash shows as a failed test."""
import pytest
import torch
from ipc_test_utils import crafted_descriptor
from test_weights_only_crafted import _global, _str

import torch_ipc

_kept = {}


def _load_and_use(data: bytes, weights_only: bool = True):
    """In a peer: load, then use the tensor the way that crashes on bad indices."""
    try:
        t = torch_ipc.loads(data, weights_only=weights_only)
        return "loaded", t.to_dense().sum().item(), t.to_dense().to_sparse_csr().values().sum().item()
    except Exception as e:  # reported to the test
        return type(e).__name__, str(e), None


def _layout(name: str) -> bytes:
    return _global("torch.serialization", "_get_layout") + _str(name) + b"\x85R"


def _pid(i: int) -> bytes:
    return b"K\x00K" + bytes([i]) + b"\x86Q"


def _torch_sparse_payload(layout: str, n_parts: int, tensors) -> bytes:
    """REDUCE(torch._utils._rebuild_sparse_tensor, (layout, (tensor 0 .. n-1, (3, 3))))."""
    parts = b"(" + b"".join(_pid(i) for i in range(n_parts)) + b"K\x03K\x03\x86t"
    body = _global("torch._utils", "_rebuild_sparse_tensor") + _layout(layout) + parts + b"\x86R"
    return crafted_descriptor(b"\x80\x02" + body + b".", tensors)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_an_index_out_of_bounds_is_refused_not_a_crash(layout, ipc_peer):
    big = 10 ** 10
    if layout == "coo":
        data = _torch_sparse_payload("torch.sparse_coo", 2, [torch.tensor([[0], [big]]), torch.ones(1)])
    else:
        crow, col = torch.tensor([0, 1, 1, 1]), torch.tensor([big])
        data = _torch_sparse_payload("torch.sparse_csr", 3, [crow, col, torch.ones(1)])
    kind, message, _ = ipc_peer.call(_load_and_use, data)
    assert kind == "DescriptorError" and "indices that do not fit it" in message, message


def test_a_legacy_sparse_constructor_is_refused(ipc_peer):
    body = _global("torch.sparse", "FloatTensor") + b"(" + _pid(0) + _pid(1) + b"K\x03K\x03\x86tR"
    tensors = [torch.tensor([[0], [1]]), torch.ones(1)]
    data = crafted_descriptor(b"\x80\x02" + body + b".", tensors)
    kind, message, _ = ipc_peer.call(_load_and_use, data)
    assert kind == "WeightsOnlyError" and "legacy sparse" in message, message


def _load_and_keep(data: bytes, weights_only: bool):
    _kept["t"] = torch_ipc.loads(data, weights_only=weights_only)
    return _kept["t"].to_dense()


def _dense_of_kept():
    return _kept.pop("t").to_dense()


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_producer_that_rewrites_the_indices_after_the_load_cannot_reach_the_consumer(
        layout, weights_only, ipc_peer):
    dense = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
    s = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    data = torch_ipc.dumps(s)
    assert torch.equal(ipc_peer.call(_load_and_keep, data, weights_only), dense)
    # the producer rewrites the indices it shared (they sit in its shared memory)
    indices = s._indices() if layout == "coo" else s.col_indices()
    indices.fill_(10 ** 10)
    assert torch.equal(ipc_peer.call(_dense_of_kept), dense)
