"""Every causal-LM family of the installed `transformers`, built tiny and
run whole, each attention module's input and output captured by forward
hooks: the oracle of `tests/test_zoo.py` and of docs/importing.md's table.

A family's tiny model is its `*ForCausalLM` (for a family that wraps a
text model, the text model's) from its config's defaults with small sizes:
hidden 64, 4 query heads of 16, 2 key/value heads where the config has
them, the fewest layers that hold one layer of each default type, windows
and chunks of 4 so that they bind in the 12 tokens run. Nothing is
downloaded. The model, not the test, builds the masks and rotary tables.
"""

import dataclasses
import inspect

import hf_models
import numpy as np

BATCH, LENGTH = 2, 12
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=32, vocab_size=64,
             num_hidden_layers=2)
SMALL = dict(sliding_window=4, attention_chunk_size=4)
# Sizes of the parts around the attention (feed-forward layers, experts,
# per-layer embeddings, linear-attention heads) that a family's defaults
# set large: at their defaults some tiny models hold hundreds of millions
# of parameters. Shrunk where the config has them.
AROUND = dict(
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
    shared_experts_intermediate_size=32, shared_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, ffn_dim=32, encoder_ffn_dim=32,
    decoder_ffn_dim=32, intermediate_size_mlp=32, dim_ff=32,
    first_dense_intermediate_size=32, mlp_only_intermediate_size=32,
    dense_intermediate_size=32, feed_forward_size=32,
    vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
    linear_key_head_dim=16, linear_value_head_dim=16,
)
# Expert counts, cut to this many (or to the experts each token takes).
EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts",
           "moe_num_experts")
TOP_K = ("num_experts_per_tok", "moe_topk", "top_k")
FEW_EXPERTS = 8
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# A BERT-style `*ForCausalLM` is a decoder only with `is_decoder=True`.
DECODER = dict(is_decoder=True)
# Families whose defaults need more than the sizes above to build tiny.
OVERRIDES = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]],
                    window_size=4),
    # Rotates int(0.334 · H) features, an even number at H = 24.
    "mimo_v2_flash": dict(head_dim=24),
    # Ergo's global layers scale their queries and keys.
    "ergo": dict(global_attention_scale=2.0),
    # LongCat-Flash's latent and expert sizes are its own parameters.
    "longcat_flash": dict(q_lora_rank=16, qk_head_dim=16, num_layers=1,
                          ffn_hidden_size=32, n_routed_experts=2,
                          zero_expert_num=1, expert_ffn_hidden_size=16,
                          moe_topk=1),
    # XLM's causal LM is causal only so configured.
    "xlm": dict(causal=True),
    "kolibri1_1": dict(index_num_heads=2),
    "cohere_compass_text": dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "dbrx": dict(attn_config={"rope_theta": 10000.0, "kv_n_heads": 2,
                              "clip_qkv": 2.0}),  # binds
    "deepseek_v2": dict(num_experts_per_tok=2, moe_intermediate_size=32),
    "plbart": dict(decoder_attention_heads=4, encoder_attention_heads=4),
    "whisper": dict(decoder_attention_heads=4, encoder_attention_heads=4),
    # Its expert counts default to none.
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1),
    # Gemma 3n's last layers read the keys and values of earlier ones (KV
    # sharing): ten layers, the last five shared, hold both kinds.
    "gemma3n": dict(num_hidden_layers=10, num_kv_shared_layers=5,
                    layer_types=(["sliding_attention"] * 4
                                 + ["full_attention"]) * 2),
    "gemma3n_text": dict(num_hidden_layers=10, num_kv_shared_layers=5,
                         layer_types=(["sliding_attention"] * 4
                                      + ["full_attention"]) * 2),
    # Gemma 4's too: four layers, the last two shared.
    "gemma4": dict(num_hidden_layers=4, num_kv_shared_layers=2,
                   layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma4_text": dict(num_hidden_layers=4, num_kv_shared_layers=2,
                        layer_types=["sliding_attention",
                                     "full_attention"] * 2),
    # MusicGen's input is a row per codebook: the batch's two rows are one
    # sequence's two codebooks.
    "musicgen": dict(num_codebooks=2),
    "musicgen_melody": dict(num_codebooks=2),
    # X-MOD's adapters are per language, one of which must be the default.
    "xmod": dict(default_language="en_XX"),
    # Zamba 2's one attention block comes after six Mamba layers.
    "zamba2": dict(num_hidden_layers=7, hybrid_layer_ids=[6],
                   layers_block_type=["linear_attention"] * 6 + ["hybrid"]),
    "dots3_note_text": dict(num_key_value_heads=4),
    "dots3_note": dict(num_key_value_heads=4),
    # Its audio and vision towers, at their defaults, are most of its
    # 870 million parameters.
    "phi4_multimodal": dict(
        audio_config=dict(hidden_size=32, intermediate_size=32, num_blocks=1,
                          num_attention_heads=2, ext_pw_out_channel=32,
                          depthwise_separable_out_channel=32,
                          nemo_conv_channels=32),
        vision_config=dict(hidden_size=32, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, crop_size=28),
    ),
}


# Families whose default config does not construct: what it needs. The
# Gemma 4 assistant's checks want no per-layer inputs, which its default
# text config has.
DEFAULTS = {
    "gemma4_assistant": dict(text_config=dict(
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One attention module's call inside a model: `module`, the model's
    `config`, its input `hidden_states` `(B, T, E)` and first output
    `output`, float32."""

    module: object
    config: object
    hidden_states: np.ndarray
    output: np.ndarray


def model_types():
    """The model types of `transformers`' causal-LM mapping."""
    from transformers.models.auto import modeling_auto

    return list(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _text_classes(model_type):
    """`(model class, config class)` of the family's causal LM, or of its
    text model where the family wraps one."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    model_class = getattr(transformers, names[model_type])
    config_class = model_class.config_class
    text = getattr(config_class(**DEFAULTS.get(model_type, {})),
                   "text_config", None)
    text_type = getattr(text, "model_type", None)
    if text is None or not text_type:
        return model_class, config_class
    text = type(text)
    if text_type in names:
        return getattr(transformers, names[text_type]), text
    return None, text  # the text model: `AutoModel`


def tiny_config(model_type):
    """`(model class or None, config)` of the family's tiny model."""
    model_class, config_class = _text_classes(model_type)
    parameters = inspect.signature(config_class.__init__).parameters
    aliases = getattr(config_class, "attribute_map", None) or {}
    default = config_class()
    kwargs = {}
    for name, value in {**SIZES, **TOKENS, **DECODER}.items():
        for key in (aliases.get(name, name), name):
            if key in parameters:
                kwargs[key] = value
                break
    layer_types = getattr(default, "layer_types", None)
    if layer_types:
        layers = max(2, max(layer_types.index(t) for t in set(layer_types))
                     + 1)
        kwargs[aliases.get("num_hidden_layers", "num_hidden_layers")] = layers
        if "layer_types" in parameters:
            kwargs["layer_types"] = list(layer_types[:layers])
    if "qk_rope_head_dim" in parameters:  # latent attention
        kwargs.update(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                      kv_lora_rank=16, num_key_value_heads=4)
        kwargs.pop("head_dim", None)
    if "rotary_dim" in parameters:  # GPT-J, CodeGen
        kwargs["rotary_dim"] = 8
    for name, value in {**SMALL, **AROUND}.items():
        if name in parameters and getattr(default, name, None) is not None:
            kwargs[name] = value
    kwargs.update(_few_experts(default, parameters))
    kwargs.update(OVERRIDES.get(model_type, {}))
    return model_class, config_class(**kwargs)


def _few_experts(default, parameters):
    """Expert counts cut to `FEW_EXPERTS`, or to the experts a token takes,
    or to two a group where routing picks groups, where those are more."""
    taken = [getattr(default, name, None) for name in TOP_K]
    groups = getattr(default, "n_group", None)
    taken.append(2 * groups if isinstance(groups, int) else None)
    least = max([FEW_EXPERTS] + [k for k in taken if isinstance(k, int)])
    return {name: least for name in EXPERTS
            if name in parameters
            and isinstance(getattr(default, name, None), int)
            and getattr(default, name) > least}


def build(model_type, seed=0, scale=0.25):
    """The family's tiny model, eager attention, in eval mode, its attention
    modules' parameters redrawn as `scale · N(0, 1)` so that the scores,
    and so the positions, matter."""
    import torch
    import transformers

    model_class, config = tiny_config(model_type)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    if model_class is None:
        model = transformers.AutoModel.from_config(config)
    else:
        model = model_class(config)
    model.eval()
    hf_models.redraw(attention_modules(model), scale)
    return model


def attention_modules(model):
    """The model's outermost attention modules (a class named
    `*Attention*`, not a decoder layer or block that holds one), in
    order."""
    found = []
    for name, module in model.named_modules():
        class_name = type(module).__name__
        if ("Attention" not in class_name
                or class_name.endswith(("Layer", "Block", "Norm"))):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return [module for _, module in found]


def run(model_type, seed=0):
    """Builds the family's tiny model and runs it on `(BATCH, LENGTH)`
    tokens: one `Call` per attention module that ran, in order."""
    import torch

    model = build(model_type, seed)
    calls = {}

    def hook(module, args, kwargs, output):
        if module in calls:
            return
        hidden = args[0] if args else kwargs.get("hidden_states")
        first = output[0] if isinstance(output, (tuple, list)) else output
        residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
        if "residual" in inspect.signature(module.forward).parameters:
            # BLOOM adds its block's residual inside the module: the
            # attention is the rest.
            first = first - residual
        if getattr(module, "dense_bias", None) is not None:
            # GPT-NeoX-Japanese returns its output bias apart, and its
            # block adds it: the module's contribution is both.
            first = first + output[-1]
        if not (torch.is_tensor(hidden) and torch.is_tensor(first)):
            return
        calls[module] = Call(module, model.config, hidden.detach().float().numpy().copy(),
                             first.detach().float().numpy().copy())

    def output_dense(module):
        # A BERT-style block's attention ends at `output.dense`, before
        # the residual and the LayerNorm of its block (see
        # `keras_mha.hf_structure`): that is what is compared.
        def hook(dense, args, output):
            captured_dense[module] = output.detach().float().numpy().copy()
        return hook

    captured_dense = {}
    handles = [m.register_forward_hook(hook, with_kwargs=True)
               for m in attention_modules(model)]
    for module in attention_modules(model):
        dense = getattr(getattr(module, "output", None), "dense", None)
        if dense is not None and hasattr(module, "self"):
            handles.append(dense.register_forward_hook(output_dense(module)))
    vocab = int(model.config.get_text_config().vocab_size)
    tokens = np.random.default_rng(0).integers(3, min(vocab, 64),
                                               size=(BATCH, LENGTH))
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(tokens), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    result = [dataclasses.replace(call, output=captured_dense[module])
              if module in captured_dense else call
              for module, call in calls.items()]
    return result
