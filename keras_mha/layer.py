"""`keras_mha.MultiHeadAttention`: projections around one attention call.

`call` reads as: check the arguments (`checks.py`), project the inputs into
heads (`axes.py` folds any `attention_axes` into one sequence), describe
what the call asks of attention (an `AttentionSpec`), attend
(`keras_mha.attention.attend` picks the algorithm), project back.
"""

import keras
from keras import ops

from keras_mha import checks
from keras_mha import projections
from keras_mha.attention import attend
from keras_mha.attention import cache as cache_lib
from keras_mha.attention import dispatch
from keras_mha.attention import masks as masks_lib
from keras_mha.attention import spec as spec_lib


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
        num_heads = checks.positive_int("num_heads", num_heads)
        key_dim = checks.positive_int("key_dim", key_dim)
        value_dim = checks.positive_int("value_dim", value_dim, allow_none=True)
        num_key_value_heads = checks.positive_int(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if num_key_value_heads is not None and num_heads % num_key_value_heads:
            raise ValueError(
                "`num_key_value_heads` must divide `num_heads`. Received: "
                f"num_heads={num_heads}, "
                f"num_key_value_heads={num_key_value_heads}"
            )
        dropout = checks.dropout_rate(dropout)
        if sliding_window is not None:
            try:
                sliding_window = checks.positive_int(
                    "sliding_window", sliding_window
                )
            except ValueError:
                raise ValueError(
                    "`sliding_window` must be `None` or a positive integer. "
                    f"Received: sliding_window={sliding_window!r}"
                ) from None
        flash_attention = checks.flash_attention(flash_attention, dropout)
        super().__init__(**kwargs)
        self.supports_masking = True
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._value_dim = value_dim or key_dim
        self._num_key_value_heads = num_key_value_heads or num_heads
        self._dropout = dropout
        self._use_bias = bool(use_bias)
        self._use_gate = bool(use_gate)
        self._output_shape = checks.output_shape(output_shape)
        self._attention_axes = checks.attention_axes(attention_axes)
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
        self._scale = spec_lib.default_scale(key_dim)

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
        self._layout = checks.input_shapes(
            query_shape, value_shape, key_shape, self._attention_axes
        )
        self._feature_sizes = {
            "query": query_shape[-1],
            "value": value_shape[-1],
            "key": key_shape[-1],
        }
        heads = {
            "query": (self._num_heads, self._key_dim, query_shape),
            "key": (self._num_key_value_heads, self._key_dim, key_shape),
            "gate": (self._num_heads, self._value_dim, query_shape),
            "value": (self._num_key_value_heads, self._value_dim, value_shape),
        }
        # Keras's order (query, key, gate, value, then output), so
        # `get_weights()` lines up with Keras's layers.
        for name, (count, size, shape) in heads.items():
            if name == "gate" and not self._use_gate:
                continue
            dense = projections.heads_projection(
                self, len(shape), count, size, name,
                activation="sigmoid" if name == "gate" else None,
            )
            dense.build(shape)
            setattr(self, f"_{name}_dense", dense)
        # Holds the dropout's `SeedGenerator`, as Keras's layer does; every
        # path drops weights with it (see `AttentionSpec.seed`).
        self._dropout_layer = keras.layers.Dropout(
            rate=self._dropout, dtype=self.dtype_policy, seed=self.seed
        )
        self._output_dense = projections.output_projection(
            self, len(query_shape), self._output_shape or (query_shape[-1],)
        )
        self._output_dense.build(
            query_shape[:-1] + (self._num_heads, self._value_dim)
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
        checks.call_arguments(
            self, query, value, key, query_mask, value_mask, key_mask,
            attention_mask, return_attention_scores, use_causal_mask, cache,
            cache_update_index,
        )
        layout = self._layout
        gate = self._gate_dense(query) if self._use_gate else None
        q = layout.to_sequence(self._query_dense(query))  # (B', T, N, H)
        k = layout.to_sequence(self._key_dense(key))  # (B', S, K, H)
        v = layout.to_sequence(self._value_dense(value))  # (B', S, K, V)
        query_tokens = _bool(layout.token_mask(query_mask))  # (B', T)
        key_tokens = masks_lib.combine_masks(
            _bool(layout.token_mask(value_mask)),
            _bool(layout.token_mask(key_mask)),
        )  # (B', S)
        # Padding is never read, yet a weight of 0 times a NaN or inf there
        # is NaN: zero padded tokens so garbage cannot leak into real ones.
        q = _zero_padding(q, query_tokens)
        k = _zero_padding(k, key_tokens)
        v = _zero_padding(v, key_tokens)

        spec = self._describe(
            query_tokens,
            key_tokens,
            layout.attention_mask(attention_mask, query, key, self._num_heads),
            use_causal_mask,
            training,
            return_attention_scores,
        )
        new_cache = None
        if cache is not None:
            k, v, keys_valid, key_positions, new_cache = (
                cache_lib.attend_inputs(
                    cache, k, v, key_tokens, cache_update_index,
                    self.rolling_cache,
                )
            )
            spec = spec.replace(
                query_offset=cache_update_index,
                key_positions=key_positions,
                key_mask=keys_valid,
            )
        context, scores = attend(q, k, v, spec)  # (B', T, N, V)

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

    def _describe(
        self, query_tokens, key_tokens, dense_mask, use_causal_mask, training,
        return_attention_scores,
    ):
        """The `AttentionSpec` of a call without a cache (see `call`)."""
        dropout = self._dropout if training else 0.0
        return spec_lib.AttentionSpec(
            scale=self._scale,
            causal=bool(use_causal_mask),
            window=spec_lib.window_sides(self._sliding_window, use_causal_mask),
            query_mask=query_tokens,
            key_mask=key_tokens,
            attention_mask=dense_mask,
            dropout=dropout,
            seed=self._dropout_layer.seed_generator
            if dropout and self.built
            else None,
            return_weights=bool(return_attention_scores),
            flash_attention=self._flash_attention,
        )

    def attention_path(
        self,
        query_shape,
        value_shape,
        key_shape=None,
        *,
        query_mask=False,
        value_mask=False,
        key_mask=False,
        attention_mask=False,
        use_causal_mask=False,
        return_attention_scores=False,
        training=False,
        cache=False,
    ):
        """The attention path a call would run: one of `dispatch.PATHS`.

        The layer describes the call as `call` does and asks the dispatch
        rule, without computing anything (the layer need not be built).

        Args:
            query_shape, value_shape, key_shape: the inputs' shapes.
            query_mask, value_mask, key_mask, attention_mask: whether each
                mask is given.
            use_causal_mask, return_attention_scores, training: as in
                `call`.
            cache: whether the call decodes with a cache.
        """
        query_shape, value_shape = tuple(query_shape), tuple(value_shape)
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        layout = checks.input_shapes(
            query_shape, value_shape, key_shape, self._attention_axes
        )
        length = layout.sequence_length
        t_len, s_len = length(query_shape), length(key_shape)
        batch = query_shape[0]

        def placeholder(given, shape, dtype="bool"):
            return keras.KerasTensor(shape, dtype=dtype) if given else None

        spec = self._describe(
            placeholder(query_mask, (batch, t_len)),
            placeholder(value_mask or key_mask, (batch, s_len)),
            placeholder(attention_mask, (batch, self._num_heads, t_len, s_len)),
            use_causal_mask,
            training,
            return_attention_scores,
        )
        if cache:
            spec = spec.replace(
                query_offset=placeholder(True, (), "int32"),
                key_positions=placeholder(True, (None,), "int32"),
            )
            s_len = None
        shapes = dispatch.Shapes(t_len, s_len, self._key_dim, self._value_dim)
        return dispatch.choose_path(spec, shapes)

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
        checks.positive_int("batch_size", batch_size)
        checks.positive_int("max_length", max_length)
        slots = self._sliding_window if self.rolling_cache else max_length
        shape = cache_lib.cache_shape(
            batch_size, slots, self._num_key_value_heads, self._key_dim,
            self._value_dim,
        )
        return ops.zeros(shape, dtype=self.compute_dtype)

    # ----------------------------------------------------------------- shapes

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        query_shape = tuple(query_shape)
        checks.input_shapes(
            query_shape, tuple(value_shape), tuple(key_shape),
            self._attention_axes,
        )
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
        checks.call_arguments(
            self, query, value, key, query_mask, value_mask, key_mask,
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
            layout = checks.input_shapes(
                tuple(query.shape), tuple(value.shape),
                tuple((value if key is None else key).shape),
                self._attention_axes,
            )
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


def _bool(mask):
    return None if mask is None else ops.cast(mask, "bool")


def _zero_padding(x, tokens):
    """`x` `(B', L, heads, X)` with the positions where `tokens` is False
    set to 0; `x` itself when `tokens` is `None`."""
    if tokens is None:
        return x
    keep = tokens[:, :, None, None]  # (B', L, 1, 1)
    return ops.where(keep, x, ops.zeros_like(x))
