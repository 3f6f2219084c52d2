"""The explicit path: attention that materializes the `(B, N, T, S)` weights.

Shapes: query `(B, T, N, H)`, key `(B, S, K, H)`, value `(B, S, K, V)`.
`N % K == 0`; query head `n` reads key/value head `n // (N // K)`.

It is the documentation of what every other path computes: a query row with
no allowed key gets weights of exactly 0 and a context of 0, and inputs in
float16/bfloat16 are computed in float32 and cast back, so large
activations cannot overflow.
"""

import keras
from keras import ops

import keras_mha.attention.logits as logits
import keras_mha.attention.masks as masks_lib

_HALF_DTYPES = ("float16", "bfloat16")


def upcast(*tensors):
    """Casts half-precision tensors to float32, leaving others alone."""
    return [
        ops.cast(x, "float32") if ops.dtype(x) in _HALF_DTYPES else x
        for x in tensors
    ]


def static_self_length(path, query, key):
    """`T` of a causal self-attention path (`blocked`, `triangular`), whose
    blocks need static, equal query and key lengths; a `ValueError`
    otherwise."""
    length = query.shape[1]
    if length is None or length != key.shape[1]:
        raise ValueError(
            f"`{path}` needs static, equal query and key lengths. Received: "
            f"query.shape={query.shape}, key.shape={key.shape}"
        )
    return length


def explicit_attention(query, key, value, spec):
    """Attention as `spec` asks, with the weights.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`.
        value: `(B, S, K, V)`.
        spec: the `AttentionSpec` of the call.

    Returns:
        `(output, weights)`: `(B, T, N, V)` in the query's dtype and the
        attention weights `(B, N, T, S)` before dropout.
    """
    t_len, s_len = ops.shape(query)[1], ops.shape(key)[1]
    mask = masks_lib.spec_mask(spec, t_len, s_len,
                               batch_size=ops.shape(query)[0],
                               num_heads=query.shape[2])
    return masked_attention(
        query, key, value, mask, spec, masks_lib.positions(spec, t_len, s_len),
        spec.bias,
    )


def masked_attention(query, key, value, mask, spec, positions, bias):
    """`explicit_attention` with the mask already built (`None` = all).

    `positions` are the queries' and keys' `(T,)` and `(S,)` positions and
    `bias` the spec's bias for them (see `logits.dense_term`).
    """
    out_dtype = query.dtype
    query, key, value = upcast(query, key, value)
    scores = modified_logits(query, key, spec, *positions, bias)
    sinks = None
    if spec.sinks is not None:
        sinks = ops.reshape(spec.sinks, (1, query.shape[2], 1, 1))
    weights = logits.weights(scores, mask, sinks)
    dropped = weights
    if spec.dropout:
        dropped = keras.random.dropout(weights, spec.dropout, seed=spec.seed)
    return ops.cast(weighted_values(dropped, value), out_dtype), weights


def modified_logits(query, key, spec, query_positions, key_positions, bias):
    """The logits `(B, N, T, S)` of queries `(B, T, N, H)` over keys
    `(B, S, K, H)`, scaled, soft-capped, with the bias (or `None`) and
    ALiBi added (see `logits.py` for the order).

    Grouped query heads ride along as rows of their key head, `(B, T, K,
    G, H)`, so keys are never repeated per group.
    """
    num_heads, num_kv_heads = query.shape[2], key.shape[2]
    groups = num_heads // num_kv_heads
    query = ops.multiply(query, ops.cast(spec.scale, query.dtype))
    batch, t_len = ops.shape(query)[0], ops.shape(query)[1]
    s_len = ops.shape(key)[1]
    if groups == 1:
        scores = ops.einsum("btnh,bsnh->bnts", query, key)  # (B, N, T, S)
    else:
        grouped = ops.reshape(
            query, (batch, t_len, num_kv_heads, groups, query.shape[3])
        )  # (B, T, K, G, H)
        scores = ops.einsum("btkgh,bskh->bkgts", grouped, key)
        scores = ops.reshape(
            scores, (batch, num_heads, t_len, s_len)
        )  # (B, N, T, S)
    scores = logits.soft_cap(scores, spec.soft_cap)
    scores = logits.add(scores, logits.dense_term(
        spec, query_positions, key_positions, bias, scores.dtype
    ))
    if spec.score_mod is None:
        return scores
    return spec.score_mod(scores, *masks_lib.index_tensors(
        batch, num_heads, query_positions, key_positions))


def weighted_values(weights, value):
    """The context `(B, T, N, V)` of weights `(B, N, T, S)` over values
    `(B, S, K, V)`; grouped weights ride along as rows of their value
    head, as `modified_logits` reads the queries."""
    batch, num_heads, t_len, s_len = (
        ops.shape(weights)[0], weights.shape[1], ops.shape(weights)[2],
        ops.shape(weights)[3],
    )
    num_kv_heads = value.shape[2]
    groups = num_heads // num_kv_heads
    if groups == 1:
        return ops.einsum("bnts,bsnv->btnv", weights, value)
    weights = ops.reshape(
        weights, (batch, num_kv_heads, groups, t_len, s_len)
    )  # (B, K, G, T, S)
    output = ops.einsum("bkgts,bskv->btkgv", weights, value)
    return ops.reshape(
        output, (batch, t_len, num_heads, value.shape[-1])
    )  # (B, T, N, V)
