"""Descriptors across releases: golden descriptors of each format version
(tests/wire/golden/descriptors_v<N>.json, written by tests/wire/golden/make_golden.py:
CPU, CUDA legacy IPC, VMM, a batch, an empty tensor) decode to the layout
they were made with, forever. torch_ipc's format does not depend on torch's,
so a consumer built against another torch release (or a later torch_ipc)
reads what this one wrote; a version it cannot read is refused naming both
versions. This build must also still write the newest golden format."""
import json
import struct
import sys
from pathlib import Path

import pytest
import torch

import torch_ipc

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = sorted(GOLDEN_DIR.glob("descriptors_v*.json"), key=lambda p: int(p.stem.split("_v")[1]))
NEWEST = GOLDEN[-1]
KIND = {"cuda_ipc": 1, "cuda_vmm": 2, "cpu_shm": 3}
VERSION_OFFSET = 4


def _make_golden():
    sys.path.insert(0, str(GOLDEN_DIR))
    try:
        import make_golden
    finally:
        sys.path.remove(str(GOLDEN_DIR))
    return make_golden


def _cases():
    for path in GOLDEN:
        for name, case in sorted(json.loads(path.read_text()).items()):
            yield pytest.param(path, case, id=f"{path.stem}-{name}")


def _check_layout(got: dict, want: dict) -> None:
    assert got["flags"] == want["flags"] and got["producer_pid"] == want["pid"]
    for table in ("devices", "events", "leases", "allocs", "storages", "tensors"):
        assert got[f"n_{table}"] == len(want[table]), table
    assert [(a["kind"], a["size"], a["lease"], a["handle"].hex()) for a in got["allocs"]] == [
        (KIND[a["kind"]], a["size"], a["lease"], a["handle"]) for a in want["allocs"]]
    keys = ("storage", "dtype", "flags", "storage_offset", "sizes", "strides")
    assert [{k: t[k] for k in keys} for t in got["tensors"]] == [{k: t[k] for k in keys} for t in want["tensors"]]
    assert got["payload"].hex() == want["payload"]


@pytest.mark.parametrize("path, case", list(_cases()))
def test_golden_descriptor_decodes_to_its_layout(path, case):
    data = bytes.fromhex(case["hex"])
    version = struct.unpack_from("<H", data, VERSION_OFFSET)[0]
    try:
        got = torch_ipc._C.describe(data)
    except torch_ipc.DescriptorError as e:
        assert path != NEWEST, f"this build cannot read the newest golden format: {e}"
        assert f"format version {version}" in str(e) and "this build reads version" in str(e), e
        return
    assert got["version"] == version
    _check_layout(got, case["layout"])


def test_golden_set_covers_every_kind_of_descriptor():
    cases = json.loads(NEWEST.read_text())
    assert {"cpu", "cuda_legacy", "vmm", "batch", "empty"} <= set(cases)
    kinds = {a["kind"] for case in cases.values() for a in case["layout"]["allocs"]}
    assert kinds == set(KIND)
    assert any(s["nbytes"] == 0 for s in cases["empty"]["layout"]["storages"])
    assert len(cases["batch"]["layout"]["tensors"]) >= 4


def test_this_build_still_writes_the_newest_golden_format():
    golden = _make_golden()
    assert NEWEST.name == f"descriptors_v{golden.VERSION}.json"
    for obj in (torch.arange(6.0).reshape(2, 3), {"a": torch.ones(3), "p": torch.nn.Parameter(torch.zeros(2))},
                torch.empty(0, 3)):
        data = torch_ipc.dumps(obj, consumers=None)  # nobody loads these: open-ended, reclaimed when obj dies
        assert golden.encode(golden.layout(data)) == data, (
            "the descriptor format changed: bump kVersion in csrc/wire/descriptor.h and add "
            "tests/wire/golden/descriptors_v<new>.json with tests/wire/golden/make_golden.py (keep the old files)")


@pytest.mark.parametrize("version", [1, 2, 4, 0xFFFF])
def test_an_unknown_format_version_is_refused_naming_both(version):
    golden = _make_golden()
    case = json.loads(NEWEST.read_text())["cpu"]
    data = bytearray(bytes.fromhex(case["hex"]))
    struct.pack_into("<H", data, VERSION_OFFSET, version)
    data = golden.seal(bytes(data))
    for decode in (torch_ipc._C.describe, torch_ipc.loads):
        with pytest.raises(torch_ipc.DescriptorError) as e:
            decode(data)
        assert f"format version {version}" in str(e.value) and f"reads version {golden.VERSION}" in str(e.value)
