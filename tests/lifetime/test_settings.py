"""Settings read from the environment are parsed in full (Note [checked settings]
in csrc/base/env.h): a junk value warns, naming the variable, and keeps the
default, instead of becoming the number its first characters spell (a junk
TORCH_IPC_IDLE_SECONDS was 0, which closed every idle mapping at the next
collection)."""
import os
import subprocess
import sys
import time

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc.testing import Peer

# Children import the torch_ipc this process imported (installed, or the checkout's build).
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torch_ipc.__file__)))
SETTINGS = ("from torch_ipc import _C; t = _C._testing; "
            "print(*t.idle_policy(), _C.channel_spin_ns(), t.fd_answer_seconds(), t.kv_default_lock_timeout())")
PARSERS = torch_ipc._C._testing  # env_int and env_number, which every numeric setting is read with
NAMES = ("TORCH_IPC_IDLE_SECONDS", "TORCH_IPC_IDLE_MAPPINGS", "TORCH_IPC_CHANNEL_SPIN_US",
         "TORCH_IPC_FD_ANSWER_SECONDS", "TORCH_IPC_KV_LOCK_TIMEOUT")


def _settings(**env: str):
    """(idle ns, idle mappings, channel spin ns), (fd answer s, KV lock timeout s)
    and stderr of a fresh process with `env`."""
    full = dict(os.environ, PYTHONPATH=IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    for name in NAMES:
        if name not in env:
            full.pop(name, None)
    r = subprocess.run([sys.executable, "-c", SETTINGS], env=full, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    idle_ns, idle_mappings, spin_ns, answer_s, lock_s = r.stdout.split()
    return (int(idle_ns), int(idle_mappings), int(spin_ns)), (float(answer_s), float(lock_s)), r.stderr


def test_valid_settings_are_taken():
    (idle_ns, idle_mappings, spin_ns), seconds, err = _settings(
        TORCH_IPC_IDLE_SECONDS=" 7 ", TORCH_IPC_IDLE_MAPPINGS="0", TORCH_IPC_CHANNEL_SPIN_US="12.5",
        TORCH_IPC_FD_ANSWER_SECONDS="2.5", TORCH_IPC_KV_LOCK_TIMEOUT="0",
    )
    assert (idle_ns, idle_mappings, spin_ns) == (7 * 10**9, 0, 12500)
    assert seconds == (2.5, 0.0)
    assert "torch_ipc: ignoring" not in err


def test_junk_settings_keep_their_defaults_and_warn():
    """Every numeric setting, junk at once, in the process that reads them at
    import: the idle settings (a junk value must not close every idle mapping),
    the spin (its default depends on the CPUs), the fd server's answer limit
    and the KV pool's default lock timeout (10 s each; an answer limit of 0 is
    junk: a socket takes 0 for no limit). The parser's junk forms are each
    checked below, in this process."""
    # This process read the same spin default at import, unless the variable is set here.
    if "TORCH_IPC_CHANNEL_SPIN_US" in os.environ:
        (_, _, default_spin), _, _ = _settings()
    else:
        default_spin = torch_ipc._C.channel_spin_ns()
    junk = {"TORCH_IPC_IDLE_SECONDS": "junk", "TORCH_IPC_IDLE_MAPPINGS": "60s", "TORCH_IPC_CHANNEL_SPIN_US": "100abc",
            "TORCH_IPC_FD_ANSWER_SECONDS": "0", "TORCH_IPC_KV_LOCK_TIMEOUT": "-1"}
    (idle_ns, idle_mappings, spin_ns), seconds, err = _settings(**junk)
    assert (idle_ns, idle_mappings) == (60 * 10**9, 1024), "a junk value must not close every idle mapping"
    assert spin_ns == default_spin
    assert seconds == (10.0, 10.0)
    for name, value in junk.items():
        assert f"ignoring {name}='{value}'" in err, err


@pytest.fixture
def variable(monkeypatch):
    """A variable of this test's own, which the parsers read like any setting."""
    name = "TORCH_IPC_TEST_SETTING"

    def set_to(value: str) -> str:
        monkeypatch.setenv(name, value)
        return name

    return set_to


@pytest.mark.parametrize("value", ["junk", "60s", "1e3", "-1", "99999999999999999999", "7 7", "0x10"])
def test_an_integer_setting_refuses_junk_and_warns(variable, capfd, value):
    """Not the number the first characters spell (atoll read "60s" as 60 and "junk" as 0)."""
    name = variable(value)
    assert PARSERS.env_int(name, 5, 0, 1000) == 5
    assert f"ignoring {name}='{value}': it takes an integer from 0 to 1000; using the default, 5" in capfd.readouterr().err


@pytest.mark.parametrize("value", ["junk", "2.5s", "nan", "inf", "-0.5", "1e7", ""])
def test_a_number_setting_refuses_junk_and_warns(variable, capfd, value):
    name = variable(value)
    assert PARSERS.env_number(name, 10.0, 0.0, 1e6) == 10.0
    err = capfd.readouterr().err
    if value == "":  # empty is unset: the default, no warning
        assert "ignoring" not in err, err
    else:
        assert f"ignoring {name}='{value}': it takes a number from 0 to 1000000; using the default, 10" in err, err


@pytest.mark.parametrize(("value", "expected"), [(" 7 ", 7), ("0", 0), ("1000", 1000), ("\t42\n", 42)])
def test_an_integer_setting_takes_a_whole_number_in_range(variable, capfd, value, expected):
    name = variable(value)
    assert PARSERS.env_int(name, 5, 0, 1000) == expected
    assert "ignoring" not in capfd.readouterr().err


@pytest.mark.parametrize(("value", "expected"), [("12.5", 12.5), (" 1e3 ", 1000.0), ("0", 0.0), ("1e6", 1e6)])
def test_a_number_setting_takes_a_decimal_in_range(variable, capfd, value, expected):
    name = variable(value)
    assert PARSERS.env_number(name, 10.0, 0.0, 1e6) == expected
    assert "ignoring" not in capfd.readouterr().err


def _export_cuda(n: int, seed: int):
    x = u.random_tensor((n,), torch.float32, torch.Generator().manual_seed(seed), "cuda")
    u.HELD["x"] = x
    return torch_ipc.dumps(x)


def _load_drop_and_wait(data: bytes, seconds: float):
    """Load, drop the tensors, let collections run for `seconds`; the stats then."""
    x = torch_ipc.loads(data)
    torch.cuda.synchronize()
    del x
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        torch_ipc.collect()
        time.sleep(0.05)
    return torch_ipc.stats()


@pytest.mark.cuda
def test_a_junk_idle_setting_keeps_legacy_mappings_open():
    """Note [idle mappings]: a legacy IPC mapping stays open idle for the default
    60 s when TORCH_IPC_IDLE_SECONDS is junk (it was closed at once)."""
    legacy = {"PYTORCH_CUDA_ALLOC_CONF": None}  # cudaMalloc segments: legacy IPC, not VMM
    with Peer(timeout=180, name="producer", env=legacy) as producer, Peer(
        timeout=180, name="consumer", env={"TORCH_IPC_IDLE_SECONDS": "junk"}
    ) as consumer:
        data = producer.call(_export_cuda, 1 << 20, u.new_seed())
        s = consumer.call(_load_drop_and_wait, data, 0.5)
        assert s["mappings_idle"] == 1, s
