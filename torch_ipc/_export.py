"""torch_ipc.export: dumps() with a handle to let go of what it exported.

Note [revoking an export]
dumps() pins what it exports until the loads it expects happened and their
holders released. A load that never comes (a consumer that crashed before it
read, bytes left in a file) pins it for the producer's life. export() returns
the same descriptor with its Export, whose revoke() forbids every load from
then on (Note [revoked exports] in csrc/os/refcount.cpp) and reclaims what no
process holds at once; holders keep what they loaded until they release it.
"""

from typing import Any, Optional

from . import _C, _serialize

__all__ = ["Export", "export"]


class Export:
    """One export made by :func:`torch_ipc.export`: its descriptor ``.data``
    (the bytes :func:`dumps` returns) and a way to let go of it.

    ``revoke()``: no load of ``.data`` may start from now on (it raises
    :class:`ReleasedError`), forwarded loads included; loads already made keep
    their tensors, and the memory is given back to this process once they
    released it. Idempotent. ``live``: still loadable or held."""

    __slots__ = ("_export",)

    def __init__(self, export: "_C.Export"):
        self._export = export

    @property
    def data(self) -> bytes:
        return self._export.data

    @property
    def live(self) -> bool:
        return self._export.live

    def revoke(self) -> None:
        self._export.forbid_loads()
        _C.collect(False)  # reclaim now what nobody holds

    def __repr__(self) -> str:
        return f"<torch_ipc.Export of {len(self.data)} bytes, {'live' if self.live else 'released'}>"


def export(obj: Any, *, consumers: Optional[int] = 1, isolated: bool = False) -> Export:
    """:func:`dumps` that keeps a handle on what it exported: an
    :class:`Export` whose ``.data`` is the descriptor and whose ``.revoke()``
    unpins it before its loads happened (a consumer that never came).

    Example::

        >>> import torch, torch_ipc
        >>> e = torch_ipc.export(torch.arange(4.0))
        >>> e.revoke()
        >>> e.live
        False
    """
    return Export(_serialize.export_object(obj, consumers=consumers, isolated=isolated))
