"""Per-token transforms of the projected heads, between the projections and
attention.

Token by token, the layers turn their projected queries `(B, T, N, H)` and
keys `(B, S, K, H)` into what attention reads, in DESIGN's order:

1. padding zeroed (a weight of 0 times a NaN in a padded token is NaN),
   then the clip of `qkv_clip` (DBRX);
2. query/key normalization (`qk_norm`): RMS with a trainable scale
   (`HeadNorm`: Qwen3, Gemma 3 per head; OLMo 2 over the projection), a
   LayerNorm with a scale and a bias (Persimmon), or Llama 4's norm
   without weights; values normalized without weights (`value_norm`:
   Gemma 4);
3. the rotary embedding, queries at `offset + t`, keys at their positions;
4. the query temperature (Llama 4's `attn_temperature_tuning`): the query
   at position `p` times `1 + scale·log(1 + floor((p + 1) / floor_scale))`.

Each is a function of one token and its position, so every attention path,
cached decoding included, sees the same transformed heads: nothing here is
a field of the `AttentionSpec`. What to apply comes from the layer's
`settings` and its public sublayers (`query_norm`, `key_norm`).
"""

import keras
from keras import ops

_HALF_DTYPES = ("float16", "bfloat16")
# The tag of `query_temperature`'s power form, `("power", length, exponent)`.
POWER = "power"


class HeadNorm(keras.layers.Layer):
    """RMS normalization of projected heads `(B, L, heads, H)` with a
    trainable `scale` (ones at first): `x / sqrt(mean(x²) + epsilon) ·
    scale`; centered, `(x - mean(x)) / sqrt(var(x) + epsilon) · scale +
    bias`, a LayerNorm, with `center=True`. Computed in float32 for
    half-precision inputs.

    Args:
        scope: `"head"`: each head's `H` features, one `(H,)` scale shared
            by the heads; `"projection"`: all `heads·H` features of the
            token together, scale `(heads·H,)`.
        epsilon: added to the mean square.
        center: whether to subtract the mean and add a trainable `bias`
            (zeros at first) of the scale's shape.
        **kwargs: base layer arguments (`name`, `dtype`).
    """

    def __init__(self, scope="head", epsilon=1e-6, center=False, **kwargs):
        super().__init__(**kwargs)
        self.scope = scope
        self.epsilon = epsilon
        self.center = center
        self.bias = None

    def build(self, input_shape):
        heads, head_dim = input_shape[-2], input_shape[-1]
        size = head_dim if self.scope == "head" else heads * head_dim
        self.scale = self.add_weight(
            name="scale", shape=(size,), initializer="ones"
        )
        if self.center:
            self.bias = self.add_weight(
                name="bias", shape=(size,), initializer="zeros"
            )

    def call(self, x):
        return normalize(x, self.scope, self.epsilon, self.scale,
                         center=self.center, bias=self.bias)

    def get_config(self):
        return {**super().get_config(), "scope": self.scope,
                "epsilon": self.epsilon, "center": self.center}


def normalize(x, scope, epsilon, scale=None, center=False, bias=None):
    """`x` `(B, L, heads, H)` divided by the root mean square of each head
    (`scope="head"`) or of each token's whole projection
    (`"projection"`), times `scale` `(H,)` or `(heads·H,)` if given;
    `center`: less its mean first, plus `bias` after. In float32 for
    half-precision `x`, returned in `x`'s dtype."""
    dtype = ops.dtype(x)
    y = ops.cast(x, "float32") if dtype in _HALF_DTYPES else x
    axes = -1 if scope == "head" else (-2, -1)
    if center:
        y = y - ops.mean(y, axis=axes, keepdims=True)
    mean_square = ops.mean(ops.square(y), axis=axes, keepdims=True)
    y = y * ops.rsqrt(mean_square + ops.cast(epsilon, y.dtype))
    for weight, apply in ((scale, ops.multiply), (bias, ops.add)):
        if weight is not None:
            weight = ops.cast(weight, y.dtype)
            if scope == "projection":
                weight = ops.reshape(weight, tuple(x.shape[-2:]))  # (heads, H)
            y = apply(y, weight)
    return ops.cast(y, dtype)


def temperature(x, offset, query_temperature, positions=None):
    """`x` `(B, T, N, H)` at positions `offset + t` (or `positions` `(B,
    T)`), each query times the layer's `query_temperature` at its
    position: `1 + scale·log(1 + floor((p + 1) / floor_scale))` for
    `(floor_scale, scale)` (Llama 4), `(1 + (p + 1) / length) **
    exponent` for `("power", length, exponent)` (Beam's scalable
    softmax); in float32 for half-precision `x`, as both compute it."""
    dtype = ops.dtype(x)
    compute = "float32" if dtype in _HALF_DTYPES else dtype
    if positions is None:
        positions = ops.arange(ops.shape(x)[1], dtype="int32") + ops.cast(
            offset, "int32")  # (T,)
    positions = ops.cast(positions, compute)
    if query_temperature[0] == POWER:
        _, length, exponent = query_temperature
        factor = ops.exp(exponent * ops.log1p((positions + 1.0) / length))
    else:
        floor_scale, scale = query_temperature
        factor = 1.0 + scale * ops.log1p(
            ops.floor((positions + 1.0) / floor_scale))
    factor = ops.reshape(factor, (-1 if len(factor.shape) == 2 else 1,
                                  ops.shape(x)[1], 1, 1))
    return ops.cast(ops.cast(x, compute) * factor, dtype)


def zero_padding(x, tokens):
    """`x` `(B, L, heads, X)` with the positions where `tokens` `(B, L)` is
    False set to 0; `x` itself when `tokens` is `None`."""
    if tokens is None:
        return x
    keep = tokens[:, :, None, None]  # (B, L, 1, 1)
    return ops.where(keep, x, ops.zeros_like(x))


def build_norms(settings, adopted, dtype):
    """`(query_norm, key_norm)`: the sublayers of a layer with
    `qk_norm="rms"` or `"layer"` (built after its other weights, so those
    line up with Keras's); `(None, None)` for `"l2"` or `None`.

    Args:
        settings: the layer's `MultiHeadSettings`.
        adopted: the sublayers handed over before the build, by name
            (`hub.adopt`: keras-hub's own norms, any layer normalizing the
            last axis), used as they are; the norms are taken out of it.
        dtype: the layer's dtype policy.
    """
    if settings.qk_norm not in ("rms", "layer"):
        return None, None
    norms = []
    for name, heads in (("query", settings.num_heads),
                        ("key", settings.num_key_value_heads)):
        if name == "key" and settings.shared_key_value:
            norms.append(None)  # the keys come normalized (`sharing.py`)
            continue
        norm = adopted.pop(f"{name}_norm", None) or HeadNorm(
            settings.qk_norm_scope, settings.qk_norm_epsilon,
            center=settings.qk_norm == "layer", name=f"{name}_norm",
            dtype=dtype)
        if not norm.built:
            norm.build((None, None, heads, settings.key_dim))
        norms.append(norm)
    return tuple(norms)


def queries(layer, q, offset, tokens=None, positions=None):
    """The layer's projected queries `(B, T, N, H)` at positions `offset +
    t` (or `positions` `(B, T)`, each token's own), ready for attention:
    padding zeroed, normalized, rotated, scaled by the temperature and by
    the layer's `query_scale` `(N, H)` (`use_query_scale`)."""
    q = _rotated_and_normalized(layer, "query", _clipped(layer, q, tokens),
                                offset, positions)
    query_temperature = layer.settings.query_temperature
    if query_temperature is not None:
        q = temperature(q, offset, query_temperature, positions)
    if layer.settings.use_query_scale:
        q = q * ops.cast(layer.query_scale, q.dtype)
    return q


def keys(layer, k, offset, tokens=None, positions=None):
    """The layer's projected keys `(B, S, K, H)` at positions `offset + j`
    (or `positions`): padding zeroed, normalized, rotated."""
    return _rotated_and_normalized(layer, "key", _clipped(layer, k, tokens),
                                   offset, positions)


def keys_and_values(layer, key, value, offset, tokens=None, positions=None,
                    shared=None):
    """The keys `(B', S, K, H)` and values `(B', S, K, V)` a call attends
    over: the layer's projections of `key` and `value` (`keys`, `values`),
    or those of an earlier layer, `shared` (a pair, or a cache's first
    two), as they are (`sharing.py`)."""
    if shared is not None:
        return tuple(shared[:2])
    layout = layer.input_layout
    k = layout.to_sequence(layer.key_dense(key))  # (B', S, K, H)
    v = layout.to_sequence(layer.value_dense(value))  # (B', S, K, V)
    return (keys(layer, k, offset, tokens, positions),
            values(layer, v, tokens))


def values(layer, v, tokens=None):
    """The layer's projected values `(B, S, K, V)`: padding zeroed,
    clipped, normalized (`value_norm`)."""
    v = _clipped(layer, v, tokens)
    if layer.settings.value_norm:
        v = normalize(v, "head", layer.settings.qk_norm_epsilon)
    return v


def _clipped(layer, x, tokens):
    x = zero_padding(x, tokens)
    clip = layer.settings.qkv_clip
    if clip is None:
        return x
    return ops.clip(x, -clip, clip)


def _rotated_and_normalized(layer, name, x, offset, positions=None):
    """The norm, then RoPE; or RoPE, then the norm
    (`qk_norm_after_rope`)."""
    after = layer.settings.qk_norm_after_rope
    rotary = layer.settings.rotary_embedding
    if not after:
        x = _norm(layer, name, x)
    if rotary is not None and positions is not None:
        x = rotary(x, positions=positions)
    elif rotary is not None:
        x = rotary(x, start_index=offset)
    return _norm(layer, name, x) if after else x


def _norm(layer, name, x):
    settings = layer.settings
    if settings.qk_norm is None:
        return x
    if settings.qk_norm in ("rms", "layer"):
        return layer.query_norm(x) if name == "query" else layer.key_norm(x)
    return normalize(x, settings.qk_norm_scope, settings.qk_norm_epsilon)
