"""Functions the weights tests run in child processes (module level, so the
children import them by name), and the models both sides build."""

import atexit
import multiprocessing as mp
import os
import secrets
import shutil
import tempfile
import time
from typing import Dict, List, Optional

import torch

import torch_ipc
from torch_ipc.weights import Publisher, Subscriber

HELD: Dict[str, object] = {}

SHAPES = {"embed.weight": (33, 16), "block.q.weight": (16, 16), "block.k.weight": (8, 16),
          "block.v.weight": (8, 16), "block.norm": (16,), "head.bias": (7,), "step": ()}


def make_weights(device: str = "cpu", dtype=torch.float32, fill: Optional[float] = None, seed: int = 0,
                 big: int = 0):
    """SHAPES filled from `seed` (or with `fill`), plus "big" of `big` elements when asked."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    shapes = dict(SHAPES, big=(big,)) if big else SHAPES
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        if fill is not None:
            t.fill_(fill)
        out[name] = t.to(device)
    return out


def bits(weights: Dict[str, torch.Tensor]) -> Dict[str, bytes]:
    return {n: t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes() for n, t in weights.items()}


_FOLDERS: List[str] = []  # made by scratch_folder, removed as this process exits


def _remove_folders() -> None:
    for folder in _FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


def scratch_folder(prefix: str) -> str:
    """A fresh folder in $TMPDIR, removed with what it holds when this process exits."""
    if not _FOLDERS:
        atexit.register(_remove_folders)
    _FOLDERS.append(tempfile.mkdtemp(prefix=prefix))
    return _FOLDERS[-1]


def listener_address():
    """A fresh Unix socket path and authkey."""
    return os.path.join(scratch_folder("torch_ipc_w"), "sock"), secrets.token_bytes(16)


def pair(weights, timeout: float = 10.0, **kwargs):
    """A publisher and a subscriber of it in this process, over a Pipe."""
    sub_kwargs = {k: kwargs.pop(k) for k in ("name_map", "transforms", "strict") if k in kwargs}
    a, b = mp.Pipe()
    pub = Publisher(weights, **kwargs)
    pub.attach(a)
    return pub, Subscriber(b, timeout=timeout, **sub_kwargs)


class Connector:
    """A picklable function that connects to a torch_ipc Listener, retrying
    while it is not listening yet."""

    def __init__(self, address, authkey: bytes, wait: float = 10.0):
        self.address, self.authkey, self.wait = address, authkey, wait

    def __call__(self):
        deadline = time.monotonic() + self.wait
        while True:
            try:
                return torch_ipc.connect(self.address, authkey=self.authkey)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


# ----------------------------------------------------------------------------- subscriber side

def sub_attach(address, authkey: bytes, device: str = "cpu", dtype=torch.float32, big: int = 0, **kwargs) -> int:
    sub = Subscriber(Connector(address, authkey), **kwargs)
    HELD["sub"] = sub
    HELD["model"] = make_weights(device, dtype, fill=0.0, big=big)
    return os.getpid()


def sub_pull(newer_than: int = 0, timeout: float = 30.0):
    sub = HELD["sub"]
    version = sub.pull(HELD["model"], newer_than=newer_than, timeout=timeout)
    if HELD["model"]["step"].is_cuda:
        torch.cuda.synchronize()
    return version, bits(HELD["model"]), dict(sub.stats)


def sub_pull_until(last: int, check_uniform: bool = True, timeout: float = 30.0) -> List[int]:
    """Pull until version `last`; every pull must see one version everywhere:
    each tensor filled with the version number (Note [weights consistency protocol])."""
    sub, model, seen = HELD["sub"], HELD["model"], []
    version = 0
    while version < last:
        version = sub.pull(model, newer_than=version, timeout=timeout)
        if model["step"].is_cuda:
            torch.cuda.synchronize()
        for name, t in model.items():
            if not bool((t == float(version)).all()):
                raise AssertionError(f"torn update: {name} holds {t.unique().tolist()[:8]} in version {version}")
        seen.append(version)
    return seen


def sub_close() -> None:
    sub = HELD.pop("sub", None)
    if sub is not None:
        sub.close()
    HELD.pop("model", None)


# ----------------------------------------------------------------------------- publisher side

def pub_serve(address, authkey: bytes, n_subscribers: int = 1, device: str = "cpu", seed: int = 0,
              fill: Optional[float] = None, big: int = 0, publish: bool = True, **kwargs) -> int:
    """Listen, attach `n_subscribers`, publish version 1 of make_weights(seed, fill, big)
    (unless not `publish`: then return 0)."""
    weights = make_weights(device, seed=seed, fill=fill, big=big)
    pub = Publisher(weights, **kwargs)
    HELD["pub"], HELD["weights"] = pub, weights
    with torch_ipc.listen(address, authkey=authkey) as listener:
        for _ in range(n_subscribers):
            conn = listener.accept()
            pub.attach(conn)
            HELD.setdefault("conns", []).append(conn)
    return pub.publish() if publish else 0


def pub_publish():
    """Publish once more; (version, subscribers the publish still counts)."""
    pub = HELD["pub"]
    version = pub.publish()
    return version, len(pub._done)


def pub_start_writing() -> None:
    """Leave the control block as a publish that dies while writing would."""
    from torch_ipc.weights import _control as ctl

    HELD["pub"]._counters.store(ctl.WRITING, 1)


def pub_scale(factor: float) -> None:
    for t in HELD["weights"].values():
        t.mul_(factor)


def pub_close() -> None:
    pub = HELD.pop("pub", None)
    if pub is not None:
        pub.close()
    HELD.pop("weights", None)
    for conn in HELD.pop("conns", []):
        conn.close()


def pub_hammer(n: int) -> int:
    """Publish versions filled with their own number as fast as possible."""
    pub, weights = HELD["pub"], HELD["weights"]
    for _ in range(n):
        version = pub.version + 1
        for t in weights.values():
            t.fill_(float(version))
        pub.publish()
    if weights["step"].is_cuda:
        torch.cuda.synchronize()
    return pub.version
