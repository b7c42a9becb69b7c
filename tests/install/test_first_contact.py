"""What a new user meets first: the README's API table matches every public
signature, ``python -m torch_ipc --help`` helps, ``doctor`` names the
extension it loaded and the torch it was built against, and ``loads(b"")``
says the bytes were empty."""
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torch_ipc

REPO = Path(__file__).resolve().parents[2]
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torch_ipc.__file__)))
TIMEOUT = 300


def _api_rows():
    readme = REPO / "README.md"
    if not readme.is_file():
        pytest.skip("needs the source tree's README.md")
    text = readme.read_text()
    section = text[text.index("\n## API\n"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^\| `([^`]+)`", section, flags=re.M)


def _resolve(dotted: str):
    # A submodule the package does not import itself (kv.remote) is imported here.
    obj, path = torch_ipc, "torch_ipc"
    for part in dotted.split("."):
        path += "." + part
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(path)
    return obj


def _default(p: inspect.Parameter) -> str:
    # File modes are written in octal, as chmod takes them.
    if p.name == "mode" and type(p.default) is int:
        return oct(p.default)
    return repr(p.default).replace("'", '"')


def _params(sig: inspect.Signature):
    """The parameters as the README writes them: name or name=default, with * and /."""
    out, star = [], False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + (p.name if p.default is p.empty else f"{p.name}={_default(p)}"))
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            out.append("/")
    return out


def test_every_public_signature_matches_its_readme_row():
    rows = {}
    for cell in _api_rows():
        m = re.fullmatch(r"([\w.]+)\(([^()]*)\)(?: -> .*)?", cell)
        if m:
            rows[m.group(1)] = [p.strip() for p in m.group(2).split(",")] if m.group(2) else []
    assert rows, "no rows with a signature in the README's API table"
    checked = 0
    for name, written in rows.items():
        actual = _params(inspect.signature(_resolve(name)))
        if written and written[-1] == "...":
            written = written[:-1]
            actual = actual[:len(written)]
        assert written == actual, f"README row {name}({', '.join(written)}) but the code says ({', '.join(actual)})"
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("module", ["torch_ipc", "torch_ipc.weights", "torch_ipc.kv"])
def test_every_public_name_has_a_readme_row(module):
    prefix = module[len("torch_ipc."):] + "." if "." in module else ""
    named = {re.match(r"[\w.]+", cell).group(0) for cell in _api_rows()}
    missing = [n for n in sys.modules[module].__all__ if prefix + n not in named]
    assert not missing, f"public names of {module} without a row in the README's API table: {missing}"


def _python_m(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "torch_ipc", *args], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def _is_the_help(text: str) -> bool:
    return text.startswith("usage: python -m torch_ipc doctor [--json]") and "--json" in text and "/dev/shm" in text


def test_help_prints_real_help_and_exits_0(capsys):
    r = _python_m("--help")  # the command line itself once; its other spellings in this process
    assert r.returncode == 0 and _is_the_help(r.stdout), r.stderr
    from torch_ipc.__main__ import _main

    for args in (["-h"], ["doctor", "--help"]):
        assert _main(args) == 0
        assert _is_the_help(capsys.readouterr().out), args
    assert _main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err and "--help" in err


@pytest.mark.parametrize("data", [b"", bytearray(), memoryview(b"")])
def test_loads_of_empty_bytes_says_empty(data):
    with pytest.raises(torch_ipc.DescriptorError, match="empty bytes"):
        torch_ipc.loads(data)
