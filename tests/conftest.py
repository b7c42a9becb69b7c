"""Configuration of torch_ipc's own test suite: its markers (``cuda``,
``gpus(n)``) and fixtures (``ipc_peer``, ``ipc_peers``, ``ipc_spawn``) come from
the opt-in ``torch_ipc.testing`` pytest plugin, as in any project that uses it.
"""
pytest_plugins = ["torch_ipc.testing"]
