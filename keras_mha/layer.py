"""`keras_mha.MultiHeadAttention`: projections around the attention paths."""

import functools
import math
import numbers
import string

import keras
import numpy as np
from keras import ops

from keras_mha import attention as attention_lib
from keras_mha import banded as banded_lib
from keras_mha import cache as cache_lib
from keras_mha import dispatch
from keras_mha import masks as masks_lib


def _check_positive_int(name, value, allow_none=False):
    """Returns `value` as a Python int (NumPy integers too), or `None`."""
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value <= 0
    ):
        expected = "a positive integer" + (" or `None`" if allow_none else "")
        raise ValueError(
            f"Argument `{name}` must be {expected}. Received: {name}={value!r}"
        )
    return int(value)


def _shape_and_dtype(x):
    """`(shape, dtype)` of a tensor, `KerasTensor`, array or nested list."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    return tuple(x.shape), keras.backend.standardize_dtype(x.dtype)


def _check_mask(name, mask, targets, broadcast=True):
    """Checks that a mask is boolean or integer and has a shape it may have.

    Args:
        name: the argument's name, for the message.
        mask: the mask, in any form `_shape_and_dtype` takes.
        targets: `{rank: (description, shape)}`; `None` sizes are unknown.
        broadcast: whether sizes of 1 broadcast.
    """
    shape, dtype = _shape_and_dtype(mask)
    if dtype != "bool" and "int" not in dtype:
        raise TypeError(
            f"`{name}` must be boolean or integer (True/1 = may attend). "
            f"Received: {name}.dtype={dtype}"
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


def _projection_equation(free_dims, bound_dims, output_dims):
    """EinsumDense equation and bias axes, letter for letter as in Keras.

    Keeping Keras's equations keeps the kernels' shapes, and so
    `set_weights(keras_layer.get_weights())` works both ways.
    """
    letters = string.ascii_lowercase
    free = letters[:free_dims]
    bound = letters[free_dims : free_dims + bound_dims]
    out = letters[free_dims + bound_dims : free_dims + bound_dims + output_dims]
    return f"{free}{bound},{bound}{out}->{free}{out}", out


@keras.saving.register_keras_serializable(package="keras_mha")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention, a drop-in for `keras.layers.MultiHeadAttention`.

    Projects `query`, `key` and `value` into heads, attends, concatenates the
    heads and projects them back. Arguments, weights and results are those of
    Keras's layer; where they differ it is on purpose (see the README):
    rows with nothing to attend to give zeros on every path, half-precision
    softmax never overflows, input masks survive the call.

    Args:
        num_heads: `N`, the number of query heads.
        key_dim: `H`, the size of each query and key head.
        value_dim: `V`, the size of each value head; `key_dim` if `None`.
        dropout: dropout rate on the attention weights, in `[0, 1)`.
        use_bias: whether the projections have biases.
        output_shape: the output's trailing shape (int or tuple); the query's
            feature size `E` if `None`.
        attention_axes: axes of the input (not batch, not features) attended
            over; all of them if `None`.
        sliding_window: `None` or `w`: query position `p` sees keys `j` with
            `|p - j| < w` (with `use_causal_mask`, the `w` keys up to and
            including `p`).
        flash_attention: passed to `keras.ops.dot_product_attention`:
            `None` (auto), `True` (require) or `False` (never).
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: as for `keras.layers.EinsumDense`.
        use_gate: whether a sigmoid gate computed from the query multiplies
            the heads before the output projection.
        seed: seed of the dropout.
        num_key_value_heads: `K`, the number of key/value heads (grouped-query
            attention); must divide `num_heads`. `num_heads` if `None`.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: `(B, T, E)`, or `(B, ..., E)` with `attention_axes`.
        value: `(B, S, E_v)`.
        key: `(B, S, E_k)`; `value` if `None`.
        query_mask: `(B, T)`, from the query's Keras mask if not given.
        value_mask: `(B, S)`, from the value's Keras mask if not given.
        key_mask: `(B, S)`, from the key's Keras mask if not given.
        attention_mask: boolean or integer, `True`/1 = may attend, of shape
            `(T, S)`, `(1, T, S)`, `(B, 1, S)`, `(B, T, S)` or `(B, N, T, S)`.
        return_attention_scores: also return the attention weights.
        training: whether dropout is applied.
        use_causal_mask: key `j` is visible from query `t` only if `j <= t`.

    Returns:
        `output` of shape `(B, T, E)` (or `output_shape`), or
        `(output, scores)` with scores `(B, N, T, S)` when
        `return_attention_scores=True`.
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        attention_axes=None,
        sliding_window=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate=False,
        seed=None,
        num_key_value_heads=None,
        **kwargs,
    ):
        num_heads = _check_positive_int("num_heads", num_heads)
        key_dim = _check_positive_int("key_dim", key_dim)
        value_dim = _check_positive_int("value_dim", value_dim, allow_none=True)
        num_key_value_heads = _check_positive_int(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if num_key_value_heads is not None and num_heads % num_key_value_heads:
            raise ValueError(
                "`num_key_value_heads` must divide `num_heads`. Received: "
                f"num_heads={num_heads}, "
                f"num_key_value_heads={num_key_value_heads}"
            )
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, numbers.Real)
            or not 0.0 <= dropout < 1.0
        ):
            raise ValueError(
                "Argument `dropout` must be a number in [0, 1). "
                f"Received: dropout={dropout!r}"
            )
        sliding_window = _check_positive_int(
            "sliding_window", sliding_window, allow_none=True
        )
        if flash_attention is not None and not isinstance(
            flash_attention, bool
        ):
            raise ValueError(
                "Argument `flash_attention` must be `None`, `True` or `False`. "
                f"Received: flash_attention={flash_attention!r}"
            )
        if flash_attention and dropout > 0.0:
            raise ValueError(
                "Dropout is not supported when flash attention is required. "
                f"Received: flash_attention=True, dropout={dropout}"
            )
        super().__init__(**kwargs)
        self.supports_masking = True
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._value_dim = value_dim or key_dim
        self._num_key_value_heads = num_key_value_heads or num_heads
        self._dropout = float(dropout)
        self._use_bias = bool(use_bias)
        self._use_gate = bool(use_gate)
        self._output_shape = _normalize_output_shape(output_shape)
        self._attention_axes = _normalize_attention_axes(attention_axes)
        if (
            sliding_window is not None
            and self._attention_axes is not None
            and len(self._attention_axes) > 1
        ):
            raise ValueError(
                "`sliding_window` needs a single attention axis. Received: "
                f"sliding_window={sliding_window}, "
                f"attention_axes={attention_axes}"
            )
        self._sliding_window = sliding_window
        self._flash_attention = flash_attention
        self._kernel_initializer = keras.initializers.get(kernel_initializer)
        self._bias_initializer = keras.initializers.get(bias_initializer)
        self._kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self._bias_regularizer = keras.regularizers.get(bias_regularizer)
        self._activity_regularizer = keras.regularizers.get(
            activity_regularizer
        )
        self._kernel_constraint = keras.constraints.get(kernel_constraint)
        self._bias_constraint = keras.constraints.get(bias_constraint)
        self.seed = seed
        self._scale = 1.0 / math.sqrt(float(key_dim))

    # Properties as in Keras. `output_shape` is not one: it would clash with
    # `Functional.summary()`.
    @property
    def num_heads(self):
        return self._num_heads

    @property
    def num_key_value_heads(self):
        return self._num_key_value_heads

    @property
    def key_dim(self):
        return self._key_dim

    @property
    def value_dim(self):
        return self._value_dim

    @property
    def dropout(self):
        return self._dropout

    @property
    def use_bias(self):
        return self._use_bias

    @property
    def attention_axes(self):
        return self._attention_axes

    @property
    def sliding_window(self):
        return self._sliding_window

    @property
    def flash_attention(self):
        return self._flash_attention

    @property
    def query_dense(self):
        return self._query_dense

    @property
    def key_dense(self):
        return self._key_dense

    @property
    def value_dense(self):
        return self._value_dense

    @property
    def output_dense(self):
        return self._output_dense

    def get_config(self):
        config = {
            "num_heads": self._num_heads,
            "key_dim": self._key_dim,
            "value_dim": self._value_dim,
            "dropout": self._dropout,
            "use_bias": self._use_bias,
            "use_gate": self._use_gate,
            "output_shape": self._output_shape,
            "attention_axes": self._attention_axes,
            "sliding_window": self._sliding_window,
            "flash_attention": self._flash_attention,
            "num_key_value_heads": self._num_key_value_heads,
            "kernel_initializer": keras.initializers.serialize(
                self._kernel_initializer
            ),
            "bias_initializer": keras.initializers.serialize(
                self._bias_initializer
            ),
            "kernel_regularizer": keras.regularizers.serialize(
                self._kernel_regularizer
            ),
            "bias_regularizer": keras.regularizers.serialize(
                self._bias_regularizer
            ),
            "activity_regularizer": keras.regularizers.serialize(
                self._activity_regularizer
            ),
            "kernel_constraint": keras.constraints.serialize(
                self._kernel_constraint
            ),
            "bias_constraint": keras.constraints.serialize(
                self._bias_constraint
            ),
            "seed": self.seed,
        }
        return {**super().get_config(), **config}

    # ------------------------------------------------------------------ build

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        query_shape, value_shape, key_shape = (
            tuple(query_shape),
            tuple(value_shape),
            tuple(key_shape),
        )
        self._check_input_shapes(query_shape, value_shape, key_shape)
        rank = len(query_shape)
        self._layout = _AxesLayout(rank, self._attention_axes)
        self._feature_sizes = {
            "query": query_shape[-1],
            "value": value_shape[-1],
            "key": key_shape[-1],
        }
        self._query_dense = self._projection(
            rank, [self._num_heads, self._key_dim], "query"
        )
        self._query_dense.build(query_shape)
        self._key_dense = self._projection(
            rank, [self._num_key_value_heads, self._key_dim], "key"
        )
        self._key_dense.build(key_shape)
        if self._use_gate:
            self._gate_dense = self._projection(
                rank,
                [self._num_heads, self._value_dim],
                "gate",
                activation="sigmoid",
            )
            self._gate_dense.build(query_shape)
        self._value_dense = self._projection(
            rank, [self._num_key_value_heads, self._value_dim], "value"
        )
        self._value_dense.build(value_shape)
        self._dropout_layer = keras.layers.Dropout(
            rate=self._dropout, dtype=self.dtype_policy, seed=self.seed
        )
        output_shape = self._output_shape or (query_shape[-1],)
        equation, bias_axes = _projection_equation(
            rank - 1, 2, len(output_shape)
        )
        self._output_dense = keras.layers.EinsumDense(
            equation,
            output_shape=[None] * (rank - 2) + list(output_shape),
            bias_axes=bias_axes if self._use_bias else None,
            name="attention_output",
            **self._sublayer_kwargs(),
        )
        self._output_dense.build(
            query_shape[:-1] + (self._num_heads, self._value_dim)
        )

    def _projection(self, rank, heads_shape, name, activation=None):
        equation, bias_axes = _projection_equation(rank - 1, 1, 2)
        projection = keras.layers.EinsumDense(
            equation,
            output_shape=[None] * (rank - 2) + heads_shape,
            bias_axes=bias_axes if self._use_bias else None,
            activation=activation,
            name=name,
            **self._sublayer_kwargs(),
        )
        # Per-token projections keep the inputs' Keras masks, which this
        # layer leaves in place (Keras's layer deletes them instead).
        projection.supports_masking = True
        return projection

    def _sublayer_kwargs(self):
        # Fresh initializer instances: a shared stateless initializer would
        # give every projection the same values.
        def clone(initializer):
            return initializer.__class__.from_config(initializer.get_config())

        return dict(
            kernel_initializer=clone(self._kernel_initializer),
            bias_initializer=clone(self._bias_initializer),
            kernel_regularizer=self._kernel_regularizer,
            bias_regularizer=self._bias_regularizer,
            activity_regularizer=self._activity_regularizer,
            kernel_constraint=self._kernel_constraint,
            bias_constraint=self._bias_constraint,
            dtype=self.dtype_policy,
        )

    def _check_input_shapes(self, query_shape, value_shape, key_shape):
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
        if not _dims_agree(value_shape[:-1], key_shape[:-1]):
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
        layout = _AxesLayout(len(query_shape), self._attention_axes)
        batch_axes = layout.batch_axes
        query_batch = tuple(query_shape[a] for a in [0, *batch_axes])
        value_batch = tuple(value_shape[a] for a in [0, *batch_axes])
        if not _dims_agree(query_batch, value_batch):
            raise ValueError(
                "`query` and `value` must agree on the batch and "
                "non-attention axes. Received: "
                f"query.shape={query_shape}, value.shape={value_shape}, "
                f"attention_axes={self._attention_axes}"
            )
        if any(value_shape[a] == 0 for a in layout.attention_axes):
            raise ValueError(
                "`value` must have at least one position to attend to. "
                f"Received: value.shape={value_shape}"
            )

    def _check_built_shapes(self, query_shape, value_shape, key_shape):
        """Inputs must fit the weights: same rank and feature sizes."""
        if not self.built:
            return
        for name, shape in (
            ("query", query_shape),
            ("value", value_shape),
            ("key", key_shape),
        ):
            features = self._feature_sizes[name]
            if len(shape) != self._layout.rank or shape[-1] not in (
                None,
                features,
            ):
                raise ValueError(
                    f"`{name}` must have rank {self._layout.rank} and "
                    f"{features} features, as when the layer was built. "
                    f"Received: {name}.shape={shape}"
                )

    def _check_call_arguments(
        self,
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
    ):
        """Checks a call from shapes and dtypes alone.

        Runs in `call` and in `compute_output_spec`, so bad inputs fail
        while a Functional model is built, and never as a backend error.
        """
        key = value if key is None else key
        query_shape, value_shape, key_shape = (
            tuple(query.shape),
            tuple(value.shape),
            tuple(key.shape),
        )
        self._check_input_shapes(query_shape, value_shape, key_shape)
        self._check_built_shapes(query_shape, value_shape, key_shape)
        layout = _AxesLayout(len(query_shape), self._attention_axes)
        for name, mask, shape in (
            ("query_mask", query_mask, query_shape),
            ("value_mask", value_mask, value_shape),
            ("key_mask", key_mask, key_shape),
        ):
            if mask is not None:
                target = {len(shape) - 1: ("(B, ...)", shape[:-1])}
                _check_mask(name, mask, target, broadcast=layout.identity)
        if attention_mask is not None:
            _check_mask(
                "attention_mask",
                attention_mask,
                layout.attention_mask_targets(
                    query_shape, key_shape, self._num_heads
                ),
            )
        if use_causal_mask and layout.multi_axis:
            raise ValueError(
                "`use_causal_mask=True` needs a single attention axis. "
                f"Received: attention_axes={self._attention_axes}"
            )
        if return_attention_scores and self._flash_attention:
            raise ValueError(
                "Attention scores cannot be returned when flash attention is "
                "required. Received: flash_attention=True, "
                "return_attention_scores=True"
            )
        if cache is not None or cache_update_index is not None:
            self._check_cache_call(
                query, value, key, cache, cache_update_index,
                use_causal_mask, attention_mask,
            )

    # ------------------------------------------------------------------- call

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
    ):
        if key is None:
            key = value
        self._check_call_arguments(
            query, value, key, query_mask, value_mask, key_mask,
            attention_mask, return_attention_scores, use_causal_mask, cache,
            cache_update_index,
        )
        layout = self._layout
        path = dispatch.choose_path(
            return_attention_scores=return_attention_scores,
            dropout_active=bool(training) and self._dropout > 0.0,
            key_dim=self._key_dim,
            value_dim=self._value_dim,
            sliding_window=None if cache is not None else self._sliding_window,
            query_length=layout.sequence_length(query),
            key_length=layout.sequence_length(key),
            has_attention_mask=attention_mask is not None,
            causal=use_causal_mask and cache is None,
            flash_attention=self._flash_attention,
        )

        gate = self._gate_dense(query) if self._use_gate else None
        q = layout.to_sequence(self._query_dense(query))  # (B', T, N, H)
        k = layout.to_sequence(self._key_dense(key))  # (B', S, K, H)
        v = layout.to_sequence(self._value_dense(value))  # (B', S, K, V)
        query_tokens = layout.token_mask(query_mask)  # (B', T)
        key_tokens = masks_lib.combine_masks(
            layout.token_mask(value_mask), layout.token_mask(key_mask)
        )  # (B', S)
        # Padding is never read, yet a weight of 0 times a NaN or inf there
        # is NaN: zero padded tokens so garbage cannot leak into real ones.
        q = _zero_padding(q, query_tokens)
        k = _zero_padding(k, key_tokens)
        v = _zero_padding(v, key_tokens)

        new_cache = None
        scores = None
        if path == dispatch.BANDED:
            context = banded_lib.banded_attention(
                q,
                k,
                v,
                window=self._sliding_window,
                causal=use_causal_mask,
                scale=self._scale,
                query_mask=query_tokens,
                key_mask=key_tokens,
                dropout=self._dropout if training else 0.0,
                seed=self._dropout_layer.seed_generator
                if training and self._dropout > 0.0
                else None,
            )
        elif path == dispatch.TRIANGULAR:
            context = attention_lib.triangular_attention(
                q, k, v, scale=self._scale, query_mask=query_tokens,
                key_mask=key_tokens,
            )
        elif cache is not None:
            context, scores, new_cache = self._attend_with_cache(
                path, q, k, v, query_tokens, key_tokens, cache,
                cache_update_index, training,
            )
        else:
            explicit_mask = layout.attention_mask(
                attention_mask, query, key, self._num_heads
            )
            padding = masks_lib.padding_mask(query_tokens, key_tokens)
            # Causal alone goes to the backend's native causal kernel.
            native_causal = (
                path == dispatch.FUSED
                and use_causal_mask
                and self._sliding_window is None
                and padding is None
                and explicit_mask is None
            )
            mask = None
            if not native_causal:
                positional = masks_lib.causal_window_mask(
                    ops.shape(q)[1],
                    ops.shape(k)[1],
                    causal=use_causal_mask,
                    window=self._sliding_window,
                )
                mask = masks_lib.combine_masks(
                    padding, explicit_mask, positional
                )
            context, scores = self._attend(
                path, q, k, v, mask, native_causal, training
            )

        context = layout.from_sequence(context, query)  # (B, ..., N, V)
        if gate is not None:
            context = ops.multiply(context, gate)
        # The output carries the query's Keras mask: `Layer.__call__` sets it.
        output = self._output_dense(context)
        results = [output]
        if return_attention_scores:
            scores = layout.scores_from_sequence(scores, query, key)
            results.append(ops.cast(scores, self.compute_dtype))
        if new_cache is not None:
            results.append(new_cache)
        return results[0] if len(results) == 1 else tuple(results)

    def _attend(self, path, q, k, v, mask, native_causal, training):
        """Runs the fused or explicit path: `(context, scores or None)`."""
        if path == dispatch.FUSED:
            context = attention_lib.fused_attention(
                q,
                k,
                v,
                mask=mask,
                is_causal=native_causal,
                scale=self._scale,
                flash_attention=self._flash_attention,
            )
            return context, None
        dropout = None
        if bool(training) and self._dropout > 0.0:
            dropout = functools.partial(self._dropout_layer, training=training)
        return attention_lib.dense_attention(
            q, k, v, mask=mask, scale=self._scale, dropout=dropout
        )

    # ------------------------------------------------------------------ cache

    @property
    def rolling_cache(self):
        """Whether the cache is a rolling buffer of `sliding_window` slots."""
        return self._sliding_window is not None

    def init_cache(self, batch_size, max_length):
        """A zero key/value cache for decoding up to `max_length` tokens.

        Args:
            batch_size: `B`.
            max_length: the longest sequence to decode. With a
                `sliding_window` the cache is a rolling buffer of `w` slots
                whatever `max_length` is.

        Returns:
            A tensor `(B, L, K, H + V + 1)` in the layer's compute dtype:
            keys, values and a per-slot "real token" flag (see
            `keras_mha.cache`). `L` is `max_length`, or `w` when rolling.
        """
        _check_positive_int("batch_size", batch_size)
        _check_positive_int("max_length", max_length)
        slots = self._sliding_window if self.rolling_cache else max_length
        return ops.zeros(
            cache_lib.cache_shape(
                batch_size,
                slots,
                self._num_key_value_heads,
                self._key_dim,
                self._value_dim,
            ),
            dtype=self.compute_dtype,
        )

    def _check_cache_call(
        self, query, value, key, cache, index, use_causal_mask, attention_mask
    ):
        if cache is None or index is None:
            raise ValueError(
                "`cache` and `cache_update_index` go together. Received: "
                f"cache={'None' if cache is None else 'a tensor'}, "
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
                f"{_shape_and_dtype(attention_mask)[0]}"
            )
        for name, tensor in (("value", value), ("key", key)):
            if not _dims_agree(tuple(tensor.shape)[1:2], query.shape[1:2]):
                raise ValueError(
                    f"With a cache, `{name}` holds the new tokens: it must "
                    "have the length of `query`. Received: "
                    f"query.shape={tuple(query.shape)}, "
                    f"{name}.shape={tuple(tensor.shape)}"
                )
        if not hasattr(cache, "shape") or not hasattr(cache, "dtype"):
            raise TypeError(
                "`cache` must be a tensor (see `init_cache`). Received: "
                f"cache of type {type(cache).__name__}"
            )
        dtype = keras.backend.standardize_dtype(cache.dtype)
        if "float" not in dtype:
            raise TypeError(
                "`cache` must be a floating-point tensor (see `init_cache`). "
                f"Received: cache.dtype={dtype}"
            )
        expected = cache_lib.cache_shape(
            query.shape[0],
            self._sliding_window if self.rolling_cache else cache.shape[1],
            self._num_key_value_heads,
            self._key_dim,
            self._value_dim,
        )
        if len(cache.shape) != 4 or not _dims_agree(
            tuple(cache.shape), expected
        ):
            raise ValueError(
                "`cache` must have shape (B, L, K, H + V + 1) = "
                f"{expected} (see `init_cache`). Received: "
                f"cache.shape={tuple(cache.shape)}"
            )
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
        if isinstance(index, numbers.Integral):
            index = int(index)
            length = query.shape[1]
            if index < 0 or (
                not self.rolling_cache
                and length is not None
                and index + length > cache.shape[1]
            ):
                raise ValueError(
                    "`cache_update_index` is out of range: positions "
                    f"{index}..{index + (length or 1) - 1} do not fit a "
                    f"cache of {cache.shape[1]} slots. Received: "
                    f"cache_update_index={index}"
                )

    def _attend_with_cache(
        self, path, q, k, v, query_tokens, key_tokens, cache, index, training
    ):
        """Attends to the cached tokens and the new ones; writes the new.

        Keys are the cache's slots as they were before this call followed by
        the new tokens, so a rolling cache can take a prompt longer than its
        window in one call. Returns `(context, scores, new_cache)`, scores
        `(B, N, T, L + T)` over that same key order.
        """
        rolling = self.rolling_cache
        num_slots = cache.shape[1]
        length = ops.shape(q)[1]
        index = ops.cast(index, "int32")
        old_k, old_v, old_valid = cache_lib.split(
            cache, self._key_dim, self._value_dim
        )
        old_positions = cache_lib.slot_positions(index, num_slots, rolling)
        old_valid = ops.logical_and(old_valid, old_positions[None] >= 0)
        new_positions = index + ops.arange(length, dtype="int32")
        new_valid = key_tokens
        if new_valid is None:
            new_valid = ops.ones(ops.shape(k)[:2], dtype="bool")
        keys_valid = ops.concatenate(
            [old_valid, ops.cast(new_valid, "bool")], axis=1
        )  # (B, L + T)
        key_positions = ops.concatenate([old_positions, new_positions])
        positional = masks_lib.position_mask(
            ops.reshape(new_positions, (1, 1, -1, 1)),  # (1, 1, T, 1)
            ops.reshape(key_positions, (1, 1, 1, -1)),  # (1, 1, 1, L + T)
            causal=True,
            window=self._sliding_window,
        )
        mask = masks_lib.combine_masks(
            masks_lib.padding_mask(query_tokens, keys_valid), positional
        )
        keys = ops.concatenate([ops.cast(old_k, k.dtype), k], axis=1)
        values = ops.concatenate([ops.cast(old_v, v.dtype), v], axis=1)
        context, scores = self._attend(
            path, q, keys, values, mask, False, training
        )
        new_cache = cache_lib.write(cache, k, v, new_valid, index, rolling)
        return context, scores, new_cache

    # ----------------------------------------------------------------- shapes

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        query_shape = tuple(query_shape)
        self._check_input_shapes(query_shape, tuple(value_shape), key_shape)
        if self._output_shape:
            return query_shape[:-1] + self._output_shape
        return query_shape

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
    ):
        self._check_call_arguments(
            query, value, key, query_mask, value_mask, key_mask,
            attention_mask, return_attention_scores, use_causal_mask, cache,
            cache_update_index,
        )
        key_shape = None if key is None else key.shape
        specs = [
            keras.KerasTensor(
                self.compute_output_shape(query.shape, value.shape, key_shape),
                dtype=self.compute_dtype,
            )
        ]
        if return_attention_scores:
            layout = _AxesLayout(len(query.shape), self._attention_axes)
            scores_shape = layout.scores_shape(
                tuple(query.shape), tuple(value.shape), self._num_heads
            )
            if cache is not None:  # keys: the old slots, then the new tokens
                scores_shape = scores_shape[:-1] + (
                    None
                    if query.shape[1] is None
                    else cache.shape[1] + query.shape[1],
                )
            specs.append(
                keras.KerasTensor(scores_shape, dtype=self.compute_dtype)
            )
        if cache is not None:
            specs.append(keras.KerasTensor(cache.shape, dtype=cache.dtype))
        return specs[0] if len(specs) == 1 else tuple(specs)


def _normalize_output_shape(output_shape):
    if output_shape is None:
        return None
    shape = output_shape
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d > 0
        for d in shape
    ):
        raise ValueError(
            "Argument `output_shape` must be a positive integer or a tuple "
            f"of positive integers. Received: output_shape={output_shape!r}"
        )
    return tuple(int(d) for d in shape) or None


def _normalize_attention_axes(attention_axes):
    if attention_axes is None:
        return None
    if isinstance(attention_axes, int) and not isinstance(
        attention_axes, bool
    ):
        attention_axes = (attention_axes,)
    if (
        not isinstance(attention_axes, (tuple, list))
        or not attention_axes
        or not all(
            isinstance(a, int) and not isinstance(a, bool)
            for a in attention_axes
        )
    ):
        raise ValueError(
            "Argument `attention_axes` must be an int or a non-empty tuple of "
            f"ints. Received: attention_axes={attention_axes!r}"
        )
    return tuple(attention_axes)


def _zero_padding(x, tokens):
    """`x` `(B', L, heads, X)` with the positions where `tokens` is False
    set to 0; `x` itself when `tokens` is `None`."""
    if tokens is None:
        return x
    keep = ops.cast(tokens, "bool")[:, :, None, None]  # (B', L, 1, 1)
    return ops.where(keep, x, ops.zeros_like(x))


def _dims_agree(a, b):
    """Equal, where both are known."""
    return len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b)
    )


class _AxesLayout:
    """Moves inputs with any `attention_axes` to the `(B', T, N, X)` form.

    The attention paths see one batch axis and one sequence axis. Inputs of
    rank 3 with the default axes are already in that form and pass through
    untouched; otherwise non-attention axes are folded into the batch and
    attention axes into the sequence, as Keras's einsum equations do.
    """

    def __init__(self, rank, attention_axes):
        self.rank = rank
        inner = tuple(range(1, rank - 1))  # the non-batch, non-feature axes
        if attention_axes is None:
            axes = inner
        else:
            # Negative axes count from the end of the input, as in Keras.
            axes = tuple(a + rank if a < 0 else a for a in attention_axes)
            bad = [a for a, n in zip(attention_axes, axes) if n not in inner]
            if bad or len(set(axes)) != len(axes):
                raise ValueError(
                    "`attention_axes` must be distinct axes of the input "
                    f"other than batch (0) and features ({rank - 1}). "
                    f"Received: attention_axes={attention_axes} for inputs "
                    f"of rank {rank}"
                )
        self.attention_axes = tuple(sorted(axes))
        self.batch_axes = tuple(a for a in inner if a not in axes)
        self.multi_axis = len(self.attention_axes) > 1
        self.identity = rank == 3
        # Projected tensors have rank `rank + 1`: (B, ..., N, X).
        self.perm = (0, *self.batch_axes, *self.attention_axes, rank - 1, rank)
        self.inverse_perm = tuple(
            self.perm.index(i) for i in range(len(self.perm))
        )

    def _sizes(self, tensor, axes):
        shape = ops.shape(tensor)
        return [shape[a] for a in axes]

    def sequence_length(self, x):
        """The static length of the attended sequence of `x`, or `None`."""
        dims = [x.shape[a] for a in self.attention_axes]
        return None if None in dims else math.prod(dims)

    def to_sequence(self, x):
        """`(B, ..., N, X)` -> `(B', T, N, X)`."""
        if self.identity:
            return x
        x = ops.transpose(x, self.perm)
        seq = math.prod(self._sizes(x, range(1 + len(self.batch_axes), self.rank - 1)))
        return ops.reshape(x, (-1, seq, x.shape[-2], x.shape[-1]))

    def from_sequence(self, x, query):
        """`(B', T, N, X)` -> `(B, ..., N, X)` laid out like `query`."""
        if self.identity:
            return x
        lead = self._sizes(query, (0, *self.batch_axes, *self.attention_axes))
        x = ops.reshape(x, (*lead, x.shape[-2], x.shape[-1]))
        return ops.transpose(x, self.inverse_perm)

    def token_mask(self, mask):
        """A Keras mask `(B, ...)` of the input -> `(B', T)`."""
        if mask is None or self.identity:
            return mask
        mask = ops.transpose(mask, self.perm[:-2])
        seq = math.prod(
            self._sizes(mask, range(1 + len(self.batch_axes), self.rank - 1))
        )
        return ops.reshape(mask, (-1, seq))

    def attention_mask_targets(self, query_shape, key_shape, num_heads):
        """`{rank: (description, shape)}`: what an `attention_mask` may be."""
        if self.identity:
            batch, t, s = query_shape[0], query_shape[1], key_shape[1]
            return {
                2: ("(T, S)", (t, s)),
                3: ("(B, T, S)", (batch, t, s)),
                4: ("(B, N, T, S)", (batch, num_heads, t, s)),
            }
        full = tuple(
            query_shape[a]
            for a in (0, *self.batch_axes, *self.attention_axes)
        ) + tuple(key_shape[a] for a in self.attention_axes)
        return {len(full): ("(B, <other axes>, <T axes>, <S axes>)", full)}

    def attention_mask(self, mask, query, key, num_heads):
        """A user `attention_mask` (checked) -> `(B'|1, N|1, T, S)` boolean."""
        if mask is None:
            return None
        mask = ops.cast(ops.convert_to_tensor(mask), "bool")
        if self.identity:
            return _rank4_mask(mask)
        # Keras's multi-axis layout: (B, <batch axes>, <T axes>, <S axes>).
        q_axes = self._sizes(query, (0, *self.batch_axes, *self.attention_axes))
        s_axes = self._sizes(key, self.attention_axes)
        full = (*q_axes, *s_axes)
        mask = ops.broadcast_to(mask, full)
        seq_t = math.prod(q_axes[1 + len(self.batch_axes) :])
        seq_s = math.prod(s_axes)
        return ops.reshape(mask, (-1, 1, seq_t, seq_s))  # (B', 1, T, S)

    def scores_from_sequence(self, scores, query, key):
        """`(B', N, T, S)` -> Keras's `(B, <batch>, N, <T axes>, <S axes>)`."""
        if self.identity:
            return scores
        lead = self._sizes(query, (0, *self.batch_axes))
        t_axes = self._sizes(query, self.attention_axes)
        s_axes = self._sizes(key, self.attention_axes)
        return ops.reshape(
            scores, (*lead, scores.shape[1], *t_axes, *s_axes)
        )

    def scores_shape(self, query_shape, key_shape, num_heads):
        lead = tuple(query_shape[a] for a in (0, *self.batch_axes))
        t_axes = tuple(query_shape[a] for a in self.attention_axes)
        s_axes = tuple(key_shape[a] for a in self.attention_axes)
        return (*lead, num_heads, *t_axes, *s_axes)


def _rank4_mask(mask):
    """A checked `attention_mask` of rank 2-4 -> `(B|1, N|1, T, S)`."""
    rank = len(mask.shape)
    if rank == 2:
        return mask[None, None]  # (1, 1, T, S)
    if rank == 3:
        return mask[:, None]  # (B|1, 1, T|1, S)
    return mask


_MHA_ONLY_ARGUMENTS = (
    "num_heads",
    "key_dim",
    "value_dim",
    "output_shape",
    "attention_axes",
)


@keras.saving.register_keras_serializable(package="keras_mha")
class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention, a drop-in for `keras.layers.GroupQueryAttention`.

    `MultiHeadAttention` with `num_key_value_heads` under the constructor and
    config of Keras's layer; weights copy both ways.

    Args:
        head_dim: `H = V`, the size of each head.
        num_query_heads: `N`.
        num_key_value_heads: `K`; must divide `num_query_heads`.
        dropout, use_bias, sliding_window, flash_attention,
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint, use_gate, seed: as for `MultiHeadAttention`.

    Call arguments, returns: as for `MultiHeadAttention`, rank-3 inputs.
    """

    def __init__(
        self,
        head_dim,
        num_query_heads,
        num_key_value_heads,
        dropout=0.0,
        use_bias=True,
        sliding_window=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate=False,
        seed=None,
        **kwargs,
    ):
        head_dim = _check_positive_int("head_dim", head_dim)
        num_query_heads = _check_positive_int(
            "num_query_heads", num_query_heads
        )
        num_key_value_heads = _check_positive_int(
            "num_key_value_heads", num_key_value_heads
        )
        if num_query_heads % num_key_value_heads:
            raise ValueError(
                "`num_key_value_heads` must divide `num_query_heads`. "
                f"Received: num_query_heads={num_query_heads}, "
                f"num_key_value_heads={num_key_value_heads}"
            )
        # `MultiHeadAttention`'s own arguments would be lost by `get_config`.
        foreign = {k: kwargs[k] for k in _MHA_ONLY_ARGUMENTS if k in kwargs}
        if foreign:
            received = ", ".join(f"{k}={v!r}" for k, v in foreign.items())
            raise ValueError(
                "`GroupedQueryAttention` does not take "
                f"{', '.join(f'`{k}`' for k in foreign)} (use "
                f"`MultiHeadAttention`). Received: {received}"
            )
        super().__init__(
            num_heads=num_query_heads,
            key_dim=head_dim,
            num_key_value_heads=num_key_value_heads,
            dropout=dropout,
            use_bias=use_bias,
            sliding_window=sliding_window,
            flash_attention=flash_attention,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            use_gate=use_gate,
            seed=seed,
            **kwargs,
        )

    @property
    def head_dim(self):
        return self._key_dim

    @property
    def num_query_heads(self):
        return self._num_heads

    def get_config(self):
        config = super().get_config()
        for name in _MHA_ONLY_ARGUMENTS:
            config.pop(name)
        config.update(head_dim=self._key_dim, num_query_heads=self._num_heads)
        return config
