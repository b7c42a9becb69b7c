"""torch_ipc.weights between a Publisher and a Subscriber in different PID,
network and IPC namespaces (containers sharing /dev/shm, a socket folder and
the uid): the control block names each process by its life key (Note
[process words] in torch_ipc/weights/_control.py), so pulls work, a
subscriber SIGKILLed in its namespace is released and a publisher SIGKILLed
in its namespace is reported gone. The other side runs tests/ns_child.py
under unshare (tests/namespace_helpers.py)."""
import os
import secrets

import ipc_test_utils as u
import pytest
import weights_helpers as h
from namespace_helpers import NamespacedChild, needs_namespaces

from torch_ipc.testing import Peer
from torch_ipc.weights import PublisherGoneError

pytestmark = needs_namespaces()

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _subscribers() -> int:
    return h.HELD["pub"].subscribers


@pytest.mark.parametrize("device", DEVICES)
def test_a_subscriber_in_other_namespaces_pulls_and_is_released_when_killed(tmp_path, device):
    address, key = str(tmp_path / "weights.sock"), secrets.token_bytes(16)
    with Peer(timeout=120) as pub:
        pub.start_call(h.pub_serve, address, key, device=device, timeout=30.0)
        with NamespacedChild("weights_sub", address, key.hex(), device, timeout=120) as sub:
            assert pub.result() == 1
            got = sub.next()
            assert got.get("version") == 1 and got["same"], got
            assert got["alive"], "the subscriber took the living publisher for dead"
            assert got["pidns"] != os.stat("/proc/self/ns/pid").st_ino
            # The publisher cannot see the subscriber's pid; it must not reap it.
            assert pub.call(h.pub_publish) == (2, 1)
            assert pub.call(_subscribers) == 1
            sub.kill()
            assert u.poll_until(lambda: pub.call(_subscribers) == 0, timeout=20), "a killed subscriber kept its slot"
            assert pub.call(h.pub_publish) == (3, 0)
        pub.call(h.pub_close)


def test_a_publisher_killed_in_other_namespaces_is_gone(tmp_path):
    address, key = str(tmp_path / "weights.sock"), secrets.token_bytes(16)
    with NamespacedChild("weights_pub", address, key.hex(), timeout=120) as pub:
        sub = h.Subscriber(h.Connector(address, key, wait=60), timeout=60)
        try:
            model = h.make_weights(fill=0.0)
            assert sub.pull(model, timeout=60) == 1 and h.bits(model) == h.bits(h.make_weights())
            assert sub.publisher_alive(), "the subscriber took the living publisher for dead"
            made = pub.next()
            assert made["version"] == 1 and made["subscribers"] == 1, made
            pub.kill()
            assert u.poll_until(lambda: not sub.publisher_alive(), timeout=20)
            with pytest.raises(PublisherGoneError, match="exited"):
                sub.pull(model, newer_than=1, timeout=10)
            assert h.bits(model) == h.bits(h.make_weights())  # the model keeps version 1
        finally:
            sub.close()
