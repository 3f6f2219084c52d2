"""Hugging Face attention modules: `from_torch` computes what they compute.

Each module runs in torch, float32, with its model's own rotary embedding
and a causal (or sliding-window causal) mask in the additive form its eager
attention adds to the logits; our layer gets the same `(B, T, E)` input on
the active backend and `use_causal_mask=True`. Every case has the same
shapes, so JAX compiles little.
"""

import importlib
import types

import numpy as np
import pytest
from util import to_numpy

import keras_mha

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

BATCH, LENGTH, HIDDEN = 2, 12, 32
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
WINDOW = 5  # < LENGTH, so the window matters
THETA = 500.0  # small, so that positions matter at LENGTH
SOFT_CAP = 2.0  # about the logits' size, so that it matters

COMMON = dict(
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    intermediate_size=16,
    vocab_size=16,
    attn_implementation="eager",
)

# case id -> (model, config class, config arguments, layer_idx)
CASES = {
    "llama": ("llama", "LlamaConfig", dict(num_hidden_layers=1), 0),
    # transformers' default RoPE for Llama rotates every feature anyway.
    "llama_bias_partial_rotary_factor": (
        "llama",
        "LlamaConfig",
        dict(num_hidden_layers=1, attention_bias=True,
             partial_rotary_factor=0.5),
        0,
    ),
    "mistral_window": (
        "mistral", "MistralConfig",
        dict(num_hidden_layers=1, sliding_window=WINDOW), 0,
    ),
    # `max_window_layers=1`: layer 0 is full, layer 1 sliding.
    **{
        f"qwen2_{kind}": (
            "qwen2", "Qwen2Config",
            dict(num_hidden_layers=2, use_sliding_window=True,
                 sliding_window=WINDOW, max_window_layers=1),
            layer_idx,
        )
        for kind, layer_idx in (("full", 0), ("sliding", 1))
    },
    # Gemma 2 and gpt-oss alternate: even layers slide, odd ones are full.
    **{
        f"gemma2_{kind}": (
            "gemma2", "Gemma2Config",
            dict(num_hidden_layers=2, head_dim=HEAD_DIM, sliding_window=WINDOW,
                 attn_logit_softcapping=SOFT_CAP, query_pre_attn_scalar=20),
            layer_idx,
        )
        for kind, layer_idx in (("sliding", 0), ("full", 1))
    },
    **{
        f"gpt_oss_{kind}": (
            "gpt_oss", "GptOssConfig",
            dict(num_hidden_layers=2, head_dim=HEAD_DIM, sliding_window=WINDOW,
                 num_local_experts=2, num_experts_per_tok=1,
                 rope_parameters={"rope_type": "default",
                                  "rope_theta": THETA}),
            layer_idx,
        )
        for kind, layer_idx in (("sliding", 0), ("full", 1))
    },
}


def _modeling(model):
    return importlib.import_module(
        f"transformers.models.{model}.modeling_{model}"
    )


def _prefix(model):
    return {"gpt_oss": "GptOss", "qwen2": "Qwen2", "gemma2": "Gemma2"}.get(
        model, model.capitalize()
    )


def _config(model, config_class, **kwargs):
    kwargs = {**COMMON, **kwargs}
    kwargs.setdefault("rope_theta", THETA)
    if "rope_parameters" in kwargs:
        del kwargs["rope_theta"]
    return getattr(transformers, config_class)(**kwargs)


def _module(model, config, layer_idx):
    """The attention module, every parameter random (sinks start empty)."""
    torch.manual_seed(layer_idx)
    module = getattr(_modeling(model), f"{_prefix(model)}Attention")(
        config, layer_idx
    )
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape) * 0.25)
    return module.eval()


def _mask(window):
    """The additive `(B, 1, T, T)` mask eager attention adds to the logits."""
    q_idx = np.arange(LENGTH)[:, None]
    kv_idx = np.arange(LENGTH)[None, :]
    allowed = kv_idx <= q_idx
    if window is not None:
        allowed &= kv_idx > q_idx - window  # transformers' sliding overlay
    mask = np.where(allowed, 0.0, np.finfo("float32").min)
    return torch.from_numpy(
        np.broadcast_to(mask, (BATCH, 1, LENGTH, LENGTH)).astype("float32")
    )


def _run_module(model, module, x):
    rotary = getattr(_modeling(model), f"{_prefix(model)}RotaryEmbedding")(
        module.config
    )
    x = torch.from_numpy(x)
    position_ids = torch.arange(LENGTH)[None].expand(BATCH, LENGTH)
    window = getattr(module, "sliding_window", None)
    if model == "mistral":  # Mistral windows every layer by its config
        window = module.config.sliding_window
    with torch.no_grad():
        output, _ = module(
            x,
            position_embeddings=rotary(x, position_ids),
            attention_mask=_mask(window),
        )
    return output.numpy()


def _inputs():
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH, LENGTH, HIDDEN)).astype("float32")


def _case(case_id):
    model, config_class, kwargs, layer_idx = CASES[case_id]
    config = _config(model, config_class, **kwargs)
    return model, _module(model, config, layer_idx)


class TestOutputs:
    @pytest.mark.parametrize("case_id", list(CASES))
    def test_matches_module(self, case_id):
        model, module = _case(case_id)
        x = _inputs()
        expected = _run_module(model, module, x)
        layer = keras_mha.from_torch(module)
        output = to_numpy(layer(x, x, use_causal_mask=True))
        np.testing.assert_allclose(output, expected, atol=2e-5, rtol=1e-5)

    def test_reads_features(self):
        _, gemma = _case("gemma2_sliding")
        layer = keras_mha.from_torch(gemma)
        assert layer.sliding_window == WINDOW
        assert layer.attn_logits_soft_cap == SOFT_CAP
        assert layer.scale == pytest.approx(20**-0.5)
        assert layer.rotary_embedding.max_wavelength == THETA
        assert layer.num_key_value_heads == KV_HEADS
        _, qwen2 = _case("qwen2_full")
        layer = keras_mha.from_torch(qwen2)
        assert layer.sliding_window is None and layer.use_bias
        # Qwen2's o_proj has no bias: ours is zero.
        np.testing.assert_array_equal(
            to_numpy(layer.output_dense.bias.value), np.zeros(HIDDEN)
        )
        _, gpt_oss = _case("gpt_oss_sliding")
        layer = keras_mha.from_torch(gpt_oss)
        assert layer.use_sinks and layer.sliding_window == WINDOW
        np.testing.assert_array_equal(
            to_numpy(layer.sinks.value), gpt_oss.sinks.detach().numpy()
        )

    def test_config_before_rope_parameters(self):
        """`rope_theta` and `rope_scaling` attributes, as before 5.0."""
        model, module = _case("llama")
        x = _inputs()
        expected = _run_module(model, module, x)
        old = module.config.to_dict()
        del old["rope_parameters"]
        module.config = types.SimpleNamespace(
            **old, rope_theta=THETA, rope_scaling=None
        )
        layer = keras_mha.from_torch(module)
        output = to_numpy(layer(x, x, use_causal_mask=True))
        np.testing.assert_allclose(output, expected, atol=2e-5, rtol=1e-5)

    def test_layer_kwargs(self):
        _, module = _case("mistral_window")
        layer = keras_mha.from_torch(
            module, name="imported", dropout=0.25, num_heads=HEADS,
            sliding_window=WINDOW, output_shape=HIDDEN,
        )
        assert layer.name == "imported" and layer.dropout == 0.25
        assert layer.sliding_window == WINDOW


class TestErrors:
    @pytest.mark.parametrize(
        "rope_parameters",
        [
            {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA},
            None,  # gpt-oss's default: yarn
        ],
        ids=["linear", "yarn"],
    )
    def test_rope_type(self, rope_parameters):
        model, config_class, kwargs, _ = CASES["gpt_oss_full"]
        kwargs = {**kwargs, "rope_parameters": rope_parameters}
        module = _module(model, _config(model, config_class, **kwargs), 1)
        rope_type = "linear" if rope_parameters else "yarn"
        with pytest.raises(ValueError, match=f"rope_type='{rope_type}'"):
            keras_mha.from_torch(module)

    def test_rope_type_before_rope_parameters(self):
        _, module = _case("llama")
        old = module.config.to_dict()
        del old["rope_parameters"]
        module.config = types.SimpleNamespace(
            **old, rope_theta=THETA,
            rope_scaling={"type": "dynamic", "factor": 2.0},
        )
        with pytest.raises(ValueError, match="rope_type='dynamic'"):
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
        _, module = _case("mistral_window")
        with pytest.raises(ValueError, match=f"`{argument}` is fixed"):
            keras_mha.from_torch(module, **{argument: value})

    def test_subclass(self):
        model, module = _case("llama")

        class Custom(type(module)):
            pass

        module.__class__ = Custom
        with pytest.raises(ValueError, match="takes a `torch.nn"):
            keras_mha.from_torch(module)
