"""``python -m torch_ipc doctor``: check what torch_ipc needs from this machine.

Each check is one row: what was looked at, its status, what was found, and
for a row that is not ``ok`` what to do about it. Statuses:

- ``ok``: works.
- ``FAIL``: torch_ipc will not work here as it should; the command exits 1.
- ``warn``: works, with a limit worth knowing.
- ``info``: a fact about the machine (no GPU, the fd path used, ...).

A check fails only where it matters for the machine: no CUDA driver is a FAIL
on a machine with NVIDIA GPUs and ``info`` on one without.

Example::

    $ python -m torch_ipc doctor           # the table
    $ python -m torch_ipc doctor --json    # the same rows as JSON
"""
import ctypes
import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import Callable, List, NamedTuple, Optional

__all__ = ["Row", "run_checks", "main"]

OK, FAIL, WARN, INFO = "ok", "FAIL", "warn", "info"


class Row(NamedTuple):
    check: str
    status: str
    detail: str
    fix: str = ""


def _mib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _has_nvidia_gpu() -> bool:
    """NVIDIA device nodes or driver: whether CUDA problems matter here."""
    return os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/version")


def _child(script: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], input=stdin, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


# ----------------------------------------------------------------------------- checks


def check_versions() -> List[Row]:
    import torch

    from . import _C

    cuda = torch.version.cuda or "none (CPU build)"
    try:
        from ._build_info import TORCH_VERSION as built_with
    except ImportError:
        built_with = "unrecorded"
    python = sys.version.split()[0]
    rows = [Row("torch and torch_ipc", OK, f"torch {torch.__version__}, CUDA build {cuda}, python {python}, "
                f"torch_ipc extension {_C.__file__} (built against torch {built_with})")]  # fmt: skip
    driver_ok, why = _C.cuda_available()
    gpus = _has_nvidia_gpu()
    if driver_ok:
        version = _driver_version()
        try:
            with open("/proc/driver/nvidia/version") as f:
                kernel = f.readline().strip()
        except OSError:
            kernel = "kernel module version unknown"
        rows.append(Row("CUDA driver", OK, f"CUDA driver API {version}; {kernel}"))
    elif gpus:
        rows.append(Row("CUDA driver", FAIL, f"this machine has NVIDIA devices but no usable driver: {why}",
                        "install the NVIDIA driver (libcuda.so.1) or make it visible in the container "
                        "(--gpus all / the NVIDIA container toolkit)"))  # fmt: skip
    else:
        rows.append(Row("CUDA driver", INFO, f"no NVIDIA GPU here ({why}): CPU tensors only"))
    if gpus and driver_ok and not torch.cuda.is_available():
        rows.append(Row("torch CUDA", FAIL, f"torch {torch.__version__} cannot use the GPUs",
                        "install a CUDA build of torch (pip install torch --index-url .../cu1xx)"))  # fmt: skip
    return rows


def _driver_version() -> str:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if cuda.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return "version unknown"


def _cuda_attributes(count: int) -> List[dict]:
    """Per device: the driver's answer on IPC, VMM and fd handles, and peer access."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    out = []
    for i in range(count):
        dev = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), i)

        def attr(code: int) -> int:
            v = ctypes.c_int()
            return v.value if cuda.cuDeviceGetAttribute(ctypes.byref(v), code, dev) == 0 else -1

        peers = []
        for j in range(count):
            other, can = ctypes.c_int(), ctypes.c_int()
            cuda.cuDeviceGet(ctypes.byref(other), j)
            peers.append(j == i or (cuda.cuDeviceCanAccessPeer(ctypes.byref(can), dev, other) == 0 and can.value == 1))
        out.append(dict(unified=attr(41), vmm=attr(102), posix_fd=attr(103), ipc_event=attr(125), peers=peers))
    return out


_ROUND_TRIPS = """
import sys, torch, torch_ipc
for line in sys.stdin.read().split():
    try:
        y = torch_ipc.loads(bytes.fromhex(line))
        y.fill_(7)
        if y.is_cuda:
            torch.cuda.synchronize(y.device)
        print("ok", flush=True)
    except Exception as e:
        print(f"{type(e).__name__}: {e}".replace(chr(10), " "), flush=True)
"""


def _round_trips(devices: List[str]) -> List[Optional[str]]:
    """Share a tensor on each device with one fresh process, which writes 7
    into each; per device, None when this process then sees the 7s, else what
    went wrong. One process for every device: an interpreter with torch takes
    seconds to start."""
    import torch

    from ._serialize import dumps

    xs = [torch.zeros(1024, device=d) for d in devices]
    try:
        r = _child(_ROUND_TRIPS, " ".join(dumps(x).hex() for x in xs))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return [f"{type(e).__name__}: {e}"] * len(devices)
    answers = r.stdout.splitlines()
    out: List[Optional[str]] = []
    for i, x in enumerate(xs):
        if i >= len(answers):
            out.append(_last_line(r.stderr) or f"the consumer exited with {r.returncode}")
        elif answers[i] != "ok":
            out.append(answers[i])
        elif not bool((x == 7).all()):
            out.append("the consumer's writes are not visible to the producer")
        else:
            out.append(None)
    return out


def check_cuda() -> List[Row]:
    import torch

    if not torch.cuda.is_available():
        return [Row("CUDA IPC", INFO, "no CUDA in this torch: nothing to check")]
    count = torch.cuda.device_count()
    attrs = _cuda_attributes(count)
    usable = [i for i, a in enumerate(attrs) if a["unified"] == 1 and a["ipc_event"] != 0]
    problems = dict(zip(usable, _round_trips([f"cuda:{i}" for i in usable]))) if usable else {}
    rows = []
    for i, a in enumerate(attrs):
        what = (f"unified addressing {a['unified']}, IPC events {a['ipc_event']}, VMM {a['vmm']}, "
                f"POSIX fd handles {a['posix_fd']}")  # fmt: skip
        if a["unified"] != 1 or a["ipc_event"] == 0:
            rows.append(Row(f"CUDA IPC cuda:{i}", FAIL, what,
                            "this device cannot share memory across processes (a MIG instance or a "
                            "platform without CUDA IPC); use a full GPU"))  # fmt: skip
            continue
        problem = problems[i]
        if problem is None:
            rows.append(Row(f"CUDA IPC cuda:{i}", OK, what + "; a round trip through another process works"))
        else:
            rows.append(Row(f"CUDA IPC cuda:{i}", FAIL, f"{what}; a round trip failed: {problem}",
                            "run the consumer as the same user on this machine; see docs/troubleshooting.md "
                            "in torch_ipc's source for the error above"))  # fmt: skip
    if count > 1:
        missing = [f"{i}->{j}" for i, a in enumerate(attrs) for j, ok in enumerate(a["peers"]) if not ok]
        matrix = " ".join("".join("x" if ok else "." for ok in a["peers"]) for a in attrs)
        if missing:
            detail = f"rows by device, x: peer access ({matrix}); none for {', '.join(missing)}"
            rows.append(Row("P2P matrix", WARN, detail,
                            "a consumer on another GPU than the memory reads it through the host: keep "
                            "producer and consumer on one GPU, or use GPUs with NVLink/P2P"))  # fmt: skip
        else:
            rows.append(Row("P2P matrix", OK, f"every pair of the {count} GPUs has peer access ({matrix})"))
    else:
        rows.append(Row("P2P matrix", INFO, f"{count} GPU: no pair to check"))
    rows.append(_check_expandable(attrs))
    return rows


def _check_expandable(attrs: List[dict]) -> Row:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    on = "expandable_segments:true" in conf.replace(" ", "").lower()
    if not on:
        return Row("expandable segments", INFO, f"off (PYTORCH_CUDA_ALLOC_CONF={conf!r}): legacy CUDA IPC is used")
    lacking = [i for i, a in enumerate(attrs) if a["vmm"] != 1 or a["posix_fd"] != 1]
    if lacking:
        return Row("expandable segments", FAIL, f"on, but cuda:{lacking} cannot export VMM memory as POSIX fds",
                   "unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF on these devices")  # fmt: skip
    return Row("expandable segments", OK, "on: VMM memory travels as file descriptors (rows below)")


def check_dev_shm() -> List[Row]:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as e:
        return [Row("/dev/shm", FAIL, f"cannot read it: {e}", "mount a tmpfs on /dev/shm")]
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{_mib(free)} free of {_mib(size)}"
    fix = ("CPU tensors live in /dev/shm: give it room (docker run --shm-size=16g, or "
           "mount -o remount,size=16g /dev/shm)")  # fmt: skip
    if free < 1 << 30:
        detail += " (less than 1 GiB: CPU tensors larger than that cannot be shared)"
        return [Row("/dev/shm", FAIL, detail, fix)]
    (problem,) = _round_trips(["cpu"])
    if problem is not None:
        return [Row("/dev/shm", FAIL, f"{detail}; sharing a CPU tensor failed: {problem}", fix)]
    return [Row("/dev/shm", OK, detail + "; a CPU tensor round trip through another process works")]


def _ptrace_scope() -> Optional[int]:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _has_cap_sys_ptrace() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 19 & 1)
    return False


def check_fd_passing() -> List[Row]:
    rows = []
    name = f"torch_ipc-doctor.{os.getpid()}.{os.urandom(4).hex()}"
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind("\0" + name)
        s.close()
        rows.append(Row("fd socket", OK, "abstract Unix sockets work: VMM file descriptors can travel by SCM_RIGHTS"))
    except OSError as e:
        rows.append(Row("fd socket", FAIL, f"cannot bind an abstract Unix socket: {e}",
                        "run producer and consumer in one network namespace"))  # fmt: skip
    scope, cap = _ptrace_scope(), _has_cap_sys_ptrace()
    syscall_ok = _pidfd_getfd_works()
    facts = f"Yama ptrace_scope {scope if scope is not None else 'absent'}, CAP_SYS_PTRACE {'yes' if cap else 'no'}"
    if not syscall_ok:
        rows.append(Row("pidfd_getfd", INFO, f"unavailable ({facts}; needs Linux >= 5.6): the socket is used",
                        "nothing to do; TORCH_IPC_FD_TRANSPORT=socket skips the attempt"))  # fmt: skip
    elif cap or scope in (None, 0):
        rows.append(Row("pidfd_getfd", OK, f"allowed between processes of one user ({facts})"))
    else:
        rows.append(Row("pidfd_getfd", INFO, f"only from ancestors ({facts}): unrelated consumers use the socket",
                        "nothing to do; for the pidfd path grant CAP_SYS_PTRACE or set ptrace_scope 0"))  # fmt: skip
    return rows


def _pidfd_getfd_works() -> bool:
    """pidfd_getfd on a child of ours (allowed by any ptrace_scope below 2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        pidfd = libc.syscall(434, child.pid, 0)  # pidfd_open
        if pidfd < 0:
            return False
        try:
            fd = libc.syscall(438, pidfd, 0, 0)  # pidfd_getfd of its stdin
            if fd < 0:
                return False
            os.close(fd)
            return True
        finally:
            os.close(pidfd)
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def check_namespaces() -> List[Row]:
    with open("/proc/self/status") as f:
        nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
    if len(nspid) > 1:
        row = Row("PID namespace", INFO, f"this process is pid {nspid[-1]} in a PID namespace of its own "
                  f"(pid {nspid[0]} outside): a container; peers elsewhere judge it by its life file (row below)")
    else:
        row = Row("PID namespace", OK, "the machine's own PID namespace")  # fmt: skip
    return [row, _check_other_namespaces()]


def _check_other_namespaces() -> Row:
    """How a peer in another PID or network namespace would reach this process (docs/containers.md)."""
    name = "peers in other namespaces"
    try:
        from . import _C
    except ImportError as e:  # check_versions says why
        return Row(name, FAIL, f"the extension does not import: {e}")
    life = _C.self_identity()[2]
    if not life:
        err = _C.life_file_error()
        return Row(name, FAIL, f"no life file in /dev/shm ({os.strerror(err) if err else 'not made'}): a peer in "
                   "another PID namespace cannot tell whether this process lives, and refuses to load from it",
                   "make /dev/shm writable for this user, with room for a 4 KiB file")  # fmt: skip
    folder, problem = _C.socket_dir()
    if problem and not os.path.exists(folder) and os.access(os.path.dirname(folder) or "/", os.W_OK):
        problem = ""  # made (mode 0700) by the first VMM export
    liveness = f"liveness by the life file /dev/shm/torch_ipc.life.{life:08x} (no pid needed)"
    if problem:
        return Row(name, WARN, f"{liveness}; VMM memory (expandable segments, SharedPool) cannot reach them: "
                   f"{problem}", "set TORCH_IPC_SOCKET_DIR to a folder of this uid with mode 0700 that both see")
    return Row(name, OK, f"{liveness}; VMM file descriptors through a socket in {folder} (TORCH_IPC_SOCKET_DIR): "
               "pidfd_getfd and abstract sockets do not cross namespaces; CPU tensors and cudaMalloc memory need "
               "only /dev/shm")  # fmt: skip


def check_limits() -> List[Row]:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        return [Row("open files", WARN, f"RLIMIT_NOFILE {soft}: each shared VMM chunk is an open file",
                    "ulimit -n 65536 (or LimitNOFILE= in a systemd unit)")]  # fmt: skip
    return [Row("open files", OK, f"RLIMIT_NOFILE {soft if soft != resource.RLIM_INFINITY else 'unlimited'}")]


CHECKS: List[Callable[[], List[Row]]] = [
    check_versions, check_cuda, check_dev_shm, check_fd_passing, check_namespaces, check_limits,
]  # fmt: skip


def run_checks() -> List[Row]:
    """Every check's rows; a check that raises is one FAIL row saying so."""
    rows: List[Row] = []
    for check in CHECKS:
        try:
            rows += check()
        except Exception as e:  # a broken check must not hide the others
            rows.append(Row(check.__name__.replace("check_", ""), FAIL, f"the check itself failed: {e!r}",
                            "report this with the output of python -m torch_ipc doctor"))  # fmt: skip
    return rows


def format_table(rows: List[Row]) -> str:
    widths = [max(len(r[i]) for r in rows + [Row("check", "status", "")]) for i in range(2)]
    lines = [f"{'check':<{widths[0]}}  {'status':<{widths[1]}}  detail", "-" * 78]
    for r in rows:
        lines.append(f"{r.check:<{widths[0]}}  {r.status:<{widths[1]}}  {r.detail}")
        if r.fix:
            lines.append(f"{'':<{widths[0]}}  {'':<{widths[1]}}  fix: {r.fix}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    rows = run_checks()
    if "--json" in args:
        print(json.dumps([r._asdict() for r in rows], indent=1))
    else:
        print(format_table(rows))
    return 1 if any(r.status == FAIL for r in rows) else 0
