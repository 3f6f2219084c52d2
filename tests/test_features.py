"""The features of current models on every path: rotary embeddings, the
scale, soft-capping, sinks, ALiBi, attention biases, segment ids and
asymmetric windows, against the float64 reference (`reference.py`, written
from the papers) and against each other.

One input shape for the whole module (JAX compiles per shape): `B = 2`,
`T = S = 24`, `E = 16`, 6 query heads over 2 key/value heads of 8.
"""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from reference import alibi_slopes as reference_slopes
from util import assert_close
from util import assert_steps_equal_full_pass
from util import compiled
from util import layer_gradients
from util import make_layer
from util import reference
from util import to_numpy

import keras_mha
from keras_mha.attention import dispatch
from keras_mha.attention import tuning
from keras_mha.attention.logits import alibi_slopes

B, T, E, N, K, H = 2, 24, 16, 6, 2, 8

# What a layer is built with: one feature at a time, and all together.
LAYER_FEATURES = {
    "plain": {},
    "rope": {"rotary_embedding": lambda: keras_mha.RotaryEmbedding(100)},
    "partial_rope": {
        "rotary_embedding": lambda: keras_mha.RotaryEmbedding(
            50, scaling_factor=2.0, rotary_dim=4
        )
    },
    # gpt-oss's published YaRN in the interleaved layout.
    "yarn_interleaved_rope": {
        "rotary_embedding": lambda: keras_mha.RotaryEmbedding(
            150000, scaling_factor=32.0, rope_type="yarn", truncate=False,
            interleaved=True,
        )
    },
    "scale": {"scale": 0.9},
    "soft_cap": {"attn_logits_soft_cap": 1.5},
    "sinks": {"use_sinks": True},
    "alibi": {"use_alibi": True},
    # Falcon: ALiBi added before the scale, so scaled with the logits.
    "alibi_before_scale": {"use_alibi": True, "alibi_before_scale": True,
                           "scale": 0.5},
    # Differential attention: heads `i` and `i + 3` pair up.
    "differential": {"differential": 0.3},
    "query_scale": {"use_query_scale": True},
    "all": {
        "rotary_embedding": lambda: keras_mha.RotaryEmbedding(100),
        "scale": 0.5,
        "attn_logits_soft_cap": 3.0,
        "use_sinks": True,
        "use_alibi": True,
        "differential": 0.3,
        "use_query_scale": True,
    },
}

# (use_causal_mask, sliding_window) and the paths that can serve them.
MASKS = {
    "causal": (True, None, ("explicit", "fused", "triangular", "blocked")),
    "causal_window": (True, (5, 0), ("explicit", "fused", "banded")),
    "asymmetric": (False, (4, 2), ("explicit", "fused", "banded")),
}


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Blocks of 8 on the blocked path and in decoding steps' reads of a
    full cache: `T = 24` is three of them."""
    monkeypatch.setitem(tuning.OVERRIDES, "blocked_block", 8)
    monkeypatch.setitem(tuning.OVERRIDES, "decode_block", 8)


def _inputs(rng):
    return rng.normal(size=(2, B, T, E)).astype("float32")


def _segments():
    ids = np.zeros((B, T), "int32")
    ids[0, 10:] = 1  # two sequences packed in row 0
    ids[1, 5:12], ids[1, 12:] = 1, 2  # three in row 1
    return ids


def _layer(x, name, window, seed=0):
    kwargs = {
        k: v() if callable(v) else v for k, v in LAYER_FEATURES[name].items()
    }
    layer = make_layer(
        x, x, seed=seed, num_heads=N, key_dim=H, num_key_value_heads=K,
        sliding_window=window, **kwargs,
    )
    if layer.sinks is not None:
        layer.sinks.assign(np.linspace(-1.0, 2.0, N).astype("float32"))
    if layer.query_scale is not None:  # ones at first: made to matter
        layer.query_scale.assign(np.random.default_rng(seed).uniform(
            0.2, 2.0, (N, H)).astype("float32"))
    return layer


def _run(layer, x, path, **kwargs):
    with dispatch.force_path(path):
        return to_numpy(layer(x, x, **kwargs))


class TestAgainstReference:
    @pytest.mark.parametrize("name", list(LAYER_FEATURES))
    @pytest.mark.parametrize("masks", list(MASKS))
    def test_every_path(self, rng, name, masks):
        causal, window, paths = MASKS[masks]
        x = _inputs(rng)[0]
        layer = _layer(x, name, window)
        expected, _ = reference(layer, x, x, use_causal_mask=causal)
        for path in paths:
            assert_close(
                _run(layer, x, path, use_causal_mask=causal), expected,
                atol=2e-5, rtol=2e-5,
            )

    @pytest.mark.parametrize("masks", list(MASKS))
    def test_segments_and_bias(self, rng, masks):
        causal, window, paths = MASKS[masks]
        x = _inputs(rng)[0]
        layer = _layer(x, "all", window)
        ids = _segments()
        for path in paths:
            assert_close(
                _run(layer, x, path, use_causal_mask=causal, segment_ids=ids),
                reference(layer, x, x, use_causal_mask=causal,
                          segment_ids=ids)[0],
                atol=2e-5, rtol=2e-5,
            )
        bias = rng.normal(size=(N, T, T)).astype("float32")
        for path in paths:  # banded cannot serve a dense bias
            assert_close(
                _run(layer, x, path, use_causal_mask=causal,
                     attention_bias=bias),
                reference(layer, x, x, use_causal_mask=causal,
                          attention_bias=bias)[0],
                atol=2e-5, rtol=2e-5,
            )

    def test_cross_attention_segments_and_bias(self, rng):
        x = _inputs(rng)[0]
        value = x[:, :18]
        layer = make_layer(x, value, num_heads=N, key_dim=H,
                           num_key_value_heads=K, use_alibi=True)
        ids = _segments()
        key_ids = ids[:, :18][:, ::-1].copy()
        bias = rng.normal(size=(B, 1, 1, 18)).astype("float32")
        kwargs = dict(segment_ids=ids, key_segment_ids=key_ids,
                      attention_bias=bias)
        expected, weights = reference(layer, x, value, **kwargs)
        for path in ("explicit", "fused"):
            with dispatch.force_path(path):
                assert_close(layer(x, value, **kwargs), expected)
        _, scores = layer(x, value, return_attention_scores=True, **kwargs)
        assert_close(scores, weights)

    def test_scores_with_sinks_sum_below_one(self, rng):
        x = _inputs(rng)[0]
        layer = _layer(x, "sinks", None)
        _, scores = layer(x, x, return_attention_scores=True)
        _, expected = reference(layer, x, x)
        assert_close(scores, expected)
        sums = to_numpy(scores).sum(-1)  # the sink holds the rest
        assert sums.max() <= 1.0 + 1e-6 and sums.min() < 0.99

    def test_empty_rows_give_zeros_with_sinks(self, rng):
        """Rows with no key put all weight on the sink: context 0."""
        x = _inputs(rng)[0]
        mask = np.ones((B, T), bool)
        mask[:, :6] = False  # the first 6 keys are padding
        for window in (None, (3, 0)):
            layer = _layer(x, "all", window)
            expected, _ = reference(layer, x, x, value_mask=mask,
                                    use_causal_mask=True)
            for path in ("explicit", "fused", "banded", "triangular",
                         "blocked"):
                got = _run(layer, x, path, value_mask=mask, use_causal_mask=True)
                assert np.all(np.isfinite(got))
                assert_close(got, expected, atol=2e-5, rtol=2e-5)

    def test_path_taken(self):
        """The paths above really serve these features (no silent
        fallback): banded keeps O(T·w) with every feature but a bias."""
        query = (B, 4096, E)
        layer = keras_mha.MultiHeadAttention(
            num_heads=N, key_dim=H, num_key_value_heads=K,
            sliding_window=(64, 0), use_sinks=True, use_alibi=True,
            attn_logits_soft_cap=2.0,
            rotary_embedding=keras_mha.RotaryEmbedding(),
        )
        assert layer.attention_path(query, query, use_causal_mask=True,
                                    segment_ids=True) == "banded"
        assert layer.attention_path(query, query, use_causal_mask=True,
                                    attention_bias=True) != "banded"
        full = keras_mha.MultiHeadAttention(
            num_heads=N, key_dim=H, use_sinks=True, use_alibi=True
        )
        with dispatch.force_path("fused"):
            assert full.attention_path(query, query, attention_bias=True,
                                       segment_ids=True) == "fused"
        capped = keras_mha.MultiHeadAttention(
            num_heads=N, key_dim=H, attn_logits_soft_cap=2.0
        )
        with dispatch.force_path("triangular"):
            assert capped.attention_path(query, query, use_causal_mask=True,
                                         segment_ids=True) == "triangular"
        # The fused kernels have no soft-cap off TPUs.
        with dispatch.force_path("fused"):
            assert capped.attention_path(query, query) == "explicit"


class TestBandedImplementations:
    """The banded path's portable core and torch's native one (ALiBi and
    sinks as extra features; torch products with a soft-cap) against the
    explicit path, with gradients."""

    @pytest.mark.parametrize(
        "causal, window, soft_cap",
        [(True, 5, None), (False, (6, 0), None), (True, 5, 1.5),
         (False, (4, 3), 1.5)],
    )
    def test_against_explicit(self, rng, monkeypatch, causal, window,
                              soft_cap):
        from keras_mha.attention import banded
        from keras_mha.attention import explicit
        from keras_mha.attention.spec import AttentionSpec
        from keras_mha.attention.spec import window_sides

        q = rng.normal(size=(B, T, N, H)).astype("float32")
        k = rng.normal(size=(B, T, K, H)).astype("float32")
        v = rng.normal(size=(B, T, K, H)).astype("float32")
        mask = np.ones((B, T), bool)
        mask[1, :3] = False
        spec = AttentionSpec(
            scale=0.4, causal=causal, window=window_sides(window, causal),
            key_mask=keras.ops.convert_to_tensor(mask),
            sinks=keras.ops.convert_to_tensor(
                np.linspace(-1, 1, N).astype("float32")
            ),
            alibi=alibi_slopes(N),
            soft_cap=soft_cap,
        )
        expected, _ = explicit.explicit_attention(q, k, v, spec)
        implementations = [banded.PORTABLE]
        if banded.native_available():
            implementations.append(banded.NATIVE)
        for implementation in implementations:
            got = banded.banded_attention(
                q, k, v, spec, block_size=8, implementation=implementation
            )
            assert_close(got, to_numpy(expected), atol=2e-5, rtol=2e-5)
        if BACKEND == "torch":  # the native kernels' own gradients
            import torch

            # Soft-capped blocks two at a time: steps of 2 and 1 blocks.
            monkeypatch.setitem(tuning.OVERRIDES, "capped_chunk", 2)

            cotangent = torch.tensor(rng.normal(size=q.shape).astype("float32"))
            # With ALiBi and without it: sinks then take the kernel's
            # log-sum-exp alone.
            for case in (spec, spec.replace(alibi=None)):
                grads = {}
                for implementation in implementations:
                    sinks = torch.linspace(-1, 1, N).requires_grad_(True)
                    inputs = [
                        torch.tensor(x, requires_grad=True) for x in (q, k, v)
                    ]
                    out = banded.banded_attention(
                        *inputs, case.replace(sinks=sinks), block_size=8,
                        implementation=implementation,
                    )
                    loss = (out * cotangent).sum()
                    grads[implementation] = [
                        g.numpy()
                        for g in torch.autograd.grad(loss, [*inputs, sinks])
                    ]
                for got, want in zip(
                    grads[banded.NATIVE], grads[banded.PORTABLE]
                ):
                    np.testing.assert_allclose(got, want, atol=1e-4,
                                               rtol=1e-4)


class TestAlibiSlopes:
    @pytest.mark.parametrize("num_heads", [1, 2, 3, 6, 8, 12, 16])
    def test_papers_slopes(self, num_heads):
        np.testing.assert_allclose(
            alibi_slopes(num_heads), reference_slopes(num_heads), rtol=1e-12
        )

    def test_known_values(self):
        # Press et al.: 8 heads -> 1/2, 1/4, ..., 1/256.
        np.testing.assert_allclose(alibi_slopes(8), 0.5 ** np.arange(1, 9))


@pytest.mark.training
class TestGradients:
    @pytest.mark.parametrize("masks", ["causal", "causal_window"])
    def test_paths_agree(self, rng, masks):
        causal, window, paths = MASKS[masks]
        x = _inputs(rng)[0]
        layer = _layer(x, "all", window)
        ids = _segments()
        grads = {}
        for path in paths:
            with dispatch.force_path(path):
                grads[path] = layer_gradients(
                    layer, x, x, use_causal_mask=causal, segment_ids=ids
                )
        names = ["query", "value"] + [w.path for w in layer.trainable_variables]
        assert any("sinks" in name for name in names)
        for path in paths[1:]:
            for name, got, want in zip(names, grads[path], grads["explicit"]):
                np.testing.assert_allclose(
                    got, want, atol=2e-4, rtol=2e-4, err_msg=f"{path}: {name}"
                )
        sinks_grad = grads["explicit"][names.index(layer.sinks.path)]
        assert np.all(np.abs(sinks_grad) > 0)


@pytest.mark.usefixtures("decode_implementation")
class TestDecoding:
    @pytest.mark.parametrize("window", [None, (5, 0), 4])
    def test_step_by_step_equals_full_pass(self, rng, window):
        x = _inputs(rng)[0][:, :12]
        layer = _layer(x, "all", window)
        cache = assert_steps_equal_full_pass(
            layer, x, ((0, 5), (5, 6), (6, 9), (9, 10), (10, 11), (11, 12)))
        if window is not None:  # a rolling cache of `left + 1` slots
            slots = window[0] + 1 if isinstance(window, tuple) else window
            assert [x.shape[1] for x in cache] == [slots] * 3

    @pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"),
                        reason="only jax.jit and tf.function trace a step")
    def test_compiled_steps_read_the_whole_cache_late(self, rng,
                                                      monkeypatch):
        """Compiled one-token steps at every position of a cache of three
        blocks: the loop over blocks up to `decode_whole_from` of it,
        then the one pass over every slot (JAX's value of the tuning
        table's `decode_whole_from`, here on this backend too), equal the
        full pass; one padded token in the prompt."""
        monkeypatch.setitem(
            tuning.OVERRIDES, "decode_whole_from",
            tuning.value("decode_whole_from", backend="jax"),
        )
        x = _inputs(rng)[0]
        layer = _layer(x, "all", None)
        mask = np.ones((B, T), bool)
        mask[1, 2] = False
        full = to_numpy(layer(x, x, use_causal_mask=True, query_mask=mask,
                              value_mask=mask))
        prompt = 4
        cache = layer.init_cache(B, T)
        _, cache = layer(x[:, :prompt], x[:, :prompt], use_causal_mask=True,
                         query_mask=mask[:, :prompt],
                         value_mask=mask[:, :prompt], cache=cache,
                         cache_update_index=0)

        def step(token, cache, index):
            return layer(token, token, use_causal_mask=True, cache=cache,
                         cache_update_index=index)

        step = compiled(step)
        outputs = []
        for i in range(prompt, T):
            index = keras.ops.convert_to_tensor(i, dtype="int32")
            out, cache = step(x[:, i : i + 1], cache, index)
            outputs.append(to_numpy(out))
        np.testing.assert_allclose(np.concatenate(outputs, 1),
                                   full[:, prompt:], atol=2e-5, rtol=2e-5)

    def test_segments_and_bias_refused_with_cache(self, rng):
        x = _inputs(rng)[0][:, :4]
        layer = _layer(x, "plain", None)
        cache = layer.init_cache(B, 4)
        for name, value in (
            ("segment_ids", np.zeros((B, 4), "int32")),
            ("attention_bias", np.zeros((4, 4), "float32")),
        ):
            with pytest.raises(ValueError, match=f"`{name}` are not supported "
                               "with a cache"):
                layer(x, x, use_causal_mask=True, cache=cache,
                      cache_update_index=0, **{name: value})


class TestCompiledAndMixedPrecision:
    def test_compiled(self, rng):
        """Under `jax.jit` / `tf.function(jit_compile=True)`; eager on torch
        and NumPy (torch.compile is covered by test_behaviour's fit)."""
        x = _inputs(rng)[0]
        layer = _layer(x, "all", (5, 0))
        ids = _segments()

        def fn(x):
            return layer(x, x, use_causal_mask=True, segment_ids=ids)

        with dispatch.force_path("banded"):
            got = to_numpy(compiled(fn)(x))
        expected, _ = reference(layer, x, x, use_causal_mask=True,
                                segment_ids=ids)
        assert_close(got, expected, atol=2e-5, rtol=2e-5)

    def test_mixed_float16_does_not_overflow(self, rng):
        x = _inputs(rng)[0] * 30.0
        layer32 = _layer(x, "all", (5, 0))
        keras.config.set_dtype_policy("mixed_float16")
        layer16 = _layer(x, "all", (5, 0))
        layer16.set_weights(layer32.get_weights())
        for path in ("explicit", "fused", "banded"):
            got = _run(layer16, x, path, use_causal_mask=True)
            assert got.dtype == np.float16 and np.all(np.isfinite(got))
            want = _run(layer32, x, path, use_causal_mask=True)
            scale = np.abs(want).max()
            np.testing.assert_allclose(got / scale, want / scale, atol=6e-2)

    @pytest.mark.training
    def test_dropout(self, rng):
        x = _inputs(rng)[0]
        layer = make_layer(x, x, num_heads=N, key_dim=H, num_key_value_heads=K,
                           sliding_window=(5, 0), use_sinks=True,
                           use_alibi=True, attn_logits_soft_cap=2.0,
                           dropout=0.5)
        plain = _run(layer, x, "explicit", use_causal_mask=True)
        for path in ("explicit", "banded"):
            dropped = _run(layer, x, path, use_causal_mask=True, training=True)
            assert np.all(np.isfinite(dropped))
            assert not np.allclose(dropped, plain)


class TestConfig:
    def test_round_trip(self, rng, tmp_path):
        x = _inputs(rng)[0]
        layer = _layer(x, "all", (5, 2))
        config = layer.get_config()
        assert config["sliding_window"] == (5, 2)
        assert config["use_sinks"] and config["use_alibi"]
        clone = keras_mha.MultiHeadAttention.from_config(config)
        assert isinstance(clone.rotary_embedding, keras_mha.RotaryEmbedding)
        assert clone.get_config() == config
        inputs = keras.Input((T, E))
        model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
        path = str(tmp_path / "features.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(
            to_numpy(loaded(x)), to_numpy(model(x)), atol=1e-6
        )
        restored = loaded.layers[-1]
        assert restored.sliding_window == (5, 2)
        np.testing.assert_allclose(to_numpy(restored.sinks),
                                   to_numpy(layer.sinks))

    def test_grouped_query_attention_takes_the_features(self, rng):
        x = _inputs(rng)[0]
        layer = keras_mha.GroupedQueryAttention(
            head_dim=H, num_query_heads=N, num_key_value_heads=K,
            use_sinks=True, use_alibi=True, attn_logits_soft_cap=2.0,
            scale=0.4, sliding_window=(3, 1),
            rotary_embedding=keras_mha.RotaryEmbedding(),
        )
        layer(x, x)
        clone = keras_mha.GroupedQueryAttention.from_config(layer.get_config())
        clone(x, x)
        clone.set_weights(layer.get_weights())
        np.testing.assert_allclose(to_numpy(clone(x, x)), to_numpy(layer(x, x)),
                                   atol=1e-6)
        assert [w.path.split("/")[-1] for w in layer.weights][-1] == "sinks"


class TestErrors:
    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"attn_logits_soft_cap": 0.0}, "attn_logits_soft_cap=0.0"),
            ({"attn_logits_soft_cap": -1}, "attn_logits_soft_cap=-1"),
            ({"scale": 0}, "scale=0"),
            ({"scale": "big"}, "scale='big'"),
            ({"sliding_window": (3,)}, r"sliding_window=\(3,\)"),
            ({"sliding_window": (-1, 2)}, r"sliding_window=\(-1, 2\)"),
            ({"sliding_window": (1, 2, 3)}, r"sliding_window=\(1, 2, 3\)"),
            ({"sliding_window": 0}, "sliding_window=0"),
            ({"alibi_before_scale": True},
             "alibi_before_scale=True, use_alibi=False"),
            ({"differential": 1.0}, "differential=1.0"),
            ({"differential": -0.1}, r"differential=-0.1"),
            ({"differential": "0.5"}, "differential='0.5'"),
            ({"differential": 0.5, "num_heads": 3},
             "num_heads=3, differential=0.5"),
            ({"differential": 0.5, "use_gate": True},
             "differential=0.5, use_gate=True"),
            ({"differential": 0.5,
              "output_norm": keras.layers.RMSNormalization()},
             "differential=0.5, output_norm="),
            ({"differential": 0.5, "differential_epsilon": 0},
             "differential_epsilon=0"),
        ],
    )
    def test_constructor_values(self, kwargs, match):
        kwargs = {"num_heads": 2, **kwargs}
        with pytest.raises(ValueError, match=match):
            keras_mha.MultiHeadAttention(key_dim=4, **kwargs)

    @pytest.mark.parametrize("name", ["use_sinks", "use_alibi",
                                      "alibi_before_scale",
                                      "use_query_scale"])
    @pytest.mark.parametrize("value", [1, "yes", None])
    def test_flags_must_be_bool(self, name, value):
        with pytest.raises(TypeError, match=f"`{name}`.*Received: {name}="):
            keras_mha.MultiHeadAttention(num_heads=2, key_dim=4,
                                         **{name: value})

    def test_rotary_must_be_a_layer(self):
        with pytest.raises(TypeError, match="rotary_embedding=10000"):
            keras_mha.MultiHeadAttention(num_heads=2, key_dim=4,
                                         rotary_embedding=10000)

    @pytest.mark.parametrize(
        "kwargs, error, match",
        [
            ({"segment_ids": np.zeros((B, T), "float32")}, TypeError,
             "segment_ids.dtype=float32"),
            ({"segment_ids": np.zeros((B, T + 1), "int32")}, ValueError,
             r"segment_ids.shape=\(2, 25\)"),
            ({"segment_ids": np.zeros((B,), "int32")}, ValueError,
             r"segment_ids.shape=\(2,\)"),
            ({"key_segment_ids": np.zeros((B, T), "int32")}, ValueError,
             "needs `segment_ids`"),
            ({"attention_bias": np.zeros((3, T, T), "float32")}, ValueError,
             r"attention_bias.shape=\(3, 24, 24\)"),
            ({"attention_bias": np.zeros((T, T + 1), "float32")}, ValueError,
             r"attention_bias.shape=\(24, 25\)"),
            ({"attention_bias": np.zeros((T, T), bool)}, TypeError,
             "attention_bias.dtype=bool"),
        ],
    )
    def test_call_arguments(self, rng, kwargs, error, match):
        x = _inputs(rng)[0]
        layer = _layer(x, "plain", None)
        with pytest.raises(error, match=match):
            layer(x, x, **kwargs)

    def test_cross_attention_needs_key_segment_ids(self, rng):
        x = _inputs(rng)[0]
        layer = make_layer(x, x[:, :10], num_heads=2, key_dim=4)
        with pytest.raises(ValueError, match="key_segment_ids"):
            layer(x, x[:, :10], segment_ids=_segments())

    def test_checked_in_functional_models(self):
        inputs = keras.Input((T, E))
        ids = keras.Input((T,), dtype="float32")
        layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
        with pytest.raises(TypeError, match="segment_ids.dtype=float32"):
            layer(inputs, inputs, segment_ids=ids)
