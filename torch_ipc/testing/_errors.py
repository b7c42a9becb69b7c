"""What a failed child looks like to the parent: PeerError and PeerTimeout."""
from __future__ import annotations

import signal
from typing import Any, Dict, Optional, Tuple


class PeerError(RuntimeError):
    """A child process failed: its function raised, or it died, or it timed out.

    Attributes:
        pid: the child's process id.
        exitcode: the child's exit code once it has exited (negative: killed by
            that signal), ``None`` while it is still alive (a :class:`Peer` whose
            call raised keeps running).
        child_traceback: the formatted traceback of the exception raised in the
            child, or what faulthandler wrote when the child crashed or timed
            out; ``""`` when there is none.
        exc_type: the qualified name of the child's exception type, or ``""``.
        exception: the child's exception itself when it could be pickled back,
            else ``None``; lets a test check ``isinstance(e.exception, X)``.
    """

    def __init__(
        self,
        message: str,
        *,
        pid: Optional[int] = None,
        exitcode: Optional[int] = None,
        child_traceback: str = "",
        exc_type: str = "",
        exception: Optional[BaseException] = None,
    ) -> None:
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode
        self.child_traceback = child_traceback
        self.exc_type = exc_type
        self.exception = exception

    @property
    def signal(self) -> Optional[int]:
        """The number of the signal that killed the child, if one did."""
        if self.exitcode is not None and self.exitcode < 0:
            return -self.exitcode
        return None

    def __reduce__(self) -> Any:
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


class PeerTimeout(PeerError, TimeoutError):
    """A child did not finish in time; it was killed (with its process group)."""


def _rebuild_error(cls: type, args: Tuple[Any, ...], state: Dict[str, Any]) -> PeerError:
    err = cls.__new__(cls, *args)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


def describe_exit(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown signal"
    return f"was killed by signal {-exitcode} ({name})"


def qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{module}.{name}"
