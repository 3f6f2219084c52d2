"""Grouped heads and decoding with a KV cache (full and rolling)."""

import re

import keras
import numpy as np
import pytest
from conftest import BACKEND
from reference import layer_weights
from reference import reference_attention
from util import assert_close
from util import compiled
from util import make_layer
from util import random_inputs
from util import to_numpy

import keras_mha
from keras_mha.attention import tuning


def _decode(layers, x, prompt_length, prompt_mask=None, chunk=1):
    """Prefills `x[:, :prompt_length]`, then feeds the rest `chunk` at a time
    through a stack of layers with residual connections, each with a cache.
    Returns the outputs of the last layer for every position."""
    batch, length, _ = x.shape
    caches = [layer.init_cache(batch, length) for layer in layers]
    outputs = []
    start = 0
    while start < length:
        stop = prompt_length if start == 0 else min(start + chunk, length)
        h = x[:, start:stop]
        mask = None if prompt_mask is None or start else prompt_mask
        for i, layer in enumerate(layers):
            out, caches[i] = layer(
                h, h, query_mask=mask, value_mask=mask, use_causal_mask=True,
                cache=caches[i], cache_update_index=start,
            )
            h = keras.ops.add(h, out)
        outputs.append(to_numpy(h))
        start = stop
    return np.concatenate(outputs, axis=1), caches


def _full(layers, x, mask=None):
    h = x
    for layer in layers:
        h = keras.ops.add(h, layer(h, h, query_mask=mask, value_mask=mask,
                      use_causal_mask=True))
    return to_numpy(h)


def _stack(x, window, num_kv_heads, count=2):
    return [
        make_layer(x, x, seed=i, num_heads=4, key_dim=4,
                   num_key_value_heads=num_kv_heads, sliding_window=window)
        for i in range(count)
    ]


class TestGroupedHeads:
    @pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
    @pytest.mark.parametrize("window", [None, 2])
    @pytest.mark.parametrize("scores", [False, True])
    def test_against_reference(self, rng, num_kv_heads, window, scores):
        query, value = random_inputs(rng, query_length=5, key_length=6)
        layer = make_layer(query, value, num_heads=4, key_dim=3,
                           num_key_value_heads=num_kv_heads,
                           sliding_window=window)
        assert layer.key_dense.kernel.shape == (8, num_kv_heads, 3)
        result = layer(query, value, use_causal_mask=True,
                       return_attention_scores=scores)
        expected, probs = reference_attention(
            layer_weights(layer), query, value, use_causal_mask=True,
            sliding_window=window,
        )
        if scores:
            assert_close(result[1], probs)
            result = result[0]
        assert_close(result, expected)

    @pytest.mark.parametrize("num_kv_heads", [2, 1])
    @pytest.mark.parametrize("causal", [False, True])
    def test_same_as_keras_group_query_attention(self, rng, num_kv_heads,
                                                 causal):
        query, value = random_inputs(rng, query_length=5, key_length=5)
        theirs = keras.layers.GroupQueryAttention(
            head_dim=3, num_query_heads=4, num_key_value_heads=num_kv_heads,
            use_gate=True, bias_initializer="random_normal",
        )
        ours = keras_mha.GroupedQueryAttention(
            head_dim=3, num_query_heads=4, num_key_value_heads=num_kv_heads,
            use_gate=True,
        )
        theirs(query, value)
        ours(query, value)
        ours.set_weights(theirs.get_weights())
        for scores in (False, True):
            a = ours(query, value, use_causal_mask=causal,
                     return_attention_scores=scores)
            b = theirs(query, value, use_causal_mask=causal,
                       return_attention_scores=scores)
            if scores:
                assert_close(a[1], to_numpy(b[1]).astype("float64"))
                a, b = a[0], b[0]
            assert_close(a, to_numpy(b).astype("float64"))

    def test_config(self):
        layer = keras_mha.GroupedQueryAttention(
            head_dim=8, num_query_heads=6, num_key_value_heads=2,
            sliding_window=4,
        )
        config = layer.get_config()
        assert config["head_dim"] == 8 and config["num_query_heads"] == 6
        assert "num_heads" not in config
        clone = keras_mha.GroupedQueryAttention.from_config(config)
        assert clone.get_config() == config
        assert keras.saving.get_registered_name(
            keras_mha.GroupedQueryAttention
        ) == "keras_mha>GroupedQueryAttention"

    def test_heads_must_divide(self):
        with pytest.raises(ValueError, match="num_key_value_heads=4"):
            keras_mha.GroupedQueryAttention(
                head_dim=2, num_query_heads=6, num_key_value_heads=4
            )


@pytest.mark.usefixtures("decode_implementation")
class TestDecoding:
    @pytest.mark.parametrize("window", [None, 3])
    @pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
    def test_prefill_then_token_by_token(self, rng, window, num_kv_heads):
        x = rng.normal(size=(2, 9, 8)).astype("float32")
        layers = _stack(x, window, num_kv_heads)
        decoded, caches = _decode(layers, x, prompt_length=5)
        np.testing.assert_allclose(decoded, _full(layers, x), atol=1e-5, rtol=1e-5)
        slots = window or 9
        keys, values, valid = caches[0]
        assert tuple(keys.shape) == (2, slots, num_kv_heads, 4)
        assert tuple(values.shape) == (2, slots, num_kv_heads, 4)
        assert tuple(valid.shape) == (2, slots)
        assert keras.backend.standardize_dtype(valid.dtype) == "bool"

    @pytest.mark.parametrize("window", [None, 2])
    def test_chunks(self, rng, window):
        x = rng.normal(size=(1, 10, 8)).astype("float32")
        layers = _stack(x, window, 2)
        decoded, _ = _decode(layers, x, prompt_length=3, chunk=4)
        np.testing.assert_allclose(decoded, _full(layers, x), atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("window", [None, 3])
    def test_left_padded_prompts(self, rng, window):
        x = rng.normal(size=(3, 8, 8)).astype("float32")
        prompt_mask = np.ones((3, 4), bool)
        prompt_mask[1, :2] = False  # two pads before a prompt of two
        prompt_mask[2, :1] = False
        full_mask = np.concatenate([prompt_mask, np.ones((3, 4), bool)], 1)
        layers = _stack(x, window, 2)
        decoded, _ = _decode(layers, x, prompt_length=4,
                             prompt_mask=prompt_mask)
        expected = _full(layers, x, mask=full_mask)
        np.testing.assert_allclose(decoded, expected, atol=1e-5, rtol=1e-5)

    @pytest.mark.skipif(BACKEND != "torch", reason="torch's native step")
    def test_long_torch_steps_read_the_slots_in_chunks(self, rng,
                                                       monkeypatch):
        # Chunks of 2 slots from 4 slots on: the left padding masks whole
        # chunks (their outputs drop out of the merge), the last chunk is
        # short.
        import torch

        from keras_mha.attention import decode
        from keras_mha.attention import decode_kernels as kernels

        monkeypatch.setitem(tuning.OVERRIDES, "decode_chunk", 2)
        monkeypatch.setitem(tuning.OVERRIDES, "decode_chunked_from", 4)
        calls = []
        chunked = kernels._chunked_step
        monkeypatch.setattr(kernels, "_chunked_step", lambda *args: (
            calls.append(args[1].shape[2]) or chunked(*args)))
        x = rng.normal(size=(1, 12, 8)).astype("float32")
        prompt_mask = np.ones((1, 6), bool)
        prompt_mask[0, :5] = False  # one real token after five pads
        full_mask = np.concatenate([prompt_mask, np.ones((1, 6), bool)], 1)
        layers = _stack(x, None, 2)
        with torch.no_grad(), decode.force_implementation("native"):
            # as `predict` runs: nothing to differentiate
            decoded, _ = _decode(layers, x, prompt_length=6,
                                 prompt_mask=prompt_mask)
        expected = _full(layers, x, mask=full_mask)
        np.testing.assert_allclose(decoded[:, 5:], expected[:, 5:],
                                   atol=1e-5, rtol=1e-5)
        assert 7 in calls and 11 in calls  # odd: a short last chunk

    def test_rolling_cache_does_not_grow(self):
        layer = keras_mha.MultiHeadAttention(
            num_heads=4, key_dim=8, value_dim=6, num_key_value_heads=2,
            sliding_window=16,
        )
        for max_length in (8, 1024, 65536):
            shapes = [tuple(x.shape) for x in layer.init_cache(3, max_length)]
            assert shapes == [(3, 16, 2, 8), (3, 16, 2, 6), (3, 16)]
        full = keras_mha.MultiHeadAttention(num_heads=4, key_dim=8)
        shapes = [tuple(x.shape) for x in full.init_cache(1, 100)]
        assert shapes == [(1, 100, 4, 8), (1, 100, 4, 8), (1, 100)]

    def test_scores_cover_old_slots_then_new_tokens(self, rng):
        x = rng.normal(size=(1, 4, 8)).astype("float32")
        layer = make_layer(x, x, num_heads=2, key_dim=4, sliding_window=3)
        cache = layer.init_cache(1, 4)
        _, cache = layer(x[:, :3], x[:, :3], use_causal_mask=True,
                         cache=cache, cache_update_index=0)
        _, scores, _ = layer(x[:, 3:], x[:, 3:], use_causal_mask=True,
                             cache=cache, cache_update_index=3,
                             return_attention_scores=True)
        scores = to_numpy(scores)
        assert scores.shape == (1, 2, 1, 4)
        # Position 3 sees positions 1, 2 (slots 1, 2) and itself; slot 0
        # holds position 0, outside the window.
        np.testing.assert_array_equal(scores[..., 0], 0.0)
        np.testing.assert_allclose(scores.sum(-1), 1.0, atol=1e-6)

    def test_eager_steps_write_in_place(self, rng):
        """An eager step writes its slots into an in-place cache
        (`init_cache(..., in_place=True)`): torch and TensorFlow return its
        tensors, JAX donates them; under a TensorFlow gradient tape the
        write is a copy."""
        x = rng.normal(size=(1, 5, 8)).astype("float32")
        layer = make_layer(x, x, num_heads=2, key_dim=4)
        _, cache = layer(x[:, :3], x[:, :3], use_causal_mask=True,
                         cache=layer.init_cache(1, 5, in_place=True),
                         cache_update_index=0)

        def step(cache, index):
            return layer(x[:, index : index + 1], x[:, index : index + 1],
                         use_causal_mask=True, cache=cache,
                         cache_update_index=index)[1]

        written = step(cache, 3)
        assert isinstance(written, tuple) and len(written) == 3
        for new, old in zip(written, cache):
            if BACKEND in ("torch", "tensorflow"):
                assert new is old
            elif BACKEND == "jax":
                assert old.is_deleted()
        flags = to_numpy(written[2])[0]
        np.testing.assert_array_equal(flags, [1, 1, 1, 1, 0])
        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape():
                copied = step(written, 4)
            assert all(new is not old for new, old in zip(copied, written))
            np.testing.assert_array_equal(to_numpy(written[2])[0], flags)
            np.testing.assert_array_equal(to_numpy(copied[2])[0], 1)

    def test_compiled_step_with_tensor_index(self, rng):
        """A decode step with a tensor index, compiled where the backend can
        (jax.jit, tf.function with XLA); eager on torch and NumPy."""
        x = rng.normal(size=(2, 6, 8)).astype("float32")
        layer = make_layer(x, x, num_heads=2, key_dim=4, sliding_window=4)

        def step(token, cache, index):
            return layer(token, token, use_causal_mask=True, cache=cache,
                         cache_update_index=index)

        step = compiled(step)
        cache = layer.init_cache(2, 6)
        outputs = []
        for i in range(6):
            index = keras.ops.convert_to_tensor(i, dtype="int32")
            out, cache = step(x[:, i : i + 1], cache, index)
            outputs.append(to_numpy(out))
        np.testing.assert_allclose(
            np.concatenate(outputs, 1),
            to_numpy(layer(x, x, use_causal_mask=True)),
            atol=1e-5,
        )


def test_force_implementation(rng):
    """`decode.force_implementation` holds the eager steps inside its
    block, the innermost block first: the native route and the portable
    loop give the same steps, a value it does not know is refused by
    name, and the native route where the backend has none, at the step.
    (On JAX the portable loop's eager run is left out, as in
    `conftest._decode_implementations`.)"""
    from keras_mha.attention import decode

    with pytest.raises(ValueError, match="implementation='fast'"):
        with decode.force_implementation("fast"):
            pass
    x = rng.normal(size=(2, 9, 8)).astype("float32")
    layers = _stack(x, None, 2)
    expected = _full(layers, x)
    with decode.force_implementation(decode.PORTABLE):
        with decode.force_implementation(decode.NATIVE):
            if decode.native_available():
                decoded, _ = _decode(layers, x, prompt_length=5)
                assert_close(decoded, expected)
            else:
                with pytest.raises(ValueError, match="exists only on"):
                    _decode(layers, x, prompt_length=5)
        if BACKEND != "jax":
            decoded, _ = _decode(layers, x, prompt_length=5)
            assert_close(decoded, expected)


class TestCacheErrors:
    def _layer(self, rng, **kwargs):
        x = rng.normal(size=(2, 3, 8)).astype("float32")
        return x, make_layer(x, x, num_heads=2, key_dim=4, **kwargs)

    def test_needs_causal(self, rng):
        x, layer = self._layer(rng)
        with pytest.raises(ValueError, match="use_causal_mask"):
            layer(x, x, cache=layer.init_cache(2, 8), cache_update_index=0)

    def test_needs_both_arguments(self, rng):
        x, layer = self._layer(rng)
        with pytest.raises(ValueError, match="cache_update_index=None"):
            layer(x, x, use_causal_mask=True, cache=layer.init_cache(2, 8))
        with pytest.raises(ValueError, match="cache=None"):
            layer(x, x, use_causal_mask=True, cache_update_index=0)

    def test_one_tensor_is_not_a_cache(self, rng):
        """The layout before `(keys, values, valid)`: one tensor."""
        x, layer = self._layer(rng)
        with pytest.raises(TypeError, match=r"\(keys, values, valid\).*"
                           r"Received: cache.shape=\(2, 8, 2, 9\)"):
            layer(x, x, use_causal_mask=True,
                  cache=np.zeros((2, 8, 2, 9), "float32"),
                  cache_update_index=0)

    @pytest.mark.parametrize("part, shape", [
        (0, (2, 8, 3, 4)), (0, (3, 8, 2, 4)), (1, (2, 8, 2, 5)),
        (1, (2, 7, 2, 4)), (2, (2, 7)), (2, (2, 8, 1)),
    ])
    def test_wrong_shape(self, rng, part, shape):
        x, layer = self._layer(rng)
        cache = list(layer.init_cache(2, 8))
        cache[part] = np.zeros(shape, "bool" if part == 2 else "float32")
        with pytest.raises(ValueError, match=rf"Received: cache\[{part}\]"
                           r"\.shape=" + re.escape(str(shape))):
            layer(x, x, use_causal_mask=True, cache=tuple(cache),
                  cache_update_index=0)

    @pytest.mark.parametrize("part, dtype", [(0, "int32"), (1, "bool"),
                                             (2, "float32")])
    def test_wrong_dtype(self, rng, part, dtype):
        x, layer = self._layer(rng)
        cache = list(layer.init_cache(2, 8))
        cache[part] = np.zeros(tuple(cache[part].shape), dtype)
        with pytest.raises(TypeError,
                           match=rf"cache\[{part}\].dtype={dtype}"):
            layer(x, x, use_causal_mask=True, cache=tuple(cache),
                  cache_update_index=0)

    def test_rolling_cache_must_have_window_slots(self, rng):
        x, layer = self._layer(rng, sliding_window=4)
        cache = make_layer(x, x, num_heads=2, key_dim=4).init_cache(2, 8)
        with pytest.raises(ValueError, match=r"cache\[0\]\.shape=\(2, 8,"):
            layer(x, x, use_causal_mask=True, cache=cache,
                  cache_update_index=0)

    @pytest.mark.parametrize("index", [-1, 6])
    @pytest.mark.parametrize("as_tensor", [False, True])
    def test_index_out_of_range(self, rng, index, as_tensor):
        """Eager calls check a tensor index as they check an int."""
        x, layer = self._layer(rng)
        if as_tensor:
            index = keras.ops.convert_to_tensor(index, dtype="int32")
        with pytest.raises(ValueError, match=r"cache_update_index=(-1|6)\b"):
            layer(x, x, use_causal_mask=True, cache=layer.init_cache(2, 8),
                  cache_update_index=index)

    def test_more_tokens_than_slots(self, rng):
        """More new tokens than a full cache has slots fit at no index: a
        `ValueError` even when the index is traced."""
        x, layer = self._layer(rng)

        def step(token, cache, index):
            return layer(token, token, use_causal_mask=True, cache=cache,
                         cache_update_index=index)

        index = keras.ops.convert_to_tensor(0, "int32")
        for run in (step, compiled(step)):
            with pytest.raises(ValueError, match=r"3 new tokens .* 2 slots.*"
                               r"Received: key.shape\[1\]=3"):
                run(x, layer.init_cache(2, 2), index)

    def test_traced_index_out_of_range_writes_nothing(self, rng):
        """Under `jax.jit` / `tf.function(jit_compile=True)` no error can be
        raised: the write is dropped (never a clamped slot), the same on
        every backend. Eager elsewhere, where the check above raises."""
        x, layer = self._layer(rng)
        if BACKEND not in ("jax", "tensorflow"):
            pytest.skip("traces on jax and tf")

        def step(token, cache, index):
            return layer(token, token, use_causal_mask=True, cache=cache,
                         cache_update_index=index)

        step = compiled(step)
        cache = layer.init_cache(2, 8)
        _, cache = step(x[:, :1], cache, keras.ops.convert_to_tensor(0, "int32"))
        before = [to_numpy(part) for part in cache]
        for index in (8, 100, -3):
            _, after = step(x[:, 1:2], cache,
                            keras.ops.convert_to_tensor(index, "int32"))
            for new, old in zip(after, before):
                np.testing.assert_array_equal(to_numpy(new), old)

    def test_attention_mask_is_rejected(self, rng):
        x, layer = self._layer(rng)
        with pytest.raises(ValueError, match="attention_mask"):
            layer(x, x, use_causal_mask=True, cache=layer.init_cache(2, 8),
                  cache_update_index=0, attention_mask=np.ones((3, 3), bool))

    @pytest.mark.parametrize("args", [(0, 8), (2, 0), (2.0, 8)])
    def test_init_cache_arguments(self, rng, args):
        _, layer = self._layer(rng)
        with pytest.raises(ValueError, match="Received"):
            layer.init_cache(*args)


# Every rope type on heads of 4 (two pairs). The length-dependent types
# switch at 4 positions: the prompt of 5 is already beyond it, so every
# call of a decode takes the same side as the full pass.
ROPES = {
    "linear": dict(max_wavelength=100, scaling_factor=2.0),
    "interleaved": dict(max_wavelength=100, interleaved=True),
    # Llama 3.1's and gpt-oss's published parameters.
    "llama3": dict(rope_type="llama3", max_wavelength=500000,
                   scaling_factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0,
                   original_max_position_embeddings=8192),
    "yarn": dict(rope_type="yarn", max_wavelength=150000,
                 scaling_factor=32.0, truncate=False,
                 original_max_position_embeddings=4096),
    "longrope": dict(rope_type="longrope", max_wavelength=100,
                     scaling_factor=4.0, short_factor=[1.0, 1.5],
                     long_factor=[2.0, 6.0],
                     original_max_position_embeddings=4),
    "dynamic": dict(rope_type="dynamic", max_wavelength=100,
                    scaling_factor=3.0, original_max_position_embeddings=4),
}


def _rope_stack(x, rope, window, dtype=None, count=2):
    return [
        make_layer(x, x, seed=i, num_heads=4, key_dim=4,
                   num_key_value_heads=2, sliding_window=window, dtype=dtype,
                   rotary_embedding=keras_mha.RotaryEmbedding(**ROPES[rope]))
        for i in range(count)
    ]


class TestRopeTypes:
    """Decoding with every rope type, on full and rolling caches."""

    @pytest.mark.usefixtures("decode_implementation")
    @pytest.mark.parametrize("window", [None, 3])
    @pytest.mark.parametrize("rope", [r for r in ROPES if r != "dynamic"])
    def test_prefill_then_token_by_token(self, rng, rope, window):
        x = rng.normal(size=(2, 9, 8)).astype("float32")
        layers = _rope_stack(x, rope, window)
        decoded, _ = _decode(layers, x, prompt_length=5)
        # The outputs reach about 20 (two residual layers; YaRN's factor
        # sharpens the softmax): the two computations' float32 roundings
        # differ by up to 2e-5 there, about 1e-6 of the scale.
        np.testing.assert_allclose(decoded, _full(layers, x), atol=5e-5,
                                   rtol=1e-5)

    def test_dynamic_keeps_each_key_as_written(self, rng):
        """Dynamic NTK rotates a call with the base of its largest
        position: keys cached before the switch keep the rotation they
        were written with, and later steps attend to them so (as
        transformers' cache does). The cache holds exactly those keys; the
        result is not the full pass's, where every key has the last base."""
        x = rng.normal(size=(2, 9, 8)).astype("float32")
        layers = _rope_stack(x, "dynamic", None, count=1)
        layer = layers[0]
        decoded, caches = _decode(layers, x, prompt_length=3)
        keys = to_numpy(layer.key_dense(x))  # (B, S, K, H)
        rope = layer.rotary_embedding
        written = [to_numpy(rope(keys[:, :3], start_index=0))] + [
            to_numpy(rope(keys[:, j : j + 1], start_index=j))
            for j in range(3, 9)
        ]
        np.testing.assert_allclose(to_numpy(caches[0][0]),
                                   np.concatenate(written, 1), atol=1e-6)
        # The prompt is the full pass over the prompt alone (largest
        # position 2, below the switch); over all 9 tokens every key has
        # the base of position 8.
        np.testing.assert_allclose(decoded[:, :3], _full(layers, x[:, :3]),
                                   atol=1e-5, rtol=1e-5)
        assert not np.allclose(decoded[:, 1:], _full(layers, x)[:, 1:],
                               atol=1e-3)

    @pytest.mark.parametrize("rope", ["yarn", "longrope", "dynamic"])
    def test_compiled_steps_with_tensor_index(self, rng, rope):
        """Steps compiled once (jax.jit, tf.function with XLA; eager on
        torch and NumPy), the index a tensor: the same as eager steps,
        across the length-dependent types' switch."""
        x = rng.normal(size=(2, 6, 8)).astype("float32")
        layer = _rope_stack(x, rope, 4, count=1)[0]

        def step(token, cache, index):
            return layer(token, token, use_causal_mask=True, cache=cache,
                         cache_update_index=index)

        outputs = {}
        for name, run in (("eager", step), ("compiled", compiled(step))):
            cache = layer.init_cache(2, 6)
            outputs[name] = []
            for i in range(6):
                index = keras.ops.convert_to_tensor(i, dtype="int32")
                out, cache = run(x[:, i : i + 1], cache, index)
                outputs[name].append(to_numpy(out))
        np.testing.assert_allclose(np.concatenate(outputs["compiled"], 1),
                                   np.concatenate(outputs["eager"], 1),
                                   atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("rope", ["interleaved", "yarn", "longrope"])
    def test_mixed_precision(self, rng, rope):
        """`mixed_bfloat16`: decoding equals the full pass in that policy
        (the rotation itself is checked against float32 in
        `test_rotary.py`)."""
        x = rng.normal(size=(2, 9, 8)).astype("float32")
        layers = _rope_stack(x, rope, 3, dtype="mixed_bfloat16")
        decoded, _ = _decode(layers, x, prompt_length=5)
        assert np.isfinite(decoded).all()
        np.testing.assert_allclose(decoded, _full(layers, x), atol=5e-2,
                                   rtol=5e-2)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's native step")
@pytest.mark.parametrize("features", ["plain", "capped", "sinks_alibi"])
def test_torch_latent_step_is_the_fused_one(rng, features):
    """`latent_core` (latent attention's step: two products over the
    latents and the rope keys where they lie) against `decode_core`
    over the same slots as one key/value head, keys `[latent,
    rope_key]`, values the latents; with padding, one row with no key
    opened as `decode._native_step` opens it."""
    import torch

    from keras_mha.attention import decode_kernels as kernels

    batch, groups, t_len, slots, rank, rope = 2, 3, 2, 7, 5, 3

    def tensor(*shape):
        return torch.tensor(rng.normal(size=shape).astype("float32"))

    q = tensor(batch, 1, groups, t_len, rank + rope)
    latents = tensor(batch, slots + 2, rank)[:, :slots]  # a view
    rope_keys = tensor(batch, slots, rope)
    mask = torch.tensor(rng.random((batch, 1, 1, t_len, slots)) > 0.3)
    mask[0, ..., 0, :] = False
    mask[0, ..., 0, 1] = True  # a row with one key
    kwargs = {}
    if features == "capped":
        kwargs["soft_cap"] = 1.5
    if features == "sinks_alibi":
        kwargs["sinks"] = tensor(1, groups)
        kwargs["alibi"] = tensor(1, 1, groups, t_len, slots)
    out = kernels.latent_core(q, latents, rope_keys, mask, **kwargs)
    keys = torch.cat([latents, rope_keys], -1)[:, :, None]
    expected = kernels.decode_core(q, keys, latents[:, :, None], mask,
                                   **kwargs)
    assert tuple(out.shape) == (batch, 1, groups, t_len, rank)
    np.testing.assert_allclose(out.numpy(), expected.numpy(), atol=1e-5,
                               rtol=1e-5)
