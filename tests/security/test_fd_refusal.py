"""The fd server's refusal of another uid reaches the client as the EACCES it
sends (Note [a refusal is read] in csrc/os/fd_passing.cpp), not as a reset
connection. Switching uid needs root."""
import errno
import os

import pytest
from sharing.test_fd_passing import _publish, _stats

from torch_ipc import _C
from torch_ipc.testing import Peer, run_in_subprocess

NOBODY = 65534


def _fetch_as_another_uid(owner, ident):
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    pid, start = owner
    try:
        _C._testing.fd_fetch(pid, start, ident, [], "socket")
    except OSError as e:
        return type(e).__name__, e.errno, str(e)
    return "fetched", 0, ""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_uid_gets_the_refusal_it_was_sent():
    with Peer() as producer:
        pid, start, ident, _ = producer.call(_publish, [b"secret"])
        refused_before = producer.call(_stats)["fd_refused"]
        for _ in range(3):  # every time, not by luck of timing
            name, err, message = run_in_subprocess(_fetch_as_another_uid, (pid, start), ident)
            assert (name, err) == ("PermissionError", errno.EACCES), (name, err, message)
            assert "runs as another user" in message and f"uid {NOBODY}" in message, message
        assert producer.call(_stats)["fd_refused"] == refused_before + 3
