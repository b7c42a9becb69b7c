"""Configuration of torch_ipc's own test suite.

The markers (``cuda``, ``gpus(n)``) and the fixtures (``peer``, ``spawn``) come
from the ``torch_ipc.testing`` pytest plugin. An installed torch_ipc registers
it through its ``pytest11`` entry point; an in-place build (``python setup.py
build_ext --inplace``) is not installed, so it is registered here, once: listing
it in ``pytest_plugins`` as well as through the entry point would register the
same module twice, which pytest refuses.
"""
import torch_ipc.testing as _plugin

pytest_plugins: list = []


def pytest_configure(config):
    pm = config.pluginmanager
    if pm.is_registered(_plugin) or pm.has_plugin("torch_ipc") or pm.has_plugin("torch_ipc.testing"):
        return
    if pm.is_blocked("torch_ipc"):  # -p no:torch_ipc
        return
    pm.register(_plugin, "torch_ipc")
