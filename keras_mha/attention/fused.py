"""The fused path: `keras.ops.dot_product_attention`, the backend's kernel.

Same arguments and result as `explicit.explicit_attention`, without the
weights and without dropout (the kernels have no seed of ours).
"""

import keras
from keras import ops

import keras_mha.attention.explicit as explicit
import keras_mha.attention.masks as masks_lib


def supported(key_dim, value_dim, backend=None):
    """Whether `keras.ops.dot_product_attention` takes these head sizes."""
    backend = backend or keras.backend.backend()
    return key_dim == value_dim or backend != "jax"


def fused_attention(query, key, value, spec):
    """Attention as `spec` asks, through the backend's fused kernel.

    A spec whose only mask is top-left causal goes to the backend's native
    causal kernel (`is_causal=True`, no mask tensor); any other mask is
    built by `masks.spec_mask` and passed whole.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`.
        value: `(B, S, K, V)`.
        spec: the `AttentionSpec` of the call (no dropout, no weights).

    Returns:
        `(B, T, N, V)` in the query's dtype.
    """
    out_dtype = query.dtype
    query, key, value = explicit.upcast(query, key, value)
    groups = query.shape[2] // key.shape[2]
    if groups > 1 and keras.backend.backend() != "jax":
        # Only JAX's kernel takes grouped heads on every K: Keras's
        # TensorFlow kernel fails for K == 1, its NumPy one for K > 1 (and
        # its torch one repeats the heads itself).
        key = ops.repeat(key, groups, axis=2)  # (B, S, N, H)
        value = ops.repeat(value, groups, axis=2)  # (B, S, N, V)
    mask = has_key = None
    if not spec.plain_causal:
        mask = masks_lib.spec_mask(
            spec, ops.shape(query)[1], ops.shape(key)[1]
        )
    if mask is not None:
        mask, has_key = masks_lib.open_empty_rows(mask)  # has_key (B|1, N|1, T, 1)
    output = ops.dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        scale=spec.scale,
        is_causal=spec.plain_causal,
        flash_attention=spec.flash_attention,
    )  # (B, T, N, V)
    if has_key is not None:
        has_key = ops.transpose(has_key, (0, 2, 1, 3))  # (B|1, T, N|1, 1)
        output = masks_lib.zero_empty_rows(output, has_key)
    return ops.cast(output, out_dtype)
