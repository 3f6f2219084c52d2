"""Attention algorithms as pure functions of projected heads and a spec.

`attend(query, key, value, spec)` is the one entry: the dispatch rule reads
the spec and the shapes and runs one of the paths, each of which builds its
masks from the spec with the position rule of `masks.py`:

- `explicit.py`: materialized `(B, N, T, S)` weights (the reference);
- `fused.py`: `keras.ops.dot_product_attention`;
- `banded.py`: sliding windows in O(T·w);
- `triangular.py`: causal self-attention without the upper triangle;
- `cache.py`: the key/value cache that decoding reads and writes;
- `kernels.py`: backend kernels behind the portable paths' interfaces.

Nothing here imports the layer or the command line.
"""

from keras_mha.attention import dispatch
from keras_mha.attention.banded import banded_attention
from keras_mha.attention.explicit import explicit_attention
from keras_mha.attention.fused import fused_attention
from keras_mha.attention.spec import AttentionSpec
from keras_mha.attention.triangular import triangular_attention


def attend(query, key, value, spec):
    """Attention of `query` over `key`/`value` as `spec` asks.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`, `N % K == 0`.
        value: `(B, S, K, V)`.
        spec: an `AttentionSpec`.

    Returns:
        `(output, weights)`: `(B, T, N, V)` in the query's dtype, and the
        `(B, N, T, S)` weights when `spec.return_weights` (else `None`).
    """
    path = dispatch.choose_path(spec, dispatch.Shapes.of(query, key, value))
    if path == dispatch.EXPLICIT:
        output, weights = explicit_attention(query, key, value, spec)
        return output, weights if spec.return_weights else None
    if path == dispatch.FUSED:
        return fused_attention(query, key, value, spec), None
    if path == dispatch.BANDED:
        return banded_attention(query, key, value, spec), None
    return triangular_attention(query, key, value, spec), None


__all__ = ["AttentionSpec", "attend", "dispatch"]
