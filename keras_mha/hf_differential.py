"""A `transformers` module of differential attention read into the layer's
`differential` (`keras_mha.differential`): DiffLlama's.

Such a module holds four `(H,)` vectors `lambda_q1`, `lambda_k1`,
`lambda_q2`, `lambda_k2`, a `lambda_init` and a weightless RMS norm
`groupnorm` over `2H` features. Its values are `H` features wide, and it
splits its `K` value heads in two halves: the heads of key/value group
`j` attend over value heads `j mod K/2` and `K/2 + j mod K/2`, side by
side. The layer's values are `V = 2H` features wide, so its value
projection holds those two heads' rows for each group: the same
products, laid out once. Nothing here imports torch or `transformers`.
"""

import dataclasses

import numpy as np

from keras_mha import hf_norms
from keras_mha import host

VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


@dataclasses.dataclass(frozen=True)
class Differential:
    """What a differential module holds beyond the projections.

    Attributes:
        lambda_init: `λ_init`.
        epsilon: the norm's.
        vectors: the four `(H,)` arrays, in `VECTORS`' order.
    """

    lambda_init: float
    epsilon: float
    vectors: tuple


def read(module, children, used, name, head_layout, value):
    """`(value, differential)`: the value `Dense` laid out for `V = 2H`
    and the module's `Differential`, or `(value, None)` for a module
    without `lambda_q1`."""
    if "lambda_q1" not in dict(module.named_parameters(recurse=False)):
        return value, None
    _, num_kv_heads, head_dim = head_layout
    lambda_init = getattr(module, "lambda_init", None)
    if "groupnorm" not in children or not isinstance(
            lambda_init, (int, float)) or num_kv_heads % 2:
        raise ValueError(
            f"The {name} holds differential attention's `lambda_q1` without"
            " what the layer reads with it: a `groupnorm`, a number "
            "`lambda_init` and an even number of key/value heads. Received:"
            f" submodules {sorted(children)}, lambda_init={lambda_init!r}, "
            f"num_key_value_heads={num_kv_heads}"
        )
    norm = hf_norms.probe(children["groupnorm"], name, "groupnorm")
    if norm.scale is not None or norm.bias is not None:
        raise ValueError(
            f"The {name}'s `groupnorm` has weights, and the layer's "
            "differential norm has none. Received: parameters "
            f"{[n for n, _ in children['groupnorm'].named_parameters()]}"
        )
    used.update(VECTORS + ("groupnorm",))
    vectors = tuple(host.to_numpy(getattr(module, n)) for n in VECTORS)
    return _paired_values(value, num_kv_heads, head_dim), Differential(
        float(lambda_init), norm.epsilon, vectors)


def _paired_values(value, num_kv_heads, head_dim):
    """The value projection with `2H` rows per group `j`: those of value
    heads `j mod K/2` and `K/2 + j mod K/2`."""
    half = num_kv_heads // 2
    order = np.concatenate([
        np.arange(head_dim) + head * head_dim
        for group in range(num_kv_heads)
        for head in (group % half, half + group % half)])
    return dataclasses.replace(
        value, weight=value.weight[order],
        bias=None if value.bias is None else value.bias[order])


def set_weights(layer, differential):
    """Gives the layer's `Differential` sublayer the module's vectors."""
    if differential is None:
        return
    sublayer = layer.differential_layer
    for name, vector in zip(VECTORS, differential.vectors):
        getattr(sublayer, name).assign(vector)
