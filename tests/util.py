"""Helpers shared by the test files (not tests themselves)."""

import keras
import numpy as np

import keras_mha
from keras_mha.attention import AttentionSpec
from keras_mha.attention.spec import default_scale
from keras_mha.attention.spec import window_sides
from reference import layer_weights
from reference import reference_attention

# Arguments that only keras_mha's layer takes.
OURS_ONLY = ("num_key_value_heads",)


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def random_inputs(rng, batch=2, query_length=5, key_length=None, features=8):
    key_length = query_length if key_length is None else key_length
    query = rng.normal(size=(batch, query_length, features)).astype("float32")
    value = rng.normal(size=(batch, key_length, features)).astype("float32")
    return query, value


def make_layer(query, value, key=None, seed=0, **kwargs):
    """Our layer, built for these inputs, with random weights and biases.

    The weights come from NumPy: random initializers would compile a new
    JAX random kernel for every shape, which dominates the suite's time.
    """
    randomize = "kernel_initializer" not in kwargs
    if randomize:
        kwargs.update(kernel_initializer="zeros", bias_initializer="zeros")
    layer = keras_mha.MultiHeadAttention(**kwargs)
    key = value if key is None else key
    layer.build(query.shape, value.shape, key.shape)
    if randomize:
        rng = np.random.default_rng(seed)
        layer.set_weights(
            [
                rng.normal(scale=0.5, size=w.shape).astype("float32")
                for w in layer.get_weights()
            ]
        )
    return layer


def make_keras_twin(layer, query, value, key=None):
    """`keras.layers.MultiHeadAttention` with the same config and weights."""
    config = layer.get_config()
    for name in OURS_ONLY + ("flash_attention",):
        config.pop(name, None)
    twin = keras.layers.MultiHeadAttention.from_config(config)
    key = value if key is None else key
    twin.build(query.shape, value.shape, key.shape)
    twin.set_weights(layer.get_weights())
    return twin


def reference(layer, query, value, key=None, **kwargs):
    """The float64 reference with the layer's weights and window."""
    kwargs.setdefault("sliding_window", layer.sliding_window)
    return reference_attention(
        layer_weights(layer), query, value, key=key, **kwargs
    )


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(
        to_numpy(actual).astype("float64"), expected, atol=atol, rtol=rtol
    )


def attention_spec(head, window=None, causal=False, **fields):
    """The `AttentionSpec` a layer with `key_dim=head` and
    `sliding_window=window` describes; `fields` fill the rest."""
    return AttentionSpec(
        scale=default_scale(head),
        causal=causal,
        window=window_sides(window, causal),
        **fields,
    )
