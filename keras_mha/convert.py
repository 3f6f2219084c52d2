"""Weight import: PyTorch's and Keras's attention layers -> `keras_mha` layers.

The weights are reshaped on the host with NumPy, once; the layer that comes
back is built and computes what the source layer computes (same scale
`1/sqrt(H)`, same head order). Only the weights and the arguments that
change the function are copied.

PyTorch's `nn.MultiheadAttention` differs from this package in two ways that
the importer cannot hide, and callers convert explicitly:

- layout: with `batch_first=False` a module takes `(T, B, E)`; our layer is
  always batch-first, `(B, T, E)`.
- masks: `key_padding_mask` (`True` = ignore) and a boolean `attn_mask`
  (`True` = not allowed) have the opposite polarity of ours (`True` = may
  attend); see `torch_mask_to_keras`.
"""

import collections.abc
import sys

import keras
import numpy as np

from keras_mha import checks
from keras_mha import host
from keras_mha import huggingface
from keras_mha.grouped import GroupedQueryAttention
from keras_mha.layer import MultiHeadAttention

_PACKED_KEYS = ("in_proj_weight",)
_SEPARATE_KEYS = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
_BIAS_KEYS = ("in_proj_bias", "out_proj.bias")


def from_torch(module_or_state_dict, **layer_kwargs):
    """Builds a `MultiHeadAttention` from a `torch.nn.MultiheadAttention`.

    Also takes `transformers`' attention modules, read by their structure
    and config (see `keras_mha.huggingface.from_transformers` for what is
    read, docs/importing.md for every family), with `config=` for a
    module that keeps none; DeepSeek's latent attention comes back as a
    `keras_mha.MultiHeadLatentAttention`.

    Query, key and value projections (packed `in_proj_weight`, or
    `q_proj_weight`/`k_proj_weight`/`v_proj_weight` when `kdim`/`vdim`
    differ from `embed_dim`), their biases and `out_proj` are copied, so that
    for `(B, T, E)` inputs the layer's output equals the module's with
    `batch_first=True` (transpose `(T, B, E)` inputs of a module with
    `batch_first=False`). The module's `dropout` is copied too.

    Works on every backend: a module needs torch installed, a state dict of
    NumPy arrays does not.

    Args:
        module_or_state_dict: a `torch.nn.MultiheadAttention`, or its
            `state_dict()` (tensors or arrays, keys without a prefix), or
            one of the `transformers` modules above.
        **layer_kwargs: more `MultiHeadAttention` arguments (`name`,
            `dtype`, `flash_attention`, `dropout`, ...). `num_heads` is
            required with a state dict, which does not record it. Arguments
            fixed by the weights (`key_dim`, `value_dim`, `use_bias`,
            `use_gate`, `num_key_value_heads`, `output_shape`) may be passed
            only with the values the weights give.

    Returns:
        A built `keras_mha.MultiHeadAttention` with `N = num_heads` heads of
        `H = V = E // N`, taking query `(B, T, E)`, value `(B, S, vdim)` and
        key `(B, S, kdim)`.

    Raises:
        ValueError: for another module type, `add_bias_kv` or
            `add_zero_attn` (no counterpart here), a state dict without
            `num_heads`, or missing, unexpected or misshapen tensors.
    """
    if huggingface.is_transformers_attention(module_or_state_dict):
        return huggingface.from_transformers(
            module_or_state_dict, **layer_kwargs
        )
    if isinstance(module_or_state_dict, collections.abc.Mapping):
        state = dict(module_or_state_dict)
        if "num_heads" not in layer_kwargs:
            raise ValueError(
                "`from_torch` needs `num_heads=` with a state dict, which "
                "does not record the number of heads. Received: "
                f"layer_kwargs={layer_kwargs}"
            )
    else:
        module = module_or_state_dict
        _check_torch_module(module)
        num_heads = layer_kwargs.setdefault("num_heads", module.num_heads)
        if num_heads != module.num_heads:
            raise ValueError(
                "`num_heads` must match the module's. Received: "
                f"num_heads={num_heads}, module.num_heads={module.num_heads}"
            )
        layer_kwargs.setdefault("dropout", float(module.dropout))
        state = module.state_dict()
    state = {name: host.to_numpy(tensor) for name, tensor in state.items()}
    num_heads = layer_kwargs["num_heads"]
    checks.positive_int("num_heads", num_heads)
    dims = _check_state_dict(state, num_heads)
    embed_dim, key_features, value_features = dims
    head_dim = embed_dim // num_heads
    use_bias = "in_proj_bias" in state
    if host.output_shape(layer_kwargs.get("output_shape")) == (embed_dim,):
        del layer_kwargs["output_shape"]  # the default: the query's size
    _check_fixed_kwargs(
        layer_kwargs,
        key_dim=head_dim,
        value_dim=head_dim,
        use_bias=use_bias,
        use_gate=False,
        num_key_value_heads=num_heads,
        output_shape=None,
    )
    layer_kwargs.update(key_dim=head_dim, value_dim=head_dim, use_bias=use_bias)
    layer = MultiHeadAttention(**layer_kwargs)
    layer.build(
        (None, None, embed_dim),
        (None, None, value_features),
        (None, None, key_features),
    )

    if "in_proj_weight" in state:
        w_q, w_k, w_v = np.split(state["in_proj_weight"], 3)  # each (E, E)
    else:
        w_q, w_k, w_v = (state[name] for name in _SEPARATE_KEYS)
    biases = (
        np.split(state["in_proj_bias"], 3) if use_bias else (None,) * 3
    )  # each (E,)

    def heads(weight, bias):
        # torch: y = x @ W.T + b, head n = features n*H:(n+1)*H.
        kernel = weight.T.reshape(weight.shape[1], num_heads, head_dim)
        if bias is None:
            return [kernel]  # (E_in, N, H)
        return [kernel, bias.reshape(num_heads, head_dim)]  # + (N, H)

    layer.query_dense.set_weights(heads(w_q, biases[0]))
    layer.key_dense.set_weights(heads(w_k, biases[1]))
    layer.value_dense.set_weights(heads(w_v, biases[2]))
    output = [
        state["out_proj.weight"].T.reshape(num_heads, head_dim, embed_dim)
    ]  # (N, V, E)
    if use_bias:
        output.append(state["out_proj.bias"])  # (E,)
    layer.output_dense.set_weights(output)
    return layer


def from_keras(layer, **layer_kwargs):
    """Copies a built Keras attention layer into the matching `keras_mha` one.

    `keras.layers.MultiHeadAttention` gives a `MultiHeadAttention` and
    `keras.layers.GroupQueryAttention` a `GroupedQueryAttention`, with the
    same config (name, dtype policy, dropout, window, ...) and weights, built
    for the same input shapes.

    Args:
        layer: a built `keras.layers.MultiHeadAttention` or
            `keras.layers.GroupQueryAttention`.
        **layer_kwargs: arguments that override the config, e.g.
            `flash_attention=False` or `name=`; not those that change the
            weights' shapes.

    Returns:
        The `keras_mha` layer, built, with the weights of `layer`.

    Raises:
        ValueError: for another layer type or an unbuilt layer.
    """
    if isinstance(layer, keras.layers.GroupQueryAttention):
        target = GroupedQueryAttention
        shape_args = ("head_dim", "num_query_heads", "num_key_value_heads")
    elif isinstance(layer, keras.layers.MultiHeadAttention):
        target = MultiHeadAttention
        shape_args = ("num_heads", "key_dim", "value_dim", "output_shape")
    else:
        raise ValueError(
            "`from_keras` takes a `keras.layers.MultiHeadAttention` or a "
            "`keras.layers.GroupQueryAttention`. Received: layer of type "
            f"{_type_name(layer)}"
        )
    if not layer.built:
        raise ValueError(
            "`from_keras` needs a built layer (call it once or `build` it) to "
            f"copy its weights. Received: layer={layer.name!r}, built=False"
        )
    config = layer.get_config()
    fixed = {
        name: config[name] for name in shape_args + ("use_bias", "use_gate")
    }
    if target is MultiHeadAttention:
        fixed["num_key_value_heads"] = config["num_heads"]
    _check_fixed_kwargs(layer_kwargs, **fixed)
    config.update(layer_kwargs)
    ours = target.from_config(config)
    ours.build_from_config(layer.get_build_config())
    # Both Keras layers keep their projections under these names; the
    # grouped one has no public properties for them.
    names = ["_query_dense", "_key_dense", "_value_dense", "_output_dense"]
    if config["use_gate"]:
        names.append("_gate_dense")
    for name in names:
        getattr(ours, name).set_weights(getattr(layer, name).get_weights())
    return ours


def torch_mask_to_keras(key_padding_mask=None, attn_mask=None, num_heads=None):
    """PyTorch's masks -> one boolean `attention_mask`, `True` = may attend.

    Args:
        key_padding_mask: `(B, S)`, boolean (`True` = ignore this key) or
            float (added to the scores: `-inf` = ignore, `0` = keep).
        attn_mask: `(T, S)` or `(B * N, T, S)`, boolean (`True` = not
            allowed) or float as above.
        num_heads: `N`; needed for a 3-D `attn_mask`.

    Returns:
        A NumPy boolean array for our layer's `attention_mask`, `(T, S)`,
        `(B, 1, S)`, `(B, T, S)` or `(B, N, T, S)`, whichever the inputs
        need; `None` if both are `None`.

    Raises:
        ValueError: for float masks with values other than `0` and `-inf`
            (an additive bias has no boolean form), or a 3-D `attn_mask`
            without `num_heads`.
    """
    allowed = None
    if key_padding_mask is not None:
        keep = _keep(key_padding_mask, "key_padding_mask")
        allowed = keep[:, None, :]  # (B, 1, S)
    if attn_mask is not None:
        keep = _keep(attn_mask, "attn_mask")
        if keep.ndim == 3:
            if num_heads is None:
                raise ValueError(
                    "A 3-D `attn_mask` (B * N, T, S) needs `num_heads`. "
                    f"Received: attn_mask.shape={keep.shape}, num_heads=None"
                )
            keep = keep.reshape(-1, num_heads, *keep.shape[1:])  # (B,N,T,S)
            if allowed is not None:
                allowed = allowed[:, None]  # (B, 1, 1, S)
        allowed = keep if allowed is None else np.logical_and(allowed, keep)
    return allowed


def _keep(mask, name):
    mask = host.to_numpy(mask)
    if mask.dtype == bool:
        return np.logical_not(mask)
    blocked = np.isneginf(mask)
    if not np.all(blocked | (mask == 0)):
        raise ValueError(
            f"A float `{name}` can only be converted when it holds 0 and "
            "-inf: other values are biases on the scores, not a mask. "
            f"Received: {name} with values in [{mask.min()}, {mask.max()}]"
        )
    return np.logical_not(blocked)


def _check_torch_module(module):
    torch = sys.modules.get("torch")  # a torch object means torch is loaded
    if torch is None or not isinstance(module, torch.nn.MultiheadAttention):
        raise ValueError(
            "`from_torch` takes a `torch.nn.MultiheadAttention` or its state "
            "dict. Received: module_or_state_dict of type "
            f"{_type_name(module)}"
        )
    unsupported = [
        f"{name}=True"
        for name, used in (
            ("add_bias_kv", module.bias_k is not None),
            ("add_zero_attn", module.add_zero_attn),
        )
        if used
    ]
    if unsupported:
        raise ValueError(
            "`add_bias_kv` and `add_zero_attn` have no counterpart in "
            "`keras_mha.MultiHeadAttention`. Received: "
            + ", ".join(unsupported)
        )


def _check_state_dict(state, num_heads):
    """Checks keys and shapes; returns `(E, kdim, vdim)`."""
    if "bias_k" in state or "bias_v" in state:
        raise ValueError(
            "`add_bias_kv` has no counterpart in "
            "`keras_mha.MultiHeadAttention`. Received: a state dict with "
            "`bias_k`/`bias_v`"
        )
    packed = "in_proj_weight" in state
    weight_keys = _PACKED_KEYS if packed else _SEPARATE_KEYS
    use_bias = any(name in state for name in _BIAS_KEYS)
    expected_keys = (
        weight_keys + ("out_proj.weight",) + (_BIAS_KEYS if use_bias else ())
    )
    missing = [name for name in expected_keys if name not in state]
    unexpected = sorted(set(state) - set(expected_keys))
    if missing or unexpected:
        raise ValueError(
            "The state dict of a `torch.nn.MultiheadAttention` needs "
            f"{list(expected_keys)}. Missing: {missing}; unexpected: "
            f"{unexpected}. Received: keys={sorted(state)}"
        )

    def last_dim(name):
        shape = state[name].shape
        return shape[-1] if shape else 0

    if packed:
        embed_dim = key_features = value_features = last_dim("in_proj_weight")
        expected = {"in_proj_weight": (3 * embed_dim, embed_dim)}
    else:
        embed_dim = last_dim("q_proj_weight")
        key_features = last_dim("k_proj_weight")
        value_features = last_dim("v_proj_weight")
        expected = {
            "q_proj_weight": (embed_dim, embed_dim),
            "k_proj_weight": (embed_dim, key_features),
            "v_proj_weight": (embed_dim, value_features),
        }
    expected["out_proj.weight"] = (embed_dim, embed_dim)
    if use_bias:
        expected["in_proj_bias"] = (3 * embed_dim,)
        expected["out_proj.bias"] = (embed_dim,)
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"`{name}` has the wrong shape for embed_dim={embed_dim}: "
                f"expected {name}.shape={shape}. Received: "
                f"{name}.shape={tuple(state[name].shape)}"
            )
    if embed_dim % num_heads:
        raise ValueError(
            "`num_heads` must divide the embedding size. Received: "
            f"num_heads={num_heads}, embed_dim={embed_dim}"
        )
    return embed_dim, key_features, value_features


def _check_fixed_kwargs(layer_kwargs, **fixed):
    for name, value in fixed.items():
        if name not in layer_kwargs:
            continue
        given = layer_kwargs[name]
        if name == "output_shape":
            given, value = host.output_shape(given), host.output_shape(value)
        if given != value:
            raise ValueError(
                f"`{name}` is fixed by the weights to {value!r}. Received: "
                f"{name}={layer_kwargs[name]!r}"
            )




def _type_name(obj):
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
