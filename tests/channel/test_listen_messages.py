"""What listen() says when it cannot listen (Note [listen errors] in
torch_ipc/mp/_listener.py), and the warnings of a refused client: they point
at the caller's line and name the peer."""
import contextlib
import errno
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import torch_ipc

AUTHKEY = b"listen-messages"
TIMEOUT = 60.0


def test_a_busy_path_is_said_once():
    with torch_ipc.listen(authkey=AUTHKEY) as first:
        address = first.address
        with pytest.raises(OSError) as e:
            torch_ipc.listen(address, authkey=AUTHKEY)
    assert e.value.errno == errno.EADDRINUSE
    assert e.value.strerror == (f"torch_ipc: cannot listen at {address!r}: another listener accepts "
                                "connections there; pick a free address")


def test_a_missing_folder_is_named(tmp_path):
    path = str(tmp_path / "missing" / "x.sock")
    with pytest.raises(FileNotFoundError) as e:
        torch_ipc.listen(path, authkey=AUTHKEY)
    assert e.value.strerror == (f"torch_ipc: cannot listen at {path!r}: the folder "
                                f"{str(tmp_path / 'missing')!r} does not exist; create it first, or pick another path")


def test_a_file_that_is_no_socket_is_named(tmp_path):
    path = str(tmp_path / "plain")
    open(path, "w").close()
    with pytest.raises(FileExistsError) as e:
        torch_ipc.listen(path, authkey=AUTHKEY)
    assert e.value.strerror == (f"torch_ipc: cannot listen at {path!r}: a file that is not a socket is there; "
                                "pick a free address")


def test_a_busy_port_says_what_the_system_said():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        address = taken.getsockname()
        with pytest.raises(OSError) as e:
            torch_ipc.listen(address, authkey=AUTHKEY)
    assert e.value.errno == errno.EADDRINUSE
    assert e.value.strerror == (f"torch_ipc: cannot listen at {address!r}: {os.strerror(errno.EADDRINUSE)}; "
                                "pick a free address")


WRONG_THEN_RIGHT = textwrap.dedent("""
    import sys, torch_ipc
    from multiprocessing import AuthenticationError
    try:
        torch_ipc.connect(sys.argv[1], authkey=b"wrong key")
    except AuthenticationError:
        pass
    sys.stdin.readline()  # until the listener reported the refusal
    with torch_ipc.connect(sys.argv[1], authkey=sys.argv[2].encode()) as conn:
        conn.recv()
""")


def test_a_refused_client_warning_points_at_the_caller_and_names_the_peer():
    # A generous handshake timeout: on a loaded machine the right key's
    # handshake must not be refused too (one refusal is what is checked).
    # Handshakes run concurrently, so a refusal and a later client's acceptance
    # may be reported in either order: the child connects with the right key
    # only once the refusal was reported (by the accept() that waits for it).
    with torch_ipc.listen(authkey=AUTHKEY, handshake_timeout=TIMEOUT) as listener:
        child = subprocess.Popen([sys.executable, "-c", WRONG_THEN_RIGHT, listener.address, AUTHKEY.decode()],
                                 stdin=subprocess.PIPE)  # fmt: skip
        try:
            with pytest.warns(RuntimeWarning, match="refused a client") as caught:
                go_on = threading.Thread(target=_when_warned, args=(caught, child), daemon=True)
                go_on.start()
                conn = listener.accept()
            go_on.join(TIMEOUT)
            with conn:
                conn.send("bye")
            assert child.wait(TIMEOUT) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    refused = [w for w in caught if "refused a client" in str(w.message)]
    assert len(refused) == 1
    assert refused[0].filename == __file__
    assert str(refused[0].message).startswith(f"torch_ipc: refused a client (pid {child.pid}): ")


def _when_warned(caught, child: subprocess.Popen) -> None:
    """Tell `child` to go on once a warning was caught (or when it must give up)."""
    deadline = time.monotonic() + TIMEOUT
    while not caught and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.01)
    with contextlib.suppress(OSError):
        child.stdin.write(b"go\n")
        child.stdin.close()


@pytest.mark.parametrize("bad, what", [(b"", "empty bytes"), ("secret", "str"), (0, "int")])
@pytest.mark.parametrize("caller", ["listen", "Listener", "connect", "Client"])
def test_a_bad_authkey_is_said_once_naming_the_entry_point(tmp_path, caller, bad, what):
    path = str(tmp_path / "x.sock")
    entry = getattr(torch_ipc, caller)
    with pytest.raises(TypeError) as e:
        entry(path, authkey=bad)
    assert str(e.value) == f"torch_ipc.{caller}: authkey must be non-empty bytes, not {what}"
    assert not os.path.exists(path)  # checked before anything is bound or connected
