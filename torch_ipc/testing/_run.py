"""run_in_subprocess: one call in a fresh child, which must then exit cleanly."""
from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from ._child import pickle_call
from ._environment import Env, check_env
from ._errors import PeerError, PeerTimeout, describe_exit, qualname
from ._peer import EXIT_GRACE_S, Peer

T = TypeVar("T")

def run_in_subprocess(
    fn: Callable[..., T], /, *args: Any, timeout: float = 60.0, env: Env = None, **kwargs: Any
) -> T:
    """Run ``fn(*args, **kwargs)`` in a fresh child process and return its result.

    The child must also exit cleanly afterwards: a crash at interpreter exit is
    reported too.

    Raises:
        PeerError: ``fn`` raised (``exitcode`` 1, ``child_traceback`` set,
            ``exception`` the original when it pickles), the child died (say a
            signal: ``exitcode`` is minus its number and the message names it), or
            it crashed while exiting.
        PeerTimeout: the whole run (start-up, call and exit) took longer than
            ``timeout`` seconds; the child and its process group were killed.

    Example::

        import math
        from torch_ipc.testing import run_in_subprocess

        assert run_in_subprocess(math.factorial, 5, timeout=30) == 120
    """
    if not float(timeout) > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    payload = pickle_call(fn, args, kwargs)  # fails here, before a child is started
    checked_env = check_env(env)
    what = qualname(fn)
    deadline = time.monotonic() + float(timeout)
    peer = Peer._oneshot(checked_env, timeout)
    try:
        try:
            call_id = peer._send(payload, what, deadline)
            result = peer._wait(call_id, what, deadline, f"{what} did not return within {timeout:g} s")
        except PeerTimeout:
            raise
        except PeerError as err:
            if err.exitcode is None and not peer._closed:  # fn raised; the child exits with code 1
                peer._proc.join(max(0.0, min(deadline - time.monotonic(), EXIT_GRACE_S)))
                if peer._proc.exitcode is None:
                    peer._shutdown(graceful=False)
                err.exitcode = peer.exitcode
                err.args = (f"{err.args[0]}\n(the child then {describe_exit(err.exitcode)})",)
            raise
        # fn returned; the child must now exit by itself, with code 0.
        peer._proc.join(max(0.0, deadline - time.monotonic()))
        if peer._proc.exitcode is None:
            peer._timeout_kill(f"{what} returned but the child did not exit within {timeout:g} s")
        if peer._proc.exitcode != 0:
            peer._raise_dead(what, during=f"at interpreter exit, after {what} returned")
        return result
    finally:
        peer._shutdown(graceful=False)

