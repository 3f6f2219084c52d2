"""Test set-up shared by every backend.

The backend comes from `KERAS_BACKEND` or `KERAS_HOME=configs/<backend>`;
the same files run unchanged on each.
"""

import importlib.util

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


@pytest.fixture(autouse=True)
def _fresh_session():
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def _decode_implementations():
    from keras_mha.attention import decode

    if decode.native_available():
        return [decode.PORTABLE, decode.NATIVE]
    return [decode.PORTABLE]


@pytest.fixture(params=_decode_implementations())
def decode_implementation(request, monkeypatch):
    """Eager decoding steps on each implementation the backend has: the
    portable block loop op by op everywhere, and the native route of
    torch (its fused kernel), TensorFlow and JAX (the loop compiled).
    `native` serves the steps it can (eager, with a value for the index)."""
    from keras_mha.attention import decode

    monkeypatch.setattr(decode, "IMPLEMENTATION", request.param)
    return request.param
