"""Attention over part of the keys, and the merge of such parts.

When the keys are split (ring attention's blocks, a cache's slots on
several devices), each part gives the softmax-weighted sum over its own
keys and the log-sum-exp of its logits, `(out, lse)`. Two parts merge
exactly by their log-sum-exps (`merge`), in any order; `finish` adds the
sinks to the denominator and zeroes the rows that had no key at all. The
result is that of `explicit_attention` over all the keys.

Shapes: queries `(B, T, N, H)`, keys `(B, S, K, H)`, values `(B, S, K, V)`;
a part is `out` `(B, T, N, V)` and `lse` `(B, T, N)`, both float32.
"""

from keras import ops

import keras_mha.attention.explicit as explicit
import keras_mha.attention.logits as logits
import keras_mha.attention.masks as masks_lib

# The log-sum-exp of a row without keys: finite, so merges stay finite,
# and far below any real one.
EMPTY = logits.MASKED_LOGIT


def empty(batch, length, num_heads, value_dim):
    """The part of no keys: `out` 0, `lse` `EMPTY`."""
    return (
        ops.zeros((batch, length, num_heads, value_dim), "float32"),
        ops.full((batch, length, num_heads), EMPTY, "float32"),
    )


def part(query, key, value, spec, query_positions, key_positions, mask):
    """`(out, lse)` of the queries over these keys.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`.
        value: `(B, S, K, V)`.
        spec: the call's spec: its scale, soft-cap and ALiBi apply here
            (its sinks in `finish`).
        query_positions: integer `(T,)`, the queries' global positions.
        key_positions: integer `(S,)`, the keys'.
        mask: boolean, broadcastable to `(B, N, T, S)`, or `None`.

    Returns:
        `(out, lse)`: `(B, T, N, V)` and `(B, T, N)`, float32.
    """
    query, key, value = explicit.upcast(query, key, value)
    query, key, value = (ops.cast(x, "float32") for x in (query, key, value))
    scores = explicit.modified_logits(query, key, spec, query_positions,
                                      key_positions, None)
    if mask is not None:
        scores = ops.where(mask, scores, ops.cast(EMPTY, scores.dtype))
    top = ops.amax(scores, axis=-1, keepdims=True)  # (B, N, T, 1)
    exp = ops.exp(ops.subtract(scores, top))
    if mask is not None:
        exp = ops.multiply(exp, ops.cast(mask, exp.dtype))
    total = ops.sum(exp, axis=-1, keepdims=True)
    has_key = ops.greater(total, 0)
    total = ops.where(has_key, total, ops.ones_like(total))
    weights = ops.divide(exp, total)
    lse = ops.where(
        has_key, ops.add(top, ops.log(total)), ops.full_like(top, EMPTY)
    )  # (B, N, T, 1)
    lse = ops.transpose(ops.squeeze(lse, -1), (0, 2, 1))  # (B, T, N)
    return explicit.weighted_values(weights, value), lse


def merge(first, second):
    """The part of the keys of both: `(out, lse)`."""
    out_a, lse_a = first
    out_b, lse_b = second
    lse = ops.logaddexp(lse_a, lse_b)
    weight_a = ops.exp(ops.subtract(lse_a, lse))[..., None]
    weight_b = ops.exp(ops.subtract(lse_b, lse))[..., None]
    return ops.add(ops.multiply(out_a, weight_a),
                   ops.multiply(out_b, weight_b)), lse


def finish(whole, sinks, dtype):
    """The output from the part of all the keys.

    Args:
        whole: `(out, lse)` over every key.
        sinks: `None`, or the spec's `(N,)` sink logits: each joins its
            head's denominator.
        dtype: the output's dtype.

    Returns:
        `(B, T, N, V)` in `dtype`; rows without keys are 0.
    """
    out, lse = whole
    has_key = ops.greater(lse, EMPTY / 2)
    if sinks is not None:
        sinks = ops.cast(sinks, "float32")  # (N,)
        with_sink = ops.logaddexp(lse, sinks)
        out = ops.multiply(out, ops.exp(ops.subtract(lse, with_sink))[..., None])
    out = ops.where(has_key[..., None], out, ops.zeros_like(out))
    return ops.cast(out, dtype)


def block_mask(spec, query_positions, key_positions, query_tokens,
               key_tokens):
    """The mask of queries over keys at global positions, `(B|1, 1, T, S)`.

    Args:
        spec: the call's spec (causal, window).
        query_positions, key_positions: integer `(T,)`, `(S,)`.
        query_tokens: `(query_mask, segment_ids)` of these queries (each
            `(B, T)` or `None`).
        key_tokens: `(key_mask, key_segment_ids)` of these keys.
    """
    positional = masks_lib.position_mask(
        ops.reshape(query_positions, (1, 1, -1, 1)),
        ops.reshape(key_positions, (1, 1, 1, -1)),
        spec.causal,
        spec.window,
    )
    query_mask, query_ids = query_tokens
    key_mask, key_ids = key_tokens
    segments = None
    if query_ids is not None:
        segments = masks_lib.segment_mask(query_ids, key_ids)
    return masks_lib.combine_masks(
        masks_lib.padding_mask(query_mask, key_mask), segments, positional
    )
