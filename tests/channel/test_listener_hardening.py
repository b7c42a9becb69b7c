"""The Listener against slow clients and leftovers: a client that trickles its
handshake delays nobody and is cut off at the handshake's deadline (Note
[concurrent handshakes] in torch_ipc/mp/_listener.py); the socket file is 0600
unless asked otherwise; a path left by a killed listener is taken over (Note
[stale socket path]); connect()'s errors name connect. CPU only."""
import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import warnings

import ipc_test_utils as u
import pytest
import torch

import torch_ipc
from torch_ipc.mp import _listener
from torch_ipc.testing import Peer

AUTHKEY = b"listener-hardening-key"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(torch_ipc.__file__))
JOIN_S = 30.0


class _Trickler:
    """A client that connects and then sends its handshake answer one byte
    every ``every`` seconds, until stopped; ``cut_after`` says when the
    listener hung up on it (a send failed)."""

    def __init__(self, address, every: float):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(address)
        self.every = every
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.cut_after = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        # A frame of 200 bytes (multiprocessing's length prefix), one byte at a time.
        payload = (200).to_bytes(4, "big") + b"x" * 200
        for i in range(len(payload)):
            if self.stop.wait(self.every):
                return
            try:
                self.sock.send(payload[i:i + 1])
            except OSError:
                self.cut_after = time.monotonic() - self.started
                return

    def close(self):
        self.stop.set()
        self.thread.join(JOIN_S)
        self.sock.close()


def _connect_send_and_time(address, authkey):
    start = time.monotonic()
    with torch_ipc.connect(address, authkey=authkey) as conn:
        conn.send(torch.arange(3))
        conn.recv()  # the listener's answer
    return time.monotonic() - start


def test_trickling_client_does_not_delay_a_legitimate_one(ipc_peer):
    with torch_ipc.listen(authkey=AUTHKEY, handshake_timeout=10.0) as listener:
        trickler = _Trickler(listener.address, every=0.2)
        try:
            time.sleep(0.3)  # the trickler is in its handshake now (it has sent a byte)
            ipc_peer.start_call(_connect_send_and_time, listener.address, AUTHKEY)
            start = time.monotonic()
            with listener.accept() as conn:
                served = time.monotonic() - start
                assert conn.recv().tolist() == [0, 1, 2]
                conn.send(torch.ones(1))
            took = ipc_peer.result(timeout=JOIN_S)
        finally:
            trickler.close()
    assert served < 1.0 and took < 1.0, f"a legitimate client waited {served:.2f} s ({took:.2f} s on its side)"


def test_trickling_client_is_cut_off_at_the_handshake_deadline():
    with torch_ipc.listen(authkey=AUTHKEY, handshake_timeout=1.0) as listener:
        trickler = _Trickler(listener.address, every=0.1)
        caught = []

        def accept():
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                try:
                    listener.accept()
                except OSError:
                    pass  # closed below
            caught.extend(str(x.message) for x in w)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while trickler.cut_after is None and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            trickler.close()
            listener.close()
            thread.join(JOIN_S)
    assert trickler.cut_after is not None and trickler.cut_after < 3.0, trickler.cut_after
    assert any("did not finish the handshake within 1 s" in m for m in caught), caught


def _socket_mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mode, expected", [(None, None), (0o600, 0o600), (0o660, 0o660)])
def test_unix_socket_mode(tmp_path, mode, expected):
    old = os.umask(0)  # the umask that made it srwxrwxrwx
    try:
        kwargs = {} if mode is None else {"mode": mode}
        with torch_ipc.listen(str(tmp_path / "s"), authkey=AUTHKEY, **kwargs) as listener:
            assert _socket_mode(listener.address) == (expected or 0o600)
    finally:
        os.umask(old)


def test_mode_none_keeps_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with torch_ipc.listen(str(tmp_path / "s"), authkey=AUTHKEY, mode=None) as listener:
            assert _socket_mode(listener.address) == 0o755
    finally:
        os.umask(old)


def _listen_and_wait(path):
    listener = torch_ipc.listen(path, authkey=AUTHKEY)
    _LISTENERS.append(listener)
    return os.getpid()


_LISTENERS = []


def test_listen_takes_over_a_path_left_by_a_killed_listener(tmp_path):
    path = str(tmp_path / "s")
    with Peer() as peer:
        peer.call(_listen_and_wait, path)
        peer.kill()
    assert stat.S_ISSOCK(os.lstat(path).st_mode), "the killed listener left no socket file"
    with torch_ipc.listen(path, authkey=AUTHKEY) as listener:
        thread = threading.Thread(target=lambda: _ACCEPTED.append(listener.accept()), daemon=True)
        thread.start()
        with torch_ipc.connect(path, authkey=AUTHKEY) as conn:
            thread.join(JOIN_S)
            with _ACCEPTED.pop() as server:
                server.send(torch.arange(2))
                assert conn.recv().tolist() == [0, 1]


_ACCEPTED = []


def test_listen_where_somebody_listens_says_so(tmp_path):
    path = str(tmp_path / "s")
    with torch_ipc.listen(path, authkey=AUTHKEY):
        with pytest.raises(OSError) as info:
            torch_ipc.listen(path, authkey=AUTHKEY)
        assert info.value.errno == errno.EADDRINUSE
        assert "another listener accepts connections there" in str(info.value)
        assert os.path.exists(path), "the live listener's socket was removed"


def test_listen_on_a_file_that_is_not_a_socket(tmp_path):
    path = tmp_path / "f"
    path.write_text("keep me")
    with pytest.raises(FileExistsError, match="not a socket"):
        torch_ipc.listen(str(path), authkey=AUTHKEY)
    assert path.read_text() == "keep me"


def test_connect_with_a_str_authkey_names_connect(tmp_path):
    with pytest.raises(TypeError) as info:
        torch_ipc.connect(str(tmp_path / "s"), authkey="k")
    assert "torch_ipc.connect" in str(info.value) and "Client" not in str(info.value)
    with pytest.raises(TypeError, match="torch_ipc.Client"):
        torch_ipc.Client(str(tmp_path / "s"), authkey="k")


def _silent_listener(path: str, first: bytes):
    """A socket that accepts at `path`, sends `first` and then nothing (until closed)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    accepted = []

    def serve():
        try:
            c, _ = server.accept()
        except OSError:
            return
        accepted.append(c)
        c.sendall(first)

    threading.Thread(target=serve, daemon=True).start()
    return server, accepted


@pytest.mark.parametrize("first", [b"", b"\x00\x00\x00\x30#CHALLENGE#"], ids=["silent", "trickle"])
def test_connect_to_a_listener_that_never_finishes_the_handshake_times_out(tmp_path, first):
    # Note [a client's deadline]: without it, connect() waited forever.
    server, accepted = _silent_listener(str(tmp_path / "silent.sock"), first)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish the handshake within 0.5 s"):
            torch_ipc.connect(str(tmp_path / "silent.sock"), authkey=AUTHKEY, timeout=0.5)
        assert 0.4 < time.monotonic() - started < 10
    finally:
        server.close()
        for c in accepted:
            c.close()


def test_connect_with_a_timeout_to_a_listener_that_accepts_late(tmp_path, ipc_peer):
    # The deadline covers the handshake only: the connection then lives on.
    address = str(tmp_path / "late.sock")
    ipc_peer.start_call(_accept_after, address, 0.3)
    assert u.poll_until(lambda: os.path.exists(address) and _listener._someone_listens(address), timeout=JOIN_S)
    with torch_ipc.connect(address, authkey=AUTHKEY, timeout=20) as conn:
        time.sleep(0.5)
        conn.send(torch.arange(3.0))
        assert conn.recv() == 3.0
    ipc_peer.result()


def _accept_after(address: str, delay: float) -> None:
    with torch_ipc.listen(address, authkey=AUTHKEY) as listener:
        time.sleep(delay)
        with listener.accept() as conn:
            conn.send(float(conn.recv().sum()))



def _accept_at_the_fd_limit(address: str) -> dict:
    """In a peer: accept() with a client in the backlog and no fd left."""
    listener = torch_ipc.listen(address, authkey=AUTHKEY)
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting.connect(address)  # in the backlog
    try:
        with u.at_fd_limit():
            started = time.monotonic()
            try:
                listener.accept()
                raised = None
            except OSError as e:
                raised = e.errno
            took = time.monotonic() - started
            cpu, wall = time.process_time(), time.monotonic()
            time.sleep(1.0)  # the acceptor keeps trying meanwhile
            cpu_share = (time.process_time() - cpu) / (time.monotonic() - wall)
    finally:
        waiting.close()
        listener.close()
    return dict(raised=raised, took=took, cpu_share=cpu_share)


def test_accept_at_the_fd_limit_raises_and_does_not_spin(tmp_path, ipc_peer):
    # Note [accept at the fd limit]: multiprocessing's accept() raises EMFILE;
    # ours spun a core trying again at once.
    got = ipc_peer.call(_accept_at_the_fd_limit, str(tmp_path / "emfile.sock"))
    assert got["raised"] == errno.EMFILE and got["took"] < 5, got
    assert got["cpu_share"] < 0.3, got


def test_a_stale_path_taken_over_by_another_listener_meanwhile_is_left_to_it(tmp_path):
    # Note [stale socket path]: two listen() calls on one stale path at once.
    path = str(tmp_path / "raced.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # nobody listens: stale (left long ago: file times are coarse)
    looked_at = os.lstat(path)
    time.sleep(0.05)
    os.unlink(path)  # the other listener took it over first...
    with torch_ipc.listen(path, authkey=AUTHKEY) as first:  # ...and listens there now
        _listener._remove_if_same(path, looked_at)  # the second one's take-over, late
        with pytest.raises(OSError, match="another listener accepts connections there"):
            torch_ipc.listen(path, authkey=AUTHKEY)
        assert os.path.exists(path) and os.lstat(path).st_ino == first._listener._inode
    assert not [n for n in os.listdir(tmp_path) if ".stale-" in n]


def test_a_socket_of_another_user_is_not_called_a_listener(tmp_path):
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv: a process without CAP_DAC_OVERRIDE, facing a root-only socket")
    path = str(tmp_path / "root-only.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    os.chown(path, 65534, 65534)  # nobody's, 0600, in a sticky folder: root without its capabilities may not use it
    os.chmod(path, 0o600)
    os.chmod(tmp_path, 0o1777)
    code = f"import torch_ipc; torch_ipc.listen({path!r}, authkey=b'k')"
    caps = "-dac_override,-dac_read_search,-fowner"
    r = subprocess.run(["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=PACKAGE_ROOT))
    assert "PermissionError" in r.stderr and "a socket this user may not connect to" in r.stderr, r.stderr[-500:]
