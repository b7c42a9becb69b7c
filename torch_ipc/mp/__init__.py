"""The multiprocessing adapters: torch_ipc's reducers for ForkingPickler
(``_reductions``), the tie between a multiprocessing connection and what was
sent over it (``_channels``), and torch_ipc's own Listener/Client
(``connection``). Their public names are re-exported by ``torch_ipc``."""
