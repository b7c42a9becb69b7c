"""The opt-in pytest plugin: the markers ``cuda``, ``gpus(n)`` and ``serial``,
and the fixtures ``ipc_peer``, ``ipc_peers`` and ``ipc_spawn``.
torch_ipc.testing re-exports its hooks and fixtures, so that
``pytest -p torch_ipc.testing`` finds them."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Iterator, List, Optional

from ._group import PeerGroup
from ._peer import Peer
from ._run import run_in_subprocess
from ._serial import turn

_gpu_count: Optional[int] = None


def cuda_device_count() -> int:
    """The number of CUDA GPUs torch sees in this process, computed once and cached.

    0 when torch is a CPU-only build or no driver or GPU is there.
    """
    global _gpu_count
    if _gpu_count is None:
        count = 0
        try:
            import torch

            if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
                count = int(torch.cuda.device_count())
        except Exception:
            count = 0
        _gpu_count = count
    return _gpu_count


def default_timeout() -> float:
    """Seconds the plugin's fixtures allow per call (``TORCH_IPC_TEST_TIMEOUT``, default 60)."""
    try:
        value = float(os.environ.get("TORCH_IPC_TEST_TIMEOUT", "60"))
    except ValueError:
        value = 60.0
    return value if value > 0 else 60.0


def _gpus_needed(mark: Any) -> int:
    args = list(mark.args)
    if "n" in mark.kwargs:
        args.append(mark.kwargs["n"])
    if len(args) != 1 or not isinstance(args[0], int) or isinstance(args[0], bool) or args[0] < 1:
        raise ValueError(f"@pytest.mark.gpus takes one positive int (the number of GPUs), got {mark}")
    return int(args[0])


def skip_reason(marks: List[Any], gpu_count: int) -> Optional[str]:
    """Why a test with these markers cannot run on a machine with ``gpu_count`` GPUs (``None``: it can)."""
    needed = 0
    for mark in marks:
        if mark.name == "cuda":
            needed = max(needed, 1)
            if gpu_count < 1:
                return "needs a CUDA GPU (torch.cuda.is_available() is False)"
        elif mark.name == "gpus":
            needed = max(needed, _gpus_needed(mark))
    if needed > gpu_count:
        if gpu_count == 0 and needed == 1:
            return "needs a CUDA GPU (torch.cuda.is_available() is False)"
        return f"needs {needed} GPUs, found {gpu_count}"
    return None


try:
    import pytest
except ImportError:  # the helpers work without pytest; the plugin needs it
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    def pytest_configure(config: Any) -> None:
        config.addinivalue_line("markers", "cuda: the test needs a CUDA GPU (skipped without one)")
        config.addinivalue_line("markers", "gpus(n): the test needs at least n CUDA GPUs (skipped with fewer)")
        config.addinivalue_line("markers", "serial: under pytest-xdist, the test runs while no other test does "
                                "(it measures something the machine shares: free GPU memory, time)")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            yield  # one process: every test already runs alone
            return
        folder = str(item.config._tmp_path_factory.getbasetemp().parent)  # shared by the run's workers
        with turn(folder, serial=item.get_closest_marker("serial") is not None):
            yield

    def pytest_collection_modifyitems(session: Any, config: Any, items: List[Any]) -> None:
        for item in items:
            marks = [m for m in item.iter_markers() if m.name in ("cuda", "gpus")]
            if not marks:
                continue
            try:
                reason = skip_reason(marks, cuda_device_count())
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))

    @pytest.fixture
    def ipc_peer() -> Iterator[Peer]:
        """A fresh :class:`Peer` for the test; closed after it (a crash at exit fails the test)."""
        p = Peer(timeout=default_timeout(), name="torch_ipc-test-peer")
        try:
            yield p
        finally:
            p.close(check=True)

    @pytest.fixture(scope="module")
    def ipc_peers() -> Iterator[PeerGroup]:
        """A :class:`PeerGroup` for the tests of one module; its peers must exit
        cleanly after the module's last test."""
        group = PeerGroup(timeout=default_timeout())
        try:
            yield group
            group.close(check=True)
        finally:
            group.close()

    @pytest.fixture
    def ipc_spawn() -> Callable[..., Any]:
        """:func:`run_in_subprocess` with the default timeout (overridable per call)."""
        return functools.partial(run_in_subprocess, timeout=default_timeout())
