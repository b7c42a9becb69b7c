"""Crafted payloads against ``loads(weights_only=True)`` (Note [weights_only]
and Note [where an object comes from] in torch_ipc/_weights_only.py): a
payload may not change an object it did not make (an allow-listed global, a
tensor of the descriptor, which is the producer's memory), may not build a
sparse tensor on unchecked indices, and may not make the unpickler size its
memo beyond the payload. Each is refused with WeightsOnlyError (or a
DescriptorError naming torch's check), and nothing changed; what torch.save
and dumps write still loads."""
import copyreg
import dataclasses
import io
import struct
from collections import OrderedDict

import pytest
import torch
from ipc_test_utils import crafted_descriptor

import torch_ipc
from torch_ipc import WeightsOnlyError

_PROTO2 = b"\x80\x02"


class _Log:
    """An allow-listed global with an ``append``: what APPEND(S) on a non-list calls."""

    def __init__(self):
        self.items = []

    def append(self, item):
        self.items.append(item)

    def extend(self, items):
        self.items.extend(items)


_GLOBAL_LOG = _Log()


def _crafted(body: bytes, tensors=()) -> bytes:
    """A real descriptor of ``tensors`` whose payload is the pickle ``body`` (protocol 2, STOP added)."""
    return crafted_descriptor(_PROTO2 + body + b".", tensors)


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


_TENSOR0 = b"K\x00K\x00\x86Q"  # BINPERSID (kind tensor, index 0)
_FLOAT_STORAGE0 = b"K\x02K\x00" + _global("torch", "float32") + b"\x87Q"  # a TypedStorage of tensor 0
_EMPTY_ORDERED_DICT = _global("collections", "OrderedDict") + b")R"
_VIEW_OF_TENSOR0 = (_global("torch._utils", "_rebuild_tensor_v2") + b"(" + _FLOAT_STORAGE0 + b"K\x00K\x04\x85K\x01\x85"
                    + b"\x89" + _EMPTY_ORDERED_DICT + b"tR")  # a new tensor on tensor 0's storage


def _try_loads(data: bytes):
    """In a peer: what loads(data) did: the exception's class names and message, or the object's type."""
    try:
        obj = torch_ipc.loads(data)
    except Exception as e:  # reported to the test, which decides
        return [c.__name__ for c in type(e).__mro__], str(e)
    return [type(obj).__name__], ""


@pytest.fixture
def rebuild_function_untouched():
    fn = torch._utils._rebuild_tensor_v2
    defaults, attrs = fn.__defaults__, dict(fn.__dict__)
    yield fn
    changed = (fn.__defaults__, dict(fn.__dict__)) != (defaults, attrs)
    fn.__defaults__ = defaults
    fn.__dict__.clear()
    fn.__dict__.update(attrs)
    assert not changed, "the payload changed torch._utils._rebuild_tensor_v2"


@pytest.mark.parametrize("state", [
    b"N}" + _str("__defaults__") + b"K\x05\x85s\x86",  # (None, {"__defaults__": (5,)}): setattr
    b"}" + _str("marker") + b"K\x01s",  # {"marker": 1}: the function's __dict__
], ids=["slot state", "dict state"])
def test_build_on_an_allowed_global_is_refused(state, rebuild_function_untouched):
    data = _crafted(_global("torch._utils", "_rebuild_tensor_v2") + state + b"b")
    with pytest.raises(WeightsOnlyError, match=r"BUILD\) of the global torch._utils._rebuild_tensor_v2"):
        torch_ipc.loads(data)
    # torch.load and loads still rebuild tensors as they did
    x = torch.arange(6.0).reshape(2, 3)
    import io
    buf = io.BytesIO()
    torch.save({"x": x}, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True)["x"], x)
    assert torch.equal(torch_ipc.loads(torch_ipc.dumps(OrderedDict(x=x)))["x"], x)


class _Allowed:
    def __init__(self, n=0):
        self.n = n


def test_build_on_an_allowed_class_itself_is_refused():
    data = _crafted(_global(__name__, "_Allowed") + b"N}" + _str("n") + b"K\x07s\x86b")
    with torch.serialization.safe_globals([_Allowed]):
        with pytest.raises(WeightsOnlyError, match="BUILD"):
            torch_ipc.loads(data)
    assert not hasattr(_Allowed, "n")


@pytest.mark.parametrize("target,how", [
    (_TENSOR0, b"K\x00K\x07s"),  # SETITEM into the shared tensor: x[0] = 7
    (_TENSOR0, b"(K\x01K\x07K\x02K\x07u"),  # SETITEMS
    (_VIEW_OF_TENSOR0, b"K\x00K\x07s"),  # SETITEM into a tensor the payload made on the shared storage
], ids=["SETITEM on a shared tensor", "SETITEMS on a shared tensor", "SETITEM on a view of it"])
def test_item_assignment_into_the_producers_memory_is_refused(target, how, ipc_peer):
    x = torch.zeros(4)
    data = _crafted(target + how, [x])
    kinds, message = ipc_peer.call(_try_loads, data)  # a real consumer, another process
    assert "WeightsOnlyError" in kinds, (kinds, message)
    assert "SETITEM" in message
    assert torch.equal(x, torch.zeros(4)), "loading the bytes wrote into the producer's tensor"


def test_append_into_an_allowed_global_is_refused():
    for how in (b"K\x01a", b"(K\x01K\x02e"):
        data = _crafted(_global(__name__, "_GLOBAL_LOG") + how)
        with torch.serialization.safe_globals([(_GLOBAL_LOG, f"{__name__}._GLOBAL_LOG")]):
            with pytest.raises(WeightsOnlyError, match="APPEND"):
                torch_ipc.loads(data)
    assert _GLOBAL_LOG.items == []


def test_calling_what_is_not_a_global_is_refused():
    x = torch.zeros(2)
    # REDUCE with a tensor of the descriptor as the callable
    with pytest.raises(WeightsOnlyError, match="call"):
        torch_ipc.loads(_crafted(_TENSOR0 + b")R", [x]))


def test_a_memo_index_beyond_the_payload_is_refused_before_the_unpickler_sizes_its_memo():
    x = torch.zeros(2)
    for body in (b"Nr\xff\xff\xff\x7f", b"Np2147483647\n", _TENSOR0 + b"r\x00\x00\x00\x40"):
        with pytest.raises(WeightsOnlyError, match="memo index"):
            torch_ipc.loads(_crafted(body, [x]))


def test_opcodes_torch_refuses_are_refused():
    # EXT1 (copyreg's extension registry), PERSID in text form, OBJ of an allowed class
    copyreg.add_extension("collections", "OrderedDict", 240)
    try:
        for body in (b"\x82\xf0)R", b"P0 0\n", b"(" + _global("collections", "OrderedDict") + b"o"):
            with pytest.raises(WeightsOnlyError):
                torch_ipc.loads(_crafted(body))
    finally:
        copyreg.remove_extension("collections", "OrderedDict", 240)


@dataclasses.dataclass
class _Config:
    lr: float
    weights: torch.Tensor


def test_payloads_dumps_and_torch_write_still_load():
    x = torch.arange(4.0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    sd = model.state_dict()  # an OrderedDict with _metadata, set by BUILD
    obj = {"sd": sd, "nested": [{"a": (x, [x])}, {1, 2}], "p": torch.nn.Parameter(torch.ones(2)),
           "cfg": _Config(0.1, x)}
    with torch.serialization.safe_globals([_Config]):
        out = torch_ipc.loads(torch_ipc.dumps(obj))
    assert out["sd"]._metadata == sd._metadata and list(out["sd"]) == list(sd)
    assert out["nested"][0]["a"][1][0].data_ptr() == x.data_ptr() and out["nested"][1] == {1, 2}
    assert type(out["p"]) is torch.nn.Parameter
    assert out["cfg"].lr == 0.1 and out["cfg"].weights.data_ptr() == x.data_ptr()
    # a bytearray as protocol 2 pickles it: its bytes as latin-1 text
    body = _global("builtins", "bytearray") + _str("abc") + _str("latin1") + b"\x86R"
    assert torch_ipc.loads(_crafted(body)) == bytearray(b"abc")


def test_build_on_a_tensor_is_refused_as_torch_refuses_it():
    # torch's unpickler runs set_(*state) on a plain tensor; Tensor.__setstate__
    # would also install the payload's backward hooks (Note [BUILD on a tensor]).
    x = torch.arange(4.0)
    hooks = _global("collections", "OrderedDict") + b")R(K\x00" + _global("torch.serialization", "_get_layout") + b"u"
    body = _VIEW_OF_TENSOR0 + b"\x88N" + hooks + b"\x87b"
    with pytest.raises(WeightsOnlyError, match=r"set the state \(BUILD\) of what torch._utils._rebuild_tensor_v2"):
        torch_ipc.loads(_crafted(body, [x]))
    on_new = _global("torch", "Tensor") + b")R" + b"\x88N" + hooks + b"\x87b"  # BUILD on torch.Tensor()
    with pytest.raises(TypeError):  # torch refuses it: set_() takes no such state
        torch._weights_only_unpickler.Unpickler(io.BytesIO(_PROTO2 + on_new + b".")).load()
    with pytest.raises(WeightsOnlyError):
        torch_ipc.loads(_crafted(on_new))
    assert not x.requires_grad and x._backward_hooks is None


@pytest.mark.parametrize("callable_, count", [
    (("builtins", "bytearray"), 1 << 40),                 # zero-filled on the host
    (("torch", "DoubleTensor"), 1 << 40),
    (("torch", "Tensor"), 1 << 40),
    (("torch.cuda", "FloatTensor"), 1 << 34),            # from the GPU's memory
])  # fmt: skip
def test_a_few_bytes_cannot_ask_for_memory(callable_, count):
    # Each is on torch's list, for pickles that name it (Note [counts in a payload]).
    body = _global(*callable_) + b"\x8a\x06" + count.to_bytes(6, "little") + b"\x85R"  # LONG1, TUPLE1, REDUCE
    with pytest.raises(WeightsOnlyError, match=f"refused a call of {'.'.join(callable_)}"):
        torch_ipc.loads(_crafted(body))
    nested = _global(*callable_) + b"(" + b"\x8a\x06" + count.to_bytes(6, "little") + b"tR"  # MARK ... TUPLE
    with pytest.raises(WeightsOnlyError, match="refused a call"):
        torch_ipc.loads(_crafted(nested))
