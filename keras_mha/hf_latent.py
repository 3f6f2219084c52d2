"""Weight import: `transformers`' multi-head latent attention ->
`keras_mha.MultiHeadLatentAttention`.

DeepSeek V2 and V3, and the families built on them: a module with
`kv_a_proj_with_mqa`; `huggingface.from_transformers` sends such modules
here. Nothing here imports `transformers`.
"""

import numpy as np

from keras_mha import hf_structure
from keras_mha import host
from keras_mha import rope_parameters
from keras_mha.latent import MultiHeadLatentAttention


def from_transformers(module, name, family, config, **layer_kwargs):
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
    `q_proj`). A `g_proj` of one output per head, in a family whose gate is
    a sigmoid (Ling 3), is `use_gate=True`, its rows repeated over each
    head's features.
    """
    children = dict(module.named_children())
    gate = next((g for g in hf_structure.GATES if g in children), None)
    hf_structure.check_all_read(module, children, {
        "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj",
        "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj",
        *([] if gate is None else [gate]),
    }, name)
    num_heads = int(config.num_attention_heads)
    if gate is not None:
        _check_gate(children[gate], gate, name, family, num_heads)
    hidden_size = int(config.hidden_size)
    q_rank = module.q_lora_rank
    q_rank = None if q_rank is None else int(q_rank)
    # The module's sizes, which the layer's arguments name as it does.
    sizes = {
        size: int(getattr(module, size))
        for size in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim")
    }
    rank, nope, rope, v_dim = sizes.values()
    use_bias = bool(getattr(config, "attention_bias", False))
    rotary = None  # NoPE (Kimi Linear): the rope part of a key unturned
    if "position_embeddings" in hf_structure.forward_parameters(module):
        rotary = rope_parameters.rotary_embedding(
            config, rope, name,
            interleaved=family.interleaved
            or bool(getattr(config, "rope_interleave", False)),
        )
    fixed = dict(
        num_heads=num_heads,
        **sizes,
        q_lora_rank=q_rank,
        rotary_embedding=rotary,
        scale=float(module.scaling),
        use_bias=use_bias,
        norm_epsilon=float(module.kv_a_layernorm.variance_epsilon),
        sliding_window=None,
        use_gate=gate is not None,
    )
    layer = hf_structure.built_layer(MultiHeadLatentAttention, fixed,
                                     layer_kwargs, name, config, hidden_size)

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
        layer.sublayer("query").set_weights(
            weights(module.q_proj, (hidden_size, *query_heads), query_heads)
        )  # (E, N, Hn + P)
    else:
        layer.sublayer("query_a").set_weights(
            weights(module.q_a_proj, (hidden_size, q_rank), (q_rank,))
        )  # (E, Rq)
        layer.sublayer("query_norm").set_weights(
            [host.to_numpy(module.q_a_layernorm.weight)]
        )
        layer.sublayer("query_b").set_weights(
            weights(module.q_b_proj, (q_rank, *query_heads))
        )  # (Rq, N, Hn + P)
    layer.sublayer("kv_a").set_weights(weights(
        module.kv_a_proj_with_mqa, (hidden_size, rank + rope), (rank + rope,)
    ))  # (E, R + P)
    layer.sublayer("kv_norm").set_weights(
        [host.to_numpy(module.kv_a_layernorm.weight)])
    layer.sublayer("kv_b").set_weights(
        weights(module.kv_b_proj, (rank, num_heads, nope + v_dim))
    )  # (R, N, Hn + V)
    if gate is not None:  # one output per head: its rows repeat
        kernel = np.repeat(host.to_numpy(children[gate].weight), v_dim,
                           axis=0).T.reshape(hidden_size, num_heads, v_dim)
        layer.sublayer("gate").set_weights(
            [kernel, np.zeros((num_heads, v_dim), kernel.dtype)]
            if use_bias else [kernel])
    layer.sublayer("output").set_weights(weights(
        module.o_proj, (num_heads, v_dim, hidden_size), (hidden_size,)
    ))  # (N, V, E)
    return layer


def _check_gate(gate, attribute, name, family, num_heads):
    """The module's output gate must be one the layer's `use_gate` reads:
    one output per head without a bias (Ling 3's `g_proj`), in a family
    whose gate is a sigmoid; else it is refused by name."""
    if family.separate_gate is not True or getattr(gate, "bias", None) \
            is not None or tuple(gate.weight.shape)[:1] != (num_heads,):
        raise ValueError(
            f"The {name} has an output gate `{attribute}` that "
            "`MultiHeadLatentAttention` reads only as a sigmoid of one "
            "output per head without a bias, in a family whose gate is "
            f"known. Received: {attribute}={gate}")
