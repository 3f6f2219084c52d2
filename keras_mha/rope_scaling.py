"""The frequencies of each RoPE type, in float64: `RotaryEmbedding`'s
arithmetic that does not depend on the input, computed once per layer.

`RopeScaling` holds the checked arguments of `keras_mha.RotaryEmbedding`
and computes, for `d` rotated features, what Hugging Face's
`ROPE_INIT_FUNCTIONS[rope_type]` computes for the same parameters: the
inverse frequencies `inv_freq_i`, `i < d/2`, and the factor that multiplies
cos and sin (`attention_factor`). With `theta = max_wavelength`,
`f = scaling_factor`, `L0 = original_max_position_embeddings` and
`base_i = theta ** (-2i/d)`:

- `"default"`: `base_i` (`f` must be 1).
- `"linear"`: `base_i / f` (positions divided by `f`); keras-hub's default.
- `"llama3"` (Llama 3.1-3.3): wavelengths `2π/base_i` above
  `L0 / low_freq_factor` are divided by `f`, those below
  `L0 / high_freq_factor` kept, those between interpolated smoothly
  (none when the factors are equal: Llama 4 Scout).
- `"yarn"`: `base_i` (extrapolation) and `base_i / f` (interpolation)
  mixed by a ramp over the dimensions that turn between `beta_slow` and
  `beta_fast` times in `L0` positions (rounded outwards with `truncate`);
  cos and sin times `attention_factor`, `0.1·ln(f) + 1` by default.
- `"dynamic"` (dynamic NTK): `theta' = theta · s ** (d / (d-2))` with
  `s = max(1, f·(P+1)/L0 - (f-1))`, `P` the call's largest position.
- `"longrope"` (Phi-3, Phi-4): `base_i / short_factor_i` while `P < L0`,
  `base_i / long_factor_i` from `P >= L0` on; cos and sin times
  `attention_factor`, `sqrt(1 + ln(f) / ln(L0))` by default.

The two length-dependent types are functions of `P` alone, which the layer
computes from each call's positions (see `RotaryEmbedding`).
"""

import dataclasses
import math
import numbers

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
LENGTH_DEPENDENT = ("dynamic", "longrope")
# The arguments that only some types read (`None` unless given): the types
# that take each. The others have keras-hub's defaults and any type
# accepts them, as keras-hub's layer does.
_ONLY_WITH = {
    "low_freq_factor": ("llama3",),
    "high_freq_factor": ("llama3",),
    "attention_factor": ("yarn", "longrope"),
    "short_factor": ("longrope",),
    "long_factor": ("longrope",),
}
_REQUIRED = {
    "llama3": ("low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}


def _positive(name, value):
    """A positive finite number; an int stays an int (keras-hub's configs)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
        0 < value < float("inf")
    ):
        raise ValueError(f"Argument `{name}` must be a positive number. "
                         f"Received: {name}={value!r}")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
        value <= 0
    ):
        raise ValueError(f"Argument `{name}` must be a positive integer. "
                         f"Received: {name}={value!r}")
    return int(value)


def _boolean(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"Argument `{name}` must be `True` or `False`. "
                         f"Received: {name}={value!r}")
    return bool(value)


def _factors(name, value):
    """A sequence of positive numbers -> a tuple of floats."""
    try:
        factors = tuple(value)
    except TypeError:
        factors = None
    if not factors or not all(
        isinstance(x, numbers.Real) and not isinstance(x, bool)
        and 0 < x < float("inf") for x in factors
    ):
        raise ValueError(
            f"Argument `{name}` must be a list of positive numbers, one per "
            f"rotated pair (`rotary_dim / 2`). Received: {name}={value!r}"
        )
    return tuple(float(x) for x in factors)


@dataclasses.dataclass(frozen=True)
class RopeTables:
    """What a call of `d` rotated features reads, as Python floats (float64;
    the layer casts them to float32): constants under every tracer.

    Attributes:
        d: the number of rotated features.
        frequencies: `d/2` inverse frequencies; for `"longrope"`, a pair:
            the short factors' and the long ones'.
        exponents: `"dynamic"`'s `-2i / (d - 2)`: at `s > 1` the inverse
            frequencies are `frequencies_i · s ** exponents_i`. `None`
            for the other types.
    """

    d: int
    frequencies: tuple
    exponents: tuple | None = None


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The checked RoPE arguments of a `RotaryEmbedding`; immutable.

    Args: as `keras_mha.RotaryEmbedding`'s of the same names.
    """

    max_wavelength: float = 10000
    scaling_factor: float = 1.0
    rope_type: str = "linear"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    short_factor: tuple | None = None
    long_factor: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.rope_type, str) or (
            self.rope_type not in ROPE_TYPES
        ):
            raise ValueError(
                f"Argument `rope_type` must be one of {ROPE_TYPES}. "
                f"Received: rope_type={self.rope_type!r}"
            )
        checked = dict(
            max_wavelength=_positive("max_wavelength", self.max_wavelength),
            scaling_factor=_positive("scaling_factor", self.scaling_factor),
            beta_fast=_positive("beta_fast", self.beta_fast),
            beta_slow=_positive("beta_slow", self.beta_slow),
            original_max_position_embeddings=_positive_int(
                "original_max_position_embeddings",
                self.original_max_position_embeddings,
            ),
            truncate=_boolean("truncate", self.truncate),
        )
        for name, types in _ONLY_WITH.items():
            value = getattr(self, name)
            if value is None:
                if name in _REQUIRED.get(self.rope_type, ()):
                    raise ValueError(
                        f"Argument `{name}` is required with "
                        f"rope_type={self.rope_type!r}. Received: {name}=None"
                    )
                continue
            if self.rope_type not in types:
                raise ValueError(
                    f"Argument `{name}` is read only with rope_type in "
                    f"{types}: it would change nothing. Received: "
                    f"{name}={value!r}, rope_type={self.rope_type!r}"
                )
            checked[name] = (
                _factors(name, value) if name in ("short_factor", "long_factor")
                else _positive(name, value)
            )
        if self.rope_type == "default" and checked["scaling_factor"] != 1:
            raise ValueError(
                "Argument `scaling_factor` must be 1 with rope_type='default', "
                "which does not scale positions (use rope_type='linear'). "
                f"Received: scaling_factor={self.scaling_factor!r}"
            )
        if self.rope_type == "llama3" and not (
            checked["high_freq_factor"] >= checked["low_freq_factor"]
        ):
            raise ValueError(
                "Argument `high_freq_factor` must be at least "
                "`low_freq_factor`. Received: "
                f"high_freq_factor={self.high_freq_factor!r}, "
                f"low_freq_factor={self.low_freq_factor!r}"
            )
        if self.rope_type == "longrope" and (
            len(checked["short_factor"]) != len(checked["long_factor"])
        ):
            raise ValueError(
                "Arguments `short_factor` and `long_factor` must have the "
                "same length, `rotary_dim / 2`. Received: "
                f"short_factor={list(checked['short_factor'])}, "
                f"long_factor={list(checked['long_factor'])}"
            )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def length_dependent(self):
        """Whether the frequencies depend on the call's largest position."""
        return self.rope_type in LENGTH_DEPENDENT

    @property
    def cos_sin_factor(self):
        """What cos and sin are multiplied by: `attention_factor`, or its
        default for the type (Hugging Face's), 1 for the other types."""
        factor = self.scaling_factor
        if self.attention_factor is not None:
            return self.attention_factor
        if self.rope_type == "yarn" and factor > 1:
            return 0.1 * math.log(factor) + 1.0
        if self.rope_type == "longrope" and factor > 1:
            length = self.original_max_position_embeddings
            return math.sqrt(1 + math.log(factor) / math.log(length))
        return 1.0

    def check_rotary_dim(self, d):
        """A `ValueError` if the type cannot rotate `d` features."""
        if self.rope_type == "longrope" and len(self.short_factor) != d // 2:
            raise ValueError(
                "Arguments `short_factor` and `long_factor` need one value per "
                f"rotated pair: {d // 2} for rotary_dim={d}. Received: "
                f"short_factor={list(self.short_factor)} "
                f"({len(self.short_factor)} values), rotary_dim={d}"
            )
        if self.rope_type == "dynamic" and d <= 2:
            raise ValueError(
                "Argument `rotary_dim` must be above 2 with "
                "rope_type='dynamic', which scales the base by "
                f"`s ** (d / (d - 2))`. Received: rotary_dim={d}"
            )

    def frequencies(self, d):
        """The inverse frequencies of `d` rotated features.

        Python floats (float64), not NumPy: a constant to every tracer,
        `torch.compile`'s included, when a layer is first built inside one.

        Returns:
            A tuple of `d/2` floats; for `"longrope"`, a pair of them: the
            short factors' then the long ones'; for `"dynamic"`, those of
            `s = 1` (positions below `original_max_position_embeddings`).
        """
        self.check_rotary_dim(d)
        theta = float(self.max_wavelength)
        base = [theta ** (-(2 * i) / d) for i in range(d // 2)]
        factor = float(self.scaling_factor)
        if self.rope_type == "linear":
            return tuple(b / factor for b in base)
        if self.rope_type == "llama3":
            return tuple(self._llama3(b, factor) for b in base)
        if self.rope_type == "yarn":
            low, high = self._yarn_ramp(d)
            # ramp 0: extrapolate (keep b), 1: interpolate (b / factor).
            ramps = [min(max((i - low) / (high - low), 0.0), 1.0)
                     for i in range(d // 2)]
            return tuple(b / factor * r + b * (1 - r)
                         for b, r in zip(base, ramps))
        if self.rope_type == "longrope":
            return (tuple(b / x for b, x in zip(base, self.short_factor)),
                    tuple(b / x for b, x in zip(base, self.long_factor)))
        return tuple(base)  # default, dynamic

    def tables(self, d):
        """The `RopeTables` of `d` rotated features."""
        self.check_rotary_dim(d)
        exponents = None
        if self.rope_type == "dynamic":
            exponents = tuple(-(2 * i) / (d - 2) for i in range(d // 2))
        return RopeTables(d, self.frequencies(d), exponents)

    def _llama3(self, b, factor):
        length = self.original_max_position_embeddings
        low, high = self.low_freq_factor, self.high_freq_factor
        wavelength = 2 * math.pi / b
        if wavelength > length / low:
            return b / factor
        if wavelength < length / high or high == low:
            # Equal factors (Llama 4 Scout) leave no band to smooth over.
            return b
        smooth = (length / wavelength - low) / (high - low)
        return (1 - smooth) * b / factor + smooth * b

    def _yarn_ramp(self, d):
        """The ends of YaRN's ramp, in pairs: extrapolation below `low`,
        interpolation above `high`."""
        theta = float(self.max_wavelength)
        length = self.original_max_position_embeddings

        def dimension(turns):  # where a feature turns `turns` times in L0
            return d * math.log(length / (turns * 2 * math.pi)) / (
                2 * math.log(theta)
            )

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # as Hugging Face does: no division by zero
        return low, high
