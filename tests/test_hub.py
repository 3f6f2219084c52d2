"""`keras_mha.adopt`: keras-hub's causal LMs on this library's attention.

Each family's tiny backbone is built from its config (nothing is
downloaded), its weights drawn at random large enough that the positions
matter, and its logits, greedy `generate` tokens, saved and reloaded
logits, LoRA and int8 quantization compared before and after the swap, on
every backend.
"""

import inspect

import numpy as np
import pytest
from util import to_numpy

import keras
import keras_mha
from keras import ops
from keras_mha import hub

keras_hub = pytest.importorskip("keras_hub")
pytestmark = pytest.mark.skipif(
    keras.backend.backend() == "numpy",
    reason="keras-hub's models do not build on Keras's NumPy backend",
)

VOCAB, LENGTH = 50, 12
SIZES = dict(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
             num_key_value_heads=2, hidden_dim=32, intermediate_dim=16)
# family -> (backbone, causal LM, extra config)
FAMILIES = {
    "llama": ("LlamaBackbone", "LlamaCausalLM", {}),
    "mistral": ("MistralBackbone", "MistralCausalLM",
                dict(sliding_window=4)),
    "mixtral": ("MixtralBackbone", "MixtralCausalLM",
                dict(num_experts=2, top_k=1, sliding_window=4)),
    "qwen": ("QwenBackbone", "QwenCausalLM", {}),
    "qwen_moe": ("QwenMoeBackbone", "QwenMoeCausalLM",
                 dict(num_experts=2, top_k=1, moe_intermediate_dim=16,
                      shared_expert_intermediate_dim=16)),
    "qwen3": ("Qwen3Backbone", "Qwen3CausalLM", dict(head_dim=8)),
    "qwen3_moe": ("Qwen3MoeBackbone", "Qwen3MoeCausalLM",
                  dict(head_dim=8, num_experts=2, top_k=1,
                       moe_intermediate_dim=16)),
    "phi3": ("Phi3Backbone", "Phi3CausalLM", {}),
    # SmolLM3: `Dense` projections, a NoPE layer.
    "smollm3": ("SmolLM3Backbone", "SmolLM3CausalLM",
                dict(attention_bias=False, attention_dropout=0.0,
                     rope_layer_enabled_list=[True, False],
                     layer_types=["full_attention"] * 2, mlp_bias=False,
                     layer_norm_epsilon=1e-6, max_position_embeddings=64,
                     rope_theta=10000.0, partial_rotary_factor=1.0)),
    # BLOOM: ALiBi, an output `Dense` of the merged heads.
    "bloom": ("BloomBackbone", "BloomCausalLM", {}),
    # Falcon: ALiBi before the scale, public names, an output `Dense`.
    "falcon": ("FalconBackbone", "FalconCausalLM", {}),
    # gpt-oss: sinks, biases, a window of `W + 1` keys, YaRN.
    "gpt_oss": ("GptOssBackbone", "GptOssCausalLM",
                dict(head_dim=8, num_experts=2, top_k=2, sliding_window=3)),
    # Qwen3.5: a linear-attention layer (left as it is), then a softmax
    # one: a gate in the query projection, norms of `1 + w`, partial rotary.
    "qwen3_5": ("Qwen3_5Backbone", "Qwen3_5CausalLM",
                dict(head_dim=8, layer_types=["linear_attention",
                                              "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=2,
                     linear_key_head_dim=8, linear_value_head_dim=8)),
    # GPT-NeoX: one fused projection, partial rotary, an output `Dense`.
    "gpt_neo_x": ("GPTNeoXBackbone", "GPTNeoXCausalLM", {}),
    "gemma": ("GemmaBackbone", "GemmaCausalLM", dict(head_dim=8)),
    # Gemma 2: soft-caps, a window on every other layer, post norms.
    "gemma2": ("GemmaBackbone", "GemmaCausalLM",
               dict(head_dim=8, query_head_dim_normalize=False,
                    use_post_ffw_norm=True, use_post_attention_norm=True,
                    final_logit_soft_cap=30.0, attention_logit_soft_cap=2.0,
                    sliding_window_size=4,
                    use_sliding_window_attention=True)),
    # Gemma 3: query/key norms of `1 + w`, a cache of two tensors.
    "gemma3": ("Gemma3Backbone", "Gemma3CausalLM",
               dict(head_dim=8, use_query_key_norm=True, image_size=16,
                    sliding_window_size=4,
                    use_sliding_window_attention=True)),
    # Gemma 3n: `Dense` projections, a weightless value norm, and its last
    # two layers reading the keys and values of the last earlier layer of
    # their kind (its cache layout `(B, 2, K, S, H)`). Its own names.
    "gemma3n": ("Gemma3nBackbone", "Gemma3nCausalLM", dict(
        text_vocab_size=VOCAB, text_hidden_size=32, num_hidden_layers=4,
        pad_token_id=0, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=[16] * 4,
        hidden_activation="gelu_approximate",
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=4, rope_theta=10000.0, max_position_embeddings=64,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=2,
        altup_num_inputs=2, laurel_rank=1, num_kv_shared_layers=2)),
    # Gemma 4: a wider global layer with one key/value head whose keys are
    # its values, rotating the first half of each half of a head; its last
    # two layers reading an earlier layer's keys and values.
    "gemma4": ("Gemma4Backbone", "Gemma4CausalLM", dict(
        vocabulary_size=VOCAB, num_layers=4, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=32, intermediate_dim=16,
        head_dim=8, global_head_dim=16, sliding_window_size=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2, num_global_key_value_heads=1,
        global_rope_partial_rotary_factor=0.5, image_size=16)),
}
# The families whose extra config is the whole config (their own names).
WHOLE_CONFIGS = ("gemma3n", "gemma4")
# The families whose backbone takes `position_ids`.
TAKE_POSITIONS = ("gemma4",)


def _model(family, seed=0):
    backbone_name, lm_name, extra = FAMILIES[family]
    backbone_class = getattr(keras_hub.models, backbone_name)
    parameters = inspect.signature(backbone_class.__init__).parameters
    sizes = {} if family in WHOLE_CONFIGS else dict(SIZES)
    if "num_query_heads" not in parameters and sizes:  # SmolLM3's, BLOOM's
        heads = sizes.pop("num_query_heads")
        sizes["num_attention_heads" if "num_attention_heads" in parameters
              else "num_heads"] = heads
    if "num_key_value_heads" not in parameters and sizes:
        del sizes["num_key_value_heads"]
    backbone = backbone_class(**sizes, **extra)
    rng = np.random.default_rng(seed)
    for weight in backbone.weights:
        weight.assign(rng.normal(scale=0.3, size=weight.shape)
                      .astype(weight.dtype))
    return getattr(keras_hub.models, lm_name)(backbone=backbone,
                                              preprocessor=None)


def _attention(block):
    return next(getattr(block, name) for name in hub._BLOCK_ATTRIBUTES
                if getattr(block, name, None) is not None)


def _blocks(model):
    """The decoder blocks (Gemma 3n's are its text model's)."""
    backbone = model.backbone
    return getattr(backbone, "language_model", backbone).transformer_layers


def _softmax_blocks(model):
    """The blocks that hold softmax attention (Qwen3.5's others hold
    linear attention)."""
    return [block for block in _blocks(model)
            if any(getattr(block, name, None) is not None
                   for name in hub._BLOCK_ATTRIBUTES)]


def _query_kernel(attention):
    """The query projection's kernel variable (through SmolLM3's view of
    its `Dense` once swapped; GPT-NeoX's fused one)."""
    layer = next(getattr(attention, name) for name in (
        "_query_dense", "query_dense", "q_proj", "_qkv_dense")
        if getattr(attention, name, None) is not None)
    return getattr(layer, "dense", layer).kernel


def _inputs(family=None):
    """Two prompts of 5 and 3 tokens, padded to `LENGTH`; Gemma 4's
    backbone also takes each token's position."""
    rng = np.random.default_rng(1)
    ids = np.zeros((2, LENGTH), "int32")
    mask = np.zeros((2, LENGTH), bool)
    for row, length in enumerate((5, 3)):
        ids[row, :length] = rng.integers(3, VOCAB, length)
        mask[row, :length] = True
    inputs = {"token_ids": ids, "padding_mask": mask}
    if family in TAKE_POSITIONS:
        inputs["position_ids"] = np.broadcast_to(
            np.arange(LENGTH, dtype="int32"), ids.shape).copy()
    return inputs


def _generate(model, inputs):
    """Greedy tokens. Gemma 3's, 3n's and 4's `generate` cannot take token
    ids without a preprocessor in keras-hub 0.32; their `generate_step`,
    which `generate` compiles, can."""
    model.compile(sampler="greedy")
    if isinstance(model, (keras_hub.models.Gemma3CausalLM,
                          keras_hub.models.Gemma3nCausalLM,
                          keras_hub.models.Gemma4CausalLM)):
        return to_numpy(model.generate_step(dict(inputs),
                                            stop_token_ids=None)["token_ids"])
    return model.generate(inputs, stop_token_ids=None)["token_ids"]


def _logits(model, inputs):
    """The logits at the real tokens (a padded query may see no key)."""
    return to_numpy(model(inputs))[inputs["padding_mask"]]


def _assert_logits_close(got, want):
    scale = np.abs(want).max()
    np.testing.assert_allclose(got / scale, want / scale, atol=1e-5)


# One family per naming of keras-hub's sublayers: private projections
# (Llama), public ones (Mixtral), query/key norms (Qwen 3), Gemma's, sinks
# held by the layer itself (gpt-oss), `Dense` projections (SmolLM3), an
# output `Dense` under our own private name (BLOOM).
NAMINGS = ["llama", "mixtral", "qwen3", "gemma3", "gpt_oss", "smollm3",
           "bloom", "gpt_neo_x", "qwen3_5", "falcon", "gemma3n", "gemma4"]
# keras-hub's GPT-NeoX rotates a decoding step's query at position 0, so
# its `generate` is not its own full pass's greedy decoding; the swapped
# model's is (`test_gpt_neo_x_steps_are_its_full_pass`).
STEPS_AT_ZERO = ("gpt_neo_x",)


def _greedy(model, inputs):
    """Greedy tokens by full passes, one a position: what `generate`
    gives when each step computes what the full pass computes."""
    ids, mask = inputs["token_ids"].copy(), inputs["padding_mask"].copy()
    for t in range(1, LENGTH):
        rows = ~mask[:, t]
        if rows.any():
            logits = to_numpy(model(dict(inputs, token_ids=ids,
                                         padding_mask=mask)))
            ids[rows, t] = logits[rows, t - 1].argmax(-1)
            mask[rows, t] = True
    return ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_generate_and_weights(family):
    """The same logits and greedy tokens after the swap, on the same
    weight variables; a second `adopt` changes nothing."""
    model, inputs = _model(family), _inputs(family)
    want_logits = _logits(model, inputs)
    want = (_greedy(model, inputs) if family in STEPS_AT_ZERO
            else _generate(model, inputs))
    block = _softmax_blocks(model)[0]
    query = _query_kernel(_attention(block))
    count = len(model.weights)
    assert keras_mha.adopt(model) is model
    for each in _softmax_blocks(model):
        assert isinstance(_attention(each), hub.HubAttention)
    layer = _attention(block)
    assert _query_kernel(layer) is query  # the same variables
    assert len(model.weights) == count
    _assert_logits_close(_logits(model, inputs), want_logits)
    np.testing.assert_array_equal(_generate(model, inputs), want)
    keras_mha.adopt(model)
    assert _attention(block) is layer


def test_gpt_neo_x_steps_are_its_full_pass():
    """A decoding step of the swapped GPT-NeoX gives its full pass's
    logits at that position; keras-hub's own step does not (it rotates
    the step's query at position 0)."""
    ids = _inputs()["token_ids"][:1, :8]
    errors = []
    for swap in (False, True):
        model = _model("gpt_neo_x")
        full = to_numpy(model({"token_ids": ids,
                               "padding_mask": np.ones_like(ids, bool)}))
        if swap:
            keras_mha.adopt(model)
        heads = SIZES["num_query_heads"]
        cache = ops.zeros((1, SIZES["num_layers"], 2, ids.shape[1], heads,
                           SIZES["hidden_dim"] // heads))
        _, _, cache = model.call_with_cache(ops.convert_to_tensor(ids),
                                            cache, 0)  # the prefill
        logits, _, _ = model.call_with_cache(
            ops.convert_to_tensor(ids[:, 5:6]), cache, 5)
        scale = np.abs(full[0, 5]).max()
        errors.append(np.abs(to_numpy(logits)[0, 0] - full[0, 5]).max()
                      / scale)
    theirs, ours = errors
    assert theirs > 1e-2 and ours < 1e-5, errors


def test_a_fused_projection_runs_once_a_call(monkeypatch):
    """GPT-NeoX's query, key and value views project a call's input with
    keras-hub's fused `EinsumDense` once, not once a view."""
    model, inputs = keras_mha.adopt(_model("gpt_neo_x")), _inputs()
    dense = _attention(_softmax_blocks(model)[0]).query_dense.dense
    calls = []
    call = type(dense).call

    def spy(self, *args, **kwargs):
        if self is dense:
            calls.append(1)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(type(dense), "call", spy)
    model(inputs)
    assert len(calls) == 1


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3", "gpt_oss",
                                    "gemma3n", "gemma4"])
def test_masks_are_structure(family, monkeypatch):
    """Without a cache a swapped block builds no dense mask: the layer is
    called causal with the padding, and a windowed layer's path at a long
    sequence is the banded one, O(T·w). Gemma 3n's layers that read an
    earlier layer's keys and values too."""
    model, inputs = _model(family), _inputs(family)
    want = _logits(model, inputs)
    keras_mha.adopt(model)
    seen = []
    cls = type(_attention(_blocks(model)[0]))
    call = cls.call

    def spy(self, *args, **kwargs):
        seen.append((kwargs.get("causal"), kwargs.get("attention_mask")))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(cls, "call", spy)
    _assert_logits_close(_logits(model, inputs), want)
    assert len(seen) == len(_blocks(model))
    assert all(causal and mask is None for causal, mask in seen)
    windowed = [_attention(b) for b in _blocks(model)
                if _attention(b).sliding_window is not None]
    assert windowed
    shape = (1, 4096, SIZES["hidden_dim"])
    for layer in windowed:
        assert layer.attention_path(shape, shape, use_causal_mask=True,
                                    key_mask=True) == "banded"


def test_gemma3n_results():
    """A swapped Gemma 3n layer returns `(output, None, cache)`: no
    weights (keras-hub's block never reads them); without a cache, its
    keys and values `(B, 2, K, T, H)`, which a shared layer reads as its
    cache and returns unchanged."""
    model = keras_mha.adopt(_model("gemma3n"))
    source, shared = (_attention(_blocks(model)[i]) for i in (0, 2))
    assert shared.key_value_source == 0
    x = np.random.default_rng(2).normal(size=(2, LENGTH, 32)).astype(
        "float32")
    output, weights, cache = source(x, None)
    assert weights is None and tuple(cache.shape) == (2, 2, 2, LENGTH, 8)
    mask = np.tril(np.ones((LENGTH, LENGTH), bool))[None].repeat(2, 0)
    output, weights, returned = shared(x, mask, cache=cache)
    assert weights is None and returned is cache
    assert tuple(output.shape) == (2, LENGTH, 32)


def test_gemma4_positions():
    """A swapped Gemma 4 turns each token at the `position_ids` its
    backbone is given, as keras-hub's layers do, not at its index."""
    model, inputs = _model("gemma4"), _inputs("gemma4")
    inputs["position_ids"] = inputs["position_ids"] * 2  # not a shift
    want = _logits(model, inputs)
    at_index = _logits(model, _inputs("gemma4"))
    assert np.abs(want - at_index).max() > 1e-3 * np.abs(want).max()
    keras_mha.adopt(model)
    _assert_logits_close(_logits(model, inputs), want)


def test_generate_traces_as_often_as_keras_hubs(monkeypatch):
    """A second `generate` of the same shapes runs the attention's Python
    as often for the swapped model as for keras-hub's: under a compiled
    `generate` (JAX, TensorFlow) not at all, no new trace; eagerly
    (torch), once a layer and step for both."""
    counts = {}

    def counting(cls, key):
        call = cls.call

        def spy(self, *args, **kwargs):
            counts[key] = counts.get(key, 0) + 1
            return call(self, *args, **kwargs)

        monkeypatch.setattr(cls, "call", spy)

    theirs = _model("llama")
    ours = keras_mha.adopt(_model("llama"))
    counting(type(_attention(theirs.backbone.transformer_layers[0])),
             "theirs")
    counting(hub.HubAttention, "ours")
    inputs = _inputs()
    for model in (theirs, ours):
        _generate(model, inputs)
    counts.clear()
    again = dict(inputs, token_ids=np.roll(inputs["token_ids"], 1, axis=1))
    for model in (theirs, ours):
        model.generate(again, stop_token_ids=None)  # compiled already
    assert counts.get("ours", 0) == counts.get("theirs", 0), counts


# keras-hub's own Gemma 3n, saved and loaded, holds state outside its
# weights: two loads of one file give different logits on JAX and
# TensorFlow. Its loaded weights are compared instead.
LOADS_OTHER_STATE = ("gemma3n",)


@pytest.mark.parametrize("family", NAMINGS)
def test_save_and_load(family, tmp_path):
    """The saved model's weights sit at keras-hub's paths: it loads as
    keras-hub's model, computing the same (holding the same weights)."""
    model, inputs = _model(family), _inputs(family)
    keras_mha.adopt(model)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    if family in LOADS_OTHER_STATE:
        want = {w.path: to_numpy(w) for w in model.weights}
        got = {w.path: to_numpy(w) for w in loaded.weights}
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        return
    _assert_logits_close(_logits(loaded, inputs), _logits(model, inputs))


def test_int8():
    """The projections the layer took over, quantized to int8 in place
    (`EinsumDense.quantize`, which `Model.quantize` calls on each), give
    what keras-hub's quantized attention gives."""
    model, inputs = _model("llama"), _inputs()
    twin = _model("llama")
    keras_mha.adopt(model)
    for each in (model, twin):
        for block in each.backbone.transformer_layers:
            attention = _attention(block)
            for name in ("query", "key", "value", "output"):
                getattr(attention, f"_{name}_dense").quantize("int8")
    assert _attention(model.backbone.transformer_layers[0]).query_dense \
        .quantization_mode == "int8"
    _assert_logits_close(_logits(model, inputs), _logits(twin, inputs))


@pytest.mark.parametrize("family", ["gpt_neo_x", "falcon"])
def test_model_quantize_int8(family):
    """`Model.quantize("int8")` of a swapped model reaches the projections
    the layer took over, through its views (GPT-NeoX's fused one, Falcon's
    output `Dense`), and gives what keras-hub's quantized model gives,
    which is not the float model's."""
    model, twin, inputs = _model(family), _model(family), _inputs(family)
    floats = _logits(twin, inputs)
    keras_mha.adopt(model)
    for each in (model, twin):
        each.quantize("int8")
    want = _logits(twin, inputs)
    _assert_logits_close(_logits(model, inputs), want)
    assert np.abs(want - floats).max() > 1e-3 * np.abs(floats).max()
    query = _attention(_softmax_blocks(model)[0]).sublayer("query")
    assert getattr(query, "dense", query).quantization_mode == "int8"


@pytest.mark.training
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3n", "gemma4"])
def test_a_training_step(family):
    """One SGD step of the swapped model updates every weight as the
    unswapped model's step does (the swapped blocks attend through the
    layer's own paths, without dense masks)."""
    inputs = _inputs(family)
    labels = np.roll(inputs["token_ids"], -1, axis=1)
    weights = []
    for swap in (False, True):
        model = _model(family)
        if swap:
            keras_mha.adopt(model)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        model.train_on_batch(inputs, labels,
                             sample_weight=inputs["padding_mask"])
        weights.append({w.path: to_numpy(w) for w in model.backbone.weights})
    want, got = weights
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, atol=2e-5, rtol=1e-4,
                                   err_msg=path)


@pytest.mark.training
@pytest.mark.parametrize("family", NAMINGS)
def test_lora(family):
    model, inputs = _model(family), _inputs(family)
    want = _logits(model, inputs)
    keras_mha.adopt(model)
    # keras-hub's default targets are `query` and `value`; SmolLM3's and
    # Gemma 3n's projections are `q_proj` and `v_proj`, GPT-NeoX's
    # `query_key_value`.
    targets = {"smollm3": ["q_proj", "v_proj"], "gemma3n": ["q_proj", "v_proj"],
               "gpt_neo_x": ["query_key_value"]}.get(family)
    model.backbone.enable_lora(rank=2, target_layer_names=targets)
    names = [w.path for w in model.trainable_weights]
    assert any("lora" in name for name in names)
    query = targets[0] if targets else "query"
    assert not any(f"{query}/kernel" in name for name in names)
    _assert_logits_close(_logits(model, inputs), want)


class TestErrors:
    def test_m_rope_positions(self):
        """A swapped Qwen3.5 block refuses M-RoPE `position_ids` by name
        (the layer rotates each token at its index)."""
        model = keras_mha.adopt(_model("qwen3_5"))
        layer = _attention(_softmax_blocks(model)[0])
        x = np.zeros((2, LENGTH, SIZES["hidden_dim"]), "float32")
        with pytest.raises(ValueError, match="M-RoPE `position_ids`"):
            layer(x, position_ids=np.zeros((2, 4, LENGTH), "int32"))

    def test_not_keras_hub(self):
        with pytest.raises(ValueError, match="keras-hub `CausalLM`"):
            keras_mha.adopt(keras.Sequential([keras.layers.Dense(2)]))

    def test_unknown_attention_changes_nothing(self, monkeypatch):
        model = _model("llama")
        monkeypatch.delitem(hub.READERS, "LlamaAttention")
        with pytest.raises(ValueError, match="no reader for the "
                           "LlamaAttention"):
            keras_mha.adopt(model)
        assert not any(isinstance(_attention(b), hub.HubAttention)
                       for b in model.backbone.transformer_layers)

    def test_dropout(self):
        backbone = keras_hub.models.LlamaBackbone(**SIZES, dropout=0.1)
        with pytest.raises(ValueError, match=r"dropout=0\.1"):
            keras_mha.adopt(backbone)
