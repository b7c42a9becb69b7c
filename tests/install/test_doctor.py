"""``python -m torch_ipc doctor`` runs on any machine (a CPU-only one too),
prints its table, and each row says what is true of this machine."""
import json
import os
import resource
import subprocess
import sys

import pytest
import torch

import torch_ipc
from torch_ipc import _C
from torch_ipc._build_info import TORCH_VERSION

# Children import the torch_ipc this process imported: the installed package,
# or the checkout's in-place build (the checkout has no _C after an install).
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torch_ipc.__file__)))


def _doctor(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "torch_ipc", "doctor", *args], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _has_nvidia_devices() -> bool:
    return os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/version")


def _cuda_driver_initialises() -> bool:
    """Whether libcuda loads and cuInit succeeds in a fresh process (not this one:
    the test process stays free of CUDA)."""
    code = "import ctypes; print(ctypes.CDLL('libcuda.so.1').cuInit(0))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return r.returncode == 0 and r.stdout.strip() == "0"


@pytest.fixture(scope="module")
def doctor_json():
    """`python -m torch_ipc doctor --json` run once for the module (it starts
    two interpreters with torch: itself and the consumer of its round trips)."""
    r = _doctor("--json")
    assert r.returncode in (0, 1), r.stderr[-3000:]
    return r


def test_doctor_rows_are_true_for_this_machine(doctor_json):
    r = doctor_json
    rows = {row["check"]: row for row in json.loads(r.stdout)}
    assert r.returncode == (1 if any(row["status"] == "FAIL" for row in rows.values()) else 0)
    for row in rows.values():
        assert row["status"] in ("ok", "FAIL", "warn", "info"), row
        assert row["status"] in ("ok", "info") or row["fix"], f"a failing row says no fix: {row}"

    versions = rows["torch and torch_ipc"]["detail"]  # the extension's path and the torch it was built against
    assert torch.__version__ in versions and _C.__file__ in versions, versions
    assert f"built against torch {TORCH_VERSION}" in versions, versions
    gpu = torch.cuda.is_available()
    driver = rows["CUDA driver"]
    if gpu:
        assert driver["status"] == "ok", driver
        for i in range(torch.cuda.device_count()):
            assert rows[f"CUDA IPC cuda:{i}"]["status"] == "ok", rows[f"CUDA IPC cuda:{i}"]
    else:
        assert rows["CUDA IPC"]["status"] == "info" and "no CUDA" in rows["CUDA IPC"]["detail"]
        if _has_nvidia_devices():  # a CPU-only torch on a GPU machine: the row says whether the driver works
            assert driver["status"] == ("ok" if _cuda_driver_initialises() else "FAIL"), driver
        else:
            assert driver["status"] == "info" and "no NVIDIA GPU here" in driver["detail"], driver

    st = os.statvfs("/dev/shm")
    shm = rows["/dev/shm"]
    free_ok = st.f_bavail * st.f_frsize >= 1 << 30
    assert (shm["status"] == "ok") == free_ok, shm
    total = st.f_blocks * st.f_frsize
    assert f"{total / (1 << 30):.1f} GiB" in shm["detail"] or f"{total / (1 << 20):.1f} MiB" in shm["detail"], shm

    with open("/proc/self/status") as f:
        nested = len(next(line for line in f if line.startswith("NSpid:")).split()) > 2
    assert rows["PID namespace"]["status"] == ("info" if nested else "ok"), rows["PID namespace"]
    other = rows["peers in other namespaces"]
    assert other["status"] == "ok" and "life file /dev/shm/torch_ipc.life." in other["detail"], other

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert str(soft) in rows["open files"]["detail"] or soft == resource.RLIM_INFINITY
    assert rows["fd socket"]["status"] == "ok"
    assert rows["pidfd_getfd"]["status"] in ("ok", "info")


def test_doctor_prints_a_table_and_says_how_to_call_it(doctor_json, capsys, monkeypatch):
    """Without --json the same rows as a table (the checks themselves ran once,
    in the --json run: here they are that run's rows, so that this process
    stays free of CUDA), the fixes under their rows, and the exit status."""
    from torch_ipc import doctor
    from torch_ipc.__main__ import _main

    rows = [doctor.Row(**row) for row in json.loads(doctor_json.stdout)]
    monkeypatch.setattr(doctor, "run_checks", lambda: rows)
    assert _main(["doctor"]) == doctor_json.returncode
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["check", "status", "detail"], lines[:2]
    width = max(len(row.check) for row in rows + [doctor.Row("check", "", "")])
    for row in rows:
        line = next((line for line in lines if line[:width].rstrip() == row.check), None)
        assert line is not None and line[width:].split()[0] == row.status, (row, lines)
        assert line.endswith(row.detail), (row, line)
        assert not row.fix or any(line.strip() == f"fix: {row.fix}" for line in lines), (row, lines)

    assert _main([]) == 2  # no command: the usage, on stderr
    assert "usage: python -m torch_ipc doctor" in capsys.readouterr().err


def test_one_consumer_process_answers_for_every_device(monkeypatch):
    """The round trips of all devices go through one fresh process; each
    device gets its own answer, and a consumer that stops half way fails the
    devices it did not answer for (here: CPU tensors standing for devices;
    the rows test above sees every GPU answered by one process)."""
    from torch_ipc import doctor

    stops = """
import sys, torch, torch_ipc
first = sys.stdin.read().split()[0]
torch_ipc.loads(bytes.fromhex(first)).fill_(7)
print("ok", flush=True)
sys.exit("the consumer gave up")
"""
    monkeypatch.setattr(doctor, "_ROUND_TRIPS", stops)
    assert doctor._round_trips(["cpu", "cpu"]) == [None, "the consumer gave up"]
