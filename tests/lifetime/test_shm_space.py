"""A /dev/shm too small for a tensor (Docker's default is 64 MiB), no GPU
needed: sharing a CPU tensor raises OSError(ENOSPC) naming /dev/shm and its
space, never dies of SIGBUS, and leaves no file behind (Note [reserving shared
memory] in csrc/os/shm.cpp). Both reservations are tested: the data segment and
the lease segment."""
import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
from shm_space_child import share_ones

import torch_ipc
from torch_ipc.testing import run_in_subprocess

# Children import the torch_ipc this process imported: the installed package,
# or the checkout's in-place build (the checkout has no _C after an install).
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torch_ipc.__file__)))

# A fresh interpreter in the small /dev/shm's mount namespace. Prints one JSON line.
_SHARE = """
import json, sys
sys.path.insert(0, sys.argv[3])
from shm_space_child import share_ones
print(json.dumps(share_ones(int(sys.argv[1]), int(sys.argv[2]))))
"""


def _share(prefix, limit: int, nbytes: int) -> dict:
    if not prefix:  # a file size limit is the child's own: no interpreter of its own needed
        return run_in_subprocess(share_ones, limit, nbytes, timeout=120)
    env = dict(os.environ, PYTHONPATH=IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([*prefix, sys.executable, "-c", _SHARE, str(limit), str(nbytes), here],
                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, f"the child died ({r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _small_shm_prefix():
    """A command prefix that runs its command with a 16 MiB tmpfs on /dev/shm
    (a mount namespace of its own), or None where that is not allowed."""
    if shutil.which("unshare") is None:
        return None
    inner = "mount -t tmpfs -o size=16m tmpfs /dev/shm && exec \"$@\""
    prefix = ["unshare", "-Urm", "sh", "-c", inner, "sh"]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    return prefix if ok else None


SMALL_SHM = _small_shm_prefix()


@pytest.mark.skipif(SMALL_SHM is None, reason="needs unshare -Urm to mount a small /dev/shm")
def test_a_tensor_larger_than_dev_shm_is_enospc_naming_its_size():
    out = _share(SMALL_SHM, 0, 32 << 20)
    assert out["shm"]["size"] == 16 << 20, out
    assert (out["error"], out["errno"]) == ("OSError", errno.ENOSPC), out
    message = out["message"]
    assert "/dev/shm has" in message and "free of 16.0 MiB" in message and "--shm-size" in message, message
    assert [f for f in out["files"] if ".H" in f] == [], f"a data segment was left behind: {out['files']}"
    assert out["still_private"], "the tensor lost its data"


@pytest.mark.skipif(SMALL_SHM is None, reason="needs unshare -Urm to mount a small /dev/shm")
def test_a_tensor_that_fits_a_small_dev_shm_is_shared():
    out = _share(SMALL_SHM, 0, 4 << 20)
    assert out["error"] is None, out


def test_a_data_segment_past_the_file_size_limit_is_efbig_and_leaves_no_file():
    """RLIMIT_FSIZE fails the reservation for real on any machine."""
    out = _share([], 2 << 20, 8 << 20)  # the lease segment (512 KiB) fits, the data does not
    assert (out["error"], out["errno"]) == ("OSError", errno.EFBIG), out
    assert "RLIMIT_FSIZE" in out["message"] and "/dev/shm" in out["message"], out["message"]
    assert len(out["files"]) == 1 and ".L" in out["files"][0], f"left behind: {out['files']}"
    assert out["still_private"], "the tensor lost its data"


def test_a_lease_segment_past_the_file_size_limit_is_efbig_and_leaves_no_file():
    out = _share([], 256 << 10, 4096)  # a lease segment is 512 KiB
    assert (out["error"], out["errno"]) == ("OSError", errno.EFBIG), out
    assert out["files"] == [], f"left behind: {out['files']}"
