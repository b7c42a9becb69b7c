"""The exceptions of torch_ipc.weights."""

from ..errors import ProducerGoneError

__all__ = ["WeightsMismatchError", "PublisherGoneError", "BroadcastError"]


class WeightsMismatchError(ValueError):
    """The model does not fit what the publisher publishes. ``problems`` lists
    every missing name, extra name, shape and dtype mismatch (one per line of
    the message); nothing was copied."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__(
            "torch_ipc.weights: the model does not match the published weights; nothing was copied:\n  "
            + "\n  ".join(self.problems)
        )

    def __reduce__(self):
        return (type(self), (self.problems,))


class PublisherGoneError(ProducerGoneError):
    """The publishing process exited and no new publisher has attached."""


class BroadcastError(RuntimeError):
    """A version was published on the trainer's node but its broadcast to the
    relays of other nodes failed (a relay died, the group broke). Later
    versions stay local until ``Publisher.broadcast_to`` gets a new group."""


def send_failed(version: int, sending: str, resume: str, error: Exception) -> BroadcastError:
    """The BroadcastError of a version published here whose sending to other
    nodes (``sending``: what failed) raised ``error``; ``resume``: the call that
    takes a new group."""
    return BroadcastError(
        f"torch_ipc.weights: version {version} is published on this node but {sending} failed "
        f"({type(error).__name__}: {error}); later versions stay local until {resume}() is called with a new group")
