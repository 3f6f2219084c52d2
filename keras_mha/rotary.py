"""`keras_mha.RotaryEmbedding`: rotary position embeddings (RoPE).

Rotate-half layout by default (Llama, GPT-NeoX, keras-hub, Hugging Face):
feature `i` pairs with `i + d/2`; `interleaved=True` pairs `2i` with
`2i + 1` (GPT-J, Cohere, GLM). Either way `<rot(q, p), rot(k, j)>` depends
on `p - j` alone. The frequencies of each `rope_type` are in
`rope_scaling.py`. Called as `keras_hub.layers.RotaryEmbedding` is, so
either layer serves.
"""

import dataclasses
import numbers

import keras
from keras import ops

import keras_mha.attention.capabilities as capabilities
from keras_mha import properties
from keras_mha.rope_scaling import RopeScaling


def rotary_dim_of(shape, rotary_dim=None):
    """The number `d` of rotated features of inputs of shape `shape`.

    Args:
        shape: the input's shape, features last (`H = shape[-1]`).
        rotary_dim: `d`, or `None` to rotate all `H` features.

    Returns:
        `d`; a `ValueError` if `H` is odd (`rotary_dim=None`) or below `d`.
    """
    size = shape[-1]
    if rotary_dim is None and (size is None or size % 2):
        raise ValueError(
            "The feature size of the input (its last axis) must be known and "
            "even for the rotary embedding, or `rotary_dim` given. "
            f"Received: inputs.shape={tuple(shape)}"
        )
    if rotary_dim is not None and size is not None and rotary_dim > size:
        raise ValueError(
            "Argument `rotary_dim` must be at most the feature size of the "
            f"input (its last axis). Received: rotary_dim={rotary_dim}, "
            f"inputs.shape={tuple(shape)}"
        )
    return size if rotary_dim is None else rotary_dim


def _checked_positions(positions):
    """`positions`, of shape `(L,)` or `(B, L)`."""
    if len(positions.shape) not in (1, 2):
        raise ValueError(
            "Argument `positions` must have shape (L,) or (B, L). "
            f"Received: positions.shape={tuple(positions.shape)}"
        )
    return positions


# The RoPE arguments, by name: `RopeScaling`'s fields.
_ROPE_ARGUMENTS = tuple(
    field.name for field in dataclasses.fields(RopeScaling)
)


@keras.saving.register_keras_serializable(package="keras_mha")
@properties.with_read_only(
    *(name for name in _ROPE_ARGUMENTS if name != "attention_factor"),
    attribute="_rope.{}", rotary_dim="_rotary_dim", interleaved="_interleaved",
)
class RotaryEmbedding(keras.layers.Layer):
    """Rotary position embedding of `(B, L, ..., H)` inputs; no weights.

    With `d = rotary_dim or H`, the features of the row at position `p`
    turn in pairs, pair `i` (`i < d/2`) by the angle `p · inv_freq_i`, and
    are multiplied by the type's `attention_factor` (1 but for `"yarn"` and
    `"longrope"`); features `[d:]` pass unchanged. `inv_freq` is Hugging
    Face's for the same `rope_type` and parameters (`ROPE_INIT_FUNCTIONS`);
    `rope_scaling.py` has the formulas. The plain case (`"linear"`, the
    default, or `"default"`) is `inv_freq_i = max_wavelength ** (-2i/d) /
    scaling_factor`.

    Two types depend on the call's largest position `P` (over `positions`,
    or `start_index + L - 1`): `"dynamic"` raises the base once `P + 1`
    exceeds `original_max_position_embeddings`, and `"longrope"` takes the
    long factors from `P >= original_max_position_embeddings` on. Each is a
    pure function of the call's positions: the layer keeps no state, so the
    same call always gives the same result (also under `jax.jit`,
    `tf.function` and `torch.compile`, with a tensor `start_index`, traced
    once). What that means when decoding: keys in a cache keep the rotation
    of the call that wrote them. A sequence that crosses the threshold
    while decoding attends from its new queries (rotated with `P`'s
    frequencies) to cached keys rotated with earlier ones, so it does not
    equal one full pass over the whole sequence; it does equal Hugging
    Face's generation, which rotates each step with that step's
    frequencies the same way. Below the threshold, and for `"longrope"`
    with a prompt already beyond it, decoding equals the full pass.

    Angles and rotation are in float32 (or the input's wider dtype); the
    result has the input's dtype, not the dtype policy's (`autocast=False`
    unless given): half precision stays half.

    Args:
        max_wavelength: the longest wavelength (Hugging Face's
            `rope_theta`), a positive number.
        scaling_factor: the type's `factor`: positions are divided by it
            with `"linear"`; `"llama3"`, `"yarn"`, `"dynamic"` use it as
            Hugging Face does, `"longrope"` for its default
            `attention_factor`. Must be 1 with `"default"`.
        rotary_dim: `d`, how many leading features of each head turn
            (partial rotary), a positive even int; all `H` if `None`.
        rope_type: `"linear"` (keras-hub's default), `"default"`,
            `"llama3"`, `"yarn"`, `"dynamic"` or `"longrope"`.
        beta_fast, beta_slow: YaRN's bounds of the ramp, in turns over
            `original_max_position_embeddings` positions (32 and 1).
        original_max_position_embeddings: the pre-training length `L0`
            (`"llama3"`, `"yarn"`, `"longrope"`; for `"dynamic"`, Hugging
            Face's `max_position_embeddings`), a positive int.
        truncate: whether YaRN rounds its ramp's ends outwards to whole
            dimensions (gpt-oss: `False`).
        low_freq_factor, high_freq_factor: Llama 3's wavelength bounds,
            `L0 / low_freq_factor` and `L0 / high_freq_factor`; required
            with `"llama3"`, `high >= low` (equal in Llama 4 Scout).
        attention_factor: what cos and sin are multiplied by (`"yarn"`,
            `"longrope"`); `None` for Hugging Face's default from
            `scaling_factor`: `0.1·ln(f) + 1` (YaRN), `sqrt(1 + ln(f) /
            ln(L0))` (LongRoPE), 1 when `f <= 1`.
        short_factor, long_factor: LongRoPE's per-pair divisors of the
            frequencies, `rotary_dim / 2` positive numbers each; required
            with `"longrope"`.
        interleaved: pair features `(2i, 2i + 1)` instead of `(i, i + d/2)`
            (GPT-J, Cohere, GLM, DeepSeek's `rope_interleave`).
        **kwargs: other `keras.layers.Layer` arguments (`name`, `dtype`).

    Call arguments:
        inputs: `(B, L, ..., H)`: the sequence on axis 1, features last.
        start_index: the position of row 0, an int or a scalar integer
            tensor (a cache index, also under `jax.jit` or `tf.function`).
        positions: optional integer tensor `(L,)` or `(B, L)` of absolute
            positions; overrides `start_index`.

    Returns:
        The rotated `inputs`, of the same shape and dtype.

    Raises:
        ValueError: for a bad argument, naming it; an argument that the
            type does not read but that was given (`low_freq_factor` with
            `"yarn"`); `short_factor`/`long_factor` of another length than
            `d / 2` (at the first call when `rotary_dim` is `None`).

    Example:

    >>> rope = keras_mha.RotaryEmbedding(
    ...     max_wavelength=500000, scaling_factor=8.0, rope_type="llama3",
    ...     low_freq_factor=1.0, high_freq_factor=4.0,
    ...     original_max_position_embeddings=8192)  # Llama 3.1
    >>> q = np.ones((2, 16, 4, 8))  # (B, L, N, H)
    >>> rope(q, start_index=3).shape
    (2, 16, 4, 8)
    """

    def __init__(self, max_wavelength=10000, scaling_factor=1.0,
                 rotary_dim=None, rope_type="linear", beta_fast=32.0,
                 beta_slow=1.0, original_max_position_embeddings=4096,
                 truncate=True, low_freq_factor=None, high_freq_factor=None,
                 attention_factor=None, short_factor=None, long_factor=None,
                 interleaved=False, **kwargs):
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self._rope = RopeScaling(
            max_wavelength=max_wavelength,
            scaling_factor=scaling_factor,
            rope_type=rope_type,
            beta_fast=beta_fast,
            beta_slow=beta_slow,
            original_max_position_embeddings=original_max_position_embeddings,
            truncate=truncate,
            low_freq_factor=low_freq_factor,
            high_freq_factor=high_freq_factor,
            attention_factor=attention_factor,
            short_factor=short_factor,
            long_factor=long_factor,
        )
        if rotary_dim is not None and (
            isinstance(rotary_dim, bool)
            or not isinstance(rotary_dim, numbers.Integral)
            or rotary_dim <= 0 or rotary_dim % 2
        ):
            raise ValueError(
                "Argument `rotary_dim` must be a positive even integer or "
                f"None. Received: rotary_dim={rotary_dim!r}"
            )
        if not isinstance(interleaved, bool):
            raise ValueError("Argument `interleaved` must be `True` or "
                             f"`False`. Received: interleaved={interleaved!r}")
        self._rotary_dim = None if rotary_dim is None else int(rotary_dim)
        self._interleaved = interleaved
        # The frequencies, computed once: here when `d` is known, else in
        # `build` from the first input's `H`. Never changed afterwards.
        self._tables = None
        if rotary_dim is None:
            return
        self._tables = self._rope.tables(self._rotary_dim)
        self.built = True

    def build(self, input_shape):
        self._tables = self._rope.tables(
            rotary_dim_of(input_shape, self._rotary_dim)
        )

    @property
    def attention_factor(self):
        """What cos and sin are multiplied by: the argument, or the type's
        default (Hugging Face's `attention_scaling`)."""
        return self._rope.cos_sin_factor

    def call(self, inputs, start_index=0, positions=None):
        d = rotary_dim_of(inputs.shape, self._rotary_dim)
        tables = self._tables
        if tables is None or tables.d != d:  # `call` unbuilt, or another H
            tables = self._rope.tables(d)
        positions = positions_of(inputs, start_index, positions)
        if self._rope.length_dependent:
            frequencies = self._length_dependent(tables, ops.amax(positions))
        else:
            frequencies = ops.convert_to_tensor(tables.frequencies, "float32")
        return turn(inputs, positions, frequencies, d, self._interleaved,
                    self._rope.cos_sin_factor)

    def _length_dependent(self, tables, largest):
        """`(d/2,)` float32 frequencies of a call whose largest position is
        `largest` (a scalar tensor): arithmetic, no branch, so a traced
        call is traced once."""
        length = self._rope.original_max_position_embeddings
        if self._rope.rope_type == "longrope":
            short, long = tables.frequencies
            return ops.where(
                ops.greater_equal(largest, length),
                ops.convert_to_tensor(long, "float32"),
                ops.convert_to_tensor(short, "float32"),
            )
        # dynamic: theta' = theta·s^(d/(d-2)), so inv_freq_i times
        # s^(-2i/(d-2)), with s = max(1, f·(P+1)/L0 - (f-1)).
        factor = float(self._rope.scaling_factor)
        s = ops.maximum(
            (largest + 1.0) * (factor / length) - (factor - 1.0), 1.0
        )
        exponents = ops.convert_to_tensor(tables.exponents, "float32")
        return ops.multiply(
            ops.convert_to_tensor(tables.frequencies, "float32"),
            ops.exp(ops.multiply(exponents, ops.log(s))),
        )

    def compute_output_spec(self, inputs, start_index=0, positions=None):
        """`inputs`' shape and dtype, the arguments checked: a symbolic
        call runs no arithmetic (on NumPy, `call` would run on the
        placeholder's uninitialised memory, NaNs included)."""
        d = rotary_dim_of(inputs.shape, self._rotary_dim)
        self._rope.check_rotary_dim(d)
        if positions is not None:
            _checked_positions(positions)
        return keras.KerasTensor(inputs.shape, dtype=inputs.dtype)

    def get_config(self):
        config = super().get_config()
        rope = {name: getattr(self._rope, name) for name in _ROPE_ARGUMENTS}
        for name in ("short_factor", "long_factor"):  # tuples: JSON lists
            if rope[name] is not None:
                rope[name] = list(rope[name])
        config.update(
            rope,
            rotary_dim=self._rotary_dim,
            interleaved=self._interleaved,
            autocast=self.autocast,
        )
        return config


def positions_of(inputs, start_index=0, positions=None):
    """The float32 positions of `inputs` `(B, L, ...)`: `positions` `(L,)`
    or `(B, L)` when given, else `start_index + t`."""
    if positions is None:
        length = ops.shape(inputs)[1]
        start = ops.cast(start_index, "float32")
        return ops.arange(length, dtype="float32") + start  # (L,)
    positions = _checked_positions(ops.convert_to_tensor(positions))
    return ops.cast(positions, "float32")  # (L,) or (B, L)


def turn(inputs, positions, frequencies, d, interleaved=False, factor=1.0):
    """`inputs` `(B, L, heads..., H)` with their first `d` features turned
    at `positions` (`positions_of`) by the float32 `frequencies` `(d/2,)`,
    cos and sin times `factor`; torch's fused rotation where it has one."""
    angles = ops.multiply(
        ops.expand_dims(positions, -1), frequencies
    )  # (L, d/2) or (B, L, d/2)
    for _ in range(len(inputs.shape) - 3):  # one axis per head axis
        angles = ops.expand_dims(angles, -2)  # (.., L, 1, d/2)
    dtype = keras.backend.result_type(inputs.dtype, "float32")
    cos, sin = ops.cos(angles), ops.sin(angles)
    if factor != 1:
        cos, sin = cos * factor, sin * factor
    cos, sin = ops.cast(cos, dtype), ops.cast(sin, dtype)
    if capabilities.has_fused_rotation():
        from keras_mha.attention import kernels

        fused = kernels.rotate_pairs if interleaved else kernels.rotate_half
        return fused(inputs, cos, sin, d)
    return rotate(inputs, cos, sin, d, interleaved, dtype)


def rotate(inputs, cos, sin, d, interleaved, dtype):
    """The rotation of `inputs`' first `d` features by `cos`, `sin`
    `(.., L, 1, d/2)`, computed in `dtype`; the rest pass unchanged."""
    size = inputs.shape[-1]
    x, *rest = [inputs] if size == d else ops.split(inputs, [d], axis=-1)
    x = ops.cast(x, dtype)
    if interleaved:
        pairs = ops.reshape(x, (*ops.shape(x)[:-1], d // 2, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]  # (.., d/2) each
    else:
        x1, x2 = ops.split(x, 2, axis=-1)
    # (x1 + i x2) * e^{i angle}: the rotation without building rotate-half.
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if interleaved:
        rotated = ops.reshape(ops.stack([y1, y2], axis=-1), ops.shape(x))
    else:
        rotated = ops.concatenate([y1, y2], axis=-1)
    rotated = ops.cast(rotated, inputs.dtype)
    return ops.concatenate([rotated, *rest], -1) if rest else rotated
