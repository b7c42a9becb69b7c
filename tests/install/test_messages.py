"""What a newcomer reads when something is off: one line that says what
happened and what to do, with the address, the path or the memory kind that
matters (and no traceback from the example scripts and benchmarks)."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import torch_ipc

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120


def run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT, **kwargs)


def one_line_failure(r: subprocess.CompletedProcess) -> str:
    """The script failed with exactly one line on stderr (no traceback); that line."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


# ---------------------------------------------------------------- API messages

@pytest.mark.parametrize("data, hint", [("not bytes", "keep descriptors as bytes"), (123, "not int")])
def test_loads_of_something_else_than_bytes(data, hint):
    with pytest.raises(TypeError, match=r"torch_ipc.loads\(\) takes the bytes that dumps\(\) returned") as e:
        torch_ipc.loads(data)
    assert hint in str(e.value)


def test_loads_takes_any_bytes_like():
    x = torch.arange(6.0)
    data = torch_ipc.dumps(x)
    for form in (bytearray(data), memoryview(data)):
        y = torch_ipc.loads(form)
        assert torch.equal(y, x)


def test_connect_to_a_missing_socket_names_it(tmp_path):
    path = str(tmp_path / "nobody.sock")
    with pytest.raises(FileNotFoundError) as e:
        torch_ipc.connect(path, authkey=b"k")
    assert f"cannot connect to {path!r}" in str(e.value) and "start the listener first" in str(e.value)


def test_connect_to_a_closed_port_names_it():
    with socket.socket() as s:  # a port that nobody listens on
        s.bind(("127.0.0.1", 0))
        address = s.getsockname()
    with pytest.raises(ConnectionRefusedError, match=rf"cannot connect to \('127.0.0.1', {address[1]}\)"):
        torch_ipc.connect(address, authkey=b"k")


def test_listen_on_a_taken_address_names_it():
    with torch_ipc.listen(authkey=b"k") as first:
        with pytest.raises(OSError, match=f"cannot listen at {first.address!r}"):
            torch_ipc.listen(first.address, authkey=b"k")


def test_listen_with_a_generated_key_prints_address_and_key(capsys):
    with torch_ipc.listen() as listener:
        err = capsys.readouterr().err
        address = listener.address
    assert err == (f"torch_ipc: listening at {address!r}; clients connect with "
                   f"torch_ipc.connect({address!r}, authkey={listener.authkey!r})\n")


# ---------------------------------------------------------------- a producer that exits

PRODUCER = """
import sys, torch, torch_ipc
x = torch.arange(1000.0, device=sys.argv[1])
print(torch_ipc.dumps(x).hex(), flush=True)
sys.stdin.readline()  # until the consumer loaded (or gave up)
"""


def start_producer(device: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}  # legacy IPC memory
    return subprocess.Popen([sys.executable, "-c", PRODUCER, device], stdin=subprocess.PIPE, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> str:
    """Let the producer exit; its stderr."""
    try:
        _, err = p.communicate("go\n", timeout=TIMEOUT)
        return err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still alive")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_producer_gone_names_the_kind_of_tensors(device):
    p = start_producer(device)
    try:
        data = bytes.fromhex(p.stdout.readline())
    finally:
        finish(p)
    wait_gone(p.pid)
    with pytest.raises(torch_ipc.ProducerGoneError) as e:
        torch_ipc.loads(data)
    kind = "CPU" if device == "cpu" else "CUDA"
    assert str(e.value) == (f"torch_ipc: the producer (pid {p.pid}) has exited; the {kind} tensors it shared "
                            "can no longer be loaded; export them again from a running process")


def test_exit_while_a_consumer_holds_cpu_tensors_is_no_warning():
    # Shared host memory stays mapped in the consumer (lifetime rule 7): nothing goes.
    p = start_producer("cpu")
    try:
        y = torch_ipc.loads(bytes.fromhex(p.stdout.readline()))
    finally:
        err = finish(p)
    assert p.returncode == 0, err
    assert "exits while" not in err, err
    assert torch.equal(y, torch.arange(1000.0))  # still readable after the producer exited


@pytest.mark.cuda
def test_exit_while_a_consumer_holds_legacy_cuda_memory_warns():
    p = start_producer("cuda")
    try:
        y = torch_ipc.loads(bytes.fromhex(p.stdout.readline()))
        torch.cuda.synchronize()
    finally:
        err = finish(p)
    assert p.returncode == 0, err
    assert ("torch_ipc: this process exits while 1 consumer process(es) still hold 4000 bytes of its CUDA "
            "memory shared through legacy CUDA IPC, which goes with it") in err, err
    del y


# ---------------------------------------------------------------- scripts

def script(path: str) -> str:
    full = REPO / path
    if not full.is_file():
        pytest.skip(f"needs the source tree's {path}")
    return str(full)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_vmm_floor_without_a_gpu_says_so():
    line = one_line_failure(run([script("benchmarks/vmm_floor.py"), "--rounds", "1"]))
    assert "needs a GPU" in line


def test_handle_file_consumer_without_a_descriptor(tmp_path):
    path = tmp_path / "missing.tipc"
    line = one_line_failure(run([script("examples/handle_file.py"), "--role", "consumer", "--path", str(path)]))
    assert line.startswith(f"FAILED: no descriptor at {path}; start the producer first")


def test_handle_file_consumer_timeout(tmp_path):
    r = run([script("examples/handle_file.py"), "--timeout", "0.01"])
    assert one_line_failure(r) == "FAILED: the consumer did not finish in 0.01 s"


def test_listener_client_without_a_server(tmp_path):
    path = tmp_path / "nobody.sock"
    line = one_line_failure(run([script("examples/listener_client.py"), str(path), "--authkey", "k"]))
    assert line.startswith(f"FAILED: [Errno 2] torch_ipc: cannot connect to '{path}'")


def test_listener_server_timeout(tmp_path):
    r = run([script("examples/listener_server.py"), "--address", str(tmp_path / "s.sock"), "--timeout", "1"])
    assert one_line_failure(r) == "FAILED: no client connected in time (--timeout)"
