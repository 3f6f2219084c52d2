"""Test set-up shared by every backend.

The backend comes from `KERAS_BACKEND` or `KERAS_HOME=configs/<backend>`;
the same files run unchanged on each.
"""

import gc
import importlib.util
import os

# torch must be imported before tensorflow (the other order can crash), and
# some tests import both; tensorflow itself is only imported when used.
if importlib.util.find_spec("torch") is not None:
    importlib.import_module("torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend {BACKEND}"


def pytest_collection_modifyitems(config, items):
    if BACKEND != "numpy":
        return
    skip = pytest.mark.skip(reason="the NumPy backend runs inference only")
    for item in items:
        if "training" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _collector_skips_earlier_modules():
    """Frees what the modules before left, then freezes what stays: the
    imports, the backend's caches and compiled programs live to the end,
    and Python's full collections, which a long session runs again and
    again, would scan them all each time (a third of a JAX session's time
    in some modules)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _fresh_session():
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def _decode_implementations():
    """The implementations an eager decoding step can take here. On JAX
    every eager step takes the native route
    (`capabilities.compiles_eager_call`):
    the portable loop compiled by `jax.jit`. Its Python run op by op, which
    no call on JAX reaches, is run by TensorFlow's, torch's and NumPy's
    suites; on JAX each of its ops would compile anew for every shape the
    step's position gives (about a minute and a half of the suite)."""
    from keras_mha.attention import decode

    if BACKEND == "jax":
        return [decode.NATIVE]
    if decode.native_available():
        return [decode.PORTABLE, decode.NATIVE]
    return [decode.PORTABLE]


def jax_children_session():
    """The session that runs the tests whose work is all in JAX child
    processes (several host devices, or several processes), or `None`
    without JAX: the first of NumPy's and torch's in a `keras-mha test` run
    (`KERAS_MHA_TEST_BACKENDS`), else JAX's. NumPy's session is the
    shortest of the run by far, and JAX's the longest; a child's backend is
    JAX whichever session starts it."""
    if importlib.util.find_spec("jax") is None:
        return None
    names = [name for name in
             os.environ.get("KERAS_MHA_TEST_BACKENDS", "").split(",") if name]
    for session in ("numpy", "torch"):
        if session in names:
            return session
    return "jax"


def skip_unless_jax_children_here():
    session = jax_children_session()
    if session is None:
        pytest.skip("the multi-device tests run in JAX child processes; "
                    "JAX is not installed")
    if session != BACKEND:
        pytest.skip(f"the multi-device tests run in JAX child processes, "
                    f"started from {session}'s session of the run "
                    f"(`conftest.jax_children_session`)")


def jax_child_env(devices):
    """The environment of a JAX child process with `devices` host devices:
    this one's, its backend and Keras home JAX's, compiling with the
    flags of the JAX session (`testrun.XLA_TEST_FLAGS`)."""
    from keras_mha.cli.testrun import xla_test_flags

    env = dict(os.environ)
    env.pop("KERAS_HOME", None)
    env.update(
        KERAS_BACKEND="jax",
        XLA_FLAGS=xla_test_flags(
            f"--xla_force_host_platform_device_count={devices}"),
        JAX_PLATFORMS="cpu",
    )
    return env


@pytest.fixture(params=_decode_implementations())
def decode_implementation(request):
    """Eager decoding steps on each implementation the backend has: the
    portable block loop op by op everywhere, and the native route of
    torch (its fused kernel), TensorFlow and JAX (the loop compiled).
    `native` serves the steps it can (eager, with a value for the index).
    Held by `decode.force_implementation`, the users' override."""
    from keras_mha.attention import decode

    with decode.force_implementation(request.param):
        yield request.param
