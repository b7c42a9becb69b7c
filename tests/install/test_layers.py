"""The layers of csrc/ (Note [layers] in csrc/README.md): no file includes a
header of a lower layer, no feature includes another, pybind11 only in
csrc/python/, and no two files include each other in a circle."""
import pathlib
import re

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
ORDER = ["base", "wire", "os", "cuda", "memory", "core", "features", "python"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)

pytestmark = pytest.mark.skipif(not CSRC.is_dir(), reason="needs the source tree (csrc/)")


def _files():
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cpp", ".cu"))


def _layer(rel: str) -> str:
    return rel.split("/", 1)[0]


def _feature(rel: str):
    parts = rel.split("/")
    return parts[1] if parts[0] == "features" else None


def _includes(path: pathlib.Path):
    return INCLUDE.findall(path.read_text())


def test_every_source_file_is_in_a_layer_folder():
    stray = [str(p.relative_to(CSRC)) for p in _files() if _layer(str(p.relative_to(CSRC))) not in ORDER]
    assert stray == []


def test_includes_name_existing_files_from_the_csrc_root():
    missing = [(str(p.relative_to(CSRC)), inc) for p in _files() for inc in _includes(p) if not (CSRC / inc).is_file()]
    assert missing == []


def _violations(root: pathlib.Path):
    bad = []
    for p in sorted(q for q in root.rglob("*") if q.suffix in (".h", ".cpp", ".cu")):
        rel = str(p.relative_to(root))
        for inc in _includes(p):
            if ORDER.index(_layer(inc)) > ORDER.index(_layer(rel)):
                bad.append(f"{rel} includes {inc} (a lower layer)")
            elif _feature(rel) and _feature(inc) and _feature(rel) != _feature(inc):
                bad.append(f"{rel} includes {inc} (another feature)")
    return bad


def test_no_file_includes_a_lower_layer_or_another_feature():
    assert _violations(CSRC) == []


def test_only_the_python_layer_includes_pybind11():
    bad = [str(p.relative_to(CSRC)) for p in _files()
           if _layer(str(p.relative_to(CSRC))) != "python" and re.search(r"#\s*include\s*[<\"](pybind11|torch/extension\.h)", p.read_text())]
    assert bad == []


def test_no_include_cycle():
    # A file's header and its .cpp are one node: a cycle between two .cpp files'
    # interfaces is a cycle, whichever of the pair includes.
    def node(rel):
        return rel.rsplit(".", 1)[0]
    graph = {}
    for p in _files():
        rel = str(p.relative_to(CSRC))
        graph.setdefault(node(rel), set()).update(node(i) for i in _includes(p) if node(i) != node(rel))
    state, cycle = {}, []

    def visit(n, path):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycle.append(path[path.index(m):] + [m] if m in path else [n, m])
                return True
            if state.get(m) is None and visit(m, path + [m]):
                return True
        state[n] = 2
        return False

    for n in sorted(graph):
        if state.get(n) is None and visit(n, [n]):
            break
    assert cycle == []


def test_the_layering_check_sees_violations(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "x.h").write_text('#include "core/export.h"\n#include "base/y.h"\n')
    (tmp_path / "features" / "kv").mkdir(parents=True)
    (tmp_path / "features" / "kv" / "a.cpp").write_text('#include "features/weights/b.h"\n#include "core/x.h"\n')
    assert _violations(tmp_path) == ["base/x.h includes core/export.h (a lower layer)",
                                     "features/kv/a.cpp includes features/weights/b.h (another feature)"]
