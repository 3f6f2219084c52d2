"""Every causal-LM family of the pinned `transformers`: `from_torch`
imports each attention module and computes what it computed inside its
model, or refuses it with a `ValueError` that names its class and what is
missing. Never a layer that computes something else.

Each family's tiny model runs whole in torch (`hf_zoo.run`): the model
builds its masks and rotary tables. On torch every family runs; on the
other backends one family per feature (`FEATURES`). The table of families
in docs/importing.md is this test's result, rendered (`render_table`):
`KERAS_MHA_WRITE_ZOO=1 pytest tests/test_zoo.py` writes it.
"""

import functools
import os
import pathlib

import keras
import numpy as np
import pytest
from util import to_numpy

import keras_mha

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
import hf_zoo  # noqa: E402

BACKEND = keras.backend.backend()
DOCS = pathlib.Path(__file__).parent.parent / "docs" / "importing.md"
BEGIN, END = "<!-- zoo table: begin -->", "<!-- zoo table: end -->"
# The fewest families that must import; raised as families are added.
AT_LEAST = 173

# One family per feature, run on every backend.
FEATURES = {
    "llama": "grouped-query heads, RoPE",
    "mistral": "a window on every layer",
    "gemma3_text": "local and global layers, norms of `1 + w`",
    "olmo2": "norms over the whole projection",
    "phi3": "a fused `qkv_proj`, partial rotary",
    "cohere": "interleaved rotary",
    "qwen3_next": "an output gate in the query projection",
    "afmoe": "a separate output gate",
    "gpt_oss": "sinks",
    "mpt": "ALiBi",
    "gpt2": "GPT-2's `Conv1D` projections",
    "gpt_bigcode": "multi-query",
    "bart": "a decoder's attention that keeps no config",
    "bert": "a BERT-style block",
    "deepseek_v3": "multi-head latent attention",
    "llama4_text": "chunks, NoPE layers, query temperature",
    "beam": "a query scale that grows with the position on NoPE layers",
    "hunyuan_v1_dense": "query/key norms after RoPE",
    "codegen": "`rotary_dim`, a fused projection in model-parallel blocks",
    "gemma4_text": "a value norm, proportional RoPE, keys as values, keys "
                   "and values shared from earlier layers",
    "persimmon": "LayerNorm query/key norms",
    "dbrx": "clipped projections",
    "nanochat": "a rotation the other way",
    "gpt_neo": "an attention within, local layers, unscaled logits",
    "lfm3": "an output gate per head",
    "laguna": "a softplus gate per head, partial rotary",
    "mimo_v2_flash": "value heads of their own size, scaled values",
    "roformer": "a BERT-style block with interleaved rotary",
    "megatron-bert": "a LayerNorm of the input inside the block",
    "bitnet": "a norm of the heads before the output projection",
    "diffllama": "differential attention: pairs of heads, subtracted",
    "dory": "L2 norms, a query scale after RoPE, a scaled gate, a norm "
            "after the gate",
}
# Families whose tiny model does not build from their defaults, and why.
NOT_BUILT = {
    "blt": "its tiny model runs over two minutes (byte-level patching)",
    "longcat_flash": "its tiny model fails in its own forward: sizes its "
                     "config does not tie together",
    "mamba2": "its state-space heads do not shrink with the others",
    "qwen4_exp": "its default config has no head sizes (nor its indexer's)",
    "qwen4_exp_text": "its default config has no head sizes (nor its "
                      "indexer's)",
    "reformer": "its LSH attention needs its default chunk sizes",
    "zamba": "its shared blocks do not tie at fewer layers",
}


def _families():
    types = hf_zoo.model_types()
    return types if BACKEND == "torch" else list(FEATURES)


@functools.lru_cache(maxsize=None)
def _calls(model_type):
    return tuple(hf_zoo.run(model_type))


def _import(call, stored):
    """The imported layer's output on the call's input, or the
    `ValueError` of the refusal.

    KV sharing (Gemma 3n, Gemma 4): a layer the model marks as storing
    its keys and values returns ours (`return_key_value=True`) into
    `stored`, by its index, and a shared layer attends over those of the
    layer its `key_value_source` names."""
    try:
        layer = keras_mha.from_torch(call.module, config=call.config)
    except ValueError as error:
        return error
    x, module = call.hidden_states, call.module
    if getattr(module, "is_kv_shared_layer", False):
        return to_numpy(layer(
            x, shared_key_value=stored[layer.key_value_source],
            use_causal_mask=True))
    if getattr(module, "store_full_length_kv", False):
        output, stored[module.layer_idx] = layer(
            x, x, use_causal_mask=True, return_key_value=True)
        return to_numpy(output)
    return to_numpy(layer(x, x, use_causal_mask=True))


@functools.lru_cache(maxsize=None)
def result(model_type):
    """`(status, detail, classes)` of a family: `"imported"` (every
    attention module), `"partly"` (its softmax layers; the others
    refused), `"refused"`, `"not built"` or `"no attention"`."""
    if model_type in NOT_BUILT:
        return "not built", NOT_BUILT[model_type], ()
    calls = _calls(model_type)
    if not calls:
        return "no attention", "no attention module ran", ()
    refusals, classes, stored = [], [], {}
    for call in calls:
        name = type(call.module).__qualname__
        classes.append(name)
        got = _import(call, stored)
        if isinstance(got, ValueError):
            refusals.append(str(got))
            continue
        scale = max(1.0, float(np.max(np.abs(call.output))))
        error = float(np.max(np.abs(got - call.output))) / scale
        assert error < 1e-4, (
            f"{model_type}: {name} imports but computes something else "
            f"(max |difference| {error:.3g} of {scale:.3g})"
        )
    classes = tuple(dict.fromkeys(classes))
    if not refusals:
        return "imported", "", classes
    status = "partly" if len(refusals) < len(calls) else "refused"
    return status, refusals[0], classes


@pytest.mark.parametrize("model_type", _families())
def test_family_imports_or_is_refused_by_name(model_type):
    """Imported modules match their output inside the model; a refused one
    names its class; the outputs compared are not trivial."""
    status, detail, classes = result(model_type)
    if model_type == "blt":
        pytest.skip(NOT_BUILT["blt"])
    if status == "not built":
        with pytest.raises(Exception):  # the list cannot go stale
            _calls(model_type)
        return
    for call in _calls(model_type):
        assert np.std(call.output) > 1e-3, (model_type, "trivial output")
    if status in ("refused", "partly"):
        assert any(name in detail for name in classes), detail
    if model_type in FEATURES:
        assert status == "imported", (model_type, detail)


def test_falcon_with_alibi_is_refused_by_name():
    """Falcon's model with `config.alibi` adds ALiBi's biases divided by
    `sqrt(H)` into the mask its attention module takes: not the layer's
    `use_alibi`, so refused rather than imported without them (its
    default, rotary, imports: `test_family_imports_or_is_refused_by_name`)."""
    model_class, config = hf_zoo.tiny_config("falcon")
    config.alibi = True
    module = hf_zoo.attention_modules(model_class(config))[0]
    with pytest.raises(ValueError, match=r"FalconAttention.*alibi=True"):
        keras_mha.from_torch(module, config=config)


def test_an_l2_norm_where_the_layer_has_none_is_refused_by_name():
    """An L2 norm (Dory's) imports where the layer's norm can hold it as
    an RMS norm with a scale (`hf_norms._l2`); as Gemma 4's weightless
    value norm, which has no scale, it is refused, not read as the RMS
    norm it is not."""
    from transformers.models.dory.modeling_dory import DoryL2Norm

    model_class, config = hf_zoo.tiny_config("gemma4_text")
    module = next(m for m in hf_zoo.attention_modules(model_class(config))
                  if hasattr(m, "v_norm"))
    module.v_norm = DoryL2Norm()
    with pytest.raises(ValueError, match=r"Gemma4TextAttention's `v_norm` "
                       r"\(DoryL2Norm\) is an L2 norm"):
        keras_mha.from_torch(module, config=config)


def test_a_position_scale_of_another_form_is_refused_by_name(monkeypatch):
    """A NoPE layer's query scale is read only as Beam's power form: a
    module whose modeling module computes none, or computes it from other
    arguments, is refused, and so is Llama 4's temperature written as the
    same kind of function."""
    import sys
    import types

    from keras_mha import hf_structure

    class ScaledAttention(torch.nn.Module):
        pass

    refused = (r"ScaledAttention: .*not of that form or not found\. "
               r"Received: layer_type='full'")
    with pytest.raises(ValueError, match=refused):
        hf_structure.position_scale(ScaledAttention(), "ScaledAttention",
                                    "full")
    modeling = types.ModuleType("modeling_scaled")
    modeling.compute_attention_scaling = lambda position_ids, length: None
    monkeypatch.setitem(sys.modules, "modeling_scaled", modeling)
    monkeypatch.setattr(ScaledAttention, "__module__", "modeling_scaled")
    with pytest.raises(ValueError, match=refused):
        hf_structure.position_scale(ScaledAttention(), "ScaledAttention",
                                    "full")
    x = np.array([1.0, 2.0, 16.0, 256.0, 2048.0, 4096.0, 65536.0, 1e6 + 1])
    llama4 = 1.0 + 0.1 * np.log1p(np.floor(x / 8192.0))
    assert hf_structure._power_form(x, llama4) is None
    assert hf_structure._power_form(x, (1.0 + x / 512.0) ** 0.25) == (
        512.0, 0.25)


@pytest.mark.skipif(BACKEND != "torch", reason="the whole zoo runs on torch")
def test_count_and_docs_table():
    """At least `AT_LEAST` families import, and docs/importing.md's table
    is this test's result."""
    table = render_table()
    imported = sum(result(t)[0] in ("imported", "partly")
                   for t in hf_zoo.model_types())
    assert imported >= AT_LEAST, imported
    text = DOCS.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    if os.environ.get("KERAS_MHA_WRITE_ZOO"):
        DOCS.write_text(text[:start] + "\n" + table + text[stop:])
        return
    assert text[start:stop].strip() == table.strip(), (
        "docs/importing.md's family table is out of date: run "
        "KERAS_MHA_WRITE_ZOO=1 pytest tests/test_zoo.py -k docs_table"
    )


def render_table():
    """The families' table of docs/importing.md, with a count."""
    types = hf_zoo.model_types()
    rows = ["| model type | status | attention classes | why not |",
            "|---|---|---|---|"]
    counts = {}
    for model_type in types:
        status, detail, classes = result(model_type)
        counts[status] = counts.get(status, 0) + 1
        why = detail.split(" Received:")[0].replace("|", "\\|")
        why = why.replace("\n", " ")
        if status == "imported":
            why = ""
        names = ", ".join(f"`{c}`" for c in classes)
        rows.append(f"| `{model_type}` | {status} | {names} | {why} |")
    summary = ", ".join(f"{n} {status}" for status, n in sorted(
        counts.items(), key=lambda item: -item[1]))
    head = (f"{len(types)} model types in transformers "
            f"{transformers.__version__}'s causal-LM mapping: {summary}.")
    return head + "\n\n" + "\n".join(rows) + "\n"
