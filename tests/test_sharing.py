"""Keys and values shared between layers (`keras_mha.sharing`, Gemma 3n's
and Gemma 4's KV sharing): a layer built with `shared_key_value=True`
attends over an earlier layer's keys and values, the pair that layer's
call returned (`return_key_value=True`) or the cache its cached call
returned.

Against the float64 reference (the queries of one layer over the keys and
values of another, as a cross-attention), against the uncached pair when
decoding, inside a Functional model that trains, saves and loads, and
against Gemma 4's own model in transformers. One input shape throughout.
"""

import keras
import numpy as np
import pytest
from reference import layer_weights
from reference import reference_attention
from util import BACKEND
from util import make_layer
from util import rotary_reference_arguments
from util import to_numpy

import keras_mha

B, T, E, N, K, H = 2, 12, 16, 4, 2, 8
WINDOW = 5
GEMMA = dict(qk_norm="rms", value_norm=True, sliding_window=WINDOW)


def _pair_of_layers(rng, **kwargs):
    """`(source, shared, x, y)`: a layer and one that shares its keys and
    values, random weights (norm scales included), and their inputs."""
    x = rng.normal(size=(B, T, E)).astype("float32")
    y = rng.normal(size=(B, T, E)).astype("float32")
    common = dict(num_heads=N, key_dim=H, num_key_value_heads=K, **kwargs)
    source = make_layer(x, x, seed=1, rotary_embedding=_rotary(), **common)
    shared = keras_mha.MultiHeadAttention(
        shared_key_value=True, rotary_embedding=_rotary(), **common)
    shared.build(y.shape)
    draw = np.random.default_rng(2)
    shared.set_weights([draw.normal(scale=0.5, size=w.shape).astype("float32")
                        for w in shared.get_weights()])
    return source, shared, x, y


def _rotary():
    return keras_mha.RotaryEmbedding(max_wavelength=100)


def _expected(source, shared, x, y):
    """The shared layer's output in float64: its own queries of `y`, the
    source's keys and values of `x`, its own output projection."""
    weights = layer_weights(source)
    mine = layer_weights(shared)
    for name in ("query", "query_bias", "output", "output_bias"):
        weights[name] = mine[name]
    kwargs = dict(use_causal_mask=True, sliding_window=shared.sliding_window,
                  scale=shared.scale,
                  rotary=rotary_reference_arguments(shared.rotary_embedding,
                                                    H))
    if shared.qk_norm is not None:
        scale = lambda norm: to_numpy(norm.scale).astype("float64")
        kwargs["qk_norm"] = ("head", shared.qk_norm_epsilon,
                             scale(shared.query_norm), scale(source.key_norm))
    if source.value_norm:
        kwargs["value_norm"] = source.qk_norm_epsilon
    return reference_attention(weights, y, x, **kwargs)[0]


@pytest.mark.parametrize("kwargs", [{}, GEMMA], ids=["plain", "gemma"])
def test_the_pair_against_the_reference(rng, kwargs):
    """The shared layer has a query, an output and no key or value
    projection; over the source's pair it computes the reference's
    cross-attention of its queries and the source's keys and values."""
    source, shared, x, y = _pair_of_layers(rng, **kwargs)
    assert shared.key_dense is None and shared.value_dense is None
    assert shared.key_norm is None
    names = sorted(w.path.split("/", 1)[1] for w in shared.weights)
    assert names == sorted(["query/kernel", "query/bias",
                            "attention_output/kernel",
                            "attention_output/bias"]
                           + (["query_norm/scale"] if kwargs else []))
    output, pair = source(x, x, use_causal_mask=True, return_key_value=True)
    np.testing.assert_allclose(
        to_numpy(output), to_numpy(source(x, x, use_causal_mask=True)),
        atol=1e-6)
    assert tuple(pair[0].shape) == (B, T, K, H)
    got = shared(y, shared_key_value=pair, use_causal_mask=True)
    np.testing.assert_allclose(to_numpy(got), _expected(source, shared, x, y),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "rolling"])
def test_decoding_reads_the_earlier_layers_cache(rng, window):
    """A prompt, then one token at a time: the shared layer reads the
    source's cache (rolling with a window) after the source's call at the
    same index, and matches its uncached call over the whole pair. It
    writes nothing: the cache it read is the one the source returned."""
    source, shared, x, y = _pair_of_layers(rng, qk_norm="rms",
                                           sliding_window=window)
    _, pair = source(x, x, use_causal_mask=True, return_key_value=True)
    want = to_numpy(shared(y, shared_key_value=pair, use_causal_mask=True))
    cache = source.init_cache(B, T)
    assert source.rolling_cache == (window is not None)
    got = []
    for start, stop in [(0, 4)] + [(i, i + 1) for i in range(4, T)]:
        _, cache = source(x[:, start:stop], x[:, start:stop],
                          use_causal_mask=True, cache=cache,
                          cache_update_index=start)
        before = [to_numpy(part) for part in cache]
        got.append(to_numpy(shared(y[:, start:stop], shared_key_value=cache,
                                   cache_update_index=start,
                                   use_causal_mask=True)))
        for old, new in zip(before, cache):
            np.testing.assert_array_equal(old, to_numpy(new))
    np.testing.assert_allclose(np.concatenate(got, 1), want, atol=2e-5,
                               rtol=2e-5)
    # With its weights returned, a step reads the whole cache: the same.
    step, scores = shared(y[:, -1:], shared_key_value=cache,
                          cache_update_index=T - 1, use_causal_mask=True,
                          return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(step), want[:, -1:], atol=2e-5)
    assert tuple(scores.shape) == (B, N, 1, cache[0].shape[1])


def test_a_model_trains_saves_and_loads(rng, tmp_path):
    """In a Functional model the shared layer's gradient reaches the
    earlier layer's key and value projections; the model saves and
    loads with `keras_mha`'s layers."""
    source, shared, x, y = _pair_of_layers(rng, **GEMMA)
    inputs = keras.Input((T, E))
    _, pair = source(inputs, inputs, use_causal_mask=True,
                     return_key_value=True)
    outputs = shared(inputs, shared_key_value=pair, use_causal_mask=True)
    model = keras.Model(inputs, outputs)
    assert tuple(model.output.shape) == (None, T, E)
    assert tuple(shared.compute_output_shape((B, T, E))) == (B, T, E)
    path = tmp_path / "shared.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)),
                               atol=1e-6)
    assert loaded.layers[-1].get_config()["shared_key_value"] is True
    if BACKEND == "numpy":  # inference only
        return
    before = to_numpy(source.key_dense.kernel)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    model.train_on_batch(x, np.zeros_like(x))
    assert np.abs(to_numpy(source.key_dense.kernel) - before).max() > 1e-4


def _bad_calls(source, shared, x, y, pair, cache):
    """`(call, error, match)` for each misuse."""
    return [
        (lambda: shared(y, y, shared_key_value=pair), ValueError,
         r"takes no `value`.*Received: value.shape=\(2, 12, 16\)"),
        (lambda: shared(y, use_causal_mask=True), ValueError,
         r"Received: shared_key_value=None"),
        (lambda: source(x, x, shared_key_value=pair), ValueError,
         r"read only by a layer built with `shared_key_value=True`"),
        (lambda: shared(y, shared_key_value=pair, return_key_value=True),
         ValueError, r"no keys or values of its own"),
        (lambda: shared(y, shared_key_value=(pair[0],)), ValueError,
         r"Received: shared_key_value=a tuple of 1"),
        (lambda: shared(y, shared_key_value=(pair[1][..., :4], pair[1])),
         ValueError, r"shared_key_value\[0\]\.shape=\(2, 12, 2, 4\)"),
        (lambda: shared(y, shared_key_value=pair, cache_update_index=3),
         ValueError, r"takes no `cache_update_index`"),
        (lambda: shared(y, shared_key_value=pair, cache=cache,
                        cache_update_index=0), ValueError,
         r"takes no `cache`"),
        (lambda: shared(y[:, :1], shared_key_value=cache,
                        use_causal_mask=True), ValueError,
         r"`cache` and `cache_update_index` go together"),
        (lambda: shared(y[:, :1], shared_key_value=cache,
                        cache_update_index=3), ValueError,
         r"use_causal_mask=True"),
        (lambda: shared(y[:, :1], shared_key_value=cache, cache_update_index=3,
                        use_causal_mask=True, value_mask=np.ones((B, 1), bool)),
         ValueError, r"`value_mask` is not read with a shared cache"),
        (lambda: source(x, x, return_key_value="yes"), TypeError,
         r"Received: return_key_value='yes'"),
        (lambda: source(), TypeError, r"query"),
        (lambda: source(x), ValueError, r"Received: value=None"),
    ]


def test_misuse_is_named(rng):
    source, shared, x, y = _pair_of_layers(rng)
    _, pair = source(x, x, use_causal_mask=True, return_key_value=True)
    cache = source.init_cache(B, T)
    for call, error, match in _bad_calls(source, shared, x, y, pair, cache):
        with pytest.raises(error, match=match):
            call()


def test_a_rolling_cache_takes_a_long_prompt_as_a_pair(rng):
    """A rolling cache has forgotten what a prompt longer than its slots
    saw first: reading it for such a prompt is refused, naming the pair."""
    source, shared, x, y = _pair_of_layers(rng, sliding_window=WINDOW)
    _, cache = source(x, x, use_causal_mask=True, cache=source.init_cache(
        B, T), cache_update_index=0)
    with pytest.raises(ValueError, match="return_key_value=True"):
        shared(y, shared_key_value=cache, cache_update_index=0,
               use_causal_mask=True)


def test_keras_hubs_cached_layer_refuses_it():
    with pytest.raises(ValueError, match="keeps keras-hub's call"):
        keras_mha.CachedMultiHeadAttention(2, 4, shared_key_value=True)
    with pytest.raises(TypeError, match="shared_key_value"):
        keras_mha.MultiHeadAttention(2, 4, shared_key_value="yes")


def test_the_source_is_named_in_the_config():
    """`key_value_source` names the layer whose keys and values a shared
    layer reads (an index or a name); the config keeps it."""
    layer = keras_mha.MultiHeadAttention(2, 4, shared_key_value=True,
                                         key_value_source="block_3")
    config = layer.get_config()
    assert config["key_value_source"] == "block_3"
    again = keras_mha.MultiHeadAttention.from_config(config)
    assert again.key_value_source == "block_3" and again.shared_key_value
    with pytest.raises(ValueError, match="Received: key_value_source=3, "
                       "shared_key_value=False"):
        keras_mha.MultiHeadAttention(2, 4, key_value_source=3)
    with pytest.raises(TypeError, match="Received: key_value_source=-1"):
        keras_mha.MultiHeadAttention(2, 4, shared_key_value=True,
                                     key_value_source=-1)


def test_gemma4_decodes_as_its_model():
    """Gemma 4's tiny model in transformers, its last two layers sharing
    the keys and values of the first two (a sliding layer and a full one),
    each attention module replaced by ours: a prompt, then greedy steps.
    The sources keep our caches (the sliding one rolling); a shared layer
    takes the prompt's pair, then reads the cache. Each step's logits are
    the model's own, run without a cache over the tokens so far."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from hf_models import attention_modules
    from hf_models import build_causal_lm
    from hf_models import decode_with

    config = transformers.Gemma4TextConfig(
        hidden_size=32, num_attention_heads=N, num_key_value_heads=K,
        head_dim=H, global_head_dim=H, intermediate_size=16, vocab_size=16,
        num_hidden_layers=4, num_kv_shared_layers=2,
        hidden_size_per_layer_input=0, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2)
    model = build_causal_lm(config)
    modules = attention_modules(model)
    layers = [keras_mha.from_torch(module) for module in modules]
    assert [layer.shared_key_value for layer in layers] == [False, False,
                                                            True, True]
    # Layer 2 reads layer 0's (sliding), layer 3 layer 1's (full).
    assert [layer.key_value_source for layer in layers] == [None, None, 0, 1]
    prompt, steps = T - 4, 4
    caches = {i: layers[i].init_cache(B, T) for i in (0, 1)}
    stored = {}

    def ours(i):
        layer, source = layers[i], layers[i].key_value_source

        def call(x, start):
            if not layer.shared_key_value:
                output, caches[i], pair = layer(
                    x, x, use_causal_mask=True, cache=caches[i],
                    cache_update_index=start, return_key_value=True)
                stored[i] = pair, caches[i]
            elif start == 0:
                output = layer(x, shared_key_value=stored[source][0],
                               use_causal_mask=True)
            else:
                output = layer(x, shared_key_value=stored[source][1],
                               cache_update_index=start, use_causal_mask=True)
            return to_numpy(output)
        return call

    tokens_in = np.random.default_rng(2).integers(0, 16, size=(B, prompt))
    tokens, logits = decode_with(model, [ours(i) for i in range(4)],
                                 tokens_in, steps)
    sequence = torch.as_tensor(np.concatenate([tokens_in, tokens], 1))
    with torch.no_grad():
        want = model(input_ids=sequence, use_cache=False).logits.numpy()
    np.testing.assert_allclose(logits, want[:, prompt - 1:-1], atol=2e-5,
                               rtol=1e-5)
