"""The README's Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _params():
    for i, code in enumerate(BLOCKS):
        marks = [pytest.mark.training] if ".fit(" in code else []
        yield pytest.param(code, id=f"block{i}", marks=marks)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", list(_params()))
def test_example_runs(code, capsys):
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
