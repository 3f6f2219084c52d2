"""Weight import: Hugging Face `transformers` attention modules -> our layer.

`keras_mha.from_torch` sends the modules named in `FAMILIES` here. Nothing
here imports `transformers`: a module is recognised by its class's module
path and name, and only its attributes, weights and `config` are read, so
the library never needs `transformers` installed.

Only the attention module is converted. Its rotary embedding lives in the
model (`LlamaRotaryEmbedding(config)`), and so does its mask (built from
`config.layer_types` and `config.sliding_window`); both are read back from
the config into the layer's `rotary_embedding` (`rope_parameters.py`) and
`sliding_window`.
"""

import dataclasses

import numpy as np

from keras_mha import host
from keras_mha import rope_parameters
from keras_mha.layer import MultiHeadAttention


@dataclasses.dataclass(frozen=True)
class Family:
    """What differs between the attention classes converted here; a new
    family is an entry of `FAMILIES` (and a reader for a new field).

    Attributes:
        window: where the model takes the layer's sliding window from:
            `None` (no window: Llama), `"config"` (`config.sliding_window`
            for every layer: Mistral, which ignores `layer_types`) or
            `"layer_types"` (`config.sliding_window` for the layers that
            `config.layer_types` marks `"sliding_attention"`).
        partial_rotary: whether the model rotates only
            `int(head_dim * partial_rotary_factor)` features of a head (see
            `rope_parameters.rotary_embedding`).
        rope_layers: which layers rotate: `None` (every layer),
            `"no_rope_layers"` (those where `config.no_rope_layers[i]` is
            true: SmolLM3, Llama 4) or `"sliding"` (those with a sliding
            window: Cohere2).
        interleaved: whether the model rotates the pairs
            `(x_{2i}, x_{2i+1})` (Cohere2) rather than `(x_i, x_{i+d/2})`.
        fused_qkv: whether the query, key and value projections are one
            `qkv_proj`, in that order (Phi-3).
        qk_norm: the module's query/key norms: `None`; `"head"` (RMSNorms
            `q_norm` and `k_norm` over each head, one `(H,)` weight each:
            Qwen3, Gemma 3); `"projection"` (over the whole projection,
            `(N·H,)` and `(K·H,)`: OLMo 2); `"weightless"` (Llama 4's
            `qk_norm`, present only on its rope layers).
        norm_offset: the norms multiply by `norm_offset + weight` (Gemma
            stores `w` for a scale of `1 + w`).
        chunks: whether `config.layer_types` marks chunked layers
            (`"chunked_attention"`, chunks of `config.attention_chunk_size`:
            Llama 4).
        temperature: whether the NoPE layers scale their queries by
            position when `config.attn_temperature_tuning` (Llama 4).
        latent: whether the module is multi-head latent attention
            (DeepSeek V3), imported as `MultiHeadLatentAttention`.
    """

    window: str = None
    partial_rotary: bool = False
    rope_layers: str = None
    interleaved: bool = False
    fused_qkv: bool = False
    qk_norm: str = None
    norm_offset: float = 0.0
    chunks: bool = False
    temperature: bool = False
    latent: bool = False


# (module path, class) -> its family.
FAMILIES = {
    ("transformers.models.llama.modeling_llama", "LlamaAttention"): Family(),
    ("transformers.models.mistral.modeling_mistral", "MistralAttention"):
        Family(window="config"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention"):
        Family(window="layer_types"),
    ("transformers.models.gemma2.modeling_gemma2", "Gemma2Attention"):
        Family(window="layer_types"),
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssAttention"):
        Family(window="layer_types"),
    ("transformers.models.phi3.modeling_phi3", "Phi3Attention"):
        Family(window="config", partial_rotary=True, fused_qkv=True),
    ("transformers.models.smollm3.modeling_smollm3", "SmolLM3Attention"):
        Family(window="layer_types", rope_layers="no_rope_layers"),
    ("transformers.models.cohere2.modeling_cohere2", "Cohere2Attention"):
        Family(window="layer_types", rope_layers="sliding", interleaved=True),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention"):
        Family(window="layer_types", qk_norm="head"),
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3Attention"):
        Family(window="layer_types", qk_norm="head", norm_offset=1.0),
    ("transformers.models.olmo2.modeling_olmo2", "Olmo2Attention"):
        Family(qk_norm="projection"),
    ("transformers.models.llama4.modeling_llama4", "Llama4TextAttention"):
        Family(rope_layers="no_rope_layers", interleaved=True,
               qk_norm="weightless", chunks=True, temperature=True),
    ("transformers.models.deepseek_v3.modeling_deepseek_v3",
     "DeepseekV3Attention"): Family(latent=True),
}


def _family(module):
    cls = type(module)
    return FAMILIES.get((cls.__module__, cls.__qualname__))


def is_transformers_attention(obj):
    """Whether `obj` is one of the `transformers` modules converted here.

    The class itself, not a subclass: a subclass may compute something else.
    """
    return _family(obj) is not None


def from_transformers(module, **layer_kwargs):
    """Builds a `MultiHeadAttention` from a `transformers` attention module.

    Supported: `LlamaAttention`, `MistralAttention`, `Qwen2Attention`,
    `Gemma2Attention`, `GptOssAttention`, `Phi3Attention`,
    `SmolLM3Attention`, `Cohere2Attention`, `Qwen3Attention`,
    `Gemma3Attention`, `Olmo2Attention` and `Llama4TextAttention` (the
    classes themselves, not subclasses). Read from the module and its
    `config`, for the module's `layer_idx`, as below. `DeepseekV3Attention`
    gives a `MultiHeadLatentAttention` instead (`_latent_from_transformers`
    says what is read):

    - heads: `config.num_attention_heads`, `config.num_key_value_heads` and
      `module.head_dim` (`config.head_dim`, or `hidden_size // heads`).
    - weights: `q_proj`, `k_proj`, `v_proj` and `o_proj`, with their biases
      (Phi-3: `qkv_proj`, split into queries, keys and values). If any
      projection has a bias, all four get one, zero where the module has
      none (Qwen2's `o_proj`): the same function.
    - rotary embedding: `config.rope_parameters` (transformers 5, one
      dict or one per layer type) or `config.rope_theta` and
      `config.rope_scaling` (older configs), rope types `"default"`,
      `"linear"`, `"llama3"`, `"yarn"`, `"dynamic"` and `"longrope"`, with
      the parameters and defaults of transformers' `ROPE_INIT_FUNCTIONS`
      (see `keras_mha.rope_parameters`). Phi-3 rotates the first
      `int(head_dim * partial_rotary_factor)` features of a head; the
      others rotate every feature, whatever `partial_rotary_factor` says,
      and so does the layer. Cohere2 rotates interleaved pairs
      (`interleaved=True`). `"dynamic"` and `"longrope"` depend on the
      call's largest position, as in the model; see `RotaryEmbedding` for
      what that means for a cache.
    - NoPE layers (`rotary_embedding=None`): SmolLM3's layers where
      `config.no_rope_layers[layer_idx]` is 0; Cohere2's full-attention
      layers (it rotates only where it slides); Llama 4's layers where
      `config.no_rope_layers[layer_idx]` is 0. Llama 4 rotates interleaved
      pairs too.
    - query/key norms: Qwen3's and Gemma 3's `q_norm` and `k_norm` (RMS
      over each head) as `qk_norm="rms"`, OLMo 2's (over the whole
      projection) with `qk_norm_scope="projection"`, their weights as the
      scales (Gemma 3 stores `w` for `1 + w`: converted) and their epsilon
      as `qk_norm_epsilon`; Llama 4's weightless `qk_norm` (its rope layers,
      with `config.use_qk_norm`) as `qk_norm="l2"`.
    - Llama 4's chunks: `config.attention_chunk_size` for the layers that
      `config.layer_types` marks `"chunked_attention"`; its
      `attn_temperature_tuning` as `query_temperature=(floor_scale,
      attn_scale)` on its NoPE layers, at the same positions (the cache's
      length plus `t`) while decoding.
    - sliding window: Mistral's and Phi-3's `config.sliding_window` for
      every layer; for the others, `config.sliding_window` where
      `config.layer_types[layer_idx] == "sliding_attention"`, else none.
      Hugging Face's window `W` (`kv_idx > q_idx - W`) is our causal
      `sliding_window=W`.
    - `module.scaling` (Gemma 2 and 3: `query_pre_attn_scalar ** -0.5`) as
      `scale`; Gemma's `attn_logit_softcapping` as
      `attn_logits_soft_cap`; gpt-oss's `module.sinks` as the `sinks`
      weight (`use_sinks=True`); `config.attention_dropout` as `dropout`.

    The layer computes what the module computes, given the model's
    position embeddings for positions `0..T-1` and its causal mask, when
    called as `layer(x, x, use_causal_mask=True)`.

    Args:
        module: one of the modules above.
        **layer_kwargs: more `MultiHeadAttention` arguments (`name`, `dtype`,
            `flash_attention`, `dropout`, ...). Those the module fixes
            (`num_heads`, `key_dim`, `value_dim`, `num_key_value_heads`,
            `use_bias`, `use_gate`, `output_shape`, `rotary_embedding`,
            `scale`, `attn_logits_soft_cap`, `use_sinks`, `use_alibi`,
            `sliding_window`, `qk_norm`, `qk_norm_scope`,
            `qk_norm_epsilon`, `attention_chunk_size`,
            `query_temperature`) may be passed only with the module's values;
            `rotary_embedding` not at all.

    Returns:
        A built `keras_mha.MultiHeadAttention` taking `(B, T, hidden_size)`
        and returning `(B, T, hidden_size)`.

    Raises:
        ValueError: for another module type, a rope setting the layer
            cannot represent (named), a module whose `sliding_window`
            disagrees with its config's, query and key norms with different
            epsilons, a module that is not causal, or an argument the
            module fixes to another value.
    """
    if not is_transformers_attention(module):
        supported = ", ".join(name for _, name in FAMILIES)
        raise ValueError(
            f"`from_transformers` takes one of {supported}. Received: module "
            f"of type {type(module).__module__}.{type(module).__qualname__}"
        )
    config = module.config
    name = type(module).__qualname__
    family = _family(module)
    if family.latent:
        return _latent_from_transformers(module, name, **layer_kwargs)
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(config.num_key_value_heads)
    head_dim = int(module.head_dim)
    hidden_size = int(config.hidden_size)
    projections = _projections(module, family, num_heads, num_kv_heads,
                               head_dim)
    use_bias = any(bias is not None for _, bias in projections.values())
    soft_cap = getattr(module, "attn_logit_softcapping", None)
    sinks = getattr(module, "sinks", None)
    sliding_window = _sliding_window(module, name, family)
    _check_causal(module, name)
    uses_rope = _uses_rope(module, family)
    qk_norm, qk_norm_scope, qk_norm_epsilon = _qk_norm(module, family)
    query_temperature = None
    if (family.temperature and not uses_rope
            and getattr(config, "attn_temperature_tuning", False)):
        query_temperature = (float(config.floor_scale),
                             float(config.attn_scale))
    rotary_embedding = None
    if uses_rope:
        rotary_embedding = rope_parameters.rotary_embedding(
            config, head_dim, name, _layer_type(module),
            family.partial_rotary, interleaved=family.interleaved,
        )
    fixed = dict(
        num_heads=num_heads,
        key_dim=head_dim,
        value_dim=head_dim,
        num_key_value_heads=num_kv_heads,
        use_bias=use_bias,
        use_gate=False,
        output_shape=None,
        rotary_embedding=rotary_embedding,
        scale=float(module.scaling),
        attn_logits_soft_cap=None if soft_cap is None else float(soft_cap),
        use_sinks=sinks is not None,
        use_alibi=False,
        sliding_window=sliding_window,
        qk_norm=qk_norm,
        qk_norm_scope=qk_norm_scope,
        qk_norm_epsilon=qk_norm_epsilon,
        attention_chunk_size=_attention_chunk_size(module, family),
        query_temperature=query_temperature,
    )
    if host.output_shape(layer_kwargs.get("output_shape")) == (hidden_size,):
        del layer_kwargs["output_shape"]  # the default: the input's size
    _check_fixed_kwargs(layer_kwargs, name, fixed)
    layer_kwargs.setdefault("dropout", float(config.attention_dropout))
    layer = MultiHeadAttention(**{**layer_kwargs, **fixed})
    layer.build((None, None, hidden_size), (None, None, hidden_size))

    def weights(projection, kernel_shape, bias_shape):
        # torch: y = x @ W.T + b; head n is features n*H:(n+1)*H.
        weight, bias = projections[projection]
        kernel = weight.T.reshape(kernel_shape)
        if not use_bias:
            return [kernel]
        if bias is None:
            return [kernel, np.zeros(bias_shape, kernel.dtype)]
        return [kernel, bias.reshape(bias_shape)]

    query_heads = (num_heads, head_dim)
    key_heads = (num_kv_heads, head_dim)
    layer.query_dense.set_weights(
        weights("query", (hidden_size, *query_heads), query_heads)
    )  # (E, N, H), (N, H)
    layer.key_dense.set_weights(
        weights("key", (hidden_size, *key_heads), key_heads)
    )  # (E, K, H), (K, H)
    layer.value_dense.set_weights(
        weights("value", (hidden_size, *key_heads), key_heads)
    )  # (E, K, V), (K, V)
    layer.output_dense.set_weights(
        weights("output", (*query_heads, hidden_size), (hidden_size,))
    )  # (N, V, E), (E,)
    if sinks is not None:
        layer.sinks.assign(host.to_numpy(sinks))  # (N,)
    if qk_norm == "rms":
        for ours, theirs in ((layer.query_norm, module.q_norm),
                             (layer.key_norm, module.k_norm)):
            ours.scale.assign(
                family.norm_offset + host.to_numpy(theirs.weight)
            )  # (H,), or (N·H,) and (K·H,)
    return layer


def _projections(module, family, num_heads, num_kv_heads, head_dim):
    """`{"query", "key", "value", "output"}` -> `(weight, bias)`, torch's
    `(out, in)` weight and `(out,)` bias (or `None`) as NumPy arrays."""

    def read(dense):
        bias = None if dense.bias is None else host.to_numpy(dense.bias)
        return host.to_numpy(dense.weight), bias

    if not family.fused_qkv:
        dense = [module.q_proj, module.k_proj, module.v_proj, module.o_proj]
        return dict(zip(("query", "key", "value", "output"),
                        map(read, dense)))
    # Phi-3: rows [queries (N·H), keys (K·H), values (K·H)] of `qkv_proj`.
    weight, bias = read(module.qkv_proj)
    stops = np.cumsum([num_heads, num_kv_heads]) * head_dim
    weights = np.split(weight, stops)
    biases = [None] * 3 if bias is None else np.split(bias, stops)
    return dict(
        query=(weights[0], biases[0]),
        key=(weights[1], biases[1]),
        value=(weights[2], biases[2]),
        output=read(module.o_proj),
    )


def _check_causal(module, name):
    """The layer is called causal; a module that is not (Gemma 3 with
    `use_bidirectional_attention`) has a model that masks otherwise."""
    if not getattr(module, "is_causal", True):
        raise ValueError(
            f"The {name} attends both ways (`is_causal=False`), and "
            "`from_torch` imports causal attention only. Received: "
            "use_bidirectional_attention="
            f"{getattr(module.config, 'use_bidirectional_attention', None)!r}"
        )


def _qk_norm(module, family):
    """`(qk_norm, qk_norm_scope, qk_norm_epsilon)` of the module's layer.

    All of them are `x / sqrt(mean(x²) + eps)` over a head (or the whole
    projection), in float32, then times the weight; transformers normalizes
    before RoPE except Llama 4, whose weightless norm comes after it: a
    rotation keeps the mean square, so the order does not matter.
    """
    if family.qk_norm is None:
        return None, "head", 1e-6
    if family.qk_norm == "weightless":
        norm = getattr(module, "qk_norm", None)  # rope layers only
        if norm is None:
            return None, "head", 1e-6
        return "l2", "head", float(norm.eps)
    epsilons = {_epsilon(module.q_norm), _epsilon(module.k_norm)}
    if len(epsilons) > 1:
        raise ValueError(
            f"The {type(module).__qualname__}'s query and key norms have "
            "different epsilons, and the layer has one `qk_norm_epsilon`. "
            f"Received: q_norm epsilon={_epsilon(module.q_norm)}, k_norm "
            f"epsilon={_epsilon(module.k_norm)}"
        )
    return "rms", family.qk_norm, epsilons.pop()


def _epsilon(norm):
    # Qwen3RMSNorm and Olmo2RMSNorm: `variance_epsilon`; Gemma3RMSNorm: `eps`.
    epsilon = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if epsilon is None else epsilon)


def _attention_chunk_size(module, family):
    """`C` of a chunked layer (Llama 4's `"chunked_attention"`), or `None`."""
    if not family.chunks or _layer_type(module) != "chunked_attention":
        return None
    return int(module.config.attention_chunk_size)


def _uses_rope(module, family):
    """Whether the module's layer rotates its queries and keys."""
    if family.rope_layers == "no_rope_layers":
        # A true entry means the layer *has* rope, as in the modules.
        return bool(module.config.no_rope_layers[module.layer_idx])
    if family.rope_layers == "sliding":
        return getattr(module, "sliding_window", None) is not None
    return True


def _layer_type(module):
    """The module's entry of `config.layer_types`, or `None`."""
    layer_types = getattr(module.config, "layer_types", None)
    return None if layer_types is None else layer_types[module.layer_idx]


def _sliding_window(module, name, family):
    """`W` (our causal `sliding_window`) of the module's layer, or `None`."""
    config = module.config
    source = family.window
    if source is None:
        return None
    window = getattr(config, "sliding_window", None)
    if source == "layer_types":
        layer_type = config.layer_types[module.layer_idx]
        window = window if layer_type == "sliding_attention" else None
        # The model masks by the config; the module's copy (which
        # transformers passes to flash attention) must agree.
        if getattr(module, "sliding_window", window) != window:
            raise ValueError(
                f"The {name}'s `sliding_window` disagrees with its config's "
                f"for layer {module.layer_idx} ({layer_type!r}). Received: "
                f"module.sliding_window={module.sliding_window!r}, "
                f"config.sliding_window={config.sliding_window!r}"
            )
    return None if window is None else int(window)


def _check_fixed_kwargs(layer_kwargs, name, fixed):
    for argument, value in fixed.items():
        if argument not in layer_kwargs:
            continue
        given = layer_kwargs[argument]
        if argument == "output_shape":
            given = host.output_shape(given)
        if argument == "rotary_embedding" or given != value:
            shown = (
                f"RotaryEmbedding(rope_type={value.rope_type!r}, "
                f"max_wavelength={value.max_wavelength})"
                if argument == "rotary_embedding"
                else repr(value)
            )
            raise ValueError(
                f"`{argument}` is fixed by the {name} module to {shown}. "
                f"Received: {argument}={layer_kwargs[argument]!r}"
            )


def _latent_from_transformers(module, name, **layer_kwargs):
    """`DeepseekV3Attention` -> `MultiHeadLatentAttention` (see
    `from_transformers`).

    Read: the heads and sizes (`num_attention_heads`, `q_lora_rank`, which
    is `None` for DeepSeek V2-Lite's direct query, `kv_lora_rank`,
    `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`), the weights of
    `q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj`),
    `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj` and `o_proj`, the
    norms' epsilon, `module.scaling` (with YaRN's `mscale_all_dim`
    squared in it) as `scale`, the rope parameters for `qk_rope_head_dim`
    features (YaRN's `mscale` and `mscale_all_dim` as its
    `attention_factor`), and `rope_interleave` as `interleaved=True`: the
    module turns the pairs `(2i, 2i + 1)` and lays the result out as two
    halves, the same rotation in another order, which a query's product
    with a key does not see. With `attention_bias`, the projections of the
    input and the output have biases (zeros where the module has none: its
    `q_proj`).
    """
    # Deferred: `keras_mha.latent` is not needed by the other families.
    from keras_mha.latent import MultiHeadLatentAttention

    config = module.config
    num_heads = int(config.num_attention_heads)
    hidden_size = int(config.hidden_size)
    q_rank = module.q_lora_rank
    q_rank = None if q_rank is None else int(q_rank)
    rank = int(module.kv_lora_rank)
    nope, rope = int(module.qk_nope_head_dim), int(module.qk_rope_head_dim)
    v_dim = int(module.v_head_dim)
    use_bias = bool(getattr(config, "attention_bias", False))
    rotary = rope_parameters.rotary_embedding(
        config, rope, name,
        interleaved=bool(getattr(config, "rope_interleave", False)),
    )
    fixed = dict(
        num_heads=num_heads,
        kv_lora_rank=rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        q_lora_rank=q_rank,
        rotary_embedding=rotary,
        scale=float(module.scaling),
        use_bias=use_bias,
        norm_epsilon=float(module.kv_a_layernorm.variance_epsilon),
        sliding_window=None,
    )
    _check_fixed_kwargs(layer_kwargs, name, fixed)
    layer_kwargs.setdefault("dropout", float(config.attention_dropout))
    layer = MultiHeadLatentAttention(**{**layer_kwargs, **fixed})
    shape = (None, None, hidden_size)
    layer.build(shape, shape)

    def weights(dense, kernel_shape, bias_shape=None):
        # torch: y = x @ W.T + b.
        kernel = host.to_numpy(dense.weight).T.reshape(kernel_shape)
        if bias_shape is None or not use_bias:
            return [kernel]
        if dense.bias is None:
            return [kernel, np.zeros(bias_shape, kernel.dtype)]
        return [kernel, host.to_numpy(dense.bias).reshape(bias_shape)]

    query_heads = (num_heads, nope + rope)
    if q_rank is None:
        layer._query_dense.set_weights(
            weights(module.q_proj, (hidden_size, *query_heads), query_heads)
        )  # (E, N, Hn + P)
    else:
        layer._query_a.set_weights(
            weights(module.q_a_proj, (hidden_size, q_rank), (q_rank,))
        )  # (E, Rq)
        layer._query_norm.set_weights(
            [host.to_numpy(module.q_a_layernorm.weight)]
        )
        layer._query_b.set_weights(
            weights(module.q_b_proj, (q_rank, *query_heads))
        )  # (Rq, N, Hn + P)
    layer._kv_a.set_weights(weights(
        module.kv_a_proj_with_mqa, (hidden_size, rank + rope), (rank + rope,)
    ))  # (E, R + P)
    layer._kv_norm.set_weights([host.to_numpy(module.kv_a_layernorm.weight)])
    layer._kv_b.set_weights(
        weights(module.kv_b_proj, (rank, num_heads, nope + v_dim))
    )  # (R, N, Hn + V)
    layer._output_dense.set_weights(weights(
        module.o_proj, (num_heads, v_dim, hidden_size), (hidden_size,)
    ))  # (N, V, E)
    return layer
