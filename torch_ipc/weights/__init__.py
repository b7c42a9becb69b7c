"""Share a trainer's weights with inference processes: publish once, pull
each new version at memory speed.

    >>> # trainer                                  # inference process
    >>> pub = Publisher(model)                     # doctest: +SKIP
    >>> pub.attach(conn)                           # sub = Subscriber(conn)  # doctest: +SKIP
    >>> opt.step(); pub.publish()                  # sub.pull(into=model)    # doctest: +SKIP

See docs/weights.md and Note [weights consistency protocol] in _control.py;
for other nodes, docs/across-machines.md and Note [relaying weights to other
nodes] in relay.py.
"""

from ._errors import BroadcastError, PublisherGoneError, WeightsMismatchError
from .publisher import Publisher
from .relay import Relay
from .subscriber import Subscriber

__all__ = ["Publisher", "Subscriber", "Relay", "PublisherGoneError", "WeightsMismatchError", "BroadcastError"]
