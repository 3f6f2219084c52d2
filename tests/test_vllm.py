"""keras-hub's vLLM route through our layers (`keras_mha.vllm`).

A paged-attention function written here in `keras.ops` to the contract of
keras-hub's bridge (`fn(kv_cache, q, k, v, scale, head_size, num_heads,
num_kv_heads, sliding_window=None, soft_cap=None) -> (new_kv_cache,
output)`) serves requests of different lengths in one continuous batch:
each step packs prefill chunks and decode tokens token-major, with each
token's position and its sequence's page table, as vLLM's engine does.
The logits served, through a swapped model's `HubAttention` layers and
through keras-hub's own layers alike, are the model's ordinary logits of
each request alone.
"""

import numpy as np
import pytest
from util import to_numpy

import keras
import keras_mha
from keras import ops

keras_hub = pytest.importorskip("keras_hub")
pytestmark = pytest.mark.skipif(
    keras.backend.backend() == "numpy",
    reason="keras-hub's models do not build on Keras's NumPy backend",
)
from keras_hub.src.vllm import context as vllm_context  # noqa: E402
from test_hub import _model  # noqa: E402

PAGE, PAGES = 4, 12
# Three requests; each step serves (request, first position, tokens).
LENGTHS = {"a": 7, "b": 5, "c": 6}
STEPS = [
    [("a", 0, 5), ("b", 0, 3)],  # two prefills
    [("a", 5, 1), ("b", 3, 1), ("c", 0, 4)],  # decodes and a prefill
    [("a", 6, 1), ("b", 4, 1), ("c", 4, 2)],  # decodes and a chunk
]
TABLES = {"a": [0, 5], "b": [3, 1], "c": [7, 2]}  # pages, not in order
SPAN = 2 * PAGE  # the slots of a sequence's pages


class PagedAttention:
    """A paged-attention function to keras-hub's bridge contract. The pool
    is `(pages, PAGE, 2, K, H)`; the engine's metadata (each token's
    sequence and position, each sequence's pages) is bound in it, as
    vLLM binds its own."""

    def __init__(self, tokens):
        self.tokens = tokens  # [(request, position)] token-major

    def __call__(self, kv_cache, q, k, v, scale, head_size, num_heads,
                 num_kv_heads, sliding_window=None, soft_cap=None):
        count, heads, size = len(self.tokens), num_kv_heads, head_size
        k = ops.reshape(k, (count, heads, size))
        v = ops.reshape(v, (count, heads, size))
        pages = kv_cache
        for t, (request, position) in enumerate(self.tokens):
            page = TABLES[request][position // PAGE]
            update = ops.stack([k[t], v[t]])[None, None]  # (1, 1, 2, K, H)
            pages = ops.slice_update(pages, [page, position % PAGE, 0, 0, 0],
                                     ops.cast(update, pages.dtype))
        flat = ops.reshape(pages, (-1, 2, heads, size))
        # Each token reads its sequence's pages whole, the same shape for
        # every token; the slots past its position or out of its window
        # weigh nothing.
        span = np.arange(SPAN)
        slots = np.array([[TABLES[request][j // PAGE] * PAGE + j % PAGE
                           for j in span] for request, _ in self.tokens])
        positions = np.array([p for _, p in self.tokens])[:, None]
        valid = span <= positions
        if sliding_window is not None:
            valid &= span > positions - sliding_window
        kv = ops.take(flat, slots, axis=0)  # (T, S, 2, K, H)
        query = ops.reshape(q, (count, heads, num_heads // heads, size))
        logits = ops.einsum("tkgh,tskh->tkgs", query, kv[:, :, 0]) * scale
        if soft_cap is not None:
            logits = soft_cap * ops.tanh(logits / soft_cap)
        logits = ops.where(valid[:, None, None, :],
                           ops.cast(logits, "float32"), -1e9)
        weights = ops.softmax(logits, axis=-1)
        out = ops.einsum("tkgs,tskh->tkgh", ops.cast(weights, kv.dtype),
                         kv[:, :, 1])
        return pages, ops.reshape(out, (count, num_heads * size))


def _requests():
    rng = np.random.default_rng(3)
    return {name: rng.integers(3, 50, size=length)
            for name, length in LENGTHS.items()}


def _served(model, requests, heads):
    """Each step's logits `(tokens, V)` served through the vLLM context."""
    layers = len(model.backbone.transformer_layers)
    caches = [ops.zeros((PAGES, PAGE, 2, *heads)) for _ in range(layers)]
    served = []
    for step in STEPS:
        tokens = [(name, start + i) for name, start, count in step
                  for i in range(count)]
        ids = np.array([requests[name][p] for name, p in tokens])[:, None]
        positions = np.array([p for _, p in tokens], "int32")
        with vllm_context.vllm_context_scope(
                paged_attention_func=PagedAttention(tokens),
                positions=ops.convert_to_tensor(positions),
                kv_caches=caches):
            logits = model({"token_ids": ids,
                            "padding_mask": np.ones_like(ids, bool)})
            caches = vllm_context.get_vllm_context().updated_kv_caches
        served.append((tokens, to_numpy(logits)[:, 0]))
    return served


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_served_logits_are_the_models(family):
    model = _model(family)
    requests = _requests()
    alone = {
        name: to_numpy(model({"token_ids": ids[None],
                              "padding_mask": np.ones((1, len(ids)), bool)}))[0]
        for name, ids in requests.items()
    }
    attention = keras_mha.adopt(_model(family)).backbone.transformer_layers[0]
    layer = (getattr(attention, "_self_attention_layer", None)
             or attention.attention)
    heads = (layer.num_key_value_heads, layer.key_dim)
    for swapped in (False, True):
        if swapped:
            keras_mha.adopt(model)
        for tokens, logits in _served(model, requests, heads):
            for (name, position), row in zip(tokens, logits):
                want = alone[name][position]
                np.testing.assert_allclose(
                    row, want, atol=2e-5 * np.abs(want).max(),
                    err_msg=f"{family}, swapped={swapped}, {name}@{position}")


def test_refused_by_name():
    layer = keras_mha.CachedMultiHeadAttention(num_heads=2, key_dim=4,
                                               use_sinks=True)
    x = np.zeros((3, 1, 8), "float32")
    layer(x, x)
    with vllm_context.vllm_context_scope(
            paged_attention_func=PagedAttention([]),
            positions=ops.zeros((3,), "int32")):
        with pytest.raises(ValueError, match="cannot take the layer's "
                           "use_sinks"):
            layer(x, x)


def test_norms_and_gate_on_the_route():
    """A layer with an `input_norm`, an `output_norm` and a gate serves a
    prompt, token-major, as its own causal call computes it."""
    layer = keras_mha.CachedMultiHeadAttention(
        num_heads=4, key_dim=8, num_key_value_heads=2, use_gate=True,
        input_norm=keras.layers.LayerNormalization(),
        output_norm=keras.layers.RMSNormalization())
    length = LENGTHS["a"]
    x = np.random.default_rng(0).normal(size=(1, length, 16)).astype(
        "float32")
    causal = np.tril(np.ones((length, length), bool))
    want = to_numpy(layer(x, x, attention_mask=causal))[0]
    tokens = [("a", position) for position in range(length)]
    packed = ops.convert_to_tensor(x[0][:, None, :])  # (tokens, 1, E)
    with vllm_context.vllm_context_scope(
            paged_attention_func=PagedAttention(tokens),
            positions=ops.arange(length, dtype="int32"),
            kv_caches=[ops.zeros((PAGES, PAGE, 2, 2, 8))]):
        got = to_numpy(layer(packed, packed))[:, 0]
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_mask_function_is_refused_by_name():
    from keras_mha.attention import rules

    layer = keras_mha.CachedMultiHeadAttention(num_heads=2, key_dim=4)
    x = np.zeros((3, 1, 8), "float32")
    layer(x, x)
    with vllm_context.vllm_context_scope(
            paged_attention_func=PagedAttention([]),
            positions=ops.zeros((3,), "int32")):
        with pytest.raises(ValueError, match="no mask or score function"):
            layer(x, x, mask_mod=rules.Causal())
