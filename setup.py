"""Build torch_ipc._C: a C++ extension that links no CUDA library.

The CUDA driver API is resolved at run time (see csrc/cuda/cuda_driver.h), so the
build needs only a C++ compiler, torch's headers and `cuda.h`. Both are looked
for only when compiling: an sdist or the metadata need neither.

Environment knobs:
  TORCH_IPC_CUDA_INCLUDE  folder holding cuda.h (else: CUDA_HOME, CUDA_PATH, next
                          to `nvcc`, the nvidia-cuda-runtime pip package,
                          /usr/local/cuda*; see build_tools/cuda_headers.py)
  TORCH_IPC_DEBUG=1       build with -O0 -g (release builds carry no debug info)
"""
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import setuptools  # noqa: E402
from setuptools import Extension, setup  # noqa: E402
from setuptools.command.build_ext import build_ext  # noqa: E402

from build_tools.build_torch import INSTALL_TORCH, torch_available, write_build_info  # noqa: E402
from build_tools.cuda_headers import find_cuda_include  # noqa: E402

# pyproject.toml's SPDX `license` string needs setuptools 77; older ones fail
# with a schema error that names neither.
if int(setuptools.__version__.split(".")[0]) < 77:
    sys.exit(f"torch_ipc needs setuptools>=77 to build (this is {setuptools.__version__}): "
             "pip install -U 'setuptools>=77' wheel")

NAME = "torch_ipc._C"
# csrc/ is laid out by layer (Note [layers] in csrc/README.md); includes are
# written from csrc/, e.g. "os/shm.h".
SOURCES = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
debug = os.environ.get("TORCH_IPC_DEBUG") == "1"
compile_args = ["-Wall", "-Wno-unused-function"] + (["-O0", "-g"] if debug else ["-O2", "-g0"])
link_args = [] if debug else ["-Wl,--strip-debug"]


# Commands that compile; metadata and sdists need no torch.
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def no_torch_exit():
    """Stop before setuptools prints anything, so that the reason is the last
    line of the build's output, just above pip's own summary."""
    sys.exit("torch_ipc: no torch to build against; " + INSTALL_TORCH)


class NoTorch(build_ext):
    """Stands in for torch's BuildExtension where no torch can be found."""

    def run(self):
        no_torch_exit()


have_torch = torch_available()
if not have_torch and BUILD_COMMANDS.intersection(sys.argv[1:]):
    no_torch_exit()
if have_torch:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class BuildWithCudaHeader(BuildExtension):
        """torch's BuildExtension, plus cuda.h's folder and the record of the torch used."""

        def build_extensions(self):
            cuda_include = find_cuda_include()
            print(f"torch_ipc: cuda.h from {cuda_include}; torch {torch.__version__}")
            for ext in self.extensions:
                ext.include_dirs.append(cuda_include)
            super().build_extensions()

        def run(self):
            super().run()
            # Beside _C: in build/lib for a wheel, in the source folder with --inplace;
            # an editable install imports the package's Python files from the source folder.
            folders = {os.path.dirname(self.get_ext_fullpath(NAME))}
            if self.editable_mode:
                folders.add(self.get_finalized_command("build_py").get_package_dir("torch_ipc"))
            for folder in folders:
                write_build_info(folder, torch.__version__)

    extension = CppExtension(name=NAME, sources=SOURCES, include_dirs=[os.path.abspath("csrc")],
                             extra_compile_args=compile_args,
                             extra_link_args=link_args, libraries=["dl"])
    build_command = BuildWithCudaHeader
else:
    extension = Extension(name=NAME, sources=SOURCES)
    build_command = NoTorch

setup(ext_modules=[extension], cmdclass={"build_ext": build_command})
