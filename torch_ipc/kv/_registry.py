"""The pools open in this process, by segment name: loading a pool that is
already open here returns that object (one holder slot per process and pool),
and the background collector reclaims dead holders' blocks in each."""
from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

from .. import _runtime

_open_pools: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_open_lock = threading.Lock()


def register(name: str, pool: Any) -> None:
    with _open_lock:
        _open_pools[name] = pool


def unregister(name: str, pool: Any) -> None:
    with _open_lock:
        if _open_pools.get(name) is pool:
            del _open_pools[name]


def find(name: str) -> Optional[Any]:
    with _open_lock:
        return _open_pools.get(name)


def _reclaim_dead_holders() -> None:
    with _open_lock:
        pools = list(_open_pools.values())
    for pool in pools:
        try:
            pool._reclaim_unless_busy()
        except Exception:  # a pool closed meanwhile, or corrupted: its users are told
            pass


_runtime.on_collect(_reclaim_dead_holders)
