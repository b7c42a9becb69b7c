"""Find cuda.h, the one CUDA file the build needs (types and constants of the
driver API; no CUDA library is linked, see csrc/cuda/cuda_driver.h).

Searched in this order, the first folder holding cuda.h wins:
  1. $TORCH_IPC_CUDA_INCLUDE
  2. $CUDA_HOME/include, $CUDA_PATH/include
  3. the include folder next to the `nvcc` found on PATH
  4. the pip packages that CUDA builds of torch install (nvidia-cuda-runtime):
     site-packages/nvidia/cu13/include (CUDA 13 and later),
     site-packages/nvidia/cuda_runtime/include (nvidia-cuda-runtime-cu12)
  5. /usr/local/cuda/include, then /usr/local/cuda-*/include, newest first
"""
import glob
import os
import shutil
import sys
from typing import Iterable, List, Mapping, Optional, Sequence

PIP_HINT = 'pip install "nvidia-cuda-runtime>=13"'

# Note [cuda.h from pip]
# CUDA builds of torch depend on NVIDIA's runtime wheels, which ship the
# toolkit's headers: nvidia-cuda-runtime (CUDA 13 on) unpacks them into
# nvidia/cu13/include, nvidia-cuda-runtime-cu12 into nvidia/cuda_runtime/include.
# A CUDA torch environment therefore already has cuda.h, and a CPU-only one gets
# it from that ~2 MB wheel without installing a toolkit.
PIP_LAYOUTS = ("nvidia/cu[0-9]*/include", "nvidia/cuda_runtime/include")


def pip_package_candidates(site_dirs: Iterable[str]) -> List[str]:
    """Include folders of NVIDIA's pip packages under each of `site_dirs`,
    the highest CUDA version first."""
    found = []
    for site in site_dirs:
        for layout in PIP_LAYOUTS:
            found += sorted(glob.glob(os.path.join(site, layout)), reverse=True)
    return found


def toolkit_candidates(root: str = "/usr/local") -> List[str]:
    """root/cuda/include, then root/cuda-*/include, the newest first."""
    return [os.path.join(root, "cuda", "include")] + sorted(glob.glob(os.path.join(root, "cuda-*", "include")),
                                                            reverse=True)


def candidates(env: Mapping[str, str], site_dirs: Sequence[str], nvcc: Optional[str],
               toolkits: Sequence[str]) -> List[str]:
    """Every folder to look in for cuda.h, in the order of the module docstring."""
    folders = [env.get("TORCH_IPC_CUDA_INCLUDE", "")]
    folders += [os.path.join(env[var], "include") for var in ("CUDA_HOME", "CUDA_PATH") if env.get(var)]
    if nvcc:
        folders.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "..", "include"))
    folders += pip_package_candidates(site_dirs)
    folders += toolkits
    return [f for f in folders if f]


def not_found_message(looked_in: Sequence[str]) -> str:
    return (
        "torch_ipc needs cuda.h (the CUDA driver API header; no CUDA library is linked and no GPU "
        f"is needed) to build, and found none. Get it with `{PIP_HINT}` in this environment, "
        "or set TORCH_IPC_CUDA_INCLUDE (or CUDA_HOME) to a CUDA toolkit's include folder. Looked in: "
        + ", ".join(looked_in)
    )


def find_cuda_include(env: Optional[Mapping[str, str]] = None,
                      site_dirs: Optional[Sequence[str]] = None,
                      nvcc: Optional[str] = None,
                      toolkits: Optional[Sequence[str]] = None) -> str:
    """The folder holding cuda.h; RuntimeError saying how to get one if none has it.
    Each argument left out is this machine's: the environment, sys.path,
    `nvcc` on PATH and the toolkits under /usr/local."""
    env = os.environ if env is None else env
    site_dirs = [p for p in sys.path if os.path.isdir(p)] if site_dirs is None else site_dirs
    nvcc = shutil.which("nvcc") if nvcc is None else nvcc
    toolkits = toolkit_candidates() if toolkits is None else toolkits
    folders = candidates(env, site_dirs, nvcc, toolkits)
    for folder in folders:
        if os.path.isfile(os.path.join(folder, "cuda.h")):
            return os.path.abspath(folder)
    raise RuntimeError(not_found_message(folders))
