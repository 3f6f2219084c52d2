"""Each layer's configuration as one frozen value, `layer.settings`, that
the modules around the layer read.

Each attention layer checks its constructor's arguments, resolves them
(`value_dim`, `num_key_value_heads` and `scale` filled in) and keeps them as
one `layer.settings`, built once in `__init__`. Its read-only properties
and its config derive from it, and the modules around the layer read it
instead of the layer's private attributes. What both kinds of layer share
is `AttentionSettings`; a setting one kind lacks has a fixed value there
(`attention_chunk_size=None` for the latent layer), never a missing
attribute.

A frozen dataclass is not a Keras saveable, list or dict: Keras's tracking
and saving pass it by, so a saved file holds what it held before.
"""

import dataclasses
from typing import Any

from keras_mha.attention import spec as spec_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSettings:
    """What every attention layer is configured with, resolved.

    Attributes:
        num_heads: `N`.
        dropout: the rate on the attention weights.
        scale: the logit scale, resolved (the layer's default if unset).
        given_scale: `scale` as the constructor took it (`None` if unset),
            for the config.
        sliding_window: `None`, `w` or `(left, right)`.
        attn_logits_soft_cap: `None` or the soft-cap `c`.
        rotary_embedding: `None`, or the rotary layer.
        use_bias: whether the projections have biases.
        kernel_initializer, bias_initializer: the projections'.
        kernel_regularizer, bias_regularizer, activity_regularizer,
            kernel_constraint, bias_constraint: the projections' (`None`
            for a layer without them).
        attention_chunk_size: `None` or `C` (the latent layer: `None`).
        flash_attention: `None`, `True` or `False` (latent: `None`).
        use_alibi, use_sinks: the ALiBi slopes, the sink logits (latent:
            `False`).
        alibi_before_scale: whether ALiBi's terms are added before the
            logit scale, so scaled with the logits (Falcon).
    """

    num_heads: int
    dropout: float
    scale: float
    given_scale: Any
    sliding_window: Any
    attn_logits_soft_cap: Any
    rotary_embedding: Any
    use_bias: bool
    kernel_initializer: Any
    bias_initializer: Any
    kernel_regularizer: Any
    bias_regularizer: Any
    activity_regularizer: Any
    kernel_constraint: Any
    bias_constraint: Any
    attention_chunk_size: Any
    flash_attention: Any
    use_alibi: bool
    use_sinks: bool
    alibi_before_scale: bool = False

    @property
    def rolling_slots(self):
        """A rolling cache's slots: the most keys a causal query sees, the
        window's `left + 1` or the chunk's `C`, the fewer; `None` without
        a window or chunks (a cache then has a slot per position)."""
        if self.sliding_window is None and self.attention_chunk_size is None:
            return None
        return spec_lib.AttentionSpec(
            1.0, causal=True, chunk=self.attention_chunk_size,
            window=spec_lib.window_sides(self.sliding_window, True),
        ).reach[0] + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiHeadSettings(AttentionSettings):
    """`keras_mha.MultiHeadAttention`'s settings, resolved.

    Attributes:
        key_dim: `H`.
        value_dim: `V` (`key_dim` if unset).
        num_key_value_heads: `K` (`num_heads` if unset).
        use_gate, gate_activation: the output gate.
        output_shape: `None` or the output's trailing shape, a tuple.
        attention_axes: `None` or a tuple of axes.
        qk_norm, qk_norm_scope, qk_norm_epsilon, qk_norm_after_rope,
            value_norm, qkv_clip, query_temperature: the per-token
            transforms of the heads (`heads.py`).
        input_norm, input_norm_scope, output_norm: `None` or the Keras
            layers that normalize the inputs before the projections (the
            query's only with scope `"query"`) and the heads after
            attention (`projections.py`).
        shared_key_value: whether the layer projects queries only and
            reads an earlier layer's keys and values (`sharing.py`).
        key_value_source: `None`, or the name or index of that layer.
        differential, differential_epsilon: `None` or `λ_init`, and the
            norm's epsilon, of differential attention
            (`keras_mha.differential`).
        use_query_scale: whether a weight `(N, H)` multiplies the queries
            after the rotary embedding (`heads.queries`).
    """

    key_dim: int
    value_dim: int
    num_key_value_heads: int
    use_gate: bool
    gate_activation: str
    output_shape: Any
    attention_axes: Any
    qk_norm: Any
    qk_norm_scope: str
    qk_norm_epsilon: float
    query_temperature: Any
    qk_norm_after_rope: bool
    value_norm: bool
    qkv_clip: Any
    input_norm: Any = None
    input_norm_scope: str = "all"
    output_norm: Any = None
    shared_key_value: bool = False
    key_value_source: Any = None
    differential: Any = None
    differential_epsilon: float = 1e-5
    use_query_scale: bool = False


# The latent layer's values of the settings it has not.
LATENT_LACKS = dict(
    kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
    kernel_constraint=None, bias_constraint=None, attention_chunk_size=None,
    flash_attention=None, use_alibi=False, use_sinks=False,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentSettings(AttentionSettings):
    """`keras_mha.MultiHeadLatentAttention`'s settings, resolved.

    Attributes:
        kv_lora_rank: `R`, the latent's size.
        qk_nope_head_dim, qk_rope_head_dim: the query and key features per
            head without and with the rotary embedding.
        v_head_dim: `V`.
        q_lora_rank: `None`, or the query's own compression.
        norm_epsilon: the RMS normalizations'.
        use_gate: whether a sigmoid gate of the query multiplies each
            head's features before the output projection.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Any
    norm_epsilon: float
    use_gate: bool = False

    @property
    def qk_head_dim(self):
        """A query head's features, `qk_nope_head_dim + qk_rope_head_dim`."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim
