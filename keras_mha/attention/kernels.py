"""Backend kernels behind the interfaces of the portable paths.

Only what measurably beats the `keras.ops` version lives here, and each
function computes exactly what its portable twin computes (the tests run
both against the same reference).

torch: `banded_core` hands the blocks of the band to
`torch.nn.functional.scaled_dot_product_attention`, whose fused kernels
(flash attention on CPU, memory-efficient attention on GPU) never write the
`(b, span)` scores of a block to memory. On a 2-core CPU this made the
banded forward about 2x faster and the backward about 1.5x faster than the
`keras.ops` version at `T = 16384`, `w = 128` (see `banded.py`). Sinks and
a causal band's ALiBi ride along as extra features (whole layer at that
size: forward 1.37x and 1.16x the plain layer, against 1.9x and 1.8x on
the portable core); a soft-cap runs as torch products when differentiating
(forward+backward 1.41x plain, portable core 2.0x).

Cache writes (`cache.py`): `ops.slice_update` copies the whole cache in an
eager call (torch clones it; JAX arrays are immutable), O(L) per token.
`write_slots` writes the `T` new slots in place instead: torch's `copy_`
into the slots, and on JAX a jitted `dynamic_update_slice` that donates the
cache, so XLA reuses its buffer. Measured on the 2-core CPU (one token,
8 heads of 64, p = 1024): a step in a 65,536-slot cache went from 368 to
3.2 ms on torch and from 102 to about the 2,048-slot time on JAX.

Each function imports its backend: the module is imported only by the
paths that use it, on that backend.
"""

import functools


def banded_core(query, key, value, mask, scale, band, alibi=None,
                sinks=None, soft_cap=None):
    """`banded._portable_core` with torch's fused attention kernel.

    With a soft-cap, which the fused kernel cannot apply, the blocks run as
    plain torch matrix products instead (`_capped_blocks`): one batched
    product for all blocks, the cap, ALiBi, the mask and the softmax with
    the sinks, without the portable core's chunk loop.

    ALiBi (causal bands) and sinks ride along as extra features, so the
    kernel still never writes the scores. In a block, query row `r` and
    span key `s` are `before + r - s` apart, and ALiBi's `-m·(before + r -
    s)` is `m·s` plus a constant of the row, which the softmax ignores:
    the queries get a feature `m_h` and the keys `s / scale`. A sink is
    one more key per span, of value 0, whose only feature `1` meets the
    queries' feature `sink_h / scale`.

    Args:
        query: `(B, n·b, N, H)`, float32 or float64.
        key: `(B, S, K, H)`.
        value: `(B, S, K, V)`.
        mask: boolean `(B|1, n, b, span)`, every row with at least one
            key (`masks.open_empty_rows`): the kernels answer an empty row
            with NaN or the mean of the values depending on the version.
        scale: multiplies the logits.
        band: the `banded._Band` geometry.
        alibi: `None`, or the `N` slopes (a causal band only without a
            soft-cap).
        sinks: `None`, or the `(N,)` sink logits.
        soft_cap: `None`, or `c > 0`.

    Returns:
        `(B, n·b, N, V)`; rows without keys are finite and zeroed by the
        caller.
    """
    import torch

    batch, padded_len, num_heads, head = query.shape
    num_kv, value_head = key.shape[2], value.shape[3]
    groups = num_heads // num_kv
    n, b, span = band.num_blocks, band.block, band.span
    # The query blocks become the kernel's "heads" and the grouped query
    # heads extra rows: (B·K, n, G·b, H) against keys (B·K, n, span, H), so
    # keys are never repeated per group.
    q = query.reshape(batch, n, b, num_kv, groups, head)
    q = q.permute(0, 3, 1, 4, 2, 5).reshape(batch * num_kv, n, groups * b, head)
    k = _spans(key, band)  # (B·K, n, span, H)
    v = _spans(value, band)  # (B·K, n, span, V)
    mask_batch = mask.shape[0]
    mask = mask[:, None, :, None].expand(mask_batch, num_kv, n, groups, b, span)
    if mask_batch == 1:
        mask = mask[:, 0].reshape(1, n, groups * b, span)  # broadcast over B·K
    else:
        mask = mask.reshape(batch * num_kv, n, groups * b, span)
    before = band.query_offset - band.frame_start  # L·b
    if soft_cap is not None:
        out = _capped_blocks(
            q, k, v, mask, scale, soft_cap, alibi, sinks,
            (batch, num_kv, groups, b), before,
        )
    elif alibi is not None or sinks is not None:
        q, k, v, mask = _with_logit_features(
            q, k, v, mask, scale, alibi, sinks, (batch, num_kv, groups, b),
            before,
        )
    if soft_cap is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale
        )[..., :value_head]  # (B·K, n, G·b, V)
    out = out.reshape(batch, num_kv, n, groups, b, value_head)
    out = out.permute(0, 2, 4, 1, 3, 5)  # (B, n, b, K, G, V)
    return out.reshape(batch, padded_len, num_heads, value_head)


def _capped_blocks(q, k, v, mask, scale, cap, alibi, sinks, sizes, before):
    """The blocks' attention with a soft-cap, in torch matrix products:
    `(B·K, n, G·b, H)` queries over `(B·K, n, span, H)` keys."""
    import torch

    batch, num_kv, groups, b = sizes
    rows, n, span = q.shape[0], q.shape[1], k.shape[2]
    scores = torch.matmul(q * scale, k.transpose(-1, -2))  # (B·K, n, G·b, span)
    scores = torch.tanh(scores / cap) * cap
    if alibi is not None:
        slopes = torch.tensor(alibi, dtype=q.dtype, device=q.device)
        r = before + torch.arange(b, dtype=q.dtype, device=q.device)
        distance = (r[:, None] - torch.arange(span, device=q.device)).abs()
        term = -slopes.reshape(num_kv, groups, 1, 1) * distance  # (K, G, b, s)
        term = term.reshape(1, num_kv, 1, groups * b, span)
        term = term.expand(batch, num_kv, 1, groups * b, span)
        scores = scores + term.reshape(rows, 1, groups * b, span)
    scores = scores.masked_fill(~mask, float("-inf"))  # no row is empty
    if sinks is not None:
        sink = sinks.to(q.dtype).reshape(1, num_kv, 1, groups, 1)
        sink = sink.expand(batch, num_kv, n, groups, b)
        scores = torch.cat(
            [scores, sink.reshape(rows, n, groups * b, 1)], dim=-1
        )
        weights = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, v)  # (B·K, n, G·b, V)


def _with_logit_features(q, k, v, mask, scale, alibi, sinks, sizes, before):
    """`banded_core`'s operands with the ALiBi and sink features.

    The keys' ALiBi feature drops `-m·(before + r)` from every key of row
    `r`; the sink, a logit of its own, gets it back: its feature is
    `(sink_h + m_h·(before + r)) / scale`.
    """
    import torch

    batch, num_kv, groups, b = sizes
    rows, n, span = q.shape[0], q.shape[1], k.shape[2]

    def per_row(values):  # (K, G, b) -> (B·K, n, G·b, 1)
        x = values.to(q.dtype).reshape(1, num_kv, 1, groups, b)
        x = x.expand(batch, num_kv, n, groups, b)
        return x.reshape(rows, n, groups * b, 1)

    q_parts, k_parts = [q], [k]
    slopes = None
    if alibi is not None:
        slopes = torch.tensor(alibi, dtype=q.dtype, device=q.device)
        slopes = slopes.reshape(num_kv, groups, 1)
        q_parts.append(per_row(slopes.expand(num_kv, groups, b)))
        position = torch.arange(span, dtype=q.dtype, device=q.device) / scale
        k_parts.append(position.reshape(1, 1, span, 1).expand(rows, n, span, 1))
    sink_feature = None
    if sinks is not None:
        sink_feature = q.shape[-1] + len(q_parts) - 1
        sink = sinks.to(q.dtype).reshape(num_kv, groups, 1).expand(
            num_kv, groups, b
        )
        if slopes is not None:
            row = before + torch.arange(b, dtype=q.dtype, device=q.device)
            sink = sink + slopes * row
        q_parts.append(per_row(sink / scale))
        k_parts.append(k.new_zeros(rows, n, span, 1))
    # Features padded with zeros to a multiple of 8, and the values to the
    # same size: torch's CPU flash kernel takes only equal query and value
    # sizes, and otherwise falls back to its math kernel (measured at
    # T = 16384: 4x slower with 72 query features against 64 values).
    pad = -(len(q_parts) - 1) % 8
    if pad:
        q_parts.append(q.new_zeros(rows, n, q.shape[2], pad))
        k_parts.append(k.new_zeros(rows, n, span, pad))
    q, k = torch.cat(q_parts, dim=-1), torch.cat(k_parts, dim=-1)
    if v.shape[-1] < q.shape[-1]:
        v = torch.cat(
            [v, v.new_zeros(v.shape[:-1] + (q.shape[-1] - v.shape[-1],))],
            dim=-1,
        )
    if sinks is not None:
        sink_key = k.new_zeros(rows, n, 1, k.shape[-1])
        sink_key[..., sink_feature] = 1.0
        k = torch.cat([k, sink_key], dim=2)  # (B·K, n, span + 1, H + ...)
        v = torch.cat([v, v.new_zeros(rows, n, 1, v.shape[-1])], dim=2)
        visible = mask.new_ones(mask.shape[:-1] + (1,))
        mask = torch.cat([mask, visible], dim=-1)
    return q, k, v, mask


def _spans(x, band):
    """Keys `(B, S, K, X)` -> spans `(B·K, n, span, X)`."""
    import torch

    batch, _, num_kv, features = x.shape
    first, last, before, after = band.frame_bounds()
    # One copy moves the heads forward and pads the frame: (B, K, F, X).
    parts = [x[:, first:last].permute(0, 2, 1, 3)]
    if before:
        parts.insert(0, x.new_zeros((batch, num_kv, before, features)))
    if after:
        parts.append(x.new_zeros((batch, num_kv, after, features)))
    x = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0].contiguous()
    n, b = band.num_blocks, band.block
    if not (torch.is_grad_enabled() and x.requires_grad):
        # Consecutive spans overlap: a strided view reads each key block in
        # place. Its backward (`as_strided`) is slow, so training copies.
        return x.as_strided(
            (batch * num_kv, n, band.span, features),
            (band.frame_len * features, b * features, features, 1),
        )
    x = x.reshape(batch * num_kv, band.frame_blocks, b, features)
    shifted = [x[:, d : d + n] for d in range(band.span_blocks)]
    return torch.cat(shifted, dim=2).reshape(
        batch * num_kv, n, band.span, features
    )


def write_slots(cache, new, start, axis=1):
    """`cache` with `new` written into slots `[start, start + T)` of
    `axis` (`T = new.shape[axis]`), in place where the backend allows it.

    torch: the same tensor comes back. JAX (eager calls only): the cache
    passed in is donated and must not be used again. `start` is an int or
    a scalar tensor whose range the caller checked.
    """
    import keras

    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            cache.narrow(axis, int(start), new.shape[axis]).copy_(new)
        return cache
    return _jax_update(axis)(cache, new.astype(cache.dtype), start)


def can_write_slots(cache):
    """Whether `write_slots` serves this cache: torch without gradients,
    or a concrete (not traced) JAX array."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        return not cache.requires_grad
    if backend == "jax":
        import jax

        return not isinstance(cache, jax.core.Tracer)
    return False


@functools.lru_cache(maxsize=4)
def _jax_update(axis):
    import jax

    @functools.partial(jax.jit, donate_argnums=(0,))
    def update(cache, new, start):
        zero = jax.numpy.zeros((), "int32")
        starts = [zero] * cache.ndim
        starts[axis] = jax.numpy.asarray(start, "int32")
        return jax.lax.dynamic_update_slice(cache, new, tuple(starts))

    return update
