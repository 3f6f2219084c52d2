"""Which attention algorithm runs: the one rule, in one place.

The paths compute the same function (see `attention.py`); this module only
decides which is cheapest given what the call asks for.

1. `explicit` when the weights are needed: `return_attention_scores=True`
   or dropout in training. Also when `H != V` on JAX, whose fused kernel
   requires equal head sizes.
2. `fused` (`keras.ops.dot_product_attention`) otherwise.
"""

import keras

FUSED = "fused"
EXPLICIT = "explicit"
PATHS = (FUSED, EXPLICIT)


def fused_supported(key_dim, value_dim, backend=None):
    """Whether `keras.ops.dot_product_attention` takes these head sizes."""
    backend = backend or keras.backend.backend()
    return key_dim == value_dim or backend != "jax"


def choose_path(
    *,
    return_attention_scores,
    dropout_active,
    key_dim,
    value_dim,
    backend=None,
):
    """Returns the name of the attention path for one call.

    Args:
        return_attention_scores: whether the caller wants the weights.
        dropout_active: whether dropout is applied to the weights.
        key_dim: `H`.
        value_dim: `V`.
        backend: backend name; the active one by default.
    """
    if return_attention_scores or dropout_active:
        return EXPLICIT
    if not fused_supported(key_dim, value_dim, backend):
        return EXPLICIT
    return FUSED
