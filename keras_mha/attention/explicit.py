"""The explicit path: attention that materializes the `(B, N, T, S)` weights.

Shapes: query `(B, T, N, H)`, key `(B, S, K, H)`, value `(B, S, K, V)`.
`N % K == 0`; query head `n` reads key/value head `n // (N // K)`.

It is the documentation of what every other path computes: a query row with
no allowed key gets weights of exactly 0 and a context of 0, and inputs in
float16/bfloat16 are computed in float32 and cast back, so large
activations cannot overflow.
"""

import warnings

import keras
from keras import ops

import keras_mha.attention.masks as masks_lib

# Masked logits are replaced by this before the softmax (float32 scores).
# Finite, so rows with nothing to attend to stay finite before being zeroed.
MASKED_LOGIT = -1e30

_HALF_DTYPES = ("float16", "bfloat16")


def upcast(*tensors):
    """Casts half-precision tensors to float32, leaving others alone."""
    return [
        ops.cast(x, "float32") if ops.dtype(x) in _HALF_DTYPES else x
        for x in tensors
    ]


def softmax(scores):
    """`ops.softmax` over the last axis, without Keras's warning for an axis
    of size 1: one key (`S = 1`) is a valid input here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "You are using a softmax over axis", UserWarning
        )
        return ops.softmax(scores, axis=-1)


def masked_softmax(scores, mask):
    """Softmax over the last axis; masked keys and empty rows get 0."""
    if mask is None:
        return softmax(scores)
    scores = ops.where(mask, scores, ops.cast(MASKED_LOGIT, scores.dtype))
    weights = softmax(scores)
    # A row whose keys are all masked is uniform here; the product zeroes it.
    return ops.multiply(weights, ops.cast(mask, weights.dtype))


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
    mask = masks_lib.spec_mask(
        spec, ops.shape(query)[1], ops.shape(key)[1]
    )
    return masked_attention(query, key, value, mask, spec)


def masked_attention(query, key, value, mask, spec):
    """`explicit_attention` with the mask already built (`None` = all)."""
    out_dtype = query.dtype
    query, key, value = upcast(query, key, value)
    num_heads, num_kv_heads = query.shape[2], key.shape[2]
    groups = num_heads // num_kv_heads
    query = ops.multiply(query, ops.cast(spec.scale, query.dtype))
    batch, t_len = ops.shape(query)[0], ops.shape(query)[1]
    s_len = ops.shape(key)[1]
    if groups == 1:
        scores = ops.einsum("btnh,bsnh->bnts", query, key)  # (B, N, T, S)
    else:
        # Grouped query heads ride along as rows of their key head, so keys
        # and values are never repeated per group.
        grouped = ops.reshape(
            query, (batch, t_len, num_kv_heads, groups, query.shape[3])
        )  # (B, T, K, G, H)
        scores = ops.einsum("btkgh,bskh->bkgts", grouped, key)
        scores = ops.reshape(
            scores, (batch, num_heads, t_len, s_len)
        )  # (B, N, T, S)
    weights = masked_softmax(scores, mask)
    dropped = weights
    if spec.dropout:
        dropped = keras.random.dropout(weights, spec.dropout, seed=spec.seed)
    if groups == 1:
        output = ops.einsum("bnts,bsnv->btnv", dropped, value)
    else:
        dropped = ops.reshape(
            dropped, (batch, num_kv_heads, groups, t_len, s_len)
        )  # (B, K, G, T, S)
        output = ops.einsum("bkgts,bskv->btkgv", dropped, value)
        output = ops.reshape(
            output, (batch, t_len, num_heads, value.shape[-1])
        )  # (B, T, N, V)
    return ops.cast(output, out_dtype), weights
