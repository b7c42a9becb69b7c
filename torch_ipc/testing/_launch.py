"""How a Peer's child is started: forked by the fork server, else spawned
(Note [fork server] in torch_ipc/testing/_fork_server.py)."""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import threading
from typing import Any, Dict, Optional, Tuple

from ._child import child_main
from ._environment import environment
from ._fork_server import LATE_ENV, ForkServerProcess, fork_server


def start_child(
    env: Dict[str, Optional[str]], name: str, fault_path: str, oneshot: bool
) -> Tuple[Any, multiprocessing.connection.Connection]:
    """Start a child running child_main; returns its Process and the parent's end of its pipe.

    A child with `env`, or one the fork server cannot fork (it is off, has
    another environment, or went away), is spawned with `env` in effect.
    """
    server = None if env else fork_server.server_pid()
    for attempt in ("fork server", "spawn") if server is not None else ("spawn",):
        parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
        if attempt == "fork server":
            late = {key: os.environ.get(key) for key in LATE_ENV}
            args = (child_conn, late, fault_path, server, True, oneshot)
            proc = ForkServerProcess(target=child_main, args=args, name=name)
        else:
            pdeathsig = threading.current_thread() is threading.main_thread()
            args = (child_conn, env, fault_path, os.getpid(), pdeathsig, oneshot)
            # not daemonic: a daemonic process may not start children of its own
            proc = multiprocessing.get_context("spawn").Process(target=child_main, args=args, name=name, daemon=False)
        try:
            with environment(env if attempt == "spawn" else {}):
                proc.start()
        except OSError:
            parent_conn.close()
            child_conn.close()
            if attempt == "spawn":
                raise
            continue  # the fork server went away: spawn this one
        except BaseException:
            parent_conn.close()
            child_conn.close()
            raise
        child_conn.close()
        return proc, parent_conn
    raise AssertionError("unreachable: the last attempt returns or raises")


def make_fault_log() -> str:
    """A fresh file for the child's faulthandler output; the caller unlinks it."""
    fd, path = tempfile.mkstemp(prefix="torch_ipc_peer_", suffix=".log")
    os.close(fd)
    return path


def remove_file(path: str) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)
