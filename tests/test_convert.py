"""Weight import: our layer computes what the imported layer computes.

`from_torch` against `torch.nn.MultiheadAttention` run by torch itself,
`from_keras` against Keras's layers, and the errors for bad input. Torch's
masks have the opposite polarity of ours (`True` = blocked); every test
converts them explicitly.
"""

import itertools

import keras
import numpy as np
import pytest
from util import to_numpy

import keras_mha
from keras_mha.convert import torch_mask_to_keras

BATCH, QUERY_LENGTH, KEY_LENGTH = 2, 5, 7
EMBED, HEADS = 8, 2
KDIM, VDIM = 6, 10


@pytest.fixture
def torch():
    return pytest.importorskip(
        "torch", reason="torch is not installed: nothing to import from"
    )


def assert_close(actual, expected):
    np.testing.assert_allclose(
        to_numpy(actual), np.asarray(expected), atol=1e-5, rtol=1e-5
    )


def _torch_module(torch, bias=True, batch_first=True, kdim=None, vdim=None,
                  **kwargs):
    """A module with random weights and biases (torch zeroes the biases)."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(
        EMBED, HEADS, bias=bias, batch_first=batch_first, kdim=kdim,
        vdim=vdim, **kwargs,
    )
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape) * 0.5)
    return module.eval()


def _run_torch(torch, module, query, key, value, **masks):
    """The module's output for batch-first NumPy inputs, batch-first."""
    to_torch = lambda x: None if x is None else torch.from_numpy(x)
    query, key, value = map(to_torch, (query, key, value))
    if not module.batch_first:  # (B, T, E) -> (T, B, E)
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    masks = {name: to_torch(mask) for name, mask in masks.items()}
    with torch.no_grad():
        output, _ = module(query, key, value, need_weights=False, **masks)
    if not module.batch_first:
        output = output.transpose(0, 1)
    return output.numpy()


def _inputs(cross, seed=0):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(BATCH, QUERY_LENGTH, EMBED)).astype("float32")
    if not cross:  # self-attention: one tensor, as torch's fast path likes
        return query, query, query
    key = rng.normal(size=(BATCH, KEY_LENGTH, KDIM)).astype("float32")
    value = rng.normal(size=(BATCH, KEY_LENGTH, VDIM)).astype("float32")
    return query, key, value


def _torch_masks(kind, query_length, key_length):
    """Torch's masks, True = blocked; no query is left without keys."""
    masks = {}
    if "padding" in kind:
        padding = np.zeros((BATCH, key_length), bool)
        padding[1, -2:] = True  # the second sequence ends two keys early
        masks["key_padding_mask"] = padding
    if "causal" in kind:
        masks["attn_mask"] = np.triu(
            np.ones((query_length, key_length), bool), k=1
        )
    return masks


CONFIGS = list(
    itertools.product(
        [True, False],  # bias
        [True, False],  # batch_first
        ["packed", "kdim_vdim"],
        ["no_mask", "padding", "causal", "padding_causal"],
    )
)


class TestFromTorch:
    @pytest.mark.parametrize(
        "bias, batch_first, dims, masks",
        CONFIGS,
        ids=[
            f"{'bias' if b else 'no_bias'}-"
            f"{'batch_first' if f else 'seq_first'}-{d}-{m}"
            for b, f, d, m in CONFIGS
        ],
    )
    def test_matches_module(self, torch, bias, batch_first, dims, masks):
        cross = dims == "kdim_vdim"
        module = _torch_module(
            torch, bias=bias, batch_first=batch_first,
            kdim=KDIM if cross else None, vdim=VDIM if cross else None,
        )
        query, key, value = _inputs(cross)
        torch_masks = _torch_masks(masks, QUERY_LENGTH, key.shape[1])
        expected = _run_torch(torch, module, query, key, value, **torch_masks)

        layer = keras_mha.from_torch(module)
        ours = {}
        if "key_padding_mask" in torch_masks:
            ours["value_mask"] = ~torch_masks["key_padding_mask"]
        output = layer(
            query, value, key=key, use_causal_mask="causal" in masks, **ours
        )
        assert_close(output, expected)

    @pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
    def test_mask_helper(self, torch, cross):
        module = _torch_module(
            torch, kdim=KDIM if cross else None, vdim=VDIM if cross else None
        )
        query, key, value = _inputs(cross, seed=1)
        masks = _torch_masks("padding_causal", QUERY_LENGTH, key.shape[1])
        # Float masks: -inf = blocked.
        masks = {
            name: np.where(mask, -np.inf, 0.0).astype("float32")
            for name, mask in masks.items()
        }
        expected = _run_torch(torch, module, query, key, value, **masks)
        attention_mask = torch_mask_to_keras(**masks)
        output = keras_mha.from_torch(module)(
            query, value, key=key, attention_mask=attention_mask
        )
        assert_close(output, expected)

    def test_per_head_attn_mask(self, torch):
        module = _torch_module(torch)
        query, key, value = _inputs(cross=False, seed=2)
        rng = np.random.default_rng(3)
        blocked = rng.random((BATCH * HEADS, QUERY_LENGTH, QUERY_LENGTH)) < 0.5
        blocked[..., 0] = False  # every query keeps a key
        expected = _run_torch(
            torch, module, query, key, value, attn_mask=blocked
        )
        attention_mask = torch_mask_to_keras(attn_mask=blocked, num_heads=HEADS)
        assert attention_mask.shape == (
            BATCH, HEADS, QUERY_LENGTH, QUERY_LENGTH
        )
        output = keras_mha.from_torch(module)(
            query, value, attention_mask=attention_mask
        )
        assert_close(output, expected)

    @pytest.mark.parametrize(
        "cross", [False, True], ids=["packed", "kdim_vdim"]
    )
    def test_state_dict(self, torch, cross):
        module = _torch_module(
            torch, kdim=KDIM if cross else None, vdim=VDIM if cross else None
        )
        from_module = keras_mha.from_torch(module)
        from_tensors = keras_mha.from_torch(
            module.state_dict(), num_heads=HEADS
        )
        from_arrays = keras_mha.from_torch(
            {k: v.numpy() for k, v in module.state_dict().items()},
            num_heads=HEADS,
        )
        for layer in (from_tensors, from_arrays):
            for a, b in zip(layer.get_weights(), from_module.get_weights()):
                np.testing.assert_array_equal(a, b)

    def test_layer_arguments(self, torch):
        module = _torch_module(torch, dropout=0.25)
        layer = keras_mha.from_torch(module)
        assert layer.dropout == 0.25
        assert (layer.num_heads, layer.key_dim, layer.value_dim) == (
            HEADS, EMBED // HEADS, EMBED // HEADS
        )
        layer = keras_mha.from_torch(
            module, dropout=0.0, name="imported", flash_attention=False,
            num_heads=HEADS, key_dim=EMBED // HEADS,
        )
        assert (layer.name, layer.dropout, layer.flash_attention) == (
            "imported", 0.0, False
        )
        assert layer.built


def _torch_forward(state, num_heads, query, key, value):
    """torch's `multi_head_attention_forward` in float64 NumPy, no masks."""
    f64 = {name: np.asarray(w, "float64") for name, w in state.items()}
    w_q, w_k, w_v = np.split(f64["in_proj_weight"], 3)
    b_q, b_k, b_v = np.split(f64["in_proj_bias"], 3)
    q, k, v = query @ w_q.T + b_q, key @ w_k.T + b_k, value @ w_v.T + b_v
    split = lambda x: x.reshape(*x.shape[:2], num_heads, -1)  # (B, T, N, H)
    q, k, v = split(q), split(k), split(v)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = np.einsum("bnts,bsnh->btnh", weights, v)
    context = context.reshape(*context.shape[:2], -1)  # (B, T, E)
    return context @ f64["out_proj.weight"].T + f64["out_proj.bias"]


def _numpy_state_dict(embed=EMBED, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {
        "in_proj_weight": (3 * embed, embed),
        "in_proj_bias": (3 * embed,),
        "out_proj.weight": (embed, embed),
        "out_proj.bias": (embed,),
    }
    return {
        name: rng.normal(scale=0.5, size=shape).astype("float32")
        for name, shape in shapes.items()
    }


def test_numpy_state_dict_without_torch():
    state = _numpy_state_dict()
    query, key, value = _inputs(cross=False, seed=4)
    layer = keras_mha.from_torch(state, num_heads=HEADS)
    expected = _torch_forward(state, HEADS, query, key, value)
    assert_close(layer(query, value), expected)


class TestFromTorchErrors:
    def test_state_dict_needs_num_heads(self):
        with pytest.raises(ValueError, match="needs `num_heads=`"):
            keras_mha.from_torch(_numpy_state_dict())

    @pytest.mark.parametrize(
        "name, shape",
        [
            ("in_proj_weight", (23, 8)),
            ("in_proj_weight", (24,)),
            ("in_proj_bias", (16,)),
            ("out_proj.weight", (8, 6)),
            ("out_proj.bias", (1, 8)),
        ],
    )
    def test_misshapen(self, name, shape):
        state = _numpy_state_dict()
        state[name] = np.zeros(shape, "float32")
        with pytest.raises(ValueError) as info:
            keras_mha.from_torch(state, num_heads=HEADS)
        message = str(info.value)
        assert f"Received: {name}.shape={shape}" in message
        if name != "in_proj_weight":  # its own shape sets embed_dim
            assert f"expected {name}.shape=" in message

    def test_misshapen_separate_weights(self):
        state = _numpy_state_dict()
        del state["in_proj_weight"]
        state["q_proj_weight"] = np.zeros((8, 8), "float32")
        state["k_proj_weight"] = np.zeros((7, 6), "float32")
        state["v_proj_weight"] = np.zeros((8, 10), "float32")
        with pytest.raises(
            ValueError,
            match=r"expected k_proj_weight.shape=\(8, 6\). "
            r"Received: k_proj_weight.shape=\(7, 6\)",
        ):
            keras_mha.from_torch(state, num_heads=HEADS)

    @pytest.mark.parametrize("name", ["out_proj.weight", "out_proj.bias"])
    def test_missing(self, name):
        state = _numpy_state_dict()
        del state[name]
        with pytest.raises(ValueError, match=rf"Missing: \['{name}'\]"):
            keras_mha.from_torch(state, num_heads=HEADS)

    def test_prefixed_keys(self):
        state = {f"attn.{k}": v for k, v in _numpy_state_dict().items()}
        with pytest.raises(ValueError, match="unexpected: .*attn.in_proj_bias"):
            keras_mha.from_torch(state, num_heads=HEADS)

    def test_heads_must_divide(self):
        with pytest.raises(ValueError, match="num_heads=3, embed_dim=8"):
            keras_mha.from_torch(_numpy_state_dict(), num_heads=3)

    @pytest.mark.parametrize(
        "name, value",
        [("key_dim", 8), ("use_bias", False), ("use_gate", True),
         ("output_shape", 4), ("num_key_value_heads", 1)],
    )
    def test_fixed_argument(self, name, value):
        with pytest.raises(ValueError, match=f"Received: {name}={value}"):
            keras_mha.from_torch(
                _numpy_state_dict(), num_heads=2, **{name: value}
            )

    def test_fixed_argument_with_the_weights_value(self):
        layer = keras_mha.from_torch(
            _numpy_state_dict(), num_heads=2, key_dim=4, output_shape=EMBED
        )
        assert layer.key_dim == 4

    def test_bias_kv_in_state_dict(self):
        state = _numpy_state_dict()
        state["bias_k"] = state["bias_v"] = np.zeros((1, 1, 8), "float32")
        with pytest.raises(ValueError, match="add_bias_kv"):
            keras_mha.from_torch(state, num_heads=HEADS)

    @pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn"])
    def test_unsupported_options(self, torch, option):
        module = torch.nn.MultiheadAttention(EMBED, HEADS, **{option: True})
        with pytest.raises(ValueError, match=f"Received: {option}=True"):
            keras_mha.from_torch(module)

    def test_other_module(self, torch):
        with pytest.raises(
            ValueError, match="Received: .* of type torch.nn.modules.linear"
        ):
            keras_mha.from_torch(torch.nn.Linear(4, 4))

    def test_not_a_module(self):
        with pytest.raises(ValueError, match="of type builtins.list"):
            keras_mha.from_torch([np.zeros((24, 8))], num_heads=2)

    def test_num_heads_differs_from_module(self, torch):
        module = torch.nn.MultiheadAttention(EMBED, HEADS)
        with pytest.raises(ValueError, match="num_heads=4, module.num_heads=2"):
            keras_mha.from_torch(module, num_heads=4)

    def test_mask_helper_rejects_biases(self):
        with pytest.raises(ValueError, match="attn_mask"):
            torch_mask_to_keras(attn_mask=np.full((2, 2), 0.5, "float32"))

    def test_mask_helper_needs_heads_for_3d(self):
        with pytest.raises(ValueError, match="num_heads=None"):
            torch_mask_to_keras(attn_mask=np.zeros((4, 2, 2), bool))


def _randomize(layer, seed=0):
    rng = np.random.default_rng(seed)
    layer.set_weights(
        [
            rng.normal(scale=0.5, size=w.shape).astype("float32")
            for w in layer.get_weights()
        ]
    )
    return layer


def _no_empty_rows_mask(query_length, key_length, seed=0):
    """(B, T, S), True = may attend; every query keeps key `t` (in any
    window) and key 0 (Keras's fused path differs on empty rows)."""
    rng = np.random.default_rng(seed)
    mask = rng.random((BATCH, query_length, key_length)) < 0.6
    mask[..., 0] = True
    for t in range(query_length):
        mask[:, t, min(t, key_length - 1)] = True
    return mask


KERAS_MHA_CASES = {
    "plain": dict(num_heads=2, key_dim=4),
    "no_bias_gate": dict(num_heads=2, key_dim=4, use_bias=False, use_gate=True),
    "output_shape": dict(num_heads=2, key_dim=3, output_shape=5),
    "sliding_window": dict(num_heads=2, key_dim=4, sliding_window=2),
}


class TestFromKeras:
    @pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
    @pytest.mark.parametrize("case", list(KERAS_MHA_CASES))
    def test_multi_head_attention(self, case, cross):
        query, key, value = _inputs(cross, seed=5)
        theirs = keras.layers.MultiHeadAttention(
            **KERAS_MHA_CASES[case], kernel_initializer="zeros", name="mha"
        )
        theirs.build(query.shape, value.shape, key.shape)
        _randomize(theirs)
        mask = _no_empty_rows_mask(QUERY_LENGTH, key.shape[1])
        expected = theirs(query, value, key=key, attention_mask=mask)

        ours = keras_mha.from_keras(theirs)
        assert type(ours) is keras_mha.MultiHeadAttention
        assert ours.name == "mha" and ours.built
        output = ours(query, value, key=key, attention_mask=mask)
        assert_close(output, to_numpy(expected))

    @pytest.mark.parametrize("window", [None, 3])
    def test_group_query_attention(self, window):
        query, key, value = _inputs(cross=False, seed=6)
        theirs = keras.layers.GroupQueryAttention(
            head_dim=4, num_query_heads=4, num_key_value_heads=2,
            sliding_window=window, kernel_initializer="zeros",
        )
        theirs.build(query.shape, value.shape)
        _randomize(theirs)
        mask = _no_empty_rows_mask(QUERY_LENGTH, QUERY_LENGTH)
        expected = theirs(query, value, attention_mask=mask)

        ours = keras_mha.from_keras(theirs)
        assert type(ours) is keras_mha.GroupedQueryAttention
        assert (ours.num_query_heads, ours.num_key_value_heads) == (4, 2)
        output = ours(query, value, attention_mask=mask)
        assert_close(output, to_numpy(expected))

    def test_called_in_a_model(self):
        inputs = keras.Input((QUERY_LENGTH, EMBED))
        theirs = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)
        theirs(inputs, inputs)
        ours = keras_mha.from_keras(theirs, flash_attention=False)
        assert (ours.dropout, ours.flash_attention) == (0.1, False)
        for a, b in zip(ours.get_weights(), theirs.get_weights()):
            np.testing.assert_array_equal(a, b)

    def test_unbuilt(self):
        with pytest.raises(ValueError, match="built=False"):
            keras_mha.from_keras(keras.layers.MultiHeadAttention(2, 4))

    def test_other_layer(self):
        with pytest.raises(ValueError, match="of type keras.*Dense"):
            keras_mha.from_keras(keras.layers.Dense(3))

    def test_fixed_argument(self):
        theirs = keras.layers.MultiHeadAttention(2, 4)
        theirs.build((1, 3, 8), (1, 3, 8))
        with pytest.raises(ValueError, match="Received: num_heads=4"):
            keras_mha.from_keras(theirs, num_heads=4)
