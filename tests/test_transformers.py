"""Hugging Face attention modules: `from_torch` computes what they compute.

Each case is a tiny random `*ForCausalLM` with its family's published
attention settings (rope types with their published parameters, windows,
soft-caps, sinks), run whole in torch, float32, eager attention
(`hf_models.run_causal_lm`): the model builds its masks and rotary tables.
Each attention module's captured input goes through `from_torch(module)`
on the active backend as `layer(x, x, use_causal_mask=True)`, and the
result must equal the module's captured output.
"""

import contextlib
import functools
import types

import numpy as np
import pytest
from hf_models import attention_modules
from hf_models import build_causal_lm
from hf_models import decode_causal_lm
from hf_models import decode_with
from hf_models import generate_greedy
from hf_models import run_causal_lm
from util import to_numpy

import keras_mha
from keras_mha import rope_parameters

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

BATCH, LENGTH, HIDDEN = 2, 12, 32
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
WINDOW = 5  # < LENGTH, so the window matters
THETA = 500.0  # small, so that positions matter at LENGTH
SOFT_CAP = 2.0  # about the logits' size, so that it matters
# Length-dependent types switch at 16 positions: runs of 8 and 24 tokens
# fall on either side.
SWITCH, SHORT, LONG = 16, 8, 24

COMMON = dict(
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    intermediate_size=16,
    vocab_size=16,
)
# Special tokens inside the tiny vocabulary, for configs whose defaults
# are not.
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_FACTORS = np.random.default_rng(7)
LONGROPE = {
    "rope_type": "longrope", "rope_theta": THETA, "factor": 4.0,
    "original_max_position_embeddings": SWITCH,
    "short_factor": [float(x) for x in _FACTORS.uniform(1, 1.5, 4)],
    "long_factor": [float(x) for x in _FACTORS.uniform(2, 8, 4)],
}
# Phi-3's longrope: its short and long factors cover the 6 rotated features
# of a head of 8 (partial rotary factor 3/4, as in Phi-4-mini).
PHI3_LONGROPE = {
    "rope_type": "longrope", "rope_theta": THETA,
    "short_factor": [float(x) for x in _FACTORS.uniform(1, 1.5, 3)],
    "long_factor": [float(x) for x in _FACTORS.uniform(2, 8, 3)],
}
# Llama 3.1-3.3's published rope parameters.
LLAMA3 = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Llama 4 Scout's published rope parameters.
LLAMA4_ROPE = {**LLAMA3, "factor": 16.0, "high_freq_factor": 1.0}
CHUNK, FLOOR_SCALE = 4, 4
# Gemma 3's published local and global rope parameters.
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0,
                       "rope_theta": 1000000.0},
}
# Gemma 4's rope: the default on local layers, "proportional" on global
# ones (half of each head's pairs turn).
GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": THETA},
    "full_attention": {"rope_type": "proportional", "rope_theta": THETA,
                       "partial_rotary_factor": 0.5},
}
# Qwen2.5's published long-context YaRN.
YARN = {
    "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
    "original_max_position_embeddings": 32768,
}

# case id -> (config class, config arguments, sequence length)
CASES = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=1), LENGTH),
    # A norm of the heads before `o_proj`: the layer's `output_norm`.
    "bitnet": ("BitNetConfig", dict(num_hidden_layers=1), LENGTH),
    # transformers' default RoPE for Llama rotates every feature anyway.
    "llama_bias_partial_rotary_factor": (
        "LlamaConfig",
        dict(num_hidden_layers=1, attention_bias=True,
             partial_rotary_factor=0.5),
        LENGTH,
    ),
    "llama_linear": (
        "LlamaConfig",
        dict(num_hidden_layers=1, rope_parameters={
            "rope_type": "linear", "rope_theta": THETA, "factor": 2.0}),
        LENGTH,
    ),
    "llama_llama3": (
        "LlamaConfig",
        dict(num_hidden_layers=1, rope_parameters=LLAMA3,
             max_position_embeddings=131072),
        LENGTH,
    ),
    "llama_yarn": (
        "LlamaConfig",
        dict(num_hidden_layers=1, rope_parameters=YARN,
             max_position_embeddings=131072),
        LENGTH,
    ),
    **{
        f"llama_dynamic_{side}": (
            "LlamaConfig",
            dict(num_hidden_layers=1, max_position_embeddings=SWITCH,
                 rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                  "rope_theta": THETA}),
            length,
        )
        for side, length in (("short", SHORT), ("long", LONG))
    },
    **{
        f"llama_longrope_{side}": (
            "LlamaConfig",
            dict(num_hidden_layers=1, rope_parameters=LONGROPE,
                 max_position_embeddings=4 * SWITCH),
            length,
        )
        for side, length in (("short", SHORT), ("long", LONG))
    },
    "mistral_window": (
        "MistralConfig", dict(num_hidden_layers=1, sliding_window=WINDOW),
        LENGTH,
    ),
    # `max_window_layers=1`: layer 0 is full, layer 1 sliding.
    "qwen2_windows": (
        "Qwen2Config",
        dict(num_hidden_layers=2, use_sliding_window=True,
             sliding_window=WINDOW, max_window_layers=1),
        LENGTH,
    ),
    "qwen2_yarn": (
        "Qwen2Config",
        dict(num_hidden_layers=1, rope_parameters=YARN,
             max_position_embeddings=131072),
        LENGTH,
    ),
    # Gemma 2 and gpt-oss alternate: even layers slide, odd ones are full.
    "gemma2_windows": (
        "Gemma2Config",
        dict(num_hidden_layers=2, head_dim=HEAD_DIM, sliding_window=WINDOW,
             attn_logit_softcapping=SOFT_CAP, query_pre_attn_scalar=20),
        LENGTH,
    ),
    # gpt-oss's published YaRN (its config's default rope parameters).
    "gpt_oss_yarn": (
        "GptOssConfig",
        dict(num_hidden_layers=2, head_dim=HEAD_DIM, sliding_window=WINDOW,
             num_local_experts=2, num_experts_per_tok=1),
        LENGTH,
    ),
    # Phi-4-mini: longrope on 3/4 of each head (`partial_rotary_factor`),
    # one fused `qkv_proj`, the config's window on every layer.
    **{
        f"phi3_longrope_partial_{side}": (
            "Phi3Config",
            dict(num_hidden_layers=1, sliding_window=WINDOW, **TOKENS,
                 max_position_embeddings=4 * SWITCH,
                 original_max_position_embeddings=SWITCH,
                 rope_parameters={**PHI3_LONGROPE,
                                  "partial_rotary_factor": 0.75}),
            length,
        )
        for side, length in (("short", SHORT), ("long", LONG))
    },
    # SmolLM3: layer 1 of 2 is NoPE (`no_rope_layers[1] == 0`).
    "smollm3_nope": (
        "SmolLM3Config",
        dict(num_hidden_layers=2, no_rope_layer_interval=2, **TOKENS),
        LENGTH,
    ),
    # Cohere2: interleaved rotary on the sliding layer, none on the full one.
    "cohere2_windows": (
        "Cohere2Config",
        dict(num_hidden_layers=2, sliding_window=WINDOW, **TOKENS,
             layer_types=["sliding_attention", "full_attention"]),
        LENGTH,
    ),
    # Qwen3: an RMSNorm over each query and key head.
    "qwen3_norms": (
        "Qwen3Config", dict(num_hidden_layers=1, head_dim=HEAD_DIM), LENGTH,
    ),
    # Gemma 3: per-head norms stored as `1 + w`, local layers at 10,000 in
    # a window, global ones at 1,000,000 with linear factor 8.
    "gemma3_local_global": (
        "Gemma3TextConfig",
        dict(num_hidden_layers=2, head_dim=HEAD_DIM, sliding_window=WINDOW,
             query_pre_attn_scalar=20, rope_parameters=GEMMA3_ROPE,
             layer_types=["sliding_attention", "full_attention"]),
        LENGTH,
    ),
    # OLMo 2: one RMSNorm over all the query heads, one over the keys.
    # Its decoder norms come after attention, so layer 0 reads the raw
    # embeddings (drawn at `initializer_range`): drawn large enough to
    # matter.
    "olmo2_norms": (
        "Olmo2Config", dict(num_hidden_layers=1, initializer_range=1.0),
        LENGTH,
    ),
    # Llama 4: a chunked rope layer with weightless norms, then a full NoPE
    # layer with the query temperature (chunk and floor scale small enough
    # to matter at 12 tokens).
    "llama4_chunked_nope": (
        "Llama4TextConfig",
        dict(num_hidden_layers=2, head_dim=HEAD_DIM, **TOKENS,
             no_rope_layers=[1, 0], attention_chunk_size=CHUNK,
             floor_scale=FLOOR_SCALE, attn_scale=0.5,
             rope_parameters=LLAMA4_ROPE, max_position_embeddings=131072,
             intermediate_size_mlp=16, num_local_experts=1),
        LENGTH,
    ),
    # Gemma 4: a local layer, then a global one with heads twice the size,
    # proportional rope and keys that are the values; values normalized
    # and logits unscaled on both.
    "gemma4_proportional": (
        "Gemma4TextConfig",
        dict(num_hidden_layers=2, head_dim=HEAD_DIM, global_head_dim=16,
             sliding_window=WINDOW, attention_k_eq_v=True,
             hidden_size_per_layer_input=0, rope_parameters=GEMMA4_ROPE,
             layer_types=["sliding_attention", "full_attention"]),
        LENGTH,
    ),
    # Persimmon: a fused projection per head, LayerNorms of the query and
    # key heads, half of each head rotated. It has no key/value heads.
    "persimmon_layer_norms": (
        "PersimmonConfig", dict(num_hidden_layers=1, num_key_value_heads=None),
        LENGTH,
    ),
    # nanochat: weightless norms after a rotation the other way.
    "nanochat_reversed": (
        "NanoChatConfig", dict(num_hidden_layers=1), LENGTH,
    ),
}


def _config(case_id):
    config_class, kwargs, _ = CASES[case_id]
    kwargs = {**COMMON, **kwargs}
    if "rope_parameters" not in kwargs and config_class != "GptOssConfig":
        kwargs["rope_theta"] = THETA
    return getattr(transformers, config_class)(**kwargs)


@functools.lru_cache(maxsize=None)
def _run(case_id):
    """The case's model run once: one `Captured` per layer."""
    length = CASES[case_id][2]
    tokens = np.random.default_rng(0).integers(
        0, COMMON["vocab_size"], size=(BATCH, length)
    )
    return tuple(run_causal_lm(_config(case_id), tokens))


PROMPT, DECODED = 12, 20


@functools.lru_cache(maxsize=None)
def _decode(case_id):
    """The case's model decoding `DECODED` tokens after a prompt of
    `PROMPT`: per call, one `Captured` per layer."""
    tokens = np.random.default_rng(1).integers(
        0, COMMON["vocab_size"], size=(BATCH, DECODED)
    )
    return tuple(decode_causal_lm(_config(case_id), tokens, PROMPT))


def _layer_cases():
    return [
        pytest.param(case_id, index, id=f"{case_id}-layer{index}")
        for case_id, (_, kwargs, _) in CASES.items()
        for index in range(kwargs["num_hidden_layers"])
    ]


def _imported_output(captured):
    layer = keras_mha.from_torch(captured.module)
    x = captured.hidden_states
    return to_numpy(layer(x, x, use_causal_mask=True))


class TestOutputs:
    @pytest.mark.parametrize("case_id, index", _layer_cases())
    def test_matches_module_in_model(self, case_id, index):
        captured = _run(case_id)[index]
        np.testing.assert_allclose(
            _imported_output(captured), captured.output, atol=2e-5, rtol=1e-5
        )

    def test_reads_features(self):
        gemma = _run("gemma2_windows")[0].module
        layer = keras_mha.from_torch(gemma)
        assert layer.sliding_window == WINDOW
        assert layer.attn_logits_soft_cap == SOFT_CAP
        assert layer.scale == pytest.approx(20**-0.5)
        assert layer.rotary_embedding.max_wavelength == THETA
        assert layer.num_key_value_heads == KV_HEADS
        qwen2 = _run("qwen2_windows")[0].module
        layer = keras_mha.from_torch(qwen2)
        assert layer.sliding_window is None and layer.use_bias
        # Qwen2's o_proj has no bias: ours is zero.
        np.testing.assert_array_equal(
            to_numpy(layer.output_dense.bias.value), np.zeros(HIDDEN)
        )
        gpt_oss = _run("gpt_oss_yarn")[0].module
        layer = keras_mha.from_torch(gpt_oss)
        assert layer.use_sinks and layer.sliding_window == WINDOW
        np.testing.assert_array_equal(
            to_numpy(layer.sinks.value), gpt_oss.sinks.detach().numpy()
        )

    def test_reads_rope_layers(self):
        """NoPE layers have no `rotary_embedding`; Cohere2 rotates the
        interleaved pairs; Phi-3 rotates 3/4 of each head."""
        smollm3 = [keras_mha.from_torch(c.module)
                   for c in _run("smollm3_nope")]
        assert smollm3[0].rotary_embedding.rotary_dim == HEAD_DIM
        assert smollm3[1].rotary_embedding is None
        sliding, full = [keras_mha.from_torch(c.module)
                         for c in _run("cohere2_windows")]
        assert sliding.sliding_window == WINDOW
        assert sliding.rotary_embedding.interleaved
        assert full.sliding_window is None and full.rotary_embedding is None
        phi3 = keras_mha.from_torch(_run("phi3_longrope_partial_long")[0].module)
        assert phi3.rotary_embedding.rotary_dim == 6
        assert phi3.rotary_embedding.long_factor == tuple(
            PHI3_LONGROPE["long_factor"])
        assert phi3.sliding_window == WINDOW and not phi3.use_bias

    def test_reads_norms_chunks_and_temperature(self):
        qwen3 = _run("qwen3_norms")[0].module
        layer = keras_mha.from_torch(qwen3)
        assert (layer.qk_norm, layer.qk_norm_scope) == ("rms", "head")
        assert layer.qk_norm_epsilon == qwen3.config.rms_norm_eps
        np.testing.assert_array_equal(
            to_numpy(layer.key_norm.scale.value),
            qwen3.k_norm.weight.detach().numpy(),
        )
        # Gemma 3 stores `w`; the model multiplies by `1 + w`.
        gemma3 = _run("gemma3_local_global")[1].module
        layer = keras_mha.from_torch(gemma3)
        np.testing.assert_allclose(
            to_numpy(layer.query_norm.scale.value),
            1 + gemma3.q_norm.weight.detach().numpy(), rtol=1e-7,
        )
        assert layer.scale == pytest.approx(20**-0.5)
        assert layer.rotary_embedding.max_wavelength == 1e6
        assert layer.rotary_embedding.scaling_factor == 8.0
        olmo2 = keras_mha.from_torch(_run("olmo2_norms")[0].module)
        assert olmo2.qk_norm_scope == "projection"
        assert tuple(olmo2.query_norm.scale.shape) == (HEADS * HEAD_DIM,)
        assert tuple(olmo2.key_norm.scale.shape) == (KV_HEADS * HEAD_DIM,)
        chunked, nope = [keras_mha.from_torch(c.module)
                         for c in _run("llama4_chunked_nope")]
        assert chunked.attention_chunk_size == CHUNK
        assert chunked.qk_norm == "l2" and chunked.query_temperature is None
        assert chunked.rotary_embedding.interleaved
        assert nope.rotary_embedding is None and nope.qk_norm is None
        assert nope.attention_chunk_size is None
        assert nope.query_temperature == (FLOOR_SCALE, 0.5)

    @pytest.mark.parametrize("case_id, rope, attention_factor", [
        ("gpt_oss_yarn", dict(rope_type="yarn", scaling_factor=32.0,
                              beta_fast=32.0, beta_slow=1.0, truncate=False,
                              original_max_position_embeddings=4096,
                              max_wavelength=150000.0),
         0.1 * np.log(32.0) + 1),
        ("llama_llama3", dict(rope_type="llama3", scaling_factor=8.0,
                              low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192), 1.0),
        ("llama_dynamic_long", dict(rope_type="dynamic", scaling_factor=2.0,
                                    original_max_position_embeddings=SWITCH),
         1.0),
        ("llama_longrope_long", dict(
            rope_type="longrope", scaling_factor=4.0,
            original_max_position_embeddings=SWITCH,
            short_factor=tuple(LONGROPE["short_factor"]),
            long_factor=tuple(LONGROPE["long_factor"])),
         np.sqrt(1 + np.log(4.0) / np.log(SWITCH))),
    ])
    def test_reads_rope_parameters(self, case_id, rope, attention_factor):
        captured = _run(case_id)[0]
        rotary = keras_mha.from_torch(captured.module).rotary_embedding
        for name, value in rope.items():
            assert getattr(rotary, name) == value, name
        assert rotary.rotary_dim == HEAD_DIM
        assert rotary.attention_factor == pytest.approx(attention_factor)
        # The model's own factor: its cos at position 0.
        cos = captured.kwargs["position_embeddings"][0]
        assert float(cos[0, 0, 0]) == pytest.approx(attention_factor)

    @pytest.mark.parametrize("case_id, rope_scaling", [
        ("llama", None),
        ("llama_linear", {"type": "linear", "factor": 2.0}),
        ("llama_dynamic_long", {"rope_type": "dynamic", "factor": 2.0}),
    ])
    def test_config_before_rope_parameters(self, case_id, rope_scaling):
        """`rope_theta` and `rope_scaling` attributes, as before 5.0."""
        captured = _run(case_id)[0]
        with _config_as(captured.module, drop=["rope_parameters"],
                        rope_theta=THETA, rope_scaling=rope_scaling):
            output = _imported_output(captured)
        np.testing.assert_allclose(output, captured.output, atol=2e-5,
                                   rtol=1e-5)

    # Decoding across the length-dependent types' switch at 16 (a prompt of
    # 12, then one token at a time to 20), and gpt-oss's YaRN with its
    # sliding layer's rolling cache.
    @pytest.mark.parametrize("case_id", ["llama_dynamic_long",
                                         "llama_longrope_long",
                                         "gpt_oss_yarn",
                                         "phi3_longrope_partial_long",
                                         "smollm3_nope",
                                         "cohere2_windows",
                                         "qwen3_norms",
                                         "gemma3_local_global",
                                         "olmo2_norms",
                                         "llama4_chunked_nope",
                                         "gemma4_proportional",
                                         "persimmon_layer_norms",
                                         "nanochat_reversed"])
    def test_decoding_matches_the_models_cache(self, case_id):
        """Step by step with a cache, the layer computes what the module
        computes with transformers' cache: each key keeps the rotation of
        the call that wrote it, in both (see `RotaryEmbedding`)."""
        calls = _decode(case_id)
        for index, first in enumerate(calls[0]):
            layer = keras_mha.from_torch(first.module)
            cache = layer.init_cache(BATCH, DECODED)
            start = 0
            for call in calls:
                x = call[index].hidden_states
                output, cache = layer(x, x, use_causal_mask=True,
                                      cache=cache, cache_update_index=start)
                np.testing.assert_allclose(
                    to_numpy(output), call[index].output, atol=2e-5,
                    rtol=1e-5, err_msg=f"layer {index}, position {start}",
                )
                start += x.shape[1]

    def test_layer_kwargs(self):
        module = _run("mistral_window")[0].module
        layer = keras_mha.from_torch(
            module, name="imported", dropout=0.25, num_heads=HEADS,
            sliding_window=WINDOW, output_shape=HIDDEN,
        )
        assert layer.name == "imported" and layer.dropout == 0.25
        assert layer.sliding_window == WINDOW


class TestGenerate:
    """Greedy decoding of a whole model whose attention modules are ours."""

    GENERATED = 6

    @pytest.mark.parametrize("case_id", ["llama_llama3",
                                         "gemma3_local_global",
                                         "llama4_chunked_nope", "bitnet"])
    def test_tokens_and_logits_of_generate(self, case_id):
        """Each attention module's forward is replaced by a call of
        `from_torch(module)` with our cache (`init_cache`,
        `cache_update_index`); the rest of the model (embeddings, norms,
        MLPs, head) is Hugging Face's, run token by token. The tokens and
        logits are `generate`'s, which decodes with transformers' cache."""
        model = build_causal_lm(_config(case_id))
        prompt = np.random.default_rng(2).integers(
            0, COMMON["vocab_size"], size=(BATCH, PROMPT)
        )
        want_tokens, want_logits = generate_greedy(model, prompt,
                                                   self.GENERATED)
        layers = [keras_mha.from_torch(m) for m in attention_modules(model)]
        caches = [layer.init_cache(BATCH, PROMPT + self.GENERATED)
                  for layer in layers]

        def ours(index):
            def call(x, start):
                output, caches[index] = layers[index](
                    x, x, use_causal_mask=True, cache=caches[index],
                    cache_update_index=start,
                )
                return to_numpy(output)
            return call

        tokens, logits = decode_with(
            model, [ours(i) for i in range(len(layers))], prompt,
            self.GENERATED,
        )
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_allclose(logits, want_logits, atol=2e-5,
                                   rtol=1e-5)


class TestRopeParameters:
    """`keras_mha.rope_parameters` on configs that the families above do
    not publish but later ones do; transformers' function is the oracle."""

    @staticmethod
    def _config(rope_parameters, **attributes):
        return types.SimpleNamespace(
            rope_parameters=rope_parameters, head_dim=HEAD_DIM,
            hidden_size=HIDDEN, num_attention_heads=HEADS,
            max_position_embeddings=163840,
            standardize_rope_params=lambda: None, **attributes,
        )

    def _hugging_face(self, config):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = config.rope_parameters["rope_type"]
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        return inv_freq.numpy(), factor

    def test_one_dict_per_layer_type(self):
        config = self._config(
            {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                "rope_theta": 1e6},
             "sliding_attention": {"rope_type": "default",
                                   "rope_theta": 1e4}},
            layer_types=["sliding_attention", "full_attention"],
        )
        full = rope_parameters.rotary_embedding(config, HEAD_DIM, "Test",
                                                "full_attention")
        sliding = rope_parameters.rotary_embedding(config, HEAD_DIM, "Test",
                                                   "sliding_attention")
        assert (full.rope_type, full.max_wavelength,
                full.scaling_factor) == ("linear", 1e6, 2.0)
        assert (sliding.rope_type, sliding.max_wavelength) == ("default",
                                                               1e4)

    @pytest.mark.parametrize("factor", [40.0, None], ids=["factor", "ratio"])
    def test_yarn_mscale(self, factor):
        """DeepSeek's YaRN: the attention factor from `mscale` and
        `mscale_all_dim`; no `factor` means the ratio of the lengths."""
        params = {"rope_type": "yarn", "rope_theta": 10000.0,
                  "factor": factor, "mscale": 1.0, "mscale_all_dim": 0.8,
                  "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 4096}
        config = self._config(params)
        inv_freq, attention_factor = self._hugging_face(config)
        rotary = rope_parameters.rotary_embedding(config, HEAD_DIM, "Test")
        assert rotary.attention_factor == pytest.approx(attention_factor,
                                                        rel=1e-12)
        assert rotary.scaling_factor == (factor or 163840 / 4096)

    def test_original_length_beside_the_rope_parameters(self):
        """Phi-3 keeps `original_max_position_embeddings` on the config;
        transformers prefers it to the rope parameters'."""
        params = {"rope_type": "longrope", "rope_theta": 10000.0,
                  "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                  "original_max_position_embeddings": 2048}
        config = self._config(params, original_max_position_embeddings=4096)
        rotary = rope_parameters.rotary_embedding(config, HEAD_DIM, "Test")
        assert rotary.original_max_position_embeddings == 4096
        assert rotary.attention_factor == pytest.approx(
            np.sqrt(1 + np.log(163840 / 4096) / np.log(4096))
        )


def _module(case_id, **config_changes):
    """A new attention module of the case's class, its config changed."""
    config = _config(case_id)
    for name, value in config_changes.items():
        setattr(config, name, value)
    return type(_run(case_id)[0].module)(config, 0)


class TestErrors:
    @pytest.mark.parametrize("rope_type", ["axial", "mrope"])
    def test_rope_type(self, rope_type):
        module = _module("llama", rope_parameters={
            "rope_type": rope_type, "rope_theta": THETA})
        with pytest.raises(ValueError, match=f"rope_type='{rope_type}'"):
            keras_mha.from_torch(module)

    def test_rope_type_before_rope_parameters(self):
        module = _module("llama")
        old = module.config.to_dict()
        del old["rope_parameters"]
        module.config = types.SimpleNamespace(
            **old, rope_theta=THETA, rope_scaling={"type": "su"},
        )
        with pytest.raises(ValueError, match="rope_type='su'"):
            keras_mha.from_torch(module)

    def test_bidirectional(self):
        """Gemma 3 with `use_bidirectional_attention` is not causal."""
        module = _module("gemma3_local_global",
                         use_bidirectional_attention=True)
        with pytest.raises(ValueError,
                           match="use_bidirectional_attention=True"):
            keras_mha.from_torch(module)

    def test_partial_rotary_factor_of_a_scaled_type(self):
        """Llama's scaled types make tables of `H · factor` features that
        its `apply_rotary_pos_emb` cannot apply to `H`: named, not run."""
        module = _module("llama", rope_parameters={
            "rope_type": "linear", "factor": 2.0, "rope_theta": THETA,
            "partial_rotary_factor": 0.5})
        with pytest.raises(ValueError,
                           match=r"Received: partial_rotary_factor=0\.5"):
            keras_mha.from_torch(module)

    @pytest.mark.parametrize(
        "argument, value",
        [
            ("num_heads", 2),
            ("use_bias", True),
            ("sliding_window", 3),
            ("scale", 0.5),
            ("use_sinks", True),
            ("output_shape", 16),
            ("rotary_embedding", keras_mha.RotaryEmbedding(THETA)),
        ],
    )
    def test_fixed_by_module(self, argument, value):
        module = _module("mistral_window")
        with pytest.raises(ValueError, match=f"`{argument}` is fixed"):
            keras_mha.from_torch(module, **{argument: value})

    def test_subclass_reads_as_its_structure(self):
        """A subclass holds what its base holds: it is read the same."""
        captured = _run("llama")[0]
        module = captured.module
        base = type(module)

        class Custom(base):
            pass

        module.__class__ = Custom
        try:
            output = _imported_output(captured)
        finally:
            module.__class__ = base
        np.testing.assert_allclose(output, captured.output, atol=2e-5,
                                   rtol=1e-5)


@contextlib.contextmanager
def _config_as(module, drop=(), **changes):
    """The module's config as a plain namespace, without the attributes
    `drop` and with `changes`, while the block runs."""
    config = module.config
    kept = config.to_dict()
    for name in drop:
        del kept[name]
    module.config = types.SimpleNamespace(**{**kept, **changes})
    try:
        yield
    finally:
        module.config = config


class TestDefects:
    """Configs and modules that earlier importers stumbled on."""

    def test_config_without_attention_dropout(self):
        """Ernie 4.5's and Mllama's configs have no `attention_dropout`:
        `dropout=` is taken as passed, and 0 when not."""
        module = _module("llama")
        with _config_as(module, drop=["attention_dropout"]):
            assert not hasattr(module.config, "attention_dropout")
            assert keras_mha.from_torch(module, dropout=0.25).dropout == 0.25
            assert keras_mha.from_torch(module).dropout == 0.0

    def test_config_without_layer_types(self):
        """Qwen3's module reads as Llama's without layer types; Cohere2's,
        which rotates only where `layer_types` slides, is a named error."""
        captured = _run("qwen3_norms")[0]
        with _config_as(captured.module, drop=["layer_types"]):
            output = _imported_output(captured)
        np.testing.assert_allclose(output, captured.output, atol=2e-5,
                                   rtol=1e-5)
        module = _run("cohere2_windows")[0].module
        with _config_as(module, drop=["layer_types"]):
            with pytest.raises(ValueError, match="layer_types=None"):
                keras_mha.from_torch(module)

    @staticmethod
    def _weightless_norm(attribute, epsilon):
        """A weightless RMS norm keeping its epsilon as `attribute` (Llama
        4's is `eps` before transformers 5.25, `variance_epsilon` since)."""

        class Norm(torch.nn.Module):
            def forward(self, x):
                eps = getattr(self, attribute, 0.0)
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

        norm = Norm()
        if attribute is not None:
            setattr(norm, attribute, epsilon)
        return norm

    @pytest.mark.parametrize("attribute", ["variance_epsilon", "eps"])
    def test_norm_epsilon_under_each_name(self, attribute):
        captured = _run("llama4_chunked_nope")[0]
        module = captured.module
        original = module.qk_norm
        epsilon = float(getattr(original, "variance_epsilon",
                                getattr(original, "eps", None)))
        module.qk_norm = self._weightless_norm(attribute, epsilon)
        try:
            layer = keras_mha.from_torch(module)
            output = _imported_output(captured)
        finally:
            module.qk_norm = original
        assert layer.qk_norm_epsilon == epsilon
        np.testing.assert_allclose(output, captured.output, atol=2e-5,
                                   rtol=1e-5)

    def test_norm_without_epsilon(self):
        module = _run("llama4_chunked_nope")[0].module
        original = module.qk_norm
        module.qk_norm = self._weightless_norm(None, 0.0)
        try:
            with pytest.raises(ValueError,
                               match="Llama4TextAttention's `qk_norm`"):
                keras_mha.from_torch(module)
        finally:
            module.qk_norm = original

    def test_module_without_config(self):
        """A module that keeps no config asks for the model's by name."""
        module = _module("llama")
        config = module.config
        del module.config
        try:
            with pytest.raises(ValueError, match="config=model.config"):
                keras_mha.from_torch(module)
            layer = keras_mha.from_torch(module, config=config)
        finally:
            module.config = config
        assert layer.num_key_value_heads == KV_HEADS

    def test_config_contradicting_weights(self):
        module = _module("llama")
        groups = module.num_key_value_groups
        del module.num_key_value_groups
        try:
            with _config_as(module, num_key_value_heads=1):
                with pytest.raises(ValueError, match=r"LlamaAttention's key "
                                   r"projection has weights of shape"):
                    keras_mha.from_torch(module)
        finally:
            module.num_key_value_groups = groups
