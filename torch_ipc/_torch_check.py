"""Refuse to load the extension under a torch other than the one it was built
against (Note [build against the installed torch] in build_tools/build_torch.py).

Note [which torch versions match]
The release part must be equal (2.13.0 == 2.13.0): torch's C++ ABI changes
between releases, and an extension built against another one fails with an
undefined symbol, or worse, loads and misbehaves. The local label (+cpu,
+cu130) is ignored: CPU and CUDA builds of one release share headers and
symbols, and this extension links no CUDA library, so one build serves both.
"""

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


def extension_import_error(error: ImportError) -> ImportError:
    """What to say when torch_ipc._C itself fails to import."""
    if "cannot import name '_C'" in str(error):
        what = ("torch_ipc's extension torch_ipc._C is not built here; install the package "
                "(`pip install --no-build-isolation .`) or build it in place "
                "(`python setup.py build_ext --inplace`)")
    else:
        what = f"torch_ipc's extension failed to load ({error}); {REBUILD}"
    return ImportError(what)
