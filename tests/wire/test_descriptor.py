"""The wire format (csrc/wire/descriptor.h): layout round trip, and rejection of
malformed descriptors, by hand-made cases and by a seeded fuzz.

Everything that feeds bad bytes to the extension runs in spawned children, so a
crash fails the test with the signal and the child's stack instead of killing
pytest. No GPU needed.
"""
import collections
import os
import pickle
import random
import re
import struct
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc.testing import Peer, run_in_subprocess

# ----------------------------------------------------------------------------- the layout, read independently of the C++ code

HEADER = struct.Struct("<4sHHIHHHHIIIIIQII16sQ")
assert HEADER.size == 80
CHECKSUM_OFFSET = 72
DEVICE_BYTES, EVENT_BYTES, LEASE_BYTES, ALLOC_BYTES, STORAGE_BYTES, TENSOR_HEAD_BYTES = 16, 80, 40, 96, 24, 16
NO_ALLOC = 0xFFFFFFFF
NONE16 = 0xFFFF
KIND_CPU_SHM = 3
FLAG_HAS_CPU = 2
TENSOR_REQUIRES_GRAD, TENSOR_PARAMETER = 1, 2

# c10::ScalarType codes (a stable enum).
SCALAR_TYPE = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
               torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.complex64: 9,
               torch.bool: 11, torch.bfloat16: 15}  # fmt: skip
QINT8 = 12

# Errors a load may raise for a descriptor that cannot be loaded. A plain
# RuntimeError, IndexError or similar is a bug: the caller could not tell it apart.
# WeightsOnlyError: a changed payload byte that makes the pickle do what a
# weights_only load refuses (Note [where an object comes from]).
FAMILY = (
    torch_ipc.WeightsOnlyError,
    torch_ipc.DescriptorError,
    torch_ipc.ProducerGoneError,
    torch_ipc.ReleasedError,
    torch_ipc.DeviceNotFoundError,
    torch_ipc.CudaError,
    torch_ipc.CudaUnavailableError,
)
UNLOADABLE = (torch_ipc.DescriptorError, torch_ipc.ProducerGoneError, torch_ipc.ReleasedError)


def checksum(data: bytes) -> int:
    """The header's 64-bit hash of every other byte (Note [descriptor checksum])."""
    mask = (1 << 64) - 1
    n = len(data)
    h = 0x9E3779B97F4A7C15 ^ n
    i = 0
    while i + 8 <= n:
        w = 0 if i == CHECKSUM_OFFSET else int.from_bytes(data[i:i + 8], "little")
        h = ((h ^ w) * 0xFF51AFD7ED558CCD) & mask
        h ^= h >> 32
        i += 8
    while i < n:
        h = ((h ^ data[i]) * 0xC4CEB9FE1A85EC53) & mask
        i += 1
    return h ^ (h >> 29)


def seal(data: bytes) -> bytes:
    """`data` with its checksum recomputed, so that a test reaches the checks behind it."""
    if len(data) < HEADER.size:
        return data
    return data[:CHECKSUM_OFFSET] + checksum(data).to_bytes(8, "little") + data[CHECKSUM_OFFSET + 8:]


class Field(NamedTuple):
    start: int
    end: int
    name: str
    strict: bool  # any change here must make a load fail

    def changed(self, before: bytes, after: bytes) -> bool:
        """Whether `after` says something else here: a start time one tick
        off is the same process (Note [start times across time namespaces])."""
        if not self.name.endswith("start_time"):
            return before[self.start:self.end] != after[self.start:self.end]
        a, b = (int.from_bytes(x[self.start:self.end], "little") for x in (before, after))
        return abs(a - b) > 1


def layout(data: bytes) -> Tuple[Dict[str, Any], List[Field]]:
    """Parse a descriptor with struct, as the layout in csrc/wire/descriptor.h says.

    Returns the decoded header and tables and the list of fields covering every byte.
    """
    (magic, version, flags, total, n_dev, n_ev, n_lease, reserved, n_alloc, n_stor, n_tens,
     payload_len, pid, start_time, life, pidns, boot, check) = HEADER.unpack_from(data, 0)  # fmt: skip
    fields = [
        Field(0, 4, "magic", True), Field(4, 6, "version", True),
        # flag bits 0-1 (has_cuda, has_cpu) are hints; bits 2-15 are unknown and refused
        Field(6, 7, "flags.lo", False), Field(7, 8, "flags.hi", True),
        Field(8, 12, "total_len", True), Field(12, 14, "n_devices", True),
        Field(14, 16, "n_events", True), Field(16, 18, "n_leases", True),
        Field(18, 20, "reserved", True), Field(20, 24, "n_allocs", True),
        Field(24, 28, "n_storages", True), Field(28, 32, "n_tensors", True),
        Field(32, 36, "payload_len", True), Field(36, 40, "producer_pid", True),
        Field(40, 48, "producer_start_time", True),
        # the life key and PID namespace say how to judge the producer; a living one passes either way
        Field(48, 52, "producer_life", False), Field(52, 56, "producer_pidns", False),
        Field(56, 72, "boot_id", True), Field(72, 80, "checksum", True),
    ]  # fmt: skip
    d: Dict[str, Any] = dict(magic=magic, version=version, flags=flags, total=total, pid=pid,
                             start_time=start_time, life=life, pidns=pidns, boot=boot, reserved=reserved,
                             payload_len=payload_len, checksum=check)  # fmt: skip
    off = HEADER.size

    def add(size: int, name: str, strict: bool) -> int:
        nonlocal off
        fields.append(Field(off, off + size, name, strict))
        off += size
        return off - size

    d["devices"] = []
    for i in range(n_dev):
        d["devices"].append(data[add(16, f"device[{i}]", False):off])
    d["events"] = []
    for i in range(n_ev):
        (dev,) = struct.unpack_from("<H", data, add(2, f"event[{i}].device", True))
        add(6, f"event[{i}].pad", False)
        add(64, f"event[{i}].handle", False)
        d["events"].append(dict(device=dev))
    d["leases"] = []
    for i in range(n_lease):
        base = off
        add(4, f"lease[{i}].pid", True)
        add(4, f"lease[{i}].segment", True)
        add(8, f"lease[{i}].start_time", True)
        add(4, f"lease[{i}].slot", True)
        add(4, f"lease[{i}].life", False)
        add(8, f"lease[{i}].generation", True)
        add(4, f"lease[{i}].pidns", False)
        add(4, f"lease[{i}].pad", True)
        lpid, seg, lstart, slot, llife, gen, lns = struct.unpack_from("<IIQIIQI", data, base)
        d["leases"].append(dict(offset=base, pid=lpid, segment=seg, start_time=lstart, slot=slot, life=llife,
                                generation=gen, pidns=lns))
    d["allocs"] = []
    for i in range(n_alloc):
        base = off
        add(1, f"alloc[{i}].kind", True)
        add(1, f"alloc[{i}].pad", False)
        add(2, f"alloc[{i}].device", True)
        add(2, f"alloc[{i}].lease", True)
        add(2, f"alloc[{i}].pad2", False)
        add(8, f"alloc[{i}].size", False)
        add(64, f"alloc[{i}].handle", False)
        kind, _p, dev, lease, _p2, size = struct.unpack_from("<BBHHHQ", data, base)
        handle = data[base + 16:base + 80]
        d["allocs"].append(dict(offset=base, kind=kind, device=dev, lease=lease, size=size, handle=handle))
    d["storages"] = []
    for i in range(n_stor):
        base = off
        add(4, f"storage[{i}].alloc", False)
        # a storage with memory names no device (its allocation's is used); one
        # without names CPU (0xFFFF) or a device index: no other value decodes
        add(2, f"storage[{i}].device", True)
        add(2, f"storage[{i}].pad", False)
        add(8, f"storage[{i}].offset", False)
        add(8, f"storage[{i}].nbytes", False)
        alloc, dev, _p, soff, nbytes = struct.unpack_from("<IHHQQ", data, base)
        d["storages"].append(dict(offset=base, alloc=alloc, device=dev, byte_offset=soff, nbytes=nbytes))
    d["tensors"] = []
    for i in range(n_tens):
        base = off
        add(4, f"tensor[{i}].storage", False)
        add(1, f"tensor[{i}].dtype", False)
        add(1, f"tensor[{i}].ndim", True)
        add(1, f"tensor[{i}].flags.lo", False)
        add(1, f"tensor[{i}].flags.hi", True)
        add(8, f"tensor[{i}].storage_offset", False)
        storage, dtype, ndim, tflags, soff = struct.unpack_from("<IBBHq", data, base)
        add(8 * ndim, f"tensor[{i}].sizes", False)
        add(8 * ndim, f"tensor[{i}].strides", False)
        sizes = list(struct.unpack_from(f"<{ndim}q", data, base + 16))
        strides = list(struct.unpack_from(f"<{ndim}q", data, base + 16 + 8 * ndim))
        d["tensors"].append(dict(offset=base, storage=storage, dtype=dtype, ndim=ndim, flags=tflags,
                                 storage_offset=soff, sizes=sizes, strides=strides))  # fmt: skip
    if payload_len:
        add(payload_len, "payload", False)
    d["payload"] = data[off - payload_len:off]
    d["end"] = off
    return d, fields


def patch(data: bytes, offset: int, fmt: str, *values: Any) -> bytes:
    """`data` with `values` packed at `offset`, and the checksum recomputed."""
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, *values)
    return seal(bytes(out))


def sample_object(seed: int) -> Dict[str, Any]:
    """A small batch with the shapes a descriptor must carry: shared storages,
    views, a parameter, an empty tensor, a 0-dim tensor, non-tensor values."""
    gen = torch.Generator().manual_seed(seed)
    a = u.random_tensor((6, 5), torch.float32, gen)
    b = torch.randint(-1000, 1000, (7,), dtype=torch.int64, generator=gen)
    return {
        "a": a,
        "a.t": a.t(),
        "a[2:,1::2]": a[2:, 1::2],
        "b": b,
        "b[3]": b[3],
        "p": torch.nn.Parameter(u.random_tensor((3,), torch.float32, gen)),
        "empty": torch.empty(0),
        "flag": u.random_tensor((4,), torch.bool, gen),
        "text": "some text",
        "n": 3,
    }


# ----------------------------------------------------------------------------- child: round trip


def own_life_key(start_time: int) -> int:
    """The key of this process's life file, found by its identity page (Note [life files])."""
    for name in os.listdir("/dev/shm"):
        if name.startswith("torch_ipc.life."):
            try:
                with open(f"/dev/shm/{name}", "rb") as f:
                    magic, pid, _, start = struct.unpack("<8sIIQ", f.read(24))
            except (OSError, struct.error):
                continue
            if magic == b"TIPCSEG1" and (pid, start) == (os.getpid(), start_time):
                return int(name.rsplit(".", 1)[1], 16)
    return 0


def _round_trip(seed: int) -> Dict[str, Any]:
    """In a child: export the sample and report what the descriptor and describe() say."""
    obj = sample_object(seed)
    data = torch_ipc.dumps(obj)
    tensors = u.tensors_in(obj)
    with open("/proc/self/stat") as f:
        start_time = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = bytes.fromhex(f.read().strip().replace("-", ""))
    expected = [
        dict(
            dtype=SCALAR_TYPE[t.dtype],
            sizes=list(t.shape),
            strides=list(t.stride()),
            storage_offset=t.storage_offset(),
            requires_grad=t.requires_grad,
            parameter=isinstance(t, torch.nn.Parameter),
            nbytes=t.untyped_storage().nbytes(),
        )
        for t in tensors
    ]
    # Loading in the producer itself gives back the same memory.
    again = torch_ipc.loads(data)
    same = [x.data_ptr() == y.data_ptr() for x, y in zip(tensors, u.tensors_in(again))]
    return dict(
        data=data,
        describe=torch_ipc._C.describe(data),
        expected=expected,
        groups=u.storage_groups(obj),
        pid=os.getpid(),
        start_time=start_time,
        life=own_life_key(start_time),
        pidns=os.stat("/proc/self/ns/pid").st_ino,
        boot=boot,
        same_memory=same,
        fingerprint=u.fingerprint(obj),
        fingerprint_again=u.fingerprint(again),
    )


def test_layout_round_trip():
    r = run_in_subprocess(_round_trip, 1234, timeout=120)
    data = r["data"]
    d, fields = layout(data)
    # Every byte is covered once, in order, and the tables end where the payload does.
    assert fields[0].start == 0 and fields[-1].end == len(data) == d["end"]
    assert all(a.end == b.start for a, b in zip(fields, fields[1:]))
    # Header
    assert d["magic"] == b"TIPC" and d["version"] == 3 and d["total"] == len(data) and d["reserved"] == 0
    assert d["checksum"] == checksum(data), "the checksum as Note [descriptor checksum] says"
    assert d["flags"] == FLAG_HAS_CPU
    assert d["pid"] == r["pid"] and d["start_time"] == r["start_time"] and d["boot"] == r["boot"]
    assert d["life"] == r["life"] != 0 and d["pidns"] == r["pidns"] != 0
    assert not d["devices"] and not d["events"]
    # One lease (this producer), owned by the producer.
    assert len(d["leases"]) == 1
    lease = d["leases"][0]
    assert (lease["pid"], lease["start_time"]) == (r["pid"], r["start_time"]) and lease["generation"] != 0
    assert (lease["life"], lease["pidns"]) == (r["life"], r["pidns"])
    # Tensors, in the order the pickler met them.
    expected = r["expected"]
    assert len(d["tensors"]) == len(expected)
    for got, want in zip(d["tensors"], expected):
        assert got["dtype"] == want["dtype"]
        assert got["sizes"] == want["sizes"] and got["strides"] == want["strides"]
        assert got["storage_offset"] == want["storage_offset"]
        assert bool(got["flags"] & TENSOR_REQUIRES_GRAD) == want["requires_grad"]
        assert bool(got["flags"] & TENSOR_PARAMETER) == want["parameter"]
    # Storages: one record per distinct storage, as the tensors share them.
    groups = r["groups"]
    storage_of = [t["storage"] for t in d["tensors"]]
    assert [storage_of.index(s) for s in storage_of] == groups
    assert len(d["storages"]) == len(set(groups))
    for t, want in zip(d["tensors"], expected):
        s = d["storages"][t["storage"]]
        assert s["device"] == NONE16
        assert s["nbytes"] == want["nbytes"]
        if want["nbytes"] == 0:
            assert s["alloc"] == NO_ALLOC
        else:
            a = d["allocs"][s["alloc"]]
            assert a["kind"] == KIND_CPU_SHM and a["device"] == NONE16 and a["lease"] == 0
            assert s["byte_offset"] + s["nbytes"] <= a["size"]
            assert a["handle"].startswith(b"/torch_ipc.")
    # describe() agrees with the bytes.
    desc = r["describe"]
    assert desc["version"] == 3 and desc["producer_pid"] == r["pid"]
    for key, table in [("n_devices", "devices"), ("n_events", "events"), ("n_leases", "leases"),
                       ("n_allocs", "allocs"), ("n_storages", "storages"), ("n_tensors", "tensors")]:  # fmt: skip
        assert desc[key] == len(d[table]), key
    assert desc["payload"] == d["payload"]
    for got, mine in zip(desc["tensors"], d["tensors"]):
        for key in ("dtype", "storage_offset", "storage"):
            assert got[key] == mine[key], key
        assert list(got["sizes"]) == mine["sizes"] and list(got["strides"]) == mine["strides"]
    # Loading in the producer: the same object on the same memory.
    assert all(r["same_memory"])
    assert r["fingerprint_again"] == r["fingerprint"]


def test_single_tensor_has_no_payload():
    d, _ = layout(run_in_subprocess(_dumps_one_tensor, timeout=120))
    assert d["payload"] == b"" and len(d["tensors"]) == 1 and d["tensors"][0]["sizes"] == [3, 4]


def _dumps_one_tensor() -> bytes:
    return torch_ipc.dumps(torch.zeros(3, 4))


# ----------------------------------------------------------------------------- malformed descriptors


def malformed_cases(data: bytes, seed: int, same_process: bool = False) -> List[Tuple[str, bytes, Optional[tuple]]]:
    """Hand-made corruptions of a valid descriptor, each with the errors a load may raise (None: it loads).

    With `same_process` the load happens in the producer, which finds its own
    storages by handle and offset and maps nothing: an allocation's size is not
    used there, and a handle that is not its own is a released export.
    """
    d, _ = layout(data)
    rng = random.Random(seed)
    n = len(data)
    DE = (torch_ipc.DescriptorError,)
    cases: List[Tuple[str, bytes, tuple]] = []
    for cut in range(n):
        cases.append((f"truncated to {cut} bytes", data[:cut], DE))
    for cut in range(20, n):
        # The length field agrees with the truncation: the tables must not fit.
        cases.append((f"truncated to {cut} bytes, length patched", patch(data[:cut], 8, "<I", cut), DE))
    cases += [
        ("one byte too many", data + b"\0", DE),
        ("100 bytes too many", data + b"x" * 100, DE),
        ("empty", b"", DE),
        ("magic only", b"TIPC", DE),
        ("64 zero bytes", bytes(64), DE),
        ("random bytes", bytes(rng.randrange(256) for _ in range(300)), DE),
        ("a pickle", pickle.dumps(torch.zeros(3)), DE),
        ("magic TIPD", b"TIPD" + data[4:], DE),
        ("magic byte-swapped", b"CPIT" + data[4:], DE),
    ]
    for version in (0, 1, 2, 4, 0x100, 0xFFFF):
        cases.append((f"version {version}", patch(data, 4, "<H", version), DE))
    for flag in (8, 0x100, 0x8000):  # 4: open-ended (dumps(consumers=None))
        cases.append((f"unknown flag {flag:#x}", patch(data, 6, "<H", d["flags"] | flag), DE))
    for total in (n - 1, n + 1, 0, 64, 0xFFFFFFFF):
        cases.append((f"length field says {total}", patch(data, 8, "<I", total), DE))
    counts = [(12, "<H", "n_devices"), (14, "<H", "n_events"), (16, "<H", "n_leases"), (20, "<I", "n_allocs"),
              (24, "<I", "n_storages"), (28, "<I", "n_tensors"), (32, "<I", "payload_len")]  # fmt: skip
    for offset, fmt, name in counts:
        (value,) = struct.unpack_from(fmt, data, offset)
        top = 0xFFFF if fmt == "<H" else 0xFFFFFFFF
        for lie in {value + 1, top, top // 2 + 1, max(value - 1, 0) if value else 1}:
            cases.append((f"{name} {value} -> {lie}", patch(data, offset, fmt, lie), DE))
    cases.append(("reserved header field set", patch(data, 18, "<H", 1), DE))
    cases.append(("boot id of another boot", seal(data[:56] + bytes(b ^ 0x5A for b in data[56:72]) + data[72:]), DE))
    cases.append(("checksum off by one", data[:72] + ((d["checksum"] + 1) % 2**64).to_bytes(8, "little") + data[80:], DE))
    cases.append(("checksum zero", data[:72] + bytes(8) + data[80:], DE))
    cases.append(("last byte changed, checksum not updated", data[:-1] + bytes([data[-1] ^ 1]), DE))
    GONE = (torch_ipc.ProducerGoneError,)
    cases.append(("producer pid that does not exist", patch(data, 36, "<I", 0x7FFFFFF0), GONE))
    cases.append(("producer start time differs", patch(data, 40, "<Q", d["start_time"] + 2), GONE))
    # Another PID namespace (Note [life files]): judged by its life file, never by a pid of ours.
    elsewhere = patch(data, 52, "<I", d["pidns"] ^ 0x5A5A)
    cases.append(("producer in another PID namespace, its life file there", elsewhere, None))
    no_file = patch(elsewhere, 48, "<I", 0x7FFFFFFF)
    cases.append(("producer in another PID namespace, life key of no file", no_file, GONE))
    # A key of 0 is "not known": the producer itself takes it for its own (pid and start time match).
    no_key = None if same_process else (OSError,)
    cases.append(("producer in another PID namespace, no life key", patch(elsewhere, 48, "<I", 0), no_key))

    lease = d["leases"][0]
    lo = lease["offset"]
    cases += [
        ("lease generation 0", patch(data, lo + 24, "<Q", 0), DE),
        ("lease generation never issued", patch(data, lo + 24, "<Q", lease["generation"] + 10**9), (torch_ipc.ReleasedError,)),
        ("lease slot far out of range", patch(data, lo + 16, "<I", 0xFFFFFFF0), DE),
        ("lease slot of another export", patch(data, lo + 16, "<I", lease["slot"] ^ 1), (torch_ipc.ReleasedError,)),
        ("lease segment that does not exist", patch(data, lo + 4, "<I", lease["segment"] + 1000), UNLOADABLE),
        ("lease owner pid that does not exist", patch(data, lo, "<I", 0x7FFFFFF0), GONE),
        ("lease owner pid 0", patch(data, lo, "<I", 0), DE),
        ("lease owner start time differs", patch(data, lo + 8, "<Q", lease["start_time"] + 2), GONE),
    ]  # fmt: skip
    for i, a in enumerate(d["allocs"]):
        ao = a["offset"]
        NAME = UNLOADABLE if same_process else DE
        if not same_process:
            cases += [
                # Bigger than the shared memory segment really is: mapping it would
                # give a SIGBUS on the first touch past the end.
                (f"alloc[{i}] size + 1", patch(data, ao + 8, "<Q", a["size"] + 1), DE),
                (f"alloc[{i}] size + 1 MiB", patch(data, ao + 8, "<Q", a["size"] + (1 << 20)), DE),
                (f"alloc[{i}] size 2**62", patch(data, ao + 8, "<Q", 1 << 62), DE),
            ]
        cases += [
            (f"alloc[{i}] kind 0", patch(data, ao, "<B", 0), DE),
            (f"alloc[{i}] kind 4", patch(data, ao, "<B", 4), DE),
            (f"alloc[{i}] kind CUDA", patch(data, ao, "<B", 1), DE),
            (f"alloc[{i}] names a GPU", patch(data, ao + 2, "<H", 0), DE),
            (f"alloc[{i}] lease out of range", patch(data, ao + 4, "<H", 1), DE),
            (f"alloc[{i}] size 0", patch(data, ao + 8, "<Q", 0), DE),
            (f"alloc[{i}] name without prefix", seal(data[:ao + 16] + b"/etc/passwd".ljust(64, b"\0") + data[ao + 80:]), NAME),
            (f"alloc[{i}] name with a path", seal(data[:ao + 16] + b"/torch_ipc./../x".ljust(64, b"\0") + data[ao + 80:]), UNLOADABLE),
            (f"alloc[{i}] name not terminated", seal(data[:ao + 16] + b"/torch_ipc." + b"9" * 53 + data[ao + 80:]), UNLOADABLE),
            (f"alloc[{i}] name of no segment", seal(data[:ao + 16] + b"/torch_ipc.1.2.H3".ljust(64, b"\0") + data[ao + 80:]), UNLOADABLE),
        ]  # fmt: skip
    for i, s in enumerate(d["storages"]):
        so = s["offset"]
        cases += [
            (f"storage[{i}] names a GPU", patch(data, so + 4, "<H", 0), DE),
            (f"storage[{i}] padding set", patch(data, so + 6, "<H", 1), DE),
            (f"storage[{i}] alloc out of range", patch(data, so, "<I", len(d["allocs"])), DE),
        ]
        if s["alloc"] == NO_ALLOC:
            cases.append((f"storage[{i}] without memory has bytes", patch(data, so + 16, "<Q", 8), DE))
        else:
            size = d["allocs"][s["alloc"]]["size"]
            cases += [
                (f"storage[{i}] without memory", patch(data, so, "<I", NO_ALLOC), DE),
                (f"storage[{i}] past its allocation", patch(data, so + 16, "<Q", size + 1), DE),
                (f"storage[{i}] offset past its allocation", patch(data, so + 8, "<Q", size), DE),
                (f"storage[{i}] offset wraps", patch(data, so + 8, "<Q", 2**64 - 8), DE),
            ]
    for i, t in enumerate(d["tensors"]):
        to, ndim = t["offset"], t["ndim"]
        cases += [
            (f"tensor[{i}] storage out of range", patch(data, to, "<I", len(d["storages"])), DE),
            (f"tensor[{i}] dtype 200", patch(data, to + 4, "<B", 200), DE),
            (f"tensor[{i}] dtype 255", patch(data, to + 4, "<B", 255), DE),
            (f"tensor[{i}] quantized dtype", patch(data, to + 4, "<B", QINT8), DE),
            (f"tensor[{i}] ndim 65", patch(data, to + 5, "<B", 65), DE),
            (f"tensor[{i}] ndim 255", patch(data, to + 5, "<B", 255), DE),
            (f"tensor[{i}] unknown flag", patch(data, to + 6, "<H", t["flags"] | 0x100), DE),
            (f"tensor[{i}] negative storage offset", patch(data, to + 8, "<q", -1), DE),
        ]
        if 0 not in t["sizes"]:  # an empty view touches no memory, wherever it starts
            cases.append((f"tensor[{i}] storage offset 2**62", patch(data, to + 8, "<q", 1 << 62), DE))
        if t["dtype"] in (SCALAR_TYPE[torch.int64], SCALAR_TYPE[torch.bool]):
            cases.append((f"tensor[{i}] integer requires grad", patch(data, to + 6, "<H", t["flags"] | 1), DE))
        nbytes = d["storages"][t["storage"]]["nbytes"]
        if ndim and nbytes:
            sz, st = to + 16, to + 16 + 8 * ndim
            cases += [
                (f"tensor[{i}] negative size", patch(data, sz, "<q", -1), DE),
                (f"tensor[{i}] negative stride", patch(data, st, "<q", -1), DE),
                (f"tensor[{i}] size past its storage", patch(data, sz, "<q", t["sizes"][0] + nbytes), DE),
                (f"tensor[{i}] stride past its storage", patch(data, st, "<q", nbytes) if t["sizes"][0] > 1
                 else patch(patch(data, st, "<q", nbytes), sz, "<q", 2), DE),
                (f"tensor[{i}] size*stride overflows", patch(patch(data, sz, "<q", 1 << 62), st, "<q", 1 << 62), DE),
                (f"tensor[{i}] huge sizes", seal(data[:sz] + struct.pack(f"<{ndim}q", *[1 << 31] * ndim) + data[st:]), DE),
            ]  # fmt: skip
            # Extents whose byte count wraps in 64 bits for 8- and 16-byte dtypes:
            # (last element + 1) * itemsize lands just past 2**64, i.e. on a few bytes.
            for dtype, itemsize in [(SCALAR_TYPE[torch.float64], 8), (10, 16)]:  # 10: complex128
                wrap = patch(data, to + 4, "<B", dtype)
                wrap = patch(patch(wrap, sz, "<q", 2), st, "<q", 2**64 // itemsize - 1)
                cases.append((f"tensor[{i}] extent wraps for itemsize {itemsize}", wrap, DE))
                wrap = patch(patch(wrap, st, "<q", 1), to + 8, "<q", 2**64 // itemsize - 1)
                cases.append((f"tensor[{i}] offset wraps for itemsize {itemsize}", wrap, DE))
    return cases


def byte_fields(data: bytes) -> List[Field]:
    """The field each byte of `data` belongs to."""
    _, fields = layout(data)
    return [f for f in fields for _ in range(f.start, f.end)]


def check_loaded(obj: Any) -> List[str]:
    """For a corrupted descriptor that loaded: every view must lie inside its
    storage, and every byte of every storage must be readable."""
    problems = []
    for t in u.tensors_in(obj):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if t.numel() > 0:
            last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
            if (last + 1) * t.element_size() > nbytes or t.storage_offset() < 0:
                problems.append(f"view {tuple(t.shape)}/{t.stride()}+{t.storage_offset()} of {t.dtype} "
                                f"runs past its storage of {nbytes} bytes")  # fmt: skip
        if nbytes:
            view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))
            int(view.sum())  # touches every byte: a bad mapping crashes the child here
    return problems


def changes(data: bytes, mutated: bytes, limit: int = 12) -> str:
    """The bytes that differ, as offset:old->new (enough to replay a failure)."""
    if len(data) != len(mutated):
        return f"length {len(data)} -> {len(mutated)}"
    diff = [f"{i}:{a:02x}->{b:02x}" for i, (a, b) in enumerate(zip(data, mutated)) if a != b]
    return " ".join(diff[:limit]) + (" ..." if len(diff) > limit else "")


def _outcome(fn, data: bytes) -> Tuple[Any, BaseException]:
    try:
        return fn(data), None
    except BaseException as e:  # classified by the caller
        return None, e


def _fuzz(data: bytes, seed: int, iterations: int, hold: bool, same_process: bool = False) -> Dict[str, Any]:
    """In a child: feed corrupted copies of `data` to describe() and loads()."""
    import gc

    held = torch_ipc.loads(data) if hold else None  # keeps the export live throughout
    failures: Dict[str, List[str]] = collections.defaultdict(list)  # kind of failure -> examples
    outcomes: collections.Counter = collections.Counter()

    def fail(what: str, mutated: bytes, msg: str) -> None:
        kind = re.sub(r"[0-9]+", "N", msg)[:120]
        if len(failures[kind]) < 3:
            failures[kind].append(f"{what}: {msg}  [{changes(data, mutated)}]")
        else:
            failures[kind].append("")

    def check(what: str, mutated: bytes, allowed: tuple, may_load: bool) -> None:
        got, err = _outcome(torch_ipc._C.describe, mutated)
        if err is not None and not isinstance(err, torch_ipc.DescriptorError):
            fail(what, mutated, f"describe() raised {type(err).__name__}: {err}")
        obj, err = _outcome(torch_ipc.loads, mutated)
        outcomes["ok" if err is None else type(err).__name__] += 1
        if err is None:
            if not may_load:
                fail(what, mutated, f"loaded; expected one of {[c.__name__ for c in allowed]}")
            for problem in check_loaded(obj):
                fail(what, mutated, problem)
            del obj
        elif not isinstance(err, allowed):
            fail(what, mutated, f"raised {type(err).__name__}: {err}; expected one of {[c.__name__ for c in allowed]}")

    # Hand-made cases.
    for what, mutated, allowed in malformed_cases(data, seed, same_process):
        check(what, mutated, allowed or (), may_load=allowed is None)  # None: it must load

    # Random corruption: 1 to 3 bytes, xor-ed or set to boundary values. Raw,
    # the checksum catches every one; sealed (checksum recomputed), the checks
    # behind it must: a strict field changed must fail the load, anything else
    # may load but must give views inside their storages.
    fields = byte_fields(data)
    rng = random.Random(seed)
    for it in range(iterations):
        mutated = bytearray(data)
        spots = sorted({rng.randrange(len(data)) for _ in range(rng.choice((1, 1, 1, 2, 3)))})
        for i in spots:
            if rng.random() < 0.3:
                mutated[i] = rng.choice([b for b in (0x00, 0x01, 0x7F, 0x80, 0xFF) if b != data[i]])
            else:
                mutated[i] ^= rng.randrange(1, 256)
        raw = bytes(mutated)
        names = ", ".join(f"{fields[i].name}@{i}" for i in spots)
        # Byte 6 holds the has_cuda hint: a load may then ask for CUDA first.
        cuda_hint = 6 in spots
        if it % 4 == 0:
            allowed = FAMILY if cuda_hint else (torch_ipc.DescriptorError,)
            check(f"iteration {it}, raw ({names})", raw, allowed, may_load=False)
            continue
        sealed = seal(raw)
        if any(CHECKSUM_OFFSET <= i < CHECKSUM_OFFSET + 8 for i in spots):
            continue  # resealing undoes the change
        hits_strict = any(fields[i].strict and fields[i].changed(data, sealed) for i in spots)
        allowed = UNLOADABLE if hits_strict and not cuda_hint else FAMILY
        check(f"iteration {it}, sealed ({names})", sealed, allowed, may_load=not hits_strict)
        if it % 256 == 0:
            gc.collect()

    del held
    gc.collect()
    after = u.wait_for_stats("imports", 0, timeout=5.0)
    if after["imports"] != 0 or after["pending_releases"] != 0:
        fail("after the fuzz", data, f"holds left after every load was dropped: {after}")
    return dict(failures=dict(failures), outcomes=dict(outcomes))


def _export_sample(seed: int) -> bytes:
    obj = sample_object(seed)
    u.HELD["sample"] = obj
    return torch_ipc.dumps(obj)


def _fuzz_own(seed: int, iterations: int) -> Dict[str, Any]:
    """Producer and consumer in one process: loads() takes the same-process path."""
    obj = sample_object(seed)
    data = torch_ipc.dumps(obj, consumers=iterations + 10_000)
    result = _fuzz(data, seed, iterations, hold=False, same_process=True)
    result["data"] = data
    return result


FUZZ_SEED = int(os.environ.get("TORCH_IPC_FUZZ_SEED", "20240229"))
FUZZ_ITERATIONS = int(os.environ.get("TORCH_IPC_FUZZ_ITERATIONS", "3000"))


def _report(result: Dict[str, Any]) -> str:
    lines = []
    for kind, examples in result["failures"].items():
        lines.append(f"{len(examples)} x {kind}")
        lines += ["    " + e for e in examples if e]
    return "\n".join(lines) + f"\noutcomes: {result['outcomes']}"


def test_malformed_and_fuzzed_descriptors_across_processes():
    with Peer(timeout=120, name="producer") as producer, Peer(timeout=300, name="fuzzer") as fuzzer:
        data = producer.call(_export_sample, FUZZ_SEED)
        result = fuzzer.call(_fuzz, data, FUZZ_SEED, FUZZ_ITERATIONS, True)
        assert not result["failures"], _report(result)
        assert result["outcomes"].get("DescriptorError", 0) > FUZZ_ITERATIONS // 10, _report(result)
        # No corrupted load left a hold on the producer's export: once the fuzzer
        # dropped everything (it is still alive), the producer reclaims the export.
        s = producer.call(u.wait_for_stats, "exports", 0, 5.0)
        assert s["exports"] == 0 and s["holders"] == 0, s


def test_malformed_and_fuzzed_descriptors_in_the_producer():
    result = run_in_subprocess(_fuzz_own, FUZZ_SEED + 1, FUZZ_ITERATIONS // 2, timeout=300)
    assert not result["failures"], _report(result)


def _describe_random(seed: int, iterations: int) -> List[str]:
    """describe() on random garbage, some with a valid-looking header."""
    rng = random.Random(seed)
    bad = []
    for _ in range(iterations):
        n = rng.randrange(0, 400)
        body = bytes(rng.randrange(256) for _ in range(n))
        if rng.random() < 0.5 and n >= HEADER.size:
            # A plausible header (magic, version, length, reserved, checksum) over garbage tables.
            body = patch(patch(patch(b"TIPC" + body[4:], 4, "<H", 1), 8, "<I", n), 18, "<H", 0)
        try:
            torch_ipc._C.describe(body)
        except torch_ipc.DescriptorError:
            pass
        except Exception as e:
            bad.append(f"{type(e).__name__}: {e} for {body.hex()}")
    return bad[:20]


def test_describe_random_garbage():
    assert run_in_subprocess(_describe_random, FUZZ_SEED, 3000, timeout=120) == []


def test_descriptor_error_is_a_value_error():
    assert issubclass(torch_ipc.DescriptorError, ValueError)
    for cls in (torch_ipc.ProducerGoneError, torch_ipc.ReleasedError, torch_ipc.DeviceNotFoundError,
                torch_ipc.CudaError, torch_ipc.CudaUnavailableError):  # fmt: skip
        assert issubclass(cls, RuntimeError), cls
    err = pickle.loads(pickle.dumps(torch_ipc.CudaError("failed", "CUDA_ERROR_INVALID_VALUE")))
    assert err.error_name == "CUDA_ERROR_INVALID_VALUE" and str(err) == "failed"


def test_loads_rejects_non_descriptor_in_process():
    # The cheap checks, in this process too: the first bytes decide.
    for data in (b"", b"TIPC", b"not a descriptor at all", bytes(64)):
        with pytest.raises(torch_ipc.DescriptorError):
            torch_ipc.loads(data)
