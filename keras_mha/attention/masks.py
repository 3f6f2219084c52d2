"""Attention masks as small pure functions of positions, and the spec's mask.

Every mask is boolean with `True` meaning "may attend". Masks are combined
with a logical AND. The canonical rank is 4, `(B, N, T, S)`, with size-1 axes
where a mask does not depend on that axis.

Query `t` sits at absolute position `offset + t` (the offset is the cache
index while decoding, 0 otherwise); key `j` sits at position `j`, or at the
position its cache slot holds.
"""

from keras import ops


def position_mask(query_positions, key_positions, causal, window,
                  chunk=None):
    """Which keys each query may see, from absolute positions alone.

    The one rule for the causal mask, the sliding window and the chunks;
    every attention path (explicit, fused, banded, blocked, triangular,
    cached) builds its masks with it.

    Args:
        query_positions: integer tensor broadcastable against
            `key_positions`, e.g. `(T, 1)`.
        key_positions: integer tensor, e.g. `(1, S)`.
        causal: whether key `j` must satisfy `j <= p`.
        window: `None`, or `(left, right)`: `p - left <= j <= p + right`.
        chunk: `None`, or `C`: `j // C == p // C` (a negative `j`, a slot
            without a token, is in no query's chunk).

    Returns:
        Boolean tensor of the broadcast shape, or `None` when nothing is
        masked.
    """
    mask = None
    if causal:
        mask = ops.greater_equal(query_positions, key_positions)
    if window is not None:
        left, right = window
        distance = query_positions - key_positions  # p - j
        in_window = ops.logical_and(
            ops.less_equal(distance, left), ops.greater_equal(distance, -right)
        )
        mask = combine_masks(mask, in_window)
    if chunk is not None:
        same_chunk = ops.equal(
            ops.floor_divide(query_positions, chunk),
            ops.floor_divide(key_positions, chunk),
        )
        mask = combine_masks(mask, same_chunk)
    return mask


def padding_mask(query_mask=None, key_mask=None):
    """Combines per-token masks `(B, T)` and `(B, S)` into `(B, 1, T, S)`.

    Either may be `None`; the result is `None` when both are.
    """
    mask = None
    if query_mask is not None:
        query_mask = ops.cast(query_mask, "bool")
        mask = query_mask[:, None, :, None]  # (B, 1, T, 1)
    if key_mask is not None:
        key_mask = ops.cast(key_mask, "bool")
        mask = combine_masks(mask, key_mask[:, None, None, :])  # (B, 1, 1, S)
    return mask


def boolean(mask):
    """`mask` as booleans, or `None`."""
    return None if mask is None else ops.cast(mask, "bool")


def combine_masks(*masks):
    """Logical AND of the masks that are not `None` (or `None`)."""
    result = None
    for mask in masks:
        if mask is None:
            continue
        result = mask if result is None else ops.logical_and(result, mask)
    return result


def segment_mask(query_segments, key_segments):
    """`(B, 1, T, S)`: a query sees only keys of its own segment id."""
    return ops.equal(
        query_segments[:, None, :, None], key_segments[:, None, None, :]
    )


def spec_mask(spec, query_length, key_length, query_start=None,
              batch_size=None, num_heads=None):
    """The whole mask a spec asks for, `(B|1, N|1, T, S)`, or `None`.

    With `query_start`, the mask of one block of queries
    `[query_start, query_start + query_length)` against keys
    `[0, key_length)` (the triangular path's blocks; static sizes).
    `batch_size` and `num_heads` size the index tensors a mask function
    (`spec.mask_mod`) is evaluated on.
    """
    start = 0 if query_start is None else query_start
    positional = None
    if (
        spec.causal
        or spec.window is not None
        or spec.chunk is not None
        or spec.key_positions is not None
    ):
        positional = _positional(spec, query_length, key_length, start)
    query_mask, key_mask, dense = (
        spec.query_mask, spec.key_mask, spec.attention_mask
    )
    query_segments, key_segments = spec.segment_ids, spec.key_segment_ids
    if query_start is not None:
        stop = start + query_length
        if query_mask is not None:
            query_mask = query_mask[:, start:stop]
        if key_mask is not None:
            key_mask = key_mask[:, :key_length]
        if dense is not None:
            dense = block(dense, start, stop, key_length)
        if query_segments is not None:
            query_segments = query_segments[:, start:stop]
            key_segments = key_segments[:, :key_length]
    segments = None
    if query_segments is not None:
        segments = segment_mask(query_segments, key_segments)
    programmed = None
    if spec.mask_mod is not None:
        programmed = spec.mask_mod.evaluate(*index_tensors(
            batch_size, num_heads,
            *positions(spec, query_length, key_length, start)))
    return combine_masks(
        padding_mask(query_mask, key_mask), dense, segments, positional,
        programmed,
    )


def index_tensors(batch_size, num_heads, query_positions, key_positions):
    """What a mask or score function is evaluated on: the batch `(B, 1,
    1, 1)`, head `(1, N, 1, 1)`, query `(1, 1, T, 1)` and key `(1, 1, 1,
    S)` indices, int32, from positions `(T,)` and `(S,)`."""
    return (
        ops.reshape(ops.arange(batch_size, dtype="int32"), (-1, 1, 1, 1)),
        ops.reshape(ops.arange(num_heads, dtype="int32"), (1, -1, 1, 1)),
        ops.reshape(ops.cast(query_positions, "int32"), (1, 1, -1, 1)),
        ops.reshape(ops.cast(key_positions, "int32"), (1, 1, 1, -1)),
    )


def block(dense, start, stop, key_length):
    """Rows `[start, stop)` and keys `[0, key_length)` of a
    `(B|1, N|1, T|1, S|1)` tensor, keeping its size-1 axes."""
    rows = slice(None) if dense.shape[2] == 1 else slice(start, stop)
    cols = slice(None) if dense.shape[3] == 1 else slice(0, key_length)
    return dense[:, :, rows, cols]


def positions(spec, query_length, key_length, start=0):
    """`(query_positions (T,), key_positions (S,))`, int32: where the
    queries `[start, start + T)` and the keys `[0, S)` of the spec sit."""
    query_positions = ops.arange(query_length, dtype="int32")
    if start:
        query_positions = query_positions + start
    if not spec.keys_at_own_positions:
        query_positions = query_positions + ops.cast(spec.query_offset, "int32")
    if spec.key_positions is None:
        key_positions = ops.arange(key_length, dtype="int32")
    else:
        key_positions = ops.cast(spec.key_positions, "int32")
    return query_positions, key_positions


def _positional(spec, query_length, key_length, start):
    """The spec's causal, window, chunk and written-slot mask `(1, 1, T,
    S)`."""
    query_positions, key_positions = positions(
        spec, query_length, key_length, start
    )
    positional = position_mask(
        ops.reshape(query_positions, (1, 1, -1, 1)),  # (1, 1, T, 1)
        ops.reshape(key_positions, (1, 1, 1, -1)),  # (1, 1, 1, S)
        spec.causal,
        spec.window,
        spec.chunk,
    )
    if spec.key_positions is not None:
        # A negative position marks a slot that holds no token.
        written = ops.reshape(key_positions >= 0, (1, 1, 1, -1))
        positional = combine_masks(positional, written)
    return positional


def has_any_key(mask):
    """`(..., T, 1)`: whether each query row may attend to at least one key."""
    return ops.any(mask, axis=-1, keepdims=True)


def open_empty_rows(mask):
    """`(mask, has_key)`: rows with no allowed key opened to every key.

    Fused kernels answer a row with nothing to attend to with the mean of
    the values, or NaN; the opened row computes something finite, and
    `zero_empty_rows` then sets it to the defined answer, 0.
    """
    has_key = has_any_key(mask)
    return ops.logical_or(mask, ops.logical_not(has_key)), has_key


def zero_empty_rows(output, has_key):
    """`output` times `has_key` (already in the output's layout)."""
    return ops.multiply(output, ops.cast(has_key, output.dtype))
