"""Which torch the extension is built against, and the record of it.

Note [build against the installed torch]
A C++ extension must run under the torch it was compiled against. pip's build
isolation builds in a fresh environment where a `torch` build requirement
would be the newest release from the index (gigabytes, and often not the torch
installed), so torch is no build requirement. Under isolation setup.py asks
this interpreter without its build environment (`python -E`) where the torch of
the environment being installed into lies, and builds against that one. With
none installed the build stops and says how to install one. The version built
against goes into torch_ipc/_build_info.py, which the package checks at import
(torch_ipc/_torch_check.py).
"""
import os
import subprocess
import sys
from typing import Optional

INSTALL_TORCH = (
    "install torch first, then build torch_ipc against it: CPU only: "
    "`pip install torch --index-url https://download.pytorch.org/whl/cpu`; "
    "with CUDA: `pip install torch`; then `pip install --no-build-isolation .`"
)

_FIND_TORCH = (
    "import importlib.util, os; s = importlib.util.find_spec('torch'); "
    "print(os.path.dirname(os.path.dirname(s.origin)) if s and s.origin else '')"
)


def installed_torch_site() -> Optional[str]:
    """The site-packages folder holding torch for this interpreter outside any
    build isolation (PYTHONPATH and PYTHONNOUSERSITE ignored), or None."""
    try:
        out = subprocess.run([sys.executable, "-E", "-c", _FIND_TORCH], capture_output=True,
                             text=True, timeout=60, cwd=os.path.expanduser("~"))
    except (OSError, subprocess.SubprocessError):
        return None
    site = out.stdout.strip()
    return site if out.returncode == 0 and site else None


def torch_available() -> bool:
    """Make `import torch` work if any torch can be built against: this
    environment's, else (under build isolation) the installed one's. False
    when there is none."""
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        pass
    site = installed_torch_site()
    if site is None:
        return False
    sys.path.append(site)  # after the build environment's own packages
    import torch
    print(f"torch_ipc: building against the installed torch {torch.__version__} ({site})")
    return True


def build_info_source(torch_version: str) -> str:
    return (
        '"""Written by setup.py when the extension was built."""\n\n'
        f"TORCH_VERSION = {torch_version!r}  # the torch the extension was compiled against\n"
    )


def write_build_info(package_dir: str, torch_version: str) -> str:
    """Write _build_info.py into `package_dir` (where _C is built); returns its path."""
    os.makedirs(package_dir, exist_ok=True)
    path = os.path.join(package_dir, "_build_info.py")
    with open(path, "w") as f:
        f.write(build_info_source(torch_version))
    return path
