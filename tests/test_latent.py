"""`MultiHeadLatentAttention`: the float64 reference of the paper
(`latent_reference.py`) on every path, both computations (expanded and
absorbed) forced and compared, decoding with the latent cache (full and
rolling, padding, tensor indices compiled once), config and `.keras` round
trips, and the named errors."""

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_mha
from keras_mha.attention import cache as cache_lib
from keras_mha.attention import decode
from keras_mha.attention import dispatch
from keras_mha.attention import latent as latent_lib
from latent_reference import latent_weights
from latent_reference import reference_latent_attention
from util import compiled
from util import rotary_reference_arguments
from util import to_numpy

# One geometry for the whole file (JAX compiles per shape): B, T, E.
BATCH, LENGTH, FEATURES = 2, 7, 8
SIZES = dict(num_heads=4, kv_lora_rank=8, qk_nope_head_dim=4,
             qk_rope_head_dim=4, v_head_dim=6)
ATOL = 2e-5


def make_latent(seed=0, **kwargs):
    """A built layer with random NumPy weights (`(B, T, E)` inputs). The
    initializers are zeros: random ones would compile a JAX kernel per
    shape."""
    config = {**SIZES, "kernel_initializer": "zeros",
              "bias_initializer": "zeros", **kwargs}
    layer = keras_mha.MultiHeadLatentAttention(**config)
    shape = (BATCH, LENGTH, FEATURES)
    layer.build(shape, shape)
    rng = np.random.default_rng(seed)
    layer.set_weights([
        rng.normal(scale=0.5, size=w.shape).astype("float32")
        for w in layer.get_weights()
    ])
    return layer


def reference(layer, x, **kwargs):
    rotary = layer.rotary_embedding
    if rotary is not None:
        kwargs["rotary"] = rotary_reference_arguments(
            rotary, layer.qk_rope_head_dim
        )
    kwargs.setdefault("sliding_window", layer.sliding_window)
    kwargs.setdefault("soft_cap", layer.attn_logits_soft_cap)
    return reference_latent_attention(
        latent_weights(layer), layer.get_config(), x, x, **kwargs
    )


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(BATCH, LENGTH, FEATURES)).astype("float32")


def padding():
    """Left padding in the second row."""
    mask = np.ones((BATCH, LENGTH), bool)
    mask[1, :2] = False
    return mask


def yarn():
    return keras_mha.RotaryEmbedding(
        rope_type="yarn", scaling_factor=4.0, max_wavelength=100.0,
        original_max_position_embeddings=8, interleaved=True,
    )


CASES = {
    # name: (layer arguments, call arguments)
    "attention_mask": (dict(), dict(attention_mask=True)),
    "causal_rope_q_lora": (
        dict(q_lora_rank=5, rotary_embedding=keras_mha.RotaryEmbedding(),
             use_bias=True),
        dict(use_causal_mask=True),
    ),
    "window_yarn_padding": (
        dict(rotary_embedding=yarn(), sliding_window=3, scale=0.3),
        dict(use_causal_mask=True, padding=True),
    ),
    "symmetric_window_soft_cap": (
        dict(sliding_window=(2, 1), attn_logits_soft_cap=2.0), dict(),
    ),
    # Ling 3's gate: a sigmoid of the query per head's feature.
    "gate": (dict(use_gate=True, use_bias=True), dict(use_causal_mask=True)),
}


def _call_arguments(call, x):
    call = dict(call)
    if call.pop("padding", False):
        call.update(query_mask=padding(), value_mask=padding())
    if call.pop("attention_mask", False):
        rng = np.random.default_rng(3)
        call["attention_mask"] = rng.random((BATCH, LENGTH, LENGTH)) < 0.6
    return call


class TestReference:
    @pytest.mark.parametrize("how", latent_lib.COMPUTATIONS)
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_the_paper(self, case, how):
        arguments, call = CASES[case]
        layer = make_latent(**arguments)
        x = inputs()
        call = _call_arguments(call, x)
        expected, weights = reference(layer, x, **call)
        with latent_lib.force_computation(how):
            out, scores = layer(x, x, return_attention_scores=True, **call)
            plain = layer(x, x, **call)
        np.testing.assert_allclose(to_numpy(out), expected, atol=ATOL,
                                   rtol=ATOL)
        np.testing.assert_allclose(to_numpy(scores), weights, atol=1e-5)
        np.testing.assert_allclose(to_numpy(plain), expected, atol=ATOL,
                                   rtol=ATOL)

    @pytest.mark.parametrize(
        "path", [dispatch.BANDED, dispatch.BLOCKED]
    )
    def test_expanded_on_every_path(self, path):
        """The expanded computation's keys `Hn + P` and values `V` of
        another size on the long-sequence paths."""
        layer = make_latent(rotary_embedding=keras_mha.RotaryEmbedding(),
                            sliding_window=3 if path == dispatch.BANDED
                            else None)
        x = inputs()
        expected, _ = reference(layer, x, use_causal_mask=True,
                                query_mask=padding(), value_mask=padding())
        with dispatch.force_path(path):
            out = layer(x, x, use_causal_mask=True, query_mask=padding(),
                        value_mask=padding())
        np.testing.assert_allclose(to_numpy(out), expected, atol=ATOL,
                                   rtol=ATOL)

    @pytest.mark.training
    def test_gradients_of_both_computations_agree(self):
        """Gradients with respect to the inputs and every weight, expanded
        and absorbed, and the input's against central differences of the
        float64 reference."""
        from util import layer_gradients

        layer = make_latent(q_lora_rank=5, use_bias=True,
                            rotary_embedding=keras_mha.RotaryEmbedding())
        x = inputs()
        grads = {}
        for how in latent_lib.COMPUTATIONS:
            with latent_lib.force_computation(how):
                grads[how] = layer_gradients(layer, x, x,
                                             use_causal_mask=True)
        for a, b in zip(grads["expanded"], grads["absorbed"]):
            assert np.all(np.isfinite(a))
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
        cotangent = np.random.default_rng(1).normal(
            size=(BATCH, LENGTH, FEATURES)
        )
        weights, config = latent_weights(layer), layer.get_config()
        rotary = rotary_reference_arguments(layer.rotary_embedding, 4)

        def loss(query):
            out, _ = reference_latent_attention(
                weights, config, query, x, use_causal_mask=True,
                rotary=rotary,
            )
            return float((out * cotangent).sum())

        step = 1e-6
        for index in [(0, 0, 0), (1, 3, 5), (1, 6, 2)]:
            plus, minus = x.astype("float64"), x.astype("float64")
            plus[index] += step
            minus[index] -= step
            numeric = (loss(plus) - loss(minus)) / (2 * step)
            np.testing.assert_allclose(grads["expanded"][0][index], numeric,
                                       atol=1e-3, rtol=1e-3)


def _decode(layer, x, prompt, how, mask=None, jit=False, in_place=False):
    """The prompt in one call, then one token a call, with `how` forced
    (`None`: the rule); the outputs concatenated. `jit`: on JAX the steps
    run under `jax.jit` with a tensor index (op by op, JAX would compile
    every operation of the step for its shapes)."""
    cache = layer.init_cache(BATCH, LENGTH, in_place=in_place)
    mask = np.ones((BATCH, LENGTH), bool) if mask is None else mask
    forced = (latent_lib.force_computation(how) if how
              else _nothing())

    def step(token, cache, index):
        return layer(token, token, use_causal_mask=True, cache=cache,
                     cache_update_index=index)

    index = int
    if jit and BACKEND == "jax":
        step, index = compiled(step), np.int32
    outputs = []
    with forced:
        out, cache = layer(
            x[:, :prompt], x[:, :prompt], use_causal_mask=True, cache=cache,
            cache_update_index=0, query_mask=mask[:, :prompt],
            value_mask=mask[:, :prompt],
        )
        outputs.append(to_numpy(out))
        for i in range(prompt, LENGTH):
            out, cache = step(x[:, i:i + 1], cache, index(i))
            outputs.append(to_numpy(out))
    return np.concatenate(outputs, axis=1), cache


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class TestDecoding:
    @pytest.mark.parametrize("how", latent_lib.COMPUTATIONS)
    @pytest.mark.parametrize("window", [None, 3])
    def test_steps_equal_the_full_pass(self, window, how):
        """Prompt then steps, padded, full and rolling cache (the prompt
        longer than the window), against the reference of the whole
        sequence, whichever computation runs."""
        layer = make_latent(rotary_embedding=yarn(), sliding_window=window,
                            q_lora_rank=5)
        x, mask = inputs(), padding()
        expected, _ = reference(layer, x, use_causal_mask=True,
                                query_mask=mask, value_mask=mask)
        out, cache = _decode(layer, x, 4, how, mask, jit=True)
        np.testing.assert_allclose(out[mask], expected[mask], atol=ATOL,
                                   rtol=ATOL)
        slots = 3 if window else LENGTH
        assert [tuple(part.shape) for part in cache] == [
            (BATCH, slots, 8), (BATCH, slots, 4), (BATCH, slots)
        ]

    def test_gated_steps_equal_the_full_pass(self):
        """The gate reads each step's own tokens, whichever computation
        the rule picks for the steps."""
        layer = make_latent(use_gate=True, rotary_embedding=yarn())
        x = inputs()
        expected, _ = reference(layer, x, use_causal_mask=True)
        out, _ = _decode(layer, x, 4, None)
        np.testing.assert_allclose(out, expected, atol=ATOL, rtol=ATOL)

    def test_portable_absorbed_steps(self):
        """The absorbed steps on the portable block loop (the test above
        runs the backends' native steps)."""
        layer = make_latent(rotary_embedding=yarn())
        x, mask = inputs(), padding()
        expected, _ = reference(layer, x, use_causal_mask=True,
                                query_mask=mask, value_mask=mask)
        with decode.force_implementation(decode.PORTABLE):
            out, _ = _decode(layer, x, 4, "absorbed", mask)
        np.testing.assert_allclose(out[mask], expected[mask], atol=ATOL,
                                   rtol=ATOL)

    @pytest.mark.parametrize("in_place", [False, True])
    def test_who_owns_the_cache(self, in_place):
        """By default a step leaves the cache it is given as it was; an
        in-place cache's steps give the same outputs."""
        layer = make_latent()
        x = inputs()
        expected, _ = reference(layer, x, use_causal_mask=True)
        out, _ = _decode(layer, x, 4, None, in_place=in_place)
        np.testing.assert_allclose(out, expected, atol=ATOL, rtol=ATOL)
        cache = layer.init_cache(BATCH, LENGTH, in_place=in_place)
        _, new = layer(x[:, :1], x[:, :1], use_causal_mask=True,
                       cache=cache, cache_update_index=0)
        assert to_numpy(new[2])[:, 0].all()
        assert cache_lib.is_in_place(new) == (in_place and BACKEND != "numpy")
        if cache_lib.is_in_place(new):
            assert type(new) is cache_lib.InPlaceLatentCache
        if not in_place:
            assert not to_numpy(cache[2]).any()

    def test_the_rule(self):
        layer = make_latent(sliding_window=3)
        assert layer.computation(LENGTH) == "expanded"
        assert layer.computation(LENGTH, cache=True,
                                 cache_update_index=0) == "expanded"
        assert layer.computation(1, cache=True,
                                 cache_update_index=5) == "absorbed"
        tensor = keras.ops.convert_to_tensor(5)
        assert layer.computation(1, cache=True,
                                 cache_update_index=tensor) == "absorbed"
        for changed in (dict(return_attention_scores=True),
                        dict(query_length=2)):  # two tokens, rolling
            assert layer.computation(**{
                "query_length": 1, "cache": True, "cache_update_index": 5,
                **changed,
            }) == "expanded"
        with latent_lib.force_computation("absorbed"):
            assert layer.computation(LENGTH) == "absorbed"
        with pytest.raises(ValueError, match="computation='fast'"):
            with latent_lib.force_computation("fast"):
                pass

    def test_absorbed_step_reads_the_latents(self, monkeypatch):
        """A step runs `decode_attention` over the latent cache as one
        shared head, with the rule, not forced."""
        seen = []
        original = decode.decode_attention

        def spy(*args, **kwargs):
            layout = kwargs.get("layout", args[5] if len(args) > 5 else None)
            seen.append((tuple(args[0].shape), layout))
            return original(*args, **kwargs)

        monkeypatch.setattr(decode, "decode_attention", spy)
        layer = make_latent()
        x = inputs()
        _decode(layer, x, LENGTH - 1, None)
        # (a compiled native step calls the function again inside)
        assert seen and set(seen) == {((BATCH, 1, 4, 8 + 4), decode.LATENT)}

    def test_returned_scores_with_a_cache(self):
        layer = make_latent()
        x = inputs()
        cache = layer.init_cache(BATCH, LENGTH)
        _, cache = layer(x[:, :3], x[:, :3], use_causal_mask=True,
                         cache=cache, cache_update_index=0)
        _, weights = reference(layer, x[:, :4], use_causal_mask=True)
        out, scores, _ = layer(
            x[:, 3:4], x[:, 3:4], use_causal_mask=True, cache=cache,
            cache_update_index=3, return_attention_scores=True,
        )
        assert tuple(scores.shape) == (BATCH, 4, 1, LENGTH + 1)
        np.testing.assert_allclose(to_numpy(scores)[..., :3],
                                   weights[:, :, 3:, :3], atol=1e-5)
        np.testing.assert_allclose(to_numpy(scores)[..., -1],
                                   weights[:, :, 3:, 3], atol=1e-5)

    def test_compiled_steps_with_a_tensor_index_trace_once(self):
        """One step function, compiled (`jax.jit`, `tf.function` with
        XLA; eager elsewhere), traced once for every index; its outputs
        are the eager ones."""
        layer = make_latent(rotary_embedding=keras_mha.RotaryEmbedding())
        x = inputs()
        eager, _ = _decode(layer, x, 4, None)
        traces = []

        def step(token, cache, index):
            traces.append(1)
            return layer(token, token, use_causal_mask=True, cache=cache,
                         cache_update_index=index)

        run = compiled(step)
        cache = layer.init_cache(BATCH, LENGTH)
        _, cache = layer(x[:, :4], x[:, :4], use_causal_mask=True,
                         cache=cache, cache_update_index=0)
        outputs = []
        for i in range(4, LENGTH):
            index = keras.ops.convert_to_tensor(np.int32(i))
            out, cache = run(keras.ops.convert_to_tensor(x[:, i:i + 1]),
                             cache, index)
            outputs.append(to_numpy(out))
        np.testing.assert_allclose(np.concatenate(outputs, 1),
                                   eager[:, 4:], atol=1e-5, rtol=1e-5)
        if BACKEND in ("jax", "tensorflow"):
            assert len(traces) == 1


class TestSerialization:
    def test_config_round_trip(self):
        layer = make_latent(q_lora_rank=5, rotary_embedding=yarn(),
                            sliding_window=3, scale=0.25, use_bias=True,
                            norm_epsilon=1e-5, dropout=0.1, seed=3,
                            attn_logits_soft_cap=30.0, use_gate=True)
        config = layer.get_config()
        clone = keras_mha.MultiHeadLatentAttention.from_config(config)
        assert clone.get_config() == config
        shape = (BATCH, LENGTH, FEATURES)
        clone.build(shape, shape)
        clone.set_weights(layer.get_weights())
        x = inputs()
        np.testing.assert_allclose(
            to_numpy(clone(x, x, use_causal_mask=True)),
            to_numpy(layer(x, x, use_causal_mask=True)), atol=1e-6,
        )
        assert layer.scale == 0.25
        assert make_latent().scale == pytest.approx(8 ** -0.5)

    def test_keras_file_round_trip(self, tmp_path):
        x_in = keras.Input((LENGTH, FEATURES))
        attention = keras_mha.MultiHeadLatentAttention(
            q_lora_rank=5, rotary_embedding=keras_mha.RotaryEmbedding(
                interleaved=True), kernel_initializer="zeros", **SIZES,
        )
        model = keras.Model(x_in, attention(x_in, x_in, use_causal_mask=True))
        rng = np.random.default_rng(0)
        model.set_weights([rng.normal(scale=0.5, size=w.shape)
                           .astype("float32") for w in model.get_weights()])
        path = tmp_path / "latent.keras"
        model.save(path)
        loaded = keras.saving.load_model(path)
        x = inputs()
        assert isinstance(loaded.layers[1], keras_mha.MultiHeadLatentAttention)
        np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)),
                                   atol=1e-6)

    def test_weights_in_order(self):
        names = [w.path.split("/", 1)[1]
                 for w in make_latent(q_lora_rank=5, use_bias=True).weights]
        assert names == [
            "query_a/kernel", "query_a/bias", "query_norm/scale",
            "query_b/kernel", "kv_a/kernel", "kv_a/bias", "kv_norm/scale",
            "kv_b/kernel", "attention_output/kernel", "attention_output/bias",
        ]
        gated = [w.path.split("/", 1)[1]
                 for w in make_latent(use_gate=True).weights]
        assert gated[-3:] == ["kv_b/kernel", "gate/kernel",
                              "attention_output/kernel"]


class TestErrors:
    @pytest.mark.parametrize("argument, value", [
        ("num_heads", 0), ("kv_lora_rank", -1), ("qk_nope_head_dim", 1.5),
        ("qk_rope_head_dim", None), ("v_head_dim", "8"), ("q_lora_rank", 0),
        ("scale", -1.0), ("norm_epsilon", 0.0), ("dropout", 1.0),
        ("sliding_window", 0), ("attn_logits_soft_cap", 0.0),
        ("use_bias", "yes"), ("use_gate", "yes"),
    ])
    def test_bad_arguments(self, argument, value):
        error = TypeError if argument in ("use_bias", "use_gate") \
            else ValueError
        with pytest.raises(error, match=f"{argument}="):
            keras_mha.MultiHeadLatentAttention(**{**SIZES, argument: value})

    def test_bad_calls(self):
        layer = make_latent()
        x = inputs()
        other = np.zeros_like(x)
        with pytest.raises(ValueError, match="key with shape"):
            layer(x, x, key=other)
        with pytest.raises(ValueError, match="query.shape"):
            layer(x[:, :, :4], x)
        with pytest.raises(ValueError, match="use_causal_mask=False"):
            layer(x[:, :1], x[:, :1], cache=layer.init_cache(BATCH, LENGTH),
                  cache_update_index=1)
        with pytest.raises(ValueError, match="cache_update_index=None"):
            layer(x[:, :1], x[:, :1], use_causal_mask=True,
                  cache=layer.init_cache(BATCH, LENGTH))
        bad = layer.init_cache(BATCH, LENGTH)
        with pytest.raises(ValueError, match=r"cache\[1\].shape"):
            layer(x[:, :1], x[:, :1], use_causal_mask=True,
                  cache=(bad[0], bad[0], bad[2]), cache_update_index=1)
        with pytest.raises(ValueError, match="cache_update_index=7"):
            layer(x[:, :1], x[:, :1], use_causal_mask=True, cache=bad,
                  cache_update_index=LENGTH)
        with pytest.raises(ValueError, match="attention_mask.shape"):
            layer(x, x, attention_mask=np.ones((LENGTH, 3), bool))
