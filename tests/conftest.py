"""Configuration of torch_ipc's own test suite: its markers (``cuda``,
``gpus(n)``) and fixtures (``ipc_peer``, ``ipc_peers``, ``ipc_spawn``) come from
the opt-in ``torch_ipc.testing`` pytest plugin, as in any project that uses it.

Note [the suite leaves nothing in TMPDIR]
The run gets a private $TMPDIR (xdist workers and every child inherit it;
pytest's own tmp_path folders stay where they were, PYTEST_DEBUG_TEMPROOT).
When the run ends (and its processes had up to 10 s to exit), whatever is
left in it was left by the suite or by torch_ipc, not by another program on
the machine: the run fails and names it.

The tests sit in folders by what they protect: wire (the descriptor format),
sharing, lifetime, channel, security, containers, weights, kv, distributed,
install (what a new user meets: install, README, layers). Helpers several
folders use live here, at the top: pytest puts this folder on sys.path, and a
test that needs another folder's test module imports it by folder
(``from wire.test_descriptor import seal``).
"""
import gc
import multiprocessing
import multiprocessing.util
import os
import shutil
import sys
import tempfile
import time

import pytest

pytest_plugins = ["torch_ipc.testing"]

_SCRATCH_KEY = "TORCH_IPC_SUITE_TMPDIR"


def pytest_configure(config):
    if hasattr(config, "workerinput") or _SCRATCH_KEY in os.environ:
        return  # an xdist worker (or a nested run): the controller set it up
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    # numpy's OpenBLAS starts a thread a core in every interpreter that imports
    # torch, and they spin: ~5% of each of the suite's ~60 fresh interpreters'
    # CPU time on a 2-core machine, in a suite that keeps both cores busy.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # torch's own caches (torch.compile's, which DTensor tests reach) stay
    # where torch keeps them: they are torch's, not something the suite left.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{os.getuid()}"))
    scratch = tempfile.mkdtemp(prefix="suite-tmp.")
    os.environ["TMPDIR"] = os.environ[_SCRATCH_KEY] = scratch
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config.stash[_scratch] = scratch


def pytest_collection_finish(session):
    """Note [tests collect garbage often]: what the tests imported and pytest
    collected lives to the end; out of every later collection."""
    gc.collect()
    gc.freeze()


# Note [tests collect garbage often]
# Tests wait for releases by polling gc.collect() and torch_ipc.collect()
# (ipc_test_utils.wait_for_stats, collect_until). A full collection walks every
# tracked object: with torch and the collected suite loaded, about 0.1 s each,
# several a second in each worker. Frozen after collection (gc.freeze), what
# was loaded is skipped and a collection walks what the tests made since. The
# fork server freezes what it imported for its children the same way
# (torch_ipc/testing/_fork_server.py), a spawned child what it imported at
# start (_child.py).


_scratch = pytest.StashKey[str]()
_SETTLE_S = 10.0  # xdist workers and their children may still be exiting: their atexit removes files


def _left_in(scratch: str) -> list:
    deadline = time.monotonic() + _SETTLE_S
    left = _listed(scratch)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _listed(scratch)
    return left


def _listed(scratch: str) -> list:
    """What is in `scratch`, less what this process removes as it exits (a
    serial run's tests ran here): its multiprocessing temp folder, and the
    test helpers' scratch folders, removed now."""
    helpers = sys.modules.get("weights_helpers")
    if helpers is not None:
        helpers._remove_folders()
    mine = multiprocessing.process.current_process()._config.get("tempdir")
    return sorted(e for e in os.listdir(scratch) if os.path.join(scratch, e) != mine)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    scratch = session.config.stash.get(_scratch, None)
    if scratch is None:
        return
    left = _left_in(scratch)
    if not left:
        if (multiprocessing.process.current_process()._config.get("tempdir") or "").startswith(scratch + os.sep):
            # multiprocessing removes its own folder as this process exits
            # (priority -100); the scratch folder goes right after it.
            multiprocessing.util.Finalize(None, shutil.rmtree, args=(scratch, True), exitpriority=-101)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write(f"\nthe suite left {len(left)} entries in its TMPDIR {scratch}: {left[:10]} "
                       "(Note [the suite leaves nothing in TMPDIR] in tests/conftest.py)\n", red=True)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
