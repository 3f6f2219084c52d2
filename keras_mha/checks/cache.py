"""Checks of a decoding call: the cache and its index."""

import numbers

import keras

from keras_mha.attention import cache as cache_lib
from keras_mha.checks.arguments import boolean
from keras_mha.checks.arguments import dims_agree
from keras_mha.checks.arguments import positive_int
from keras_mha.checks.arguments import shape_and_dtype

def cache_slots(layer, batch_size, max_length, in_place):
    """Checks the arguments of `layer.init_cache`; returns its cache's
    number of slots: `max_length`, or the rolling cache's."""
    positive_int("batch_size", batch_size)
    positive_int("max_length", max_length)
    boolean("in_place", in_place)
    return layer.settings.rolling_slots if layer.rolling_cache else max_length


def cache_index(index, length, num_slots, rolling):
    """Checks `cache_update_index`: a Python or scalar integer tensor.

    An index with a value (a Python int, or a tensor in an eager call) must
    fit a full cache of `num_slots` with `length` new tokens. A traced one
    cannot be checked; an out-of-range write then writes nothing (see
    `cache._write_run`).
    """
    if isinstance(index, bool) or not (
        isinstance(index, numbers.Integral)
        or (
            hasattr(index, "shape")
            and len(index.shape) == 0
            and "int" in keras.backend.standardize_dtype(index.dtype)
        )
    ):
        raise ValueError(
            "`cache_update_index` must be an integer or a scalar integer "
            f"tensor. Received: cache_update_index={index!r}"
        )
    if not rolling and length is not None and length > num_slots:
        raise ValueError(
            f"{length} new tokens do not fit a cache of {num_slots} slots "
            f"at any `cache_update_index`. Received: key.shape[1]={length}"
        )
    value = cache_lib.concrete_int(index)  # `None` when traced
    if value is not None:
        index = value
        if index < 0 or (
            not rolling and length is not None and index + length > num_slots
        ):
            raise ValueError(
                "`cache_update_index` is out of range: positions "
                f"{index}..{index + (length or 1) - 1} do not fit a "
                f"cache of {num_slots} slots. Received: "
                f"cache_update_index={index}"
            )


def cache_call(
    query, value, key, cache, index, *, use_causal_mask, attention_mask,
    num_kv_heads, key_dim, value_dim, window,
):
    """Checks a layer call with `cache=`/`cache_update_index=` from shapes.

    `window` is the rolling cache's number of slots, or `None` for a full
    cache.
    """
    if cache is None or index is None:
        raise ValueError(
            "`cache` and `cache_update_index` go together. Received: "
            f"cache={'None' if cache is None else 'a cache'}, "
            f"cache_update_index={index!r}"
        )
    if not use_causal_mask:
        raise ValueError(
            "Decoding with a cache needs `use_causal_mask=True`. "
            f"Received: use_causal_mask={use_causal_mask}"
        )
    if len(query.shape) != 3:
        raise ValueError(
            "A cache needs inputs of rank 3 (batch, sequence, features). "
            f"Received: query.shape={tuple(query.shape)}"
        )
    if attention_mask is not None:
        raise ValueError(
            "`attention_mask` is not supported with a cache; pass "
            "`query_mask`/`value_mask` (the cache remembers padding). "
            "Received: attention_mask with shape "
            f"{shape_and_dtype(attention_mask)[0]}"
        )
    for name, tensor in (("value", value), ("key", key)):
        if not dims_agree(tuple(tensor.shape)[1:2], query.shape[1:2]):
            raise ValueError(
                f"With a cache, `{name}` holds the new tokens: it must "
                "have the length of `query`. Received: "
                f"query.shape={tuple(query.shape)}, "
                f"{name}.shape={tuple(tensor.shape)}"
            )
    keys = cache_parts(cache)[0]
    num_slots = window if window is not None else (
        keys.shape[1] if len(keys.shape) > 1 else None
    )
    expected = cache_lib.cache_shapes(
        query.shape[0], num_slots, num_kv_heads, key_dim, value_dim
    )
    part_shapes(cache, expected, "`(keys, values, valid)` of shapes "
                "(B, L, K, H), (B, L, K, V) and (B, L)")
    cache_index(index, query.shape[1], keys.shape[1], window is not None)


def part_shapes(cache, expected, described):
    """Checks each part of the tuple `cache` against its shape in
    `expected` (`None` sizes are unknown); `described` says what the
    parts are and their shapes."""
    for i, (part, want) in enumerate(zip(cache, expected)):
        shape = tuple(part.shape)
        if len(shape) != len(want) or not dims_agree(shape, want):
            raise ValueError(
                f"`cache` must be {described} = {expected} (see "
                f"`init_cache`). Received: cache[{i}].shape={shape}"
            )


def cache_parts(cache):
    """`cache` is our layer's `(keys, values, valid)` (`init_cache`):
    floating-point keys and values, boolean flags."""
    if not isinstance(cache, (tuple, list)) or len(cache) != 3:
        received = (
            f"cache.shape={tuple(cache.shape)}" if hasattr(cache, "shape")
            else f"cache of type {type(cache).__name__}"
        )
        raise TypeError(
            "`cache` must be the tuple `(keys, values, valid)` that "
            f"`init_cache` returns. Received: {received}"
        )
    for i, part in enumerate(cache[:2]):
        cache_tensor(part, f"cache[{i}]")
    valid = cache[2]
    tensor = hasattr(valid, "shape") and hasattr(valid, "dtype")
    dtype = keras.backend.standardize_dtype(valid.dtype) if tensor else None
    if dtype != "bool":
        raise TypeError(
            "`cache[2]` (valid) must be a boolean tensor (see `init_cache`). "
            "Received: " + (f"cache[2].dtype={dtype}" if tensor else
                            f"cache[2] of type {type(valid).__name__}")
        )
    return cache


def cache_tensor(cache, name="cache"):
    """`cache` (named `name`) is a floating-point tensor."""
    if not hasattr(cache, "shape") or not hasattr(cache, "dtype"):
        raise TypeError(
            f"`{name}` must be a tensor (see `init_cache`). Received: "
            f"{name} of type {type(cache).__name__}"
        )
    dtype = keras.backend.standardize_dtype(cache.dtype)
    if "float" not in dtype:
        raise TypeError(
            f"`{name}` must be a floating-point tensor (see `init_cache`). "
            f"Received: {name}.dtype={dtype}"
        )
