"""Checkpoints saved under one backend load under every other.

Each installed backend saves a few small Functional models once, as
`.keras` and as `.weights.h5`, with its own outputs on fixed inputs (the
other backends in subprocesses: `python tests/test_checkpoints.py DIR`, run
in parallel; the current one in this process). The tests load every file
into the current backend and compare the outputs with the saver's. Every
backend's session does the same, so together they cover the whole matrix
while each session starts only three subprocesses.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest

import keras_mha
from keras_mha.attention import dispatch
from keras_mha.attention.spec import window_sides

BACKENDS = ("tensorflow", "jax", "torch", "numpy")
INSTALLED = tuple(
    b for b in BACKENDS if b == "numpy" or importlib.util.find_spec(b)
)
FORMATS = ("keras", "weights.h5")
BATCH, FEATURES = 2, 8
# name -> sequence length; "banded" is long enough for the banded path.
LENGTHS = {"plain": 6, "banded": 256, "grouped": 6, "latent": 6}
WINDOW = 16


def build_model(name):
    """A small Functional model around one of our layers, zero weights."""
    zeros = dict(kernel_initializer="zeros", bias_initializer="zeros")
    x = keras.Input((LENGTHS[name], FEATURES), name="tokens")
    if name == "plain":
        attention = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=4, value_dim=3, **zeros
        )
        h = attention(x, x)
    elif name == "banded":
        attention = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=4, sliding_window=WINDOW, **zeros
        )
        h = attention(x, x, use_causal_mask=True)
    elif name == "latent":
        attention = keras_mha.MultiHeadLatentAttention(
            num_heads=2, kv_lora_rank=4, qk_nope_head_dim=2,
            qk_rope_head_dim=2, v_head_dim=3, q_lora_rank=3,
            rotary_embedding=keras_mha.RotaryEmbedding(interleaved=True),
            **zeros,
        )
        h = attention(x, x, use_causal_mask=True)
    else:
        attention = keras_mha.GroupedQueryAttention(
            head_dim=4, num_query_heads=4, num_key_value_heads=2, **zeros
        )
        h = attention(x, x, use_causal_mask=True)
    y = keras.layers.Dense(3, **zeros)(keras.layers.LayerNormalization()(h))
    return keras.Model(x, y, name=name)


def inputs(name):
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH, LENGTHS[name], FEATURES)).astype("float32")


def save_all(directory):
    """Saves each model in both formats, and its outputs (this backend)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Weights differ per backend (and from the loader's zeros), so a file
    # that silently did not load cannot pass.
    seed = BACKENDS.index(keras.backend.backend()) + 1
    for name in LENGTHS:
        model = build_model(name)
        rng = np.random.default_rng(seed)
        model.set_weights(
            [
                rng.normal(scale=0.5, size=w.shape).astype("float32")
                for w in model.get_weights()
            ]
        )
        model.save(directory / f"{name}.keras")
        model.save_weights(directory / f"{name}.weights.h5")
        output = keras.ops.convert_to_numpy(model(inputs(name)))
        np.save(directory / f"{name}.npy", output)
    (directory / "done.json").write_text(json.dumps(keras.backend.backend()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """backend -> folder of its files; the other backends in parallel."""
    root = tmp_path_factory.mktemp("checkpoints")
    current = keras.backend.backend()
    processes = {}
    for backend in INSTALLED:
        if backend == current:
            continue
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        processes[backend] = subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__).resolve()),
             str(root / backend)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    save_all(root / current)
    failures = {}
    for backend, process in processes.items():
        output, _ = process.communicate(timeout=600)
        if process.returncode:
            failures[backend] = output[-3000:]
    assert not failures, failures
    return {backend: root / backend for backend in INSTALLED}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(LENGTHS))
@pytest.mark.parametrize("source", BACKENDS)
def test_loads_here(saved, source, name, fmt):
    if source not in INSTALLED:
        pytest.skip(f"{source} is not installed")
    folder = saved[source]
    if fmt == "keras":
        model = keras.saving.load_model(folder / f"{name}.keras")
    else:
        model = build_model(name)
        model.load_weights(folder / f"{name}.weights.h5")
    attention = model.layers[1]
    assert type(attention).__module__ in (
        "keras_mha.layer", "keras_mha.grouped", "keras_mha.latent"
    )
    output = keras.ops.convert_to_numpy(model(inputs(name)))
    np.testing.assert_allclose(
        output, np.load(folder / f"{name}.npy"), atol=1e-5, rtol=1e-5
    )


def test_banded_model_takes_the_banded_path():
    length = LENGTHS["banded"]
    assert dispatch.banded_pays_off(window_sides(WINDOW), length, length)


def test_registered_names_in_the_archive(saved):
    current = keras.backend.backend()
    for name, class_name in (
        ("plain", "MultiHeadAttention"),
        ("grouped", "GroupedQueryAttention"),
        ("latent", "MultiHeadLatentAttention"),
    ):
        with zipfile.ZipFile(saved[current] / f"{name}.keras") as archive:
            config = archive.read("config.json").decode()
        assert f'"registered_name": "keras_mha>{class_name}"' in config


if __name__ == "__main__":
    save_all(sys.argv[1])
