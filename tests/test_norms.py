"""The norms around the projections: `input_norm` (a Keras layer on the
query, and on the value and key with `input_norm_scope="all"`:
Megatron-BERT's and RoBERTa-PreLayerNorm's pre-norm) and `output_norm` (a Keras layer on each
token's heads concatenated, after the gate and before the output
projection: BitNet's sub-norm, Dory's L2 norm), against the float64 reference (`reference.py`), on
every path, in the cache, compiled, in the config, the saved file and the
weights.

`test_heads.py`'s input shape (JAX compiles per shape): `B = 2`,
`T = S = 24`, `E = 16`, 6 query heads over 2 key/value heads of 8.
"""

import keras
import numpy as np
import pytest
from util import assert_close
from util import assert_steps_equal_full_pass
from util import compiled
from util import make_layer
from util import reference
from util import to_numpy

import keras_mha
from keras_mha.attention import dispatch
from keras_mha.attention import tuning

B, T, E, N, K, H = 2, 24, 16, 6, 2, 8

VARIANTS = {
    "input_layer_norm": lambda: dict(
        input_norm=keras.layers.LayerNormalization(epsilon=1e-5)),
    "input_rms": lambda: dict(
        input_norm=keras.layers.RMSNormalization(epsilon=1e-6)),
    "output_rms": lambda: dict(
        output_norm=keras.layers.RMSNormalization(epsilon=1e-6)),
    # Both, with a gate and RoPE: every step of the layer.
    "all": lambda: dict(
        input_norm=keras.layers.LayerNormalization(epsilon=1e-5),
        output_norm=keras.layers.RMSNormalization(epsilon=1e-6),
        use_gate=True, rotary_embedding=keras_mha.RotaryEmbedding(100)),
}


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setitem(tuning.OVERRIDES, "blocked_block", 8)
    monkeypatch.setitem(tuning.OVERRIDES, "decode_block", 8)


def _x(rng):
    return rng.normal(size=(B, T, E)).astype("float32")


def _layer(x, name, memory=None, **extra):
    # Random weights, the norms' scales and biases included (`make_layer`).
    return make_layer(x, x if memory is None else memory, num_heads=N,
                      key_dim=H, num_key_value_heads=K,
                      **VARIANTS[name](), **extra)


class TestAgainstReference:
    @pytest.mark.parametrize("name", list(VARIANTS))
    def test_variants(self, rng, name):
        x = _x(rng)
        layer = _layer(x, name)
        expected, _ = reference(layer, x, x, use_causal_mask=True)
        for path in ("explicit", "fused"):
            with dispatch.force_path(path):
                got = layer(x, x, use_causal_mask=True)
            assert_close(got, expected, atol=2e-5, rtol=2e-5)

    def test_every_path(self, rng):
        x = _x(rng)
        for window, paths in ((None, ("triangular", "blocked")),
                              ((5, 0), ("banded",))):
            layer = _layer(x, "all", sliding_window=window)
            expected, _ = reference(layer, x, x, use_causal_mask=True)
            for path in paths:
                with dispatch.force_path(path):
                    got = layer(x, x, use_causal_mask=True)
                assert_close(got, expected, atol=2e-5, rtol=2e-5)

    def test_query_scope_leaves_the_memory(self, rng):
        """`input_norm_scope="query"` normalizes the query only (a
        cross-attention's memory, of another size here); `"all"` the value
        and key too: the two differ."""
        x = _x(rng)
        memory = rng.normal(size=(B, T, 2 * E)).astype("float32")
        layer = _layer(x, "input_layer_norm", memory,
                       input_norm_scope="query")
        expected, _ = reference(layer, x, memory)
        assert_close(layer(x, memory), expected, atol=2e-5, rtol=2e-5)
        square = _layer(x, "input_layer_norm", input_norm_scope="query")
        every = _layer(x, "input_layer_norm")
        every.set_weights(square.get_weights())
        only_query, _ = reference(square, x, x)
        assert_close(square(x, x), only_query, atol=2e-5, rtol=2e-5)
        assert np.abs(only_query - to_numpy(every(x, x))).max() > 1e-2

    def test_all_scope_normalizes_a_memory(self, rng):
        """`input_norm_scope="all"` normalizes a cross-attention's value
        and key too, each its own."""
        x = _x(rng)
        value, key = (rng.normal(size=(B, T, E)).astype("float32")
                      for _ in range(2))
        layer = _layer(x, "input_layer_norm", value)
        for args in ((value,), (value, key)):
            expected, _ = reference(layer, x, *args)
            assert_close(layer(x, *args), expected, atol=2e-5, rtol=2e-5)

    def test_norms_are_what_they_say(self, rng):
        """The output norm sees each token's `N·V` features: with scales of
        one, the heads given to the output projection have unit mean
        square."""
        x = _x(rng)
        layer = _layer(x, "output_rms")
        layer.output_norm.scale.assign(np.ones((N * H,), "float32"))
        seen = []
        dense = layer.output_dense
        original = dense.call
        dense.call = lambda heads, *a, **k: (seen.append(to_numpy(heads)),
                                             original(heads, *a, **k))[1]
        try:
            layer(x, x)
        finally:
            dense.call = original
        np.testing.assert_allclose((seen[0]**2).mean((-2, -1)), 1.0,
                                   atol=1e-4)


class TestDecoding:
    @pytest.mark.parametrize("window", [None, (5, 0)], ids=["full", "rolling"])
    def test_step_by_step_equals_full_pass(self, rng, window):
        x = _x(rng)[:, :12]
        layer = _layer(x, "all", sliding_window=window)
        assert_steps_equal_full_pass(
            layer, x, ((0, 5), (5, 6), (6, 9), (9, 12)))

    def test_cached_layer(self, rng):
        """keras-hub's cached layer: a prompt, then steps."""
        x = _x(rng)[:, :12]
        twin = _layer(x, "all")
        layer = keras_mha.CachedMultiHeadAttention(
            num_heads=N, key_dim=H, num_key_value_heads=K, **VARIANTS["all"]())
        layer.build(x.shape, x.shape)
        layer.set_weights(twin.get_weights())
        full = to_numpy(twin(x, x, use_causal_mask=True))
        causal = np.tril(np.ones((12, 12), bool))
        cache = layer.init_cache(B, 12)
        out, cache = layer(x[:, :5], x[:, :5], cache=cache,
                           cache_update_index=0, attention_mask=causal[:5])
        outputs = [to_numpy(out)]
        for i in range(5, 12):
            step = x[:, i:i + 1]
            out, cache = layer(step, step, cache=cache, cache_update_index=i,
                               attention_mask=causal[i:i + 1])
            outputs.append(to_numpy(out))
        np.testing.assert_allclose(np.concatenate(outputs, 1), full,
                                   atol=2e-5, rtol=2e-5)


class TestCompiled:
    def test_compiled(self, rng):
        """Under `jax.jit` / `tf.function(jit_compile=True)`; eager
        elsewhere."""
        x = _x(rng)
        layer = _layer(x, "all")
        got = compiled(lambda q: layer(q, q, use_causal_mask=True))(x)
        expected, _ = reference(layer, x, x, use_causal_mask=True)
        assert_close(got, expected, atol=2e-5, rtol=2e-5)


class TestWeightsAndConfig:
    def test_weights_after_keras(self, rng):
        """Keras's weights first, in Keras's order, then the norms'."""
        x = _x(rng)
        layer = _layer(x, "all")
        names = [w.path.split("/", 1)[1] for w in layer.weights]
        plain = make_layer(x, x, num_heads=N, key_dim=H,
                           num_key_value_heads=K, use_gate=True)
        keras_names = [w.path.split("/", 1)[1] for w in plain.weights]
        assert names[:len(keras_names)] == keras_names
        assert [tuple(w.shape) for w in layer.weights[len(keras_names):]] == [
            (E,), (E,), (N * H,)]

    def test_round_trip(self, rng, tmp_path):
        x = _x(rng)
        layer = _layer(x, "all")
        config = layer.get_config()
        assert config["input_norm"]["class_name"] == "LayerNormalization"
        assert config["output_norm"]["class_name"] == "RMSNormalization"
        clone = keras_mha.MultiHeadAttention.from_config(config)
        assert clone.get_config() == config
        assert isinstance(clone.input_norm, keras.layers.LayerNormalization)
        inputs = keras.Input((T, E))
        model = keras.Model(inputs, layer(inputs, inputs,
                                          use_causal_mask=True))
        path = str(tmp_path / "norms.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)),
                                   atol=1e-6)
        norm = loaded.layers[-1].output_norm
        np.testing.assert_array_equal(to_numpy(norm.scale),
                                      to_numpy(layer.output_norm.scale))

    @pytest.mark.training
    def test_norms_train(self, rng):
        from util import layer_gradients

        x = _x(rng)
        layer = _layer(x, "all")
        grads = layer_gradients(layer, x, x, use_causal_mask=True)
        names = ["query", "value"] + [w.path for w in layer.trainable_variables]
        for weight in (layer.input_norm.gamma, layer.output_norm.scale):
            (index,) = [i for i, n in enumerate(names) if n == weight.path]
            assert np.all(np.isfinite(grads[index]))
            assert np.abs(grads[index]).max() > 0


class TestErrors:
    def test_memory_of_another_size_with_scope_all(self, rng):
        x = _x(rng)
        memory = np.zeros((B, T, 2 * E), "float32")
        layer = keras_mha.MultiHeadAttention(
            num_heads=N, key_dim=H, input_norm_scope="all",
            input_norm=keras.layers.LayerNormalization())
        with pytest.raises(ValueError, match="input_norm_scope='all'"):
            layer(x, memory)

    def test_scope(self):
        with pytest.raises(ValueError, match="input_norm_scope='memory'"):
            keras_mha.MultiHeadAttention(num_heads=2, key_dim=4,
                                         input_norm_scope="memory")

    @pytest.mark.parametrize("name", ["input_norm", "output_norm"])
    @pytest.mark.parametrize("value", ["layer", 1e-6])
    def test_not_a_layer(self, name, value):
        with pytest.raises(TypeError, match=f"{name}={value!r}"):
            keras_mha.MultiHeadAttention(num_heads=2, key_dim=4,
                                         **{name: value})
