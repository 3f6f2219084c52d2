"""Attention algorithms as pure functions of projected heads.

Shapes: query `(B, T, N, H)`, key `(B, S, K, H)`, value `(B, S, K, V)`,
mask broadcastable to `(B, N, T, S)` (`True` = may attend). `N % K == 0`;
query head `n` reads key/value head `n // (N // K)`.

Every function here gives the same numbers: a query row with no allowed key
gets weights of exactly 0 and a context of 0. Inputs in float16/bfloat16 are
computed in float32 and cast back, so large activations cannot overflow.
"""

import warnings

import keras
from keras import ops

from keras_mha import masks as masks_lib

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


def _group_queries(query, num_kv_heads):
    """`(B, T, N, H)` -> `(B, T, K, G, H)`, `G = N // K`."""
    shape = ops.shape(query)
    groups = query.shape[2] // num_kv_heads
    return ops.reshape(
        query, (shape[0], shape[1], num_kv_heads, groups, query.shape[3])
    )


def dense_attention(query, key, value, mask=None, scale=1.0, dropout=None):
    """Explicit attention that materializes the `(B, N, T, S)` weights.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`.
        value: `(B, S, K, V)`.
        mask: `None` or boolean, broadcastable to `(B, N, T, S)`.
        scale: multiplies the logits, usually `1 / sqrt(H)`.
        dropout: `None` or a callable applied to the weights.

    Returns:
        `(output, weights)`: `(B, T, N, V)` in the query's dtype and the
        attention weights `(B, N, T, S)` before dropout.
    """
    out_dtype = query.dtype
    query, key, value = upcast(query, key, value)
    num_heads, num_kv_heads = query.shape[2], key.shape[2]
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    if num_kv_heads == num_heads:
        scores = ops.einsum("btnh,bsnh->bnts", query, key)  # (B, N, T, S)
    else:
        grouped = _group_queries(query, num_kv_heads)  # (B, T, K, G, H)
        scores = ops.einsum("btkgh,bskh->bkgts", grouped, key)
        shape = ops.shape(scores)
        scores = ops.reshape(
            scores, (shape[0], num_heads, shape[3], shape[4])
        )  # (B, N, T, S)
    weights = masked_softmax(scores, mask)
    dropped = weights if dropout is None else dropout(weights)
    if num_kv_heads == num_heads:
        output = ops.einsum("bnts,bsnv->btnv", dropped, value)
    else:
        shape = ops.shape(dropped)
        grouped = ops.reshape(
            dropped,
            (shape[0], num_kv_heads, num_heads // num_kv_heads)
            + (shape[2], shape[3]),
        )  # (B, K, G, T, S)
        output = ops.einsum("bkgts,bskv->btkgv", grouped, value)
        shape = ops.shape(output)
        output = ops.reshape(
            output, (shape[0], shape[1], num_heads, value.shape[-1])
        )  # (B, T, N, V)
    return ops.cast(output, out_dtype), weights


def fused_attention(
    query,
    key,
    value,
    mask=None,
    is_causal=False,
    scale=1.0,
    flash_attention=None,
):
    """Attention through `keras.ops.dot_product_attention`.

    Same arguments and result as `dense_attention`, without the weights.
    `is_causal=True` is only passed on when `mask` is `None`, so the backend
    can use its native causal kernel; otherwise the caller folds causality
    into `mask`.
    """
    out_dtype = query.dtype
    query, key, value = upcast(query, key, value)
    groups = query.shape[2] // key.shape[2]
    if groups > 1 and keras.backend.backend() != "jax":
        # Only JAX's kernel takes grouped heads on every K: Keras's
        # TensorFlow kernel fails for K == 1, its NumPy one for K > 1 (and
        # its torch one repeats the heads itself).
        key = ops.repeat(key, groups, axis=2)  # (B, S, N, H)
        value = ops.repeat(value, groups, axis=2)  # (B, S, N, V)
    has_key = None
    if mask is not None:
        # The fused kernels answer rows with nothing to attend to with the
        # mean of the values (or NaN); open those rows, then zero them.
        has_key = masks_lib.has_any_key(mask)  # (B|1, N|1, T, 1)
        mask = ops.logical_or(mask, ops.logical_not(has_key))
    output = ops.dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        is_causal=is_causal and mask is None,
        flash_attention=flash_attention,
    )  # (B, T, N, V)
    if has_key is not None:
        keep = ops.transpose(has_key, (0, 2, 1, 3))  # (B|1, T, N|1, 1)
        output = ops.multiply(output, ops.cast(keep, output.dtype))
    return ops.cast(output, out_dtype)


# Queries per block of `triangular_attention`. Measured on the 2-core CPU
# (JAX, B = 1, N = 8, H = 64): 512 beat 128 and 256 at T = 1024 and 4096.
TRIANGLE_BLOCK = 512


def triangular_attention(
    query, key, value, scale=1.0, query_mask=None, key_mask=None,
    block_size=TRIANGLE_BLOCK,
):
    """Causal self-attention a block of queries at a time.

    Query block `[start, stop)` attends to keys `[0, stop)` only, so of the
    `(T, T)` scores just the lower triangle and the diagonal blocks are
    computed: about half the FLOPs of the full matrix, and `(B, N, b, T)`
    weights alive at a time. The blocks are a Python loop over static
    slices (`T` must be static), each one `dense_attention`, so the numbers
    and the empty-row rule are the explicit path's.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, T, K, H)`.
        value: `(B, T, K, V)`.
        scale: multiplies the logits.
        query_mask: `None` or boolean `(B, T)`.
        key_mask: `None` or boolean `(B, T)`.
        block_size: queries per block `b`.

    Returns:
        `(B, T, N, V)` in the query's dtype.
    """
    length = query.shape[1]
    if length is None or length != key.shape[1]:
        raise ValueError(
            "`triangular_attention` needs static, equal query and key "
            f"lengths. Received: query.shape={query.shape}, "
            f"key.shape={key.shape}"
        )
    outputs = []
    for start in range(0, length, block_size):
        stop = min(length, start + block_size)
        mask = masks_lib.combine_masks(
            masks_lib.padding_mask(
                None if query_mask is None else query_mask[:, start:stop],
                None if key_mask is None else key_mask[:, :stop],
            ),
            masks_lib.causal_window_mask(
                stop - start, stop, causal=True, window=None, offset=start
            ),
        )  # (B|1, 1, b, stop)
        output, _ = dense_attention(
            query[:, start:stop],
            key[:, :stop],
            value[:, :stop],
            mask=mask,
            scale=scale,
        )
        outputs.append(output)  # (B, b, N, V)
    if len(outputs) == 1:
        return outputs[0]
    return ops.concatenate(outputs, axis=1)
