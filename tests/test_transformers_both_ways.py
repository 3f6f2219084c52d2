"""`from_torch` on attention that is not causal: an encoder's
self-attention (BERT) and a decoder's cross-attention over the encoder's
output (BART). Each module runs inside its tiny random model, its inputs
and output captured by hooks; the imported layer, called without
`use_causal_mask` as the module attends, must compute the same.
"""

import numpy as np
import pytest
from hf_models import redraw
from util import to_numpy

import keras_mha

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

BATCH, LENGTH, SOURCE = 2, 7, 9
SIZES = dict(hidden_size=32, num_attention_heads=4, intermediate_size=16,
             vocab_size=16)


def _capture(model, module, inputs, probe=None):
    """`(args, kwargs, output)` of `module`'s call (the output of `probe`,
    a submodule, when given) while `model` runs on `inputs`."""
    seen = {}

    def call(m, args, kwargs, out):
        seen.setdefault("call", (args, kwargs))

    def result(m, args, out):
        seen.setdefault("output", out[0] if isinstance(out, tuple) else out)

    target = probe if probe is not None else module
    handles = [module.register_forward_hook(call, with_kwargs=True),
               target.register_forward_hook(result)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    args, kwargs = seen["call"]
    return args, kwargs, seen["output"].float().numpy()


def _tokens(rng, length):
    return torch.as_tensor(rng.integers(3, 16, size=(BATCH, length)))


def test_encoder_self_attention():
    """BERT's encoder attends both ways; its block's attention ends at
    `output.dense` (see `keras_mha.hf_structure`)."""
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        **SIZES, num_hidden_layers=1, attn_implementation="eager")).eval()
    block = model.encoder.layer[0].attention
    redraw([block], 0.25)
    args, kwargs, output = _capture(
        model, block, {"input_ids": _tokens(np.random.default_rng(0), LENGTH)},
        probe=block.output.dense)
    x = (args[0] if args else kwargs["hidden_states"]).float().numpy()
    layer = keras_mha.from_torch(block, config=model.config)
    got = to_numpy(layer(x, x))
    np.testing.assert_allclose(got, output, atol=2e-5, rtol=1e-5)
    # Not the causal result: the test would see a causal import.
    assert np.abs(to_numpy(layer(x, x, use_causal_mask=True))
                  - output).max() > 1e-3


def test_decoder_cross_attention():
    """BART's decoder attends to the encoder's output: queries from the
    decoder's tokens, keys and values from the source."""
    torch.manual_seed(0)
    config = transformers.BartConfig(
        d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=16, decoder_ffn_dim=16, encoder_layers=1,
        decoder_layers=1, vocab_size=16, attn_implementation="eager")
    model = transformers.BartModel(config).eval()
    cross = model.decoder.layers[0].encoder_attn
    redraw([cross], 0.25)
    rng = np.random.default_rng(1)
    args, kwargs, output = _capture(model, cross, {
        "input_ids": _tokens(rng, SOURCE),
        "decoder_input_ids": _tokens(rng, LENGTH),
    })
    query = (args[0] if args else kwargs["hidden_states"]).float().numpy()
    source = kwargs["key_value_states"].float().numpy()
    layer = keras_mha.from_torch(cross, config=config)
    got = to_numpy(layer(query, source))
    assert got.shape == (BATCH, LENGTH, 32)
    np.testing.assert_allclose(got, output, atol=2e-5, rtol=1e-5)

