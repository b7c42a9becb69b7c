"""The README's two-terminal example is the code in examples/, and it runs."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120
ADDRESS = "/tmp/torch_ipc_demo.sock"


def readme_python_blocks():
    readme = REPO / "README.md"
    if not readme.is_file():
        pytest.skip("needs the source tree's README.md")
    return re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)


@pytest.mark.parametrize("name", ["producer.py", "consumer.py"])
def test_readme_shows_the_example_file(name):
    code = (REPO / "examples" / name).read_text()
    assert code in readme_python_blocks()


def test_readme_example_runs(tmp_path):
    # The scripts as the README shows them, at a socket path of this test's own.
    address = str(tmp_path / "demo.sock")
    scripts = {}
    for name in ("producer.py", "consumer.py"):
        code = (REPO / "examples" / name).read_text()
        assert ADDRESS in code
        scripts[name] = tmp_path / name
        scripts[name].write_text(code.replace(ADDRESS, address))
    producer = subprocess.Popen([sys.executable, str(scripts["producer.py"])], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(address):
            assert producer.poll() is None, producer.communicate()
            assert time.monotonic() < deadline, "the producer never listened"
            time.sleep(0.05)
        consumer = subprocess.run([sys.executable, str(scripts["consumer.py"])], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=TIMEOUT)
        assert consumer.returncode == 0, consumer.stderr
        assert consumer.stdout == "consumer: done\n"
        out, err = producer.communicate(timeout=TIMEOUT)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    assert producer.returncode == 0, err
    assert out.splitlines()[-1] == "producer sees: [1.0, 1.0, 1.0, 1.0]"
    assert err == ""  # no warning either


def test_readme_api_table_lists_every_public_name():
    import torch_ipc
    import torch_ipc.weights

    readme = REPO / "README.md"
    if not readme.is_file():
        pytest.skip("needs the source tree's README.md")
    text = readme.read_text()
    table = text[text.index("## API"):]
    table = table[:table.index("\n## ")]
    listed = set(re.findall(r"^\| `([\w.]+)", table, flags=re.M))
    public = set(torch_ipc.__all__) | {f"weights.{name}" for name in torch_ipc.weights.__all__} \
        | {f"kv.{name}" for name in torch_ipc.kv.__all__}
    assert public <= listed, sorted(public - listed)


def test_readme_links_every_docs_page_and_every_link_resolves():
    # The README is what a user reads first; the rest lives in docs/, and a
    # page nobody links to is a page nobody finds.
    readme = REPO / "README.md"
    docs = REPO / "docs"
    if not readme.is_file() or not docs.is_dir():
        pytest.skip("needs the source tree's README.md and docs/")
    pages = {p.name for p in docs.glob("*.md")}
    texts = {"README.md": readme.read_text()} | {f"docs/{p}": (docs / p).read_text() for p in pages}
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", texts["README.md"]))
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
    for name, text in texts.items():
        base = (REPO / name).parent
        for target in re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text):
            assert (base / target).exists(), f"{name} links to {target}, which does not exist"
