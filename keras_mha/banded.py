"""Sliding-window attention computed block by block: O(T·w), not O(T·S).

Queries are cut into blocks of `b` consecutive positions. The keys a block
may see lie in one contiguous span: `[start - w + 1, end]` when causal,
`[start - w + 1, end + w - 1]` otherwise. With keys cut into blocks of the
same size and aligned with the query blocks, that span is a fixed number of
whole key blocks, so every query block gets the same static number of keys
and the whole band is a handful of batched matrix products:

    query blocks      (B, n, b, K, G, H)
    key/value spans   (B, n, L + 1 + R blocks of b, K, H|V)
    scores            (B, n, K, G, b, span)

`n = ceil(T / b)`, `L = ceil((w - 1) / b)` key blocks before the query
block, `R = L` after it (`0` when causal). Keys outside `[0, S)` are padding
and masked. All shapes follow from the static `T`, `S`, `w` and `b`, so the
function traces under `jax.jit` and `tf.function` (XLA included) with any
batch size, and the ordinary autodiff of each backend differentiates it with
the same O(T·w) memory.
"""

import math

from keras import ops

from keras_mha import attention as attention_lib
from keras_mha import masks as masks_lib

# Smallest and largest default query block (see `default_block_size`).
_MIN_BLOCK = 32
_MAX_BLOCK = 256


def default_block_size(window, causal):
    """The query block `b` used when none is given.

    TODO: fill from measurements.
    """
    del causal
    block = 1 << max(0, (window - 1).bit_length())  # next power of two >= w
    return max(_MIN_BLOCK, min(_MAX_BLOCK, block))


def banded_attention(
    query,
    key,
    value,
    window,
    causal,
    scale,
    query_mask=None,
    key_mask=None,
    query_offset=0,
    block_size=None,
):
    """Sliding-window attention in O(T·w) time and memory.

    Query `t` sits at absolute position `p = query_offset + t` and may attend
    to key `j` iff `|p - j| < window` and, when `causal`, `j <= p`, ANDed
    with `query_mask` and `key_mask`. The numbers are those of
    `attention.dense_attention` with the equivalent dense mask: a query row
    with no allowed key gets an output of exactly 0 (and finite gradients);
    float16/bfloat16 inputs are computed in float32 and cast back.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`, `N % K == 0`; query head `n` reads key head
            `n // (N // K)` (the keys are not repeated per group).
        value: `(B, S, K, V)`.
        window: `w >= 1`, a Python int.
        causal: whether key `j` must also satisfy `j <= p`.
        scale: multiplies the logits, usually `1 / sqrt(H)`.
        query_mask: `None` or boolean `(B, T)`, `True` = valid query.
        key_mask: `None` or boolean `(B, S)`, `True` = valid key.
        query_offset: absolute position of query 0, a Python int `>= 0`.
        block_size: the query block `b`; `default_block_size(window, causal)`
            if `None`.

    Returns:
        `(B, T, N, V)` in the query's dtype.

    `T` and `S` must be known when tracing; `B` may be dynamic.
    """
    window = _static_int("window", window, minimum=1)
    query_offset = _static_int("query_offset", query_offset, minimum=0)
    if block_size is None:
        block_size = default_block_size(window, causal)
    block = _static_int("block_size", block_size, minimum=1)
    out_dtype = query.dtype
    query, key, value = attention_lib.upcast(query, key, value)
    t_len, num_heads, head = query.shape[1], query.shape[2], query.shape[3]
    s_len, num_kv = key.shape[1], key.shape[2]
    value_head = value.shape[3]
    if t_len is None or s_len is None:
        raise ValueError(
            "`banded_attention` needs static sequence lengths. Received: "
            f"query.shape={query.shape}, key.shape={key.shape}"
        )
    if num_heads % num_kv:
        raise ValueError(
            "The number of key heads must divide the number of query heads. "
            f"Received: query.shape={query.shape}, key.shape={key.shape}"
        )
    groups = num_heads // num_kv
    batch = ops.shape(query)[0]

    num_blocks = -(-t_len // block)  # n
    padded_len = num_blocks * block
    before = -(-(window - 1) // block)  # L key blocks before a query block
    after = 0 if causal else before  # R key blocks after it
    span_blocks = before + 1 + after
    span = span_blocks * block
    # The key frame: absolute positions [frame_start, frame_start + frame_len)
    # cut into n + L + R blocks; query block i sees frame blocks i .. i+L+R.
    frame_start = query_offset - before * block
    frame_len = (num_blocks + before + after) * block

    q = ops.multiply(query, ops.cast(scale, query.dtype))
    q = _pad_axis1(q, 0, padded_len - t_len)  # (B, n·b, N, H)
    q = ops.reshape(
        q, (batch, num_blocks, block, num_kv, groups, head)
    )  # (B, n, b, K, G, H)
    k = _spans(_frame(key, frame_start, frame_len), span_blocks, block)
    v = _spans(_frame(value, frame_start, frame_len), span_blocks, block)
    # k: (B, n, span, K, H), v: (B, n, span, K, V)

    mask = _band_mask(
        batch_mask=(query_mask, key_mask),
        t_len=t_len,
        s_len=s_len,
        num_blocks=num_blocks,
        block=block,
        span_blocks=span_blocks,
        frame_start=frame_start,
        frame_len=frame_len,
        query_offset=query_offset,
        causal=causal,
        window=window,
    )  # (B|1, n, b, span)
    has_key = masks_lib.has_any_key(mask)  # (B|1, n, b, 1)

    scores = ops.einsum("bnrkgh,bnskh->bnkgrs", q, k)  # (B, n, K, G, b, span)
    scores = ops.where(
        mask[:, :, None, None],
        scores,
        ops.cast(attention_lib.MASKED_LOGIT, scores.dtype),
    )
    # A row with no allowed key is uniform here; `has_key` zeroes it below.
    weights = ops.softmax(scores, axis=-1)
    out = ops.einsum(
        "bnkgrs,bnskv->bnrkgv", weights, v
    )  # (B, n, b, K, G, V)
    out = ops.multiply(
        out, ops.cast(has_key[:, :, :, :, None, None], out.dtype)
    )
    out = ops.reshape(
        out, (batch, padded_len, num_heads, value_head)
    )  # (B, n·b, N, V)
    out = out[:, :t_len]  # (B, T, N, V)
    return ops.cast(out, out_dtype)


def _static_int(name, value, minimum):
    try:
        number = int(value)
    except TypeError:
        number = None
    if number is None or number != value or number < minimum:
        raise ValueError(
            f"Argument `{name}` must be a Python integer >= {minimum}. "
            f"Received: {name}={value!r}"
        )
    return number


def _pad_axis1(x, before, after):
    if before == 0 and after == 0:
        return x
    widths = [(0, 0)] * len(x.shape)
    widths[1] = (before, after)
    return ops.pad(x, widths)


def _frame(x, frame_start, frame_len):
    """Positions `[frame_start, frame_start + frame_len)` of `x` along axis 1.

    Positions outside `[0, S)` are zeros (and masked by the caller).
    """
    s_len = x.shape[1]
    first = min(max(frame_start, 0), s_len)
    last = min(max(frame_start + frame_len, 0), s_len)
    x = x[:, first:last]
    pad_before = first - frame_start
    return _pad_axis1(x, pad_before, frame_len - pad_before - (last - first))


def _spans(x, span_blocks, block):
    """`(B, (n + span_blocks - 1)·b, ...)` -> `(B, n, span_blocks·b, ...)`.

    Span `i` is blocks `i .. i + span_blocks - 1`: each key block is copied
    into the `span_blocks` spans that need it, O(T·w) in all.
    """
    shape = ops.shape(x)
    rest = tuple(x.shape[2:])
    num_blocks = x.shape[1] // block - span_blocks + 1
    x = ops.reshape(x, (shape[0], x.shape[1] // block, block) + rest)
    if span_blocks == 1:
        return x
    shifted = [x[:, d : d + num_blocks] for d in range(span_blocks)]
    return ops.concatenate(shifted, axis=2)


def _band_mask(
    batch_mask,
    t_len,
    s_len,
    num_blocks,
    block,
    span_blocks,
    frame_start,
    frame_len,
    query_offset,
    causal,
    window,
):
    """`(B|1, n, b, span)`: which key of its span each query may attend to."""
    query_mask, key_mask = batch_mask
    query_positions = ops.reshape(
        ops.arange(num_blocks * block, dtype="int32") + query_offset,
        (num_blocks, block, 1),
    )  # (n, b, 1)
    key_positions = ops.arange(frame_len, dtype="int32") + frame_start
    key_positions = _spans(
        ops.reshape(key_positions, (1, frame_len)), span_blocks, block
    )[0][:, None, :]  # (n, 1, span)
    mask = masks_lib.position_mask(
        query_positions, key_positions, causal, window
    )  # (n, b, span)
    in_range = ops.logical_and(
        ops.greater_equal(key_positions, 0), ops.less(key_positions, s_len)
    )  # (n, 1, span)
    mask = ops.logical_and(mask, in_range)[None]  # (1, n, b, span)
    if query_mask is not None:
        query_mask = ops.cast(query_mask, "bool")
        query_mask = _pad_axis1(query_mask, 0, num_blocks * block - t_len)
        query_mask = ops.reshape(
            query_mask, (-1, num_blocks, block, 1)
        )  # (B, n, b, 1)
        mask = ops.logical_and(mask, query_mask)
    if key_mask is not None:
        key_mask = _frame(ops.cast(key_mask, "bool"), frame_start, frame_len)
        key_mask = _spans(key_mask, span_blocks, block)[
            :, :, None, :
        ]  # (B, n, 1, span)
        mask = ops.logical_and(mask, key_mask)
    return mask
