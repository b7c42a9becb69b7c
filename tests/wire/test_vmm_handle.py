"""The 64-byte VMM handle field (csrc/wire/vmm_handle.h): layout round trip, rejection
of every malformed value, and a seeded structure-aware fuzz against an oracle
written here from Note [VMM handle field]. Pure C++ codec: no GPU needed.

Everything that feeds bad bytes to the extension runs in spawned children, so a
crash fails the test with the signal instead of killing pytest.
"""
import os
import random
import re
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

import torch_ipc
from torch_ipc import _C
from torch_ipc.testing import run_in_subprocess

# ----------------------------------------------------------------------------- the layout, read independently of the C++ code

# u8 version, u8 handle type, u16 fd numbers present, u32 chunks, u64 export id,
# u64 chunk bytes, u32 producer pid, i32 x 9 fd numbers (unused: -1).
FIELD = struct.Struct("<BBHIQQI9i")
assert FIELD.size == 64
OFFSETS = {"version": (0, "<B"), "type": (1, "<B"), "n_fds": (2, "<H"), "n_chunks": (4, "<I"),
           "id": (8, "<Q"), "chunk_bytes": (16, "<Q"), "pid": (24, "<I")}  # fmt: skip
FD_SLOTS_AT = 28
VERSION = 1
POSIX_FD, FABRIC = 1, 8  # CU_MEM_HANDLE_TYPE_*
MAX_FDS = 9
U32, U64, I32_MAX = 2**32 - 1, 2**64 - 1, 2**31 - 1

FUZZ_SEED = int(os.environ.get("TORCH_IPC_FUZZ_SEED", "20240229"))
FUZZ_ITERATIONS = int(os.environ.get("TORCH_IPC_FUZZ_ITERATIONS", "3000")) * 10


def pack(type=POSIX_FD, n_chunks=1, id=1, chunk_bytes=2 << 20, pid=1234, fds=(), *, version=VERSION,
         n_fds=None, slots=None):  # fmt: skip
    """The field's bytes as the Note lays them out; n_fds and slots override what fds implies."""
    fds = list(fds)
    if slots is None:
        slots = (fds + [-1] * MAX_FDS)[:MAX_FDS]
    return FIELD.pack(version, type, len(fds) if n_fds is None else n_fds, n_chunks, id, chunk_bytes, pid, *slots)


def patch(raw: bytes, name: str, value: int) -> bytes:
    at, fmt = OFFSETS[name]
    return raw[:at] + struct.pack(fmt, value) + raw[at + struct.calcsize(fmt) :]


def expected_error(raw: bytes, alloc_size: Optional[int] = None) -> Optional[str]:
    """The oracle: None when the field is valid, else a regex of the decoder's complaint."""
    version, type_, n_fds, n_chunks, ident, chunk_bytes, pid, *slots = FIELD.unpack(raw)
    if version != VERSION:
        return "unknown version"
    if n_fds > MAX_FDS:
        return "inconsistent fd numbers"
    if any(s != -1 for s in slots[n_fds:]):
        return "unused fd slot"
    return values_error(type_, n_chunks, ident, chunk_bytes, pid, slots[:n_fds], alloc_size)


def values_error(type, n_chunks, id, chunk_bytes, pid, fds: Sequence[int], alloc_size=None) -> Optional[str]:
    if type not in (POSIX_FD, FABRIC):
        return "unknown handle type"
    if n_chunks == 0:
        return "no allocations"
    if id == 0:
        return "no export id"
    if pid == 0 or pid > I32_MAX:
        return "pid .* out of range"
    if fds and (type != POSIX_FD or len(fds) > MAX_FDS or len(fds) != n_chunks or chunk_bytes == 0 or min(fds) < 0):
        return "inconsistent fd numbers"
    if chunk_bytes:
        if chunk_bytes * n_chunks > U64:
            return "overflow 64 bits"
        if alloc_size is not None and alloc_size != chunk_bytes * n_chunks:
            return "is not .* chunks of"
    else:
        if n_chunks < 2:
            return "one chunk and no chunk size"
        if alloc_size is not None and alloc_size < n_chunks:
            return "cannot hold"
    return None


def as_kwargs(decoded: Dict) -> Dict:
    return {k: decoded[k] for k in ("type", "n_chunks", "id", "chunk_bytes", "pid", "fds")}


# ----------------------------------------------------------------------------- valid fields

VALID = [
    # one 2 MiB SharedPool allocation, its fd number sent for pidfd_getfd
    dict(type=POSIX_FD, n_chunks=1, id=0x1234_5678_9ABC_DEF0, chunk_bytes=2 << 20, pid=4242, fds=[37]),
    # an expandable-segments run of 9 x 20 MiB: the most fd numbers a field holds
    dict(type=POSIX_FD, n_chunks=9, id=7, chunk_bytes=20 << 20, pid=1, fds=list(range(100, 109))),
    # 10 chunks: no fd numbers, the consumer asks the socket
    dict(type=POSIX_FD, n_chunks=10, id=7, chunk_bytes=20 << 20, pid=I32_MAX, fds=[]),
    # chunks of different sizes: no common size, no fd numbers
    dict(type=POSIX_FD, n_chunks=2, id=U64, chunk_bytes=0, pid=99, fds=[]),
    # fabric handles carry no fd numbers
    dict(type=FABRIC, n_chunks=3, id=5, chunk_bytes=2 << 20, pid=99, fds=[]),
    dict(type=FABRIC, n_chunks=U32, id=5, chunk_bytes=0, pid=99, fds=[]),
    # sizes at the top of 64 bits
    dict(type=POSIX_FD, n_chunks=1, id=1, chunk_bytes=U64, pid=2, fds=[0]),
    dict(type=POSIX_FD, n_chunks=3, id=1, chunk_bytes=U64 // 3, pid=2, fds=[0, 1, I32_MAX]),  # 3 * ((2^64-1)/3) = 2^64-1
    dict(type=FABRIC, n_chunks=U32, id=1, chunk_bytes=U64 // U32, pid=2, fds=[]),  # (2^32-1)(2^32+1) = 2^64-1
    dict(type=POSIX_FD, n_chunks=U32, id=1, chunk_bytes=1, pid=2, fds=[]),
]


@pytest.mark.parametrize("values", VALID, ids=range(len(VALID)))
def test_round_trip(values):
    raw = _C._testing.vmm_handle_encode(**values)
    assert raw == pack(**values)  # the layout of the Note, byte for byte
    assert expected_error(raw) is None
    decoded = _C._testing.vmm_handle_decode(raw)
    assert decoded == dict(values, version=VERSION)
    total = values["chunk_bytes"] * values["n_chunks"] if values["chunk_bytes"] else values["n_chunks"] * (2 << 20)
    assert _C._testing.vmm_handle_decode(raw, total) == decoded
    assert _C._testing.vmm_handle_encode(**as_kwargs(decoded)) == raw


def test_defaults_and_wrong_lengths():
    raw = _C._testing.vmm_handle_encode(type=POSIX_FD, n_chunks=2, id=3, chunk_bytes=4, pid=5)
    assert raw == pack(POSIX_FD, 2, 3, 4, 5)
    assert FIELD.unpack(raw)[7:] == (-1,) * MAX_FDS
    for n in (0, 63, 65, 128):
        with pytest.raises(ValueError, match="64 bytes"):
            _C._testing.vmm_handle_decode(bytes(n))
    with pytest.raises(ValueError, match="fit in a byte"):
        _C._testing.vmm_handle_encode(type=256 + POSIX_FD, n_chunks=1, id=1, chunk_bytes=1, pid=1)
    assert issubclass(torch_ipc.DescriptorError, ValueError)


# ----------------------------------------------------------------------------- invalid values, one at a time

BASE = dict(type=POSIX_FD, n_chunks=2, id=11, chunk_bytes=2 << 20, pid=77, fds=[5, 6])


def _bad_values() -> List[Tuple[str, Dict, str]]:
    """(name, values, what the decoder says): each breaks one rule of a valid field."""
    cases = []
    for t in (0, 2, 4, 7, 9, 255):
        cases.append((f"type={t}", dict(BASE, type=t, fds=[]), "unknown handle type"))
    cases += [
        ("no chunks", dict(BASE, n_chunks=0, fds=[]), "no allocations"),
        ("id 0", dict(BASE, id=0), "no export id"),
        ("pid 0", dict(BASE, pid=0), "out of range"),
        ("pid 2^31", dict(BASE, pid=I32_MAX + 1), "out of range"),
        ("pid 2^32-1", dict(BASE, pid=U32), "out of range"),
        ("fabric with fds", dict(BASE, type=FABRIC), "inconsistent fd numbers"),
        ("fewer fds than chunks", dict(BASE, fds=[5]), "inconsistent fd numbers"),
        ("more fds than chunks", dict(BASE, fds=[5, 6, 7]), "inconsistent fd numbers"),
        ("fds with mixed sizes", dict(BASE, n_chunks=2, chunk_bytes=0), "inconsistent fd numbers"),
        ("negative fd", dict(BASE, fds=[5, -1]), "inconsistent fd numbers"),
        ("fd -2^31", dict(BASE, fds=[-(2**31), 6]), "inconsistent fd numbers"),
        ("10 fds", dict(BASE, n_chunks=10, fds=list(range(10))), "inconsistent fd numbers"),
        ("one chunk, no size", dict(BASE, n_chunks=1, chunk_bytes=0, fds=[]), "one chunk and no chunk size"),
        ("2^63 x 2", dict(BASE, chunk_bytes=2**63, fds=[]), "overflow 64 bits"),
        ("2^64-1 x 2", dict(BASE, chunk_bytes=U64), "overflow 64 bits"),
        ("(2^64-1)/3+1 x 3", dict(BASE, n_chunks=3, chunk_bytes=U64 // 3 + 1, fds=[]), "overflow 64 bits"),
        ("2^32 x (2^32-1)... +1", dict(BASE, n_chunks=U32, chunk_bytes=U64 // U32 + 1, fds=[]), "overflow 64 bits"),
    ]
    return cases


def _bad_bytes() -> List[Tuple[str, bytes, Optional[int], str]]:
    """(name, raw, alloc_size, what the decoder says): malformed bytes no encoder writes."""
    good = pack(**BASE)
    size = BASE["chunk_bytes"] * BASE["n_chunks"]
    cases = [(f"version {v}", patch(good, "version", v), None, "unknown version") for v in (0, 2, 255)]
    cases += [(f"n_fds {n}", patch(good, "n_fds", n), None, "inconsistent fd numbers|unused fd slot")
              for n in (0, 1, 3, 9)]  # fmt: skip
    cases += [(f"n_fds {n}", patch(good, "n_fds", n), None, "inconsistent fd numbers") for n in (10, 0xFFFF)]
    for slot in range(2, MAX_FDS):
        for value in (0, -2, 5, I32_MAX, -(2**31)):
            raw = good[: FD_SLOTS_AT + 4 * slot] + struct.pack("<i", value) + good[FD_SLOTS_AT + 4 * slot + 4 :]
            cases.append((f"slot {slot}={value}", raw, None, "unused fd slot"))
    no_fds = pack(**dict(BASE, fds=[]))
    cases.append(("n_fds 0, slot 0 kept", patch(good, "n_fds", 0), None, "unused fd slot"))
    cases.append(("all slots 0", no_fds[:FD_SLOTS_AT] + bytes(36), None, "unused fd slot"))
    for alloc in (0, 1, size - 1, size + 1, size // 2, 2 * size, U64):
        cases.append((f"alloc size {alloc}", good, alloc, "is not 2 chunks of"))
    mixed = pack(**dict(BASE, n_chunks=5, chunk_bytes=0, fds=[]))
    for alloc in (0, 1, 4):
        cases.append((f"5 mixed chunks in {alloc} bytes", mixed, alloc, "cannot hold"))
    return cases


def _check_rejections() -> List[str]:
    bad = []
    for name, values, why in _bad_values():
        assert values_error(**values) is not None, name  # the oracle agrees it is bad
        for label, call in (("encode", lambda: _C._testing.vmm_handle_encode(**values)),
                            ("decode", lambda: _C._testing.vmm_handle_decode(pack(**values)))):  # fmt: skip
            try:
                call()
                bad.append(f"{label} {name}: accepted")
            except torch_ipc.DescriptorError as e:
                if not re.search(why, str(e)) or (label == "decode" and "VMM handle field" not in str(e)):
                    bad.append(f"{label} {name}: {e}")
            except Exception as e:
                bad.append(f"{label} {name}: {type(e).__name__}: {e}")
    for name, raw, alloc, why in _bad_bytes():
        assert expected_error(raw, alloc) is not None, name
        try:
            _C._testing.vmm_handle_decode(raw, alloc)
            bad.append(f"decode {name}: accepted")
        except torch_ipc.DescriptorError as e:
            if not re.search(why, str(e)):
                bad.append(f"decode {name}: {e}")
        except Exception as e:
            bad.append(f"decode {name}: {type(e).__name__}: {e}")
    return bad


def test_every_invalid_value_is_a_descriptor_error():
    assert run_in_subprocess(_check_rejections, timeout=120) == []


def test_bad_cases_break_one_rule_each():
    # Each case above must differ from a valid field in the one way it names.
    good = pack(**BASE)
    assert expected_error(good) is None and expected_error(good, BASE["chunk_bytes"] * 2) is None
    assert _C._testing.vmm_handle_decode(good, BASE["chunk_bytes"] * 2)["fds"] == BASE["fds"]
    mixed = pack(**dict(BASE, n_chunks=5, chunk_bytes=0, fds=[]))
    assert _C._testing.vmm_handle_decode(mixed, 5)["n_chunks"] == 5


# ----------------------------------------------------------------------------- fuzz

FIELD_EDGES = {
    "version": [0, 1, 2, 0x80, 0xFF],
    "type": [0, 1, 2, 3, 4, 8, 9, 0x10, 0xFF],
    "n_fds": [0, 1, 2, 8, 9, 10, 0x100, 0xFFFF],
    "n_chunks": [0, 1, 2, 3, 8, 9, 10, 0xFFFF, 2**31, U32 - 1, U32],
    "id": [0, 1, 2**63, U64],
    "chunk_bytes": [0, 1, 2 << 20, 20 << 20, U64 // 3, U64 // 3 + 1, U64 // U32, 2**32, 2**32 + 1, 2**63, U64 - 1, U64],
    "pid": [0, 1, I32_MAX, I32_MAX + 1, U32],
}  # fmt: skip
FD_EDGES = [-(2**31), -2, -1, 0, 1, 2, 1023, I32_MAX]


def random_valid(rng: random.Random) -> Dict:
    type_ = rng.choice([POSIX_FD, POSIX_FD, FABRIC])
    n_chunks = rng.choice([1, 1, 2, 3, 9, 10, rng.randrange(1, 1 << 16), rng.randrange(1, U32 + 1), U32])
    if n_chunks >= 2 and rng.random() < 0.25:
        chunk_bytes = 0
    else:
        top = U64 // n_chunks
        chunk_bytes = rng.choice([1, 2 << 20, 20 << 20, top, rng.randrange(1, top + 1)])
        chunk_bytes = min(chunk_bytes, top)
    fds = []
    if type_ == POSIX_FD and chunk_bytes and n_chunks <= MAX_FDS and rng.random() < 0.7:
        fds = [rng.choice([0, 3, rng.randrange(0, 1 << 20), I32_MAX]) for _ in range(n_chunks)]
    return dict(type=type_, n_chunks=n_chunks, id=rng.choice([1, U64, rng.randrange(1, U64 + 1)]),
                chunk_bytes=chunk_bytes, pid=rng.choice([1, I32_MAX, rng.randrange(1, 1 << 22)]), fds=fds)  # fmt: skip


def mutate(raw: bytes, rng: random.Random) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        how = rng.random()
        if how < 0.3:  # a bit flip
            i = rng.randrange(64 * 8)
            b[i // 8] ^= 1 << (i % 8)
        elif how < 0.45:  # a random byte
            b[rng.randrange(64)] = rng.randrange(256)
        elif how < 0.8:  # a field set to a value at one of its edges
            name = rng.choice(list(FIELD_EDGES))
            b = bytearray(patch(bytes(b), name, rng.choice(FIELD_EDGES[name])))
        else:  # an fd slot set to an edge
            i = FD_SLOTS_AT + 4 * rng.randrange(MAX_FDS)
            b[i : i + 4] = struct.pack("<i", rng.choice(FD_EDGES))
    return bytes(b)


def alloc_size_for(values: Dict, rng: random.Random) -> Optional[int]:
    true = values["chunk_bytes"] * values["n_chunks"] if values["chunk_bytes"] else None
    candidates = [None, 0, 1, U64, rng.randrange(U64 + 1), values["n_chunks"], values["n_chunks"] - 1]
    if true is not None:
        candidates += [true, true, true - 1, min(true + 1, U64)]
    return rng.choice([c for c in candidates if c is not None and 0 <= c <= U64] + [None])


def _fuzz(seed: int, iterations: int) -> Dict:
    rng = random.Random(seed)
    failures: List[str] = []
    outcomes = {"accepted": 0, "DescriptorError": 0}
    for _ in range(iterations):
        values = random_valid(rng)
        raw = mutate(pack(**values), rng) if rng.random() < 0.9 else pack(**values)
        alloc = alloc_size_for(values, rng)
        want = expected_error(raw, alloc)
        try:
            got = _C._testing.vmm_handle_decode(raw, alloc)
        except torch_ipc.DescriptorError as e:
            outcomes["DescriptorError"] += 1
            if want is None:
                failures.append(f"rejected a valid field ({e}): {raw.hex()} alloc_size={alloc}")
            elif "VMM handle field" not in str(e):
                failures.append(f"message names no field ({e}): {raw.hex()}")
            continue
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}: {raw.hex()} alloc_size={alloc}")
            continue
        outcomes["accepted"] += 1
        if want is not None:
            failures.append(f"accepted a field the oracle rejects ({want}): {raw.hex()} alloc_size={alloc}")
            continue
        # What decodes is canonical: encoding it again gives the same bytes.
        again = _C._testing.vmm_handle_encode(**as_kwargs(got))
        if again != raw:
            failures.append(f"re-encoded differently: {raw.hex()} -> {again.hex()}")
    return dict(failures=failures[:20], n_failures=len(failures), outcomes=outcomes)


def test_fuzzed_fields_never_crash_and_match_the_oracle():
    result = run_in_subprocess(_fuzz, FUZZ_SEED, FUZZ_ITERATIONS, timeout=300)
    assert result["n_failures"] == 0, result
    # Both outcomes are exercised often enough to mean something.
    assert result["outcomes"]["accepted"] > FUZZ_ITERATIONS // 20, result["outcomes"]
    assert result["outcomes"]["DescriptorError"] > FUZZ_ITERATIONS // 4, result["outcomes"]


def _random_bytes(seed: int, iterations: int) -> List[str]:
    """Whole random fields, some with a valid version byte; every outcome agrees with the oracle."""
    rng = random.Random(seed)
    bad = []
    for _ in range(iterations):
        raw = bytearray(rng.randrange(256) for _ in range(64))
        if rng.random() < 0.5:
            raw[0] = VERSION
        alloc = rng.choice([None, 0, rng.randrange(U64 + 1)])
        want = expected_error(bytes(raw), alloc)
        try:
            _C._testing.vmm_handle_decode(bytes(raw), alloc)
            if want is not None:
                bad.append(f"accepted ({want}): {raw.hex()}")
        except torch_ipc.DescriptorError:
            if want is None:
                bad.append(f"rejected: {raw.hex()}")
        except Exception as e:
            bad.append(f"{type(e).__name__}: {e}: {raw.hex()}")
    return bad[:20]


def test_random_bytes():
    assert run_in_subprocess(_random_bytes, FUZZ_SEED + 1, 5000, timeout=120) == []
