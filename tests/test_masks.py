"""Mask builders against small hand-written expectations."""

import numpy as np
import pytest
from util import to_numpy

from keras_mha.attention import AttentionSpec
from keras_mha.attention import masks
from keras_mha.attention.spec import window_sides

T, F = True, False


def _mask(query_length, key_length, causal, window, offset=0, **fields):
    """The spec's mask; `window` is a layer's `w` or a `(left, right)`."""
    if not isinstance(window, tuple):
        window = window_sides(window, causal)
    spec = AttentionSpec(scale=1.0, causal=causal, window=window,
                         query_offset=offset, **fields)
    mask = masks.spec_mask(spec, query_length, key_length)
    return None if mask is None else to_numpy(mask)[0, 0]


def test_nothing_to_mask_is_none():
    assert _mask(3, 3, causal=False, window=None) is None


def test_causal_is_top_left_aligned():
    np.testing.assert_array_equal(
        _mask(2, 4, causal=True, window=None),
        [[T, F, F, F],
         [T, T, F, F]],
    )


def test_symmetric_window():
    np.testing.assert_array_equal(
        _mask(4, 4, causal=False, window=2),
        [[T, T, F, F],
         [T, T, T, F],
         [F, T, T, T],
         [F, F, T, T]],
    )


def test_causal_window_counts_the_query_itself():
    # w = 2 keys: the query's own position and the one before it.
    np.testing.assert_array_equal(
        _mask(4, 4, causal=True, window=2),
        [[T, F, F, F],
         [T, T, F, F],
         [F, T, T, F],
         [F, F, T, T]],
    )


def test_window_of_one_is_the_diagonal():
    np.testing.assert_array_equal(
        _mask(3, 3, causal=False, window=1), np.eye(3, dtype=bool)
    )


def test_offset_places_queries_at_absolute_positions():
    # Two queries at positions 3 and 4 of a 5-slot cache, causal, w = 3.
    np.testing.assert_array_equal(
        _mask(2, 5, causal=True, window=3, offset=3),
        [[F, T, T, T, F],
         [F, F, T, T, T]],
    )


def test_asymmetric_window():
    # (left, right) = (1, 2): p - 1 <= j <= p + 2.
    np.testing.assert_array_equal(
        _mask(4, 5, causal=False, window=(1, 2)),
        [[T, T, T, F, F],
         [T, T, T, T, F],
         [F, T, T, T, T],
         [F, F, T, T, T]],
    )
    # Either side may be 0.
    np.testing.assert_array_equal(
        _mask(3, 3, causal=False, window=(0, 1)),
        [[T, T, F],
         [F, T, T],
         [F, F, T]],
    )


def test_key_positions_place_cached_keys():
    # A rolling cache of 3 slots holding positions 3, 4 and (empty) -1,
    # then the new token at position 5; causal, w = 3.
    mask = _mask(1, 4, causal=True, window=3, offset=5,
                 key_positions=np.array([3, 4, -1, 5]))
    np.testing.assert_array_equal(mask, [[T, T, F, T]])


def test_open_empty_rows_then_zero_them():
    mask = np.array([[[[T, F], [F, F]]]])  # (1, 1, 2, 2), row 1 empty
    opened, has_key = masks.open_empty_rows(mask)
    np.testing.assert_array_equal(to_numpy(opened)[0, 0], [[T, F], [T, T]])
    np.testing.assert_array_equal(to_numpy(has_key)[0, 0, :, 0], [T, F])
    out = masks.zero_empty_rows(np.ones((1, 1, 2, 1), "float32"), has_key)
    np.testing.assert_array_equal(to_numpy(out)[0, 0, :, 0], [1.0, 0.0])


def test_padding_mask_combines_query_and_key():
    query_mask = np.array([[T, F]])
    key_mask = np.array([[T, T, F]])
    mask = to_numpy(masks.padding_mask(query_mask, key_mask))
    assert mask.shape == (1, 1, 2, 3)
    np.testing.assert_array_equal(mask[0, 0], [[T, T, F], [F, F, F]])
    assert masks.padding_mask(None, None) is None


@pytest.mark.parametrize("count", [0, 1, 3])
def test_combine_masks_is_and(count):
    parts = [np.array([[T, T, F, F]]), np.array([[T, F, T, F]]),
             np.array([[T, T, T, T]])][:count]
    result = masks.combine_masks(None, *parts, None)
    if count == 0:
        assert result is None
    else:
        np.testing.assert_array_equal(
            to_numpy(result), np.logical_and.reduce(parts)
        )
