"""The one base for objects that hold a resource until close(): ``with``
closes them, and so does the garbage collector (Note [close on collect])."""

from typing import TypeVar

_Self = TypeVar("_Self", bound="Closing")


class Closing:
    """``with`` closes it: ``__enter__`` returns it, ``__exit__`` calls close()."""

    __slots__ = ()  # a subclass may declare its own (SharedKVPool does)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Note [close on collect]
# An object dropped without close() is closed by __del__, which may run on a
# partially constructed object (its __init__ raised) or at interpreter
# shutdown (modules half torn down): any Exception from closing is dropped
# there, as an exception out of __del__ could only be printed. A subclass
# that must do less from a finalizer than close() does says so in
# _close_on_collect().
class Closeable(Closing):
    """Closing, and closed by the garbage collector when dropped open."""

    __slots__ = ()

    def _close_on_collect(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close_on_collect()
        except Exception:
            pass
