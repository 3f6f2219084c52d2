"""`CachedMultiHeadAttention` against keras-hub's layer, decoder and GPT-2."""

from unittest import mock

import keras
import keras_hub
import numpy as np
import pytest
from conftest import BACKEND
from keras_hub.src.layers.modeling import transformer_decoder
from keras_hub.src.layers.modeling.transformer_layer_utils import (
    compute_causal_mask,
)
from util import assert_close
from util import compiled
from util import reference
from util import to_numpy

import keras_mha
import keras_mha.attention
from keras_mha.attention import dispatch
from keras_mha.attention import tuning
from keras_mha.cached import CachedMultiHeadAttention

BATCH, FEATURES, HEADS, HEAD_DIM = 2, 8, 2, 4


def _random_weights(layer, seed):
    rng = np.random.default_rng(seed)
    layer.set_weights(
        [
            rng.normal(scale=0.5, size=w.shape).astype("float32")
            for w in layer.get_weights()
        ]
    )


def _build(cls, seed=0, query_length=4, key_length=None, **kwargs):
    """A `cls` layer built for `(B, T, E)` over `(B, S, E)`, with NumPy
    weights: random initializers would compile a JAX kernel per shape."""
    kwargs.setdefault("num_heads", HEADS)
    kwargs.setdefault("key_dim", HEAD_DIM)
    layer = cls(kernel_initializer="zeros", bias_initializer="zeros", **kwargs)
    key_length = query_length if key_length is None else key_length
    layer.build(
        (BATCH, query_length, FEATURES), (BATCH, key_length, FEATURES)
    )
    _random_weights(layer, seed)
    return layer


def _pair(**kwargs):
    """keras-hub's layer with random weights, and ours with the same."""
    theirs = _build(keras_hub.layers.CachedMultiHeadAttention, **kwargs)
    ours = _build(CachedMultiHeadAttention, **kwargs)
    ours.set_weights(theirs.get_weights())
    return theirs, ours


def _inputs(rng, length, features=FEATURES):
    return rng.normal(size=(BATCH, length, features)).astype("float32")


def _causal(query_length, key_length, index=0):
    """keras-hub's decoder mask `(B, T, S)`, queries from `index`."""
    return compute_causal_mask(BATCH, key_length, query_length, index)


def _assert_results_close(ours, theirs):
    ours = ours if isinstance(ours, tuple) else (ours,)
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert tuple(a.shape) == tuple(b.shape)
        assert_close(a, to_numpy(b).astype("float64"))


def _random_mask(rng, query_length, key_length):
    """`(B, T, S)` booleans with at least one key in every row."""
    mask = rng.random((BATCH, query_length, key_length)) < 0.6
    mask[:, :, 0] = True
    return mask


def _small_blocks(monkeypatch):
    """Decode steps read caches in blocks of 4 slots on every backend."""
    monkeypatch.setitem(tuning.OVERRIDES, "decode_block", 4)


class TestAgainstKerasHub:
    @pytest.mark.parametrize("scores", [False, True], ids=["out", "scores"])
    @pytest.mark.parametrize("mask", [None, "causal", "random"])
    @pytest.mark.parametrize("key_length", [4, 6], ids=["self", "cross"])
    def test_without_cache(self, rng, scores, mask, key_length):
        theirs, ours = _pair(query_length=4, key_length=key_length)
        query, value = _inputs(rng, 4), _inputs(rng, key_length)
        if mask == "causal":
            mask = _causal(4, key_length)
        elif mask == "random":
            mask = _random_mask(rng, 4, key_length)
        kwargs = dict(attention_mask=mask, return_attention_scores=scores)
        _assert_results_close(
            ours(query, value, **kwargs), theirs(query, value, **kwargs)
        )

    @pytest.mark.parametrize("scores", [False, True], ids=["out", "scores"])
    @pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
    @pytest.mark.usefixtures("decode_implementation")
    def test_prefill_then_steps(self, rng, scores, blocks, monkeypatch):
        """Prefill 3 tokens at index 0, then one token at a time: a cache of
        one block is read whole, a longer one block by block (here blocks
        of 4 slots of 6, the last one overlapping)."""
        if blocks:
            _small_blocks(monkeypatch)
        length, prompt = 6, 3
        theirs, ours = _pair(query_length=length)
        x = _inputs(rng, length)
        our_cache = ours.init_cache(BATCH, length)
        their_cache = keras.ops.zeros((BATCH, 2, length, HEADS, HEAD_DIM))
        assert tuple(our_cache.shape) == tuple(their_cache.shape)
        starts = [0] + list(range(prompt, length))
        for start, stop in zip(starts, starts[1:] + [length]):
            step = x[:, start:stop]
            kwargs = dict(
                attention_mask=_causal(stop - start, length, start),
                cache_update_index=start,
                return_attention_scores=scores,
            )
            mine = ours(step, step, cache=our_cache, **kwargs)
            expected = theirs(step, step, cache=their_cache, **kwargs)
            _assert_results_close(mine, expected)
            our_cache, their_cache = mine[-1], expected[-1]

    @pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"),
                        reason="only jax.jit and tf.function trace a step")
    def test_compiled_steps(self, rng, monkeypatch):
        """Compiled one-token steps (a tensor index) over a cache of two
        blocks, which write one run into the cache instead of stacking its
        halves, equal keras-hub's eager steps, caches included."""
        _small_blocks(monkeypatch)
        length = 6
        theirs, ours = _pair(query_length=length)
        x = _inputs(rng, length)

        def step(token, cache, index, mask):
            return ours(token, token, attention_mask=mask, cache=cache,
                        cache_update_index=index)

        step = compiled(step)
        our_cache = ours.init_cache(BATCH, length)
        their_cache = keras.ops.zeros((BATCH, 2, length, HEADS, HEAD_DIM))
        for i in range(length):
            token, mask = x[:, i : i + 1], _causal(1, length, i)
            index = keras.ops.convert_to_tensor(i, dtype="int32")
            mine = step(token, our_cache, index, mask)
            expected = theirs(token, token, attention_mask=mask,
                              cache=their_cache, cache_update_index=i)
            _assert_results_close(mine, expected)
            our_cache, their_cache = mine[-1], expected[-1]

    def test_step_path(self, rng, monkeypatch):
        """A step over a cache of one block attends on `explicit` on JAX
        (XLA fuses it better inside a decode loop), on the rule elsewhere,
        and on a path that `force_path` holds it to everywhere."""
        _, ours = _pair(query_length=4)
        x = _inputs(rng, 4)
        cache = ours.init_cache(BATCH, 4)
        seen = []
        choose_path = dispatch.choose_path

        def recording(*args, **kwargs):
            seen.append(choose_path(*args, **kwargs))
            return seen[-1]

        monkeypatch.setattr(dispatch, "choose_path", recording)
        step = dict(attention_mask=_causal(1, 4, 3), cache=cache,
                    cache_update_index=3)
        _, step["cache"] = ours(x[:, 3:], x[:, 3:], **step)
        jax = keras.backend.backend() == "jax"
        assert seen == [dispatch.EXPLICIT if jax else dispatch.FUSED]
        with dispatch.force_path(dispatch.FUSED):
            ours(x[:, 3:], x[:, 3:], **step)
        assert seen[-1] == dispatch.FUSED

    def test_route_rule(self, monkeypatch):
        """`dispatch.cache_route` for keras-hub's cache, on both sides of
        `decode_block`: within one block, or with scores or dropout, the
        cache is read whole after its write; past it a step reads its
        slots up to its last token; never the prompt route (its mask and
        scores span the slots). Ours, at the same calls: the prompt at
        index 0, and keys computed from the entries (the latent cache,
        expanded) are never read where they lie."""
        _small_blocks(monkeypatch)  # 4 slots a block
        spec = keras_mha.attention.AttentionSpec(scale=1.0)

        def route(spec, num_slots, layout="pair", index=0, **kwargs):
            return dispatch.cache_route(spec, 1, index, False, layout,
                                        num_slots, **kwargs)

        assert route(spec, 4) == dispatch.WHOLE_CACHE
        assert route(spec, 5) == dispatch.SLOT_WRITE
        for changed in (dict(return_weights=True), dict(dropout=0.5)):
            assert route(spec.replace(**changed), 5) == dispatch.WHOLE_CACHE
        assert route(spec, 5, "flagged") == dispatch.PROMPT
        assert route(spec, 5, "flagged", index=3) == dispatch.SLOT_WRITE
        assert route(spec, 5, "latent", index=3,
                     computed=True) == dispatch.CONCATENATED

    @pytest.mark.parametrize("scores", [False, True], ids=["out", "scores"])
    @pytest.mark.parametrize("masked", [False, True], ids=["all", "mask"])
    def test_static_cache(self, rng, scores, masked):
        """`cache_update_index=None`: the cache as it is, returned as is."""
        theirs, ours = _pair(query_length=2, key_length=5)
        query = _inputs(rng, 2)
        cache = rng.normal(size=(BATCH, 2, 5, HEADS, HEAD_DIM))
        cache = cache.astype("float32")
        kwargs = dict(
            attention_mask=_random_mask(rng, 2, 5) if masked else None,
            return_attention_scores=scores,
        )
        # `value` is not read: a different one gives the same results.
        mine = ours(query, _inputs(rng, 3), cache=cache, **kwargs)
        expected = theirs(query, query, cache=cache, **kwargs)
        _assert_results_close(mine, expected)
        np.testing.assert_array_equal(to_numpy(mine[-1]), cache)

    @pytest.mark.parametrize(
        "form", ["(T,S)", "(1,T,S)", "(B,T,S)", "(B,1,S)", "(B,1,T,S)"]
    )
    @pytest.mark.parametrize("dtype", ["bool", "int32", "float32"])
    def test_mask_forms(self, rng, form, dtype):
        theirs, ours = _pair(query_length=3, key_length=5)
        query, value = _inputs(rng, 3), _inputs(rng, 5)
        mask = _random_mask(rng, 3, 5)
        mask = {
            "(T,S)": mask[0],
            "(1,T,S)": mask[:1],
            "(B,T,S)": mask,
            "(B,1,S)": mask[:, :1],
            "(B,1,T,S)": mask[:, None],
        }[form].astype(dtype)
        _assert_results_close(
            ours(query, value, attention_mask=mask),
            theirs(query, value, attention_mask=mask),
        )

    def test_unwritten_slots_are_never_attended(self, rng):
        """A difference on purpose: without a mask, keras-hub attends to
        the slots after the new tokens too; we never do. With those slots
        masked, keras-hub agrees with us."""
        theirs, ours = _pair(query_length=2, key_length=6)
        x = _inputs(rng, 2)
        cache = rng.normal(size=(BATCH, 2, 6, HEADS, HEAD_DIM))
        cache = cache.astype("float32")
        output, new_cache = ours(x, x, cache=cache, cache_update_index=1)
        written = np.zeros((BATCH, 2, 6), dtype=bool)
        written[:, :, :3] = True  # slots 0..2: before and at the new tokens
        expected = theirs(
            x, x, cache=cache, cache_update_index=1, attention_mask=written
        )
        _assert_results_close((output, new_cache), expected)
        unmasked = theirs(x, x, cache=cache, cache_update_index=1)
        assert not np.allclose(to_numpy(output), to_numpy(unmasked[0]))

    def test_weights_copy_both_ways(self):
        theirs, ours = _pair()
        assert [w.shape for w in ours.weights] == [
            w.shape for w in theirs.weights
        ]
        other = _build(keras_hub.layers.CachedMultiHeadAttention, seed=5)
        other.set_weights(ours.get_weights())
        for a, b in zip(other.get_weights(), theirs.get_weights()):
            np.testing.assert_array_equal(a, b)


class _OurDecoder(keras_hub.layers.TransformerDecoder):
    """keras-hub's decoder, its attention layers built from our class."""

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        with mock.patch.object(
            transformer_decoder,
            "CachedMultiHeadAttention",
            CachedMultiHeadAttention,
        ):
            super().build(decoder_sequence_shape, encoder_sequence_shape)


def _decoder_pair(length, encoder_length=None):
    kwargs = dict(intermediate_dim=16, num_heads=HEADS,
                  kernel_initializer="zeros")
    shapes = [(BATCH, length, FEATURES)]
    if encoder_length is not None:
        shapes.append((BATCH, encoder_length, FEATURES))
    stock = keras_hub.layers.TransformerDecoder(**kwargs)
    stock.build(*shapes)
    _random_weights(stock, 0)
    ours = _OurDecoder(**kwargs)
    ours.build(*shapes)
    ours.set_weights(stock.get_weights())
    attention = [ours._self_attention_layer]
    if encoder_length is not None:
        attention.append(ours._cross_attention_layer)
    assert all(
        isinstance(a, CachedMultiHeadAttention) for a in attention
    )
    return stock, ours


def _decode(decoder, x, prompt, encoder=None):
    """Prefills `x[:, :prompt]`, then one token at a time; the outputs of
    every position and the last self-attention cache."""
    length = x.shape[1]
    cache = keras.ops.zeros((BATCH, 2, length, HEADS, FEATURES // HEADS))
    cross_kwargs = {}
    if encoder is not None:
        cross_cache = keras.ops.zeros(
            (BATCH, 2, encoder.shape[1], HEADS, FEATURES // HEADS)
        )
        cross_kwargs = dict(
            encoder_sequence=encoder,
            cross_attention_cache=cross_cache,
            cross_attention_cache_update_index=0,
        )
    outputs = []
    starts = [0] + list(range(prompt, length))
    for start, stop in zip(starts, starts[1:] + [length]):
        result = decoder(
            x[:, start:stop],
            self_attention_cache=cache,
            self_attention_cache_update_index=start,
            **cross_kwargs,
        )
        outputs.append(to_numpy(result[0]))
        cache = result[1]
        if encoder is not None:  # computed once, then read as it is
            cross_kwargs.update(
                cross_attention_cache=result[2],
                cross_attention_cache_update_index=None,
            )
    return np.concatenate(outputs, axis=1), cache


class TestTransformerDecoder:
    @pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
    def test_same_as_stock_decoder(self, rng, padded):
        stock, ours = _decoder_pair(5)
        x = _inputs(rng, 5)
        padding = None
        if padded:  # right padding: every query keeps a key
            padding = np.arange(5)[None, :] < np.array([[5], [3]])
        assert_close(
            ours(x, decoder_padding_mask=padding),
            to_numpy(stock(x, decoder_padding_mask=padding)).astype("float64"),
        )

    def test_cached_loop_equals_full_pass(self, rng):
        stock, ours = _decoder_pair(6)
        x = _inputs(rng, 6)
        full = to_numpy(stock(x)).astype("float64")
        decoded, cache = _decode(ours, x, prompt=3)
        their_decoded, their_cache = _decode(stock, x, prompt=3)
        assert_close(decoded, full)
        assert_close(their_decoded, full)
        assert_close(cache, to_numpy(their_cache).astype("float64"))

    def test_cross_attention_cache(self, rng):
        """The cross-attention cache: computed at index 0 from the encoder
        (4 tokens for 1 query), then read as it is."""
        stock, ours = _decoder_pair(5, encoder_length=4)
        x, encoder = _inputs(rng, 5), _inputs(rng, 4)
        full = to_numpy(stock(x, encoder)).astype("float64")
        assert_close(ours(x, encoder), full)
        decoded, _ = _decode(ours, x, prompt=2, encoder=encoder)
        assert_close(decoded, full)


def _gpt2(attention_class):
    with mock.patch.object(
        transformer_decoder, "CachedMultiHeadAttention", attention_class
    ):
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
            intermediate_dim=32, max_sequence_length=32,
        )
    for layer in backbone.transformer_layers:
        assert type(layer._self_attention_layer) is attention_class
    return backbone


class TestGPT2:
    def test_generate_same_tokens(self):
        theirs = _gpt2(keras_hub.layers.CachedMultiHeadAttention)
        _random_weights(theirs, 0)
        ours = _gpt2(CachedMultiHeadAttention)
        ours.set_weights(theirs.get_weights())

        token_ids = np.zeros((2, 10), dtype="int32")
        token_ids[0, :3] = [5, 17, 3]
        token_ids[1, :5] = [9, 1, 44, 2, 30]
        padding_mask = token_ids != 0
        inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
        assert_close(
            ours(inputs), to_numpy(theirs(inputs)).astype("float64"),
            atol=1e-4,
        )

        generated = []
        for backbone in (theirs, ours):
            lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
            lm.compile(sampler="greedy")
            result = lm.generate(dict(inputs), stop_token_ids=None)
            generated.append(to_numpy(result["token_ids"]))
        np.testing.assert_array_equal(generated[1], generated[0])
        # The prompts are kept and the rest is filled in.
        np.testing.assert_array_equal(
            generated[1][padding_mask], token_ids[padding_mask]
        )
        assert (generated[1][:, 5:] != 0).any()


_FEATURES = {
    "window": dict(sliding_window=3),
    "rotary": dict(rotary_embedding=keras_mha.RotaryEmbedding()),
    "soft_cap": dict(attn_logits_soft_cap=2.0),
    "sinks": dict(use_sinks=True),
    "alibi": dict(use_alibi=True),
    "scale": dict(scale=0.3),
    "grouped": dict(num_key_value_heads=1),
    "gate": dict(use_gate=True),
}


class TestFeatures:
    @pytest.mark.parametrize("feature", list(_FEATURES))
    @pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
    @pytest.mark.usefixtures("decode_implementation")
    def test_cached_loop_equals_reference(self, rng, feature, blocks,
                                          monkeypatch):
        """Prefill then steps, with keras-hub's causal mask, equals the
        float64 reference of causal attention, and so does the full pass
        (the cache read whole, and block by block)."""
        if blocks:
            _small_blocks(monkeypatch)
        length, prompt = 6, 3
        layer = _build(CachedMultiHeadAttention,
                       query_length=length, **_FEATURES[feature])
        x = _inputs(rng, length)
        expected, _ = reference(layer, x, x, use_causal_mask=True)
        assert_close(layer(x, x, attention_mask=_causal(length, length)),
                     expected)
        cache = layer.init_cache(BATCH, length)
        assert tuple(cache.shape) == (
            BATCH, 2, length, layer.num_key_value_heads, HEAD_DIM
        )
        outputs = []
        starts = [0] + list(range(prompt, length))
        for start, stop in zip(starts, starts[1:] + [length]):
            step = x[:, start:stop]
            output, cache = layer(
                step, step, cache=cache, cache_update_index=start,
                attention_mask=_causal(stop - start, length, start),
            )
            outputs.append(to_numpy(output))
        assert_close(np.concatenate(outputs, axis=1), expected)

    def test_rotary_cache_holds_rotated_keys(self, rng):
        layer = _build(CachedMultiHeadAttention, query_length=4,
                       rotary_embedding=keras_mha.RotaryEmbedding())
        x = _inputs(rng, 4)
        _, cache = layer(x[:, 2:], x[:, 2:], cache=layer.init_cache(BATCH, 4),
                         cache_update_index=2)
        keys = layer.rotary_embedding(layer.key_dense(x), start_index=0)
        assert_close(cache[:, 0, 2:], to_numpy(keys)[:, 2:])

    def test_banded_path_without_cache(self, rng, monkeypatch):
        """A window over long keys without a mask runs the banded path."""
        calls = []
        banded = keras_mha.attention.banded_attention

        def spy(*args):
            calls.append(1)
            return banded(*args)

        monkeypatch.setattr(keras_mha.attention, "banded_attention", spy)
        layer = _build(CachedMultiHeadAttention, query_length=256,
                       sliding_window=4)
        x = rng.normal(size=(1, 256, FEATURES)).astype("float32")
        expected, _ = reference(layer, x, x)
        assert_close(layer(x, x), expected)
        assert calls


class TestTraining:
    @pytest.mark.training
    def test_one_training_step_with_dropout(self, rng):
        inputs = keras.Input((4, FEATURES))
        layer = CachedMultiHeadAttention(
            num_heads=HEADS, key_dim=HEAD_DIM, dropout=0.2, seed=0,
            kernel_initializer="zeros",
        )
        model = keras.Model(
            inputs, layer(inputs, inputs, attention_mask=_causal(4, 4))
        )
        _random_weights(layer, 0)
        before = [w.copy() for w in layer.get_weights()]
        model.compile(optimizer="sgd", loss="mse")
        x = _inputs(rng, 4)
        model.fit(x, x, batch_size=BATCH, epochs=1, verbose=0)
        after = layer.get_weights()
        assert all(np.isfinite(w).all() for w in after)
        assert any(not np.allclose(a, b) for a, b in zip(after, before))


class TestSerialization:
    def test_config_round_trip(self):
        layer = CachedMultiHeadAttention(
            num_heads=2, key_dim=4, num_key_value_heads=1, sliding_window=3,
            rotary_embedding=keras_mha.RotaryEmbedding(max_wavelength=500),
        )
        config = layer.get_config()
        clone = CachedMultiHeadAttention.from_config(config)
        assert type(clone) is CachedMultiHeadAttention
        assert clone.get_config() == config
        assert (
            keras.saving.get_registered_name(type(layer))
            == "keras_mha>CachedMultiHeadAttention"
        )

    def test_keras_file_round_trip(self, rng, tmp_path):
        inputs = keras.Input((4, FEATURES))
        layer = CachedMultiHeadAttention(
            num_heads=HEADS, key_dim=HEAD_DIM, kernel_initializer="zeros"
        )
        mask = _causal(4, 4)
        model = keras.Model(inputs, layer(inputs, inputs, attention_mask=mask))
        _random_weights(layer, 0)
        path = tmp_path / "cached.keras"
        model.save(path)
        loaded = keras.saving.load_model(path)
        x = _inputs(rng, 4)
        assert_close(loaded(x), to_numpy(model(x)).astype("float64"))
        assert any(
            type(sub) is CachedMultiHeadAttention
            for sub in loaded.layers
        )

    def test_symbolic_shapes(self):
        layer = CachedMultiHeadAttention(num_heads=HEADS,
                                                   key_dim=HEAD_DIM)
        query = keras.KerasTensor((BATCH, 1, FEATURES))
        cache = keras.KerasTensor((BATCH, 2, 7, HEADS, HEAD_DIM))
        output, scores, new_cache = layer(
            query, query, cache=cache, cache_update_index=3,
            return_attention_scores=True,
        )
        assert output.shape == (BATCH, 1, FEATURES)
        assert scores.shape == (BATCH, HEADS, 1, 7)
        assert new_cache.shape == cache.shape


class TestErrors:
    def _layer(self, **kwargs):
        return _build(CachedMultiHeadAttention, query_length=1,
                      **kwargs)

    def test_index_without_cache(self, rng):
        x = _inputs(rng, 1)
        with pytest.raises(ValueError, match="`cache_update_index`"):
            self._layer()(x, x, cache_update_index=0)

    @pytest.mark.parametrize(
        "shape",
        [
            (BATCH, 2, 5, HEADS),
            (BATCH, 1, 5, HEADS, HEAD_DIM),
            (BATCH, 2, 5, HEADS + 1, HEAD_DIM),
            (BATCH, 2, 5, HEADS, HEAD_DIM + 1),
            (BATCH + 1, 2, 5, HEADS, HEAD_DIM),
        ],
        ids=["rank", "pair", "heads", "head_dim", "batch"],
    )
    def test_cache_of_wrong_shape(self, rng, shape):
        x = _inputs(rng, 1)
        cache = np.zeros(shape, dtype="float32")
        with pytest.raises(ValueError, match=r"`cache` must have shape"):
            self._layer()(x, x, cache=cache, cache_update_index=0)

    @pytest.mark.parametrize("as_tensor", [False, True])
    def test_index_out_of_range(self, rng, as_tensor):
        """Eager calls check a tensor index as they check an int (an
        in-place write would otherwise fail in the backend, or clamp)."""
        x = _inputs(rng, 1)
        cache = np.zeros((BATCH, 2, 3, HEADS, HEAD_DIM), dtype="float32")
        index = keras.ops.convert_to_tensor(3, "int32") if as_tensor else 3
        with pytest.raises(ValueError, match=r"cache_update_index=3\b"):
            self._layer()(x, x, cache=cache, cache_update_index=index)

    @pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"),
                        reason="only jax.jit and tf.function trace a step")
    @pytest.mark.parametrize("stepped", [False, True],
                             ids=["one-block", "stepped"])
    def test_traced_index_out_of_range_writes_nothing(self, rng, stepped,
                                                      monkeypatch):
        """Traced, no error can be raised: an index whose token does not
        fit writes nothing (never a clamped slot), on both writes (a cache
        of one block, and the step's over a larger one)."""
        if stepped:  # a cache of more than one block takes the step
            monkeypatch.setitem(tuning.OVERRIDES, "decode_block", 2)
        x = _inputs(rng, 1)
        layer = self._layer()
        cache = rng.normal(size=(BATCH, 2, 3, HEADS, HEAD_DIM))
        cache = cache.astype("float32")
        step = compiled(lambda token, cache, index: layer(
            token, token, cache=cache, cache_update_index=index))
        for index in (3, 100, -1):
            _, after = step(x, cache,
                            keras.ops.convert_to_tensor(index, "int32"))
            np.testing.assert_array_equal(to_numpy(after), cache)

    def test_cache_needs_value_dim_equal_key_dim(self, rng):
        x = _inputs(rng, 1)
        layer = self._layer(value_dim=HEAD_DIM + 2)
        with pytest.raises(ValueError, match="value_dim"):
            layer.init_cache(BATCH, 3)
        cache = np.zeros((BATCH, 2, 3, HEADS, HEAD_DIM), dtype="float32")
        with pytest.raises(ValueError, match="value_dim"):
            layer(x, x, cache=cache, cache_update_index=0)

    def test_mask_of_wrong_shape(self, rng):
        x = _inputs(rng, 1)
        cache = np.zeros((BATCH, 2, 3, HEADS, HEAD_DIM), dtype="float32")
        with pytest.raises(ValueError, match="`attention_mask`"):
            self._layer()(x, x, cache=cache, cache_update_index=0,
                          attention_mask=np.ones((BATCH, 1, 4), bool))
