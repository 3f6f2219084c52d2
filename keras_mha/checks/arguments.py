"""Checks of constructor arguments, one validator per kind of value, and
the shape and dtype of any array-like."""

import numbers

import keras
import numpy as np

# Each kind of positive value: its type, whether it is in range, its
# Python form, and the error's wording (an integer's is Keras's).
_POSITIVE = {
    "integer": (
        numbers.Integral, lambda value: value > 0, int,
        "Received an invalid value for argument `{name}`, expected "
        "{expected}. Received: {name}={value!r}",
    ),
    "number": (
        numbers.Real, lambda value: 0.0 < float(value) < float("inf"), float,
        "Argument `{name}` must be {expected}. Received: {name}={value!r}",
    ),
}


def _positive(kind, name, value, allow_none):
    """`value` as a positive Python `kind` of `_POSITIVE`, or `None`."""
    if value is None and allow_none:
        return None
    kind_type, in_range, python_form, message = _POSITIVE[kind]
    if (
        isinstance(value, bool)
        or not isinstance(value, kind_type)
        or not in_range(value)
    ):
        expected = f"a positive {kind}" + (" or `None`" if allow_none else "")
        raise ValueError(
            message.format(name=name, expected=expected, value=value)
        )
    return python_form(value)


def positive_int(name, value, allow_none=False):
    """`value` as a Python int (NumPy integers too), or `None`."""
    return _positive("integer", name, value, allow_none)


def positive_number(name, value, allow_none=False):
    """`value` as a Python float `> 0` (finite), or `None`."""
    return _positive("number", name, value, allow_none)


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


def alibi(use_alibi, alibi_before_scale):
    """`(use_alibi, alibi_before_scale)`, booleans; the second only with
    the first."""
    use_alibi = boolean("use_alibi", use_alibi)
    before = boolean("alibi_before_scale", alibi_before_scale)
    if before and not use_alibi:
        raise ValueError(
            "`alibi_before_scale=True` says where ALiBi's terms are added, "
            "and needs `use_alibi=True`. Received: alibi_before_scale=True, "
            "use_alibi=False"
        )
    return use_alibi, before


def norm_layer(name, value):
    """`None`, or a Keras layer that keeps its input's shape (`input_norm`,
    `output_norm`)."""
    if value is not None and not isinstance(value, keras.layers.Layer):
        raise TypeError(
            f"Argument `{name}` must be `None` or a Keras layer that keeps "
            "its input's shape, such as `keras.layers.LayerNormalization()`"
            f" or `keras.layers.RMSNormalization()`. Received: {name}="
            f"{value!r}"
        )
    return value


def input_norm_features(scope, features):
    """With `input_norm_scope="all"` the query's `input_norm` normalizes
    the value and key too: `features` (the inputs' sizes, by name) must
    agree."""
    if scope == "all" and len(set(features.values())) > 1:
        sizes = ", ".join(f"{name}={size}" for name, size in features.items())
        raise ValueError(
            "`input_norm_scope='all'` normalizes the value and key with the "
            "query's `input_norm`, which needs their feature sizes to be "
            "the query's; `input_norm_scope='query'` leaves a "
            "cross-attention's memory as it is. Received: "
            f"input_norm_scope='all', feature sizes {sizes}"
        )


def choice(name, value, choices, allow_none=False):
    """`value`, one of `choices` (strings), or `None` if allowed."""
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or value not in choices:
        expected = " or ".join(repr(c) for c in choices)
        expected += " or `None`" if allow_none else ""
        raise ValueError(
            f"Argument `{name}` must be {expected}. Received: {name}={value!r}"
        )
    return value


def key_value_heads(value, num_heads):
    """`num_key_value_heads`: `None`, or a positive int dividing
    `num_heads`."""
    value = positive_int("num_key_value_heads", value, allow_none=True)
    if value is not None and num_heads % value:
        raise ValueError(
            "`num_key_value_heads` must divide `num_heads`. Received: "
            f"num_heads={num_heads}, num_key_value_heads={value}"
        )
    return value


def query_temperature_pair(value):
    """`None`; `(floor_scale, scale)`, a positive number and a finite one;
    or `("power", length, exponent)`, a positive number and a finite one
    after the tag: as a tuple of Python floats after any tag (a JSON list
    from a config too)."""
    if value is None:
        return None
    form = tuple(value) if isinstance(value, (tuple, list)) else ()
    tag = form[:1] if form[:1] == ("power",) else ()
    numbers_ = form[len(tag):]
    if (
        len(numbers_) != 2
        or any(isinstance(x, bool) or not isinstance(x, numbers.Real)
               for x in numbers_)
        or not 0.0 < float(numbers_[0]) < float("inf")
        or not abs(float(numbers_[1])) < float("inf")
    ):
        raise ValueError(
            "Argument `query_temperature` must be `None`, a pair "
            "`(floor_scale, scale)` or a triple `(\"power\", length, "
            "exponent)`, with a positive number and a finite number. "
            f"Received: query_temperature={value!r}"
        )
    return tag + (float(numbers_[0]), float(numbers_[1]))


def head_features(qk_norm, qk_norm_scope, qk_norm_epsilon,
                  query_temperature, qk_norm_after_rope=False,
                  value_norm=False, qkv_clip=None):
    """The layer's `qk_norm`, `qk_norm_scope`, `qk_norm_epsilon`,
    `query_temperature`, `qk_norm_after_rope`, `value_norm` and
    `qkv_clip`, checked, by name."""
    return dict(
        qk_norm=choice("qk_norm", qk_norm, ("rms", "layer", "l2"),
                       allow_none=True),
        qk_norm_scope=choice("qk_norm_scope", qk_norm_scope,
                             ("head", "projection")),
        qk_norm_epsilon=positive_number("qk_norm_epsilon", qk_norm_epsilon),
        query_temperature=query_temperature_pair(query_temperature),
        qk_norm_after_rope=boolean("qk_norm_after_rope", qk_norm_after_rope),
        value_norm=boolean("value_norm", value_norm),
        qkv_clip=positive_number("qkv_clip", qkv_clip, allow_none=True),
    )


def single_attention_axis(axes, received, **features):
    """Features that need one attention axis (`sliding_window`,
    `attention_chunk_size`): a `ValueError` for the first one given when
    the checked `axes` are several (`received`: as the user passed them)."""
    if axes is None or len(axes) <= 1:
        return
    for name, value in features.items():
        if value is not None:
            raise ValueError(
                f"`{name}` needs a single attention axis. Received: "
                f"{name}={value}, attention_axes={received}"
            )


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


def dims_agree(a, b):
    """Equal, where both are known."""
    return len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b)
    )


def differential(value, epsilon, num_heads, use_gate, output_norm):
    """`(differential, differential_epsilon)`: `None`, or `λ_init` in
    `[0, 1)` for a layer whose heads pair up (an even `num_heads`, no
    output gate or `output_norm`, which would act on heads the pairs
    have merged); the norm's epsilon, a positive number."""
    epsilon = positive_number("differential_epsilon", epsilon)
    if value is None:
        return None, epsilon
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not 0.0 <= float(value) < 1.0):
        raise ValueError(
            "Argument `differential` must be `None` or `lambda_init`, a "
            f"number in [0, 1). Received: differential={value!r}"
        )
    if num_heads % 2:
        raise ValueError(
            "Differential attention pairs head `i` with head `i + N/2`: "
            "`num_heads` must be even. Received: num_heads="
            f"{num_heads}, differential={value!r}"
        )
    for name, given in (("use_gate", use_gate), ("output_norm", output_norm)):
        if given not in (None, False):
            raise ValueError(
                f"Differential attention takes no `{name}`: it normalizes "
                "each pair of heads itself. Received: "
                f"differential={value!r}, {name}={given!r}"
            )
    return float(value), epsilon
