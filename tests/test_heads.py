"""The per-token head features of real checkpoints: query/key norms
(`qk_norm`, both scopes, RMS with weights and without, LayerNorm), the
values' norm, the clip of the projections and the query temperature, against the float64 reference (`reference.py`), in the cache,
in the config and in the weights.

One input shape for the whole module, `test_features.py`'s (JAX compiles
per shape): `B = 2`, `T = S = 24`, `E = 16`, 6 query heads over 2
key/value heads of 8.
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
from keras_mha import heads as heads_lib
from keras_mha.attention import dispatch
from keras_mha.attention import tuning

B, T, E, N, K, H = 2, 24, 16, 6, 2, 8

VARIANTS = {
    "rms_head": {"qk_norm": "rms"},
    "rms_projection": {"qk_norm": "rms", "qk_norm_scope": "projection",
                       "qk_norm_epsilon": 1e-5},
    "l2_head": {"qk_norm": "l2"},
    "l2_projection": {"qk_norm": "l2", "qk_norm_scope": "projection"},
    "layer_head": {"qk_norm": "layer"},
    "layer_projection": {"qk_norm": "layer", "qk_norm_scope": "projection"},
    "value_norm": {"value_norm": True, "qk_norm_epsilon": 1e-2},
    "clip": {"qkv_clip": 1.5},
    "temperature": {"query_temperature": (4.0, 0.5)},
    # Beam's scalable softmax on its NoPE layers.
    "power_temperature": {"query_temperature": ("power", 6.0, 0.5)},
    # Hunyuan: per-head norms after RoPE.
    "rms_after_rope": {"qk_norm": "rms", "qk_norm_after_rope": True,
                       "rotary_embedding": lambda: keras_mha.RotaryEmbedding(
                           100)},
    # Llama 4's NoPE layer, Qwen3's RoPE layer, Gemma 4's value norm and
    # DBRX's clip in one: every step.
    "all": {"qk_norm": "rms", "query_temperature": (3.0, 0.25),
            "value_norm": True, "qkv_clip": 1.5,
            "rotary_embedding": lambda: keras_mha.RotaryEmbedding(100)},
}


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setitem(tuning.OVERRIDES, "blocked_block", 8)
    monkeypatch.setitem(tuning.OVERRIDES, "decode_block", 8)


def _x(rng):
    return rng.normal(size=(B, T, E)).astype("float32")


def _layer(x, name, window=None, **extra):
    kwargs = {k: v() if callable(v) else v
              for k, v in VARIANTS[name].items()}
    # Random weights, norm scales included (`make_layer`).
    return make_layer(x, x, num_heads=N, key_dim=H, num_key_value_heads=K,
                      sliding_window=window, **kwargs, **extra)


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
        """Per-token transforms: every path attends to the same heads."""
        x = _x(rng)
        for window, paths in ((None, ("triangular", "blocked")),
                              ((5, 0), ("banded",))):
            layer = _layer(x, "all", window)
            expected, _ = reference(layer, x, x, use_causal_mask=True)
            for path in paths:
                with dispatch.force_path(path):
                    got = layer(x, x, use_causal_mask=True)
                assert_close(got, expected, atol=2e-5, rtol=2e-5)

    def test_norms_are_what_they_say(self, rng):
        """Unit mean square per head or per token (scales of ones), and
        "l2" = "rms" with its scales at one."""
        x = _x(rng)
        for scope in ("head", "projection"):
            rms = _layer(x, "rms_head", qk_norm_scope=scope)
            for norm in (rms.query_norm, rms.key_norm):
                norm.scale.assign(np.ones(norm.scale.shape, "float32"))
            l2 = _layer(x, "l2_head", qk_norm_scope=scope)
            l2.set_weights(rms.get_weights()[: len(l2.get_weights())])
            np.testing.assert_allclose(
                to_numpy(l2(x, x)), to_numpy(rms(x, x)), atol=1e-6)
            q = to_numpy(rms.query_norm(rms.query_dense(x)))  # (B, T, N, H)
            axes = -1 if scope == "head" else (-2, -1)
            np.testing.assert_allclose((q**2).mean(axes), 1.0, atol=1e-4)

    @pytest.mark.parametrize("scope", ["head", "projection"])
    def test_layer_norm_is_keras_layer_normalization(self, rng, scope):
        """`qk_norm="layer"` normalizes as Keras's `LayerNormalization`
        over the same features, with the same scale and bias."""
        x = _x(rng)
        layer = _layer(x, "layer_head", qk_norm_scope=scope)
        q = to_numpy(layer.query_dense(x))  # (B, T, N, H)
        shape = q.shape if scope == "head" else (B, T, 1, N * H)
        keras_norm = keras.layers.LayerNormalization(epsilon=1e-6)
        keras_norm.build(shape)
        keras_norm.set_weights([to_numpy(layer.query_norm.scale),
                                to_numpy(layer.query_norm.bias)])
        want = to_numpy(keras_norm(q.reshape(shape))).reshape(q.shape)
        np.testing.assert_allclose(to_numpy(layer.query_norm(q)), want,
                                   atol=2e-5)

    def test_value_norm_and_clip(self, rng):
        """Values of unit mean square per head; every projection within
        the clip."""
        x = _x(rng)
        layer = _layer(x, "all")
        v = to_numpy(heads_lib.values(layer, layer.value_dense(x)))
        np.testing.assert_allclose((v**2).mean(-1), 1.0, atol=1e-4)
        clipped = make_layer(x, x, num_heads=N, key_dim=H, qkv_clip=0.25)
        for projection, transform in ((clipped.query_dense, heads_lib.queries),
                                      (clipped.key_dense, heads_lib.keys)):
            got = to_numpy(transform(clipped, projection(x), 0))
            assert np.abs(got).max() == pytest.approx(0.25)


class TestWeights:
    @pytest.mark.parametrize(
        "scope, shapes", [("head", [(H,), (H,)]),
                          ("projection", [(N * H,), (K * H,)])]
    )
    def test_names_shapes_and_order(self, rng, scope, shapes):
        x = _x(rng)
        layer = _layer(x, "rms_head", qk_norm_scope=scope, use_sinks=True)
        names = [w.path.split("/", 1)[1] for w in layer.weights]
        assert names[-3:] == ["sinks/sinks", "query_norm/scale",
                              "key_norm/scale"]
        assert [tuple(w.shape) for w in layer.weights[-2:]] == shapes
        plain = make_layer(x, x, num_heads=N, key_dim=H,
                           num_key_value_heads=K, use_sinks=True)
        # Keras's weights first, in Keras's order.
        assert names[:-2] == [w.path.split("/", 1)[1] for w in plain.weights]

    def test_layer_norm_weights(self, rng):
        x = _x(rng)
        layer = _layer(x, "layer_projection")
        names = [w.path.split("/", 1)[1] for w in layer.weights]
        assert names[-4:] == ["query_norm/scale", "query_norm/bias",
                              "key_norm/scale", "key_norm/bias"]
        assert [tuple(w.shape) for w in layer.weights[-4:]] == [
            (N * H,), (N * H,), (K * H,), (K * H,)]

    def test_l2_has_no_weights(self, rng):
        x = _x(rng)
        layer = _layer(x, "l2_projection")
        assert layer.query_norm is None and layer.key_norm is None
        assert len(layer.weights) == 8  # four projections, kernel and bias

    @pytest.mark.training
    def test_scales_train(self, rng):
        from util import layer_gradients

        x = _x(rng)
        layer = _layer(x, "all")
        grads = layer_gradients(layer, x, x, use_causal_mask=True)
        names = ["query", "value"] + [w.path for w in layer.trainable_variables]
        for name in ("query_norm/scale", "key_norm/scale"):
            (index,) = [i for i, n in enumerate(names) if n.endswith(name)]
            assert np.all(np.isfinite(grads[index]))
            assert np.abs(grads[index]).max() > 0


class TestDecoding:  # the transforms precede the decode paths: one suffices
    @pytest.mark.parametrize("window", [None, (5, 0)], ids=["full", "rolling"])
    @pytest.mark.parametrize("after_rope", [False, True],
                             ids=["norm_then_rope", "rope_then_norm"])
    def test_step_by_step_equals_full_pass(self, rng, window, after_rope):
        """The temperature reads each query's own position in the cache;
        a cache holds keys rotated, and normalized after when asked."""
        x = _x(rng)[:, :12]
        layer = _layer(x, "all", window, qk_norm_scope="projection",
                       qk_norm_after_rope=after_rope)
        _assert_steps_equal_full_pass(layer, x)

    def test_power_temperature_steps_equal_full_pass(self, rng):
        """Beam's form of the temperature reads each query's position in
        the cache too."""
        x = _x(rng)[:, :12]
        _assert_steps_equal_full_pass(_layer(x, "power_temperature"), x)

    def test_cached_layer(self, rng):
        """keras-hub's cached layer: a prompt, then steps, equal the full
        causal pass."""
        x = _x(rng)[:, :12]
        kwargs = {k: v() if callable(v) else v
                  for k, v in VARIANTS["all"].items()}
        layer = keras_mha.CachedMultiHeadAttention(
            num_heads=N, key_dim=H, num_key_value_heads=K, **kwargs)
        layer.build(x.shape, x.shape)
        twin = make_layer(x, x, num_heads=N, key_dim=H, num_key_value_heads=K,
                          **kwargs)
        layer.set_weights(twin.get_weights())
        full = to_numpy(twin(x, x, use_causal_mask=True))
        causal = np.tril(np.ones((12, 12), bool))
        cache = layer.init_cache(B, 12)
        out, cache = layer(x[:, :5], x[:, :5], cache=cache,
                           cache_update_index=0, attention_mask=causal[:5])
        outputs = [to_numpy(out)]
        for i in range(5, 12):
            out, cache = layer(x[:, i:i + 1], x[:, i:i + 1], cache=cache,
                               cache_update_index=i,
                               attention_mask=causal[i:i + 1])
            outputs.append(to_numpy(out))
        np.testing.assert_allclose(np.concatenate(outputs, 1), full,
                                   atol=2e-5, rtol=2e-5)


def _assert_steps_equal_full_pass(layer, x):
    """A prompt of 5 tokens, then steps of 1 and 3, through the layer's
    cache, equal the full causal pass over the 12 tokens of `x`."""
    assert_steps_equal_full_pass(
        layer, x, ((0, 5), (5, 6), (6, 9), (9, 10), (10, 11), (11, 12)))


class TestCompiledAndMixedPrecision:
    def test_compiled(self, rng):
        """Under `jax.jit` / `tf.function(jit_compile=True)`; eager
        elsewhere."""
        x = _x(rng)
        layer = _layer(x, "all", qk_norm_scope="projection")
        got = compiled(lambda q: layer(q, q, use_causal_mask=True))(x)
        expected, _ = reference(layer, x, x, use_causal_mask=True)
        assert_close(got, expected, atol=2e-5, rtol=2e-5)

    def test_mixed_bfloat16(self, rng):
        x = _x(rng)
        layer32 = _layer(x, "all")
        keras.config.set_dtype_policy("mixed_bfloat16")
        layer16 = _layer(x, "all")
        layer16.set_weights(layer32.get_weights())
        assert layer16.query_norm.scale.dtype == "float32"
        got = to_numpy(layer16(x, x, use_causal_mask=True))
        want, _ = reference(layer32, x, x, use_causal_mask=True)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got.astype("float32") / scale,
                                   want / scale, atol=3e-2)


class TestConfig:
    def test_round_trip(self, rng, tmp_path):
        x = _x(rng)
        layer = _layer(x, "all", qk_norm_scope="projection",
                       qk_norm_epsilon=1e-5)
        config = layer.get_config()
        assert (config["qk_norm"], config["qk_norm_scope"],
                config["qk_norm_epsilon"], config["query_temperature"]) == (
            "rms", "projection", 1e-5, (3.0, 0.25))
        assert config["qk_norm_after_rope"] is False
        assert (config["value_norm"], config["qkv_clip"]) == (True, 1.5)
        clone = keras_mha.MultiHeadAttention.from_config(config)
        assert clone.get_config() == config
        inputs = keras.Input((T, E))
        model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
        path = str(tmp_path / "heads.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)),
                                   atol=1e-6)
        assert loaded.layers[-1].query_temperature == (3.0, 0.25)

    def test_grouped_query_attention(self, rng):
        x = _x(rng)
        layer = keras_mha.GroupedQueryAttention(
            head_dim=H, num_query_heads=N, num_key_value_heads=K,
            qk_norm="rms", qk_norm_scope="projection",
            query_temperature=(2, 0.1),
        )
        layer(x, x)
        assert tuple(layer.key_norm.scale.shape) == (K * H,)
        clone = keras_mha.GroupedQueryAttention.from_config(layer.get_config())
        clone(x, x)
        clone.set_weights(layer.get_weights())
        np.testing.assert_allclose(to_numpy(clone(x, x)), to_numpy(layer(x, x)),
                                   atol=1e-6)


class TestErrors:
    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"qk_norm": "batch"}, "qk_norm='batch'"),
            ({"qkv_clip": 0}, "qkv_clip=0"),
            ({"qkv_clip": -1.0}, "qkv_clip=-1.0"),
            ({"qk_norm": True}, "qk_norm=True"),
            ({"qk_norm_scope": "token"}, "qk_norm_scope='token'"),
            ({"qk_norm_scope": None}, "qk_norm_scope=None"),
            ({"qk_norm_epsilon": 0.0}, "qk_norm_epsilon=0.0"),
            ({"qk_norm_epsilon": -1e-6}, "qk_norm_epsilon=-1e-06"),
            ({"query_temperature": (0, 0.1)},
             r"query_temperature=\(0, 0.1\)"),
            ({"query_temperature": (8192,)}, r"query_temperature=\(8192,\)"),
            ({"query_temperature": 8192}, "query_temperature=8192"),
            ({"query_temperature": (8192, float("inf"))},
             r"query_temperature=\(8192, inf\)"),
            ({"query_temperature": (True, 0.1)},
             r"query_temperature=\(True, 0.1\)"),
            ({"query_temperature": ("power", 0, 0.1)},
             r"query_temperature=\('power', 0, 0.1\)"),
            ({"query_temperature": ("pow", 8, 0.1)},
             r"query_temperature=\('pow', 8, 0.1\)"),
        ],
    )
    def test_constructor_values(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, **kwargs)

    @pytest.mark.parametrize("name", ["qk_norm_after_rope", "value_norm"])
    def test_booleans(self, name):
        with pytest.raises(TypeError, match=f"{name}='yes'"):
            keras_mha.MultiHeadAttention(num_heads=2, key_dim=4,
                                         **{name: "yes"})
