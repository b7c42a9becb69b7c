"""Shared helpers for torch_ipc's multi-process tests.

The functions here run in child processes (a Peer or run_in_subprocess), so
they live at module level; the children import this module by name (pytest's
default ``prepend`` import mode puts tests/ on sys.path, and the children get
the parent's sys.path). Nothing here touches CUDA at import time.
"""
import contextlib
import gc
import os
import secrets
import signal
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import torch_ipc

# What a child holds between calls: key -> object (tensors it loaded or made).
HELD: Dict[str, Any] = {}

# ----------------------------------------------------------------------------- dtypes and data

_DTYPE_NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
]  # fmt: skip


def loads(data: bytes) -> Any:
    """torch_ipc.loads of what the tests send: modules, dataclasses and other
    objects besides tensors, so full pickle (tests/security/test_loads_weights_only.py tests
    the default, weights_only=True)."""
    return torch_ipc.loads(data, weights_only=False)


def _usable(dtype: torch.dtype, device: str) -> bool:
    """Whether tensors of `dtype` can be made from random bytes and copied on `device`."""
    try:
        raw = torch.zeros(16, dtype=torch.uint8, device=device)
        t = raw.view(dtype)
        t[::2].clone()
        t.view(torch.uint8)
        return True
    except Exception:
        return False


def dtypes(device: str = "cpu") -> List[torch.dtype]:
    """Every dtype with a storage that this torch can fill with bytes and copy on `device`."""
    out = []
    for name in _DTYPE_NAMES:
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype) and dtype not in out and _usable(dtype, device):
            out.append(dtype)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def new_seed() -> int:
    """A fresh seed per run; tests print it so that a failure can be replayed."""
    return secrets.randbits(63)


def random_tensor(shape, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """Fresh random bits of any dtype (bool: 0 or 1). Floats include NaN and inf patterns."""
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape).to(device)


def bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor's elements in row-major order (any dtype, any view)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).cpu().numpy().tobytes()


def run_table_on_cpu(table: torch.Tensor, kind: int = 0) -> None:
    """Do on the CPU, with CPU addresses, what each GPU block of
    csrc/cuda/kernels/batched_copy.cu does with its item {src, dst, count, 0}:
    copy count bytes (kind 0) or convert count fp32 elements to bf16 (kind 1)."""
    import ctypes

    for src, dst, count, _ in table.tolist():
        if kind == 0:
            ctypes.memmove(dst, src, count)
        else:
            f = torch.frombuffer((ctypes.c_char * (4 * count)).from_address(src), dtype=torch.float32)
            torch.frombuffer((ctypes.c_char * (2 * count)).from_address(dst), dtype=torch.bfloat16).copy_(f)


def digest(t: torch.Tensor) -> str:
    """sha256 of bits(t): compares big tensors exactly without shipping them."""
    import hashlib

    return hashlib.sha256(bits(t)).hexdigest()


# ----------------------------------------------------------------------------- fingerprints


def tensors_in(obj: Any, depth: int = 0) -> List[torch.Tensor]:
    """Every tensor inside dicts, lists and tuples (and modules' parameters), in order."""
    if depth > 20:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return [p for p in obj.parameters()] + [b for b in obj.buffers()]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v, depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v, depth + 1)]
    return []


def fingerprint(obj: Any) -> Any:
    """A picklable, exact description of `obj`: containers and their types, and for each
    tensor its type, dtype, shape, strides, storage offset, requires_grad and bytes."""
    if isinstance(obj, torch.Tensor):
        return (
            "tensor",
            type(obj).__name__,
            str(obj.dtype),
            str(obj.device.type),
            tuple(obj.shape),
            tuple(obj.stride()),
            obj.storage_offset(),
            obj.requires_grad,
            bits(obj),
        )
    if isinstance(obj, torch.nn.Module):
        return (
            "module",
            type(obj).__name__,
            [(k, fingerprint(v)) for k, v in obj.named_parameters()],
            [(k, fingerprint(v)) for k, v in obj.named_buffers()],
        )
    if isinstance(obj, torch.UntypedStorage):
        raw = torch.empty(0, dtype=torch.uint8, device=obj.device).set_(obj)
        return ("storage", obj.device.type, obj.nbytes(), raw.cpu().numpy().tobytes())
    if isinstance(obj, dict):
        return (type(obj).__name__, [(k, fingerprint(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [fingerprint(v) for v in obj])
    return ("value", repr(obj))


def storage_groups(obj: Any) -> List[int]:
    """For each tensor in `obj`, the index of the first tensor with the same storage:
    tells which tensors alias which, independently of addresses."""
    ptrs = [t.untyped_storage().data_ptr() for t in tensors_in(obj)]
    return [ptrs.index(p) for p in ptrs]


# ----------------------------------------------------------------------------- views

# The views of views_of() that can be written through (not broadcast, not overlapping, not empty).
WRITABLE = ["row_slice", "col_step", "transposed", "element", "flat_window"]


def views_of(base: torch.Tensor) -> dict:
    """Every kind of view of a (7, 12) tensor, by name."""
    return {
        "full": base,
        "row_slice": base[2:5],
        "col_step": base[:, 1::3],
        "transposed": base.t(),
        "row": base[3],
        "element": base[1, 2],
        "empty_slice": base[2:2],
        "expanded": base[0:1].expand(4, -1),  # stride 0
        "overlapping": base.view(-1).as_strided((5, 4), (3, 1), 7),
        "unsqueezed": base[:, None, 3:],
        "flat_window": base.view(-1)[5:40],
    }


def write_views(key: str, view: str, seed: int) -> dict:
    """Write fresh random values into `view` of every dtype held under `key`
    (a dict of views_of() dicts); return what was written."""
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for name, views in HELD[key].items():
        if view in views:
            t = views[view]
            src = random_tensor(tuple(t.shape), t.dtype, gen, t.device.type)
            t.copy_(src)
            written[name] = bits(src)  # bits() copies to the host: the write has finished
    return written


def view_bits(key: str, view: str) -> dict:
    return {name: bits(views[view]) for name, views in HELD[key].items() if view in views}


# ----------------------------------------------------------------------------- child-side operations


def load(key: str, data: bytes) -> Any:
    """Load a descriptor and hold the result under `key`; return its fingerprint."""
    obj = loads(data)
    HELD[key] = obj
    return fingerprint(obj)


def load_quietly(key: str, data: bytes) -> None:
    HELD[key] = loads(data)


def hold(key: str, obj: Any) -> None:
    HELD[key] = obj


def held_fingerprint(key: str) -> Any:
    return fingerprint(HELD[key])


def held_groups(key: str) -> List[int]:
    return storage_groups(HELD[key])


def drop(key: Optional[str] = None) -> Dict[str, int]:
    """Drop one held object (all when key is None), let torch_ipc release, return stats."""
    if key is None:
        HELD.clear()
    else:
        HELD.pop(key, None)
    gc.collect()
    torch_ipc.collect()
    return torch_ipc.stats()


def stats() -> Dict[str, int]:
    return torch_ipc.stats()


def collect(close_idle: bool = False) -> Dict[str, int]:
    torch_ipc.collect(close_idle)
    return torch_ipc.stats()


def poll_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll predicate() until it is true (True) or `timeout` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


@contextlib.contextmanager
def at_fd_limit(limit: int = 1024):
    """This process with no fd left (RLIMIT_NOFILE at most `limit`, every
    one taken), as under EMFILE; the fds and the limit back after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, limit), hard))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def ctrl_c_after(seconds: float):
    """SIGINT to this process `seconds` in, with Python's default handler
    (KeyboardInterrupt in the main thread), as a user's Ctrl-C."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGINT, previous)


def wait_for_stats(key: str, value: int, timeout: float = 5.0) -> Dict[str, int]:
    """Call collect() until stats()[key] == value or `timeout` seconds passed; return stats."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        torch_ipc.collect()
        s = torch_ipc.stats()
        if s[key] == value or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def export_random(key: str, shape, dtype_name_: str = "float32", consumers: int = 1, seed: int = 0):
    """Make a random tensor, hold it under `key`, export it; return (descriptor, bits, nbytes)."""
    gen = torch.Generator().manual_seed(seed)
    x = random_tensor(tuple(shape), getattr(torch, dtype_name_), gen)
    HELD[key] = x
    data = torch_ipc.dumps(x, consumers=consumers)
    return data, bits(x), x.untyped_storage().nbytes()


def open_fds(peer: Optional[int] = None) -> int:
    """How many file descriptors this process has open; given `peer`, leaving
    out pidfds of processes other than `peer`: the sweep keeps one for each
    live process whose files it sees, and processes of other tests (or of
    other programs) come and go meanwhile."""
    if peer is None:
        return len(os.listdir("/proc/self/fd"))
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]" and _pidfd_pid(fd) != peer:
                continue
        except FileNotFoundError:  # closed since the listing (the listing's own fd among them)
            continue
        count += 1
    return count


def _pidfd_pid(fd: str) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("Pid:")), -1)


def share_batch(count: int, seed: int, device: str = "cpu", exact: Callable[[torch.Tensor], Any] = bits):
    """`count` descriptors of {"t": tensor, "i": index}: the same tensor again and
    again (even i) and fresh small float16 ones (odd i); every 50 descriptors,
    the first two carry exact(tensor) to check, the others None."""
    gen = torch.Generator().manual_seed(seed)
    x = HELD.setdefault("same", random_tensor((1024,), torch.float32, gen, device))
    out = []
    for i in range(count):
        t = x if i % 2 == 0 else random_tensor((int(torch.randint(1, 4096, (1,), generator=gen)),), torch.float16, gen, device)
        out.append((torch_ipc.dumps({"t": t, "i": i}), exact(t) if i % 50 < 2 else None))
    return out


def load_batch(batch, exact: Callable[[torch.Tensor], Any] = bits) -> Dict[str, int]:
    """Load and drop each descriptor of share_batch() in turn; return stats()
    after a collect, with "fds" (open_fds()) and "bad" (how many loads had the
    wrong index or values)."""
    bad = 0
    for i, (data, want) in enumerate(batch):
        obj = loads(data)
        if obj["i"] != i or (want is not None and exact(obj["t"]) != want):
            bad += 1
        del obj
    torch_ipc.collect()
    s = torch_ipc.stats()
    s["fds"] = open_fds()
    s["bad"] = bad
    return s


def digest_held(key: str) -> str:
    return digest(HELD[key])


def gpu_cycles_per_second() -> float:
    """How many cycles torch.cuda._sleep spins per second on this GPU (measured
    once per device and process: a measurement spins ~30 ms and synchronizes)."""
    device = torch.cuda.current_device()
    if device not in _CYCLES_PER_SECOND:
        _CYCLES_PER_SECOND[device] = _measure_gpu_cycles_per_second()
    return _CYCLES_PER_SECOND[device]


_CYCLES_PER_SECOND: Dict[int, float] = {}


def _measure_gpu_cycles_per_second() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1000.0)


def load_bits(key: str, data: bytes) -> bytes:
    x = loads(data)
    HELD[key] = x
    return bits(x)


def try_load(data: bytes) -> Tuple[str, str]:
    """Load and drop at once; return ("ok", "") or (exception type name, message)."""
    try:
        obj = loads(data)
    except Exception as e:  # reported to the test, which decides
        return type(e).__name__, str(e)
    del obj
    gc.collect()
    return "ok", ""


def shm_files_of(pid: int, start_time: Optional[int] = None) -> List[str]:
    """torch_ipc's shared memory files in /dev/shm that belong to process `pid`
    (and, given its start time, to that process only: a producer in another PID
    namespace is pid 1 there, as is every other namespaced producer)."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    prefix = f"torch_ipc.{pid}." + ("" if start_time is None else f"{start_time}.")
    return sorted(n for n in names if n.startswith(prefix))


def process_gone(pid: int, within: float = 10.0) -> bool:
    """True once `pid` no longer runs (absent, or a zombie nobody reaped yet)."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)



# ----------------------------------------------------------------------------- files of other users, bait


class PickleMarker:
    """Unpickling this creates a file: the proof that a pickle ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def crafted_descriptor(pickled: bytes, tensors=()) -> bytes:
    """A real descriptor of ``tensors`` whose payload is the pickle ``pickled``,
    as no dumps() writes it (HELD keeps the tensors: the export lives, for any
    number of loads, as long as this process)."""
    from torch_ipc import _serialize

    HELD.setdefault("crafted", []).append(list(tensors))
    return _serialize.export_parts(list(tensors), [], _serialize._PICKLED + pickled, consumers=2**32 - 1).data


def pickled_descriptor(marker: str, shape=(4,)) -> bytes:
    """A descriptor of one tensor whose payload is a pickle that creates
    `marker` when loaded (HELD keeps the tensor: the export lives as long as
    this process)."""
    import pickle

    from torch_ipc import _serialize

    t = torch.zeros(shape, dtype=torch.int64)
    HELD["bait"] = t
    payload = _serialize._PICKLED + pickle.dumps(PickleMarker(marker))
    return _serialize.export_parts([t], [False], payload, consumers=2**32 - 1).data


def plant_as_uid(uid: int, path: str, content: bytes, mode: int = 0o666) -> int:
    """In a child run as root: become `uid` and create `path` (mode `mode`,
    whatever the umask) holding `content`; returns the file's owner."""
    os.setgid(uid)
    os.setuid(uid)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, content)
    finally:
        os.close(fd)
    return os.stat(path).st_uid


# ----------------------------------------------------------------------------- in the test's own process


def collect_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Collect until predicate() is true; False if it never becomes so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()
        torch_ipc.collect()
        if predicate():
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def running(p, timeout: float = 120.0):
    """Start multiprocessing process p; join it at the end of the block (it must
    exit cleanly), killing it if it is still there."""
    p.start()
    try:
        yield p
        p.join(timeout)
        assert p.exitcode == 0, p.exitcode
    finally:
        if p.is_alive():
            p.kill()
            p.join()
