"""The documentation runs: every Python example, and the site's build.

Every ```python block of `README.md` and of each page under `docs/` runs
as written, in a fresh namespace, on every backend, with every warning an
error: an example that warns teaches users to ignore warnings. A block that
trains (it calls `.fit(` or `train_on_batch(`) is marked `training`, so the
NumPy backend, which runs inference only, skips it.
"""

import ast
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import BACKEND

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_TRAINS = re.compile(r"\.fit\(|train_on_batch\(")
_TEST_NAME = re.compile(r"tests/(test_\w+\.py)((?:::\w+)*)")


def _blocks():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2  # the code's first
            name = f"{page.relative_to(ROOT).as_posix()}:{line}"
            code = match.group(1)
            marks = [pytest.mark.training] if _TRAINS.search(code) else []
            yield pytest.param(page, line, code, id=name, marks=marks)


BLOCKS = list(_blocks())


def test_every_page_with_examples_is_found():
    pages = {block.values[0].name for block in BLOCKS}
    assert {"README.md", "decoding.md", "models.md"} <= pages, pages


def _defines(path, names):
    """Whether `names` (a class, then a method; or a function) are defined
    in the test file `path`."""
    scope = ast.parse(path.read_text(encoding="utf-8")).body
    for name in names:
        found = [
            node for node in scope
            if isinstance(node, (ast.ClassDef, ast.FunctionDef))
            and node.name == name
        ]
        if not found:
            return False
        scope = found[0].body
    return True


def test_named_tests_exist():
    """Every test the docs name (`tests/test_x.py::Class::test_y`) exists:
    the differences page names the test that pins each difference."""
    named = set()
    for page in [*PAGES, ROOT / "CONTRIBUTING.md"]:
        named.update(_TEST_NAME.findall(page.read_text(encoding="utf-8")))
    assert len(named) > 10
    missing = [
        f"tests/{file}{names}" for file, names in sorted(named)
        if not (ROOT / "tests" / file).exists()
        or not _defines(ROOT / "tests" / file, names.split("::")[1:])
    ]
    assert not missing, missing


# Keras's torch backend converts tensors with `np.array(x)`, which NumPy 2
# warns about (the same filter as `pyproject.toml`'s); Keras's warning, not
# the example's.
@pytest.mark.filterwarnings(
    "error",
    "ignore:__array__ implementation doesn't accept a copy keyword"
    ":DeprecationWarning",
)
@pytest.mark.parametrize("page, line, code", BLOCKS)
def test_example_runs(page, line, code, capsys):
    # Blank lines up to the block keep tracebacks on the page's line numbers.
    source = "\n" * (line - 1) + code
    exec(compile(source, str(page), "exec"), {"__name__": "__docs__"})


# The build reads the sources without importing them (griffe's static
# analysis) and runs no backend, so one backend's run covers it; NumPy's
# suite is the shortest.
@pytest.mark.skipif(
    BACKEND != "numpy", reason="the site's build does not depend on the "
    "backend; it runs once, with the NumPy backend's suite"
)
def test_site_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
