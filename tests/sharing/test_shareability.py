"""One rule says which tensors torch_ipc exports itself (Note [one shareability
rule] in csrc/core/export.cpp): the fast paths and the pickler ask it before
export, and the exporter refuses what it rejects."""
import pytest
import torch

import torch_ipc
from torch_ipc import _C, _serialize


def _sparse_kinds():
    dense = torch.eye(3)
    return {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "meta": torch.empty(3, device="meta")}


def test_strided_tensors_with_memory_are_shared_natively_and_nothing_else():
    assert _C.shared_natively(torch.zeros(3))
    assert _C.shared_natively(torch.zeros(3, 4).t())  # any strides
    assert _C.shared_natively(torch.nn.Parameter(torch.zeros(2)))
    for name, t in _sparse_kinds().items():
        assert not _C.shared_natively(t), name
    assert _C.all_shared_natively([torch.zeros(1), torch.ones(2)])
    assert not _C.all_shared_natively([torch.zeros(1), _sparse_kinds()["coo"]])


@pytest.mark.parametrize("kind", ["coo", "csr", "meta"])
def test_the_exporter_refuses_what_the_rule_rejects(kind):
    t = _sparse_kinds()[kind]
    with pytest.raises(RuntimeError, match="torch_ipc exports strided tensors that have memory"):
        _C.export_tensors([t], [False], b"", 1)


def test_a_fast_shape_holding_a_sparse_tensor_is_pickled_up_front():
    x = torch.arange(4.0)
    tensors, _, payload = _serialize.split({"x": x})
    assert payload[:1] == b"D" and tensors[0] is x
    sparse = _sparse_kinds()["coo"]
    tensors, _, payload = _serialize.split({"x": x, "s": sparse})
    assert payload[:1] == b"P"
    # only what torch_ipc exports itself reaches the exporter: x and the sparse tensor's parts
    assert all(_C.shared_natively(t) for t in tensors) and any(t is x for t in tensors)
    back = torch_ipc.loads(torch_ipc.dumps({"x": x, "s": sparse}))
    assert back["s"].layout is torch.sparse_coo and torch.equal(back["s"].to_dense(), sparse.to_dense())
    back["x"][0] = 42.0  # the dense tensor is still shared, not copied
    assert x[0] == 42.0
