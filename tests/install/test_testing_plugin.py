"""The multi-process test helper itself (torch_ipc.testing): results, errors,
signals, timeouts, environment, Peer and PeerGroup lifetime, and the opt-in
pytest plugin."""
import atexit
import gc
import os
import signal
import subprocess
import time

import ipc_test_utils as u
import pytest

from torch_ipc.testing import (
    Peer,
    PeerError,
    PeerGroup,
    PeerTimeout,
    cuda_device_count,
    default_timeout,
    run_in_subprocess,
    skip_reason,
)

pytest_plugins = ["pytester"]

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


class _WritesWhenDeleted:
    def __init__(self, path):
        # What __del__ uses it holds: at interpreter exit builtins and modules may be gone.
        self.fd, self.write = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), os.write

    def __del__(self):
        self.write(self.fd, b"deleted at interpreter exit\n")


def _exit_handlers(path):
    """What a child's exit runs: a Python atexit handler, a deleter of an object a
    module holds (run by the interpreter's finalization) and, registered with
    the C library, abort() (run by exit() with the static destructors)."""
    import ctypes

    atexit.register(lambda: open(path, "a").write("atexit\n"))
    _STATE["deleted at exit"] = _WritesWhenDeleted(path)
    libc = ctypes.CDLL(None)
    libc.on_exit.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    assert libc.on_exit(ctypes.cast(libc.abort, ctypes.c_void_p), None) == 0
    return os.getpid()


def _start_grandpeer():
    _STATE["peer"] = Peer(timeout=60)
    return _STATE["peer"].pid, _STATE["peer"]._fault_path


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
    # The timeout covers the child's start-up: leave it five times what one takes here.
    start = time.monotonic()
    run_in_subprocess(os.getpid, timeout=60)
    timeout = min(8.0, max(2.0, 5 * (time.monotonic() - start)))
    start = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        run_in_subprocess(_sleep_with_grandchild, str(path), timeout=timeout)
    took = time.monotonic() - start
    assert took < timeout + 5, f"took {took:.1f} s to give up after {timeout:.1f} s"
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


def _parent_and_env(key):
    return os.getppid(), os.environ.get(key)


def _print(text):
    print(text, flush=True)
    os.write(2, text.encode() + b"\n")


def test_children_have_the_environment_they_would_have_been_spawned_with(monkeypatch):
    # Environment as the fork server found it: forked by the server, with this
    # test's PYTEST_CURRENT_TEST (which changes with every test).
    ppid, current = run_in_subprocess(_parent_and_env, "PYTEST_CURRENT_TEST", timeout=60)
    assert current == os.environ["PYTEST_CURRENT_TEST"]
    if os.environ.get("TORCH_IPC_TEST_FORK_SERVER") != "0":
        assert ppid != os.getpid(), "not forked by the fork server"
    # A changed environment: spawned, with the change there from exec.
    monkeypatch.setenv("TORCH_IPC_TEST_CHANGED", "yes")
    with Peer(timeout=60) as peer:
        assert peer.call(os.getppid) == os.getpid()
        env, at_exec = peer.call(_environment)
    assert env["TORCH_IPC_TEST_CHANGED"] == "yes"
    assert b"TORCH_IPC_TEST_CHANGED=yes" in at_exec


def test_child_output_goes_where_the_parents_goes(capfd):
    run_in_subprocess(_print, "printed by a child", timeout=60)
    out, err = capfd.readouterr()
    assert "printed by a child" in out and "printed by a child" in err


def test_env_rejects_non_strings():
    with pytest.raises(TypeError):
        run_in_subprocess(_add, 1, timeout=60, env={"X": 1})


# ----------------------------------------------------------------------------- Peer
# Tests that leave their peer as they found it share one (ipc_peers); those that
# kill it, time it out or close it start their own.


def test_peer_keeps_state_between_calls(ipc_peers):
    peer = ipc_peers.get("shared")
    peer.call(_set, "x", [1, 2, 3])
    assert peer.call(_get, "x") == [1, 2, 3]
    assert peer.call(os.getpid) == peer.pid != os.getpid()


def test_peer_async_call(ipc_peers):
    peer = ipc_peers.get("shared")
    peer.call(_sleep, 0)  # started
    t0 = time.monotonic()
    peer.start_call(_sleep, 0.5)
    assert peer.busy
    assert time.monotonic() - t0 < 0.4, "start_call must not wait"
    with pytest.raises(RuntimeError):
        peer.start_call(_sleep, 0)  # one call at a time
    assert peer.result() == 0.5
    assert not peer.busy


def test_peer_error_keeps_peer_running(ipc_peers):
    peer = ipc_peers.get("shared")
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
        peer.timeout = 1
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


def test_a_forked_peer_exits_through_python_but_not_the_static_destructors(tmp_path):
    """Note [fork server exit]: atexit handlers and the interpreter's finalization
    run in a child forked by the fork server (a crash there is reported, as
    above); the C exit handlers registered before its end (libtorch's static
    destructors; here abort()) do not, unless it initialised CUDA."""
    path = tmp_path / "ran"
    if os.environ.get("TORCH_IPC_TEST_FORK_SERVER") == "0":
        pytest.skip("TORCH_IPC_TEST_FORK_SERVER=0 spawns every child")
    peer = Peer(timeout=60)
    assert peer.call(os.getppid) != os.getpid(), "forked by the fork server"
    peer.call(_exit_handlers, str(path))
    assert peer.close(check=True) == 0
    assert path.read_text().splitlines() == ["atexit", "deleted at interpreter exit"]


def test_peer_dropped_without_close_is_killed():
    peer = Peer(timeout=60)
    pid = peer.call(os.getpid)
    del peer
    gc.collect()
    assert u.process_gone(pid), "a Peer that is garbage collected must kill its child"


def test_peer_child_dies_with_its_parent():
    with Peer(timeout=60) as parent:
        grandchild, its_fault_log = parent.call(_start_grandpeer)
        assert not u.process_gone(grandchild, within=0)
        parent.kill()
        assert u.process_gone(grandchild), "a peer's peer must die when the peer is SIGKILLed"
    os.unlink(its_fault_log)  # its owner, killed, could not (Note [the suite leaves nothing in TMPDIR])


# ----------------------------------------------------------------------------- PeerGroup


def _init_mark():
    _STATE["init"] = os.getpid()


def test_peer_group_shares_and_replaces_its_peers():
    with PeerGroup(timeout=60) as group:
        a = group.get("a", init=_init_mark)
        assert a.call(_get, "init") == a.pid, "init runs in the new peer"
        assert group.get("a", init=_init_mark) is a
        with pytest.raises(ValueError):
            group.get("a", init=_init_mark, timeout=5)  # other arguments, same name
        # Dead, and nobody was told: get() says so, then starts a new one.
        os.kill(a.pid, signal.SIGKILL)
        assert u.process_gone(a.pid)
        with pytest.raises(PeerError) as info:
            group.get("a", init=_init_mark)
        assert info.value.exitcode == -signal.SIGKILL and "SIGKILL" in str(info.value)
        b = group.get("a", init=_init_mark)
        assert b.pid != a.pid and b.call(_get, "init") == b.pid
        # Left busy by a failed test: killed and replaced.
        b.start_call(_sleep, 600)
        c = group.get("a", init=_init_mark)
        assert c.pid != b.pid and u.process_gone(b.pid, within=0)
        # Killed on purpose: replaced without an error.
        c.kill()
        d = group.get("a", init=_init_mark)
        assert d.pid != c.pid and d.is_alive()
        group.close(check=True)
        assert u.process_gone(d.pid, within=0) and d.exitcode == 0
        with pytest.raises(RuntimeError):
            group.get("a")


# ----------------------------------------------------------------------------- pytest plugin


def test_fixtures(ipc_peer, ipc_spawn, ipc_peers):
    assert ipc_peer.call(_add, 1, b=1)[0] == 2
    assert ipc_spawn(_add, 3, b=4)[0] == 7
    assert ipc_spawn(_add, 3, timeout=30)[0] == 3
    assert isinstance(ipc_peers, PeerGroup) and ipc_peers.timeout == default_timeout()


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


# A project of somebody else's: the same markers and fixture names as the plugin's.
_SUITE = """
import pytest

@pytest.mark.cuda
def test_needs_cuda():
    pass

@pytest.mark.gpus(64)
def test_needs_64_gpus():
    pass

def test_uses_fixtures(ipc_peer, ipc_spawn, ipc_peers):
    import functools
    from torch_ipc.testing import PeerGroup, default_timeout, run_in_subprocess

    assert ipc_peer.call(abs, -3) == 3
    assert isinstance(ipc_spawn, functools.partial) and ipc_spawn.func is run_in_subprocess
    assert ipc_spawn.keywords == {"timeout": default_timeout()}
    assert isinstance(ipc_peers, PeerGroup)
"""


def test_plugin_is_not_loaded_without_opt_in(pytester):
    """Installing torch_ipc changes nobody's pytest runs: no fixtures, markers untouched."""
    pytester.makepyfile(test_theirs=_SUITE)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=2, errors=1)  # the marked tests run; no ipc_* fixtures
    result.stdout.fnmatch_lines(["*fixture 'ipc_peer' not found*"])
    assert "torch_ipc" not in "\n".join(line for line in result.outlines if line.startswith("plugins:"))


@pytest.mark.parametrize("how", ["-p", "conftest"])
def test_plugin_opt_in(pytester, how):
    """`pytest -p torch_ipc.testing` or `pytest_plugins` in a conftest: the
    fixtures work and the markers skip what this machine cannot run."""
    pytester.makepyfile(test_theirs=_SUITE)
    args = ["-p", "no:cacheprovider", "-rs", "--strict-markers"]
    if how == "-p":
        args += ["-p", "torch_ipc.testing"]
    else:
        pytester.makeconftest('pytest_plugins = ["torch_ipc.testing"]')
    result = pytester.runpytest_inprocess(*args)
    gpus = cuda_device_count()
    out = result.stdout.str()
    assert f"needs 64 GPUs, found {gpus}" in out, out
    if gpus == 0:
        assert "needs a CUDA GPU (torch.cuda.is_available() is False)" in out, out
        result.assert_outcomes(passed=1, skipped=2)
    else:
        result.assert_outcomes(passed=2, skipped=1)


_SERIAL_SUITE = '''
import os, time, pytest

LOG = os.environ["SERIAL_LOG"]


def _note(what):
    with open(LOG, "a") as f:
        f.write(f"{what} {time.monotonic()!r}\\n")


@pytest.mark.parametrize("i", range(6))
def test_ordinary(i):
    _note(f"start ordinary-{i}")
    time.sleep(0.2)
    _note(f"end ordinary-{i}")


@pytest.mark.serial
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
    _note(f"start alone-{i}")
    time.sleep(0.3)
    _note(f"end alone-{i}")
'''


def _intervals(log):
    """{test: (start, end)} from the lines the suite wrote."""
    out = {}
    for line in log.read_text().splitlines():
        edge, name, when = line.split()
        start, end = out.get(name, (None, None))
        out[name] = (float(when), end) if edge == "start" else (start, float(when))
    return out


def test_serial_tests_run_alone_under_xdist(pytester, tmp_path, monkeypatch):
    pytest.importorskip("xdist")
    log = tmp_path / "log"
    monkeypatch.setenv("SERIAL_LOG", str(log))
    pytester.makepyfile(test_theirs=_SERIAL_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "torch_ipc.testing", "-n", "2",
                                           "--strict-markers")
    result.assert_outcomes(passed=8)
    spans = _intervals(log)
    assert len(spans) == 8, spans
    for name, (start, end) in spans.items():
        if not name.startswith("alone"):
            continue
        overlapping = [o for o, (s, e) in spans.items() if o != name and s < end and e > start]
        assert overlapping == [], f"{name} ran while {overlapping} did"
    ordinary = [o for o in spans if o.startswith("ordinary")]
    together = [(a, b) for a in ordinary for b in ordinary
                if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]]
    assert together, f"no two ordinary tests ran at once (the lock serialised everything): {spans}"
