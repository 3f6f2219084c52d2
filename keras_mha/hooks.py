"""What our layers change in `keras.layers.Layer`'s own methods.

`__call__` checks the kinds of a call's array arguments before Keras
converts them (`checks.argument_kinds`), and `quantize` quantizes the
projections (`projections.quantize`), where Keras's attention layer raises
`NotImplementedError`. With Keras's private names (`KerasPrivateNames`),
the layer's bases. `compute_output_spec` reads the arguments of `call`
(`call_arguments`), and both return their results as `results` does.
"""

import inspect

from keras_mha import checks
from keras_mha import projections
from keras_mha.attention import paged as paged_lib
from keras_mha.private_names import KerasPrivateNames


class LayerHooks(KerasPrivateNames):
    """`__call__` with its arguments' kinds checked, and `quantize`."""

    def __call__(self, *args, **kwargs):
        checks.argument_kinds(self, args, kwargs)  # before Keras converts
        if paged_lib.is_paged(kwargs.get("cache")) or isinstance(
                kwargs.get("cache"), paged_lib.PagedRows):
            kwargs["cache"] = Unconverted(kwargs["cache"])
        return super().__call__(*args, **kwargs)

    quantize = projections.quantize


class Unconverted:
    """A paged cache passed through Keras's `Layer.__call__` untouched:
    Keras casts every float tensor of a call's arguments to the compute
    dtype, which would turn float8 pages, and the float32 scales of a
    half-precision layer, into it. `call` takes the cache out
    (`unconverted`)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def unconverted(value):
    """`value`, taken out of its `Unconverted` box where it is in one."""
    return value.value if isinstance(value, Unconverted) else value


def call_arguments(call, check, layer, args, kwargs):
    """The arguments of `call(layer, *args, **kwargs)` by name, defaults
    filled in, checked by `check(layer, **arguments)`.

    Keras calls `compute_output_spec` with the arguments of `call`; a
    layer's `compute_output_spec(*args, **kwargs)` reads them here, so the
    signature is written once, on `call` (named by its class: a subclass
    may call its own differently), and they are checked as `call` checks
    them.
    """
    bound = inspect.signature(call).bind(layer, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["self"]
    if "cache" in arguments:
        arguments["cache"] = unconverted(arguments["cache"])
    check(layer, **arguments)
    return arguments


def results(output, *extras):
    """A call's results: `output`, then each of `extras` (the scores, the
    cache) that is not `None`; `output` alone when none is."""
    extras = tuple(x for x in extras if x is not None)
    return (output, *extras) if extras else output
