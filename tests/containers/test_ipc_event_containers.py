"""torch_ipc.IpcEvent between processes of different PID, network and IPC
namespaces: its state names the maker with life key and PID namespace
(version 2, csrc/features/ipc_event/ipc_event.cpp), so a consumer in another
namespace judges the maker by its life file, never by an unrelated process of
the same pid in its own namespace. GPU only (the state checks, CPU too, are in
tests/sharing/test_ordering.py)."""
import pickle

import ipc_test_utils as u
import pytest
import torch
from namespace_helpers import NamespacedChild, needs_namespaces

import torch_ipc
from torch_ipc.testing import Peer

pytestmark = [needs_namespaces(), pytest.mark.cuda]


def _record_event(path: str) -> None:
    event = torch_ipc.IpcEvent("cuda:0")
    torch.cuda._sleep(50_000_000)
    event.record()
    u.HELD["event"] = event
    with open(path, "wb") as f:
        f.write(pickle.dumps(event))


def test_an_event_of_a_living_maker_in_other_namespaces_stays_open(tmp_path):
    path = str(tmp_path / "event.pkl")
    with Peer(timeout=120) as maker:
        maker.call(_record_event, path)
        with NamespacedChild("event", path, timeout=120) as consumer:
            got = consumer.next()
            assert got["done"] is True, got
            # The collector closes the events of dead makers only: this one lives.
            assert got["events_open"] == 1, got
