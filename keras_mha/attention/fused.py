"""The fused paths: `keras.ops.dot_product_attention`, the backend's kernel,
and JAX's kernel with its own window (`fused_window_attention`).

Same arguments and result as `explicit.explicit_attention`, without the
weights and without dropout (the kernels have no seed of ours).
"""

from keras import ops

import keras_mha.attention.capabilities as capabilities
import keras_mha.attention.explicit as explicit
import keras_mha.attention.logits as logits
import keras_mha.attention.masks as masks_lib
import keras_mha.attention.tuning as tuning


def supported(key_dim, value_dim, backend=None):
    """Whether `keras.ops.dot_product_attention` takes these head sizes."""
    same = key_dim == value_dim
    return same or capabilities.fused_takes_other_value_size(backend)


def fused_attention(query, key, value, spec):
    """Attention as `spec` asks, through the backend's fused kernel.

    A spec whose only mask is top-left causal goes to the backend's native
    causal kernel (`is_causal=True`, no mask tensor); any other mask is
    built by `masks.spec_mask` and passed whole. A bias or ALiBi is passed
    as the kernel's `bias`, with the mask folded in (torch's kernel takes
    one or the other). Sinks become one more key of zeros whose logit is
    the head's sink: it joins every row's denominator and adds nothing to
    the output. The kernels have no soft-cap off TPUs (see
    `dispatch.can_serve`).

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`.
        value: `(B, S, K, V)`.
        spec: the `AttentionSpec` of the call (no dropout, no weights, no
            soft-cap).

    Returns:
        `(B, T, N, V)` in the query's dtype.
    """
    out_dtype = query.dtype
    query, key, value = explicit.upcast(query, key, value)
    num_heads = query.shape[2]
    groups = num_heads // key.shape[2]
    if groups > 1 and not capabilities.fused_takes_grouped_heads():
        key = ops.repeat(key, groups, axis=2)  # (B, S, N, H)
        value = ops.repeat(value, groups, axis=2)  # (B, S, N, V)
    t_len, s_len = ops.shape(query)[1], ops.shape(key)[1]
    positions = (None, None)
    if spec.alibi is not None:  # the only term that reads them
        positions = masks_lib.positions(spec, t_len, s_len)
    term = logits.dense_term(
        spec, *positions, spec.bias, query.dtype
    )  # (B|1, N|1, T, S) or None
    native_causal = (
        spec.plain_causal and term is None and spec.sinks is None
    )
    mask = has_key = None
    if not native_causal:
        mask = masks_lib.spec_mask(spec, t_len, s_len,
                                   batch_size=ops.shape(query)[0],
                                   num_heads=num_heads)
    if spec.sinks is not None:
        key, value, mask, term = _with_sink_key(
            query, key, value, mask, term, spec.sinks
        )
    elif mask is not None and capabilities.fused_masks_finitely():
        has_key = masks_lib.has_any_key(mask)  # (B|1, N|1, T, 1)
    elif mask is not None:
        mask, has_key = masks_lib.open_empty_rows(mask)  # has_key (B|1, N|1, T, 1)
    if term is not None and mask is not None:
        term = ops.where(mask, term, ops.cast(logits.MASKED_LOGIT, term.dtype))
        mask = None
    flash = spec.flash_attention
    if flash is None and capabilities.compiling_one_graph():
        # Keras's check for flash attention builds torch's `SDPAParams`, a
        # graph break; unpinned, torch's SDPA picks its kernel itself.
        flash = False
    output = ops.dot_product_attention(
        query,
        key,
        value,
        bias=term,
        mask=mask,
        scale=spec.scale,
        is_causal=native_causal,
        flash_attention=flash,
    )  # (B, T, N, V)
    if has_key is not None:
        has_key = ops.transpose(has_key, (0, 2, 1, 3))  # (B|1, T, N|1, 1)
        output = masks_lib.zero_empty_rows(output, has_key)
    return ops.cast(output, out_dtype)


def _with_sink_key(query, key, value, mask, term, sinks):
    """Keys and values with one more of zeros, and the mask and term with
    its column: always visible, logit = the head's sink (`q·0 = 0`)."""
    batch, t_len = ops.shape(query)[0], ops.shape(query)[1]
    num_heads = query.shape[2]
    key = _pad_one(key)  # (B, S + 1, K|N, H)
    value = _pad_one(value)  # (B, S + 1, K|N, V)
    s_len = ops.shape(key)[1] - 1
    lead = 1
    for x in (mask, term):
        if x is not None and x.shape[0] != 1:
            lead = batch
    if term is None:
        term = ops.zeros((1, 1, 1, 1), query.dtype)
    term = ops.broadcast_to(term, (lead, num_heads, t_len, s_len))
    sink = ops.broadcast_to(
        ops.reshape(ops.cast(sinks, query.dtype), (1, num_heads, 1, 1)),
        (lead, num_heads, t_len, 1),
    )
    term = ops.concatenate([term, sink], axis=-1)  # (B|1, N, T, S + 1)
    if mask is not None:
        mask = ops.broadcast_to(mask, (lead, mask.shape[1], t_len, s_len))
        visible = ops.ones((lead, mask.shape[1], t_len, 1), "bool")
        mask = ops.concatenate([mask, visible], axis=-1)
    return key, value, mask, term


def _pad_one(x):
    return ops.pad(x, [(0, 0), (0, 1), (0, 0), (0, 0)])


def fused_window_attention(query, key, value, spec):
    """Sliding-window attention in `jax.nn.dot_product_attention`, the
    window passed as its `local_window_size`.

    JAX's `(left, right)` is ours: query `t` sees keys `t - left <= j <=
    t + right`, top-left aligned as our positions are without a cache, and
    `is_causal` ANDs `j <= t`. Its `implementation=None` is XLA's dense
    softmax with the window as a mask; on a GPU, half-precision inputs and
    a one-sided window (`right = 0`, which `causal` implies) at `T = S` go
    to `implementation="cudnn"` first, cuDNN's flash kernel, which skips
    the keys outside the window and keeps its softmax in float32; where
    cuDNN refuses the call, XLA's runs it.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`.
        value: `(B, S, K, H)`.
        spec: a window without padding, dense mask, bias, soft-cap, sinks,
            ALiBi, weights or dropout, keys at their own positions, and
            every query with a key (see `dispatch.can_serve`).

    Returns:
        `(B, T, N, H)` in the query's dtype.
    """
    import jax

    out_dtype = query.dtype
    kwargs = dict(
        scale=spec.scale,
        is_causal=bool(spec.causal),
        local_window_size=tuple(int(side) for side in spec.window),
    )
    if _cudnn_window(query, key, spec):
        try:
            return jax.nn.dot_product_attention(
                query, key, value, implementation="cudnn", **kwargs
            )
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # cuDNN absent, or the shapes are not its
    query, key, value = explicit.upcast(query, key, value)
    output = jax.nn.dot_product_attention(query, key, value, **kwargs)
    return ops.cast(output, out_dtype)


def _cudnn_window(query, key, spec):
    """Whether cuDNN's flash kernel may take the window: on a GPU, half
    precision, `T = S`, and no keys to the right (its window is
    `(p - w, p]`)."""
    return (
        tuning.device_platform(query) == tuning.GPU
        and ops.dtype(query) in ("float16", "bfloat16")
        and query.shape[1] == key.shape[1]
        and (spec.causal or spec.window[1] == 0)
    )
