"""What the documentation says about the repository comes from the
repository.

- The module map: `CONTRIBUTING.md`'s tables of the modules (which
  `docs/architecture.md` shows on the site) are each module's docstring
  summary, one table per package (`render_module_map`).
- The tuning numbers: `docs/paths.md`'s table is `tuning.TABLE`
  (`render_tuning_table`), and the phrases of the docs that quote its
  values (`QUOTED`) carry the table's values.
- The repository's files that the docs and the library's sources name
  exist (`references`).

`KERAS_MHA_WRITE_DOCS=1 pytest tests/test_doc_sources.py` writes the
generated parts (the two tables, the quoted values); without it the tests
fail where the committed text differs from what the code gives. Nothing
here reads a backend: the outcome is the same on every one.
"""

import ast
import math
import os
import pathlib
import re

from keras_mha.attention import tuning

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_mha"
WRITE = bool(os.environ.get("KERAS_MHA_WRITE_DOCS"))
REGENERATE = "KERAS_MHA_WRITE_DOCS=1 pytest tests/test_doc_sources.py"


def _spliced(path, begin, end, generated):
    """Checks, or writes with `KERAS_MHA_WRITE_DOCS`, that the text of
    `path` between the lines `begin` and `end` is `generated`."""
    text = path.read_text(encoding="utf-8")
    start = text.index(begin) + len(begin)
    stop = text.index(end, start)
    wanted = "\n" + generated.strip("\n") + "\n"
    if WRITE:
        path.write_text(text[:start] + wanted + text[stop:], encoding="utf-8")
        return
    assert text[start:stop] == wanted, (
        f"{path.relative_to(ROOT)}'s generated part ({begin}) is out of "
        f"date: run {REGENERATE}"
    )


def _cell(text):
    """`text` as one cell of a Markdown table."""
    return text.replace("|", "\\|")


# ---------------------------------------------------------------- module map

CONTRIBUTING = ROOT / "CONTRIBUTING.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAP_BEGIN = "<!-- module map: begin (generated: tests/test_doc_sources.py) -->"
MAP_END = "<!-- module map: end -->"


def summary(path):
    """The summary of the module at `path`: its docstring's first
    paragraph on one line, or `None` without a docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstring = ast.get_docstring(tree)
    if not docstring:
        return None
    return " ".join(docstring.split("\n\n")[0].split())


def packages():
    """The folders of `keras_mha` that are packages, the package first."""
    return sorted(
        (init.parent for init in PACKAGE.rglob("__init__.py")),
        key=lambda folder: folder.relative_to(ROOT).parts,
    )


def modules(package):
    """`(name, path of its docstring)` of every module and subpackage of
    `package`, by name; a subpackage's name ends with `/`."""
    found = []
    for child in package.iterdir():
        if child.suffix == ".py" and child.name != "__init__.py":
            found.append((child.name, child))
        elif (child / "__init__.py").is_file():
            found.append((child.name + "/", child / "__init__.py"))
    return sorted(found)


def render_module_map():
    """One section per package of `keras_mha`: its summary, then a table of
    its modules and subpackages with theirs."""
    sections = []
    for package in packages():
        where = package.relative_to(ROOT).as_posix() + "/"
        rows = ["| module | holds |", "|---|---|"]
        for name, path in modules(package):
            rows.append(f"| `{where}{name}` | {_cell(summary(path) or '')} |")
        sections.append("\n".join([
            f"### `{where}`", "", summary(package / "__init__.py") or "", "",
            *rows,
        ]))
    return "\n\n".join(sections)


def test_every_module_says_what_it_holds():
    """The map is made of the modules' summaries: every module has one,
    a sentence."""
    missing = [
        path.relative_to(ROOT).as_posix()
        for package in packages()
        for path in [package / "__init__.py"] + [p for _, p in modules(package)]
        if not (summary(path) or "").endswith((".", ")"))
    ]
    assert not missing, (
        f"{missing}: open each with a docstring whose first paragraph says "
        "in one sentence what the module holds (the module map shows it)"
    )


def test_the_module_map_is_the_modules():
    _spliced(CONTRIBUTING, MAP_BEGIN, MAP_END, render_module_map())


def test_the_architecture_page_shows_the_module_map():
    """The site's architecture page includes `CONTRIBUTING.md`'s section
    with the generated map, rather than a copy of its own."""
    contributing = CONTRIBUTING.read_text(encoding="utf-8")
    section = contributing[
        contributing.index("<!-- --8<-- [start:modules] -->"):
        contributing.index("<!-- --8<-- [end:modules] -->")
    ]
    assert MAP_BEGIN in section and MAP_END in section
    page = ARCHITECTURE.read_text(encoding="utf-8")
    assert '--8<-- "CONTRIBUTING.md:modules"' in page
    assert "| module |" not in page


# ------------------------------------------------------------ tuning numbers

PATHS = ROOT / "docs" / "paths.md"
TUNING_BEGIN = (
    "<!-- tuning table: begin (generated: tests/test_doc_sources.py) -->"
)
TUNING_END = "<!-- tuning table: end -->"
BACKENDS = ("jax", "tensorflow", "torch", "numpy")

# Phrases of the docs that quote the tuning table: `{name}` is setting
# `name`'s value on a CPU (the same for every backend), `{name@backend}`
# its value for `backend`; `{name:GiB}` in GiB. The docs' text must read
# the same, whitespace aside, with the table's values.
QUOTED = {
    "README.md": [
        "on JAX (from `T = {blocked_min_length@jax}`) and TensorFlow "
        "(from `T = {blocked_min_length@tensorflow}`)",
    ],
    "docs/keras-differences.md": [
        "(JAX from `T = {blocked_min_length@jax}`, TensorFlow from "
        "`T = {blocked_min_length@tensorflow}`)",
    ],
    "docs/paths.md": [
        "`S >= {banded_min_ratio}·w` and `S >= {banded_min_length}`",
        "from `T = {blocked_min_length@jax}` on JAX and "
        "`T = {blocked_min_length@tensorflow}` on TensorFlow",
        "(a soft-cap), from `T = {blocked_min_length@torch}`",
        "an `attention_bias`), from `T = {triangular_min_length@jax}`",
        "float32 scores would pass {dense_scores_budget:GiB} GiB",
        "blocks of {blocked_block} queries ({blocked_large_block} from "
        "`T = {blocked_large_from}`)",
        "within {banded_block_min}..{banded_block_max}",
    ],
}
_FIELD = re.compile(r"\{(\w+)(?:@(\w+))?(?::(\w+))?\}")
_NUMBER = r"([0-9]+(?:[.,][0-9]+)*)"


def quoted_value(name, backend=None, unit=None):
    """Setting `name`'s value on a CPU as the docs write it."""
    if backend is None:
        values = {tuning.entry(name, b, tuning.CPU).value for b in BACKENDS}
        assert len(values) == 1, (
            f"{name} differs by backend: quote it as {{{name}@backend}}"
        )
        (value,) = values
    else:
        value = tuning.entry(name, backend, tuning.CPU).value
    if unit == "GiB":
        value = value / (1 << 30)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _phrase_pattern(phrase):
    """A regex of `phrase` whose fields match any number and whose spaces
    match any whitespace (a phrase may wrap)."""
    parts, fields, last = [], [], 0
    for field in _FIELD.finditer(phrase):
        parts.append(re.escape(phrase[last:field.start()]))
        parts.append(_NUMBER)
        fields.append(field.groups())
        last = field.end()
    parts.append(re.escape(phrase[last:]))
    pattern = re.sub(r"(\\ )+", r"\\s+", "".join(parts))
    return re.compile(pattern), fields


def test_quoted_numbers_are_the_tuning_table():
    """Each phrase of `QUOTED` is on its page, once, with the table's
    values (written there with `KERAS_MHA_WRITE_DOCS`)."""
    stale = []
    for page, phrases in QUOTED.items():
        path = ROOT / page
        text = original = path.read_text(encoding="utf-8")
        for phrase in phrases:
            pattern, fields = _phrase_pattern(phrase)
            found = list(pattern.finditer(text))
            assert len(found) == 1, (
                f"{page} should say, once, {phrase!r} (with the tuning "
                "table's values): reword the page or its entry of QUOTED "
                f"in tests/test_doc_sources.py. Found: {len(found)}"
            )
            match = found[0]
            wanted = [quoted_value(*field) for field in fields]
            if list(match.groups()) != wanted:
                stale.append(f"{page}: {match.group(0)!r}")
            for i in reversed(range(len(fields))):
                text = (text[:match.start(i + 1)] + wanted[i]
                        + text[match.end(i + 1):])
        if WRITE and text != original:
            path.write_text(text, encoding="utf-8")
    assert WRITE or not stale, (
        f"{stale}: these numbers differ from keras_mha.attention.tuning."
        f"TABLE: run {REGENERATE}"
    )


def test_the_library_names_settings_without_their_values():
    """The library's docstrings and comments name a setting of the table,
    never its value beside it (`` `blocked_min_length` (512) ``): the
    values live in `tuning.TABLE` alone."""
    names = "|".join(sorted(tuning.TABLE, key=len, reverse=True))
    copied = re.compile(
        rf"`[^`\n]*\b(?:{names})\b[^`\n]*`\s*\((?:[A-Za-z]+\s+|`\[?)?\d"
    )
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: "
        f"{m.group(0)}"
        for path in sorted(PACKAGE.rglob("*.py")) if path.name != "tuning.py"
        for text in [path.read_text(encoding="utf-8")]
        for m in copied.finditer(text)
    ]
    assert not found, found


def _shown(name, value):
    """A setting's value in the docs' table."""
    if isinstance(value, (bool, type(None))) or value == math.inf:
        return f"`{value}`"
    if name.endswith(("_bytes", "_budget")):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
            if value % size == 0:
                return f"{value // size} {unit}"
    return f"`{value}`"


def render_tuning_table():
    """`tuning.TABLE` as a Markdown table, in its order."""
    rows = ["| setting | backend | platform | value | why | measured by |",
            "|---|---|---|---|---|---|"]
    for name, backend, platform, value, reason, benchmark in tuning.rows():
        where = ["any" if key == tuning.ANY else key
                 for key in (backend, platform)]
        command = "none" if benchmark == "none" else f"`{benchmark}`"
        rows.append(
            f"| `{name}` | {where[0]} | {where[1]} | {_shown(name, value)} "
            f"| {_cell(reason)} | {command} |"
        )
    return "\n".join(rows)


def test_the_tuning_table_page_is_the_table():
    _spliced(PATHS, TUNING_BEGIN, TUNING_END, render_tuning_table())


# ---------------------------------------------------------------- references

# The top-level folders of the repository that references start from.
OURS = ("keras_mha", "tests", "docs", "benchmarks", "configs", ".ci")
_ROOTED = re.compile(
    r"(?<![\w./-])((?:keras_mha|tests|docs|benchmarks|configs|\.ci)/[\w./-]*)"
)
_BARE = re.compile(r"[\w-]+\.(?:py|md)")
_PLAIN_BARE = re.compile(r"(?<![\w./`-])([\w-]+\.(?:py|md))(?![\w/`-])")
_SPAN = re.compile(r"`+([^`\n]+?)`+")
_FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)


def _sources():
    """The files whose references are checked: the pages and the library."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
            *sorted((ROOT / "docs").rglob("*.md")),
            *sorted(PACKAGE.rglob("*.py"))]


def _file_names():
    """The base names of the repository's files."""
    names = {path.name for path in ROOT.iterdir() if path.is_file()}
    for folder in OURS:
        for base, dirs, files in os.walk(ROOT / folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            names.update(files)
    return names


def references(text):
    """`(offset, reference, kind)` of every reference to a repository file
    in `text`: `"path"`, relative to the repository's root, or `"name"`, a
    bare file name."""
    found = [(m.start(1), m.group(1).rstrip("."), "path")
             for m in _ROOTED.finditer(text)]
    prose = _FENCE.sub(lambda m: " " * len(m.group(0)), text)
    for span in _SPAN.finditer(prose):
        if _BARE.fullmatch(span.group(1)):
            found.append((span.start(1), span.group(1), "name"))
    plain = _SPAN.sub(lambda m: " " * len(m.group(0)), prose)
    found += [(m.start(1), m.group(1), "name")
              for m in _PLAIN_BARE.finditer(plain)]
    return sorted(found)


def test_references_find_what_they_should():
    text = (
        "`checks.py`, see DESIGN.md and [a page](paths.md#rule); "
        "keras_mha/layer.py, `tests/test_docs.py::test_x`, `docs/`.\n"
        "`python my_script.py`, `keras/src/x_test.py`, "
        "`transformers.modeling_llama`, `DIR/report.md`, "
        "../shared/hooks/structure.py, api/hub.md\n"
        "```bash\nrun script.py tests/test_x.py\n```\n"
    )
    assert [ref for _, ref, _ in references(text)] == [
        "checks.py", "DESIGN.md", "paths.md", "keras_mha/layer.py",
        "tests/test_docs.py", "docs/", "tests/test_x.py",
    ]


def test_named_repository_files_exist():
    """Every file of this repository that the pages (`README.md`,
    `CONTRIBUTING.md`, `docs/`) and the library's sources (docstrings,
    comments, strings) name exists.

    A reference is one of:

    - a path from the repository's root: it starts with one of its folders
      (`keras_mha/`, `tests/`, `docs/`, `benchmarks/`, `configs/`, `.ci/`),
      anywhere, code blocks included (`tests/test_x.py::name` names the
      file `tests/test_x.py`); it must exist, as a file or a folder;
    - a bare file name ending in `.py` or `.md`, written alone in a code
      span (`` `checks.py` ``) or as a word of prose or a link
      (`DESIGN.md`, `[page](paths.md)`): some file of the repository must
      have that name. A name inside a longer code span
      (`` `python script.py` ``) or a code block is a command, not a
      reference.

    So the files of other projects and the files a command writes are
    named with a path that is not ours (`keras/src/...`, `DIR/report.md`)
    or as a dotted module (`transformers.modeling_rope_utils`). Paths
    relative to a page (`api/hub.md`) are links, which the site's strict
    build checks.
    """
    names = _file_names()
    missing = []
    for source in _sources():
        text = source.read_text(encoding="utf-8")
        for offset, ref, kind in references(text):
            exists = ((ROOT / ref).exists() if kind == "path"
                      else ref in names)
            if not exists:
                line = text.count("\n", 0, offset) + 1
                missing.append(f"{source.relative_to(ROOT)}:{line}: {ref}")
    assert not missing, missing
