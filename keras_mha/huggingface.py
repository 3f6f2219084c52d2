"""Weight import: Hugging Face `transformers` attention modules -> our layer.

`keras_mha.from_torch` sends any `transformers` module here. A module is
read from what it holds (`hf_structure`: projections, biases, norms,
gates, sinks) and from its config (heads, windows, chunks, rope
parameters); what only a family's code shows is a row of the table in
`hf_families`, keyed by the config's `model_type`, never by the class's
name. A module the reader is not sure of is refused with a `ValueError`
that names its class and the feature: a wrong import is worse than none.
Nothing here imports `transformers`, so the library never needs it
installed.

Only the attention module is converted. Its rotary embedding lives in the
model (`LlamaRotaryEmbedding(config)`), and so does its mask (built from
`config.layer_types` and `config.sliding_window`); both are read back from
the config into the layer's `rotary_embedding` (`rope_parameters.py`) and
`sliding_window`.
"""

import numpy as np

from keras_mha import hf_differential
from keras_mha import hf_families
from keras_mha import hf_structure
from keras_mha import host
from keras_mha import rope_parameters
from keras_mha.layer import MultiHeadAttention


def is_transformers_attention(obj):
    """Whether `obj` is a torch module defined in `transformers` (or a
    subclass of one), which `from_transformers` reads or refuses by name."""
    return any(
        cls.__module__.startswith("transformers.")
        for cls in type(obj).__mro__
    ) and hasattr(obj, "named_children")


def from_transformers(module, config=None, **layer_kwargs):
    """Builds a `MultiHeadAttention` from a `transformers` attention module.

    Any family whose attention the layer computes is read, from the module
    and its `config`, for the module's `layer_idx`; DeepSeek's multi-head
    latent attention (a module with `kv_a_proj_with_mqa`) gives a
    `MultiHeadLatentAttention` instead (`hf_latent.from_transformers` says
    what is read). docs/importing.md lists every family of the pinned
    `transformers` with what it uses.

    - heads: `config.num_attention_heads`; `config.num_key_value_heads`,
      or one with `config.multi_query`, or else one per query head;
      `module.head_dim` (`config.head_dim`, or `hidden_size // heads`).
      The weights' shapes must agree.
    - weights (`hf_structure`): `q_proj`, `k_proj`, `v_proj` and `o_proj`
      (or `out_proj`, `dense`), or one fused projection (`qkv_proj`,
      `Wqkv`, `c_attn`, `query_key_value`), with their biases. If any
      projection has a bias, all get one, zero where the module has none.
      An output gate (a `gate_proj`, or the gate half of Qwen3-Next's
      query projection) becomes `use_gate=True`; `sinks`, `use_sinks`.
    - rotary embedding: `config.rope_parameters` (transformers 5, one
      dict or one per layer type) or `config.rope_theta` and
      `config.rope_scaling` (older configs), rope types `"default"`,
      `"linear"`, `"llama3"`, `"yarn"`, `"dynamic"` and `"longrope"`, with
      the parameters and defaults of transformers' `ROPE_INIT_FUNCTIONS`
      (see `keras_mha.rope_parameters`), on the layers whose forward takes
      `position_embeddings`, interleaved and partial where the family's
      row says so. `"dynamic"` and `"longrope"` depend on the call's
      largest position, as in the model; see `RotaryEmbedding` for what
      that means for a cache.
    - NoPE layers (`rotary_embedding=None`): where
      `config.no_rope_layers[layer_idx]` is 0 (SmolLM3, Llama 4), or the
      full-attention layers of families that rotate only where they
      slide (Cohere2, Exaone 4).
    - query/key norms, probed (`hf_structure`): RMS over each head or
      over the whole projection, with their weights as the scales (`1 + w`
      where the norm computes that: Gemma) and their epsilon as
      `qk_norm_epsilon`; weightless ones as `qk_norm="l2"`; after the
      rotary embedding where the family's row says so (Hunyuan).
    - a BERT-style block's norm of its input as `input_norm` (the query,
      value and key of self-attention; pass `input_norm_scope="query"`
      for the block's cross-attention, whose memory it leaves as it is),
      and a norm of the heads before the output projection (BitNet) as
      `output_norm`.
    - chunks: `config.attention_chunk_size` for the layers that
      `config.layer_types` marks `"chunked_attention"`; Llama 4's
      `attn_temperature_tuning` as `query_temperature=(floor_scale,
      attn_scale)` on its NoPE layers.
    - sliding window: `config.sliding_window` where
      `config.layer_types[layer_idx] == "sliding_attention"`, or on every
      layer for configs without layer types (and Mistral's, which ignores
      them). Hugging Face's window `W` (`kv_idx > q_idx - W`) is our
      causal `sliding_window=W`.
    - `module.scaling` as `scale`; `attn_logit_softcapping` as
      `attn_logits_soft_cap`; `config.attention_dropout` as `dropout`
      unless `dropout` is passed.

    The layer computes what the module computes, given the model's
    position embeddings for positions `0..T-1` and its causal mask, when
    called as `layer(x, x, use_causal_mask=True)`.

    Args:
        module: a `transformers` attention module.
        config: the model's config, for a module that keeps none
            (`module.config`: BART's, BLOOM's); else the module's own.
        **layer_kwargs: more `MultiHeadAttention` arguments (`name`, `dtype`,
            `flash_attention`, `dropout`, ...). Those the module fixes
            (`num_heads`, `key_dim`, `value_dim`, `num_key_value_heads`,
            `use_bias`, `use_gate`, `output_shape`, `rotary_embedding`,
            `scale`, `attn_logits_soft_cap`, `use_sinks`, `use_alibi`,
            `sliding_window`, `qk_norm`, `qk_norm_scope`,
            `qk_norm_epsilon`, `attention_chunk_size`, `query_temperature`,
            `qk_norm_after_rope`) may be passed only with the module's values;
            `rotary_embedding` not at all.

    Returns:
        A built `keras_mha.MultiHeadAttention` taking `(B, T, hidden_size)`
        and returning `(B, T, hidden_size)`, or the output projection's
        size where it differs (Zamba 2's: `output_shape`).

    Raises:
        ValueError: naming the module's class and what is missing: a
            structure or feature the layer does not compute, a config
            that contradicts the weights, a rope setting the layer cannot
            represent, a module that is not causal, or an argument the
            module fixes to another value.
    """
    name = type(module).__qualname__
    config, family = _config_and_family(module, config, name)
    if hasattr(module, "kv_a_proj_with_mqa"):
        # Deferred: latent attention is not needed by the other families.
        from keras_mha import hf_latent

        return hf_latent.from_transformers(module, name, family, config,
                                           **layer_kwargs)
    head_layout = _head_layout(module, config, name)
    structure = hf_structure.read(
        module, name, head_layout, family,
        values_are_keys=bool(getattr(config, "attention_k_eq_v", False)))
    value_dim = _check_shapes(structure, name, head_layout)
    structure = _in_rotation_order(structure, module, config, family,
                                   head_layout)
    hidden_size = structure.query.weight.shape[1]
    fixed = _fixed_arguments(module, config, name, family, structure,
                             head_layout, value_dim)
    output_size = structure.output.weight.shape[0]
    if output_size != hidden_size:
        fixed["output_shape"] = (output_size,)
    elif host.output_shape(layer_kwargs.get("output_shape")) == (hidden_size,):
        del layer_kwargs["output_shape"]  # the default: the input's size
    layer = hf_structure.built_layer(MultiHeadAttention, fixed, layer_kwargs,
                                     name, config, hidden_size)
    _set_weights(layer, structure, head_layout, value_dim, fixed["use_bias"])
    return layer


def _config_and_family(module, config, name):
    """`(config, family)`: the module's config (else the one passed) and
    its `hf_families.Family`."""
    config = getattr(module, "config", None) or config
    if config is None:
        raise ValueError(
            f"`from_torch` reads a `transformers` module's heads and rope "
            f"settings from its `config`, and the {name} keeps none: pass "
            "the model's, `from_torch(module, config=model.config)`. "
            "Received: module.config=None, config=None"
        )
    return config, hf_families.family(config)


def _in_rotation_order(structure, module, config, family, head_layout):
    """`structure` with each query and key head's features in the order
    our rotary embedding rotates them (`hf_structure.reordered`), where
    the family's differs."""
    head_dim = head_layout[2]
    order = rope_parameters.proportional_order(
        config, head_dim, _layer_type(module, config))
    if family.reversed_rotation:  # see `hf_families.Family`
        order = np.roll(np.arange(head_dim), head_dim // 2)
    if order is not None:  # Gemma 4, LFM3 (see `proportional_order`)
        structure = hf_structure.reordered(structure, order, head_layout)
    return structure


def _fixed_arguments(module, config, name, family, structure, head_layout,
                     value_dim):
    """The `MultiHeadAttention` arguments the module fixes: its heads,
    weights' structure, rotary embedding, norms, window and scale."""
    num_heads, num_kv_heads, head_dim = head_layout
    projections = (structure.query, structure.key, structure.value,
                   structure.output, structure.gate)
    use_bias = any(dense is not None and dense.bias is not None
                   for dense in projections)
    soft_cap = getattr(module, "attn_logit_softcapping", None)
    uses_rope = _uses_rope(module, family, config)
    qk_norm, qk_norm_scope, qk_norm_epsilon = _qk_norm(structure, name, head_dim)
    query_temperature = None
    if (family.temperature and not uses_rope
            and getattr(config, "attn_temperature_tuning", False)):
        query_temperature = (float(config.floor_scale),
                             float(config.attn_scale))
    if "attention_scaling" in hf_structure.forward_parameters(module) and (
            not uses_rope):
        query_temperature = hf_structure.position_scale(
            module, name, _layer_type(module, config))
    rotary_embedding = None
    if uses_rope:
        rotary_embedding = _rotary_embedding(module, config, name, family,
                                             head_dim)
    scale = getattr(module, "scaling", family.scale)
    window = _sliding_window(module, name, family, config)
    _check_window_both_ways(module, name, config, window)
    return dict(
        num_heads=num_heads,
        key_dim=head_dim,
        value_dim=value_dim,
        num_key_value_heads=num_kv_heads,
        use_bias=use_bias,
        use_gate=structure.gate is not None,
        gate_activation=(family.separate_gate
                         if isinstance(family.separate_gate, str)
                         else "sigmoid"),
        output_shape=None,
        rotary_embedding=rotary_embedding,
        scale=float(head_dim**-0.5 if scale is None else scale)
        * structure.logit_factor,
        attn_logits_soft_cap=None if soft_cap is None else float(soft_cap),
        use_sinks=structure.sinks is not None,
        use_alibi=_uses_alibi(module, name, family, config),
        sliding_window=window,
        qk_norm=qk_norm,
        qk_norm_scope=qk_norm_scope,
        qk_norm_epsilon=qk_norm_epsilon,
        attention_chunk_size=_attention_chunk_size(module, config),
        query_temperature=query_temperature,
        qk_norm_after_rope=qk_norm is not None and family.norms_after_rope,
        value_norm=structure.value_norm is not None,
        input_norm=_keras_norm(structure.input_norm),
        output_norm=_keras_norm(structure.output_norm),
        qkv_clip=_qkv_clip(module, config),
        shared_key_value=structure.shared_key_value,
        key_value_source=(_key_value_source(module, config)
                          if structure.shared_key_value else None),
        use_query_scale=structure.query_scale is not None,
        **({} if structure.differential is None else dict(
            differential=structure.differential.lambda_init,
            differential_epsilon=structure.differential.epsilon)),
    )


def _key_value_source(module, config):
    """The `layer_idx` of the layer whose keys and values a shared module
    reads: the last earlier one of its layer type that the config marks
    `"store"` (`kv_sharing_modes`, Gemma 3n and Gemma 4); `None` where the
    config does not say."""
    modes = getattr(config, "kv_sharing_modes", None)
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if modes is None or types is None or index is None:
        return None
    sources = [j for j in range(index)
               if modes[j] == "store" and types[j] == types[index]]
    return sources[-1] if sources else None


def _keras_norm(norm):
    """The Keras layer of a probed `hf_norms.Norm`, or `None`."""
    return None if norm is None else norm.keras_layer()


def _rotary_embedding(module, config, name, family, head_dim):
    """The `RotaryEmbedding` of a module whose layer rotates."""
    # GPT-J rotates the first `module.rotary_dim` features, with the
    # frequencies of a head of that size.
    rotary_dim = getattr(module, "rotary_dim", None)
    return rope_parameters.rotary_embedding(
        config, rotary_dim if isinstance(rotary_dim, int) else head_dim,
        name, _layer_type(module, config), family.partial_rotary,
        interleaved=family.interleaved,
    )


def _set_weights(layer, structure, head_layout, value_dim, use_bias):
    """Sets the layer's projections, sinks and norms to the module's."""
    num_heads, num_kv_heads, head_dim = head_layout
    hidden_size = structure.query.weight.shape[1]

    def weights(dense, kernel_shape, bias_shape):
        # torch: y = x @ W.T + b; head n is features n*H:(n+1)*H.
        kernel = dense.weight.T.reshape(kernel_shape)
        if not use_bias:
            return [kernel]
        if dense.bias is None:
            return [kernel, np.zeros(bias_shape, kernel.dtype)]
        return [kernel, dense.bias.reshape(bias_shape)]

    # Kernels `(E, heads, size)` and biases `(heads, size)`, in Keras's
    # order of the projections.
    projection_heads = {
        "query": (num_heads, head_dim),
        "key": (num_kv_heads, head_dim),
        "gate": (num_heads, value_dim),
        "value": (num_kv_heads, value_dim),
    }
    for projection, shape in projection_heads.items():
        dense = getattr(structure, projection)
        if dense is not None:  # a gate only where the module has one
            getattr(layer, f"_{projection}_dense").set_weights(
                weights(dense, (hidden_size, *shape), shape)
            )
    output_size = structure.output.weight.shape[0]
    layer.output_dense.set_weights(
        weights(structure.output, (_merged_heads(structure, num_heads),
                                   value_dim, output_size), (output_size,))
    )  # (N, V, E'), (E',); `N/2` pairs of differential attention
    hf_differential.set_weights(layer, structure.differential)
    if structure.query_scale is not None:  # (N·H,) -> (N, H)
        layer.query_scale.assign(
            structure.query_scale.reshape(num_heads, head_dim))
    if structure.sinks is not None:
        layer.sinks.assign(structure.sinks)  # (N,)
    for norm, probed, features in (
            (layer.input_norm, structure.input_norm, hidden_size),
            (layer.output_norm, structure.output_norm, num_heads * value_dim)):
        if norm is not None:
            norm.set_weights(probed.weights(features))
    for norm, probed in ((layer.query_norm, structure.query_norm),
                         (layer.key_norm, structure.key_norm)):
        if norm is not None:  # "rms" or "layer"
            norm.scale.assign(probed.scale)
            if probed.bias is not None:
                norm.bias.assign(probed.bias)


def _head_layout(module, config, name):
    """`(N, K, H)`: the module's own counts where it keeps them (a decoder
    of an encoder-decoder model has its own), else its config's."""

    def integer(owner, *names):
        for attribute in names:
            value = getattr(owner, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    num_heads = (integer(module, "num_heads", "num_attention_heads")
                 or integer(config, "num_attention_heads"))
    if num_heads is None:
        raise ValueError(
            f"The {name} and its config give no number of heads "
            "(`num_heads`, `config.num_attention_heads`): it is not "
            "multi-head attention that `from_torch` reads. Received: "
            f"config of type {type(config).__name__}"
        )
    groups = integer(module, "num_key_value_groups")
    num_kv_heads = integer(module, "num_key_value_heads", "num_kv_heads")
    if num_kv_heads is None and groups:
        num_kv_heads = num_heads // groups
    if num_kv_heads is None:
        num_kv_heads = integer(config, "num_key_value_heads")
    if num_kv_heads is None:
        num_kv_heads = 1 if getattr(config, "multi_query", False) else num_heads
    head_dim = (integer(module, "head_dim") or integer(config, "head_dim")
                or int(config.hidden_size) // num_heads)
    return num_heads, num_kv_heads, head_dim


def _check_shapes(structure, name, head_layout):
    """The value head size `V`, once the weights agree with `(N, K, H)`."""
    num_heads, num_kv_heads, head_dim = head_layout
    hidden_size = structure.query.weight.shape[1]
    merged = _merged_heads(structure, num_heads)
    value_rows = num_kv_heads * (structure.output.weight.shape[1] // merged)
    if structure.value is not None:  # else an earlier layer's (shared)
        value_rows = structure.value.weight.shape[0]
    value_dim = value_rows // num_kv_heads
    want = {
        "query": (num_heads * head_dim, hidden_size),
        "key": (num_kv_heads * head_dim, hidden_size),
        "value": (num_kv_heads * value_dim, hidden_size),
        # Zamba 2's output is narrower than its input (`output_shape`).
        "output": (structure.output.weight.shape[0], merged * value_dim),
    }
    for projection, shape in want.items():
        if getattr(structure, projection) is None:
            continue
        got = getattr(structure, projection).weight.shape
        if tuple(got) != shape or value_rows % num_kv_heads:
            raise ValueError(
                f"The {name}'s {projection} projection has weights of shape "
                f"{tuple(got)}, and its config's heads (N={num_heads}, "
                f"K={num_kv_heads}, H={head_dim}) need {shape}. Received: "
                f"{projection} weight shape {tuple(got)}"
            )
    return value_dim


def _merged_heads(structure, num_heads):
    """The heads the output projection takes: `N`, or the `N/2` pairs of
    differential attention."""
    return num_heads // 2 if structure.differential else num_heads


def _qkv_clip(module, config):
    """DBRX's and MPT's `clip_qkv`: the bound of the projected queries,
    keys and values, or `None`."""
    clip = getattr(module, "clip_qkv", None)
    for owner in (config, getattr(config, "attn_config", None)):
        if clip is None and owner is not None:
            clip = getattr(owner, "clip_qkv", None)
    return None if clip is None else float(clip)


def _check_window_both_ways(module, name, config, window):
    """A module that attends both ways (`is_causal=False`: an encoder's, a
    cross-attention, XLM's without `config.causal`) imports as it is, and
    its caller leaves `use_causal_mask` off; with a sliding window (Gemma 3
    with `use_bidirectional_attention`) its model's mask is one the
    layer's window does not give."""
    inner = getattr(module, "self", module)  # a BERT-style block
    causal = getattr(module, "is_causal", getattr(inner, "is_causal", None))
    if causal is None:
        causal = getattr(config, "causal", True)
    if window is not None and not causal:
        raise ValueError(
            f"The {name} attends both ways (`is_causal=False`) within a "
            "sliding window, and the layer's window of a call without "
            "`use_causal_mask` is another. Received: "
            f"sliding_window={window}, use_bidirectional_attention="
            f"{getattr(config, 'use_bidirectional_attention', None)!r}"
        )


def _qk_norm(structure, name, head_dim):
    """`(qk_norm, qk_norm_scope, qk_norm_epsilon)` of the module's layer.

    Every norm read is `x / sqrt(mean(x²) + eps)` over a head (or the whole
    projection) times its scale, or a LayerNorm (Persimmon); transformers
    normalizes before RoPE except Llama 4, whose weightless norm comes
    after it: a rotation keeps the mean square, so the order does not
    matter there. A value norm (Gemma 4) shares the epsilon.
    """
    query, key, value = (structure.query_norm, structure.key_norm,
                         structure.value_norm)
    epsilons = {n.epsilon for n in (query, key, value) if n is not None}
    if structure.shared_key_value:  # the keys come normalized, or not
        key = query
    if len(epsilons) > 1 or (query is None) != (key is None) or (
            query is not None and ((query.scale is None) != (key.scale is None)
                                   or (query.bias is None) != (key.bias is None))):
        raise ValueError(
            f"The {name}'s query, key and value norms differ (epsilon or "
            "weights), and the layer has one `qk_norm` and one "
            f"`qk_norm_epsilon`. Received: epsilons {sorted(epsilons)}"
        )
    epsilon = epsilons.pop() if epsilons else 1e-6
    if query is None:
        return None, "head", epsilon
    if query.scale is None:
        return "l2", "head", epsilon
    scope = "head" if query.scale.shape[0] == head_dim else "projection"
    return "rms" if query.bias is None else "layer", scope, epsilon


def _attention_chunk_size(module, config):
    """`C` of a chunked layer (`"chunked_attention"`: Llama 4), or `None`."""
    if _layer_type(module, config) != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def _uses_rope(module, family, config):
    """Whether the module's layer rotates its queries and keys."""
    if family.rope_layers == "no_rope_layers":
        # A true entry means the layer *has* rope, as in the modules.
        return bool(config.no_rope_layers[module.layer_idx])
    if family.rope_layers == "every":
        return True
    if family.rope_layers == "sliding":
        return _sliding_window(module, type(module).__qualname__,
                               family, config) is not None
    # A model may pass `None` instead (NoPE by its config: GraniteMoeHybrid
    # with `position_embedding_type=None`).
    if getattr(config, "position_embedding_type", "rope") not in ("rope",):
        return False
    if getattr(config, "use_mem_rope", None) is False:  # Zamba 2's NoPE
        return False
    # RecurrentGemma's module holds its rotary embedding and applies it.
    return ("position_embeddings" in hf_structure.forward_parameters(module)
            or hasattr(module, "rotary_emb"))


def _uses_alibi(module, name, family, config):
    """Whether the model adds ALiBi's biases to the module's logits: the
    family's row says so; a forward that takes `alibi`, or a config that
    asks for it (`config.alibi`: Falcon's model adds its biases divided by
    `sqrt(H)` to the mask), is refused otherwise, since how the biases are
    made is the family's code."""
    if family.alibi:
        return True
    if getattr(config, "alibi", False) is True:
        raise ValueError(
            f"The {name}'s model adds ALiBi biases of its own making to the "
            "mask (`config.alibi`), which `from_torch` does not read for "
            f"its family. Received: model_type={config.model_type!r}, "
            "alibi=True"
        )
    if "alibi" in hf_structure.forward_parameters(module):
        raise ValueError(
            f"The {name}'s forward takes ALiBi biases whose slopes "
            "`from_torch` does not know for its family. Received: "
            f"model_type={getattr(module, 'config', None) and module.config.model_type!r}"
        )
    return False


def _layer_type(module, config):
    """The module's entry of `config.layer_types`, or `None`."""
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if layer_types is None or index is None:
        return None
    return layer_types[index]


def _sliding_window(module, name, family, config):
    """`W` (our causal `sliding_window`) of the module's layer, or `None`."""
    if family.window is None:
        return None
    if family.window == "attention_type":
        local = getattr(module, "attention_type", None) == "local"
        return int(config.window_size) if local else None
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None and (family.window == "layer_types"
                                or family.rope_layers == "sliding"):
        raise ValueError(
            f"The {name}'s family places its windows (and rotary "
            "embeddings) by `config.layer_types`, and its config has none. "
            f"Received: model_type={getattr(config, 'model_type', None)!r}, "
            "layer_types=None"
        )
    if family.window == "layer_types" or (family.window == "auto"
                                          and layer_types is not None):
        layer_type = _layer_type(module, config)
        window = window if layer_type == "sliding_attention" else None
        # The model masks by the config; the module's copy (which
        # transformers passes to flash attention) must agree.
        if family.window == "auto" and getattr(
                module, "sliding_window", window) != window:
            raise ValueError(
                f"The {name}'s `sliding_window` disagrees with its config's "
                f"for layer {module.layer_idx} ({layer_type!r}). Received: "
                f"module.sliding_window={module.sliding_window!r}, "
                f"config.sliding_window={config.sliding_window!r}"
            )
    return None if window is None else int(window)
