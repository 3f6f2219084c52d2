"""What a `transformers` family computes beyond what its module holds.

A module's projections, norms, gates and sinks are read from the module
(`hf_structure`), its heads, windows, chunks and rope parameters from its
config. What neither shows is written in the family's code: whether the
rotary embedding turns interleaved pairs, rotates part of each head, or
applies on some layers only; how a fused projection lays out its heads;
how an output gate is computed. That is this table, keyed by the config's
`model_type`: a family is data, never code. A family not listed reads as
the default (Llama's computation); one whose config asks for something
that only the family's code could settle (a partial rotary factor, say) is
refused by name rather than guessed.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    """Attributes:
        window: where the model takes each layer's sliding window from:
            `"auto"` (`config.layer_types`' `"sliding_attention"` layers
            when the config has layer types, else `config.sliding_window`
            for every layer), `"config"` (`config.sliding_window` for every
            layer, whatever `layer_types` says), `"layer_types"` (as
            `"auto"`, though the module's own `sliding_window` is set on
            every layer: Exaone 4) or `None` (no window).
        rope_layers: which layers rotate: `None` (every layer whose forward
            takes `position_embeddings`), `"no_rope_layers"` (those where
            `config.no_rope_layers[i]` is true: SmolLM3, Llama 4) or
            `"sliding"` (those with a sliding window: Cohere2, Exaone 4) or
            `"every"` (every layer, the model passing its own sinusoidal
            table: RoFormer).
        partial_rotary: whether the model rotates only
            `int(H · partial_rotary_factor)` features of each head.
        interleaved: whether the model rotates the pairs
            `(x_{2i}, x_{2i+1})` rather than `(x_i, x_{i+d/2})`.
        reversed_rotation: whether the model turns each pair by `-θ`
            (nanochat): the layer's rotation of the halves swapped, which
            the importer reads by swapping each query and key head's
            halves.
        scale: the logit scale where the module keeps none (GPT-Neo's
            1.0); `None`: the module's `scaling`, else `1 / sqrt(H)`.
        fused_layout: how a fused query-key-value projection orders its
            rows: `"contiguous"`, `"per_head"` or `"model_parallel"` (see
            `hf_structure._split_fused`).
        query_gate: `"per_head"` where the query projection holds, per
            head, `H` query rows then `H` gate rows (Qwen3-Next); else
            `None`.
        separate_gate: whether a `gate_proj`/`g_proj` is an output gate
            of the input, as the layer's `use_gate`, one per feature of
            the heads or one per head: `True` (a sigmoid) or the name of
            its activation (`"softplus"`: Laguna).
        temperature: whether the NoPE layers scale their queries by
            position when `config.attn_temperature_tuning` (Llama 4).
        norms_after_rope: whether the query/key norms come after the
            rotary embedding (Hunyuan), as `qk_norm_after_rope=True`.
        alibi: whether the model adds ALiBi's biases, with the slopes of
            the layer's `use_alibi` (BLOOM, MPT). A module whose forward
            takes `alibi`, or whose config has `alibi=True` (Falcon's,
            whose biases are divided by `sqrt(H)`), from a family not
            marked so is refused.
    """

    window: str | None = "auto"
    rope_layers: str | None = None
    partial_rotary: bool = False
    interleaved: bool = False
    reversed_rotation: bool = False
    scale: float | None = None
    fused_layout: str = "contiguous"
    query_gate: str | None = None
    separate_gate: bool | str = False
    temperature: bool = False
    norms_after_rope: bool = False
    alibi: bool = False


DEFAULT = Family()

# Each family once, with the `model_type`s that compute as it does.
_TABLE = (
    (Family(partial_rotary=True),
     ("bamba", "glm4_moe", "mimo_v2_flash", "nemotron", "phi",
      "recurrent_gemma", "stablelm")),
    (Family(interleaved=True),
     ("cohere", "deepseek_v2", "ernie4_5", "ernie4_5_moe", "gptj", "helium")),
    (Family(partial_rotary=True, interleaved=True), ("glm", "glm4")),
    (Family(partial_rotary=True, fused_layout="per_head"),
     ("gpt_neox", "gpt_neox_japanese", "persimmon")),
    (Family(partial_rotary=True, query_gate="per_head"),
     ("qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")),
    (Family(separate_gate=True), ("dory", "hrm_text", "lfm3")),
    # Ling 3: multi-head latent attention with a gate per head.
    (Family(separate_gate=True, interleaved=True), ("bailing_hybrid",)),
    (Family(separate_gate=True, rope_layers="sliding"), ("afmoe", "beam")),
    (Family(rope_layers="sliding"), ("flint", "lara_mini")),
    (Family(rope_layers="sliding", interleaved=True),
     ("cohere2", "cohere2_moe", "ergo")),
    # Rotary embeddings on the sliding layers only, windows by layer type
    # though the modules hold a window on every layer.
    (Family(window="layer_types", rope_layers="sliding"),
     ("exaone4", "exaone_moe", "kolibri1")),
    (Family(norms_after_rope=True), ("hunyuan_v1_dense", "hunyuan_v1_moe")),
    # BLOOM's module adds its block's residual to its output; the layer is
    # the attention without it, as for a BERT-style block.
    (Family(alibi=True, fused_layout="per_head"), ("bloom",)),
    (Family(alibi=True), ("mpt",)),
    (Family(interleaved=True, fused_layout="model_parallel"), ("codegen",)),
    (Family(window="attention_type", scale=1.0), ("gpt_neo",)),
    (Family(window="config"), ("mistral",)),
    # Moshi's model masks causally only, whatever `config.sliding_window`
    # holds.
    (Family(window=None), ("moshi",)),
    (Family(window="config", partial_rotary=True), ("phi3",)),
    (Family(separate_gate="softplus", partial_rotary=True), ("laguna",)),
    (Family(rope_layers="no_rope_layers"), ("smollm3",)),
    (Family(rope_layers="no_rope_layers", interleaved=True, temperature=True),
     ("llama4_text",)),
    (Family(rope_layers="every", interleaved=True), ("roformer",)),
    (Family(query_gate="per_head"), ("minicpm5_moe",)),
    (Family(reversed_rotation=True), ("nanochat",)),
)
FAMILIES = {
    model_type: family
    for family, model_types in _TABLE
    for model_type in model_types
}


def family(config):
    """The `Family` of a module's config."""
    return FAMILIES.get(getattr(config, "model_type", None), DEFAULT)
