"""The norms of a `transformers` attention module, read by running them on
a probe.

A norm must be an RMS norm with `w` or `1 + w` as its scale or none, or a
LayerNorm. Where the module holds it decides what it becomes in the
layer: per-head or per-projection query/key norms (`qk_norm`), Gemma 4's
weightless value norm (`value_norm`), a pre-norm of the block's input
inside the module (`input_norm`: Megatron-BERT, RoBERTa-PreLayerNorm,
XLM-RoBERTa-XL) and a norm of the heads before the output projection
(`output_norm`: BitNet's sub-norm). torch is imported only to probe a
norm, which is a torch module.
"""

import dataclasses

import keras
import numpy as np

from keras_mha import host

# (query, key) norms by the names of the families that use them.
QUERY_KEY_NORMS = (
    ("q_norm", "k_norm"),
    ("q_layernorm", "k_layernorm"),
    ("query_layernorm", "key_layernorm"),
)
# A BERT-style block's norm of its input, before its self-attention.
INPUT_NORMS = ("ln", "LayerNorm", "self_attn_layer_norm")
# A norm of the heads, concatenated, before the output projection.
OUTPUT_NORMS = ("attn_sub_norm",)


@dataclasses.dataclass(frozen=True)
class Norm:
    """A norm, as probed.

    Attributes:
        scale: the scale it multiplies by (`w`, or `1 + w` for a norm that
            stores `w`), `(H,)`, `(heads·H,)` or `(E,)`; `None` for a
            weightless one.
        epsilon: its epsilon.
        bias: a LayerNorm's bias (it centers too), or `None` for an RMS
            norm.
    """

    scale: np.ndarray
    epsilon: float
    bias: np.ndarray = None

    def keras_layer(self):
        """A Keras layer computing this norm over the last axis:
        `LayerNormalization` for one that centers, else `RMSNormalization`;
        built, `set_weights(norm.weights(features))` gives it the
        module's."""
        if self.bias is not None:
            return keras.layers.LayerNormalization(epsilon=self.epsilon)
        return keras.layers.RMSNormalization(epsilon=self.epsilon)

    def weights(self, features):
        """The Keras layer's weights for `features` features: the scale
        (ones for a weightless norm), then the bias of one that
        centers."""
        scale = self.scale
        if scale is None:
            scale = np.ones(features, np.float32)
        return [scale] + ([] if self.bias is None else [self.bias])


def query_key_norms(children, used, name, shared=False, head_dim=None):
    """`(query_norm, key_norm)`: the module's `Norm`s, or `None`s; the
    query's only where `shared` (its keys come normalized). `head_dim`:
    what an L2 norm normalizes (`probe`)."""
    if "qk_norm" in children:  # Llama 4: one weightless norm for both
        used.add("qk_norm")
        norm = probe(children["qk_norm"], name, "qk_norm", head_dim)
        return norm, norm
    for query_name, key_name in QUERY_KEY_NORMS:
        if query_name in children and shared:
            used.add(query_name)
            query = probe(children[query_name], name, query_name, head_dim)
            return query, None
        if query_name in children and key_name in children:
            used.update((query_name, key_name))
            return (probe(children[query_name], name, query_name, head_dim),
                    probe(children[key_name], name, key_name, head_dim))
    return None, None


def value_norm(children, used, name):
    """The weightless `Norm` of a module's `v_norm` (Gemma 4), or `None`."""
    if "v_norm" not in children:
        return None
    used.add("v_norm")
    value_norm = probe(children["v_norm"], name, "v_norm")
    if value_norm.scale is not None or value_norm.bias is not None:
        raise ValueError(
            f"The {name}'s `v_norm` has weights, and the layer's "
            "`value_norm` has none. Received: parameters "
            f"{[n for n, _ in children['v_norm'].named_parameters()]}"
        )
    return value_norm


def one_of(children, names, used, name, features=None):
    """The `Norm` of the first of `names` among the module's `children`
    (`INPUT_NORMS`, `OUTPUT_NORMS`), or `None`; `features`: what an L2
    norm normalizes (`probe`), `None` to refuse one."""
    for attribute in names:
        if attribute in children:
            used.add(attribute)
            return probe(children[attribute], name, attribute, features)
    return None


def _epsilon(norm, owner, attribute):
    """The norm's epsilon under any of the names `transformers` uses."""
    for epsilon_name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, epsilon_name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise ValueError(
        f"The {owner}'s `{attribute}` ({type(norm).__name__}) has no "
        "epsilon under the names `from_torch` reads (`variance_epsilon`, "
        "`eps`, `epsilon`). Received: attributes "
        f"{sorted(k for k in vars(norm) if not k.startswith('_'))}"
    )


def probe(norm, owner, attribute, features=None):
    """Runs the norm on a probe: it must be `x / sqrt(mean(x²) + eps)`
    times `w`, `1 + w` or nothing, `x / sqrt(sum(x²) + eps)` (an L2
    norm, read where the caller gives the `features` it normalizes), or a
    LayerNorm: `(x - mean) / sqrt(var + eps) · w + b`."""
    import torch

    epsilon = _epsilon(norm, owner, attribute)
    weight = getattr(norm, "weight", None)
    params = sorted(n for n, _ in norm.named_parameters())
    shape = getattr(norm, "normalized_shape", None)  # torch's own norms
    width = (int(weight.shape[-1]) if weight is not None
             else int(shape[-1]) if shape else 16)
    sample = np.random.default_rng(0).normal(1.0, 1.0, (2, width))
    with torch.no_grad():
        got = host.to_numpy(norm(torch.as_tensor(sample, dtype=torch.float32)))

    def normalized(x):
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + epsilon)

    candidates = []  # (scale, bias, what the norm would return)
    if not params:
        candidates.append((None, None, normalized(sample)))
        candidates.append(("sum", None, sample / np.sqrt(
            np.sum(sample**2, -1, keepdims=True) + epsilon)))
    if params == ["weight"]:
        w = host.to_numpy(weight).astype(np.float64)
        candidates += [(s, None, normalized(sample) * s) for s in (w, 1.0 + w)]
    if params == ["bias", "weight"]:
        w = host.to_numpy(weight).astype(np.float64)
        b = host.to_numpy(norm.bias).astype(np.float64)
        centered = sample - sample.mean(-1, keepdims=True)
        candidates.append((w, b, normalized(centered) * w + b))
    for scale, bias, want in candidates:
        if np.allclose(got, want, rtol=1e-4, atol=1e-5):
            if isinstance(scale, str):
                return _l2(norm, owner, attribute, epsilon, features)
            as32 = lambda a: None if a is None else a.astype(np.float32)
            return Norm(as32(scale), epsilon, as32(bias))
    raise ValueError(
        f"The {owner}'s `{attribute}` ({type(norm).__name__}) is neither an "
        "RMS norm with a weight `w` or `1 + w` (or none), a weightless L2 "
        "norm nor a LayerNorm, "
        "the norms the layer has. Received: parameters "
        f"{[n for n, _ in norm.named_parameters()]}"
    )


def _l2(norm, owner, attribute, epsilon, features):
    """An L2 norm over `features` (`F`) as the RMS norm the layer computes:
    `x / sqrt(Σx² + eps) = x / sqrt(mean(x²) + eps / F) / sqrt(F)`, a
    scale of `1 / sqrt(F)` and the epsilon `eps / F` (nGPT's, Dory's)."""
    if features is None:
        raise ValueError(
            f"The {owner}'s `{attribute}` ({type(norm).__name__}) is an L2 "
            "norm, `x / sqrt(sum(x²) + eps)`, and the layer's norm there "
            "divides by the root of the mean. Received: an L2 norm"
        )
    return Norm(np.full(features, features**-0.5, np.float32),
                epsilon / features)
