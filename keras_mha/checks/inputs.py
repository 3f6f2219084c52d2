"""Checks of a call's tensors from their shapes and dtypes."""

import inspect

import keras
import numpy as np

from keras_mha.attention import paged as paged_lib
from keras_mha.attention import rules
from keras_mha.axes import AxesLayout
from keras_mha.checks.paged import ragged_call
from keras_mha.checks.arguments import dims_agree
from keras_mha.checks.arguments import shape_and_dtype
from keras_mha.checks.cache import cache_call
from keras_mha.checks.cache import cache_index
from keras_mha.checks.sharing import shared_call
from keras_mha.checks.sharing import value_or_query

# A call's array arguments (`cache` apart: a tuple of them, or one tensor).
ARRAY_ARGUMENTS = (
    "query", "value", "key", "query_mask", "value_mask", "key_mask",
    "attention_mask", "attention_bias", "segment_ids", "key_segment_ids",
    "cache_update_index", "cache",
)
# Those that must be tensors or arrays: Keras takes nothing else as inputs.
_TENSORS = ("query", "value", "key")
# The names of each layer class's `call` parameters, in order.
_CALL_NAMES = {}
# Those whose other kinds `cache.py`'s checks name (an int index, a tuple).
_CHECKED_LATER = ("cache", "cache_update_index")


def argument_kinds(layer, args, kwargs):
    """Checks that every array argument of a call of `layer` is an array of
    numbers or booleans, before `Layer.__call__` converts them.

    Keras's conversion would fail on a NumPy array of strings or objects
    without naming the argument (`Invalid dtype: str32`), and a dict or a
    string as `query` would reach `call` as an `AttributeError`. A tensor's
    dtype is read, never its values.

    Args:
        layer: the layer called; its `call`'s parameters name `args`.
        args: the call's positional arguments.
        kwargs: its keyword arguments.
    """
    names = _CALL_NAMES.get(type(layer))
    if names is None:
        names = _CALL_NAMES[type(layer)] = tuple(
            inspect.signature(layer.call).parameters
        )
    given = dict(zip(names, args))
    given.update((k, v) for k, v in kwargs.items() if k in ARRAY_ARGUMENTS)
    for name, value in given.items():
        if name not in ARRAY_ARGUMENTS or value is None:
            continue
        if name == "cache" and isinstance(value, (tuple, list)):
            for i, part in enumerate(value):  # `checks.cache_parts` the rest
                if hasattr(part, "dtype"):
                    _array_kind(f"cache[{i}]", part)
        elif name not in _CHECKED_LATER or hasattr(value, "dtype"):
            _array_kind(name, value)


def _array_kind(name, value):
    """`value` (of argument `name`) is a tensor or array of numbers or
    booleans; a nested list or a number where `name` is not a layer
    input."""
    tensor = hasattr(value, "shape") and hasattr(value, "dtype")
    if not tensor:
        if name in _TENSORS or not isinstance(
            value, (list, tuple, bool, int, float, np.generic)
        ):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise TypeError(
                f"`{name}` must be a tensor or a NumPy array. Received: "
                f"{name}={shown} of type {type(value).__name__}"
            )
        try:
            value = np.asarray(value)
        except ValueError as error:  # ragged nested lists
            raise ValueError(
                f"`{name}` must be a tensor, an array or a nested list of "
                f"one shape. Received: {name} with {error}"
            ) from None
    dtype = value.dtype
    try:
        dtype = keras.backend.standardize_dtype(dtype)
    except ValueError:  # a dtype Keras has no name for (strings, objects)
        dtype = str(dtype)
    if dtype != "bool" and "int" not in dtype and "float" not in dtype:
        raise TypeError(
            f"`{name}` must hold numbers or booleans. "
            f"Received: {name}.dtype={dtype}"
        )


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


def defined_features(name, shape):
    """Checks that the input `name`'s last dimension, its features, is
    known."""
    if shape[-1] is None:
        raise ValueError(
            f"The last dimension of `{name}` must be defined. "
            f"Received: {name}.shape={shape}"
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
        defined_features(name, shape)
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
    settings = layer.settings
    if layout.multi_axis and (
        settings.rotary_embedding is not None or settings.use_alibi
    ):
        raise ValueError(
            "`rotary_embedding` and `use_alibi` need a single attention "
            f"axis. Received: attention_axes={settings.attention_axes}"
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
        attention_bias(attention_bias_, query_shape, key_shape,
                       settings.num_heads)
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
        layer.settings.attention_axes,
    )
    if layer.built:  # inputs must fit the weights
        rank = layer.input_layout.rank
        for name, shape in shapes.items():
            features = layer.input_features[name]
            if len(shape) != rank or shape[-1] not in (None, features):
                raise ValueError(
                    f"`{name}` must have rank {rank} and "
                    f"{features} features, as when the layer was built. "
                    f"Received: {name}.shape={shape}"
                )
    return shapes, layout


def scores_and_flash(layer, return_attention_scores):
    """Keras's error for scores asked of flash attention."""
    if return_attention_scores and layer.settings.flash_attention:
        raise ValueError(
            "Returning attention scores is not supported when flash "
            "attention is enabled. Please disable flash attention to "
            "access attention scores. Received: flash_attention=True, "
            "return_attention_scores=True"
        )


def call_arguments(
    layer, *, query, value, key, query_mask, value_mask, key_mask,
    attention_mask, return_attention_scores, use_causal_mask, cache,
    cache_update_index, attention_bias=None, segment_ids=None,
    key_segment_ids=None, training=None, mask_mod=None, score_mod=None,
    shared_key_value=None, return_key_value=False,
):
    """Checks a call of `layer` from shapes and dtypes alone.

    Runs in `call` and in `compute_output_spec`, so bad inputs fail
    while a Functional model is built, and never as a backend error.
    Takes every argument of the call, by keyword; `training` needs no
    check.
    """
    stand_in = shared_call(
        layer, query=query, value=value, cache=cache,
        cache_update_index=cache_update_index,
        shared_key_value=shared_key_value, return_key_value=return_key_value,
        value_mask=value_mask, key_mask=key_mask,
        paged=paged_lib.is_paged(cache) or isinstance(
            cache, paged_lib.PagedRows))
    if stand_in is not None:  # a layer that shares an earlier one's
        value = key = stand_in
        if len(shared_key_value) == 3:
            cache = shared_key_value  # read as a cache of its own
    if isinstance(cache, paged_lib.PagedRows):  # quantized, in pages
        length = query.shape[1]
        cache_index(cache_update_index, length,
                    cache.page_table.shape[1] * cache.pool.keys.shape[1],
                    False)
        cache, cache_update_index = cache.pool, paged_lib.rows_batch(
            cache, cache_update_index, length)
    programs(mask_mod, score_mod)
    value = value_or_query(layer.settings, query, value)
    if paged_lib.is_paged(cache):  # a ragged call (`checks/paged.py`)
        return ragged_call(layer, (query, value, key), cache,
                           cache_update_index, use_causal_mask,
                           return_attention_scores, locals())
    settings = layer.settings
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
                shapes["query"], shapes["key"], settings.num_heads
            ),
        )
    feature_arguments(
        layer, layout, shapes, cache, attention_bias, segment_ids,
        key_segment_ids,
    )
    programs(mask_mod, score_mod, layout, settings.attention_axes)
    if use_causal_mask and layout.multi_axis:
        raise ValueError(
            "`use_causal_mask=True` needs a single attention axis. "
            f"Received: attention_axes={settings.attention_axes}"
        )
    scores_and_flash(layer, return_attention_scores)
    if cache is not None or cache_update_index is not None:
        cache_call(
            query, value, key, cache, cache_update_index,
            use_causal_mask=use_causal_mask, attention_mask=attention_mask,
            num_kv_heads=settings.num_key_value_heads,
            key_dim=settings.key_dim, value_dim=settings.value_dim,
            window=settings.rolling_slots if layer.rolling_cache else None,
        )


def programs(mask_mod, score_mod, layout=None, attention_axes=None):
    """A mask and a score function: `keras_mha` objects or plain
    functions (a `TypeError` otherwise), over one attention axis of the
    inputs' `layout` when given."""
    if mask_mod is not None:
        rules.as_mask(mask_mod)
    if score_mod is not None:
        rules.as_score_function(score_mod)
    programmed = mask_mod is not None or score_mod is not None
    if layout is not None and layout.multi_axis and programmed:
        raise ValueError(
            "`mask_mod` and `score_mod` need a single attention axis. "
            f"Received: attention_axes={attention_axes}"
        )
