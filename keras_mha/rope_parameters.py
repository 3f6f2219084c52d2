"""Hugging Face's RoPE settings -> `keras_mha.RotaryEmbedding`.

`transformers` 5 keeps them in `config.rope_parameters` (one dict, or one
per layer type), older versions in `config.rope_theta` and
`config.rope_scaling`. The model computes its rotary tables with
`ROPE_INIT_FUNCTIONS[rope_type]` (`transformers.modeling_rope_utils`);
this module reads exactly the parameters that function reads, with the
same defaults, into the layer's arguments, so the layer's frequencies and
cos/sin scaling are the model's. A setting the layer cannot represent is a `ValueError`
that names it. Nothing here imports `transformers`.
"""

import math

import numpy as np

from keras_mha.rope_scaling import ROPE_TYPES
from keras_mha.rotary import RotaryEmbedding

DEFAULT_ROPE_THETA = 10000.0  # transformers' `default_theta`
# The types whose pre-training length transformers fills in from
# `max_position_embeddings` when the config does not give it.
_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def rope_parameters(config, layer_type=None):
    """The rope parameters of a layer of `layer_type`, as transformers 5
    standardizes them: a dict with `rope_type` and `rope_theta` at least.

    Args:
        config: a `transformers` config, or an object with the same
            attributes (`rope_parameters`, or `rope_theta` and
            `rope_scaling` as before transformers 5).
        layer_type: the layer's entry of `config.layer_types`, for configs
            whose `rope_parameters` has one dict per layer type.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:  # before transformers 5: `rope_theta`, `rope_scaling`
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault(
            "rope_theta", getattr(config, "rope_theta", DEFAULT_ROPE_THETA)
        )
        factor = getattr(config, "partial_rotary_factor", None)
        if factor is not None:
            params.setdefault("partial_rotary_factor", factor)
    elif isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", DEFAULT_ROPE_THETA)
    if params["rope_type"] in _WITH_ORIGINAL_LENGTH:
        # Phi-3 keeps its pre-training length beside the rope parameters;
        # transformers gives that one priority.
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault(
            "original_max_position_embeddings",
            config.max_position_embeddings,
        )
    return params


def rotary_embedding(config, head_dim, owner, layer_type=None,
                     partial_rotary=False, interleaved=False):
    """The `RotaryEmbedding` whose tables are the model's.

    Args:
        config: the module's config (see `rope_parameters`).
        head_dim: `H`, the module's head size.
        owner: the module's class name, for error messages.
        layer_type: as in `rope_parameters`.
        partial_rotary: whether the model rotates only
            `int(H · partial_rotary_factor)` features. When `False` (Llama,
            Mistral, Qwen2, Gemma 2, gpt-oss) the default type rotates all
            `H` whatever the factor says, and the scaled types, whose
            tables the model cannot apply to `H` features otherwise, need
            a factor of 1.
        interleaved: whether the model rotates the pairs
            `(x_{2i}, x_{2i+1})` (Cohere2, Llama 4) rather than
            `(x_i, x_{i + d/2})`.

    Returns:
        A `keras_mha.RotaryEmbedding` with `rotary_dim` set.

    Raises:
        ValueError: for a rope type the layer does not have, or a partial
            rotary factor the model cannot run with; the message names the
            setting.
    """
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "proportional" and not interleaved:
        return _proportional(params, head_dim)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"The {owner}'s rope type has no counterpart in "
            f"`keras_mha.RotaryEmbedding` (which has {ROPE_TYPES}). "
            f"Received: rope_type={rope_type!r}"
        )
    fraction = params.get("partial_rotary_factor", 1.0)
    rotary_dim = int(head_dim * fraction)
    if not partial_rotary:
        if rope_type != "default" and rotary_dim != head_dim:
            raise ValueError(
                f"The {owner} applies a table of `int(head_dim * "
                f"partial_rotary_factor)` = {rotary_dim} features to heads "
                f"of {head_dim} with rope_type={rope_type!r}: the model "
                "itself cannot run. Received: "
                f"partial_rotary_factor={fraction!r}"
            )
        rotary_dim = head_dim
    kwargs = dict(
        max_wavelength=params["rope_theta"],
        rotary_dim=rotary_dim,
        rope_type=rope_type,
        interleaved=interleaved,
        **_READERS[rope_type](params, config),
    )
    return RotaryEmbedding(**kwargs)


def proportional_order(config, head_dim, layer_type=None):
    """The order of a head's features in which a "proportional" rotary
    embedding (Gemma 4, LFM3) is `_proportional`'s; `None` for any other
    rope type.

    transformers' proportional RoPE turns the pairs `(x_i, x_{i + H/2})`
    for `i < a = int(partial_rotary_factor · H / 2)` at the frequencies
    `theta^(-2i/H)`, and leaves the other pairs. With the rotated pairs'
    features moved to the front, `[0, a) ∪ [H/2, H/2 + a)` then the rest,
    that is the layer's rotation of the first `2a` features, pairs `(j, j
    + a)`, at `theta'^(-2j/2a)`, `theta' = theta^(2a/H)`. A query's product
    with a key is the same whatever order both take, so the importer
    reorders the query and key projections' rows by this order.
    """
    params = rope_parameters(config, layer_type)
    if params["rope_type"] != "proportional":
        return None
    half, rotated = head_dim // 2, _rotated_pairs(params, head_dim)
    return np.concatenate([
        np.arange(rotated), half + np.arange(rotated),
        np.arange(rotated, half), half + np.arange(rotated, half),
    ])


def _rotated_pairs(params, head_dim):
    return int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)


def _proportional(params, head_dim):
    """The layer's rotation of the features reordered by
    `proportional_order`; `None` where no pair turns."""
    rotated = _rotated_pairs(params, head_dim)
    if rotated == 0:
        return None
    return RotaryEmbedding(
        max_wavelength=params["rope_theta"] ** (2 * rotated / head_dim),
        rotary_dim=2 * rotated,
        scaling_factor=params.get("factor", 1.0),
    )


def _default(params, config):
    return {}


def _linear(params, config):
    return dict(scaling_factor=params["factor"])


def _dynamic(params, config):
    # transformers' dynamic NTK scales from `max_position_embeddings`.
    return dict(
        scaling_factor=params["factor"],
        original_max_position_embeddings=config.max_position_embeddings,
    )


def _llama3(params, config):
    return dict(
        scaling_factor=params["factor"],
        low_freq_factor=params["low_freq_factor"],
        high_freq_factor=params["high_freq_factor"],
        original_max_position_embeddings=(
            params["original_max_position_embeddings"]
        ),
    )


def _factor(params, config):
    """`factor`, or the ratio of the lengths where a config leaves it out
    (DeepSeek V3, Phi-3)."""
    factor = params.get("factor")
    if factor is None:
        factor = (
            config.max_position_embeddings
            / params["original_max_position_embeddings"]
        )
    return factor


def _yarn(params, config):
    factor = _factor(params, config)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = _mscale(factor, mscale) / _mscale(
            factor, mscale_all_dim
        )
    return dict(
        scaling_factor=factor,
        attention_factor=attention_factor,
        beta_fast=params.get("beta_fast") or 32.0,
        beta_slow=params.get("beta_slow") or 1.0,
        truncate=params.get("truncate", True),
        original_max_position_embeddings=(
            params["original_max_position_embeddings"]
        ),
    )


def _mscale(factor, mscale):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope(params, config):
    return dict(
        scaling_factor=_factor(params, config),
        attention_factor=params.get("attention_factor"),
        short_factor=params["short_factor"],
        long_factor=params["long_factor"],
        original_max_position_embeddings=(
            params["original_max_position_embeddings"]
        ),
    )


_READERS = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}
