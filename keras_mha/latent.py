"""`keras_mha.MultiHeadLatentAttention`: DeepSeek V2/V3's attention.

`call` reads as: check the arguments, project the query into heads and the
keys' input into one latent and one shared rotated key per token, describe
the call (an `AttentionSpec`, as `MultiHeadAttention` does), attend with
the expanded or the absorbed computation (`attention/latent.py`), project
back.
"""

import keras
from keras import ops

from keras_mha import axes
from keras_mha import checks
from keras_mha.checks import latent as latent_checks
from keras_mha import describe as describe_lib
from keras_mha import distribution as distribution_lib
from keras_mha import hooks
from keras_mha import projections
from keras_mha import serving
from keras_mha import properties
from keras_mha import settings as settings_lib
from keras_mha.attention import latent as latent_lib
from keras_mha.attention import masks as masks_lib
from keras_mha.attention import paged as paged_lib
from keras_mha.attention import spec as spec_lib

# The constructor's settings, fields of `layer.settings`: the config's
# entries and read-only properties.
_SETTINGS = (
    "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "q_lora_rank", "use_bias", "norm_epsilon", "dropout",
    "sliding_window", "use_gate",
)


@keras.saving.register_keras_serializable(package="keras_mha")
@properties.with_read_only(*_SETTINGS, "rotary_embedding",
                           "attn_logits_soft_cap", attribute="settings.{}")
class MultiHeadLatentAttention(properties.Configured, keras.layers.Layer):
    """Multi-head latent attention (MLA, DeepSeek-V2, arXiv 2405.04434).

    Keys and values come from one compressed latent per token: the input
    is projected (`kv_a`) into a latent `c` of `kv_lora_rank` features,
    RMS-normalized (`kv_norm`), and a key part `k_rope` of
    `qk_rope_head_dim` features shared by all heads. Per head `n`:

    - query `[q_nope_n, q_rope_n]` (`qk_nope_head_dim + qk_rope_head_dim`),
      from `query` (or `query_a`, `query_norm`, `query_b` with
      `q_lora_rank`);
    - key `[k_nope_n, k_rope]`, `k_nope_n` and value `v_n` from the latent
      (`kv_b`, to `N·(qk_nope_head_dim + v_head_dim)`);
    - the rotary embedding turns `q_rope` and `k_rope` only, at absolute
      positions; the logits are scaled by `scale`, by default
      `(qk_nope_head_dim + qk_rope_head_dim) ** -0.5` (DeepSeek V3 with
      YaRN multiplies it by the square of its `mscale`: pass `scale`,
      as `from_torch` does).

    A cache (`init_cache`) holds the latents and the shared rotated keys,
    `kv_lora_rank + qk_rope_head_dim` numbers per token. Two computations
    give the same outputs: expanded (the latents up-projected into
    per-head keys and values, then the usual attention paths) and absorbed
    (the key up-projection folded into the queries and the value
    up-projection into the output: attention over the latents as one
    shared key/value head). A decoding step that reads its cache in place
    runs absorbed; every other call runs expanded (the rule is in
    `keras_mha.attention.latent`).

    Weights: the `EinsumDense` sublayers `query` (or `query_a`,
    `query_norm` (RMS), `query_b`), `kv_a`, `kv_norm` (RMS), `kv_b`,
    (`gate`) and `attention_output`, in that order. `use_bias` gives
    biases to the projections of the inputs (`query` or `query_a`, `kv_a`,
    `gate`) and to `attention_output`, as Hugging Face's `attention_bias`
    does; the up-projections `query_b` and `kv_b` have none
    (`sublayer(name)`).
    `settings` holds the constructor's values resolved as one frozen value
    (`keras_mha.settings.LatentSettings`), which the read-only properties
    give. Registered as `keras_mha>MultiHeadLatentAttention`.

    Args:
        num_heads: `N`, the number of heads.
        kv_lora_rank: `R`, the size of the latent.
        qk_nope_head_dim: the query and key features per head without
            rotary embedding.
        qk_rope_head_dim: `P`, the rotated features: per query head, and
            of the one key part shared by the heads.
        v_head_dim: `V`, the value size per head.
        q_lora_rank: `None` (the query projected directly, DeepSeek
            V2-Lite), or the size of the query's own compression (DeepSeek
            V2, V3).
        rotary_embedding: `None`, or a layer applied to `(B, L, heads, P)`
            as `layer(x, start_index=...)`: `keras_mha.RotaryEmbedding`
            (DeepSeek's `rope_interleave` is its `interleaved=True`), or
            keras-hub's.
        scale: the logit scale; `(qk_nope_head_dim + qk_rope_head_dim) **
            -0.5` if `None`.
        use_bias: biases on `query` (or `query_a`), `kv_a` and
            `attention_output`.
        norm_epsilon: the epsilon of the RMS normalizations.
        dropout: dropout rate on the attention weights, in `[0, 1)`.
        sliding_window: `None`, `w` or `(left, right)`, as for
            `MultiHeadAttention`; with `use_causal_mask` the cache is a
            rolling buffer of `w` slots.
        attn_logits_soft_cap: `None`, or `c > 0`: logits become
            `c·tanh(logits / c)` after scaling.
        kernel_initializer: for every projection kernel.
        bias_initializer: for every projection bias.
        seed: seed of the dropout.
        use_gate: whether `sigmoid(gate(query))`, one value per head's
            feature, multiplies the heads before `attention_output` (Ling
            3's head-wise gate, imported with its rows repeated).
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: `(B, T, E)`.
        value: `(B, S, E_v)`: the input of the latents (keys and values).
        key: `None`, or `value` itself: keys and values both come from the
            latents of `value`.
        query_mask: `(B, T)`, `True` = a real query; the query's Keras mask
            if not given.
        value_mask: `(B, S)`, `True` = a real key; the value's Keras mask if
            not given.
        key_mask: `(B, S)`, combined with `value_mask` by AND.
        attention_mask: boolean, broadcastable to `(B, T, S)` or `(B, N, T,
            S)`, `True` = may attend. Not with a cache.
        return_attention_scores: also return the attention weights.
        training: whether dropout is applied.
        use_causal_mask: key `j` is visible from query position `p` only if
            `j <= p` (`p = cache_update_index + t` with a cache).
        cache: decode with the `(latents, rope_keys, valid)` of
            `init_cache` (or of the previous call): `use_causal_mask=True`,
            `value` holds the new tokens (`S = T`).
        cache_update_index: with `cache`, the position of the first new
            token: a Python int or a scalar integer tensor.
        mask_mod, score_mod: a mask and a score function, as
            `MultiHeadAttention` takes them (docs/programmable.md).

    Returns:
        `output` `(B, T, E)`; with `return_attention_scores`, `(output,
        scores)`, scores `(B, N, T, S)`; with `cache`, `(output,
        new_cache)` or `(output, scores, new_cache)`, scores `(B, N, T, L +
        T)` (the cache's `L` slots before the call, then the new tokens).
    """

    _config_names = _SETTINGS  # `properties.Configured.get_config`
    _config_objects = ("kernel_initializer", "bias_initializer")

    def __init__(
        self,
        num_heads,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        q_lora_rank=None,
        rotary_embedding=None,
        scale=None,
        use_bias=False,
        norm_epsilon=1e-6,
        dropout=0.0,
        sliding_window=None,
        attn_logits_soft_cap=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        seed=None,
        use_gate=False,
        **kwargs,
    ):
        num_heads = checks.positive_int("num_heads", num_heads)
        kv_lora_rank = checks.positive_int("kv_lora_rank", kv_lora_rank)
        qk_nope_head_dim = checks.positive_int(
            "qk_nope_head_dim", qk_nope_head_dim
        )
        qk_rope_head_dim = checks.positive_int(
            "qk_rope_head_dim", qk_rope_head_dim
        )
        v_head_dim = checks.positive_int("v_head_dim", v_head_dim)
        q_lora_rank = checks.positive_int("q_lora_rank", q_lora_rank,
                                          allow_none=True)
        rotary_embedding = checks.rotary_embedding(rotary_embedding)
        scale = checks.positive_number("scale", scale, allow_none=True)
        norm_epsilon = checks.positive_number("norm_epsilon", norm_epsilon)
        dropout = checks.dropout_rate(dropout)
        sliding_window = checks.sliding_window(sliding_window)
        attn_logits_soft_cap = checks.positive_number(
            "attn_logits_soft_cap", attn_logits_soft_cap, allow_none=True
        )
        use_bias = checks.boolean("use_bias", use_bias)
        use_gate = checks.boolean("use_gate", use_gate)
        super().__init__(**kwargs)
        self.settings = settings_lib.LatentSettings(
            num_heads=num_heads, kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
            q_lora_rank=q_lora_rank, rotary_embedding=rotary_embedding,
            given_scale=scale,
            scale=(spec_lib.default_scale(qk_nope_head_dim + qk_rope_head_dim)
                   if scale is None else scale),
            use_bias=use_bias, use_gate=use_gate, norm_epsilon=norm_epsilon,
            dropout=dropout,
            sliding_window=sliding_window,
            attn_logits_soft_cap=attn_logits_soft_cap,
            kernel_initializer=keras.initializers.get(kernel_initializer),
            bias_initializer=keras.initializers.get(bias_initializer),
            **settings_lib.LATENT_LACKS,
        )
        self.supports_masking = True
        self.seed = seed
        self._rotary_embedding = rotary_embedding  # tracked: a sublayer
        self._feature_sizes = None  # the inputs', built
        self.sinks = None  # what `describe.describe` reads of a layer

    scale = properties.read_only("settings.scale",
                                 "The logit scale, resolved.")
    input_features = properties.read_only(
        "_feature_sizes", "The feature sizes of the inputs the layer was "
        "built for, by name (`query`, `value`); `None` before `build`.")
    _sublayers = dict(query="_query_dense", query_a="_query_a",
                      query_norm="_query_norm", query_b="_query_b",
                      kv_a="_kv_a", kv_norm="_kv_norm", kv_b="_kv_b",
                      gate="_gate_dense",
                      output="_output_dense")  # `sublayer`

    # ------------------------------------------------------------------ build

    def build(self, query_shape, value_shape, key_shape=None):
        query_shape, value_shape = tuple(query_shape), tuple(value_shape)
        latent_checks.shapes(query_shape, value_shape)
        settings = self.settings
        self._feature_sizes = dict(query=query_shape[-1],
                                   value=value_shape[-1])
        heads, head = settings.num_heads, settings.qk_head_dim
        if settings.q_lora_rank is None:
            self._query_dense = self._dense(
                "btd,dnh->btnh", (None, heads, head), "query", "nh")
            self._query_dense.build(query_shape)
        else:
            rank = settings.q_lora_rank
            self._query_a = self._dense("btd,dr->btr", (None, rank),
                                        "query_a", "r")
            self._query_a.build(query_shape)
            self._query_norm = self._norm("query_norm", rank)
            self._query_b = self._dense("btr,rnh->btnh", (None, heads, head),
                                        "query_b", None)
            self._query_b.build(query_shape[:-1] + (rank,))
        rank, rope = settings.kv_lora_rank, settings.qk_rope_head_dim
        self._kv_a = self._dense("btd,dr->btr", (None, rank + rope), "kv_a",
                                 "r")
        self._kv_a.build(value_shape)
        self._kv_norm = self._norm("kv_norm", rank)
        self._kv_b = self._dense(
            "btr,rnh->btnh",
            (None, heads, settings.qk_nope_head_dim + settings.v_head_dim),
            "kv_b", None,
        )
        self._kv_b.build(value_shape[:-1] + (rank,))
        self._dropout_layer = keras.layers.Dropout(
            rate=settings.dropout, dtype=self.dtype_policy, seed=self.seed
        )
        if settings.use_gate:
            self._gate_dense = self._dense(
                "btd,dnv->btnv", (None, heads, settings.v_head_dim), "gate",
                "nv")
            self._gate_dense.build(query_shape)
        self._output_dense = self._dense(
            "btnv,nve->bte", (None, query_shape[-1]), "attention_output", "e"
        )
        self._output_dense.build(
            query_shape[:-1] + (heads, settings.v_head_dim))
        self.built = True

    def _dense(self, equation, output_shape, name, bias_axes):
        return projections.Projection(
            equation,
            output_shape=output_shape,
            bias_axes=bias_axes if self.settings.use_bias else None,
            name=name,
            **projections.sublayer_kwargs(self),
        )

    def _norm(self, name, size):
        norm = keras.layers.RMSNormalization(
            epsilon=self.settings.norm_epsilon, name=name,
            dtype=self.dtype_policy,
        )
        norm.build((None, None, size))
        return norm

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
        mask_mod=None,
        score_mod=None,
    ):
        cache = hooks.unconverted(cache)
        latent_checks.call(
            self, query=query, value=value, key=key, query_mask=query_mask,
            value_mask=value_mask, key_mask=key_mask,
            attention_mask=attention_mask, use_causal_mask=use_causal_mask,
            cache=cache, cache_update_index=cache_update_index,
            mask_mod=mask_mod, score_mod=score_mod,
        )
        settings = self.settings
        nope, rank = settings.qk_nope_head_dim, settings.kv_lora_rank
        if settings.q_lora_rank is None:
            q = self._query_dense(query)  # (B, T, N, Hn + P)
        else:
            q = self._query_b(self._query_norm(self._query_a(query)))
        compressed = self._kv_a(value)  # (B, S, R + P)
        latents = self._kv_norm(compressed[..., :rank])  # (B, S, R)
        rope_keys = compressed[..., rank:]  # (B, S, P)
        query_tokens = masks_lib.boolean(query_mask)
        key_tokens = masks_lib.combine_masks(
            masks_lib.boolean(value_mask), masks_lib.boolean(key_mask))
        # Padding is never read, yet a weight of 0 times a NaN there is
        # NaN: zero padded tokens so garbage cannot leak into real ones.
        q = _zero_padding(q, query_tokens)
        latents = _zero_padding(latents, key_tokens)
        rope_keys = _zero_padding(rope_keys, key_tokens)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        rotary = settings.rotary_embedding
        paged = paged_lib.is_paged(cache)
        if rotary is not None:
            start = 0 if cache is None or paged else cache_update_index
            at = paged_lib.token_positions(cache_update_index, q) if paged \
                else None  # a ragged call's rows at their own positions
            q_rope = rotary(q_rope, start_index=start, positions=at)
            rope_keys = rotary(
                rope_keys[:, :, None], start_index=start, positions=at
            )[:, :, 0]  # (B, S, P)
        spec = describe_lib.describe(
            self, query_tokens=query_tokens, key_tokens=key_tokens,
            dense_mask=None if attention_mask is None else axes.rank4_mask(
                attention_mask), use_causal_mask=use_causal_mask,
            training=training,
            return_attention_scores=return_attention_scores,
            seed=getattr(self._dropout_layer, "seed_generator", None),
            mask_mod=mask_mod, score_mod=score_mod,
        )
        how = latent_lib.ABSORBED if paged else latent_lib.computation(
            spec, q.shape[1], cache=cache is not None,
            index=cache_update_index, rolling=self.rolling_cache,
            absorbable=self._kv_b.quantization_mode is None,
        )
        context, scores, new_cache = latent_lib.latent_attention(
            q_nope, q_rope, latents, rope_keys, spec, up_project=self._kv_b,
            kernel=lambda: self._kv_b.kernel, nope_dim=nope, how=how,
            cache=cache, index=cache_update_index, rolling=self.rolling_cache,
        )
        if return_attention_scores:
            scores = ops.cast(scores, self.compute_dtype)
        if settings.use_gate:
            context = ops.multiply(context,
                                   ops.sigmoid(self._gate_dense(query)))
        return hooks.results(
            self._output_dense(context),
            scores if return_attention_scores else None, new_cache,
        )

    def computation(self, query_length=1, cache=False, cache_update_index=None,
                    return_attention_scores=False, training=False):
        """The computation a call would run: `"expanded"` or `"absorbed"`.

        Args:
            query_length: `T`.
            cache: whether the call decodes with a cache.
            cache_update_index: with a cache, the index (a Python int, or
                any non-int for a tensor).
            return_attention_scores, training: as in `call`.
        """
        spec = spec_lib.AttentionSpec(
            scale=self.settings.scale,
            dropout=self.settings.dropout if training else 0.0,
            return_weights=bool(return_attention_scores),
        )
        absorbable = not self.built or self._kv_b.quantization_mode is None
        return latent_lib.computation(
            spec, query_length, cache=cache, index=cache_update_index,
            rolling=self.rolling_cache, absorbable=absorbable,
        )

    # ------------------------------------------------------------------ cache

    @property
    def rolling_cache(self):
        """Whether `init_cache` makes a rolling buffer (with a
        `sliding_window`)."""
        return self.settings.rolling_slots is not None

    def init_cache(self, batch_size, max_length, in_place=False):
        """A zero latent cache for decoding up to `max_length` tokens.

        Args:
            batch_size: `B`.
            max_length: the longest sequence to decode. With a
                `sliding_window` the cache is a rolling buffer of `w` slots
                whatever `max_length` is.
            in_place: whether calls may write into this cache's own
                tensors; `False` (the default): the caller owns the cache.

        Returns:
            `(latents, rope_keys, valid)`: `(B, L, kv_lora_rank)` and `(B,
            L, qk_rope_head_dim)` in the compute dtype (the normalized
            latents and the rotated shared keys), and `valid` `(B, L)`
            boolean, true where a real token was written. `L` is
            `max_length`, or `w` when rolling. Owned and written as
            `MultiHeadAttention.init_cache`'s cache is: by default a call
            returns a new cache; with `in_place=True` an eager call writes
            the new slots into the cache's own tensors, and the cache is a
            `keras_mha.attention.cache.InPlaceLatentCache`.
        """
        slots = checks.cache_slots(self, batch_size, max_length, in_place)
        return distribution_lib.shard_cache(latent_lib.zeros(
            batch_size, slots, self.settings.kv_lora_rank,
            self.settings.qk_rope_head_dim, self.compute_dtype, in_place))

    def init_paged_cache(self, num_pages, page_size, quantize=None,
                         in_place=False):
        """An empty paged cache, as `MultiHeadAttention.init_paged_cache`
        makes one: pages of one head, `[latent, rope_key]` (`kv_lora_rank
        + qk_rope_head_dim` features), whose first `kv_lora_rank` are read
        as the values; no value pages. A ragged call runs the absorbed
        computation (docs/serving.md)."""
        return serving.paged_cache(self, num_pages, page_size, quantize,
                                   in_place)

    # ----------------------------------------------------------------- shapes

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape = tuple(query_shape)
        latent_checks.shapes(query_shape, tuple(value_shape))
        return query_shape

    def compute_output_spec(self, *args, **kwargs):
        call = hooks.call_arguments(MultiHeadLatentAttention.call,
                                    latent_checks.call, self, args, kwargs)
        query, value, cache = call["query"], call["value"], call["cache"]
        scores = None
        if call["return_attention_scores"]:
            keys = value.shape[1]
            if cache is not None:
                keys = None if keys is None else cache[0].shape[1] + keys
            scores = keras.KerasTensor(
                (query.shape[0], self.settings.num_heads, query.shape[1],
                 keys),
                dtype=self.compute_dtype,
            )
        if cache is not None:
            cache = tuple(
                keras.KerasTensor(part.shape, dtype=part.dtype)
                for part in cache
            )
        return hooks.results(
            keras.KerasTensor(tuple(query.shape), dtype=self.compute_dtype),
            scores, cache,
        )


def _zero_padding(x, tokens):
    """`x` `(B, L, ...)` with the positions where `tokens` `(B, L)` is
    False set to 0; `x` itself when `tokens` is `None`."""
    if tokens is None:
        return x
    keep = ops.reshape(tokens, tuple(ops.shape(tokens)) + (1,) * (x.ndim - 2))
    return ops.where(keep, x, ops.zeros_like(x))
