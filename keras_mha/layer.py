"""`keras_mha.MultiHeadAttention`: projections around one attention call.

`call` reads as: check the arguments (`checks/`), project the inputs into
heads (`axes.py` folds any `attention_axes` into one sequence), describe
what the call asks of attention (an `AttentionSpec`), attend
(`keras_mha.attention.attend` picks the algorithm), project back.
"""

import keras
from keras import ops

from keras_mha import cache_methods
from keras_mha import checks
from keras_mha import describe as describe_lib
from keras_mha import differential as differential_lib
from keras_mha import heads as heads_lib
from keras_mha import hooks
from keras_mha import projections
from keras_mha import properties
from keras_mha import settings as settings_lib
from keras_mha import sharing
from keras_mha.attention import attend
from keras_mha.attention import attend_cached
from keras_mha.attention import attend_shared
from keras_mha.attention import masks as masks_lib
from keras_mha.attention import paged as paged_lib
from keras_mha.attention import spec as spec_lib

_read_only = properties.read_only

# The constructor's settings, fields of `layer.settings`: the config's
# entries, in its order, and read-only properties as in Keras but for
# `use_gate` and `output_shape` (`Functional.summary()` reads it).
_SETTINGS = (
    "num_heads", "key_dim", "value_dim", "dropout", "use_bias", "use_gate",
    "output_shape", "attention_axes", "sliding_window", "flash_attention",
    "num_key_value_heads", "attention_chunk_size", "use_sinks", "use_alibi",
    "qk_norm", "qk_norm_scope", "qk_norm_epsilon", "query_temperature",
    "qk_norm_after_rope", "value_norm", "qkv_clip", "gate_activation",
    "input_norm_scope", "alibi_before_scale", "shared_key_value",
    "key_value_source", "differential", "differential_epsilon",
    "use_query_scale",
)
# Keras's private names for its layers' settings, read-only here, for code
# written against Keras's (Keras's own tests read `_flash_attention` and
# `_sliding_window`), and two that `CachedMultiHeadAttention` reads.
_PRIVATE_NAMES = (
    "num_heads", "key_dim", "value_dim", "dropout", "use_bias", "use_gate",
    "output_shape", "attention_axes", "sliding_window", "flash_attention",
    "kernel_initializer", "bias_initializer", "kernel_regularizer",
    "bias_regularizer", "activity_regularizer", "kernel_constraint",
    "bias_constraint", "num_key_value_heads", "scale",
)


@keras.saving.register_keras_serializable(package="keras_mha")
@properties.with_read_only(
    *(name for name in _SETTINGS if name not in ("use_gate", "output_shape")),
    "rotary_embedding", "attn_logits_soft_cap", "input_norm", "output_norm",
    attribute="settings.{}",
)
@properties.with_read_only(*_PRIVATE_NAMES, attribute="settings.{}",
                           name="_{}")
@properties.with_read_only("query_dense", "key_dense", "value_dense",
                           "output_dense", "differential_layer")
class MultiHeadAttention(hooks.LayerHooks, properties.Configured,
                         cache_methods.CacheMethods, keras.layers.Layer):
    """Multi-head attention, a drop-in for `keras.layers.MultiHeadAttention`.

    Projects `query`, `key` and `value` into heads, attends, concatenates the
    heads and projects them back. Arguments, weights and results are those of
    Keras's layer (Keras 3.15); where they differ it is on purpose (the docs'
    "Differences from Keras"): rows with nothing to attend to give zeros on
    every path, half-precision softmax never overflows, input masks survive
    the call. Registered as `keras_mha>MultiHeadAttention`: a model saved
    under one backend loads under every other.

    Weights: the `EinsumDense` sublayers `query`, `key`, (`gate`), `value`
    and `attention_output`, Keras's names, shapes and order, then `sinks`,
    `query_norm`, `key_norm`, the `input_norm`'s and the `output_norm`'s,
    then `differential`'s four vectors, then `query_scale`;
    `set_weights(keras_layer.get_weights())` works both ways. `settings`
    holds the constructor's values resolved (`value_dim`,
    `num_key_value_heads` and `scale` filled in) as one frozen value
    (`keras_mha.settings.MultiHeadSettings`); read-only properties give
    them as Keras's do, and the sublayers (`query_dense`, `key_dense`,
    `value_dense`, `output_dense`, `query_norm`, `key_norm`,
    `differential_layer`; `sublayer(name)`).

    Args:
        num_heads: `N`, the number of query heads.
        key_dim: `H`, the size of each query and key head.
        value_dim: `V`, the size of each value head; `key_dim` if `None`.
        dropout: dropout rate on the attention weights, in `[0, 1)`,
            applied with `training=True`.
        use_bias: whether the projections have biases.
        output_shape: the output's trailing shape, an int or a tuple of
            ints; the query's feature size `E` if `None`.
        attention_axes: an int or a tuple of ints: the axes attended over
            (not batch, not features); all of them if `None`.
        sliding_window: `None`, `w` or `(left, right)`. With `w`, query
            position `p` sees keys `j` with `|p - j| < w` (with
            `use_causal_mask`, the `w` keys up to and including `p`); with
            `(left, right)`, keys `p - left <= j <= p + right`, either side
            may be 0 (causal sets `right` to 0). Hugging Face's
            `sliding_window=W` is the causal `w = W`. One attention axis.
        flash_attention: passed to `keras.ops.dot_product_attention`:
            `None` (auto), `True` (require: no dropout, no returned
            scores) or `False` (never).
        kernel_initializer: for every projection kernel.
        bias_initializer: for every projection bias.
        kernel_regularizer, bias_regularizer, activity_regularizer: as for
            `keras.layers.EinsumDense`, passed to every projection.
        kernel_constraint, bias_constraint: likewise.
        use_gate: whether a gate computed from the query multiplies the
            heads before the output projection.
        gate_activation: the gate's, `"sigmoid"` or `"softplus"` (Laguna).
        seed: seed of the dropout.
        num_key_value_heads: `K`, the key/value heads of grouped-query
            attention: query head `n` reads head `n // (N // K)`. Must
            divide `num_heads`; `num_heads` if `None`.
        rotary_embedding: `None`, or a layer applied to the projected
            queries and keys `(B, L, heads, H)` as `layer(x,
            start_index=...)`: `keras_mha.RotaryEmbedding`, or keras-hub's.
            Queries are rotated at `offset + t`, keys at their own
            positions; a cache stores rotated keys.
        scale: the logit scale; `1 / sqrt(key_dim)` if `None` (Gemma 2:
            `query_pre_attn_scalar ** -0.5`).
        attn_logits_soft_cap: `None`, or `c > 0`: logits become
            `c·tanh(logits / c)` after scaling (Gemma 2).
        use_sinks: adds a trainable weight `sinks` `(num_heads,)`, zeros at
            first: one logit per head that joins each row's softmax
            denominator and is then dropped (gpt-oss).
        use_alibi: adds ALiBi's `-m_h·|p - j|` to the logits, slopes
            `m_h = 2^(-8(h+1)/N)` (BLOOM's rule when `N` is not a power of
            two); with `alibi_before_scale`, before `scale` (Falcon).
        attention_chunk_size: `None` or `C`: key `j` is visible from
            position `p` only if `j // C == p // C` (Llama 4's chunked
            layers), with every other mask; a cache is then a rolling one
            of `C` slots (or the window's, if fewer). One attention axis.
        qk_norm: `None`, `"rms"`, `"layer"` or `"l2"`: queries and keys
            (after the projections' biases, before RoPE) become `x /
            sqrt(mean(x²) + qk_norm_epsilon)`, with `"rms"` times the
            `scale` of the sublayers `query_norm` and `key_norm` (Qwen3,
            Gemma 3, OLMo 2); `"layer"` is a LayerNorm, centered, with a
            `scale` and a `bias` (Persimmon); `"l2"` has no weights
            (Llama 4).
        qk_norm_after_rope: the norms come after RoPE instead (Hunyuan).
        qk_norm_scope: `"head"`: each head's `H` features, one `(H,)`
            scale; `"projection"`: a token's heads together, scales
            `(N·H,)` and `(K·H,)` (OLMo 2).
        qk_norm_epsilon: added to the mean square.
        value_norm: values become `v / sqrt(mean(v²) + qk_norm_epsilon)`
            per head, without weights (Gemma 4).
        qkv_clip: `None` or `c > 0`: the projected queries, keys and
            values are clipped to `[-c, c]` (DBRX's `clip_qkv`).
        query_temperature: `None`; `(floor_scale, scale)`: the query at
            position `p` (after RoPE) times `1 + scale·log(1 + floor((p +
            1) / floor_scale))` (Llama 4); or `("power", length,
            exponent)`: times `(1 + (p + 1) / length) ** exponent` (the
            scalable softmax of Beam's NoPE layers); `p =
            cache_update_index + t`.
        input_norm: `None`, or a Keras layer (`LayerNormalization`) applied
            to the inputs before the projections (Megatron-BERT's pre-norm).
        input_norm_scope: `"all"`: the query, value and key (of one size);
            `"query"`: the query only (a cross-attention's memory).
        output_norm: `None`, or a Keras layer (`RMSNormalization`) applied
            to each token's `N·V` attention features, the heads
            concatenated, after the gate and before the output projection
            (BitNet's sub-norm; Dory's L2 norm).
        shared_key_value: the layer projects queries only and attends over
            an earlier layer's keys and values, its call's
            `shared_key_value` (Gemma 3n's and Gemma 4's last layers;
            `keras_mha.sharing`): no key or value projections, no key
            norm, no cache of its own.
        key_value_source: with `shared_key_value`, `None` or which earlier
            layer's keys and values it reads, as its model names or
            numbers its layers (`from_torch` sets the `layer_idx` of
            transformers' source layer). The caller routes them; the layer
            keeps the name in its config.
        differential: `None`, or `λ_init` in `[0, 1)`: differential
            attention (`keras_mha.differential`, DiffLlama). Head `i` pairs
            with head `i + N/2` (`num_heads` even); each pair gives
            `RMSNorm(o_i - λ·o_{i+N/2})·(1 - λ_init)`, `λ` from four
            trainable `(key_dim,)` vectors; the output projection takes the
            `N/2` pairs. No `use_gate` or `output_norm` with it;
            `differential_epsilon` is the norm's.
        use_query_scale: adds a trainable weight `query_scale` `(num_heads,
            key_dim)`, ones at first, multiplying the queries' features
            after the rotary embedding and the temperature (nGPT's `s_qk`,
            Dory), which the query projection cannot hold.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: `(B, T, E)`; of rank > 3, `(B, ..., E)`, attended over
            `attention_axes`.
        value: `(B, S, E_v)`, of the query's rank.
        key: `(B, S, E_k)`; `value` if `None`.
        query_mask: `(B, T)`, `True` = a real query; the query's Keras mask
            (e.g. from `Embedding(mask_zero=True)`) if not given.
        value_mask: `(B, S)`, `True` = a real key; the value's Keras mask if
            not given.
        key_mask: `(B, S)`; the key's Keras mask if not given. Every mask
            is combined with AND.
        attention_mask: boolean, integer or float, nonzero = may attend,
            broadcastable to `(B, T, S)` or `(B, N, T, S)`, also `(T, S)`;
            of rank > 3, Keras's `(B, <other axes>, <query attention
            axes>, <key attention axes>)`.
        return_attention_scores: also return the attention weights.
        training: whether dropout is applied.
        use_causal_mask: key `j` is visible from query position `p` only if
            `j <= p`, with `p = t`, or `cache_update_index + t` with a cache.
        cache: decode with the `(keys, values, valid)` cache of
            `init_cache` (or of the previous call): rank-3 inputs,
            `use_causal_mask=True`, no `attention_mask`, `attention_bias` or
            `segment_ids`; `value` and `key` hold the new tokens.
        cache_update_index: with `cache`, the position of the first new
            token: a Python int or a scalar integer tensor.
        attention_bias: `None`, or a float tensor broadcastable to
            `(B, N, T, S)`, added to the logits (T5's relative bias).
        segment_ids: `None`, or integer `(B, T)`: a query attends only to
            keys of its own segment (packed sequences). The keys share the
            queries' ids unless `key_segment_ids` is given.
        key_segment_ids: the keys' ids `(B, S)`, for cross-attention.
        mask_mod: a mask (`keras_mha.Documents(ids)`, `MaskFunction(fn)`,
            ..., with `&`, `|`, `~`) or `fn(batch, head, query_position,
            key_position) -> bool`, ANDed with the other masks.
        score_mod: `fn(score, batch, head, query_position, key_position)`.
        shared_key_value: with `shared_key_value=True` (and no `value`,
            `key` or `cache`), an earlier layer's keys and values: the
            `(keys, values)` its call returned, at positions `0 .. S - 1`,
            or the cache its cached call returned, with the same
            `cache_update_index`, read and not written.
        return_key_value: also return `(keys, values)`, `(B, S, K, H)` and
            `(B, S, K, V)`: this call's tokens' heads as attended over
            (normalized, rotated), for the layers that share them.

    Returns:
        `output`, of the query's shape (the last axis `output_shape` if
        given), carrying the query's Keras mask. With `return_attention_scores`,
        `(output, scores)`, scores `(B, N, T, S)` in the compute dtype (of
        rank > 3, `(B, <other axes>, N, <query attention axes>, <key
        attention axes>)`). With `cache`, `(output, new_cache)`, or
        `(output, scores, new_cache)` with scores `(B, N, T, L + T)`: the
        `L` cached slots, then the new tokens. With `return_key_value`, the pair
        last.
    """

    # Whether the call takes an earlier layer's keys and values, so the
    # constructor allows `shared_key_value=True` (keras-hub's call, in
    # `CachedMultiHeadAttention`, does not).
    takes_shared_key_value = True
    _config_names = _SETTINGS  # `properties.Configured.get_config`
    _config_layers = ("rotary_embedding", "input_norm", "output_norm")

    def __init__(
        self, num_heads, key_dim, value_dim=None, dropout=0.0, use_bias=True,
        output_shape=None, attention_axes=None, sliding_window=None,
        flash_attention=None, kernel_initializer="glorot_uniform",
        bias_initializer="zeros", kernel_regularizer=None,
        bias_regularizer=None, activity_regularizer=None,
        kernel_constraint=None, bias_constraint=None, use_gate=False,
        seed=None, num_key_value_heads=None, rotary_embedding=None,
        scale=None, attn_logits_soft_cap=None, use_sinks=False,
        use_alibi=False, attention_chunk_size=None, qk_norm=None,
        qk_norm_scope="head", qk_norm_epsilon=1e-6, query_temperature=None,
        qk_norm_after_rope=False, value_norm=False, qkv_clip=None,
        gate_activation="sigmoid", input_norm=None, input_norm_scope="all",
        output_norm=None, alibi_before_scale=False, shared_key_value=False,
        key_value_source=None, differential=None, differential_epsilon=1e-5,
        use_query_scale=False, **kwargs,
    ):
        num_heads = checks.positive_int("num_heads", num_heads)
        key_dim = checks.positive_int("key_dim", key_dim)
        value_dim = checks.positive_int("value_dim", value_dim, allow_none=True)
        num_key_value_heads = checks.key_value_heads(num_key_value_heads,
                                                     num_heads)
        dropout = checks.dropout_rate(dropout)
        sliding_window = checks.sliding_window(sliding_window)
        attention_chunk_size = checks.positive_int(
            "attention_chunk_size", attention_chunk_size, allow_none=True)
        scale = checks.positive_number("scale", scale, allow_none=True)
        attn_logits_soft_cap = checks.positive_number(
            "attn_logits_soft_cap", attn_logits_soft_cap, allow_none=True)
        use_alibi, alibi_before_scale = checks.alibi(use_alibi,
                                                     alibi_before_scale)
        rotary_embedding = checks.rotary_embedding(rotary_embedding)
        head_features = checks.head_features(
            qk_norm, qk_norm_scope, qk_norm_epsilon, query_temperature,
            qk_norm_after_rope, value_norm, qkv_clip)
        flash_attention = checks.flash_attention(flash_attention, dropout)
        super().__init__(**kwargs)
        gate_activation = checks.choice(
            "gate_activation", gate_activation, ("sigmoid", "softplus"))
        output_shape = checks.output_shape(output_shape)
        axes = checks.attention_axes(attention_axes)
        differential, differential_epsilon = checks.differential(
            differential, differential_epsilon, num_heads, use_gate,
            output_norm)
        checks.single_attention_axis(
            axes, attention_axes, sliding_window=sliding_window,
            attention_chunk_size=attention_chunk_size)
        self.settings = settings_lib.MultiHeadSettings(
            num_heads=num_heads, key_dim=key_dim,
            value_dim=value_dim or key_dim,
            num_key_value_heads=num_key_value_heads or num_heads,
            dropout=dropout, use_bias=bool(use_bias), use_gate=bool(use_gate),
            gate_activation=gate_activation, output_shape=output_shape,
            attention_axes=axes, sliding_window=sliding_window,
            attention_chunk_size=attention_chunk_size,
            flash_attention=flash_attention,
            kernel_initializer=keras.initializers.get(kernel_initializer),
            bias_initializer=keras.initializers.get(bias_initializer),
            kernel_regularizer=keras.regularizers.get(kernel_regularizer),
            bias_regularizer=keras.regularizers.get(bias_regularizer),
            activity_regularizer=keras.regularizers.get(activity_regularizer),
            kernel_constraint=keras.constraints.get(kernel_constraint),
            bias_constraint=keras.constraints.get(bias_constraint),
            given_scale=scale,
            scale=spec_lib.default_scale(key_dim) if scale is None else scale,
            attn_logits_soft_cap=attn_logits_soft_cap,
            use_sinks=checks.boolean("use_sinks", use_sinks),
            use_alibi=use_alibi, rotary_embedding=rotary_embedding,
            alibi_before_scale=alibi_before_scale,
            input_norm=checks.norm_layer("input_norm", input_norm),
            input_norm_scope=checks.choice(
                "input_norm_scope", input_norm_scope, ("all", "query")),
            output_norm=checks.norm_layer("output_norm", output_norm),
            shared_key_value=checks.shared_key_value(self, shared_key_value),
            key_value_source=checks.key_value_source(key_value_source,
                                                     shared_key_value),
            differential=differential,
            differential_epsilon=differential_epsilon,
            use_query_scale=checks.boolean("use_query_scale",
                                           use_query_scale),
            **head_features,
        )
        self.supports_masking = True
        self.seed = seed
        self._rotary_embedding = rotary_embedding  # tracked: a sublayer
        self._query_norm = self._key_norm = None  # `HeadNorm`s, built
        self._layout = self._feature_sizes = None  # the inputs', built
        self._adopted = {}  # built projections by name, for `build`
        self._differential_layer = None  # `differential`'s, built
        self.query_scale = None  # `use_query_scale`'s weight, built

    # Read-only as in Keras (the others: `with_read_only` above).
    scale = _read_only("settings.scale",
                       "The logit scale; `1 / sqrt(key_dim)` if unset.")
    query_norm = _read_only("_query_norm", "`qk_norm='rms'` or `'layer'`.")
    key_norm = _read_only("_key_norm", "`qk_norm='rms'` or `'layer'`.")
    input_layout = _read_only("_layout", "The built inputs' `AxesLayout` "
                              "(`None` before `build`).")
    input_features = _read_only("_feature_sizes", "The built inputs' feature "
                                "sizes by name (`None` before `build`).")
    _sublayers = dict(query="_query_dense", key="_key_dense",
                      value="_value_dense", gate="_gate_dense",
                      output="_output_dense")  # `sublayer`

    @property
    def sinks(self):
        """The `(num_heads,)` sink logits (`use_sinks=True`, once built)."""
        holder = getattr(self, "_sinks_layer", None)
        return None if holder is None else holder.sinks

    # ------------------------------------------------------------------ build

    def build(self, query_shape, value_shape=None, key_shape=None):
        settings = self.settings
        query_shape = tuple(query_shape)
        value_shape = tuple(checks.value_or_query(settings, query_shape,
                                                  value_shape))
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        self._layout = checks.input_shapes(
            query_shape, value_shape, key_shape, settings.attention_axes
        )
        self._feature_sizes = dict(query=query_shape[-1],
                                   value=value_shape[-1], key=key_shape[-1])
        heads, kv_heads = settings.num_heads, settings.num_key_value_heads
        key_dim, value_dim = settings.key_dim, settings.value_dim
        projected = {
            "query": (heads, key_dim, query_shape),
            "key": (kv_heads, key_dim, key_shape),
            "gate": (heads, value_dim, query_shape),
            "value": (kv_heads, value_dim, value_shape),
        }
        # Keras's order (query, key, gate, value, then output), so
        # `get_weights()` lines up with Keras's layers. Projections handed
        # over before the build (`hub.adopt`) are used as they are.
        for name, (count, size, shape) in projected.items():
            if name == "gate" and not settings.use_gate:
                continue
            if name in ("key", "value") and settings.shared_key_value:
                setattr(self, f"_{name}_dense", None)  # `sharing.py`
                continue
            dense = self._adopted.pop(name, None) or projections.heads_projection(
                self, len(shape), count, size, name,
                activation=settings.gate_activation if name == "gate" else None,
            )
            if not dense.built:
                dense.build(shape)
            setattr(self, f"_{name}_dense", dense)
        # Holds the dropout's `SeedGenerator`, as Keras's layer does; every
        # path drops weights with it (see `AttentionSpec.seed`).
        self._dropout_layer = keras.layers.Dropout(
            rate=settings.dropout, dtype=self.dtype_policy, seed=self.seed
        )
        self._output_dense = self._adopted.pop(
            "output", None) or projections.output_projection(
            self, len(query_shape),
            settings.output_shape or (query_shape[-1],))
        pairs = heads // 2 if settings.differential is not None else heads
        if not self._output_dense.built:
            self._output_dense.build(query_shape[:-1] + (pairs, value_dim))
        if settings.use_sinks:  # after Keras's weights, so theirs line up
            self._sinks_layer = self._adopted.pop("sinks", None) or (
                projections.Sinks(heads, name="sinks", dtype=self.dtype_policy))
            if not self._sinks_layer.built:
                self._sinks_layer.build()
        self._query_norm, self._key_norm = heads_lib.build_norms(
            settings, self._adopted, self.dtype_policy)
        projections.build_norms_around(self, query_shape, heads * value_dim)
        if settings.differential is not None:
            self._differential_layer = differential_lib.Differential(
                heads, settings.key_dim, settings.differential,
                settings.differential_epsilon, name="differential",
                dtype=self.dtype_policy)
            self._differential_layer.build()
        if settings.use_query_scale:
            self.query_scale = self.add_weight(
                name="query_scale", shape=(heads, settings.key_dim),
                initializer="ones")

    # ------------------------------------------------------------------- call

    def call(
        self, query, value=None, key=None, query_mask=None, value_mask=None,
        key_mask=None, attention_mask=None, return_attention_scores=False,
        training=None, use_causal_mask=False, cache=None,
        cache_update_index=None, attention_bias=None, segment_ids=None,
        key_segment_ids=None, mask_mod=None, score_mod=None,
        shared_key_value=None, return_key_value=False,
    ):
        if key is None:
            key = value
        cache = hooks.unconverted(cache)
        paged = paged_lib.is_paged(cache)
        checks.call_arguments(
            self, query=query, value=value, key=key, query_mask=query_mask,
            value_mask=value_mask, key_mask=key_mask,
            attention_mask=attention_mask,
            return_attention_scores=return_attention_scores,
            use_causal_mask=use_causal_mask, cache=cache,
            cache_update_index=cache_update_index,
            attention_bias=attention_bias, segment_ids=segment_ids,
            key_segment_ids=key_segment_ids, mask_mod=mask_mod,
            score_mod=score_mod, shared_key_value=shared_key_value,
            return_key_value=return_key_value)
        layout = self._layout
        query, value, key = projections.normalized_inputs(self, query, value,
                                                          key)
        gate = self._gate_dense(query) if self.settings.use_gate else None
        q = layout.to_sequence(self._query_dense(query))  # (B', T, N, H)
        tokens = lambda mask: masks_lib.boolean(layout.token_mask(mask))
        query_tokens = tokens(query_mask)  # (B', T)
        key_tokens = masks_lib.combine_masks(tokens(value_mask),
                                             tokens(key_mask))  # (B', S)
        # `heads.py`; new keys sit where the queries do when decoding, as
        # do queries over an earlier layer's cache (`sharing.py`).
        reads = sharing.is_cache(shared_key_value)
        start = cache_update_index if reads or (
            cache is not None and not paged) else 0
        # A ragged call's tokens sit at their rows' own positions.
        at = paged_lib.token_positions(cache_update_index, q) if paged \
            else None
        q = heads_lib.queries(self, q, start, query_tokens, at)
        k, v = heads_lib.keys_and_values(self, key, value, start, key_tokens,
                                         at, shared_key_value)

        spec = self._describe(
            query, key, attention_mask, training=training,
            return_attention_scores=return_attention_scores,
            query_tokens=query_tokens, key_tokens=key_tokens,
            use_causal_mask=use_causal_mask, attention_bias=attention_bias,
            segment_ids=segment_ids, key_segment_ids=key_segment_ids,
            mask_mod=mask_mod, score_mod=score_mod)
        new_cache = None
        if reads:
            context, scores = attend_shared(q, spec, shared_key_value,
                                            cache_update_index,
                                            self.rolling_cache)
        elif cache is None:
            context, scores = attend(q, k, v, spec)  # (B', T, N, V)
        else:
            context, scores, new_cache = attend_cached(
                q, k, v, spec, cache, cache_update_index, self.rolling_cache
            )

        if return_attention_scores:
            scores = layout.scores_from_sequence(scores, query, key)
        else:
            scores = None
        return self._project_back(context, gate, query, scores, new_cache,
                                  (k, v) if return_key_value else None)

    def _describe(self, query, key, attention_mask, training=None,
                  return_attention_scores=False, *, query_tokens=None,
                  key_tokens=None, use_causal_mask=False, **features):
        """The call's `AttentionSpec` (`describe.describe`), with the dense
        mask laid out as the heads are; `features`: `attention_bias`,
        `segment_ids`, `key_segment_ids`."""
        dense_mask = self._layout.attention_mask(
            attention_mask, query, key, self.settings.num_heads)
        return describe_lib.describe(
            self, query_tokens=query_tokens, key_tokens=key_tokens,
            dense_mask=dense_mask, use_causal_mask=use_causal_mask,
            training=training,
            return_attention_scores=return_attention_scores,
            # Keras's `Dropout` has a `SeedGenerator` only at a rate > 0.
            seed=getattr(self._dropout_layer, "seed_generator", None),
            **features,
        )

    def _project_back(self, context, gate, query, scores=None, cache=None,
                      key_value=None):
        """`(B', T, N, V)` context -> the call's results: the output, then
        the scores (in the returned layout), the cache and the keys and
        values when given."""
        context = self._layout.from_sequence(context, query)  # (B, ..., N, V)
        context = projections.heads_to_project(self, context, gate)
        if scores is not None:
            scores = ops.cast(scores, self.compute_dtype)
        # The output carries the query's Keras mask: `Layer.__call__` sets it.
        return hooks.results(self._output_dense(context), scores, cache,
                             key_value)

    def attention_path(
        self, query_shape, value_shape, key_shape=None, *, query_mask=False,
        value_mask=False, key_mask=False, attention_mask=False,
        use_causal_mask=False, return_attention_scores=False, training=False,
        cache=False, attention_bias=False, segment_ids=False,
    ):
        """The path a call would run on the active backend: `"fused"`,
        `"explicit"`, `"banded"`, `"blocked"` or `"triangular"`.

        The layer describes the call as `call` does and asks the dispatch
        rule, without computing anything (the layer need not be built).

        Args:
            query_shape, value_shape, key_shape: the inputs' shapes.
            query_mask, value_mask, key_mask, attention_mask: whether each
                mask is given.
            cache, attention_bias, segment_ids: whether each is given.
            use_causal_mask, return_attention_scores, training: as in `call`.
        """
        given = dict(query_mask=query_mask, key_mask=value_mask or key_mask,
                     attention_mask=attention_mask,
                     attention_bias=attention_bias, segment_ids=segment_ids)
        return describe_lib.attention_path(
            self, query_shape, value_shape, key_shape, given=given,
            use_causal_mask=use_causal_mask,
            return_attention_scores=return_attention_scores,
            training=training, cache=cache,
        )

    # ----------------------------------------------------------------- shapes

    def compute_output_shape(self, query_shape, value_shape=None,
                             key_shape=None):
        query_shape = tuple(query_shape)
        value_shape = checks.value_or_query(self.settings, query_shape,
                                            value_shape)
        key_shape = value_shape if key_shape is None else key_shape
        checks.input_shapes(
            query_shape, tuple(value_shape), tuple(key_shape),
            self.settings.attention_axes,
        )
        if self.settings.output_shape:
            return query_shape[:-1] + self.settings.output_shape
        return query_shape

    def compute_output_spec(self, *args, **kwargs):
        call = hooks.call_arguments(MultiHeadAttention.call,
                                    checks.call_arguments, self, args, kwargs)
        query, value, key = call["query"], call["value"], call["key"]
        if call["shared_key_value"] is not None:  # keys: its length or slots
            value = key = sharing.stand_in(query, call["shared_key_value"])
        output = keras.KerasTensor(
            self.compute_output_shape(
                query.shape, value.shape, None if key is None else key.shape
            ),
            dtype=self.compute_dtype,
        )
        return hooks.results(output, *describe_lib.extra_result_specs(
            self, query, value, key,
            return_attention_scores=call["return_attention_scores"],
            cache=call["cache"], return_key_value=call["return_key_value"],
        ))

