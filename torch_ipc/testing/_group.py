"""PeerGroup: named Peers that several tests share."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ._environment import Env, check_env
from ._errors import PeerError, describe_exit
from ._peer import Peer


class PeerGroup:
    """Named :class:`Peer` processes that several tests share, each started on first use.

    Starting a Peer starts an interpreter that imports torch: seconds on a small
    machine. Tests that only load, check and drop can share peers: each asks the
    group for a peer by name and gets the same process as the tests before it,
    so it must leave nothing behind that the next test could trip over. A test
    that kills its peer, makes it exit, or changes it for good uses a Peer of
    its own.

    Args:
        timeout: the default ``timeout`` of the peers (see :class:`Peer`).

    Example::

        import os
        from torch_ipc.testing import PeerGroup

        with PeerGroup(timeout=30) as group:
            producer = group.get("producer")
            assert group.get("producer") is producer
            assert group.get("consumer").pid != producer.pid
            group.close(check=True)   # both must exit cleanly

    A peer found dead by :meth:`get` is replaced by a new one. If nobody had
    been told of its death (no :class:`PeerError` reported it and it was not
    killed on purpose), :meth:`get` raises :class:`PeerError` saying how it
    ended; the next :meth:`get` starts the new one. A peer left busy (a test
    failed while waiting for a call) is killed and replaced.
    """

    def __init__(self, timeout: float = 60.0) -> None:
        if not float(timeout) > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.timeout = float(timeout)
        self._peers: Dict[str, Tuple[Peer, Tuple[Any, ...]]] = {}
        self._closed = False

    def get(
        self,
        name: str,
        *,
        env: Env = None,
        init: Optional[Callable[[], Any]] = None,
        timeout: Optional[float] = None,
    ) -> Peer:
        """The peer called ``name``, started now if it is not running.

        ``env`` and ``timeout`` are those of a new :class:`Peer`; ``init`` (a
        module-level function) runs once in a new peer before it is handed
        out. Asking again for ``name`` with other arguments is a ``ValueError``.
        """
        if self._closed:
            raise RuntimeError("the PeerGroup is closed")
        config = (tuple(sorted(check_env(env).items())), init, self.timeout if timeout is None else float(timeout))
        entry = self._peers.get(name)
        if entry is not None:
            peer, had = entry
            if had != config:
                raise ValueError(f"peer {name!r} was started with other arguments ({had}) than {config}")
            if peer.is_alive() and not peer.busy:
                return peer
            del self._peers[name]
            unnoticed = not peer.busy and not peer._killed and not peer._reported
            peer.close()
            if unnoticed:
                raise PeerError(
                    f"shared peer {name!r} (pid {peer.pid}) {describe_exit(peer.exitcode)} after an earlier "
                    "test used it; the next get() starts a new one",
                    pid=peer.pid,
                    exitcode=peer.exitcode,
                    child_traceback=peer._fault_log_at_close,
                )
        peer = Peer(timeout=config[2], env=env, name=name)
        try:
            if init is not None:
                peer.call(init)
        except BaseException:
            peer.close()
            raise
        self._peers[name] = (peer, config)
        return peer

    def close(self, *, check: bool = False) -> None:
        """Close every peer, the newest first; idempotent.

        With ``check=True``, raises :class:`PeerError` when one did not exit
        cleanly (see :meth:`Peer.close`), after all were closed.
        """
        self._closed = True
        errors: List[PeerError] = []
        while self._peers:
            name = next(reversed(self._peers))
            peer, _ = self._peers.pop(name)
            try:
                peer.close(check=check)
            except PeerError as err:
                errors.append(err)
        if errors:
            if len(errors) > 1:
                errors[0].args = (f"{errors[0].args[0]}\n(and {len(errors) - 1} more peers of the group)",)
            raise errors[0]

    def __enter__(self) -> "PeerGroup":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
