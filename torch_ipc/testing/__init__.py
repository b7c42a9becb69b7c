"""Multi-process test helpers for torch_ipc, and an opt-in pytest plugin.

Everything that crosses a process boundary in a test goes through one of two
helpers. Their children are fresh processes: forked by a fork server that
imported torch and torch_ipc but never touched CUDA (Note [fork server]), or
spawned (multiprocessing's ``"spawn"`` start method) when ``env`` is given. They
are never forked from the test's own process: a forked child of a process that
touched CUDA cannot use CUDA.

* :func:`run_in_subprocess` runs one module-level function in a fresh child and
  returns its result, or raises :class:`PeerError` with the child's exit code
  and formatted traceback (or the signal that killed it), or
  :class:`PeerTimeout` after killing it.
* :class:`Peer` is a long-lived child that runs the calls sent to it, so it can
  keep state between them (hold a tensor it loaded) and can be killed while it
  does. A :class:`PeerGroup` hands the same named Peers to several tests, so
  that they pay for starting an interpreter (and importing torch) once.

Example::

    import os
    from torch_ipc.testing import Peer, run_in_subprocess

    def child_pid_and_env():
        return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")

    if __name__ == "__main__":
        pid, visible = run_in_subprocess(child_pid_and_env, env={"CUDA_VISIBLE_DEVICES": "1"})
        assert pid != os.getpid() and visible == "1"
        with Peer(timeout=30) as peer:
            assert peer.call(os.getpid) == peer.pid

Rules for the functions sent to a child:

* They must be defined at module level of an importable module: the child
  unpickles a function by importing its module (pytest's default ``prepend``
  import mode makes test modules importable in the child).
* Test modules must not initialise CUDA at import time (no ``torch.cuda.*``
  calls, no CUDA tensors at module level): the child imports them, and a module
  that touches CUDA on import makes every child pay for a CUDA context, in the
  parent's environment rather than the one given with ``env``.
* Arguments and results travel through a multiprocessing Pipe as standard pickle
  bytes (``pickle.dumps``; not multiprocessing's ForkingPickler, so no tensor is
  ever shared behind the test's back: a tensor argument arrives as a copy). Send
  torch_ipc descriptors (``bytes``) to share memory.

``env`` variables are in the child's environment from the moment its interpreter
starts, before it imports anything (torch reads some, such as
``PYTORCH_CUDA_ALLOC_CONF``, when it is imported; the CUDA driver reads
``CUDA_VISIBLE_DEVICES`` when it initialises). A value of ``None`` removes the
variable in the child. Without ``env`` the child has the parent's environment:
it is spawned whenever ``os.environ`` differs from the one the fork server
started with. ``TORCH_IPC_TEST_FORK_SERVER=0`` spawns every child.

The pytest plugin is opt-in: ``pytest -p torch_ipc.testing``, or
``pytest_plugins = ["torch_ipc.testing"]`` in the top-level ``conftest.py``.
Installing torch_ipc changes no other project's pytest runs. The plugin adds the
fixtures

* ``ipc_peer``: a fresh :class:`Peer` per test, closed after it (a crash at
  exit fails the test);
* ``ipc_peers``: a :class:`PeerGroup` shared by the tests of one module, whose
  peers are closed after the module's last test (same check);
* ``ipc_spawn``: :func:`run_in_subprocess` with the default timeout;

and the markers ``cuda`` and ``gpus(n)``, which skip a test on a machine without
a GPU or with fewer than ``n``, and ``serial``: under pytest-xdist the test
runs while no other test does (Note [serial tests] in _serial.py).
``TORCH_IPC_TEST_TIMEOUT`` (seconds, default 60) sets the fixtures' default
timeout.
"""
from __future__ import annotations

# The modules, by what they hold (Note [fork server] in _fork_server.py):
#   _errors       PeerError, PeerTimeout
#   _environment  the `env` a child starts with
#   _child        the child's setup and call loop; the messages' format
#   _fork_server  the process that forks children from an imported torch
#   _launch       starting a child: forked by the fork server, else spawned
#   _peer         Peer
#   _group        PeerGroup
#   _run          run_in_subprocess
#   _serial       the `serial` marker's lock under pytest-xdist
#   _plugin       the pytest markers and fixtures (re-exported below, where
#                 `pytest -p torch_ipc.testing` looks for them)
from ._errors import PeerError, PeerTimeout
from ._group import PeerGroup
from ._peer import Peer, kill_all_peers
from ._plugin import cuda_device_count, default_timeout, skip_reason
from ._run import run_in_subprocess

try:
    from ._plugin import (  # noqa: F401 - the plugin's hooks and fixtures
        ipc_peer,
        ipc_peers,
        ipc_spawn,
        pytest_collection_modifyitems,
        pytest_configure,
        pytest_runtest_protocol,
    )
except ImportError:  # no pytest: the helpers work without it, the plugin needs it
    pass

__all__ = [
    "Peer",
    "PeerError",
    "PeerGroup",
    "PeerTimeout",
    "cuda_device_count",
    "default_timeout",
    "kill_all_peers",
    "run_in_subprocess",
]
