"""The multi-process test helper itself (torch_ipc.testing): results, errors,
signals, timeouts, environment, Peer lifetime, and the pytest plugin."""
import atexit
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import ipc_test_utils as u
from torch_ipc.testing import Peer, PeerError, PeerTimeout, run_in_subprocess, skip_reason

# ----------------------------------------------------------------------------- child functions
# (module level: the child imports this module to find them)

_STATE = {}


def _add(a, b=0):
    return a + b, os.getpid()


def _big_result(n):
    return os.urandom(n)


def _raise_value_error(text):
    raise ValueError(text)


def _raise_unpicklable():
    class Local(Exception):
        pass

    raise Local("not importable by the parent")


def _kill_self(sig):
    if sig == signal.SIGSEGV:
        import ctypes

        ctypes.string_at(0)  # a real segfault
    os.kill(os.getpid(), sig)
    time.sleep(30)


def _sleep_with_grandchild(path):
    child = subprocess.Popen(["sleep", "600"])
    with open(path, "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    time.sleep(600)


def _environment():
    with open("/proc/self/environ", "rb") as f:
        at_exec = f.read().split(b"\0")
    return dict(os.environ), at_exec


def _torch_threads():
    import torch

    return torch.get_num_threads()


def _set(key, value):
    _STATE[key] = value


def _get(key):
    return _STATE[key]


def _sleep(seconds):
    time.sleep(seconds)
    return seconds


def _crash_at_exit():
    atexit.register(os.kill, os.getpid(), signal.SIGSEGV)
    return "returned"


def _start_grandpeer():
    _STATE["peer"] = Peer(timeout=60)
    return _STATE["peer"].pid


# ----------------------------------------------------------------------------- run_in_subprocess


def test_returns_value_from_another_process():
    value, pid = run_in_subprocess(_add, 2, b=40, timeout=60)
    assert value == 42
    assert pid != os.getpid()
    assert u.process_gone(pid, within=0), "the child must be reaped when run_in_subprocess returns"


def test_large_result_comes_back_whole():
    data = run_in_subprocess(_big_result, 16 << 20, timeout=60)
    assert isinstance(data, bytes) and len(data) == 16 << 20


def test_reports_exception_with_traceback_and_exit_code():
    with pytest.raises(PeerError) as info:
        run_in_subprocess(_raise_value_error, "kaboom 123", timeout=60)
    err = info.value
    assert err.exitcode == 1
    assert err.exc_type.endswith("ValueError")
    assert isinstance(err.exception, ValueError) and str(err.exception) == "kaboom 123"
    assert "_raise_value_error" in err.child_traceback
    assert "Traceback (most recent call last)" in err.child_traceback
    assert "kaboom 123" in str(err) and "_raise_value_error" in str(err)
    assert not isinstance(err, PeerTimeout)


def test_reports_exception_that_does_not_pickle():
    with pytest.raises(PeerError) as info:
        run_in_subprocess(_raise_unpicklable, timeout=60)
    assert info.value.exception is None
    assert "not importable by the parent" in str(info.value)
    assert info.value.exitcode == 1


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL, signal.SIGABRT])
def test_reports_child_killed_by_signal(sig):
    with pytest.raises(PeerError) as info:
        run_in_subprocess(_kill_self, sig, timeout=60)
    err = info.value
    assert err.exitcode == -sig and err.signal == sig
    assert signal.Signals(sig).name in str(err)
    if sig == signal.SIGSEGV:  # faulthandler says where it crashed
        assert "Segmentation fault" in err.child_traceback
        assert "_kill_self" in err.child_traceback


def test_timeout_kills_child_and_its_process_group(tmp_path):
    path = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        run_in_subprocess(_sleep_with_grandchild, str(path), timeout=8)
    took = time.monotonic() - start
    assert took < 8 + 5, f"took {took:.1f} s to give up"
    err = info.value
    assert isinstance(err, PeerError) and isinstance(err, TimeoutError)
    assert err.exitcode == -signal.SIGKILL
    assert "_sleep_with_grandchild" in err.child_traceback, "the child's stack at the timeout"
    child, grandchild = map(int, path.read_text().split())
    assert child == err.pid
    assert u.process_gone(child, within=0), "the child must be dead and reaped"
    assert u.process_gone(grandchild), "the child's own children must be killed too"


def test_returned_but_crashed_at_exit_is_an_error():
    with pytest.raises(PeerError) as info:
        run_in_subprocess(_crash_at_exit, timeout=60)
    assert info.value.exitcode == -signal.SIGSEGV
    assert "interpreter exit" in str(info.value)


def test_unpicklable_function_fails_in_parent():
    with pytest.raises(TypeError, match="module level"):
        run_in_subprocess(lambda: 1, timeout=60)


def test_env_is_set_before_the_interpreter_starts(monkeypatch):
    monkeypatch.setenv("TORCH_IPC_TEST_DROPPED", "parent value")
    before = dict(os.environ)
    env, at_exec = run_in_subprocess(
        _environment,
        timeout=60,
        env={"TORCH_IPC_TEST_VAR": "from the test", "TORCH_IPC_TEST_DROPPED": None},
    )
    assert env["TORCH_IPC_TEST_VAR"] == "from the test"
    assert "TORCH_IPC_TEST_DROPPED" not in env
    # /proc/self/environ is the environment the process was exec'd with: the
    # variable was there before anything was imported.
    assert b"TORCH_IPC_TEST_VAR=from the test" in at_exec
    assert not any(entry.startswith(b"TORCH_IPC_TEST_DROPPED=") for entry in at_exec)
    assert dict(os.environ) == before, "the parent's environment must be left as it was"


def test_env_is_in_effect_when_torch_initialises():
    import torch

    if torch.get_num_threads() == 1:
        pytest.skip("this process already runs torch with one thread; nothing to tell apart")
    # torch reads OMP_NUM_THREADS when it is imported, and the child imports
    # torch (through torch_ipc) before the function runs.
    assert run_in_subprocess(_torch_threads, timeout=60, env={"OMP_NUM_THREADS": "1"}) == 1


def test_env_rejects_non_strings():
    with pytest.raises(TypeError):
        run_in_subprocess(_add, 1, timeout=60, env={"X": 1})


# ----------------------------------------------------------------------------- Peer


def test_peer_keeps_state_between_calls():
    with Peer(timeout=60) as peer:
        peer.call(_set, "x", [1, 2, 3])
        assert peer.call(_get, "x") == [1, 2, 3]
        assert peer.call(os.getpid) == peer.pid != os.getpid()


def test_peer_async_call():
    with Peer(timeout=60) as peer:
        peer.call(_sleep, 0)  # started
        t0 = time.monotonic()
        peer.start_call(_sleep, 0.5)
        assert peer.busy
        assert time.monotonic() - t0 < 0.4, "start_call must not wait"
        with pytest.raises(RuntimeError):
            peer.start_call(_sleep, 0)  # one call at a time
        assert peer.result() == 0.5
        assert not peer.busy


def test_peer_error_keeps_peer_running():
    with Peer(timeout=60) as peer:
        peer.call(_set, "k", 7)
        with pytest.raises(PeerError) as info:
            peer.call(_raise_value_error, "in a peer")
        assert info.value.exitcode is None and isinstance(info.value.exception, ValueError)
        assert "in a peer" in info.value.child_traceback
        assert peer.call(_get, "k") == 7


def test_peer_kill_while_busy_reports_the_signal():
    peer = Peer(timeout=60)
    try:
        peer.call(_set, "k", 1)
        peer.start_call(_sleep, 600)
        peer.kill()
        assert peer.exitcode == -signal.SIGKILL, "kill() waits until the child is reaped"
        with pytest.raises(PeerError) as info:
            peer.result()
        assert info.value.exitcode == -signal.SIGKILL and "SIGKILL" in str(info.value)
        with pytest.raises(PeerError):
            peer.call(_get, "k")
    finally:
        assert peer.close(check=True) == -signal.SIGKILL  # killed on purpose: no error


def test_peer_timeout_kills_it():
    peer = Peer(timeout=60)
    try:
        peer.call(_sleep, 0)  # started: the next call's timeout is the call's alone
        peer.timeout = 2
        with pytest.raises(PeerTimeout):
            peer.call(_sleep, 600)
        assert not peer.is_alive() and u.process_gone(peer.pid, within=0)
        with pytest.raises(PeerError):
            peer.call(_sleep, 0)
    finally:
        peer.close()


def test_peer_close_is_idempotent_and_clean():
    peer = Peer(timeout=60)
    pid = peer.call(os.getpid)
    assert peer.close(check=True) == 0
    assert peer.close(check=True) == 0
    assert u.process_gone(pid, within=0)
    with pytest.raises(PeerError):
        peer.call(os.getpid)


def test_peer_close_while_busy_kills_at_once():
    peer = Peer(timeout=60)
    peer.call(_sleep, 0)
    peer.start_call(_sleep, 600)
    t0 = time.monotonic()
    assert peer.close(check=True) == -signal.SIGKILL  # an abandoned call is no error
    assert time.monotonic() - t0 < 5
    assert u.process_gone(peer.pid, within=0)


def test_peer_close_check_reports_a_crash_at_exit():
    peer = Peer(timeout=60)
    peer.call(_crash_at_exit)
    with pytest.raises(PeerError) as info:
        peer.close(check=True)
    assert info.value.exitcode == -signal.SIGSEGV


def test_peer_dropped_without_close_is_killed():
    peer = Peer(timeout=60)
    pid = peer.call(os.getpid)
    del peer
    gc.collect()
    assert u.process_gone(pid), "a Peer that is garbage collected must kill its child"


def test_peer_child_dies_with_its_parent():
    with Peer(timeout=60) as parent:
        grandchild = parent.call(_start_grandpeer)
        assert not u.process_gone(grandchild, within=0)
        parent.kill()
        assert u.process_gone(grandchild), "a peer's peer must die when the peer is SIGKILLed"


# ----------------------------------------------------------------------------- pytest plugin


def test_fixtures(peer, spawn):
    assert peer.call(_add, 1, b=1)[0] == 2
    assert spawn(_add, 3, b=4)[0] == 7
    assert spawn(_add, 3, timeout=30)[0] == 3


def test_skip_reasons():
    cuda, gpus2, gpus_bad = pytest.mark.cuda.mark, pytest.mark.gpus(2).mark, pytest.mark.gpus("x").mark
    no_gpu = "needs a CUDA GPU (torch.cuda.is_available() is False)"
    assert skip_reason([cuda], 0) == no_gpu
    assert skip_reason([cuda], 1) is None
    assert skip_reason([gpus2], 0) == "needs 2 GPUs, found 0"
    assert skip_reason([cuda, gpus2], 1) == "needs 2 GPUs, found 1"
    assert skip_reason([gpus2], 2) is None
    assert skip_reason([pytest.mark.gpus(n=3).mark], 2) == "needs 3 GPUs, found 2"
    with pytest.raises(ValueError):
        skip_reason([gpus_bad], 8)


@pytest.mark.parametrize("entry_point", [False, True], ids=["conftest", "entry-point"])
def test_plugin_markers_in_a_pytest_run(tmp_path, entry_point):
    """Run pytest on a small suite and read what the plugin skipped and why.

    With `entry_point`, a distribution on the path advertises the plugin as an
    installed torch_ipc does (pytest11), and the suite's conftest must not
    register it a second time.
    """
    import torch_ipc
    from torch_ipc.testing import cuda_device_count

    repo = os.path.dirname(os.path.dirname(os.path.abspath(torch_ipc.__file__)))
    suite = tmp_path / "suite"
    suite.mkdir()
    with open(os.path.join(os.path.dirname(__file__), "conftest.py")) as f:
        (suite / "conftest.py").write_text(f.read())
    (suite / "test_marked.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.cuda
            def test_needs_cuda():
                pass

            @pytest.mark.gpus(64)
            def test_needs_64_gpus():
                pass

            def test_uses_fixtures(peer, spawn):
                assert peer.call(abs, -3) == spawn(abs, -3) == 3
            """
        )
    )
    path = [repo]
    if entry_point:
        site = tmp_path / "site"
        info = site / "torch_ipc_plugin_probe-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_ipc_plugin_probe\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text("[pytest11]\ntorch_ipc = torch_ipc.testing\n")
        path.append(str(site))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "--strict-markers", str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    if entry_point:
        # pytest loads one plugin per name: an installed torch_ipc's own entry
        # point wins over the probe's, and either proves the entry-point path.
        plugins = [line for line in out.splitlines() if line.startswith("plugins:")]
        assert plugins and ("torch_ipc_plugin_probe" in plugins[0] or "torch_ipc-" in plugins[0]), (
            "the entry point was not used:\n" + out
        )
    gpus = cuda_device_count()
    assert f"needs 64 GPUs, found {gpus}" in out, out
    if gpus == 0:
        assert "needs a CUDA GPU (torch.cuda.is_available() is False)" in out, out
        assert "1 passed, 2 skipped" in out, out
    else:
        assert "2 passed, 1 skipped" in out, out
