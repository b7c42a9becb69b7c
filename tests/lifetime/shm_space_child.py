"""What test_shm_space.py runs in a child: in a fresh interpreter of a mount
namespace with a small /dev/shm, or in a child forked by the test helpers under a
small file size limit. Imports nothing of the tests."""
import os
import resource

import torch

import torch_ipc


def share_ones(limit: int, nbytes: int) -> dict:
    """In a child whose /dev/shm (or file size limit, `limit` bytes when not 0)
    is small: dumps() of `nbytes` of ones, what failed, what it left in /dev/shm."""
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    out = {}
    try:
        torch_ipc.dumps(t)
        out["error"] = None
    except OSError as e:
        out.update(error=type(e).__name__, errno=e.errno, message=str(e))
    out["files"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"torch_ipc.{os.getpid()}."))
    out["still_private"] = t.untyped_storage().data_ptr() != 0 and bool((t == 1).all())
    st = os.statvfs("/dev/shm")
    out["shm"] = dict(size=st.f_blocks * st.f_frsize, free=st.f_bavail * st.f_frsize)
    return out
