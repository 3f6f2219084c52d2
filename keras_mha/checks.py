"""Argument checking for the layers: one validator per kind of argument.

Every check runs before any backend op, from Python values, shapes and
dtypes alone, so bad input fails with a `ValueError` or `TypeError` that
names the argument and the value received (`... Received: name=value`),
also while a Functional model is built from `keras.Input`s. Where Keras's
layer has a message for the same error, its wording is included.
"""

import numbers

import keras
import numpy as np

from keras_mha.attention import cache as cache_lib
from keras_mha.axes import AxesLayout


def positive_int(name, value, allow_none=False):
    """`value` as a Python int (NumPy integers too), or `None`."""
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value <= 0
    ):
        expected = "a positive integer" + (" or `None`" if allow_none else "")
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected "
            f"{expected}. Received: {name}={value!r}"
        )
    return int(value)


def positive_number(name, value, allow_none=False):
    """`value` as a Python float `> 0` (finite), or `None`."""
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0.0 < float(value) < float("inf")
    ):
        expected = "a positive number" + (" or `None`" if allow_none else "")
        raise ValueError(
            f"Argument `{name}` must be {expected}. Received: {name}={value!r}"
        )
    return float(value)


def boolean(name, value):
    """`value` as a Python bool; Python and NumPy booleans only."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"Argument `{name}` must be `True` or `False`. "
            f"Received: {name}={value!r}"
        )
    return bool(value)


def sliding_window(value):
    """`None`, a positive int `w`, or a pair `(left, right)` of ints
    `>= 0` (a tuple); a JSON list from a config is a pair too."""
    if value is None:
        return None
    message = (
        "`sliding_window` must be `None`, a positive integer or a pair "
        "`(left, right)` of non-negative integers. "
        f"Received: sliding_window={value!r}"
    )

    def integer(x, low):
        return (
            isinstance(x, numbers.Integral)
            and not isinstance(x, bool)
            and x >= low
        )

    if isinstance(value, (tuple, list)):
        if len(value) != 2 or not all(integer(side, 0) for side in value):
            raise ValueError(message)
        return (int(value[0]), int(value[1]))
    if not integer(value, 1):
        raise ValueError(message)
    return int(value)


def rotary_embedding(value):
    """`None`, or a callable layer (`keras_mha.RotaryEmbedding`, or
    keras-hub's, called as `layer(x, start_index=...)`)."""
    if value is not None and not callable(value):
        raise TypeError(
            "Argument `rotary_embedding` must be `None` or a layer called "
            "as `layer(x, start_index=...)`, such as "
            "`keras_mha.RotaryEmbedding()`. "
            f"Received: rotary_embedding={value!r}"
        )
    return value


def dropout_rate(value):
    """A dropout rate in `[0, 1)` as a Python float."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0.0 <= value < 1.0
    ):
        raise ValueError(
            "Argument `dropout` must be a number in [0, 1). "
            f"Received: dropout={value!r}"
        )
    return float(value)


def flash_attention(value, dropout):
    """`None`, `True` or `False`; `True` only without dropout."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(
            "Argument `flash_attention` must be `None`, `True` or `False`. "
            f"Received: flash_attention={value!r}"
        )
    if value and dropout > 0.0:
        raise ValueError(
            "Dropout is not supported when flash attention is enabled. "
            "Please set dropout to 0.0 to use flash attention. "
            f"Received: flash_attention=True, dropout={dropout}"
        )
    return value


def output_shape(value):
    """`None`, or a tuple of positive ints from an int or a sequence."""
    if value is None:
        return None
    shape = value
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d > 0
        for d in shape
    ):
        raise ValueError(
            f"Invalid `output_shape`: {value!r}. It must be a positive "
            "integer or a tuple of positive integers. "
            f"Received: output_shape={value!r}"
        )
    return tuple(int(d) for d in shape) or None


def attention_axes(value):
    """`None`, or a non-empty tuple of ints from an int or a sequence."""
    if value is None:
        return None
    axes = value
    if isinstance(axes, int) and not isinstance(axes, bool):
        axes = (axes,)
    if (
        not isinstance(axes, (tuple, list))
        or not axes
        or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes)
    ):
        raise ValueError(
            "Argument `attention_axes` must be an int or a non-empty tuple "
            f"of ints. Received: attention_axes={value!r}"
        )
    return tuple(axes)


def shape_and_dtype(x):
    """`(shape, dtype)` of a tensor, `KerasTensor`, array or nested list."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    try:
        dtype = keras.backend.standardize_dtype(x.dtype)
    except ValueError:  # not a dtype Keras has (strings, objects)
        dtype = str(x.dtype)
    return tuple(x.shape), dtype


def mask_argument(name, value, targets, broadcast=True):
    """Checks that a mask has a mask's dtype and a shape it may have.

    Boolean, integer or float, as Keras takes them: nonzero = may attend.

    Args:
        name: the argument's name, for the message.
        value: the mask, in any form `shape_and_dtype` takes.
        targets: `{rank: (description, shape)}`; `None` sizes are unknown.
        broadcast: whether sizes of 1 broadcast.
    """
    shape, dtype = shape_and_dtype(value)
    if dtype != "bool" and "int" not in dtype and "float" not in dtype:
        raise TypeError(
            f"`{name}` must be boolean, integer or float (nonzero = may "
            f"attend). Received: {name}.dtype={dtype}"
        )
    description, target = targets.get(len(shape), (None, None))
    if target is None or not all(
        got is None or want is None or got == want or (broadcast and got == 1)
        for got, want in zip(shape, target)
    ):
        expected = " or ".join(f"{d} = {t}" for d, t in targets.values())
        raise ValueError(
            f"`{name}` must {'broadcast to' if broadcast else 'have shape'} "
            f"{expected}. Received: {name}.shape={shape}"
        )


def dims_agree(a, b):
    """Equal, where both are known."""
    return len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b)
    )


def input_shapes(query_shape, value_shape, key_shape, axes):
    """Checks the shapes of `query`, `value` and `key` against each other.

    Returns:
        The `AxesLayout` of the inputs.
    """
    if not dims_agree(value_shape[1:-1], key_shape[1:-1]):
        raise ValueError(
            "All dimensions of `value` and `key`, except the last one, "
            f"must be equal. Received: value.shape={value_shape} and "
            f"key.shape={key_shape}"
        )
    for name, shape in (
        ("query", query_shape),
        ("value", value_shape),
        ("key", key_shape),
    ):
        if len(shape) < 3:
            raise ValueError(
                f"`{name}` must have rank >= 3 (batch, sequence, "
                f"features). Received: {name}.shape={shape}"
            )
    if not len(query_shape) == len(value_shape) == len(key_shape):
        raise ValueError(
            "`query`, `value` and `key` must have the same rank. "
            f"Received: query.shape={query_shape}, "
            f"value.shape={value_shape}, key.shape={key_shape}"
        )
    if not dims_agree(value_shape[:1], key_shape[:1]):
        raise ValueError(
            "All dimensions of `value` and `key`, except the last one, "
            f"must be equal. Received: value.shape={value_shape} and "
            f"key.shape={key_shape}"
        )
    for name, shape in (("query", query_shape), ("key", key_shape)):
        if shape[-1] is None:
            raise ValueError(
                f"The last dimension of `{name}` must be defined. "
                f"Received: {name}.shape={shape}"
            )
    # Validates the axes too. `value` is compared with `query`: it is
    # always given, and `key` agrees with it.
    layout = AxesLayout(len(query_shape), axes)
    query_batch = tuple(query_shape[a] for a in [0, *layout.batch_axes])
    value_batch = tuple(value_shape[a] for a in [0, *layout.batch_axes])
    if not dims_agree(query_batch, value_batch):
        raise ValueError(
            "`query` and `value` must agree on the batch and "
            "non-attention axes. Received: "
            f"query.shape={query_shape}, value.shape={value_shape}, "
            f"attention_axes={axes}"
        )
    if any(value_shape[a] == 0 for a in layout.attention_axes):
        raise ValueError(
            "`value` must have at least one position to attend to. "
            f"Received: value.shape={value_shape}"
        )
    return layout


def attention_bias(value, query_shape, key_shape, num_heads):
    """Checks a float `attention_bias` broadcastable to `(B, N, T, S)`."""
    shape, dtype = shape_and_dtype(value)
    if "float" not in dtype and "int" not in dtype:
        raise TypeError(
            "`attention_bias` must be a float tensor added to the logits "
            "(pass a boolean mask as `attention_mask`). "
            f"Received: attention_bias.dtype={dtype}"
        )
    target = (query_shape[0], num_heads, query_shape[1], key_shape[1])
    padded = (1,) * (4 - len(shape)) + shape
    if len(shape) > 4 or not all(
        d in (1, None) or t is None or d == t for d, t in zip(padded, target)
    ):
        raise ValueError(
            "`attention_bias` must broadcast to (B, N, T, S) = "
            f"{target}. Received: attention_bias.shape={shape}"
        )


def segment_ids(name, value, expected):
    """Checks integer segment ids of shape `expected` (`(B, T)`)."""
    shape, dtype = shape_and_dtype(value)
    if "int" not in dtype:
        raise TypeError(
            f"`{name}` must be an integer tensor of segment ids. "
            f"Received: {name}.dtype={dtype}"
        )
    if len(shape) != 2 or not dims_agree(shape, expected):
        raise ValueError(
            f"`{name}` must have shape (B, length) = {expected}. "
            f"Received: {name}.shape={shape}"
        )


def feature_arguments(
    layer, layout, shapes, cache, attention_bias_, segment_ids_,
    key_segment_ids,
):
    """Checks the call arguments of the features of current models."""
    if layout.multi_axis and (
        layer._rotary_embedding is not None or layer._use_alibi
    ):
        raise ValueError(
            "`rotary_embedding` and `use_alibi` need a single attention "
            f"axis. Received: attention_axes={layer._attention_axes}"
        )
    given = {
        "attention_bias": attention_bias_,
        "segment_ids": segment_ids_,
        "key_segment_ids": key_segment_ids,
    }
    given = {name: x for name, x in given.items() if x is not None}
    if not given:
        return
    names = ", ".join(f"`{name}`" for name in given)
    if not layout.identity:
        raise ValueError(
            f"{names} need inputs of rank 3 (batch, sequence, features). "
            f"Received: query.shape={shapes['query']}"
        )
    if cache is not None:
        raise ValueError(
            f"{names} are not supported with a cache: decoding steps read "
            "the cache's own padding flags and positions. Received: "
            f"{', '.join(f'{name}=a tensor' for name in given)}, "
            "cache=a cache"
        )
    query_shape, key_shape = shapes["query"], shapes["key"]
    if attention_bias_ is not None:
        attention_bias(attention_bias_, query_shape, key_shape, layer._num_heads)
    if key_segment_ids is not None and segment_ids_ is None:
        raise ValueError(
            "`key_segment_ids` needs `segment_ids` (the queries' ids). "
            "Received: segment_ids=None"
        )
    if segment_ids_ is not None:
        segment_ids("segment_ids", segment_ids_, query_shape[:2])
        if key_segment_ids is not None:
            segment_ids("key_segment_ids", key_segment_ids, key_shape[:2])
        elif not dims_agree(query_shape[1:2], key_shape[1:2]):
            raise ValueError(
                "`segment_ids` alone means the keys share the queries' ids; "
                "for keys of another length pass `key_segment_ids`. "
                f"Received: query.shape={query_shape}, "
                f"key.shape={key_shape}"
            )


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
    query, value, key, cache, index, use_causal_mask, attention_mask,
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
    for i, (part, want) in enumerate(zip(cache, expected)):
        shape = tuple(part.shape)
        if len(shape) != len(want) or not dims_agree(shape, want):
            raise ValueError(
                "`cache` must be `(keys, values, valid)` of shapes "
                f"(B, L, K, H), (B, L, K, V) and (B, L) = {expected} (see "
                f"`init_cache`). Received: cache[{i}].shape={shape}"
            )
    cache_index(index, query.shape[1], keys.shape[1], window is not None)


def built_inputs(layer, query, value, key=None):
    """`(shapes, layout)` of a call's inputs, checked against each other
    and, once `layer` is built, against its weights."""
    key = value if key is None else key
    shapes = {
        "query": tuple(query.shape),
        "value": tuple(value.shape),
        "key": tuple(key.shape),
    }
    layout = input_shapes(
        shapes["query"], shapes["value"], shapes["key"],
        layer._attention_axes,
    )
    if layer.built:  # inputs must fit the weights
        for name, shape in shapes.items():
            features = layer._feature_sizes[name]
            if len(shape) != layer._layout.rank or shape[-1] not in (
                None,
                features,
            ):
                raise ValueError(
                    f"`{name}` must have rank {layer._layout.rank} and "
                    f"{features} features, as when the layer was built. "
                    f"Received: {name}.shape={shape}"
                )
    return shapes, layout


def scores_and_flash(layer, return_attention_scores):
    """Keras's error for scores asked of flash attention."""
    if return_attention_scores and layer._flash_attention:
        raise ValueError(
            "Returning attention scores is not supported when flash "
            "attention is enabled. Please disable flash attention to "
            "access attention scores. Received: flash_attention=True, "
            "return_attention_scores=True"
        )


def call_arguments(
    layer,
    query,
    value,
    key,
    query_mask,
    value_mask,
    key_mask,
    attention_mask,
    return_attention_scores,
    use_causal_mask,
    cache,
    cache_update_index,
    attention_bias=None,
    segment_ids=None,
    key_segment_ids=None,
):
    """Checks a call of `layer` from shapes and dtypes alone.

    Runs in `call` and in `compute_output_spec`, so bad inputs fail
    while a Functional model is built, and never as a backend error.
    """
    key = value if key is None else key
    shapes, layout = built_inputs(layer, query, value, key)
    for name, mask, shape in (
        ("query_mask", query_mask, shapes["query"]),
        ("value_mask", value_mask, shapes["value"]),
        ("key_mask", key_mask, shapes["key"]),
    ):
        if mask is not None:
            target = {len(shape) - 1: ("(B, ...)", shape[:-1])}
            mask_argument(name, mask, target, broadcast=layout.identity)
    if attention_mask is not None:
        mask_argument(
            "attention_mask",
            attention_mask,
            layout.attention_mask_targets(
                shapes["query"], shapes["key"], layer._num_heads
            ),
        )
    feature_arguments(
        layer, layout, shapes, cache, attention_bias, segment_ids,
        key_segment_ids,
    )
    if use_causal_mask and layout.multi_axis:
        raise ValueError(
            "`use_causal_mask=True` needs a single attention axis. "
            f"Received: attention_axes={layer._attention_axes}"
        )
    scores_and_flash(layer, return_attention_scores)
    if cache is not None or cache_update_index is not None:
        cache_call(
            query, value, key, cache, cache_update_index,
            use_causal_mask, attention_mask, layer._num_key_value_heads,
            layer._key_dim, layer._value_dim,
            layer._rolling_slots if layer.rolling_cache else None,
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
