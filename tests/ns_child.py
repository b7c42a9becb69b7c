"""The process that tests/containers/test_containers.py runs in new PID, network and IPC
namespaces (tests/namespace_helpers.py): one job per invocation, named by the
first argument; results as JSON lines on stdout."""
import json
import os
import sys
import time

import torch

import torch_ipc
from torch_ipc import _C, _process


def say(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def namespace() -> dict:
    return dict(pid=os.getpid(), pidns=os.stat("/proc/self/ns/pid").st_ino, netns=os.stat("/proc/self/ns/net").st_ino)


def hold_forever() -> None:
    while True:
        time.sleep(60)


def load(path: str, *flags: str) -> None:
    """Load the descriptor in `path`; report; add 1 to it ('write'); stay ('hold')."""
    try:
        x = torch_ipc.loads(open(path, "rb").read())
    except Exception as e:  # reported, not raised: the test checks which error
        say(error=type(e).__name__, message=str(e), **namespace())
        return
    if "write" in flags:
        x.add_(1)
    for _ in range(3):  # collections must keep the living producer's lease segment mapped
        torch_ipc.collect()
    say(values=x.tolist(), lease_segments=_C.stats()["lease_segments"], **namespace())
    if "hold" in flags:
        hold_forever()


def client(address: str, authkey_hex: str, *flags: str) -> None:
    """Connect to a Listener at a socket path, receive a tensor, add 1, send its sum back."""
    with torch_ipc.connect(address, authkey=bytes.fromhex(authkey_hex)) as c:
        x = c.recv()
        x.add_(1)
        c.send(float(x.sum()))
        # The listener's pid is not visible here (SO_PEERCRED says 0): judged by its life key.
        say(values=x.tolist(), peer=list(c._peer), peer_alive=_process.alive(c._peer), **namespace())
        if "hold" in flags:
            hold_forever()
        c.recv()  # until the producer says goodbye


def produce(path: str) -> None:
    """Export a tensor into `path`, report this process's /dev/shm files, and stay."""
    x = torch.arange(8.0)
    data = torch_ipc.dumps(x, consumers=None)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)
    pid, start, life, pidns = _C.self_identity()
    life_file = f"torch_ipc.life.{life:08x}"
    mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_ipc.{pid}.{start}.") or n == life_file]
    say(files=sorted(mine), life=life, **namespace())
    hold_forever()


def fetch_fds(pid: str, start: str, life: str, pidns: str, ident: str, mode: str = "", remote: str = "") -> None:
    """Fetch the fds export `ident` of a producer elsewhere published; report their bytes."""
    remote_fds = [int(f) for f in remote.split(",") if f]
    try:
        got = _C._testing.fd_fetch(int(pid), int(start), int(ident), remote_fds, mode, int(life), int(pidns))
    except OSError as e:
        say(error=type(e).__name__, message=str(e))
        return
    out = []
    for fd, _size in got:
        out.append(os.pread(fd, 64, 0).rstrip(b"\0").decode())
        os.close(fd)
    say(contents=out)


KV_SHAPE = (2, 4)


def kv_attach(path: str, n: str, device: str = "cpu") -> None:
    """Attach to the KV pool whose pickle is in `path`, allocate `n` blocks and
    fill them with this pid, reclaim (nobody here is dead), report; stay."""
    from torch_ipc.kv import SharedKVPool

    pool = SharedKVPool.attach(open(path, "rb").read(), KV_SHAPE, torch.int32)
    ids = pool.allocate(int(n))
    pool.scatter(ids, torch.full((len(ids), *KV_SHAPE), os.getpid(), dtype=torch.int32, device=pool.device))
    if pool.device.type == "cuda":
        torch.cuda.synchronize()  # the test reads these blocks from another process
    reclaimed = sum(pool.reclaim() for _ in range(3))
    for _ in range(3):
        torch_ipc.collect()
    say(ids=ids, reclaimed=reclaimed, free=pool.free_blocks, holders=len(pool.holders()),
        seen=pool.gather([0]).reshape(-1).tolist(), device=str(pool.device), **namespace())  # fmt: skip
    hold_forever()


def kv_recv(address: str, authkey_hex: str) -> None:
    """Connect to a torch_ipc Listener at a path, attach to the KV pool it
    sends, receive a hand-over of blocks (taking them over), report; stay."""
    from torch_ipc.kv import SharedKVPool

    with torch_ipc.connect(address, authkey=bytes.fromhex(authkey_hex)) as c:
        pool = SharedKVPool.attach(c, KV_SHAPE, torch.int32)
        got = pool.recv(c)
        say(ids=got.ids, meta=got.meta, held=sorted(pool.held()), seen=pool.gather(got.ids).reshape(-1).tolist(),
            **namespace())  # fmt: skip
        hold_forever()


def kv_own(path: str, device: str = "cpu") -> None:
    """Create a KV pool of 8 blocks, hold 3 filled with 7, put its pickle in `path`, report; stay."""
    from torch_ipc.kv import SharedKVPool

    pool = SharedKVPool(8, KV_SHAPE, torch.int32, device)
    ids = pool.allocate(3)
    pool.scatter(ids, torch.full((3, *KV_SHAPE), 7, dtype=torch.int32, device=device))
    if device != "cpu":
        torch.cuda.synchronize()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(torch_ipc.dumps(pool))
    os.rename(tmp, path)
    say(ids=ids, **namespace())
    hold_forever()


def weights_sub(address: str, authkey_hex: str, device: str = "cpu") -> None:
    """A weights Subscriber of the Publisher listening at `address`: pull
    version 1, report (whether it is the publisher's model), stay."""
    import weights_helpers as h

    sub = h.Subscriber(h.Connector(address, bytes.fromhex(authkey_hex), wait=60), timeout=60)
    model = h.make_weights(device, fill=0.0)
    try:
        version = sub.pull(model, timeout=60)
    except Exception as e:  # reported, not raised: the test checks which error
        say(error=type(e).__name__, message=str(e), **namespace())
        return
    say(version=version, same=h.bits(model) == h.bits(h.make_weights()), alive=sub.publisher_alive(), **namespace())
    hold_forever()


def weights_pub(address: str, authkey_hex: str, device: str = "cpu") -> None:
    """A weights Publisher at `address`: attach one subscriber, publish version 1, report, stay."""
    import weights_helpers as h

    version = h.pub_serve(address, bytes.fromhex(authkey_hex), device=device)
    say(version=version, subscribers=h.HELD["pub"].subscribers, **namespace())
    hold_forever()


def event(path: str) -> None:
    """Load the IpcEvent pickled in `path`, order this stream after it, drop
    it, collect; report how many opened events this process keeps (its
    producer lives: the event stays open for the next load)."""
    import pickle

    e = pickle.loads(open(path, "rb").read())
    e.wait()
    torch.cuda.synchronize()
    done = e.query()
    del e
    for _ in range(3):
        torch_ipc.collect()
    say(done=done, events_open=_C.stats()["events_open"], **namespace())
    hold_forever()


def mp_client(address: str, authkey_hex: str, *flags: str) -> None:
    """With init_reductions(): connect to a multiprocessing Listener at a
    path, receive a CPU tensor, add 1, send its sum back; report; stay
    ('hold') or wait for the producer's goodbye."""
    from multiprocessing import connection as mpc

    torch_ipc.init_reductions()
    with mpc.Client(address, authkey=bytes.fromhex(authkey_hex)) as c:
        x = c.recv()
        x.add_(1)
        c.send(float(x.sum()))
        say(values=x.tolist(), **namespace())
        if "hold" in flags:
            hold_forever()
        c.recv()


def pipe_end(address: str, authkey_hex: str, *flags: str) -> None:
    """Connect to a torch_ipc Listener at a path and receive one end of a
    torch_ipc.Pipe; through it, receive a CPU tensor, add 1, send its sum
    back; report; stay ('hold') or wait for the producer's goodbye."""
    with torch_ipc.connect(address, authkey=bytes.fromhex(authkey_hex)) as c:
        end = c.recv()
        x = end.recv()
        x.add_(1)
        end.send(float(x.sum()))
        say(values=x.tolist(), kind=type(end).__name__, **namespace())
        if "hold" in flags:
            hold_forever()
        end.recv()


def pipe_pair(address: str, authkey_hex: str) -> None:
    """Use both ends of a new torch_ipc.Pipe (as pid 1 of this namespace),
    hand both to the Listener at a path, and exit without closing them."""
    with torch_ipc.connect(address, authkey=bytes.fromhex(authkey_hex)) as c:
        e0, e1 = torch_ipc.Pipe()
        e0.send("ping")
        assert e1.recv() == "ping"
        c.send(e0)
        c.send(e1)
        say(pid=os.getpid(), handed=c.recv())
        os._exit(0)  # no close(): the claims go with this process


if __name__ == "__main__":
    jobs = {"load": load, "client": client, "produce": produce, "fetch_fds": fetch_fds, "kv_attach": kv_attach,
            "kv_own": kv_own, "kv_recv": kv_recv, "weights_sub": weights_sub, "weights_pub": weights_pub, "event": event, "mp_client": mp_client,
            "pipe_end": pipe_end, "pipe_pair": pipe_pair}  # fmt: skip
    jobs[sys.argv[1]](*sys.argv[2:])
