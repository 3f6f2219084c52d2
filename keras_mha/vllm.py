"""keras-hub's vLLM route: attention handed to vLLM's paged attention.

While keras-hub serves a model with vLLM, a thread-local context
(`keras_hub.src.vllm.context`) holds a paged-attention function, each
token's position and the per-layer paged caches. keras-hub's own layers
then project their heads and hand them to
`keras_hub.src.vllm.attention.vllm_paged_attention`, which reads and
writes the layer's pages. `CachedMultiHeadAttention` and `HubAttention` do
the same here: queries and keys normalized and rotated at the context's
positions, keys and values with their own (unexpanded) heads, the layer's
scale, window and soft-cap. What the bridge cannot take is refused by
name while the context is active.

Nothing here imports keras-hub: a context can be active only where the
user's keras-hub is imported already.
"""

import sys

from keras import ops

from keras_mha import heads as heads_lib
from keras_mha import projections

_CONTEXT = "keras_hub.src.vllm.context"


def serving_context():
    """keras-hub's active vLLM context with a paged-attention function, or
    `None` (keras-hub not imported, or not serving)."""
    module = sys.modules.get(_CONTEXT)
    if module is None:
        return None
    context = module.get_vllm_context()
    if context is None or context.paged_attention_func is None:
        return None
    return context


def paged_attention(layer, query, value, key, cache, context,
                    return_attention_scores=False, programmed=False):
    """The layer's call through vLLM's paged attention.

    Args:
        layer: a `MultiHeadAttention` (built).
        query, value, key: the call's inputs, `(B, T, E)`; self-attention
            only (`key` and `value` are `query`).
        cache: the call's cache, returned as it is (the pages are the
            context's).
        context: keras-hub's active context (`serving_context`).
        return_attention_scores: refused (the kernel returns none).
        programmed: whether the call has a mask or score function:
            refused (the kernel takes neither).

    Returns:
        `output`, or `(output, cache)` when a cache was given, as keras-hub's
        layers return.
    """
    _check(layer, query, value, key, return_attention_scores, programmed)
    from keras_hub.src.vllm.attention import vllm_paged_attention

    settings = layer.settings
    query, value, key = projections.normalized_inputs(layer, query, value, key)
    positions = ops.reshape(context.positions, (-1, 1))  # (B, T) = (n, 1)
    q = heads_lib.queries(layer, layer.sublayer("query")(query), 0,
                          positions=positions)
    k = heads_lib.keys(layer, layer.sublayer("key")(key), 0,
                       positions=positions)
    v = heads_lib.values(layer, layer.sublayer("value")(value))
    context_heads = vllm_paged_attention(
        q, k, v, settings.scale, num_kv_heads=settings.num_key_value_heads,
        sliding_window=settings.sliding_window,
        soft_cap=settings.attn_logits_soft_cap,
    )  # (B, T, N, V)
    # Rank-3 inputs: the heads laid out as the gate's `(B, T, N, V)`.
    gate = layer.sublayer("gate")(query) if settings.use_gate else None
    context_heads = projections.heads_to_project(layer, context_heads, gate)
    output = layer.sublayer("output")(context_heads)  # (B, T, E)
    return output if cache is None else (output, cache)


def _check(layer, query, value, key, return_attention_scores, programmed):
    settings = layer.settings
    if programmed:
        raise ValueError(
            "keras-hub's vLLM paged attention takes no mask or score "
            "function, and its serving context is active. Received: "
            "mask_mod or score_mod given"
        )
    refused = {
        "use_sinks": settings.use_sinks,
        "use_alibi": settings.use_alibi,
        "attention_chunk_size": settings.attention_chunk_size is not None,
        "query_temperature": settings.query_temperature is not None,
        "return_attention_scores": return_attention_scores,
        "cross-attention": value is not query or key is not query,
        "sliding_window": not (settings.sliding_window is None
                               or isinstance(settings.sliding_window, int)),
    }
    for name, found in refused.items():
        if found:
            raise ValueError(
                f"keras-hub's vLLM paged attention cannot take the layer's "
                f"{name}, and its serving context is active. Received: "
                f"{name}={getattr(settings, name, True)!r}"
            )
