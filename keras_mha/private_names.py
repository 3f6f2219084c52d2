"""Keras's private names on our layers, for code written against Keras's.

Keras's own tests and keras-hub's subclasses of Keras's attention layers
read a few private attributes: the einsum equations of the attention, the
logit scale. `KerasPrivateNames` gives them Keras's meaning on
`keras_mha.MultiHeadAttention` (the projections `_query_dense`,
`_key_dense`, `_value_dense` and `_output_dense` are the layer's own
sublayers). The attention itself does not run these equations: they
describe it.
"""

from keras_mha import axes as axes_lib


class KerasPrivateNames:
    """`_dot_product_equation`, `_combine_equation` and
    `_inverse_sqrt_key_dim`, as on `keras.layers.MultiHeadAttention`."""

    @property
    def _dot_product_equation(self):
        """Keras's einsum of the logits, `(keys, queries) -> scores`
        (built layers only)."""
        return self._keras_equations()[0]

    @property
    def _combine_equation(self):
        """Keras's einsum of the context, `(scores, values) -> context`
        (built layers only)."""
        return self._keras_equations()[1]

    @property
    def _inverse_sqrt_key_dim(self):
        """Keras's logit scale: here `scale` (`1 / sqrt(key_dim)` if
        unset)."""
        return self._scale

    def _keras_equations(self):
        layout = getattr(self, "_layout", None)
        if layout is None:
            raise AttributeError(
                "The attention's einsum equations exist once the layer is "
                f"built; `{self.name}` is not built yet"
            )
        return axes_lib.keras_einsum_equations(
            layout.rank, layout.attention_axes
        )
