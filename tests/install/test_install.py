"""The build and the install: cuda.h found where users have it, the torch the
extension was built against recorded and checked at import, builds under pip's
build isolation using the installed torch, and an sdist that carries what the
README points to."""
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import torch_ipc
from torch_ipc import _torch_check

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120


def build_tools():
    """The repository's build helpers (not installed with the package)."""
    if not (REPO / "build_tools").is_dir():
        pytest.skip("needs the source tree's build_tools/")
    sys.path.insert(0, str(REPO))
    try:
        from build_tools import build_torch, cuda_headers
    finally:
        sys.path.remove(str(REPO))
    return build_torch, cuda_headers


def run_python(code: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


# ---------------------------------------------------------------- the torch built against

def test_build_recorded_the_torch_it_runs_with():
    from torch_ipc import _build_info

    assert _build_info.TORCH_VERSION == torch.__version__


def copy_of_this_package(folder: Path, torch_version: str) -> Path:
    """This very torch_ipc (extension included) under `folder`, its build record
    saying it was built against `torch_version`."""
    pkg = folder / "torch_ipc"
    shutil.copytree(Path(torch_ipc.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    build_torch, _ = build_tools()
    build_torch.write_build_info(str(pkg), torch_version)
    return pkg


# Note [only the copy imports]
# An editable install (pip install -e .) puts a finder of setuptools' at the end
# of sys.meta_path that maps torch_ipc and its modules to the source tree. The
# copy on PYTHONPATH is found first, but a module the copy lacks (the _C a test
# deleted) would then be found by that finder, in the source tree. So the child
# drops the finders of editable installs before it imports: it sees exactly the
# copy, as it would under a regular install.
ONLY_THE_COPY = (
    "import sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n"
)


def import_copy(folder: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(folder))
    code = ONLY_THE_COPY + "import torch_ipc; print(torch_ipc.__file__); torch_ipc.stats()"
    return run_python(code, folder, env)


def test_import_refuses_an_extension_built_against_another_torch(tmp_path):
    copy_of_this_package(tmp_path, "1.0.0")
    r = import_copy(tmp_path)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: torch_ipc was built against torch 1.0.0 but this process runs "
                           f"torch {torch.__version__}; rebuild"), r.stderr
    assert "pip install --no-build-isolation" in last


def test_import_accepts_another_build_of_the_same_release(tmp_path):
    # +cpu and +cu130 builds of one release share the C++ ABI (Note [which torch versions match]).
    copy_of_this_package(tmp_path, _torch_check.release(torch.__version__) + "+cu130")
    r = import_copy(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "torch_ipc" / "__init__.py")


def test_import_without_the_extension_says_how_to_build_it(tmp_path):
    pkg = copy_of_this_package(tmp_path, torch.__version__)
    for so in pkg.glob("_C*.so"):
        so.unlink()
    r = import_copy(tmp_path)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    # Where torch_ipc is also installed, the message names that copy too.
    assert (f"torch_ipc._C is not built in {pkg}" in last or f"imported the source folder {pkg}" in last), r.stderr
    assert "build_ext --inplace" in last, r.stderr
    assert "circular import" not in r.stderr, r.stderr


def test_a_source_folder_shadowing_the_installed_package_names_both(tmp_path):
    installed = copy_of_this_package(tmp_path / "site", torch.__version__)
    checkout = tmp_path / "checkout"
    source = copy_of_this_package(checkout, torch.__version__)
    for so in source.glob("_C*.so"):
        so.unlink()
    # run from the checkout's root, as `python -m torch_ipc doctor` or a script saved there would
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    # -c and runpy as -m would run them (the current folder first on sys.path),
    # seeing only the copies (Note [only the copy imports]).
    doctor = "import runpy; sys.argv = ['torch_ipc', 'doctor']; runpy.run_module('torch_ipc', run_name='__main__')"
    for argv in (["-c", ONLY_THE_COPY + "import torch_ipc"], ["-c", ONLY_THE_COPY + doctor]):
        r = subprocess.run([sys.executable, *argv], cwd=checkout, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert f"imported the source folder {source}" in last and f"installed torch_ipc in {installed}" in last, r.stderr
        assert "Run from another directory" in last and "circular import" not in r.stderr, r.stderr
    assert run_python(ONLY_THE_COPY + "import torch_ipc", tmp_path, env).returncode == 0  # from elsewhere: the installed one


@pytest.mark.parametrize("built, running, ok", [
    ("2.13.0+cpu", "2.13.0+cpu", True),
    ("2.11.0+cu130", "2.11.0", True),
    ("2.14.1", "2.13.0+cpu", False),
    ("2.13.0", "2.13.1", False),
])
def test_version_rule(built, running, ok):
    if ok:
        _torch_check.check_torch_version(built, running)
    else:
        with pytest.raises(ImportError, match=re.escape(f"built against torch {built} but this process runs torch {running};")):
            _torch_check.check_torch_version(built, running)


HIDE_SITE_PACKAGES = (  # what pip's build isolation does to the build's sys.path
    "import sys\n"
    "sys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
)


def test_build_under_isolation_uses_the_installed_torch(tmp_path):
    build_tools()
    (tmp_path / "sitecustomize.py").write_text(HIDE_SITE_PACKAGES)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONNOUSERSITE="1")
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "try:\n    import torch\nexcept ImportError:\n    print('hidden')\n"
        "from build_tools.build_torch import torch_available\n"
        "print(torch_available())\n"
        "import torch; print(torch.__version__, torch.__file__)\n"
    )
    r = run_python(code, tmp_path, env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "hidden"  # the build's own environment has no torch
    assert lines[-2] == "True"
    assert lines[-1] == f"{torch.__version__} {torch.__file__}"  # the one this environment has


# ---------------------------------------------------------------- cuda.h

def fake_include(root: Path, layout: str) -> str:
    folder = root / layout
    folder.mkdir(parents=True)
    (folder / "cuda.h").write_text("/* cuda.h */\n")
    return str(folder)


@pytest.mark.parametrize("layout", ["nvidia/cu13/include", "nvidia/cuda_runtime/include"])
def test_cuda_header_from_nvidias_pip_packages(tmp_path, layout):
    _, cuda_headers = build_tools()
    want = fake_include(tmp_path / "site-packages", layout)
    found = cuda_headers.find_cuda_include(env={}, site_dirs=[str(tmp_path / "site-packages")], nvcc="",
                                           toolkits=[])
    assert found == want


def test_cuda_header_search_order(tmp_path):
    _, cuda_headers = build_tools()
    site = tmp_path / "site-packages"
    pip_folder = fake_include(site, "nvidia/cu13/include")
    toolkit = fake_include(tmp_path, "cuda-13.0/include")
    nvcc = tmp_path / "cuda-13.0" / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("")
    explicit = fake_include(tmp_path, "explicit")
    find = cuda_headers.find_cuda_include
    assert find(env={"TORCH_IPC_CUDA_INCLUDE": explicit, "CUDA_HOME": str(tmp_path / "cuda-13.0")},
                site_dirs=[str(site)], nvcc=str(nvcc), toolkits=[]) == explicit
    assert find(env={"CUDA_HOME": str(tmp_path / "cuda-13.0")}, site_dirs=[str(site)], nvcc="",
                toolkits=[]) == toolkit
    assert find(env={}, site_dirs=[str(site)], nvcc=str(nvcc), toolkits=[]) == toolkit
    assert find(env={}, site_dirs=[str(site)], nvcc="", toolkits=[toolkit]) == pip_folder


def test_no_cuda_header_says_which_pip_command_provides_it(tmp_path):
    _, cuda_headers = build_tools()
    with pytest.raises(RuntimeError) as e:
        cuda_headers.find_cuda_include(env={"CUDA_HOME": str(tmp_path)}, site_dirs=[str(tmp_path)], nvcc="",
                                       toolkits=[])
    assert 'pip install "nvidia-cuda-runtime>=13"' in str(e.value)
    assert str(tmp_path / "include") in str(e.value)  # where it looked


# ---------------------------------------------------------------- the sdist

def test_sdist_carries_what_the_readme_points_to(tmp_path):
    build_tools()
    # From a copy: sdist builds its tree (torch_ipc-<version>/) and egg-info in
    # the folder it runs in, which another run on the same checkout shares.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "torch_ipc-*", ".ruff_cache", ".scratch"))
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=source,
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    (tarball,) = tmp_path.glob("torch_ipc-*.tar.gz")
    with tarfile.open(tarball) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for path in ["LICENSE", "README.md", "setup.py", "pyproject.toml", "build_tools/cuda_headers.py",
                 "build_tools/build_torch.py", "scripts/test", "scripts/gpu-check", "benchmarks/RESULTS.md",
                 "benchmarks/bench.py", "examples/demo.py", "tests/conftest.py", "tests/wire/golden/descriptors_v2.json",
                 "csrc/python/module.cpp", "csrc/README.md"]:
        assert path in names, path
    assert "torch_ipc/_build_info.py" not in names  # written by each build, for its own torch
