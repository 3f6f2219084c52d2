"""What a layer call asks of attention: its `AttentionSpec`, and its path.

The layer describes each call once, from its settings (`layer.settings`:
scale, window, chunks, soft-cap, ALiBi), its sinks and the call's arguments
(masks, causal, dropout, bias, segment ids), passed by keyword;
`attention_path` describes a call from shapes alone and asks the dispatch
rule which path it would take.
"""

import keras
from keras import ops

from keras_mha import checks
from keras_mha import distribution as distribution_lib
from keras_mha.attention import dispatch
from keras_mha.attention import logits as logits_lib
from keras_mha.attention import paged as paged_lib
from keras_mha.attention import rules
from keras_mha.attention import spec as spec_lib


def describe(
    layer, *, query_tokens=None, key_tokens=None, dense_mask=None,
    use_causal_mask=False, training=None, return_attention_scores=False,
    attention_bias=None, segment_ids=None, key_segment_ids=None, seed=None,
    mask_mod=None, score_mod=None,
):
    """The `AttentionSpec` of a call of `layer` without a cache.

    Args:
        layer: the `MultiHeadAttention` or `MultiHeadLatentAttention`: its
            `settings` and its `sinks`.
        query_tokens, key_tokens: boolean `(B', T)`, `(B', S)` or `None`.
        dense_mask: boolean `(B'|1, N|1, T, S)` or `None`.
        use_causal_mask, training, return_attention_scores: as in `call`.
        attention_bias: checked, broadcastable to `(B, N, T, S)`, or `None`.
        segment_ids, key_segment_ids: checked integer ids, or `None` (the
            keys share the queries' ids when only `segment_ids` is given).
        seed: the layer's dropout `SeedGenerator` (a built layer's), read
            when the call drops weights.
        mask_mod, score_mod: a checked mask and score function (objects
            or plain functions), or `None`.
    """
    settings = layer.settings
    dropout = settings.dropout if training else 0.0
    if segment_ids is not None:
        if key_segment_ids is None:
            key_segment_ids = segment_ids
        segment_ids = ops.convert_to_tensor(segment_ids)
        key_segment_ids = ops.convert_to_tensor(key_segment_ids)
    return spec_lib.AttentionSpec(
        scale=settings.scale,
        causal=bool(use_causal_mask),
        window=spec_lib.window_sides(settings.sliding_window, use_causal_mask),
        chunk=settings.attention_chunk_size,
        query_mask=query_tokens,
        key_mask=key_tokens,
        attention_mask=dense_mask,
        dropout=dropout,
        seed=seed if dropout else None,
        return_weights=bool(return_attention_scores),
        flash_attention=settings.flash_attention,
        bias=None if attention_bias is None else _rank4(attention_bias),
        soft_cap=settings.attn_logits_soft_cap,
        # The variable's tensor: torch.compile breaks its graph on
        # `ops.cast` of a Keras variable.
        sinks=None if layer.sinks is None else layer.sinks.value,
        alibi=_alibi_slopes(settings),
        segment_ids=segment_ids,
        key_segment_ids=key_segment_ids,
        sharding=distribution_lib.context_plan(),
        mask_mod=None if mask_mod is None else rules.as_mask(mask_mod),
        score_mod=None if score_mod is None else rules.as_score_function(
            score_mod),
    )


def _alibi_slopes(settings):
    """The spec's ALiBi slopes, or `None`: added before the scale
    (`alibi_before_scale`, Falcon), the terms are scaled with the logits,
    which is the slopes times the scale."""
    if not settings.use_alibi:
        return None
    slopes = logits_lib.alibi_slopes(settings.num_heads)
    if settings.alibi_before_scale:
        slopes = tuple(m * settings.scale for m in slopes)
    return slopes


def attention_path(
    layer, query_shape, value_shape, key_shape=None, *, given,
    use_causal_mask=False, return_attention_scores=False, training=False,
    cache=False,
):
    """The path a call of `layer` would run (see
    `MultiHeadAttention.attention_path`); `given` holds which optional
    tensors the call has, by argument name."""
    settings = layer.settings
    query_shape, value_shape = tuple(query_shape), tuple(value_shape)
    key_shape = value_shape if key_shape is None else tuple(key_shape)
    layout = checks.input_shapes(
        query_shape, value_shape, key_shape, settings.attention_axes
    )
    t_len = layout.sequence_length(query_shape)
    s_len = layout.sequence_length(key_shape)
    batch, heads = query_shape[0], settings.num_heads

    def placeholder(name, shape, dtype="bool"):
        return keras.KerasTensor(shape, dtype=dtype) if given[name] else None

    spec = describe(
        layer,
        query_tokens=placeholder("query_mask", (batch, t_len)),
        key_tokens=placeholder("key_mask", (batch, s_len)),
        dense_mask=placeholder("attention_mask", (batch, heads, t_len, s_len)),
        use_causal_mask=use_causal_mask,
        training=training,
        return_attention_scores=return_attention_scores,
        attention_bias=placeholder("attention_bias",
                                   (batch, heads, t_len, s_len), "float32"),
        segment_ids=placeholder("segment_ids", (batch, t_len), "int32"),
    )
    if cache:
        spec = spec.replace(
            query_offset=keras.KerasTensor((), dtype="int32"),
            key_positions=keras.KerasTensor((None,), dtype="int32"),
        )
        s_len = None
    shapes = dispatch.Shapes(t_len, s_len, settings.key_dim,
                             settings.value_dim, batch, heads)
    return dispatch.choose_path(spec, shapes)


def extra_result_specs(layer, query, value, key, *,
                       return_attention_scores=False, cache=None,
                       return_key_value=False):
    """The `KerasTensor`s a call returns after its output: the scores
    (keys: a cache's old slots, then the new tokens), the new cache, and
    the keys and values of the call's tokens."""
    specs = []
    if return_attention_scores:
        layout = checks.input_shapes(
            tuple(query.shape), tuple(value.shape),
            tuple((value if key is None else key).shape),
            layer.settings.attention_axes,
        )
        scores_shape = layout.scores_shape(
            tuple(query.shape), tuple(value.shape), layer.settings.num_heads
        )
        if cache is not None:
            scores_shape = scores_shape[:-1] + (
                None
                if query.shape[1] is None
                else cache[0].shape[1] + query.shape[1],
            )
        specs.append(keras.KerasTensor(scores_shape, dtype=layer.compute_dtype))
    if cache is not None:
        if paged_lib.is_paged(cache) or isinstance(cache,
                                                   paged_lib.PagedRows):
            specs.append(keras.tree.map_structure(
                lambda part: keras.KerasTensor(part.shape, dtype=part.dtype),
                cache))
        else:
            specs.append(tuple(keras.KerasTensor(part.shape, dtype=part.dtype)
                               for part in cache))
    if return_key_value:
        settings = layer.settings
        specs.append(tuple(
            keras.KerasTensor(tuple(value.shape[:2]) + (
                settings.num_key_value_heads, size), dtype=layer.compute_dtype)
            for size in (settings.key_dim, settings.value_dim)))
    return specs


def _rank4(bias):
    """A checked `attention_bias` -> rank 4, `(B|1, N|1, T|1, S|1)`."""
    bias = ops.convert_to_tensor(bias)
    if "float" not in keras.backend.standardize_dtype(bias.dtype):
        bias = ops.cast(bias, "float32")
    while len(bias.shape) < 4:
        bias = ops.expand_dims(bias, 0)
    return bias
