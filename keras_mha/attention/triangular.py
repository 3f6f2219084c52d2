"""The triangular path: causal self-attention a block of queries at a time.

Query block `[start, stop)` attends to keys `[0, stop)` only, so of the
`(T, T)` scores just the lower triangle and the diagonal blocks are
computed: about half the FLOPs of the full matrix, and `(B, N, b, T)`
weights alive at a time. Each block is the explicit path on its slice, so
the numbers and the empty-row rule are the explicit path's.
"""

from keras import ops

import keras_mha.attention.explicit as explicit
import keras_mha.attention.masks as masks_lib
import keras_mha.attention.tuning as tuning


def triangular_attention(query, key, value, spec, block_size=None):
    """Causal self-attention as `spec` asks, skipping the upper triangle.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, T, K, H)`.
        value: `(B, T, K, V)`.
        spec: a causal `AttentionSpec` without a window, dense mask,
            dropout or cache (see `dispatch.can_serve`); its bias,
            soft-cap, sinks, ALiBi and segment ids apply block by block.
        block_size: queries per block `b`; the tuning table's
            `triangular_block` if `None`.

    Returns:
        `(B, T, N, V)` in the query's dtype.

    The blocks are a Python loop over static slices: `T` must be static.
    """
    length = explicit.static_self_length("triangular_attention", query, key)
    block_size = block_size or tuning.value("triangular_block", query)
    outputs = []
    for start in range(0, length, block_size):
        stop = min(length, start + block_size)
        mask = masks_lib.spec_mask(
            spec, stop - start, stop, query_start=start
        )  # (B|1, 1, b, stop)
        bias = spec.bias
        if bias is not None:
            bias = masks_lib.block(bias, start, stop, stop)
        output, _ = explicit.masked_attention(
            query[:, start:stop], key[:, :stop], value[:, :stop], mask, spec,
            masks_lib.positions(spec, stop - start, stop, start), bias,
        )
        outputs.append(output)  # (B, b, N, V)
    if len(outputs) == 1:
        return outputs[0]
    return ops.concatenate(outputs, axis=1)
