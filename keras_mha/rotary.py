"""`keras_mha.RotaryEmbedding`: rotary position embeddings (RoPE).

Rotate-half layout (Llama, GPT-NeoX, keras-hub, Hugging Face): feature `i`
pairs with `i + d/2`, so `<rot(q, p), rot(k, j)>` depends on `p - j` alone.
Called as `keras_hub.layers.RotaryEmbedding` is, so either layer serves.
"""

import numbers

import keras
import numpy as np
from keras import ops


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


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
        0 < value < float("inf")
    ):
        raise ValueError(f"Argument `{name}` must be a positive number. "
                         f"Received: {name}={value!r}")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


@keras.saving.register_keras_serializable(package="keras_mha")
class RotaryEmbedding(keras.layers.Layer):
    """Rotary position embedding of `(B, L, ..., H)` inputs; no weights.

    With `d = rotary_dim or H` and `inv_freq_i = max_wavelength ** (-2i/d)`
    for `i < d/2`, the features `(x_i, x_{i + d/2})` of the row at position
    `p` turn by the angle `(p / scaling_factor) * inv_freq_i`; features
    `[d:]` pass unchanged. Angles and rotation are in float32 (or the
    input's wider dtype); the result has the input's dtype, not the dtype
    policy's (`autocast=False` unless given): half precision stays half.

    Args:
        max_wavelength: the longest wavelength (Llama's `rope_theta`), a
            positive number.
        scaling_factor: positions are divided by it (linear RoPE scaling), a
            positive number.
        rotary_dim: `d`, how many leading features of each head turn
            (partial rotary), a positive even int; all `H` if `None`.
        **kwargs: other `keras.layers.Layer` arguments (`name`, `dtype`).

    Call arguments:
        inputs: `(B, L, ..., H)`: the sequence on axis 1, features last.
        start_index: the position of row 0, an int or a scalar integer
            tensor (a cache index, also under `jax.jit` or `tf.function`).
        positions: optional integer tensor `(L,)` or `(B, L)` of absolute
            positions; overrides `start_index`.

    Returns:
        The rotated `inputs`, of the same shape and dtype.

    Example:

    >>> rope = keras_mha.RotaryEmbedding(max_wavelength=10000)
    >>> q = np.ones((2, 16, 4, 8))  # (B, L, N, H)
    >>> rope(q, start_index=3).shape
    (2, 16, 4, 8)
    """

    def __init__(self, max_wavelength=10000, scaling_factor=1.0,
                 rotary_dim=None, **kwargs):
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self.max_wavelength = _positive("max_wavelength", max_wavelength)
        self.scaling_factor = _positive("scaling_factor", scaling_factor)
        if rotary_dim is not None and (
            isinstance(rotary_dim, bool)
            or not isinstance(rotary_dim, numbers.Integral)
            or rotary_dim <= 0 or rotary_dim % 2
        ):
            raise ValueError(
                "Argument `rotary_dim` must be a positive even integer or "
                f"None. Received: rotary_dim={rotary_dim!r}"
            )
        self.rotary_dim = None if rotary_dim is None else int(rotary_dim)
        self.built = True

    def call(self, inputs, start_index=0, positions=None):
        d = rotary_dim_of(inputs.shape, self.rotary_dim)
        if positions is None:
            positions = ops.arange(
                ops.shape(inputs)[1], dtype="float32"
            ) + ops.cast(start_index, "float32")  # (L,)
        positions = _checked_positions(ops.convert_to_tensor(positions))
        # 1/scaling_factor is folded into the frequencies, in float64: the
        # same angles in real arithmetic, one float32 rounding fewer.
        inv_freq = np.power(
            float(self.max_wavelength), -np.arange(0, d, 2) / d
        ) / self.scaling_factor  # (d/2,)
        angles = ops.multiply(
            ops.expand_dims(ops.cast(positions, "float32"), -1),
            inv_freq.astype("float32"),
        )  # (L, d/2) or (B, L, d/2)
        for _ in range(len(inputs.shape) - 3):  # one axis per head axis
            angles = ops.expand_dims(angles, -2)  # (.., L, 1, d/2)
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        cos = ops.cast(ops.cos(angles), dtype)
        sin = ops.cast(ops.sin(angles), dtype)
        if keras.backend.backend() == "torch":
            from keras_mha.attention import kernels

            return kernels.rotate_half(inputs, cos, sin, d)
        splits = [d // 2] if inputs.shape[-1] == d else [d // 2, d]
        x1, x2, *rest = ops.split(inputs, splits, axis=-1)  # rest: [d:]
        x1, x2 = ops.cast(x1, dtype), ops.cast(x2, dtype)
        # (x1 + i x2) * e^{i angle}: rotate-half without building it.
        rotated = ops.concatenate(
            [x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1
        )
        rotated = ops.cast(rotated, inputs.dtype)
        return ops.concatenate([rotated, *rest], -1) if rest else rotated

    def compute_output_spec(self, inputs, start_index=0, positions=None):
        """`inputs`' shape and dtype, the arguments checked: a symbolic
        call runs no arithmetic (on NumPy, `call` would run on the
        placeholder's uninitialised memory, NaNs included)."""
        rotary_dim_of(inputs.shape, self.rotary_dim)
        if positions is not None:
            _checked_positions(positions)
        return keras.KerasTensor(inputs.shape, dtype=inputs.dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            max_wavelength=self.max_wavelength,
            scaling_factor=self.scaling_factor,
            rotary_dim=self.rotary_dim,
            autocast=self.autocast,
        )
        return config
