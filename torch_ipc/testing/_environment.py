"""The environment a child starts with: `env` checked, and put in os.environ
while the child is started."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Dict, Iterator, Mapping, Optional

Env = Optional[Mapping[str, Optional[str]]]

_env_lock = threading.Lock()


@contextlib.contextmanager
def environment(env: Dict[str, Optional[str]]) -> Iterator[None]:
    """Put `env` in os.environ while a child is started, then restore it.

    A spawned child inherits the parent's environment at exec, so the variables
    are there before the child imports anything. Other threads of this process
    see the values while the child starts (a few milliseconds).
    """
    if not env:
        yield
        return
    with _env_lock:
        saved = {key: os.environ.get(key) for key in env}
        try:
            apply_env(env)
            yield
        finally:
            apply_env(saved)


def apply_env(env: Dict[str, Optional[str]]) -> None:
    """Set each variable of `env` in os.environ; a None value removes it."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def check_env(env: Env) -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {}
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not key or "=" in key:
            raise TypeError(f"env keys must be non-empty str without '=', got {key!r}")
        if value is not None and not isinstance(value, str):
            raise TypeError(f"env[{key!r}] must be a str or None, got {type(value).__name__}")
        out[key] = value
    return out

