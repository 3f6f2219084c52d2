"""Attention masks as small pure functions of positions.

Every mask is boolean with `True` meaning "may attend". Masks are combined
with a logical AND. The canonical rank is 4, `(B, N, T, S)`, with size-1 axes
where a mask does not depend on that axis.

Query `t` sits at absolute position `offset + t` (the offset is the cache
index while decoding, 0 otherwise); key `j` sits at position `j`.
"""

from keras import ops


def position_mask(query_positions, key_positions, causal, window):
    """Which keys each query may see, from absolute positions alone.

    The one rule for the causal mask and the sliding window; every attention
    path (dense, banded, cached) builds its masks with it.

    Args:
        query_positions: integer tensor broadcastable against
            `key_positions`, e.g. `(T, 1)`.
        key_positions: integer tensor, e.g. `(1, S)`.
        causal: whether key `j` must satisfy `j <= p`.
        window: `None`, or the window `w`: `|p - j| < w`.

    Returns:
        Boolean tensor of the broadcast shape, or `None` when nothing is
        masked.
    """
    mask = None
    if causal:
        mask = ops.greater_equal(query_positions, key_positions)
    if window is not None:
        in_window = ops.less(ops.abs(query_positions - key_positions), window)
        mask = in_window if mask is None else ops.logical_and(mask, in_window)
    return mask


def causal_window_mask(query_length, key_length, causal, window, offset=0):
    """The causal and sliding-window mask of shape `(1, 1, T, S)`, or `None`.

    Built by comparing `arange` indices, so it works with dynamic lengths.
    """
    if not causal and window is None:
        return None
    query_positions = ops.arange(query_length, dtype="int32") + offset
    key_positions = ops.arange(key_length, dtype="int32")
    mask = position_mask(
        ops.reshape(query_positions, (1, 1, -1, 1)),  # (1, 1, T, 1)
        ops.reshape(key_positions, (1, 1, 1, -1)),  # (1, 1, 1, S)
        causal,
        window,
    )
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


def combine_masks(*masks):
    """Logical AND of the masks that are not `None` (or `None`)."""
    result = None
    for mask in masks:
        if mask is None:
            continue
        result = mask if result is None else ops.logical_and(result, mask)
    return result


def has_any_key(mask):
    """`(..., T, 1)`: whether each query row may attend to at least one key."""
    return ops.any(mask, axis=-1, keepdims=True)
