"""``python -m torch_ipc``: the command line (``doctor``, ``--help``)."""
import sys

HELP = """usage: python -m torch_ipc doctor [--json]
       python -m torch_ipc --help

torch_ipc shares PyTorch tensors (CUDA and CPU) between processes on one
machine, zero-copy. This command line has one command:

  doctor        check this machine for what torch_ipc needs (CUDA driver and
                IPC, the P2P matrix, /dev/shm size and free space, fd passing
                and pidfd_getfd rights, PID namespace, expandable segments,
                open-file limit) and print a table with a fix for each failing
                line; exits 1 when a check that matters here fails
    --json      the rows as JSON instead of a table

The library itself is used from Python: help(torch_ipc), or the README."""


def _main(argv) -> int:
    if argv and argv[0] in ("-h", "--help", "help"):
        print(HELP)
        return 0
    if not argv or argv[0] != "doctor":
        print(HELP.split("\n\n")[0], file=sys.stderr)
        print("python -m torch_ipc: " + (f"unknown command {argv[0]!r}" if argv else "name a command")
              + "; --help says more", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in argv[1:]):
        print(HELP)
        return 0
    from .doctor import main

    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
