"""The child's side of a Peer: its setup, and the loop that runs the calls sent
to it; and the format of the messages both sides exchange."""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import multiprocessing.connection
import os
import pickle
import signal
import sys
import traceback
from typing import Any, Callable, Dict, Optional, Tuple

from ._environment import apply_env
from ._errors import PeerError, qualname

# Messages: parent -> child  pickle((call_id, payload)) where payload is
#                            pickle((fn, args, kwargs)); call_id 0 means "stop".
#           child -> parent  pickle(("ok", call_id, result_bytes)) or
#                            pickle(("err", call_id, exc_type, text, traceback, exc_bytes)).
# The envelope holds only ints, strings and bytes, so it always unpickles; the
# user's objects are unpickled inside a try so that a failure there is reported
# as that call's error instead of killing the child.

_fault_log: Any = None  # the child's faulthandler file, kept open for its lifetime


def _child_setup(env: Dict[str, Optional[str]], fault_path: str, parent_pid: int, pdeathsig: bool) -> None:
    global _fault_log
    # A process group of its own, so that a timeout or close() kills whatever the
    # child started too.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if pdeathsig and sys.platform.startswith("linux"):
        # Die with the parent (pytest killed with SIGKILL leaves no orphans). Only
        # when the parent started us from its main thread: the signal is sent when
        # the *thread* that forked the child exits.
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent_pid:
                os._exit(70)  # the parent is already gone
    # The parent put `env` in the environment this interpreter started with; set
    # it again in case anything imported while the child was being prepared (the
    # parent's __main__, re-imported by spawn) changed it.
    apply_env(env)
    # What the child imported to get here (torch among it) lives as long as it
    # does: keep it out of its garbage collections, as the fork server does
    # for its children (tests call gc.collect() often; torch makes each ~0.1 s).
    gc.collect()
    gc.freeze()
    with contextlib.suppress(OSError):
        _fault_log = open(fault_path, "w")
        faulthandler.enable(file=_fault_log, all_threads=True)
        # SIGUSR1: the parent asks for every thread's stack before a timeout kill.
        faulthandler.register(signal.SIGUSR1, file=_fault_log, all_threads=True, chain=False)


def _run_one(payload: bytes) -> Tuple[Any, ...]:
    try:
        fn, args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
        del fn, args, kwargs
        try:
            return ("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:
            raise TypeError(f"the function returned {type(result).__name__}, which cannot be pickled: {exc}") from exc
    except BaseException as exc:  # noqa: B902 - report everything, SystemExit included
        tb = traceback.format_exc()
        try:
            exc_bytes: Optional[bytes] = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(exc_bytes)  # only send what will unpickle on the other side
        except Exception:
            exc_bytes = None
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return ("err", qualname(type(exc)), text, tb, exc_bytes)


def child_main(
    conn: multiprocessing.connection.Connection,
    env: Dict[str, Optional[str]],
    fault_path: str,
    parent_pid: int,
    pdeathsig: bool,
    oneshot: bool,
) -> None:
    _child_setup(env, fault_path, parent_pid, pdeathsig)
    failed = False
    while True:
        try:
            call_id, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the parent closed its end: nobody is left to answer
        if call_id == 0:
            break
        reply = _run_one(payload)
        failed = reply[0] == "err"
        try:
            conn.send_bytes(pickle.dumps((reply[0], call_id) + reply[1:], protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, OSError):
            break
        del reply, payload
        if oneshot:
            break
    conn.close()
    if oneshot and failed:
        sys.exit(1)



# ----------------------------------------------------------------- the parent's end of the messages


def pickle_call(fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bytes:
    """The payload of a call: fails here, in the parent, when it cannot travel."""
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"cannot send {qualname(fn)} and its arguments to a child process: {exc} "
            "(the function must be defined at module level of an importable module, "
            "and its arguments must pickle)"
        ) from exc


def encode_call(call_id: int, payload: bytes) -> bytes:
    return pickle.dumps((call_id, payload), protocol=pickle.HIGHEST_PROTOCOL)


STOP = pickle.dumps((0, None))  # call id 0: return from the loop


def unpack_reply(message: Tuple[Any, ...], what: str, pid: int) -> Any:
    """The result a child's reply carries, or the PeerError its function raised."""
    if message[0] == "ok":
        return pickle.loads(message[2])
    exc_type, text, tb, exc_bytes = message[2:6]
    exception = None
    if exc_bytes is not None:
        with contextlib.suppress(Exception):
            exception = pickle.loads(exc_bytes)
    raise PeerError(
        f"{what} raised {text} in peer pid {pid}\n\n--- child traceback ---\n{tb}",
        pid=pid,
        exitcode=None,
        child_traceback=tb,
        exc_type=exc_type,
        exception=exception,
    )
