"""Every public entry point that takes descriptor bytes loads them with the
allow-list (Note [weights_only] in torch_ipc/_weights_only.py): bytes whose
payload would run code are refused before it runs, whichever door they come
in by. The internal loads has no default: each caller says whom it trusts."""
import inspect

import pytest
from ipc_test_utils import crafted_descriptor
from test_weights_only_crafted import _global, _str

import torch_ipc
from torch_ipc import _serialize  # the internal loads
from torch_ipc.kv import SharedKVPool
from torch_ipc.mp.handles import rebuild_tensor

ENTRY_POINTS = {
    "torch_ipc.loads": torch_ipc.loads,
    "SharedKVPool.attach": SharedKVPool.attach,
    "reduce_tensor's rebuild": rebuild_tensor,
}


def _touch(path: str) -> str:
    with open(path, "w"):
        pass
    return "ran"


def _runs_code(marker: str, how: str) -> bytes:
    """A descriptor whose payload calls os.system, or a function of this module, to create ``marker``."""
    target = _global("os", "system") if how == "os.system" else _global(__name__, "_touch")
    arg = f"touch {marker}" if how == "os.system" else marker
    return crafted_descriptor(b"\x80\x02" + target + _str(arg) + b"\x85R.")


def _feed(name: str, data: bytes):
    """In a peer: hand ``data`` to the entry point ``name``; the exception's class names and message."""
    try:
        ENTRY_POINTS[name](data)
    except Exception as e:  # reported to the test
        return [c.__name__ for c in type(e).__mro__], str(e)
    return ["no exception"], ""


@pytest.mark.parametrize("how", ["os.system", "a function of the sender"])
@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_crafted_bytes_are_refused_by_every_entry_point(name, how, tmp_path, ipc_peer):
    marker = tmp_path / "ran"
    kinds, message = ipc_peer.call(_feed, name, _runs_code(str(marker), how))
    assert "WeightsOnlyError" in kinds, (kinds, message)
    assert "refused the global" in message
    assert not marker.exists(), "the payload ran"


def test_the_internal_loads_has_no_default_trust():
    assert inspect.signature(_serialize.loads).parameters["weights_only"].default is inspect.Parameter.empty
    assert inspect.signature(torch_ipc.loads).parameters["weights_only"].default is True


def _rebuild_then_load(data: bytes):
    """In a peer: rebuild_tensor() of a descriptor of no bare tensor, then loads() of the same bytes."""
    try:
        rebuild_tensor(data)
        refused = None
    except torch_ipc.DescriptorError as e:
        refused = str(e)
    return refused, torch_ipc.loads(data)["w"].tolist()


def test_a_refused_rebuild_spends_nothing_at_the_producer(ipc_peer):
    # A descriptor for one consumer: a refusal must leave it to that consumer.
    import torch

    x = torch.arange(4.0)
    refused, loaded = ipc_peer.call(_rebuild_then_load, torch_ipc.dumps({"w": x}))
    assert refused is not None and "reduce_tensor() handle holds a Tensor, this one a dict" in refused
    assert loaded == x.tolist()
