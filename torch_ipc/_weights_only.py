"""What ``loads(data, weights_only=True)`` lets a payload do (Note [weights_only]).

Note [weights_only]
loads(data, weights_only=True) unpickles the payload with torch.load's
allow-list (torch/_weights_only_unpickler.py: containers, primitives,
OrderedDict, torch.dtype/device/Size/layout, torch's tensor rebuild
functions, and what torch.serialization.add_safe_globals added), plus the
rebuilds torch_ipc itself pickles (sparse and meta tensors, IpcEvent, a KV
pool, which check what they are given as any load from a peer). Tensors and
storages are references into the descriptor's own tables. The pickle machine
is the C one (torch's pure-Python unpickler is ~10x slower and wants protocol
2), so two checks stand where torch's unpickler checks each opcode as it runs:
- find_class: a global that is not on the list raises WeightsOnlyError when the
  unpickler reaches it, before anything calls it: no code of the payload's
  choosing runs.
- check_payload, before the load: the opcodes are walked once, tracking where
  each stack and memo entry comes from (Note [where an object comes from]),
  and the payload is refused when it would change an object it did not make.
A payload that names no global and no tensor can reach nothing it did not
make, so it skips the walk: loads tries the C unpickler first with hooks that
stop it at the first global or tensor reference (Note [payload fast paths]
in _serialize.py).
The default is True, as torch.load's has been since torch 2.6: a descriptor
is bytes that may come from a file, a queue or an HTTP endpoint, and what
people load is tensors in containers, which need nothing else. Senders of
other objects load with weights_only=False from a sender they trust. The
channels torch_ipc authenticates itself (Listener/Client, and the
multiprocessing reductions, whose pipes multiprocessing already trusts with
full pickle) keep full pickle. docs/security.md says what that leaves.
"""

import importlib
import pickle
from collections import Counter, OrderedDict

import torch

from .errors import DescriptorError, WeightsOnlyError

__all__ = ["allowed_global", "check_payload", "validate_sparse_rebuild"]

_TORCH_IPC_GLOBALS = {  # path: module, looked up when met (kv and ipc_event import _serialize)
    "torch_ipc._serialize._rebuild_sparse": "torch_ipc._serialize",
    "torch.multiprocessing.reductions.rebuild_meta_tensor": "torch.multiprocessing.reductions",
    "torch_ipc.ipc_event._rebuild_ipc_event": "torch_ipc.ipc_event",
    "torch_ipc.kv._load_pool": "torch_ipc.kv",
}
# As torch's unpickler: never allowed, even when a user allow-lists them.
_BLOCKED_MODULES = frozenset(("sys", "os", "posix", "nt"))


def _refused_global(module: str, name: str) -> WeightsOnlyError:
    return WeightsOnlyError(
        f"torch_ipc.loads(weights_only=True) refused the global {module}.{name} in the payload "
        "(tensors, containers and the types torch.load(weights_only=True) allows are loaded; "
        "docs/security.md). Load with weights_only=False only from a sender you trust, or allow it "
        f"with torch.serialization.add_safe_globals([{name}])")


def allowed_global(module: str, name: str):
    """The object ``module.name`` for a weights_only load; WeightsOnlyError if
    it is not allowed. torch's sparse rebuild comes back checked (Note [sparse
    tensors from a peer])."""
    from torch import _weights_only_unpickler as allow

    path = f"{module}.{name}"
    found = None
    if module not in _BLOCKED_MODULES:
        found = allow._get_allowed_globals().get(path)
        if found is None and hasattr(allow, "_get_user_allowed_globals"):  # torch >= 2.4
            found = allow._get_user_allowed_globals().get(path)
        if found is None and path in _TORCH_IPC_GLOBALS:
            found = getattr(importlib.import_module(_TORCH_IPC_GLOBALS[path]), name)
    if found is None:
        raise _refused_global(module, name)
    if found is torch._utils._rebuild_sparse_tensor:
        return _rebuild_torch_sparse_checked
    return found


# Note [sparse tensors from a peer]
# A sparse tensor built on indices nobody checked reads and writes out of
# bounds later (to_dense, to_sparse_csr: CVE-2025-62164 for torch.load). Every
# sparse tensor a load builds is checked with torch's invariant checks, on a
# private copy of its indices: the originals may sit in the producer's shared
# memory, which the producer can rewrite after the check. The values stay
# shared (no value can make an access go out of bounds). The legacy
# torch.sparse.*Tensor constructors are refused by weights_only loads.
def validate_sparse_rebuild(layout, indices, values, shape, coalesced=None):
    """A sparse tensor of ``layout`` on private copies of ``indices`` (one
    tensor for COO, (compressed, plain) otherwise), its invariants checked:
    DescriptorError if they do not hold."""
    try:
        if layout is torch.sparse_coo:
            (index,) = indices
            return torch.sparse_coo_tensor(index.clone(), values, shape, is_coalesced=coalesced,
                                           check_invariants=True)
        compressed, plain = indices
        return torch.sparse_compressed_tensor(compressed.clone(), plain.clone(), values, shape, layout=layout,
                                              check_invariants=True)
    except (RuntimeError, TypeError, ValueError) as e:
        raise DescriptorError(f"torch_ipc: a sparse tensor ({layout}, size {tuple(shape)}) in the payload has "
                              f"indices that do not fit it, refused: {e}") from None


def _rebuild_torch_sparse_checked(layout, data):
    """torch._utils._rebuild_sparse_tensor, checked (Note [sparse tensors from a peer])."""
    if layout is torch.sparse_coo:
        indices, values, size, *coalesced = data
        return validate_sparse_rebuild(layout, (indices,), values, size, coalesced[0] if coalesced else None)
    if layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        compressed, plain, values, size = data
        return validate_sparse_rebuild(layout, (compressed, plain), values, size)
    raise WeightsOnlyError(f"torch_ipc: no sparse layout {layout!r}")


def _legacy_sparse_class(obj) -> bool:
    return obj in torch._tensor_classes and "sparse" in obj.__module__


def _makes_memory(obj) -> bool:
    """A tensor or storage class (Note [counts in a payload])."""
    return isinstance(obj, type) and (obj in torch._tensor_classes or issubclass(
        obj, (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)))


def _tensor_rebuild_paths() -> frozenset:
    from torch import _weights_only_unpickler as allow

    paths = {f"torch._utils.{f.__name__}" for f in allow._tensor_rebuild_functions()}
    paths.update(("torch._tensor._rebuild_from_type_v2", "torch_ipc._serialize._rebuild_sparse",
                  "torch.multiprocessing.reductions.rebuild_meta_tensor"))
    return frozenset(paths)


# Note [where an object comes from]
# check_payload simulates the unpickler's stack and memo with, for each entry,
# where its object comes from: a literal; a dict, list or set this unpickle
# made (_DICT, _LIST, _SET); a tensor or storage of the descriptor (_SHARED:
# the producer's memory); a global (a _Global: allow-listed functions and
# classes, shared by the whole process); or what REDUCE/NEWOBJ made of one (a
# _Made, which remembers the global). As torch's unpickler allows, and no more:
# BUILD only on an instance of an allowed class made here, not a tensor
# (Note [BUILD on a tensor]); SETITEM(S) only on dicts made here (and
# OrderedDict/Counter instances); APPEND(S) only on lists made here; ADDITEMS
# only on sets made here; REDUCE/NEWOBJ only of a global, not of one that
# allocates what the payload asks (Note [counts in a payload]). Memo indices are
# bounded by the payload's size (the C unpickler sizes its memo by the largest).
_LITERAL, _DICT, _LIST, _SET, _SHARED, _COUNT = range(6)

# Note [counts in a payload]
# A few bytes can ask for any amount of memory: bytearray(2**40) zero-fills
# it, torch.cuda.FloatTensor(2**34) takes it from the GPU, torch.Tensor(n)
# from the host, and torch.load(weights_only=True) allows each (the classes
# are on its list for the pickles that name them, not call them). A
# load must not allocate far beyond its payload (docs/security.md), so the
# walk refuses calls of tensor and storage classes (a payload of ours never
# makes one), and calls of bytearray whose arguments hold an int of more
# than two bytes (_COUNT; a bytearray pickles as its bytes).

# Note [BUILD on a tensor]
# torch's unpickler decides BUILD by the instance's type: a Parameter's
# __setstate__, but a plain Tensor's set_(*state), which refuses anything but
# a storage and its geometry. The C unpickler calls Tensor.__setstate__,
# which also sets requires_grad and _backward_hooks: a payload could hang a
# function of its choosing on a loaded tensor's backward. So BUILD is refused
# on a tensor made by torch.Tensor or a tensor rebuild (our dumps never writes
# one), and allowed on a Parameter, as torch allows it.
_PARAMETER_REBUILDS = frozenset(("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"))


class _Global:
    __slots__ = ("path", "obj")

    def __init__(self, path: str, obj):
        self.path, self.obj = path, obj


class _Made:
    __slots__ = ("by",)

    def __init__(self, by: _Global):
        self.by = by


def _describe(entry) -> str:
    if isinstance(entry, _Global):
        return f"the global {entry.path}"
    if isinstance(entry, _Made):
        return f"what {entry.by.path} returned"
    return {_DICT: "a dict", _LIST: "a list", _SET: "a set", _SHARED: "a tensor of the descriptor"}.get(
        entry, "a literal")


def _refuse(what: str, entry) -> WeightsOnlyError:
    return WeightsOnlyError(
        f"torch_ipc.loads(weights_only=True) refused the payload: it would {what} {_describe(entry)}, "
        "an object it did not make or may not change (torch.load(weights_only=True) refuses it too; "
        "docs/security.md). Load with weights_only=False only from a sender you trust")


def _arg_lengths() -> dict:
    """opcode byte -> its argument's size: n bytes, or how to find it (pickletools' codes)."""
    import pickletools

    return {op.code.encode("latin-1")[0]: (op.arg.n if op.arg is not None else 0) for op in pickletools.opcodes}


_LENGTH_PREFIX = {-2: (1, False), -3: (4, True), -4: (4, False), -5: (8, False)}  # size, signed
_GLOBAL_PAIR = (ord("c"), ord("i"))  # two lines: module and name


def _read_arg(data, pos: int, code: int, size: int):
    """(argument bytes, position after them) of the opcode at ``pos - 1``."""
    if size >= 0:
        end = pos + size
    elif size == -1:  # up to a newline (two of them for GLOBAL and INST)
        end = data.find(b"\n", pos)
        if end >= 0 and code in _GLOBAL_PAIR:
            end = data.find(b"\n", end + 1)
        if end < 0:
            raise pickle.UnpicklingError("pickle data was truncated")
        return data[pos:end], end + 1
    else:
        width, signed = _LENGTH_PREFIX[size]
        length = int.from_bytes(data[pos:pos + width], "little", signed=signed)
        if length < 0:
            raise pickle.UnpicklingError("negative byte count in the payload's pickle")
        pos += width
        end = pos + length
    if end > len(data):
        raise pickle.UnpicklingError("pickle data was truncated")
    return data[pos:end], end


class _Walk:
    """One pass of check_payload over a pickle (Note [where an object comes from])."""

    def __init__(self, data: bytes):
        self.data = data
        self.stack = []
        self.marks = []
        self.memo = {}
        self.globals = []  # (module, name, object) of each global met

    def pop(self, n: int = 1):
        if len(self.stack) - (self.marks[-1] if self.marks else 0) < n:
            raise pickle.UnpicklingError("the payload's pickle pops more than it pushed")
        if n == 1:
            return self.stack.pop()
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def pop_mark(self) -> list:
        if not self.marks:
            raise pickle.UnpicklingError("the payload's pickle has no MARK where it needs one")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def top(self):
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise pickle.UnpicklingError("the payload's pickle pops more than it pushed")
        return self.stack[-1]

    def put(self, index: int) -> None:
        if index < 0 or index > len(self.data):
            raise WeightsOnlyError(f"torch_ipc.loads(weights_only=True) refused the payload: memo index "
                                   f"{index} is beyond what a pickle of {len(self.data)} bytes needs")
        self.memo[index] = self.top()

    def get(self, index: int) -> None:
        if index not in self.memo:
            raise pickle.UnpicklingError(f"the payload's pickle reads memo entry {index}, which it never set")
        self.stack.append(self.memo[index])

    def global_(self, module: str, name: str) -> None:
        found = allowed_global(module, name)
        self.globals.append((module, name, found))
        self.stack.append(_Global(f"{module}.{name}", found))

    def stack_global(self) -> None:
        module, name = self.pop(2)
        if not all(isinstance(part, (bytes, str)) for part in (module, name)):
            raise WeightsOnlyError("torch_ipc.loads(weights_only=True) refused the payload: a global whose "
                                   "name is not a literal string")
        module, name = (p.decode("utf-8", "surrogatepass") if isinstance(p, bytes) else p for p in (module, name))
        self.global_(module, name)

    def call(self, opcode: str, n_args: int) -> None:
        """REDUCE, NEWOBJ, NEWOBJ_EX: the callable under ``n_args`` arguments must be a global."""
        args = self.pop(n_args)
        callable_ = self.pop()
        if not isinstance(callable_, _Global):
            raise _refuse(f"call ({opcode})", callable_)
        if _legacy_sparse_class(callable_.obj):
            raise WeightsOnlyError(f"torch_ipc.loads(weights_only=True) refused the legacy sparse constructor "
                                   f"{callable_.path} (Note [sparse tensors from a peer])")
        if _makes_memory(callable_.obj) or (callable_.obj is bytearray and _COUNT in (args if n_args > 1 else [args])):
            raise WeightsOnlyError(f"torch_ipc.loads(weights_only=True) refused a call of {callable_.path}, which "
                                   "would allocate as much memory as the payload asks (Note [counts in a payload])")
        self.stack.append(_Made(callable_))

    def build(self) -> None:
        self.pop()
        target = self.top()
        if isinstance(target, _Made):  # Note [BUILD on a tensor]
            maker = target.by
            if isinstance(maker.obj, type):
                if not issubclass(maker.obj, torch.Tensor) or maker.obj is torch.nn.Parameter:
                    return
            elif maker.path in _PARAMETER_REBUILDS:
                return
        raise _refuse("set the state (BUILD) of", target)

    def fill(self, opcode: str, items: list) -> None:
        """APPEND(S), SETITEM(S), ADDITEMS of ``items`` into the object under them."""
        target = self.top()
        if opcode.startswith("APPEND"):
            ok = target == _LIST
        elif opcode == "ADDITEMS":
            ok = target == _SET
        else:
            ok = target == _DICT or (isinstance(target, _Made) and target.by.obj in (OrderedDict, Counter))
            if opcode == "SETITEMS" and len(items) % 2:
                raise pickle.UnpicklingError("odd number of items for SETITEMS")
        if not ok:
            raise _refuse(f"add items ({opcode}) to", target)


class _Rebuilds:
    _paths = None

    def paths(self) -> frozenset:
        if self._paths is None:
            self._paths = _tensor_rebuild_paths()
        return self._paths


_REBUILDS = _Rebuilds()


def _actions() -> dict:
    """opcode byte -> (name, what it does to the stack) for every opcode check_payload accepts."""
    import pickletools

    literal = ("BININT1", "BININT2", "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES",
               "BINBYTES8", "BYTEARRAY8", "NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT", "EMPTY_TUPLE")
    table = {name: "literal" for name in literal}
    table.update(dict.fromkeys(("INT", "BININT", "LONG", "LONG1", "LONG4"), _COUNT))
    table.update(dict.fromkeys(("UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"), "str"))
    table.update(TUPLE1="T1", TUPLE2="T2", TUPLE3="T3", EMPTY_LIST=_LIST, EMPTY_DICT=_DICT, EMPTY_SET=_SET,
                 TUPLE="mark", FROZENSET="mark", LIST="mark", DICT="mark")
    for name in ("APPEND", "SETITEM", "APPENDS", "SETITEMS", "ADDITEMS", "POP", "POP_MARK", "DUP", "MARK", "PUT",
                 "BINPUT", "LONG_BINPUT", "MEMOIZE", "GET", "BINGET", "LONG_BINGET", "GLOBAL", "STACK_GLOBAL",
                 "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD", "BINPERSID", "PROTO", "FRAME", "STOP"):
        table[name] = name
    return {op.code.encode("latin-1")[0]: (op.name, table.get(op.name)) for op in pickletools.opcodes}


_ACTIONS = _actions()
_ARG_LENGTHS = _arg_lengths()
_MARKED = {"TUPLE": _LITERAL, "FROZENSET": _LITERAL, "LIST": _LIST, "DICT": _DICT}


def _tuple_of(items) -> int:
    """What a tuple of `items` is to the walk: _COUNT if it holds one (Note [counts in a payload])."""
    return _COUNT if _COUNT in items else _LITERAL


# Note [checked payloads]
# The walk costs ~0.4 us an opcode (~1.7 ms for a 384-entry OrderedDict
# state_dict), and a producer that sends the same structure again (weights
# each step) sends the same pickle: tensors are indices into the descriptor's
# table. So the last payloads that passed are remembered with the globals they
# named; one passes again while each of those names still resolves to the same
# object (the allow-list may have changed). find_class checks every global of
# the load itself anyway.
_PASSED: "OrderedDict[bytes, list]" = OrderedDict()
_PASSED_COUNT = 16
_PASSED_BYTES = 1 << 20  # larger payloads are walked each time


def check_payload(data: bytes) -> None:
    """Raise WeightsOnlyError if the pickle ``data`` would do what a
    weights_only load must not (Note [where an object comes from]), or
    pickle.UnpicklingError if it is malformed."""
    named = _PASSED.get(data)
    if named is not None and all(_still_allowed(*g) for g in named):
        return
    named = _walk(data)
    if len(data) <= _PASSED_BYTES:
        _PASSED[data] = named
        while len(_PASSED) > _PASSED_COUNT:
            _PASSED.popitem(last=False)


def _still_allowed(module: str, name: str, found) -> bool:
    try:
        return allowed_global(module, name) is found
    except WeightsOnlyError:
        return False


def _walk(data: bytes) -> list:
    """check_payload's walk; the globals the payload names. The opcodes a
    pickle of tensors in containers is made of are handled here, inline;
    _other_opcode does the rest."""
    walk = _Walk(data)
    stack, marks, memo = walk.stack, walk.marks, walk.memo
    push = stack.append
    pos, end = 0, len(data)
    while pos < end:
        code = data[pos]
        depth = len(stack) - (marks[-1] if marks else 0)
        if code == _MEMOIZE and depth:
            memo[len(memo)] = stack[-1]
            pos += 1
        elif code == _BININT1:
            push(_LITERAL)
            pos += 2
        elif code == _BININT2:
            push(_LITERAL)
            pos += 3
        elif code in _NEW_OBJECT:  # EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, NONE
            push(_NEW_OBJECT[code])
            pos += 1
        elif code == _SHORT_BINUNICODE and pos + 1 < end:
            start = pos + 2
            pos = start + data[pos + 1]
            push(data[start:pos])
        elif code == _TUPLE2 and depth >= 2:
            stack[-2:] = [_tuple_of(stack[-2:])]
            pos += 1
        elif code == _BINPERSID and depth:
            stack[-1] = _SHARED
            pos += 1
        elif code == _SETITEM and depth >= 3 and stack[-3] == _DICT and type(stack[-3]) is int:
            del stack[-2:]
            pos += 1
        elif code == _BINGET and pos + 1 < end and data[pos + 1] in memo:
            push(memo[data[pos + 1]])
            pos += 2
        elif code == _LONG_BINGET and int.from_bytes(data[pos + 1:pos + 5], "little") in memo and pos + 4 < end:
            push(memo[int.from_bytes(data[pos + 1:pos + 5], "little")])
            pos += 5
        elif code == _MARK:
            marks.append(len(stack))
            pos += 1
        elif code == _STOP:
            walk.pop()
            return walk.globals
        else:
            pos = _other_opcode(walk, data, pos)
    raise pickle.UnpicklingError("pickle data was truncated (no STOP)")


def _other_opcode(walk: _Walk, data: bytes, pos: int) -> int:
    """One opcode of _walk at ``pos``; the position after it."""
    code = data[pos]
    name, action = _ACTIONS.get(code, (None, None))
    if name is None:
        raise pickle.UnpicklingError(f"invalid pickle opcode {code:#04x} at byte {pos}")
    if action is None:
        raise WeightsOnlyError(f"torch_ipc.loads(weights_only=True) refused the pickle opcode {name}, which "
                               "torch.load(weights_only=True) refuses too (docs/security.md)")
    arg, pos = _read_arg(data, pos + 1, code, _ARG_LENGTHS[code])
    if action == "literal":
        walk.stack.append(_LITERAL)
    elif action == "str":
        walk.stack.append(arg if name != "UNICODE" else arg.decode("raw-unicode-escape"))
    elif action in ("T1", "T2", "T3"):
        items = walk.pop(int(action[1]))
        walk.stack.append(_tuple_of(items if action != "T1" else [items]))
    elif type(action) is int:  # EMPTY_LIST, EMPTY_DICT, EMPTY_SET; _COUNT
        walk.stack.append(action)
    elif action == "STOP":
        raise AssertionError("STOP is _walk's")
    else:
        _step(walk, name, action, arg)
    return pos


_MEMOIZE, _BININT1, _BININT2, _SHORT_BINUNICODE, _TUPLE2, _BINPERSID, _SETITEM, _BINGET, _LONG_BINGET = (
    pickle.MEMOIZE[0], pickle.BININT1[0], pickle.BININT2[0], pickle.SHORT_BINUNICODE[0], pickle.TUPLE2[0],
    pickle.BINPERSID[0], pickle.SETITEM[0], pickle.BINGET[0], pickle.LONG_BINGET[0])
_MARK, _STOP = pickle.MARK[0], pickle.STOP[0]
_NEW_OBJECT = {pickle.EMPTY_DICT[0]: _DICT, pickle.EMPTY_LIST[0]: _LIST, pickle.EMPTY_TUPLE[0]: _LITERAL,
               pickle.NONE[0]: _LITERAL}


def _step(walk: _Walk, name: str, action, arg: bytes) -> None:
    """The opcodes of check_payload's loop that are not literals."""
    if name in _MARKED:
        items = walk.pop_mark()
        walk.stack.append(_tuple_of(items) if name == "TUPLE" else _MARKED[name])
    elif name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
        walk.put(len(walk.memo) if name == "MEMOIZE" else _memo_index(name, arg))
    elif name in ("GET", "BINGET", "LONG_BINGET"):
        walk.get(_memo_index(name, arg))
    elif name in ("APPEND", "SETITEM"):
        items = walk.pop(1 if name == "APPEND" else 2)
        walk.fill(name, items if name == "SETITEM" else [items])
    elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
        walk.fill(name, walk.pop_mark())
    elif name == "BINPERSID":
        walk.pop()
        walk.stack.append(_SHARED)
    elif name == "MARK":
        walk.marks.append(len(walk.stack))
    elif name == "POP":  # as the C unpickler: a MARK when nothing is above it
        if walk.marks and len(walk.stack) == walk.marks[-1]:
            walk.marks.pop()
        else:
            walk.pop()
    elif name == "POP_MARK":
        walk.pop_mark()
    elif name == "DUP":
        walk.stack.append(walk.top())
    elif name == "GLOBAL":
        module, _, attr = arg.partition(b"\n")
        walk.global_(module.decode("utf-8"), attr.decode("utf-8"))
    elif name == "STACK_GLOBAL":
        walk.stack_global()
    elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
        walk.call(name, 2 if name == "NEWOBJ_EX" else 1)
    elif name == "BUILD":
        walk.build()
    # PROTO, FRAME: nothing on the stack


def _memo_index(name: str, arg: bytes) -> int:
    if name in ("GET", "PUT"):
        try:
            return int(arg)
        except ValueError:
            raise pickle.UnpicklingError(f"bad {name} argument {arg[:20]!r}") from None
    return int.from_bytes(arg, "little")
