"""A descriptor's producer field is checked against the leases it names (Note
[forwarder cross-check] in csrc/core/import.cpp), and the pidfds kept for
liveness are a bounded cache (Note [bounded pidfd cache] in
csrc/os/process.cpp): naming many live processes costs a bounded number of fds,
also under a low fd limit. CPU only."""
import os
import resource
import subprocess

import pytest
import torch
from wire.test_descriptor import patch

import torch_ipc
from torch_ipc.testing import Peer, run_in_subprocess

_HELD = {}
PRODUCER_PID_OFFSET = 36  # Note [descriptor layout]: u32 pid, u64 start time


def _export_and_hold():
    t = torch.arange(64, dtype=torch.float32)
    _HELD["t"] = t
    return torch_ipc.dumps(t, consumers=None)


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _forge(data: bytes, pid: int) -> bytes:
    """``data`` naming the live process ``pid`` as its producer."""
    return patch(data, PRODUCER_PID_OFFSET, "<IQ", pid, _start_time(pid))


def _sleepers(n: int):
    return [subprocess.Popen(["sleep", "120"]) for _ in range(n)]


def test_descriptor_naming_another_live_process_does_not_load():
    with Peer() as producer, Peer() as bystander:
        data = producer.call(_export_and_hold)
        assert torch_ipc.loads(data)[:2].tolist() == [0.0, 1.0]  # the real one loads
        with pytest.raises(torch_ipc.ReleasedError, match="holds nothing"):
            torch_ipc.loads(_forge(data, bystander.pid))


def _forged_loads_under_a_low_fd_limit(forged) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    fds_before = len(os.listdir("/proc/self/fd"))
    outcomes = {}
    for data in forged:
        try:
            torch_ipc.loads(data)
            name = "loaded"
        except Exception as e:  # counted for the test
            name = type(e).__name__ + ("" if not isinstance(e, OSError) else f"[{e.errno}]")
        outcomes[name] = outcomes.get(name, 0) + 1
    fds_after = len(os.listdir("/proc/self/fd"))
    own = torch_ipc.loads(torch_ipc.dumps(torch.ones(3)))  # a new export still works
    return {"outcomes": outcomes, "fds_before": fds_before, "fds_after": fds_after, "own": own.tolist()}


def test_many_named_processes_keep_a_bounded_number_of_fds():
    sleepers = _sleepers(80)
    try:
        with Peer() as producer:
            data = producer.call(_export_and_hold)
            forged = [_forge(data, p.pid) for p in sleepers]
            result = run_in_subprocess(_forged_loads_under_a_low_fd_limit, forged)
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
    assert result["outcomes"] == {"ReleasedError": 80}, result
    assert result["fds_after"] - result["fds_before"] <= 34, result  # at most 32 pidfds cached
    assert result["own"] == [1.0, 1.0, 1.0]
