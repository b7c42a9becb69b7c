"""Write tests/wire/golden/descriptors_v<N>.json: descriptors of the current format
version, each as hex with the layout it must decode to (tests/wire/test_golden.py).

Run it only when the format version changes, to ADD the new version's file;
the files of earlier versions stay, and each build must decode them or refuse
them naming both versions. The CPU, batch and empty descriptors come from a
real dumps(); the CUDA legacy and VMM ones, which need a GPU to export, are
encoded here from a layout, by the same encoder that reproduces the real ones
byte for byte (checked before anything is written).

    PYTHONPATH=. python tests/wire/golden/make_golden.py   # from the repository root, in-place build
"""
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for test_descriptor's independent layout

import torch  # noqa: E402
from test_descriptor import HEADER, seal  # noqa: E402

import torch_ipc  # noqa: E402

VERSION = 3
MAGIC = b"TIPC"
KIND = {"cuda_ipc": 1, "cuda_vmm": 2, "cpu_shm": 3}
NONE16 = 0xFFFF
NO_ALLOC = 0xFFFFFFFF


def encode(d: dict) -> bytes:
    """The descriptor of layout ``d`` (the format of csrc/wire/descriptor.cpp's encode)."""
    body = b"".join(bytes.fromhex(u) for u in d["devices"])
    body += b"".join(struct.pack("<H6x", e["device"]) + bytes.fromhex(e["handle"]) for e in d["events"])
    body += b"".join(struct.pack("<IIQIIQI4x", ls["pid"], ls["segment"], ls["start_time"], ls["slot"], ls["life"],
                                 ls["generation"], ls["pidns"]) for ls in d["leases"])
    body += b"".join(struct.pack("<BxHH2xQ", KIND[a["kind"]], a["device"], a["lease"], a["size"])
                     + bytes.fromhex(a["handle"]) for a in d["allocs"])
    body += b"".join(struct.pack("<IH2xQQ", s["alloc"], s["device"], s["offset"], s["nbytes"]) for s in d["storages"])
    for t in d["tensors"]:
        ndim = len(t["sizes"])
        body += struct.pack("<IBBHq", t["storage"], t["dtype"], ndim, t["flags"], t["storage_offset"])
        body += struct.pack(f"<{ndim}q", *t["sizes"]) + struct.pack(f"<{ndim}q", *t["strides"])
    payload = bytes.fromhex(d["payload"])
    total = HEADER.size + len(body) + len(payload)
    header = HEADER.pack(MAGIC, VERSION, d["flags"], total, len(d["devices"]), len(d["events"]), len(d["leases"]), 0,
                         len(d["allocs"]), len(d["storages"]), len(d["tensors"]), len(payload), d["pid"],
                         d["start_time"], d["life"], d["pidns"], bytes.fromhex(d["boot_id"]), 0)
    return seal(header + body + payload)


def layout(data: bytes) -> dict:
    """The layout of a real descriptor, read with test_descriptor's independent parser."""
    from test_descriptor import layout as parse

    p, _ = parse(data)
    return {
        "flags": p["flags"], "pid": p["pid"], "start_time": p["start_time"], "life": p["life"], "pidns": p["pidns"],
        "boot_id": p["boot"].hex(),
        "devices": [u.hex() for u in p["devices"]],
        "events": [{"device": e["device"], "handle": data[e_off(p, i) + 8:e_off(p, i) + 72].hex()}
                   for i, e in enumerate(p["events"])],
        "leases": [{k: ls[k] for k in ("pid", "segment", "start_time", "slot", "life", "generation", "pidns")}
                   for ls in p["leases"]],
        "allocs": [{"kind": {v: k for k, v in KIND.items()}[a["kind"]], "device": a["device"], "lease": a["lease"],
                    "size": a["size"], "handle": a["handle"].hex()} for a in p["allocs"]],
        "storages": [{"alloc": s["alloc"], "device": s["device"], "offset": s["byte_offset"], "nbytes": s["nbytes"]}
                     for s in p["storages"]],
        "tensors": [{k: t[k] for k in ("storage", "dtype", "flags", "storage_offset", "sizes", "strides")}
                    for t in p["tensors"]],
        "payload": p["payload"].hex(),
    }  # fmt: skip


def e_off(p: dict, i: int) -> int:
    """Where event i starts (after the header and the device table)."""
    return HEADER.size + 16 * len(p["devices"]) + 80 * i


def vmm_handle(n_chunks: int, export_id: int, chunk_bytes: int, pid: int) -> str:
    """Note [VMM handle field] in csrc/wire/vmm_handle.h, POSIX fds, none sent."""
    field = struct.pack("<BBHIQQI", 1, 1, 0, n_chunks, export_id, chunk_bytes, pid) + struct.pack("<9i", *[-1] * 9)
    return field.hex()


def cuda_layout(base: dict, kind: str) -> dict:
    """``base`` (one CPU tensor) moved onto a GPU: a device table, an event, the allocation on it."""
    d = json.loads(json.dumps(base))
    d["flags"] = 1  # kHasCuda
    d["devices"] = ["5a" * 16]  # the GPU's UUID
    d["events"] = [{"device": 0, "handle": ("e1" * 64)}]
    alloc = d["allocs"][0]
    alloc.update(kind=kind, device=0, size=2 << 20)
    alloc["handle"] = ("c7" * 64) if kind == "cuda_ipc" else vmm_handle(1, 0x1234_5678_9ABC, 2 << 20, d["pid"])
    d["storages"][0]["offset"] = 512  # a block inside the cudaMalloc segment
    return d


def main() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    real = {
        "cpu": torch_ipc.dumps(x),
        "batch": torch_ipc.dumps({"w": x, "b": torch.ones(5, dtype=torch.bfloat16),
                                  "p": torch.nn.Parameter(torch.zeros(2, 2)), "v": x[1:, ::2]}),
        "empty": torch_ipc.dumps(torch.empty(0, 3)),
    }
    goldens = {}
    for name, data in real.items():
        d = layout(data)
        assert encode(d) == data, f"the encoder here does not reproduce the real {name} descriptor"
        goldens[name] = d
    goldens["cuda_legacy"] = cuda_layout(goldens["cpu"], "cuda_ipc")
    goldens["vmm"] = cuda_layout(goldens["cpu"], "cuda_vmm")
    out = {name: {"hex": encode(d).hex(), "layout": d} for name, d in goldens.items()}
    path = os.path.join(HERE, f"descriptors_v{VERSION}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
