"""Chunked attention (`attention_chunk_size=C`, Llama 4): key `j` is
visible from position `p` iff `j // C == p // C`, ANDed with every other
mask, on every path, in the cache and under compilation, against the
float64 reference (`reference.py`).

One input shape for the whole module, `test_features.py`'s (JAX compiles
per shape): `B = 2`, `T = S = 24`, `E = 16`, 6 query heads over 2
key/value heads of 8; chunks of 5 cut the blocks of 8 of the blocked
path and the decode steps.
"""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from util import assert_close
from util import compiled
from util import layer_gradients
from util import make_layer
from util import reference
from util import to_numpy

import keras_mha
from keras_mha.attention import dispatch
from keras_mha.attention import tuning
from keras_mha.attention.spec import AttentionSpec

B, T, E, N, K, H = 2, 24, 16, 6, 2, 8
C = 5

# (use_causal_mask, sliding_window) and the paths that can serve them.
MASKS = {
    "causal": (True, None, ("explicit", "fused", "banded", "blocked",
                            "triangular")),
    "bidirectional": (False, None, ("explicit", "fused", "banded")),
    "causal_window": (True, (3, 0), ("explicit", "fused", "banded")),
    "asymmetric_window": (False, (4, 2), ("explicit", "fused", "banded")),
}


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setitem(tuning.OVERRIDES, "blocked_block", 8)
    monkeypatch.setitem(tuning.OVERRIDES, "decode_block", 8)


def _x(rng):
    return rng.normal(size=(B, T, E)).astype("float32")


def _layer(x, window=None, chunk=C, **kwargs):
    return make_layer(x, x, num_heads=N, key_dim=H, num_key_value_heads=K,
                      sliding_window=window, attention_chunk_size=chunk,
                      **kwargs)


def _run(layer, x, path, **kwargs):
    with dispatch.force_path(path):
        return to_numpy(layer(x, x, **kwargs))


class TestAgainstReference:
    @pytest.mark.parametrize("masks", list(MASKS))
    def test_every_path(self, rng, masks):
        causal, window, paths = MASKS[masks]
        x = _x(rng)
        layer = _layer(x, window)
        expected, _ = reference(layer, x, x, use_causal_mask=causal)
        for path in paths:
            assert_close(_run(layer, x, path, use_causal_mask=causal),
                         expected, atol=2e-5, rtol=2e-5)

    def test_with_padding_segments_and_features(self, rng):
        """Every other mask and the logit features, ANDed with chunks."""
        x = _x(rng)
        layer = _layer(x, use_sinks=True, use_alibi=True,
                       attn_logits_soft_cap=3.0,
                       rotary_embedding=keras_mha.RotaryEmbedding(100))
        layer.sinks.assign(np.linspace(-1.0, 2.0, N).astype("float32"))
        mask = np.ones((B, T), bool)
        mask[1, :7] = False  # a chunk and a bit of left padding
        ids = np.zeros((B, T), "int32")
        ids[0, 12:] = 1
        kwargs = dict(use_causal_mask=True, query_mask=mask, value_mask=mask,
                      segment_ids=ids)
        expected, _ = reference(layer, x, x, **kwargs)
        for path in MASKS["causal"][2]:
            got = _run(layer, x, path, **kwargs)
            assert np.all(np.isfinite(got))
            assert_close(got, expected, atol=2e-5, rtol=2e-5)

    def test_scores(self, rng):
        """The returned weights are block diagonal inside the causal
        triangle."""
        x = _x(rng)
        layer = _layer(x)
        _, scores = layer(x, x, use_causal_mask=True,
                          return_attention_scores=True)
        _, expected = reference(layer, x, x, use_causal_mask=True)
        assert_close(scores, expected)
        p, j = np.arange(T)[:, None], np.arange(T)[None, :]
        outside = (j > p) | (j // C != p // C)
        assert np.all(to_numpy(scores)[..., outside] == 0)


class TestDispatch:
    def test_long_chunked_causal_calls_go_to_banded(self):
        """A band of width `C`: `banded` from `S >= 4·C` and `S >= 256`
        (`banded_min_ratio`, `banded_min_length`), on every platform."""
        layer = keras_mha.MultiHeadAttention(num_heads=N, key_dim=H,
                                             attention_chunk_size=128)
        for length, path in ((512, "banded"), (511, None)):
            got = layer.attention_path((B, length, E), (B, length, E),
                                       use_causal_mask=True)
            assert (got == "banded") == (path == "banded"), (length, got)
        spec = AttentionSpec(scale=0.1, causal=True, chunk=128)
        shapes = dispatch.Shapes(16384, 16384, H, H, B, N)
        for platform in ("cpu", "gpu", "tpu"):
            assert dispatch.choose_path(spec, shapes, platform=platform) == (
                "banded")
        # Keras's layer has no chunks: neither its fused kernel nor JAX's
        # window serves them.
        windowed = spec.replace(window=(127, 0))
        assert not dispatch.keras_would_fuse(windowed, shapes)
        assert not dispatch.can_serve("fused_window", windowed, shapes, "jax")

    def test_reach(self):
        """The band a chunk needs: `(C - 1, C - 1)`, right 0 with causal,
        the narrower side of a window too."""
        spec = AttentionSpec(scale=1.0, chunk=8)
        assert spec.reach == (7, 7)
        assert spec.replace(causal=True).reach == (7, 0)
        assert spec.replace(window=(3, 20)).reach == (3, 7)
        assert spec.replace(chunk=None, window=(3, 20)).reach == (3, 20)


@pytest.mark.training
class TestGradients:
    def test_paths_agree(self, rng):
        """The blocked path's custom gradient skips the blocks outside the
        chunks; the band's autodiff."""
        x = _x(rng)
        layer = _layer(x, use_sinks=True, attn_logits_soft_cap=3.0)
        ids = np.zeros((B, T), "int32")
        ids[1, 9:] = 1
        grads = {}
        for path in ("explicit", "banded", "blocked"):
            with dispatch.force_path(path):
                grads[path] = layer_gradients(layer, x, x, use_causal_mask=True,
                                              segment_ids=ids)
        names = ["query", "value"] + [w.path for w in layer.trainable_variables]
        for path in ("banded", "blocked"):
            for name, got, want in zip(names, grads[path], grads["explicit"]):
                np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4,
                                           err_msg=f"{path}: {name}")


def _decode_equals_full_pass(x, layer, slots):
    """A rolling cache of `slots`: one call, single tokens and several at
    once, across chunk boundaries, give the full pass."""
    full = to_numpy(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(B, 12)
    assert [part.shape[1] for part in cache] == [slots] * 3
    outputs = []
    for start, stop in ((0, 4), (4, 5), (5, 8), (8, 9), (9, 10), (10, 12)):
        token = x[:, start:stop]
        out, cache = layer(token, token, use_causal_mask=True, cache=cache,
                           cache_update_index=start)
        outputs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outputs, 1), full, atol=2e-5,
                               rtol=2e-5)


@pytest.mark.usefixtures("decode_implementation")
def test_rolling_cache_of_chunk_slots(rng):
    """`C` slots, on each implementation of the steps."""
    x = _x(rng)[:, :12]
    _decode_equals_full_pass(x, _layer(x, use_sinks=True), C)


class TestDecoding:
    @pytest.mark.parametrize("window, slots", [((7, 0), C), ((2, 0), 3)],
                             ids=["wider_window", "narrower_window"])
    def test_rolling_cache_with_a_window(self, rng, window, slots):
        """`min(left + 1, C)` slots."""
        x = _x(rng)[:, :12]
        _decode_equals_full_pass(x, _layer(x, window), slots)

    def test_cached_layer_full_cache(self, rng):
        """keras-hub's cache, a slot per position: the chunks mask the
        earlier chunks' slots."""
        x = _x(rng)
        layer = keras_mha.CachedMultiHeadAttention(
            num_heads=N, key_dim=H, num_key_value_heads=K,
            attention_chunk_size=C)
        layer.build(x.shape, x.shape)
        twin = _layer(x)
        layer.set_weights(twin.get_weights())
        full = to_numpy(twin(x, x, use_causal_mask=True))
        causal = np.tril(np.ones((T, T), bool))
        cache = layer.init_cache(B, T)
        out, cache = layer(x[:, :7], x[:, :7], cache=cache,
                           cache_update_index=0, attention_mask=causal[:7])
        outputs = [to_numpy(out)]
        for i in range(7, T):
            out, cache = layer(x[:, i:i + 1], x[:, i:i + 1], cache=cache,
                               cache_update_index=i,
                               attention_mask=causal[i:i + 1])
            outputs.append(to_numpy(out))
        np.testing.assert_allclose(np.concatenate(outputs, 1), full,
                                   atol=2e-5, rtol=2e-5)


class TestCompiledAndMixedPrecision:
    def test_compiled(self, rng):
        """The band and the blocked loops under `jax.jit` and
        `tf.function(jit_compile=True)`, the layer whole; under
        `torch.compile`, the fused path's attention alone, the chunks'
        mask in its graph (Dynamo takes minutes over a whole layer here,
        and unrolls the loops of the band and the blocks)."""
        x = _x(rng)
        layer = _layer(x)
        expected, _ = reference(layer, x, x, use_causal_mask=True)
        if BACKEND == "torch":
            import torch

            from keras_mha.attention import attend

            q, k, v = (keras.ops.convert_to_tensor(
                rng.normal(size=(B, T, heads, H)).astype("float32"))
                for heads in (N, K, K))
            spec = AttentionSpec(scale=0.3, causal=True, chunk=C)
            with dispatch.force_path("explicit"):
                want = to_numpy(attend(q, k, v, spec)[0])
            with dispatch.force_path("fused"):
                run = torch.compile(lambda *heads: attend(*heads, spec)[0],
                                    backend="aot_eager")
                np.testing.assert_allclose(to_numpy(run(q, k, v)), want,
                                           atol=2e-5, rtol=2e-5)
            return
        for path in ("banded", "blocked"):
            with dispatch.force_path(path):
                got = compiled(lambda q: layer(q, q, use_causal_mask=True))(
                    keras.ops.convert_to_tensor(x))
            assert_close(got, expected, atol=2e-5, rtol=2e-5)

    def test_compiled_steps_with_tensor_index(self, rng):
        """Steps over the rolling cache, compiled with a tensor index
        (`jax.jit`, `tf.function(jit_compile=True)`; eager elsewhere)."""
        x = _x(rng)[:, :12]
        layer = _layer(x)

        def step(token, cache, index):
            return layer(token, token, use_causal_mask=True, cache=cache,
                         cache_update_index=index)

        step = compiled(step)
        cache = layer.init_cache(B, 12)
        outputs = []
        for i in range(12):
            index = keras.ops.convert_to_tensor(i, dtype="int32")
            out, cache = step(x[:, i : i + 1], cache, index)
            outputs.append(to_numpy(out))
        np.testing.assert_allclose(
            np.concatenate(outputs, 1),
            to_numpy(layer(x, x, use_causal_mask=True)), atol=2e-5, rtol=2e-5)

    def test_mixed_bfloat16(self, rng):
        x = _x(rng)
        layer32 = _layer(x)
        keras.config.set_dtype_policy("mixed_bfloat16")
        layer16 = _layer(x)
        layer16.set_weights(layer32.get_weights())
        want, _ = reference(layer32, x, x, use_causal_mask=True)
        scale = np.abs(want).max()
        for path in ("banded", "blocked", "fused"):
            got = _run(layer16, x, path, use_causal_mask=True)
            assert np.all(np.isfinite(got.astype("float32")))
            np.testing.assert_allclose(got.astype("float32") / scale,
                                       want / scale, atol=3e-2)


class TestConfigAndErrors:
    def test_round_trip(self, rng):
        x = _x(rng)
        layer = keras_mha.GroupedQueryAttention(
            head_dim=H, num_query_heads=N, num_key_value_heads=K,
            attention_chunk_size=C, sliding_window=7)
        layer(x, x)
        config = layer.get_config()
        assert config["attention_chunk_size"] == C
        clone = keras_mha.GroupedQueryAttention.from_config(config)
        assert clone.get_config() == config
        assert clone.attention_chunk_size == C

    @pytest.mark.parametrize("value", [0, -3, 2.5, True, "8"])
    def test_bad_values(self, value):
        with pytest.raises(ValueError, match="attention_chunk_size="):
            keras_mha.MultiHeadAttention(num_heads=2, key_dim=4,
                                         attention_chunk_size=value)

    def test_needs_one_attention_axis(self):
        with pytest.raises(ValueError, match="`attention_chunk_size` needs a "
                           "single attention axis"):
            keras_mha.MultiHeadAttention(num_heads=2, key_dim=4,
                                         attention_axes=(1, 2),
                                         attention_chunk_size=4)
