"""A fuzz of weights_only payloads (Note [where an object comes from] in
torch_ipc/_weights_only.py): thousands of random pickles built from the
opcodes torch's allow-list permits (and the protocol 4-5 ones dumps writes),
mixing allowed globals (and a few refused ones), tensors and storages of a real
descriptor, containers, objects made by REDUCE/NEWOBJ, memo reads and writes
and marks, with BUILD, SETITEM(S), APPEND(S), ADDITEMS and REDUCE aimed at
targets of every provenance, some with a byte changed. Each either loads or
raises WeightsOnlyError, DescriptorError or UnpicklingError; none crashes the
process (they run in a child), and none changes a global (torch._utils'
functions, an allow-listed class) or the producer's tensor."""
import pickle
import random
import struct
import time

import torch
from test_weights_only_crafted import _global, _str

import torch_ipc
from torch_ipc import DescriptorError, WeightsOnlyError, _serialize

N_PAYLOADS = 10000
SEED = 20261126


class FuzzAllowed:
    """An allow-listed class: BUILD on an instance made here is fine, on the class itself not."""

    def __init__(self, n=0):
        self.n = n


_ALLOWED = [("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
            ("torch._utils", "_rebuild_sparse_tensor"), ("collections", "OrderedDict"), ("collections", "Counter"),
            ("torch", "Size"), ("torch", "float32"), ("torch", "int64"), ("builtins", "set"),
            ("builtins", "bytearray"), ("torch.nn.parameter", "Parameter"), ("torch", "Tensor"),
            ("torch.serialization", "_get_layout"), ("torch", "device"), ("torch._tensor", "_rebuild_from_type_v2"),
            ("torch_ipc._serialize", "_rebuild_sparse"), ("torch.sparse", "FloatTensor"),
            (__name__, "FuzzAllowed")]
_REFUSED = [("os", "system"), ("builtins", "eval"), ("builtins", "getattr"), (__name__, "_snapshot")]
_PIDS = [b"K\x00K\x00\x86Q", b"K\x01K\x00\x86Q", b"K\x00K\x01\x86Q",
         b"K\x02K\x00" + _global("torch", "float32") + b"\x87Q", b"K\x09\x85Q"]


class _Payloads:
    """Random pickles from one seeded generator."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def literal(self) -> bytes:
        r = self.rng
        return r.choice([b"N", b"\x88", b"\x89", b")", b"K" + bytes([r.randrange(256)]),
                         b"J" + struct.pack("<i", r.randrange(-2 ** 31, 2 ** 31)), b"G" + struct.pack(">d", r.random()),
                         _str(r.choice(["__defaults__", "__dict__", "n", "x", "torch.sparse_coo", "_metadata"]))])

    def global_(self) -> bytes:
        module, name = self.rng.choice(_REFUSED if self.rng.random() < 0.05 else _ALLOWED)
        if self.rng.random() < 0.3:  # STACK_GLOBAL of two strings
            return b"".join(b"\x8c" + bytes([len(part)]) + part.encode() for part in (module, name)) + b"\x93"
        return _global(module, name)

    def made(self) -> bytes:
        return self.global_() + self.args() + self.rng.choice([b"R", b"R", b"\x81"])

    def args(self) -> bytes:
        items = b"".join(self.value(depth=2) for _ in range(self.rng.randrange(4)))
        return b"(" + items + b"t"

    def container(self) -> bytes:
        r = self.rng
        if r.random() < 0.5:
            return r.choice([b"}", b"]", b"\x8f"])
        n = r.randrange(4)
        return b"(" + b"".join(self.value(depth=2) for _ in range(2 * n)) + r.choice([b"t", b"l", b"d", b"\x91"])

    def value(self, depth: int = 0) -> bytes:
        r = self.rng
        kinds = [self.literal, self.literal, self.global_, lambda: r.choice(_PIDS), self.container,
                 lambda: b"h" + bytes([r.randrange(6)])]
        if depth < 2:
            kinds.append(self.made)
        return r.choice(kinds)()

    def operation(self) -> bytes:
        """A target of any provenance, then something done to it."""
        r = self.rng
        target = self.value()
        state = r.choice([self.value(depth=1), b"N}" + _str("__defaults__") + b"K\x05\x85s\x86",
                          b"}" + _str("n") + b"K\x07s", b"\x88N" + _global("collections", "OrderedDict") + b")R\x87"])
        op = r.choice([state + b"b", self.value(1) + self.value(1) + b"s",
                       b"(" + self.value(1) + self.value(1) + b"u", self.value(1) + b"a",
                       b"(" + self.value(1) + b"e", b"(" + self.value(1) + b"\x90", self.args() + b"R",
                       b"\x94", b"q" + bytes([r.randrange(8)]), b"2", b"0", b""])
        return target + op

    def payload(self) -> bytes:
        r = self.rng
        body = b"".join(r.choice([self.operation, self.value])() for _ in range(r.randrange(1, 6)))
        data = bytearray(b"\x80\x04(" + body + b"t.")
        if r.random() < 0.15:  # a byte changed, removed or added
            at = r.randrange(len(data))
            how = r.randrange(3)
            if how == 0:
                data[at] = r.randrange(256)
            elif how == 1:
                del data[at]
            else:
                data.insert(at, r.choice(b"bsuae\x90R\x81\x94qh20(tl"))
        return bytes(data)


def _snapshot():
    """What a payload must not change: torch._utils' functions and the allow-listed class."""
    functions = {name: (f.__defaults__, f.__kwdefaults__, dict(f.__dict__))
                 for name, f in vars(torch._utils).items() if callable(f) and hasattr(f, "__defaults__")}
    return functions, dict(vars(FuzzAllowed))


def _fuzz(descriptor: bytes, n: int, seed: int):
    """In a child: n random payloads loaded weights_only on the tensors of ``descriptor``."""
    tensors = list(torch_ipc.loads(descriptor))
    before = _snapshot()
    outcomes, unexpected = {}, []
    gen = _Payloads(seed)
    with torch.serialization.safe_globals([FuzzAllowed]):
        for _ in range(n):
            data = gen.payload()
            try:
                _serialize._rebuild(list(tensors), None, b"P" + data, weights_only=True)
                kind = "loaded"
            except WeightsOnlyError:
                kind = "WeightsOnlyError"
            except DescriptorError as e:
                kind = "DescriptorError"
                if isinstance(e.__cause__, (MemoryError, RecursionError, SystemError)):
                    unexpected.append((data, repr(e.__cause__)))
            except pickle.UnpicklingError:
                kind = "UnpicklingError"
            except BaseException as e:  # what the test is for: reported
                kind = type(e).__name__
                unexpected.append((data, repr(e)))
            outcomes[kind] = outcomes.get(kind, 0) + 1
    changed = [name for name, v in _snapshot()[0].items() if before[0].get(name) != v]
    if _snapshot()[1] != before[1]:
        changed.append("FuzzAllowed")
    return outcomes, unexpected[:5], changed, [t.tolist() for t in tensors]


def test_random_weights_only_payloads_load_or_are_refused(ipc_peer):
    x, y = torch.arange(4.0), torch.arange(3)
    data = torch_ipc.dumps([x, y], consumers=None)
    start = time.monotonic()
    outcomes, unexpected, changed, seen = ipc_peer.call(_fuzz, data, N_PAYLOADS, SEED)
    took = time.monotonic() - start
    assert not changed, f"payloads changed {changed}"
    wrote = not (torch.equal(x, torch.arange(4.0)) and torch.equal(y, torch.arange(3)))
    assert not wrote, "a payload wrote the producer's tensors"
    assert seen == [x.tolist(), y.tolist()]
    assert sum(outcomes.values()) == N_PAYLOADS
    assert set(outcomes) <= {"loaded", "WeightsOnlyError", "DescriptorError", "UnpicklingError"}, (outcomes, unexpected)
    assert not unexpected, unexpected
    # the mix reached every verdict, not only refusals
    assert min(outcomes.get("loaded", 0), outcomes.get("WeightsOnlyError", 0)) > N_PAYLOADS // 20, outcomes
    assert took < 30, f"{N_PAYLOADS} payloads took {took:.1f} s"
    print(f"\n{N_PAYLOADS} payloads in {took:.1f} s: {outcomes}")
