"""``python -m torch_ipc doctor [--json]``: see torch_ipc/doctor.py."""
import sys

USAGE = "usage: python -m torch_ipc doctor [--json]"


def _main(argv) -> int:
    if not argv or argv[0] != "doctor":
        print(USAGE, file=sys.stderr)
        return 2
    from .doctor import main

    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
