"""``loads(data, weights_only=...)`` with torch.load's meaning (Note
[weights_only] in torch_ipc/_serialize.py): by default the payload is
unpickled with torch.load(weights_only=True)'s allow-list, and anything else
is refused with pickle.UnpicklingError before it runs; the load spends
nothing then. Tensors in any container, Parameters, dtypes, devices and
sizes load as before."""
import os
import pickle
from collections import OrderedDict

import pytest
import torch

import torch_ipc
from torch_ipc import WeightsOnlyError


def _touch(path: str) -> str:
    with open(path, "w"):
        pass
    return "ran"


class _RunsCode:
    """Pickles as a call that creates a marker file."""

    def __init__(self, path: str, how: str):
        self.path, self.how = path, how

    def __reduce__(self):
        if self.how == "os.system":
            return (os.system, (f"touch {self.path}",))
        return (_touch, (self.path,))


class _Allowed:
    def __init__(self, n=0):
        self.n = n


def _try_loads(data: bytes):
    """In a peer: the default load; the exception's types and message, or the object's type."""
    try:
        obj = torch_ipc.loads(data)
    except Exception as e:  # reported to the test, which decides
        return [c.__name__ for c in type(e).__mro__], str(e)
    return type(obj).__name__, ""


@pytest.mark.parametrize("how", ["os.system", "a function of the sender"])
def test_payload_that_would_run_code_is_refused_before_it_runs(tmp_path, how, ipc_peer):
    marker = tmp_path / "ran"
    x = torch.zeros(3)
    data = torch_ipc.dumps({"w": x, "evil": _RunsCode(str(marker), how)})

    kinds, message = ipc_peer.call(_try_loads, data)  # another process, the default
    assert "UnpicklingError" in kinds and "WeightsOnlyError" in kinds, message
    assert "refused the global" in message and "weights_only=False" in message
    with pytest.raises(pickle.UnpicklingError, match="refused the global"):
        torch_ipc.loads(data, weights_only=True)
    assert not marker.exists(), "the payload ran"

    # the refused loads spent nothing: a trusted load (one consumer) still gets in, and runs it
    out = torch_ipc.loads(data, weights_only=False)
    assert out["w"].data_ptr() == x.data_ptr()
    assert marker.exists()


def test_state_dicts_with_nested_containers_and_parameters_load():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    param = torch.nn.Parameter(torch.ones(2))
    obj = {
        "model": model.state_dict(),
        "optimizer": {"step": 3, "lr": 1e-3, "betas": (0.9, 0.99), "groups": [{"params": [0, 1]}]},
        "param": param,
        "kinds": [torch.bfloat16, torch.device("cpu"), torch.Size([2, 3])],
        "misc": (None, True, b"raw", bytearray(b"ba"), 1 + 2j, {"a", "b"}, frozenset({1})),
        "ordered": OrderedDict(b=torch.arange(2), a=torch.arange(3)),
        "sparse": torch.eye(3).to_sparse(),
        "meta": torch.empty(4, device="meta"),
    }
    out = torch_ipc.loads(torch_ipc.dumps(obj), weights_only=True)
    for k, v in model.state_dict().items():
        assert out["model"][k].data_ptr() == v.data_ptr(), k
    assert out["model"]._metadata == model.state_dict()._metadata
    assert type(out["param"]) is torch.nn.Parameter and out["param"].data_ptr() == param.data_ptr()
    assert out["optimizer"] == obj["optimizer"]
    assert out["kinds"] == obj["kinds"] and out["misc"] == obj["misc"]
    assert type(out["ordered"]) is OrderedDict and list(out["ordered"]) == ["b", "a"]
    assert torch.equal(out["sparse"].to_dense(), torch.eye(3))
    assert out["meta"].is_meta and out["meta"].shape == (4,)


def test_the_fast_shapes_load_with_weights_only():
    sd = {"a": torch.zeros(2), "b": torch.ones(3)}
    assert torch_ipc.loads(torch_ipc.dumps(sd))["b"].data_ptr() == sd["b"].data_ptr()
    assert len(torch_ipc.loads(torch_ipc.dumps([sd["a"], sd["b"]]))) == 2


def test_safe_globals_torch_allows_load_too():
    data = torch_ipc.dumps({"w": torch.zeros(1), "cfg": _Allowed(4)}, consumers=2)
    with pytest.raises(WeightsOnlyError, match="_Allowed"):
        torch_ipc.loads(data)
    with torch.serialization.safe_globals([_Allowed]):
        assert torch_ipc.loads(data)["cfg"].n == 4


def test_the_default_is_weights_only_and_the_reductions_keep_full_pickle():
    import inspect

    assert inspect.signature(torch_ipc.loads).parameters["weights_only"].default is True
    with torch_ipc.reductions():
        from multiprocessing.reduction import ForkingPickler

        data = ForkingPickler.dumps({"w": torch.zeros(1), "cfg": _Allowed(5)})
    assert pickle.loads(data)["cfg"].n == 5  # multiprocessing's own channels trust their peer
