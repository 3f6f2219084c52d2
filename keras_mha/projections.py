"""The layer's projections: `keras.layers.EinsumDense` as Keras builds them.

The equations, names, shapes and order are those of
`keras.layers.MultiHeadAttention`, so `set_weights(keras_layer.get_weights())`
works both ways, and LoRA, int8 quantization and dtype-policy maps work as
in Keras. `Projection` is `EinsumDense` with one backend kernel: on torch a
plain projection runs as a single `torch.addmm`.
"""

import string

import keras
from keras import ops

import keras_mha.attention.capabilities as capabilities
from keras_mha import checks


def projection_equation(free_dims, bound_dims, output_dims):
    """EinsumDense equation and bias axes, letter for letter as in Keras.

    Keeping Keras's equations keeps the kernels' shapes, and so
    `set_weights(keras_layer.get_weights())` works both ways.
    """
    letters = string.ascii_lowercase
    free = letters[:free_dims]
    bound = letters[free_dims : free_dims + bound_dims]
    out = letters[free_dims + bound_dims : free_dims + bound_dims + output_dims]
    return f"{free}{bound},{bound}{out}->{free}{out}", out


def heads_projection(layer, rank, num_heads, head_size, name, activation=None):
    """`(B, ..., E) -> (B, ..., heads, size)` for inputs of `rank`."""
    equation, bias_axes = projection_equation(rank - 1, 1, 2)
    projection = Projection(
        equation,
        output_shape=[None] * (rank - 2) + [num_heads, head_size],
        bias_axes=bias_axes if layer.settings.use_bias else None,
        activation=activation,
        name=name,
        **sublayer_kwargs(layer),
    )
    # Per-token projections keep the inputs' Keras masks, which the layer
    # leaves in place (Keras's layer deletes them instead).
    projection.supports_masking = True
    return projection


def output_projection(layer, rank, output_shape):
    """`(B, ..., N, V) -> (B, ..., *output_shape)`."""
    equation, bias_axes = projection_equation(rank - 1, 2, len(output_shape))
    return Projection(
        equation,
        output_shape=[None] * (rank - 2) + list(output_shape),
        bias_axes=bias_axes if layer.settings.use_bias else None,
        name="attention_output",
        **sublayer_kwargs(layer),
    )


class Projection(keras.layers.EinsumDense):
    """`keras.layers.EinsumDense` whose plain call on torch is one `addmm`.

    Keras's call is an einsum, then the bias added as a second pass that
    writes a fresh tensor. On torch, a projection without LoRA,
    quantization or autocast runs as `torch.addmm(bias, x, kernel)`
    (`kernels.project`): the bias is accumulated by the matmul itself, so
    no second pass reads the output and writes a fresh tensor, and the
    projection costs what its matmul costs. A layer call makes four
    projections. Everything else is Keras's call.
    """

    def call(self, inputs, training=None):
        if (
            capabilities.has_fused_projection()
            and self.bias is not None
            and not self.lora_enabled
            and self.quantization_mode is None
            and self.compute_dtype == self.variable_dtype
            and inputs.dtype == self._kernel.value.dtype
        ):
            from keras_mha.attention import kernels

            x = kernels.project(
                inputs, self._kernel.value, self.bias.value,
                len(self._kernel.shape) - len(self.bias.shape),
            )
            return x if self.activation is None else self.activation(x)
        return super().call(inputs, training=training)

    def quantize(self, mode=None, type_check=True, config=None):
        # Keras refuses subclasses, which might change what `call` does;
        # this one defers every quantized call to Keras's.
        super().quantize(mode, type_check=False, config=config)


def quantize(layer, mode=None, type_check=True, config=None):
    """Quantizes the layer's projections, as `keras.Model.quantize` does.

    Every `EinsumDense` sublayer is quantized; the sinks and any norms keep
    their dtype, as `Model.quantize` leaves the layers it cannot quantize.
    The projections' policies go into a `keras.dtype_policies.DTypePolicyMap`
    keyed by their paths, which becomes the layer's dtype policy, so its
    config rebuilds quantized projections and the layer saves and loads.

    Args:
        mode: Keras's quantization mode (`"int8"`, `"int4"`, `"float8"`),
            or `None` with a `config`.
        type_check: accepted for Keras's signature; unused.
        config: a `keras.quantizers.QuantizationConfig`, or `None`.
    """
    policies = layer.dtype_policy
    if not isinstance(policies, keras.dtype_policies.DTypePolicyMap):
        policies = keras.dtype_policies.DTypePolicyMap(default_policy=policies)
    for sublayer in _all_sublayers(layer):
        if isinstance(sublayer, keras.layers.EinsumDense):
            sublayer.quantize(mode, config=config)
            policies[sublayer.path] = sublayer.dtype_policy
    _replace_dtype_policy(layer, policies)
    if capabilities.variables_are_parameters():
        # As `Model.quantize` does: the replaced weights leave the torch
        # parameters.
        for tracked in [layer, *_all_sublayers(layer)]:
            _retrack_variables(tracked)


# Keras's own internals, each behind one function: Keras has no public
# way to do these (`tests/test_structure.py` lists them).


def _all_sublayers(layer):
    """Every sublayer of `layer`, nested ones too: Keras's
    `Layer._flatten_layers`, as `Model.quantize` uses it (a `Layer` has no
    public listing of its nested sublayers)."""
    return list(layer._flatten_layers(include_self=False))


def _replace_dtype_policy(layer, policies):
    """Makes the `DTypePolicyMap` `policies` the layer's dtype policy.
    Keras's setter, `layer.dtype_policy = policies`, would file the map
    inside the layer's own map under its path when the layer's policy is
    a map already; `Model.quantize` sets `_dtype_policy` too."""
    layer._dtype_policy = policies


def _retrack_variables(layer):
    """Keras's `Layer._track_variables`: torch's parameters follow the
    layer's variables again (after quantization replaced some)."""
    layer._track_variables()


def sublayer_kwargs(layer):
    """A projection's arguments from `layer`'s: its initializers, and the
    regularizers and constraints it has (`None` where it has none)."""
    # Fresh initializer instances: a shared stateless initializer would
    # give every projection the same values.
    def clone(initializer):
        return initializer.__class__.from_config(initializer.get_config())

    settings = layer.settings
    return dict(
        kernel_initializer=clone(settings.kernel_initializer),
        bias_initializer=clone(settings.bias_initializer),
        kernel_regularizer=settings.kernel_regularizer,
        bias_regularizer=settings.bias_regularizer,
        activity_regularizer=settings.activity_regularizer,
        kernel_constraint=settings.kernel_constraint,
        bias_constraint=settings.bias_constraint,
        dtype=layer.dtype_policy,
    )


class Sinks(keras.layers.Layer):
    """The `(N,)` sink logits (`use_sinks=True`) as a weight named `sinks`.

    A sublayer built after the projections, so the layer's weights are
    Keras's in Keras's order, then the sinks.
    """

    def __init__(self, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads

    @classmethod
    def holding(cls, variable, **kwargs):
        """A built `Sinks` whose weight is `variable` `(N,)`, not a copy
        (`hub.adopt`: keras-hub's own)."""
        sinks = cls(int(variable.shape[0]), **kwargs)
        sinks.sinks = variable  # tracked as the layer's weight
        sinks.built = True
        return sinks

    def build(self, input_shape=None):
        self.sinks = self.add_weight(
            name="sinks", shape=(self.num_heads,), initializer="zeros"
        )


# The norms around the projections: the layer's `input_norm` and
# `output_norm`, Keras layers the caller gives.


def build_norms_around(layer, query_shape, merged_heads):
    """Builds the layer's `input_norm` for `query_shape` and its
    `output_norm` for the query's shape with `merged_heads` (`N·V`)
    features, and tracks both as the layer's sublayers, after its other
    weights."""
    settings = layer.settings
    for name, shape in (("input_norm", query_shape),
                        ("output_norm", query_shape[:-1] + (merged_heads,))):
        norm = getattr(settings, name)
        if norm is None:
            continue
        if name == "input_norm":
            checks.input_norm_features(settings.input_norm_scope,
                                       layer.input_features)
        if not norm.built:
            norm.build(shape)
        setattr(layer, f"_{name}", norm)  # tracked: its weights are saved


def normalized_inputs(layer, query, value, key):
    """`(query, value, key)` with the layer's `input_norm` applied to the
    query, and with `input_norm_scope="all"` to the value and key too
    (which a layer with shared keys and values does not take)."""
    settings = layer.settings
    norm = settings.input_norm
    if norm is None:
        return query, value, key
    normalized = norm(query)
    if settings.input_norm_scope == "query" or value is None:
        return normalized, value, key
    if value is query and key is query:  # self-attention: one norm
        return normalized, normalized, normalized
    normalized_value = norm(value)
    return (normalized, normalized_value,
            normalized_value if key is value else norm(key))


def heads_to_project(layer, context, gate=None):
    """What the output projection takes of the attention's heads `(B, ...,
    N, V)`: times the `gate` (`use_gate`), then the layer's `output_norm`
    over each token's `N·V` features together (BitNet's sub-norm, Dory's
    L2 norm after its gate), and differential attention's `N/2` pairs
    (`keras_mha.differential`, which takes neither of the others)."""
    settings = layer.settings
    if gate is not None:
        context = ops.multiply(context, gate)
    norm = settings.output_norm
    if norm is not None:
        shape = ops.shape(context)
        merged = ops.reshape(
            context, (*shape[:-2], settings.num_heads * settings.value_dim))
        context = ops.reshape(norm(merged), shape)
    if settings.differential is not None:
        context = layer.differential_layer(context)  # (B, ..., N/2, V)
    return context
