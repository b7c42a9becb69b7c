"""Build torch_ipc._C: a C++ extension that links no CUDA library.

The CUDA driver API is resolved at run time (see csrc/cuda_driver.h), so the
build needs only a C++ compiler, torch's headers and `cuda.h`.

Environment knobs:
  TORCH_IPC_CUDA_INCLUDE  folder holding cuda.h (default: $CUDA_HOME/include,
                          then next to `nvcc` on PATH, then /usr/local/cuda*/include)
  TORCH_IPC_DEBUG=1       build with -O0 -g
"""
import glob
import os
import shutil

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


def find_cuda_include():
    candidates = [os.environ.get("TORCH_IPC_CUDA_INCLUDE")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "..", "include"))
    candidates.append("/usr/local/cuda/include")
    candidates += sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True)
    for folder in candidates:
        if folder and os.path.isfile(os.path.join(folder, "cuda.h")):
            return os.path.abspath(folder)
    raise RuntimeError(
        "torch_ipc needs cuda.h (the CUDA driver API header) to build; set "
        "TORCH_IPC_CUDA_INCLUDE to the folder that holds it. No CUDA library is linked."
    )


debug = os.environ.get("TORCH_IPC_DEBUG") == "1"
extra = ["-O0", "-g"] if debug else ["-O2"]

setup(
    ext_modules=[
        CppExtension(
            name="torch_ipc._C",
            sources=sorted(glob.glob("csrc/*.cpp")),
            include_dirs=[find_cuda_include()],
            extra_compile_args=["-Wall", "-Wno-unused-function"] + extra,
            libraries=["dl"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
