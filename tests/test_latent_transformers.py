"""`from_torch(DeepseekV3Attention)`: the imported `MultiHeadLatentAttention`
computes what the module computes inside a tiny random
`DeepseekV3ForCausalLM` (captured with hooks, nothing downloaded), in one
call and decoding with its own latent cache; and greedy decoding of the
tiny model rebuilt around our layer gives `generate`'s tokens."""

import functools

import numpy as np
import pytest
from hf_models import decode_causal_lm
from util import to_numpy

import keras_mha

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

BATCH, PROMPT, LENGTH = 2, 5, 9
YARN = {
    "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
    "original_max_position_embeddings": 8, "mscale": 1.0,
    "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0,
}
CASES = {
    # DeepSeek V3: compressed queries, YaRN with mscale, interleaved RoPE.
    "v3_yarn_interleaved": dict(q_lora_rank=6, rope_parameters=YARN,
                                rope_interleave=True),
    # DeepSeek V2-Lite: queries projected directly, plain RoPE in halves,
    # biases.
    "v2_lite": dict(q_lora_rank=None, rope_interleave=False,
                    attention_bias=True,
                    rope_parameters={"rope_type": "default",
                                     "rope_theta": 500.0}),
}


def _config(case_id):
    return transformers.DeepseekV3Config(
        vocab_size=16, hidden_size=32, intermediate_size=16,
        moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8,
        qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **CASES[case_id],
    )


@functools.lru_cache(maxsize=None)
def _decode(case_id):
    """The model on a prompt, then one token a call, with its own cache:
    per call, one `Captured` per layer."""
    tokens = np.random.default_rng(1).integers(3, 16, size=(BATCH, LENGTH))
    return tuple(decode_causal_lm(_config(case_id), tokens, PROMPT))


@pytest.mark.parametrize("case_id", list(CASES))
def test_matches_the_module_and_its_cache(case_id):
    """The prompt's call in one pass, then every step with the latent cache
    (absorbed, by the rule), against the module's outputs in the model."""
    calls = _decode(case_id)
    for index, first in enumerate(calls[0]):
        layer = keras_mha.from_torch(first.module)
        x = first.hidden_states
        np.testing.assert_allclose(
            to_numpy(layer(x, x, use_causal_mask=True)), first.output,
            atol=2e-5, rtol=1e-5,
        )
        cache = layer.init_cache(BATCH, LENGTH)
        start = 0
        for call in calls:
            x = call[index].hidden_states
            assert layer.computation(x.shape[1], cache=True,
                                     cache_update_index=start) == (
                "expanded" if start == 0 else "absorbed")
            output, cache = layer(x, x, use_causal_mask=True, cache=cache,
                                  cache_update_index=start)
            np.testing.assert_allclose(
                to_numpy(output), call[index].output, atol=2e-5, rtol=1e-5,
                err_msg=f"layer {index}, position {start}",
            )
            start += x.shape[1]


def test_reads_the_module():
    v3 = keras_mha.from_torch(_decode("v3_yarn_interleaved")[0][0].module)
    lite = keras_mha.from_torch(_decode("v2_lite")[0][0].module)
    assert v3.q_lora_rank == 6 and lite.q_lora_rank is None
    assert v3.rotary_embedding.interleaved
    assert not lite.rotary_embedding.interleaved
    assert v3.rotary_embedding.rope_type == "yarn"
    # YaRN's mscale_all_dim, squared, in the scale.
    mscale = 0.1 * 0.8 * np.log(4.0) + 1.0
    assert v3.scale == pytest.approx(8 ** -0.5 * mscale ** 2)
    assert lite.scale == pytest.approx(8 ** -0.5)
    assert lite.use_bias and not v3.use_bias
    with pytest.raises(ValueError, match="kv_lora_rank=4"):
        keras_mha.from_torch(_decode("v2_lite")[0][0].module, kv_lora_rank=4)


class _OurAttention(torch.nn.Module):
    """Stands in for a `DeepseekV3Attention` inside the model: our layer
    with our latent cache, one call at a time (the model's positions, mask
    and cache are not read)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.cache, self.index = None, 0

    def forward(self, hidden_states, *args, **kwargs):
        x = hidden_states.detach().numpy()
        if self.cache is None:
            self.cache = self.layer.init_cache(x.shape[0], LENGTH + 4)
        out, self.cache = self.layer(x, x, use_causal_mask=True,
                                     cache=self.cache,
                                     cache_update_index=self.index)
        self.index += x.shape[1]
        return torch.as_tensor(np.array(to_numpy(out))), None


def test_greedy_decoding_gives_generate_tokens():
    """The tiny DeepSeek V3 with every attention module replaced by our
    layer, decoded greedily one token a call, gives the tokens of the
    original model's `generate(do_sample=False)`."""
    config = _config("v3_yarn_interleaved")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".self_attn." in name:
                parameter.copy_(torch.randn(parameter.shape) * 0.25)
    prompt = torch.as_tensor(
        np.random.default_rng(2).integers(3, 16, size=(1, PROMPT))
    )
    new = LENGTH - PROMPT
    with torch.no_grad():
        expected = model.generate(
            prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
        )[0, PROMPT:].tolist()
        for decoder in model.model.layers:
            decoder.self_attn = _OurAttention(
                keras_mha.from_torch(decoder.self_attn)
            )
        tokens, ids = [], prompt
        for _ in range(new):
            logits = model(input_ids=ids, use_cache=False).logits
            ids = logits[:, -1:].argmax(-1)
            tokens.append(int(ids[0, 0]))
    assert tokens == expected
    assert len(set(expected)) > 1  # not one token repeated
