"""Refuse to load the extension under a torch other than the one it was built
against (Note [build against the installed torch] in build_tools/build_torch.py).

Note [which torch versions match]
The release part must be equal (2.13.0 == 2.13.0): torch's C++ ABI changes
between releases, and an extension built against another one fails with an
undefined symbol, or worse, loads and misbehaves. The local label (+cpu,
+cu130) is ignored: CPU and CUDA builds of one release share headers and
symbols, and this extension links no CUDA library, so one build serves both.
"""

import glob
import importlib.machinery
import os
import sys
from typing import Optional

REBUILD = ("rebuild torch_ipc against this torch: from its source folder, "
           "`pip install --no-build-isolation --no-deps --force-reinstall .`")


def release(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0'."""
    return version.split("+", 1)[0]


def check_torch_version(built_with: str, running: str) -> None:
    """ImportError naming both versions and the fix unless they match."""
    if release(built_with) != release(running):
        raise ImportError(
            f"torch_ipc was built against torch {built_with} but this process runs torch "
            f"{running}; {REBUILD} (or install torch=={release(built_with)})"
        )


def check_built_torch() -> None:
    """Compare the torch recorded at build time with the one imported."""
    import torch

    try:
        from ._build_info import TORCH_VERSION
    except ImportError:
        return  # built by a setup.py that recorded nothing: _C's own import decides
    check_torch_version(TORCH_VERSION, torch.__version__)


def installed_copy(package_dir: str) -> Optional[str]:
    """Another torch_ipc on sys.path, with a built extension, than the one in
    ``package_dir``: the installed copy that a source folder shadows."""
    here = os.path.realpath(package_dir)
    for entry in sys.path:
        folder = os.path.join(entry or os.getcwd(), "torch_ipc")
        if os.path.realpath(folder) == here:
            continue
        if any(glob.glob(os.path.join(folder, "_C" + suffix)) for suffix in importlib.machinery.EXTENSION_SUFFIXES):
            return folder
    return None


def extension_import_error(error: ImportError, package_dir: str) -> ImportError:
    """What to say when torch_ipc._C itself fails to import (from ``package_dir``)."""
    if "cannot import name '_C'" not in str(error):
        return ImportError(f"torch_ipc's extension failed to load ({error}); {REBUILD}")
    build_here = f"build it in place (`python setup.py build_ext --inplace` in {os.path.dirname(package_dir)})"
    other = installed_copy(package_dir)
    if other is not None:
        return ImportError(
            f"torch_ipc: Python imported the source folder {package_dir}, which has no built extension, "
            f"instead of the installed torch_ipc in {other}: the current directory (or the script's) "
            f"comes first on sys.path. Run from another directory, or {build_here}")
    return ImportError(
        f"torch_ipc's extension torch_ipc._C is not built in {package_dir}; install the package "
        f"(`pip install --no-build-isolation .`) or {build_here}")
