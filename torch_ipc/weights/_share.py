"""What a publisher sends a subscriber once, and how tensors are collected."""

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ._layout import Layout


@dataclass
class Share:
    """The one message of an attach: the shared buffer and control block (one
    torch_ipc descriptor), the layout, the subscriber's slot and the events.
    Later publishes send nothing: the version lives in the control block."""

    descriptor: bytes
    layout: Layout
    slot: int
    publisher: int  # its process word (Note [process words] in _control.py)
    epoch: int  # random per Publisher: a restarted trainer is a new epoch
    publish_event: Any  # IpcEvent or None: recorded after each publish (direct mode)
    staging_events: Tuple[Any, ...]  # (half 0, half 1) in bucketed mode
    done_events: Tuple[Any, ...]  # this subscriber's, recorded after its copies: (direct,) or one per half
    # a relay's snapshot (Note [pulling a relayed version as it lands] in relay.py): byte ranges of the
    # snapshot and an IpcEvent per range, recorded once its bytes landed; () otherwise
    ranges: Tuple[Tuple[int, int], ...] = ()
    range_events: Tuple[Any, ...] = ()


def named_tensors(source, what: str) -> Dict[str, torch.Tensor]:
    """{name: tensor} of a module (its state_dict: parameters and persistent
    buffers) or of a mapping of tensors; detached, same memory."""
    if isinstance(source, torch.nn.Module):
        items = source.state_dict(keep_vars=True).items()
    elif hasattr(source, "items"):
        items = source.items()
    else:
        raise TypeError(f"torch_ipc.weights: {what} must be an nn.Module or a mapping of tensors, "
                        f"not {type(source).__name__}")
    out = {}
    for name, t in items:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"torch_ipc.weights: {what} maps str to tensors; {name!r} is a {type(t).__name__}")
        out[name] = t.detach()
    return out


def send(conn, message) -> None:
    """Send over a Connection/Pipe end (``send``) or put on a Queue (``put``)."""
    if hasattr(conn, "send"):
        conn.send(message)
    elif hasattr(conn, "put"):
        conn.put(message)
    else:
        raise TypeError(f"torch_ipc.weights: cannot send through a {type(conn).__name__} (need send() or put())")


def receive(conn, timeout: Optional[float]):
    """One message from a Connection/Pipe end or a Queue; None when nothing
    arrives within `timeout` seconds (0: do not wait)."""
    if hasattr(conn, "recv"):
        if not conn.poll(timeout):
            return None
        return conn.recv()
    if hasattr(conn, "get"):
        import queue

        try:
            return conn.get(timeout=timeout) if timeout else conn.get_nowait()
        except queue.Empty:
            return None
    raise TypeError(f"torch_ipc.weights: cannot receive from a {type(conn).__name__} (need recv() or get())")
