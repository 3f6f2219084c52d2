"""What our layers change in `keras.layers.Layer`'s own methods.

`__call__` checks the kinds of a call's array arguments before Keras
converts them (`checks.argument_kinds`), and `quantize` quantizes the
projections (`projections.quantize`), where Keras's attention layer raises
`NotImplementedError`. With Keras's private names (`KerasPrivateNames`),
the layer's bases.
"""

from keras_mha import checks
from keras_mha import projections
from keras_mha.private_names import KerasPrivateNames


class LayerHooks(KerasPrivateNames):
    """`__call__` with its arguments' kinds checked, and `quantize`."""

    def __call__(self, *args, **kwargs):
        checks.argument_kinds(self, args, kwargs)  # before Keras converts
        return super().__call__(*args, **kwargs)

    quantize = projections.quantize
