"""Keras's own test files for its attention layers, run against ours.

`keras/src/layers/attention/multi_head_attention_test.py` and
`grouped_query_attention_test.py` ship inside the installed keras wheel. Each
is loaded from there at collection time (never copied into this repository)
as a private module, and its `layers` global is replaced by a proxy whose
`MultiHeadAttention` (or `GroupedQueryAttention`) is keras_mha's and whose
every other attribute is `keras.src.layers`'s. Nothing in keras itself is
patched, so other test modules in the same process still see Keras's layers.

Their `testing.TestCase` classes are re-exposed here as subclasses of the
same name, so the ids read
`tests/test_keras_suite.py::MultiHeadAttentionTest::...` and
`tests/test_keras_suite.py::GroupedQueryAttentionTest::...`. A few tests are
skipped, each with its reason (see `_skips`).
"""

import importlib.util
import sys
import types
import unittest
from pathlib import Path

import keras
import pytest
from conftest import BACKEND
from keras.src import layers as keras_layers

import keras_mha

KERAS_TEST_DIR = Path("src", "layers", "attention")
# Keras's test file -> {the name its tests read from `layers`: our class}.
KERAS_TEST_FILES = {
    "multi_head_attention_test.py": {
        "MultiHeadAttention": keras_mha.MultiHeadAttention
    },
    "grouped_query_attention_test.py": {
        "GroupedQueryAttention": keras_mha.GroupedQueryAttention
    },
}

# Tests that call or override Keras's private `_compute_attention` hook; our
# layer has no such hook. Parameterized variants share the method's name as a
# prefix (absl appends `_<name>` or a number).
PRIVATE_HOOK_TESTS = (
    "test_compute_attention_combines_causal_and_explicit_mask",
    "test_causal_only_skipped_for_subclass",
)
PRIVATE_HOOK_REASON = (
    "calls or overrides the private `_compute_attention` hook of Keras's "
    "layer, which keras_mha does not implement"
)

# Keras's own marker (registered and handled by the conftest.py of Keras's
# repository, which the wheel does not ship): the test needs a backend with a
# trainer. On NumPy, Keras's own class fails such tests too (`model.fit` raises
# NotImplementedError), and Keras's CI skips them there.
TRAINABLE_MARKER = "requires_trainable_backend"
TRAINABLE_REASON = (
    "marked `requires_trainable_backend` by Keras: the NumPy backend has no "
    "trainer (`fit` raises NotImplementedError with Keras's own class too)"
)


def _keras_test_path(file_name):
    path = Path(keras.__file__).resolve().parent / KERAS_TEST_DIR / file_name
    if not path.is_file():
        pytest.fail(
            f"Keras's test file for its layer is missing: {path} does not exist "
            f"in the installed keras {keras.__version__}; this module runs that "
            "file against keras_mha and cannot run without it",
            pytrace=False,
        )
    return path


def _register_keras_markers():
    # The file decorates a test with `@pytest.mark.requires_trainable_backend`,
    # which `--strict-markers` (pyproject's addopts) turns into a collection
    # error for this whole module. A test module has no public handle on the
    # config, hence `pytest.mark._config`; the marker is only registered, and
    # only if nothing registered it already.
    config = getattr(pytest.mark, "_config", None)
    if config is None:
        return
    registered = {line.split(":")[0].strip() for line in config.getini("markers")}
    if TRAINABLE_MARKER not in registered:
        config.addinivalue_line(
            "markers",
            f"{TRAINABLE_MARKER}: Keras's own marker, for tests of "
            "tests/test_keras_suite.py that need a trainer (skipped on NumPy)",
        )


class _LayersProxy(types.ModuleType):
    """`keras.src.layers`, except for the names of `replaced` (keras_mha's
    classes)."""

    def __init__(self, replaced):
        super().__init__("keras.src.layers", keras_layers.__doc__)
        self.__dict__.update(replaced)

    def __getattr__(self, name):  # only for names not set on the proxy
        return getattr(keras_layers, name)

    def __dir__(self):
        return sorted(set(dir(keras_layers)) | set(self.__dict__))


def _load_keras_tests(file_name, replaced):
    path = _keras_test_path(file_name)
    _register_keras_markers()
    name = "_keras_suite." + Path(file_name).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    # The file did `from keras.src import layers`; its tests look `layers` up
    # in the module's globals when they run, so they now see the proxy.
    module.layers = _LayersProxy(replaced)
    return module, ", ".join(f"keras_mha.{n}" for n in replaced)


def _marks(function):
    return {mark.name for mark in getattr(function, "pytestmark", [])}


def _skips(cls):
    """{test method name: reason} for the tests of `cls` not run here."""
    skips = {}
    for name in unittest.TestLoader().getTestCaseNames(cls):
        if any(name == t or name.startswith(t + "_") for t in PRIVATE_HOOK_TESTS):
            skips[name] = PRIVATE_HOOK_REASON
        elif BACKEND == "numpy" and TRAINABLE_MARKER in _marks(getattr(cls, name)):
            skips[name] = TRAINABLE_REASON
    return skips


def _skipped(name, reason):
    @pytest.mark.skip(reason=f"{name}: {reason}")
    def test(self):
        raise AssertionError("skipped")

    test.__name__ = test.__qualname__ = name
    return test


def _expose(module, ours):
    """Keras's TestCase classes, as same-named subclasses with our skips."""
    exposed = {}
    for name, cls in vars(module).items():
        if (
            isinstance(cls, type)
            and issubclass(cls, unittest.TestCase)
            and cls.__module__ == module.__name__
        ):
            body = {
                test: _skipped(test, reason) for test, reason in _skips(cls).items()
            }
            body["__module__"] = __name__
            body["__qualname__"] = name
            body["__doc__"] = (
                f"Keras's `{name}` ({Path(module.__file__).name}), on "
                f"{ours}."
            )
            exposed[name] = type(cls)(name, (cls,), body)
    if not exposed:
        pytest.fail(
            f"no unittest.TestCase class found in {module.__file__}",
            pytrace=False,
        )
    return exposed


for _file_name, _replaced in KERAS_TEST_FILES.items():
    globals().update(_expose(*_load_keras_tests(_file_name, _replaced)))


@pytest.fixture(scope="module", autouse=True)
def _restore_keras_globals():
    # Keras's TestCase.setUp disables traceback filtering for good, and its
    # tests toggle flash attention; put both back for the modules after this.
    from keras.src.backend.common import global_state

    filtering = keras.config.is_traceback_filtering_enabled()
    flash = global_state.get_global_attribute("flash_attention", default=None)
    yield
    if filtering:
        keras.config.enable_traceback_filtering()
    else:
        keras.config.disable_traceback_filtering()
    global_state.set_global_attribute("flash_attention", flash)


@pytest.mark.parametrize(
    "shape, axes", [((2, 5, 8), None), ((2, 3, 4, 8), (2,)), ((2, 3, 4, 8), (1, 2))]
)
def test_private_names_as_keras(shape, axes):
    # Code written for Keras's layer (keras-hub's subclasses, Keras's tests)
    # reads these private names; they hold what Keras's layer holds.
    ours = keras_mha.MultiHeadAttention(2, 4, attention_axes=axes)
    theirs = keras.layers.MultiHeadAttention(2, 4, attention_axes=axes)
    for layer in (ours, theirs):
        layer.build(shape, shape)
    for name in (
        "_dot_product_equation", "_combine_equation", "_inverse_sqrt_key_dim"
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    for name in ("_query_dense", "_key_dense", "_value_dense", "_output_dense"):
        assert getattr(ours, name).kernel.shape == getattr(theirs, name).kernel.shape


def test_grouped_private_names_as_keras():
    ours = keras_mha.GroupedQueryAttention(4, 4, 2)
    theirs = keras.layers.GroupQueryAttention(4, 4, 2)
    for layer in (ours, theirs):
        layer.build((2, 5, 8), (2, 5, 8))
    for name in (
        "_dot_product_equation", "_combine_equation", "_inverse_sqrt_head_dim"
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
