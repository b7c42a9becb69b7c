"""Every shared memory segment torch_ipc opens must be the one its producer
made (Note [segment identity] in csrc/os/shm.h): a file under the producer's
name that another uid created, one of mode 0666, a symlink, or one whose
identity page names another process is refused with ReleasedError, and
nothing in it is read, let alone unpickled. The uid tests switch a child to
another uid, which needs root."""
import os
import re

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc.kv import SharedKVPool

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching a child to another uid needs root")
HOST_NAME = re.compile(rb"/torch_ipc\.\d+\.\d+\.H[0-9a-f]{8}\.[0-9a-f]{12}")
IDENTITY_START_TIME = 16  # the creator's start time in the identity page


def shared_tensor():
    """A CPU tensor exported (consumers=4) and its host segment's file."""
    t = torch.arange(1024, dtype=torch.float32)
    data = torch_ipc.dumps(t, consumers=4)
    return t, data, "/dev/shm" + HOST_NAME.search(data).group().decode()


def load_and_write(data: bytes) -> float:
    """Load, write -1 into element 0 (the producer must see it), return element 1."""
    t = torch_ipc.loads(data)
    t[0] = -1
    return float(t[1])


def replace_file(path: str, content: bytes, mode: int = 0o600) -> None:
    """The producer let go of its file; a process of our uid made another one there."""
    os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.fchmod(fd, mode)
    os.write(fd, content)
    os.close(fd)


def test_a_segment_of_mode_0666_is_refused_and_loads_once_0600(ipc_spawn):
    t, data, path = shared_tensor()
    os.chmod(path, 0o666)
    kind, message = ipc_spawn(u.try_load, data)
    assert kind == "ReleasedError" and "its mode is 0666, not 0600" in message, message
    assert "is not the one pid" in message and "refusing to map it" in message
    os.chmod(path, 0o600)
    assert ipc_spawn(load_and_write, data) == 1.0  # the failed load spent nothing
    assert t[0] == -1  # same memory


def test_a_file_that_another_process_made_under_the_name_is_refused(ipc_spawn):
    t, data, path = shared_tensor()
    with open(path, "rb") as f:
        content = bytearray(f.read())
    content[IDENTITY_START_TIME] ^= 1  # the same bytes, made by another process
    try:
        replace_file(path, bytes(content))
        kind, message = ipc_spawn(u.try_load, data)
        assert kind == "ReleasedError" and "it was made by pid" in message, message
        replace_file(path, bytes(len(content)))  # no identity page at all
        kind, message = ipc_spawn(u.try_load, data)
        assert kind == "ReleasedError" and "no torch_ipc identity page" in message, message
    finally:
        os.unlink(path)


def test_a_symlink_under_the_name_is_never_followed(ipc_spawn, tmp_path):
    t, data, path = shared_tensor()
    target = tmp_path / "target"
    with open(path, "rb") as f:
        target.write_bytes(f.read())  # a perfect copy: only the link is wrong
    os.chmod(target, 0o600)
    os.unlink(path)
    os.symlink(target, path)
    try:
        kind, message = ipc_spawn(u.try_load, data)
        assert kind == "ReleasedError" and "symbolic link" in message, message
    finally:
        os.unlink(path)


@needs_root
def test_a_planted_file_of_another_uid_named_by_a_descriptor_is_refused(ipc_spawn):
    t, data, path = shared_tensor()
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        copy = f.read()  # even the producer's own bytes, identity page and all
    os.unlink(path)
    try:
        assert ipc_spawn(u.plant_as_uid, OTHER_UID, path, copy) == OTHER_UID
        assert os.stat(path).st_size == size
        kind, message = ipc_spawn(u.try_load, data)
        assert kind == "ReleasedError", message
        assert f"owned by uid {OTHER_UID}, not by this process's uid 0" in message, message
    finally:
        os.unlink(path)


def attach_pool(data: bytes) -> tuple:
    try:
        pool = SharedKVPool.attach(data)
        pool.block(0)  # touch a block: maps the chunks
    except Exception as e:  # reported to the test
        return type(e).__name__, str(e)
    pool.close()
    return "ok", ""


@needs_root
def test_another_uid_recreating_a_closed_pools_segment_runs_nothing(ipc_spawn, tmp_path):
    """Note [segment identity]: the attack of issue 20's first item. The pool's
    owner closed it (its name is gone, the owner lives); another uid creates
    a file of that name holding the header copied from it, whose chunk record
    is a descriptor with a pickle that would create `marker` when loaded."""
    marker = str(tmp_path / "pickle-ran")
    bait = u.pickled_descriptor(marker, shape=(4, 2, 4))
    pool = SharedKVPool(4, (2, 4), torch.int64)
    data, name, fields = torch_ipc.dumps(pool), pool._state.name, pool._state.allocator.field_offsets()
    path = "/dev/shm" + name
    with open(path, "rb") as f:
        content = bytearray(f.read())
    pool.close()
    assert not os.path.exists(path)
    record = fields["chunks"][0]
    length_at = record + fields["chunk.descriptor_bytes"][0]
    content[length_at:length_at + 4] = len(bait).to_bytes(4, "little")
    text_at = record + fields["chunk.descriptor"][0]
    content[text_at:text_at + len(bait)] = bait
    try:
        assert ipc_spawn(u.plant_as_uid, OTHER_UID, path, bytes(content)) == OTHER_UID
        kind, message = ipc_spawn(attach_pool, data)
        assert kind in ("ReleasedError", "ProducerGoneError"), message
        assert f"owned by uid {OTHER_UID}" in message, message
        assert not os.path.exists(marker)
    finally:
        os.unlink(path)
