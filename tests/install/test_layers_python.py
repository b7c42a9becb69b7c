"""The layers of torch_ipc/ (Note [python layers]): no module imports one of a
higher layer, at module level or inside a function; kv and weights never
import each other; and no two modules import each other in a circle.

Note [python layers]
The Python package is layered as csrc/ is (Note [layers] in csrc/README.md),
lowest first:
  base      _C (the extension), errors, _build_info, _torch_check, _cuda
            (device arguments), _process (is that process alive),
            _batched_copy (the batched copy kernels, for kv and weights),
            _closing (the with/close/__del__ base)
  runtime   _runtime: the collector thread, the exit hook, fork handling
  memory    pool (SharedPool), ipc_event: kinds of memory and events
  core      _weights_only: what a weights_only load allows (the checks);
            _serialize: dumps/loads, the one crossing into _C's export/load;
            _export: export() -> Export, revocable
  mp        mp/: the multiprocessing adapters (reductions, channels, connection);
            _dist: the one module that calls torch.distributed (other nodes)
  features  kv/, weights/: one feature each, never importing another
  tools     testing/, doctor: built on the package, used by nobody in it
  package   __init__, __main__: the names users import
A module may import its own layer and the layers before it.
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "torch_ipc"

LAYERS = [
    ("base", ["_C", "errors", "_build_info", "_torch_check", "_cuda", "_process", "_batched_copy", "_closing"]),
    ("runtime", ["_runtime"]),
    ("memory", ["pool", "ipc_event"]),
    ("core", ["_weights_only", "_serialize", "_export"]),
    ("mp", ["mp", "_dist"]),
    ("features", ["kv", "weights"]),
    ("tools", ["testing", "doctor"]),
    ("package", ["", "__main__"]),
]
FEATURES = {"kv", "weights"}

pytestmark = pytest.mark.skipif(not PACKAGE.is_dir(), reason="needs the source tree (torch_ipc/)")


def _modules(root: pathlib.Path):
    """{dotted name below the package ('' for its __init__): path}."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _top(name: str) -> str:
    """The entry of LAYERS a module belongs to: its first name part."""
    return name.split(".", 1)[0]


def _layer(name: str) -> int:
    top = _top(name)
    for index, (_, tops) in enumerate(LAYERS):
        if top in tops:
            return index
    raise AssertionError(f"torch_ipc.{name} is in no layer: add it to LAYERS and Note [python layers]")


def _imports(name: str, path: pathlib.Path, modules, package: str):
    """The package's modules that `name` imports, anywhere in its file:
    `from . import x` imports the module x (not the package), `from . import
    attr` and `import torch_ipc` the package's __init__."""
    here = name.split(".") if name else []
    if path.name != "__init__.py":
        here = here[:-1]

    def inner(dotted: str):
        if dotted == package:
            return ""
        if dotted.startswith(package + "."):
            return dotted[len(package) + 1:]
        return None  # outside the package

    def is_module(n):
        # _C (the extension) and _build_info (written by each build) are
        # modules that a clean checkout lacks.
        return n in modules or n in ("_C", "_build_info")

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [inner(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = inner(node.module or "")
                if module is None:
                    continue
            targets = []
            for alias in node.names:
                sub = f"{module}.{alias.name}" if module else alias.name
                targets.append(sub if is_module(sub) else module)
        else:
            continue
        for target in targets:
            while target is not None and target and not is_module(target):
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target is not None and target != name:
                found.add(target)
    return found


def _graph(root: pathlib.Path, package: str = "torch_ipc"):
    modules = _modules(root)
    return {name: _imports(name, path, modules, package) for name, path in modules.items()}


def _shown(package: str, name: str) -> str:
    return f"{package}.{name}" if name else package


def _violations(root: pathlib.Path, package: str = "torch_ipc"):
    bad = []
    for name, imported in sorted(_graph(root, package).items()):
        for other in sorted(imported):
            what = f"{_shown(package, name)} imports {_shown(package, other)}"
            if _layer(other) > _layer(name):
                bad.append(f"{what} (a higher layer)")
            elif _top(name) in FEATURES and _top(other) in FEATURES and _top(name) != _top(other):
                bad.append(f"{what} (another feature)")
    return bad


def _cycle(graph):
    """One import cycle of the graph, as a list of modules; [] when none."""
    state = {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if state.get(m) is None:
                found = visit(m, path + [m])
                if found:
                    return found
        state[n] = 2
        return []

    for n in sorted(graph):
        if state.get(n) is None:
            found = visit(n, [n])
            if found:
                return found
    return []


def test_every_module_is_in_a_layer():
    for name in _modules(PACKAGE):
        _layer(name)


def test_no_module_imports_a_higher_layer_or_another_feature():
    assert _violations(PACKAGE) == []


def test_no_import_cycle():
    # The package's __init__ imports everything to export it; its submodules
    # reach it only by importing a sibling (`from . import _C`), which is no
    # edge into __init__ itself.
    assert _cycle(_graph(PACKAGE)) == []


def test_the_layering_check_sees_violations(tmp_path):
    root = tmp_path / "torch_ipc"
    (root / "kv").mkdir(parents=True)
    (root / "weights").mkdir()
    (root / "__init__.py").write_text("from . import errors, kv, weights\n")
    (root / "errors.py").write_text("import os\n\ndef f():\n    from .kv import pool  # hidden in a function\n")
    (root / "kv" / "__init__.py").write_text("from .. import _serialize\nfrom ..weights import _plan\n")
    (root / "weights" / "__init__.py").write_text("")
    (root / "weights" / "_plan.py").write_text("import torch_ipc\nfrom . import _plan\n")
    (root / "_serialize.py").write_text("from .pool import x\n")
    (root / "pool.py").write_text("def g():\n    from torch_ipc._serialize import dumps\n")
    assert _violations(root) == [
        "torch_ipc.errors imports torch_ipc.kv (a higher layer)",
        "torch_ipc.kv imports torch_ipc.weights._plan (another feature)",
        "torch_ipc.pool imports torch_ipc._serialize (a higher layer)",
        "torch_ipc.weights._plan imports torch_ipc (a higher layer)",
    ]
    assert _cycle(_graph(root)) == ["_serialize", "pool", "_serialize"]
