"""The package's structure: the library stands apart from the command line,
and both from the development benchmarks.

The library is every module of `keras_mha` outside `keras_mha/cli/` and
`keras_mha/__main__.py`; the development benchmarks are the top-level
`benchmarks/`, outside the package (they import it, never the reverse).
Imports are read from the sources with `ast`, an import inside a function
counting as much as one at the top, the way `../shared/hooks/structure.py`
reads them; nothing here compiles.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

from conftest import BACKEND

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_mha"
MAX_LINES = 600


def _modules():
    """Module name -> source file, for every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def is_cli(name):
    return name in ("keras_mha.cli", "keras_mha.__main__") or name.startswith(
        "keras_mha.cli."
    )


LIBRARY = sorted(name for name in MODULES if not is_cli(name))


def is_benchmarks(name):
    return name == "benchmarks" or name.startswith("benchmarks.")


def imported_names(name):
    """Every module name that module `name` imports, anywhere in its source
    (`imported_names_of`)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imported_names_of(path.read_text(encoding="utf-8"), package)


def imported_names_of(source, package):
    """Every module name that `source`, a module of `package`, imports.

    `from X import a` imports `X` (whose `__init__` runs first), and `X.a`
    too where that is a module of the package; relative imports are
    resolved.
    """
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(base)
                if submodule in MODULES:
                    found.add(submodule)
    return found


def import_graph():
    """Module -> the package's modules it imports.

    Imports of the top package `keras_mha`, whose `__init__` only re-exports
    its submodules, are left out, as the hook leaves them out.
    """
    return {
        name: {
            other
            for other in imported_names(name)
            if other in MODULES and other not in (name, "keras_mha")
        }
        for name in MODULES
    }


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# ------------------------------------------------------------------ the reader


def test_the_reader_sees_every_kind_of_import():
    parser = imported_names("keras_mha.cli")
    assert "keras_mha.cli.common" in parser  # at the top
    assert "keras_mha.cli.demo" in parser  # inside a function
    assert "keras_mha.cli.common" in imported_names("keras_mha.cli.demo")
    assert "keras_mha.cli" in imported_names("keras_mha.__main__")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # What the benchmarks rule looks for, wherever it is imported from.
    assert is_benchmarks("benchmarks") and is_benchmarks("benchmarks.plan")
    assert not is_benchmarks("benchmarks_of_someone")
    for source in ("def f():\n    from benchmarks import plan\n",
                   "import benchmarks.plan\n"):
        assert any(is_benchmarks(name)
                   for name in imported_names_of(source, "keras_mha.cli"))


# ------------------------------------------------------------------ the rules


def test_the_library_never_imports_the_command_line():
    found = sorted(
        f"{name} imports {other}"
        for name in LIBRARY
        for other in imported_names(name)
        if is_cli(other)
    )
    assert found == []


def test_neither_the_library_nor_the_command_line_imports_the_benchmarks():
    found = sorted(
        f"{name} imports {other}"
        for name in MODULES
        for other in imported_names(name)
        if is_benchmarks(other)
    )
    assert found == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_library_module_is_over_the_limit():
    lengths = {
        name: len(MODULES[name].read_text(encoding="utf-8").splitlines())
        for name in LIBRARY
    }
    assert {n: k for n, k in lengths.items() if k > MAX_LINES} == {}


# ------------------------------------------------------- the backends' names

BACKEND_NAMES = ("jax", "numpy", "tensorflow", "torch")

# Calls whose string argument names a package to look up, not a backend:
# `sys.modules.get("torch")` finds torch loaded on any backend.
_PACKAGE_LOOKUPS = ("sys.modules.get", "importlib.import_module",
                    "importlib.util.find_spec", "__import__")


def may_name_backends(name):
    """Whether module `name` may name a backend: `capabilities.py`, which
    answers for every backend, the backends' kernels (`kernels.py`,
    `*_kernels.py`) and the command line."""
    return (
        name == "keras_mha.attention.capabilities"
        or name.rpartition(".")[2].endswith("kernels")
        or is_cli(name)
    )


def backend_names_in(source):
    """The lines of `source` with a string constant equal to a backend's
    name, outside the argument of a package lookup (`_PACKAGE_LOOKUPS`)."""
    tree = ast.parse(source)
    lookups = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args
                and ast.unparse(node.func) in _PACKAGE_LOOKUPS):
            lookups.add(id(node.args[0]))
    return sorted({
        node.lineno for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in BACKEND_NAMES
        and id(node) not in lookups
    })


def test_the_reader_finds_backend_names():
    for source in ('keras.backend.backend() == "jax"\n',
                   'backend in ("tensorflow", "numpy")\n',
                   'TABLE = {("torch", ANY): 1}\n',
                   "f(backend='numpy')\n"):
        assert backend_names_in(source) == [1], source
    for source in ('torch = sys.modules.get("torch")\n',
                   'importlib.import_module("jax")\n',
                   'import torch\n"""Runs on torch and jax."""\n',
                   'message = "the torch backend"\n'):
        assert backend_names_in(source) == [], source
    assert may_name_backends("keras_mha.attention.capabilities")
    assert may_name_backends("keras_mha.attention.cache_kernels")
    assert may_name_backends("keras_mha.attention.kernels")
    assert may_name_backends("keras_mha.cli.common")
    assert not may_name_backends("keras_mha.attention.dispatch")


def test_only_capabilities_kernels_and_the_command_line_name_backends():
    # An algorithm asks `keras_mha/attention/capabilities.py` for what it
    # needs; comparing the backend's name elsewhere scatters the choice.
    found = {
        name: lines
        for name in LIBRARY
        if not may_name_backends(name)
        and (lines := backend_names_in(
            MODULES[name].read_text(encoding="utf-8")))
    }
    assert found == {}


# ------------------------------------------------- other objects' privates

# The library's reads of `x._name` where `x` is not `self` or `cls`, by
# module and expression, each with its reason: the internals of Keras and
# keras-hub (each behind one named function) and torch's private ops, none
# with a public equivalent. Our layers' own state is read through
# `layer.settings` (`keras_mha/settings.py`), `layer.sublayer(name)` and
# public properties.
ALLOWED_PRIVATE_READS = {
    ("keras_mha/projections.py", "layer._flatten_layers"):
        "Keras: a layer's nested sublayers, as `Model.quantize` lists them",
    ("keras_mha/projections.py", "layer._dtype_policy"):
        "Keras: the setter would file a policy map inside the layer's own",
    ("keras_mha/projections.py", "layer._track_variables"):
        "Keras: torch's parameters follow quantized variables again",
    ("keras_mha/hub.py", "block._tracker"):
        "Keras: a built block's tracker must forget the replaced layer",
    ("keras_mha/hub.py", "block._layers"):
        "Keras: a built block's sublayers must lose the replaced layer",
    ("keras_mha/hub_readers.py", "attention._inv_norm_factor"):
        "keras-hub: Llama's attention keeps its scale under no public name",
    ("keras_mha/attention/decode_kernels.py",
     "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"):
        "torch: the CPU flash kernel, with its log-sum-exp",
    ("keras_mha/attention/kernels.py",
     "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"):
        "torch: the CPU flash kernel, with its log-sum-exp",
    ("keras_mha/attention/kernels.py",
     "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward"):
        "torch: the CPU flash kernel's backward",
}


def private_reads(source):
    """The expressions `x._name` (not dunders) of `source` whose `x` is not
    the name `self` or `cls`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name)
                         and node.value.id in ("self", "cls"))):
            found.add(ast.unparse(node))
    return found


def _library_private_reads():
    return {
        (MODULES[name].relative_to(ROOT).as_posix(), expression)
        for name in MODULES
        for expression in private_reads(
            MODULES[name].read_text(encoding="utf-8"))
    }


def test_the_reader_finds_private_reads():
    assert private_reads("layer._num_heads\n") == {"layer._num_heads"}
    assert private_reads("f(x)._y.z\n") == {"f(x)._y"}
    assert private_reads("self._a + cls._b + x.__class__ + x.y\n") == set()


def test_no_module_reads_another_objects_private_attributes():
    # A module reads a layer's configuration from `layer.settings`, one
    # frozen value, never from the layer's private attributes.
    found = _library_private_reads() - set(ALLOWED_PRIVATE_READS)
    assert sorted(found) == []


def test_every_allowed_private_read_still_occurs():
    assert sorted(set(ALLOWED_PRIVATE_READS) - _library_private_reads()) == []


# Keras first, as a program that loads a saved model imports them: the
# package registers its layers as it is imported, before any name is read.
_USE_THE_LAYER = """
import json, sys
import keras
import numpy as np
import keras_mha
registered = keras.saving.get_registered_object(
    "keras_mha>GroupedQueryAttention") is not None
layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
x = np.ones((1, 3, 8), "float32")  # (B, T, E)
output = layer(x, x, use_causal_mask=True)
print(json.dumps({
    "shape": list(output.shape),
    "cli": sorted(m for m in sys.modules
                  if m in ("keras_mha.cli", "keras_mha.__main__")
                  or m.startswith("keras_mha.cli.")),
    "registered": registered,
}))
"""


def _fresh(code):
    """What `code`, run in a fresh process (this one has imported the
    command line and Keras already), prints last, as JSON."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        env=dict(os.environ, KERAS_BACKEND=BACKEND), timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_using_the_layer_loads_no_command_line_module():
    assert _fresh(_USE_THE_LAYER) == {"shape": [1, 3, 8], "cli": [],
                                      "registered": True}


# Reads every public name, as `from keras_mha import *` does, after noting
# what importing the package alone loaded.
_IMPORT_THE_PACKAGE = """
import json, sys
import keras_mha
alone = sorted(m for m in ("keras", "keras_mha.layer") if m in sys.modules)
missing = hasattr(keras_mha, "no_such_name")
public = {name: getattr(keras_mha, name).__module__
          for name in keras_mha.__all__}
import keras
registered = sorted(
    name for name in ("MultiHeadAttention", "CachedMultiHeadAttention",
                      "GroupedQueryAttention", "MultiHeadLatentAttention",
                      "RotaryEmbedding", "HubAttention")
    if keras.saving.get_registered_object("keras_mha>" + name) is not None)
print(json.dumps({"alone": alone, "missing": missing,
                  "version": keras_mha.__version__,
                  "public": public, "dir": sorted(set(keras_mha.__all__)
                                                  - set(dir(keras_mha))),
                  "registered": registered}))
"""


def test_the_package_loads_its_names_on_first_use():
    found = _fresh(_IMPORT_THE_PACKAGE)
    assert found["alone"] == []  # neither Keras nor a layer yet
    assert found["missing"] is False  # an AttributeError, as ever
    assert found["version"] == "0.1.0"
    assert found["public"] == {
        "BlockMap": "keras_mha.attention.block_maps",
        "Causal": "keras_mha.attention.rules",
        "Chunk": "keras_mha.attention.rules",
        "DenseMask": "keras_mha.attention.rules",
        "Documents": "keras_mha.attention.rules",
        "MaskFunction": "keras_mha.attention.rules",
        "Padding": "keras_mha.attention.rules",
        "PrefixLM": "keras_mha.attention.rules",
        "ScoreFunction": "keras_mha.attention.rules",
        "Window": "keras_mha.attention.rules",
        "CachedMultiHeadAttention": "keras_mha.cached",
        "ContextParallel": "keras_mha.distribution",
        "GroupedQueryAttention": "keras_mha.grouped",
        "HubAttention": "keras_mha.hub_layer",
        "MultiHeadAttention": "keras_mha.layer",
        "MultiHeadLatentAttention": "keras_mha.latent",
        "RotaryEmbedding": "keras_mha.rotary",
        "adopt": "keras_mha.hub",
        "from_keras": "keras_mha.convert",
        "from_torch": "keras_mha.convert",
        "layout_map": "keras_mha.distribution",
    }
    assert found["dir"] == []  # dir() lists every public name
    # One name read registered every layer with Keras's serialization.
    assert found["registered"] == ["CachedMultiHeadAttention",
                                   "GroupedQueryAttention",
                                   "HubAttention",
                                   "MultiHeadAttention",
                                   "MultiHeadLatentAttention",
                                   "RotaryEmbedding"]


def test_static_imports_of_the_package_match_its_exports():
    # The package loads its names lazily; the `TYPE_CHECKING` imports are
    # what static readers (the API reference, type checkers) see.
    import keras_mha

    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    static = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            for inner in node.body:
                if isinstance(inner, ast.ImportFrom):
                    static.update({a.name: inner.module for a in inner.names})
    assert static == keras_mha._EXPORTS
