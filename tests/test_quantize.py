"""`layer.quantize(mode)`: the projections quantized, as `Model.quantize`
quantizes the layers it holds.

Keras's own `MultiHeadAttention.quantize` raises `NotImplementedError`
(only `Model.quantize`, which reaches the projections, works there); ours
quantizes its `EinsumDense` projections and keeps their policies in its
own, so a quantized layer saves and loads.
"""

import keras
import numpy as np
import pytest

import keras_mha
from util import to_numpy

LAYERS = [
    pytest.param(keras_mha.MultiHeadAttention,
                 dict(num_heads=2, key_dim=4, num_key_value_heads=1,
                      use_sinks=True, rotary_embedding=keras_mha.RotaryEmbedding()),
                 id="MultiHeadAttention"),
    pytest.param(keras_mha.GroupedQueryAttention,
                 dict(head_dim=4, num_query_heads=2, num_key_value_heads=1),
                 id="GroupedQueryAttention"),
    pytest.param(keras_mha.CachedMultiHeadAttention,
                 dict(num_heads=2, key_dim=4, use_gate=True),
                 id="CachedMultiHeadAttention"),
]


def _model(cls, kwargs, x):
    inputs = keras.Input(x.shape[1:])
    layer = cls(**kwargs, kernel_initializer="glorot_uniform",
                bias_initializer="glorot_uniform")
    return keras.Model(inputs, layer(inputs, inputs)), layer


@pytest.mark.parametrize("cls, kwargs", LAYERS)
def test_int8_close_to_float_and_round_trips(cls, kwargs, rng, tmp_path):
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    model, layer = _model(cls, kwargs, x)
    expected = to_numpy(model(x))
    layer.quantize("int8")
    projections = [sub for sub in layer._flatten_layers(include_self=False)
                   if isinstance(sub, keras.layers.EinsumDense)]
    assert len(projections) >= 4
    assert all(sub.quantization_mode == "int8" for sub in projections)
    assert all(sub.kernel.dtype == "int8" for sub in projections)
    quantized = to_numpy(model(x))
    # int8 weights with per-channel scales: about 1% of the outputs' scale.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(quantized, expected, atol=0.03 * scale)
    assert not np.array_equal(quantized, expected)
    path = str(tmp_path / "quantized.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(to_numpy(loaded(x)), quantized)
    assert [w.dtype for w in loaded.weights] == [w.dtype for w in model.weights]


def test_keras_layer_does_not_quantize():
    """The difference from Keras's layer (docs/keras-differences.md)."""
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    x = np.ones((2, 5, 8), "float32")
    layer(x, x)
    with pytest.raises(NotImplementedError):
        layer.quantize("int8")


def test_quantize_twice_is_an_error(rng):
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
    layer(x, x)
    layer.quantize("int8")
    with pytest.raises(ValueError, match="already quantized"):
        layer.quantize("int8")
