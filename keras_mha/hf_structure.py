"""A `transformers` attention module read from what it holds.

The projections are found by the names `transformers` gives them (separate
`q_proj`/`k_proj`/`v_proj`, or one fused `qkv_proj`, `Wqkv`, `c_attn`,
`query_key_value`), the head counts and sizes from the config and checked
against the weights' shapes, and the norms are read by running them on a
probe (`hf_norms`). Every parameter and submodule of the module must be
accounted for: one that no feature of the layer reads is refused by name,
since a module that holds more than the layer reads computes more than the
layer does. Nothing here imports `transformers`; torch only for its
`Parameter` type.
"""

import dataclasses
import inspect
import sys

import numpy as np

from keras_mha import hf_differential
from keras_mha import hf_ngpt
from keras_mha import hf_norms
from keras_mha import host

# (query, key, value, outputs): separate projections, by the names of the
# families that use them; the first output name present is the output.
_SEPARATE = (
    ("q_proj", "k_proj", "v_proj", ("o_proj", "out_proj", "dense", "Wo")),
    ("query_proj", "key_proj", "value_proj", ("out_proj",)),
    ("q_lin", "k_lin", "v_lin", ("out_lin",)),
    ("Wq", "Wk", "Wv", ("dense",)),
)
# (fused query-key-value, outputs).
_FUSED = (
    ("qkv_proj", ("o_proj", "out_proj")),
    ("Wqkv", ("out_proj",)),
    ("c_attn", ("c_proj",)),
    ("query_key_value", ("dense",)),
)
GATES = ("gate_proj", "g_proj")
# Submodules that compute nothing the layer must know of.
_INERT = ("Dropout", "Identity", "RotaryEmbedding", "ModuleList")
# Buffers that hold a causal mask or a rotary table the model's own masks
# and rope parameters give again.
_INERT_BUFFERS = ("bias", "masked_bias", "inv_freq")
# Parameters and submodules that no feature of the layer reads, with what
# they do: named in the refusal.
KNOWN_UNSUPPORTED = {
    "indexer": "a lightning indexer that picks the top-k keys per query",
    "o_norm": "a norm on the attention's output",
    "relative_position_bias": "a learned relative position bias",
    "rel_pos_h": "learned relative positions",
    "relative_pos_embeddings": "learned relative positions",
    "r_w_bias": "relative attention (Transformer-XL)",
    "time_decay": "RWKV's recurrence, not softmax attention",
    "experts": "a mixture of attention experts",
    "conv1d": "a convolution inside attention",
    "k_sconv": "a convolution inside attention",
    "A": "a learned dynamic mask (Doge)",
    "s_gate": "gated attention scores",
    "sqk": "scaled query/key products (nGPT's)",
    "gate_bias": "a gate with a separate bias",
    "qk_scale": "a learned scale of the query-key products",
    "ln": "a LayerNorm of the input inside the module",
    "LayerNorm": "a LayerNorm of the input inside the module",
    "self_attn_layer_norm": "a LayerNorm of the input inside the module",
}


@dataclasses.dataclass(frozen=True)
class Dense:
    """One projection as torch computes it: `y = x @ weight.T + bias`.

    Attributes:
        weight: `(out, in)` NumPy array.
        bias: `(out,)` NumPy array or `None`.
    """

    weight: np.ndarray
    bias: np.ndarray = None


@dataclasses.dataclass(frozen=True)
class Structure:
    """What an attention module holds.

    Attributes:
        query, key, value, output: `Dense`; `query` without its gate.
        gate: `Dense` of the output gate, or `None`.
        query_norm, key_norm: `Norm` or `None`.
        sinks: `(N,)` array or `None`.
        fused: the name of a fused query-key-value projection, or `None`.
        value_norm: a weightless `Norm` of the values (Gemma 4), or
            `None`.
        input_norm: a `Norm` of the input inside a BERT-style block
            (Megatron-BERT), or `None`.
        output_norm: a `Norm` of the heads before the output projection
            (BitNet), or `None`.
        shared_key_value: whether the module projects queries only and
            reads an earlier layer's keys and values (`key` and `value`
            are then `None`).
        logit_factor: what the module multiplies its logits by beyond
            its `scaling`: the square of a `qk_scale` buffer that scales
            both queries and keys (Ergo's global layers), else 1.
        differential: `hf_differential.Differential` (DiffLlama; `value`
            then laid out for it), or `None`.
        query_scale: `(N·H,)` factors of the queries after the rotary
            embedding (`hf_ngpt`, Dory), or `None`.
    """

    query: Dense
    key: Dense
    value: Dense
    output: Dense
    gate: Dense = None
    query_norm: hf_norms.Norm = None
    key_norm: hf_norms.Norm = None
    sinks: np.ndarray = None
    fused: str = None
    value_norm: hf_norms.Norm = None
    logit_factor: float = 1.0
    input_norm: hf_norms.Norm = None
    output_norm: hf_norms.Norm = None
    shared_key_value: bool = False
    differential: hf_differential.Differential = None
    query_scale: np.ndarray = None


def read(module, name, head_layout, family, values_are_keys=False):
    """The `Structure` of `module`.

    Args:
        module: the attention module.
        name: its class name, for messages.
        head_layout: `(N, K, H)` from its config.
        family: its `hf_families.Family`.
        values_are_keys: whether the config says a module without a
            `v_proj` takes its values from `k_proj` (Gemma 4's
            `attention_k_eq_v`).

    Raises:
        ValueError: for a module whose projections are not found, whose
            weights contradict `head_layout`, or that holds a parameter or
            submodule the layer does not read (named with its feature).
    """
    children = dict(module.named_children())
    used = set()
    if "self" in children and "output" in children:
        return _bert(module, children, name)
    if list(children) == ["attention"]:  # GPT-Neo: the attention within
        check_all_read(module, children, {"attention"}, name)
        return read(children["attention"], name, head_layout, family,
                    values_are_keys)
    # Gemma 3n's and Gemma 4's last layers: queries only, the keys and
    # values an earlier layer's (`keras_mha.sharing`).
    shared = bool(getattr(module, "is_kv_shared_layer", False))
    if values_are_keys and getattr(module, "v_proj", False) is None:
        children["v_proj"] = children["k_proj"]  # the same projection
    if "q_gate_proj" in children:  # MiniCPM5: queries and gates, per head
        children["q_proj"] = children.pop("q_gate_proj")
    query, key, value, output, fused = _projections(
        module, children, used, name, head_layout, family, shared)
    query, gate = _output_gate(module, children, used, name, head_layout,
                               family, query, output)
    gate = hf_ngpt.folded_gate(module, used, gate)
    norms = hf_norms.query_key_norms(children, used, name, shared,
                                     head_layout[2])
    value_norm = hf_norms.value_norm(children, used, name)
    output_norm = hf_norms.one_of(children, hf_norms.OUTPUT_NORMS, used, name,
                                  output.weight.shape[1])
    value, differential = hf_differential.read(module, children, used, name,
                                               head_layout, value)
    sinks = None
    if isinstance(getattr(module, "sinks", None), _parameter_type()):
        sinks = host.to_numpy(module.sinks)
    logit_factor = 1.0
    if "qk_scale" in dict(module.named_buffers(recurse=False)):
        used.add("qk_scale")
        logit_factor = float(host.to_numpy(module.qk_scale)) ** 2
    query_scale = hf_ngpt.query_scale(module, used, query.weight.shape[0])
    check_all_read(module, children, used | {"sinks"}, name)
    return Structure(query, key, value, output, gate, *norms, sinks, fused,
                     value_norm, logit_factor, output_norm=output_norm,
                     shared_key_value=shared, differential=differential,
                     query_scale=query_scale)


def _projections(module, children, used, name, head_layout, family,
                 shared=False):
    """`(query, key, value, output, fused)`: the module's `Dense`
    projections, the query with its gate rows if it has them, and the name
    of its fused projection (or `None`); no key or value where `shared`."""
    projections = _separate(children, used, name, shared)
    fused = None
    if projections is None and not shared:
        projections, fused = _fused(module, children, used, name,
                                    head_layout, family)
    if projections is None:
        raise ValueError(
            f"The {name} has none of the projections `from_torch` reads "
            "(`q_proj`/`k_proj`/`v_proj`, `qkv_proj`, `Wqkv`, `c_attn` or "
            "`query_key_value`, with an output projection). Received: "
            f"submodules {sorted(children)}"
        )
    query, key, value, output = projections
    if isinstance(getattr(module, "dense_bias", None), _parameter_type()):
        # GPT-NeoX-Japanese's last layer returns its output bias apart,
        # and its block adds it to the output: the layer's output bias.
        used.add("dense_bias")
        output = Dense(output.weight, host.to_numpy(module.dense_bias))
    v_scale = getattr(module, "v_scale", 1.0)  # MiMo-V2-Flash's values
    if isinstance(v_scale, float) and v_scale != 1.0 and value is not None:
        value = Dense(value.weight * v_scale,
                      None if value.bias is None else value.bias * v_scale)
    return query, key, value, output, fused


def _output_gate(module, children, used, name, head_layout, family, query,
                 output):
    """`(query, gate)`: the query without its gate rows (Qwen3-Next), and
    the output gate's `Dense` with one output per head's feature, or
    `None`."""
    gate = None
    num_heads, _, head_dim = head_layout
    if query.weight.shape[0] == 2 * num_heads * head_dim:
        query, gate = _query_gate(query, name, head_layout, family)
    for gate_name in GATES:
        if gate_name in children:
            if not family.separate_gate:
                raise ValueError(
                    f"The {name} has an output gate `{gate_name}` whose "
                    "activation `from_torch` does not know for its family."
                    f" Received: {gate_name}={children[gate_name]}"
                )
            gate = _dense(children[gate_name], name, gate_name)
            used.add(gate_name)
            gate = _gate_per_feature(gate, name, gate_name, num_heads,
                                     output.weight.shape[1])
            bias = getattr(module, "gate_bias", None)
            if isinstance(bias, _parameter_type()) and gate.bias is None:
                # Beam: one bias per head, over its features.
                used.add("gate_bias")
                repeat = gate.weight.shape[0] // bias.shape[0]
                gate = Dense(gate.weight,
                             np.repeat(host.to_numpy(bias), repeat))
    return query, gate


def reordered(structure, order, head_layout):
    """`structure` with each query and key head's features taken in
    `order` `(H,)` (rows of the projections, their biases and the norms'
    weights); the product of a query with a key is unchanged."""
    num_heads, num_kv_heads, head_dim = head_layout

    def rows(array, count):
        if array is None:
            return None
        shaped = array.reshape(count, head_dim, *array.shape[1:])
        return shaped[:, order].reshape(array.shape)

    def dense(d, count):
        if d is None:  # a shared layer's keys (`keras_mha.sharing`)
            return None
        return Dense(rows(d.weight, count), rows(d.bias, count))

    def norm(n, count):
        if n is None:
            return None
        count = 1 if n.scale is None or n.scale.shape[0] == head_dim else count
        return dataclasses.replace(n, scale=rows(n.scale, count),
                                   bias=rows(n.bias, count))

    return dataclasses.replace(
        structure,
        query=dense(structure.query, num_heads),
        key=dense(structure.key, num_kv_heads),
        query_norm=norm(structure.query_norm, num_heads),
        key_norm=norm(structure.key_norm, num_kv_heads),
        query_scale=rows(structure.query_scale, num_heads),
    )


def _gate_per_feature(gate, name, attribute, num_heads, features):
    """The gate's `Dense` with one output per head's feature (`N·V` of
    them): a gate of one output per head (LFM3) gates each of its head's
    features alike, so its rows repeat."""
    rows = gate.weight.shape[0]
    if rows == num_heads and features != num_heads:
        repeat = features // num_heads
        return Dense(np.repeat(gate.weight, repeat, axis=0),
                     None if gate.bias is None
                     else np.repeat(gate.bias, repeat))
    if rows != features:
        raise ValueError(
            f"The {name}'s output gate `{attribute}` has {rows} outputs, "
            f"neither one per head ({num_heads}) nor one per feature of "
            f"the heads ({features}). Received: weight shape "
            f"{tuple(gate.weight.shape)}"
        )
    return gate


def _bert(module, children, name):
    """A BERT-style block: self-attention `self` (`query`, `key`,
    `value`) and `output` (`dense`, then the block's dropout, residual and
    LayerNorm), and a norm of its input where it has one (`INPUT_NORMS`).
    The layer is the attention up to `output.dense`; the residual and the
    LayerNorm stay the block's."""
    inner = dict(children["self"].named_children())
    names = ("query", "key", "value")
    if not all(n in inner for n in names) or not hasattr(children["output"],
                                                          "dense"):
        raise ValueError(
            f"The {name} is a BERT-style block without the `self.query`, "
            "`self.key`, `self.value` and `output.dense` that `from_torch` "
            f"reads. Received: submodules of `self` {sorted(inner)}"
        )
    check_all_read(children["self"], inner, set(names), name)
    used = {"self", "output"}
    input_norm = hf_norms.one_of(children, hf_norms.INPUT_NORMS, used, name)
    check_all_read(module, children, used, name)
    query, key, value = (_dense(inner[n], name, f"self.{n}") for n in names)
    output = _dense(children["output"].dense, name, "output.dense")
    return Structure(query, key, value, output, input_norm=input_norm)


def _parameter_type():
    import torch

    return torch.nn.Parameter


def _dense(module, owner, attribute):
    """`Dense` of a torch `Linear`, of `transformers`' `Conv1D` (GPT-2),
    whose weight is stored `(in, out)`, or of a wrapper that holds one
    `linear` and uses it alone (Moshi's, `use_flexible_linear=False`)."""
    inner = getattr(module, "linear", None)
    if (getattr(module, "use_flexible_linear", None) is False
            and len(list(module.children())) == 1 and inner is not None):
        return _dense(inner, owner, f"{attribute}.linear")
    weight = getattr(module, "weight", None)
    extra = [n for n, _ in module.named_parameters() if n not in ("weight",
                                                                 "bias")]
    if weight is None or weight.ndim != 2 or extra:
        raise ValueError(
            f"The {owner}'s `{attribute}` is a {type(module).__name__}, not "
            "a linear projection, and `from_torch` reads linear ones only. "
            f"Received: parameters {[n for n, _ in module.named_parameters()]}"
        )
    weight = host.to_numpy(weight)
    if type(module).__name__ == "Conv1D":
        weight = weight.T
    bias = getattr(module, "bias", None)
    return Dense(weight, None if bias is None else host.to_numpy(bias))


def _separate(children, used, owner, shared=False):
    """The separate projections `(query, key, value, output)`, or `None`;
    the query and output only (key and value `None`) where `shared`."""
    for query, key, value, outputs in _SEPARATE:
        inputs = (query,) if shared else (query, key, value)
        if not all(n in children for n in inputs):
            continue
        output = next((n for n in outputs if n in children), None)
        if output is None:
            return None
        used.update((*inputs, output))
        return tuple(_dense(children[n], owner, n) if n in inputs + (output,)
                     else None for n in (query, key, value, output))
    return None


def _fused(module, children, used, name, head_layout, family):
    for fused, outputs in _FUSED:
        output = next((n for n in outputs if n in children), None)
        if fused not in children or output is None:
            continue
        used.update((fused, output))
        dense = _dense(children[fused], name, fused)
        query, key, value = _split_fused(dense, name, head_layout,
                                         family.fused_layout,
                                         getattr(module, "mp_num", None))
        return (query, key, value, _dense(children[output], name, output)), fused
    return None, None


def _split_fused(dense, name, head_layout, layout, blocks=None):
    """Queries, keys and values of one fused projection.

    `layout`: `"contiguous"` (all queries, then keys, then values: Phi-3,
    MPT, GPT-2), `"per_head"` (per head, its query, key and value:
    GPT-NeoX, Persimmon) or `"model_parallel"` (CodeGen: `blocks` blocks,
    each its heads' queries, values, then keys).
    """
    num_heads, num_kv_heads, head_dim = head_layout
    rows = dense.weight.shape[0]
    want = (num_heads + 2 * num_kv_heads) * head_dim
    if rows != want:
        raise ValueError(
            f"The {name}'s fused projection has {rows} outputs, and its "
            f"config's heads (N={num_heads}, K={num_kv_heads}, "
            f"H={head_dim}) give (N + 2K)·H = {want}. Received: "
            f"weight shape {tuple(dense.weight.shape)}"
        )
    if layout == "per_head":
        if num_kv_heads != num_heads:
            raise ValueError(
                f"The {name}'s fused projection lays out each head's query, "
                "key and value together, which needs as many key/value "
                f"heads as query heads. Received: N={num_heads}, "
                f"K={num_kv_heads}"
            )
        # Rows (N, 3, H) -> three (N·H) blocks.
        order = np.arange(rows).reshape(num_heads, 3, head_dim)
        index = [order[:, i].reshape(-1) for i in range(3)]
    elif layout == "model_parallel" and blocks and num_kv_heads == num_heads:
        order = np.arange(rows).reshape(blocks, 3, -1)
        index = [order[:, i].reshape(-1) for i in (0, 2, 1)]
    elif layout == "contiguous":
        stops = np.cumsum([num_heads, num_kv_heads, num_kv_heads]) * head_dim
        index = np.split(np.arange(rows), stops[:-1])
    else:
        raise ValueError(
            f"The {name}'s fused projection has a layout `from_torch` does "
            f"not read. Received: layout={layout!r}"
        )
    bias = dense.bias
    return tuple(
        Dense(dense.weight[i], None if bias is None else bias[i])
        for i in index
    )


def _query_gate(query, name, head_layout, family):
    """Qwen3-Next's query projection: per head, `H` query rows then `H`
    gate rows."""
    num_heads, _, head_dim = head_layout
    if family.query_gate != "per_head":
        raise ValueError(
            f"The {name}'s query projection is twice N·H = "
            f"{num_heads * head_dim} wide (an output gate in it?), in a "
            "layout `from_torch` does not know for its family. Received: "
            f"weight shape {tuple(query.weight.shape)}"
        )
    order = np.arange(2 * num_heads * head_dim).reshape(num_heads, 2,
                                                         head_dim)
    parts = []
    for i in range(2):
        rows = order[:, i].reshape(-1)
        bias = None if query.bias is None else query.bias[rows]
        parts.append(Dense(query.weight[rows], bias))
    return tuple(parts)


def check_all_read(module, children, used, name):
    """Refuses a module holding a parameter or submodule not in `used`."""
    unread = [n for n, _ in module.named_parameters(recurse=False)
              if n not in used]
    unread += [n for n, _ in module.named_buffers(recurse=False)
               if n not in used and n not in _INERT_BUFFERS]
    unread += [n for n, child in children.items()
               if n not in used and not any(
                   part in type(child).__name__ for part in _INERT)]
    if not unread:
        return
    features = [KNOWN_UNSUPPORTED[n] for n in unread if n in KNOWN_UNSUPPORTED]
    what = "; ".join(dict.fromkeys(features)) or (
        "parts that no feature of the layer reads")
    raise ValueError(
        f"The {name}: {what} is not supported. Received: a module holding "
        f"{sorted(unread)}"
    )


# What both importers (this layer's and the latent layer's) share.


def forward_parameters(module):
    """The parameters of the module's `forward`, by name."""
    try:
        return inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}


# Positions at which a model's query scale is read (`position_scale`).
_SCALE_POSITIONS = np.array([0, 1, 15, 255, 2047, 4095, 65535, 10**6])


def position_scale(module, name, layer_type):
    """`("power", length, exponent)`: the query scale a model hands its
    layers without RoPE as `attention_scaling`, `(1 + (p + 1) / length) **
    exponent` (the scalable softmax of Beam's NoPE layers). The model
    computes it with its modeling module's `compute_attention_scaling`;
    it is read by evaluating that function at positions from 0 to 10⁶ and
    fitting the form, which must then give every value it gave (to 2e-6);
    anything else is refused by name."""
    refused = ValueError(
        f"The {name}: a query scale that grows with the position is read "
        "as `(1 + (p + 1) / length) ** exponent` (the scalable softmax of "
        "Beam's NoPE layers), from the modeling module's "
        "`compute_attention_scaling`; this one is not of that form or not "
        f"found. Received: layer_type={layer_type!r}")
    compute = getattr(sys.modules.get(type(module).__module__),
                      "compute_attention_scaling", None)
    if not callable(compute):
        raise refused
    import torch

    try:  # the model's own function, called as the model calls it
        with torch.no_grad():
            found = compute(torch.as_tensor(_SCALE_POSITIONS[None]))
        factor = np.asarray(found, np.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as error:
        raise refused from error
    form = _power_form(_SCALE_POSITIONS + 1.0, factor)
    if form is None:
        raise refused
    return ("power", *form)


def _power_form(x, factor):
    """`(length, exponent)` with `(1 + x / length) ** exponent` equal to
    `factor` at every `x` (relative 2e-6), fitted on the last two points
    (the best conditioned) and rounded to 6 digits where that still
    holds; `None` where no such pair does."""
    if factor.shape != x.shape or not np.all(factor > 1.0):
        return None
    low, high = np.log(factor[-2:])
    ratio = high / low

    def spread(length):  # grows with `length`, from 1 toward x1 / x0
        return np.log1p(x[-1] / length) / np.log1p(x[-2] / length)

    if not 1.0 < ratio < x[-1] / x[-2]:
        return None
    bounds = [-20.0, 60.0]  # log(length)
    for _ in range(200):
        middle = sum(bounds) / 2
        bounds[int(spread(np.exp(middle)) > ratio)] = middle
    length = float(np.exp(sum(bounds) / 2))
    exponent = float(high / np.log1p(x[-1] / length))
    for pair in ((float(f"{length:.6g}"), float(f"{exponent:.6g}")),
                 (length, exponent)):
        if np.allclose((1.0 + x / pair[0]) ** pair[1], factor, rtol=2e-6,
                       atol=0.0):
            return pair
    return None


def built_layer(layer_class, fixed, layer_kwargs, name, config, hidden_size):
    """`layer_class(**layer_kwargs, **fixed)`, built for inputs of
    `hidden_size` features: `fixed` holds what the module fixes (a
    `layer_kwargs` entry must agree: `check_fixed_kwargs`), and `dropout`
    is the config's unless given."""
    check_fixed_kwargs(layer_kwargs, name, fixed)
    default_dropout(layer_kwargs, config)
    layer = layer_class(**{**layer_kwargs, **fixed})
    shape = (None, None, hidden_size)
    layer.build(shape, shape)
    return layer


def default_dropout(layer_kwargs, config):
    """The config's attention dropout, unless `dropout` is passed (a config
    may have none: Ernie 4.5, Mllama)."""
    if "dropout" not in layer_kwargs:
        rate = getattr(config, "attention_dropout", None)
        layer_kwargs["dropout"] = float(rate or 0.0)


def check_fixed_kwargs(layer_kwargs, name, fixed):
    """A `ValueError` for a layer argument passed with a value other than
    the one the module fixes."""
    for argument, value in fixed.items():
        if argument not in layer_kwargs:
            continue
        given = layer_kwargs[argument]
        if argument == "output_shape":
            given = host.output_shape(given)
        if argument == "rotary_embedding" or given != value:
            shown = (
                f"RotaryEmbedding(rope_type={value.rope_type!r}, "
                f"max_wavelength={value.max_wavelength})"
                if argument == "rotary_embedding"
                else repr(value)
            )
            raise ValueError(
                f"`{argument}` is fixed by the {name} module to {shown}. "
                f"Received: {argument}={layer_kwargs[argument]!r}"
            )
