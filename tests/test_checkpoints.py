"""Checkpoints saved under one backend load under every other.

Each installed backend saves a few small Functional models once, as
`.keras` and as `.weights.h5`, with its own outputs on fixed inputs (the
other backends in subprocesses: `python tests/test_checkpoints.py DIR`, run
in parallel; the current one in this process). The tests load every file
into the current backend and compare the outputs with the saver's, so the
sessions of a `keras-mha test` run cover the whole matrix; they share the
saved files (the `saved` fixture), so each backend saves once a run.
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


def _lock(path, wait):
    """`path` opened and locked (`flock`), or `None` when another process
    holds it and `wait` is false."""
    import fcntl

    file = open(path, "w")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        file.close()
        return None
    return file


def _save(root, backends):
    """Saves `backends`' files under `root`: the current backend in this
    process, the others in subprocesses, in parallel."""
    current = keras.backend.backend()
    processes = {}
    for backend in backends:
        if backend == current:
            continue
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        env.pop("KERAS_HOME", None)
        processes[backend] = subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__).resolve()),
             str(root / backend)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    if current in backends:
        save_all(root / current)
    failures = {}
    for backend, process in processes.items():
        output, _ = process.communicate(timeout=600)
        if process.returncode:
            failures[backend] = output[-3000:]
    assert not failures, failures


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """backend -> folder of its files.

    In a `keras-mha test` run the sessions share one folder
    (`KERAS_MHA_TEST_SHARED`): each backend's files are saved once, by the
    first session to claim them (a lock per backend), and the other
    sessions wait for them. Alone, a session saves every backend's."""
    shared = os.environ.get("KERAS_MHA_TEST_SHARED")
    if shared and importlib.util.find_spec("fcntl") is not None:
        root = pathlib.Path(shared) / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("checkpoints")
        _save(root, INSTALLED)
        return {backend: root / backend for backend in INSTALLED}

    def done(backend):
        return (root / backend / "done.json").exists()

    pending = list(INSTALLED)
    while pending:
        claimed, theirs = {}, []
        try:
            for backend in pending:
                lock = _lock(root / f"{backend}.lock", wait=False)
                if lock is None:
                    theirs.append(backend)
                elif done(backend):
                    lock.close()
                else:
                    claimed[backend] = lock
            _save(root, list(claimed))
        finally:
            for lock in claimed.values():
                lock.close()
        for backend in theirs:  # wait for the session saving them
            _lock(root / f"{backend}.lock", wait=True).close()
        # A session that failed left its backends unsaved: claim them here.
        pending = [backend for backend in theirs if not done(backend)]
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
