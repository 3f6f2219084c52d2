"""Backend kernels behind the interfaces of the portable paths.

Only what measurably beats the `keras.ops` version lives here, and each
function computes exactly what its portable twin computes (the tests run
both against the same reference).

torch: `banded_core` hands the blocks of the band to
`torch.nn.functional.scaled_dot_product_attention`, whose fused kernels
(flash attention on CPU, memory-efficient attention on GPU) never write the
`(b, span)` scores of a block to memory. On CPU this makes the banded
forward and backward faster than the `keras.ops` version, which writes
every block's scores (see `banded.py`; the numbers are in
docs/performance.md). The mask and ALiBi go in as an additive bias of one
`(b, span)` block shared by the band's interior blocks; sinks join the
softmax through the flash kernel's log-sum-exp; a soft-cap runs as torch
products a few blocks at a time with a backward of its own, and without a
gradient a head at a time on views of the projections (the features table
of docs/performance.md measures each).

`project`: `EinsumDense`'s einsum and bias as one `torch.addmm`
(`projections.Projection`); `rotate_half` and `rotate_pairs`: the rotary
embedding in place, in either layout.
The cache's in-place writes are in `cache_kernels.py`, the decode step's
kernels in `decode_kernels.py`.

Each function imports its backend: the module is imported only by the
paths that use it, on that backend.
"""

import functools
import math

import keras_mha.attention.tuning as tuning


def differentiated(*tensors):
    """Whether torch's grad mode is on and one of `tensors` needs a grad."""
    import torch

    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in tensors
    )


def project(x, kernel, bias, bound_dims):
    """`x·kernel + bias` over `x`'s last `bound_dims` axes, one `addmm`.

    `kernel` is `(*bound, *out)` and `bias` `(*out)`, as `EinsumDense`
    holds them for the layer's equations; returns `(*x_free, *out)`.
    """
    import torch

    free = x.shape[: x.ndim - bound_dims]
    inner = math.prod(kernel.shape[:bound_dims])
    out = torch.addmm(
        bias.reshape(-1), x.reshape(-1, inner), kernel.reshape(inner, -1)
    )
    return out.reshape(*free, *kernel.shape[bound_dims:])


def banded_core(query, key, value, mask, scale, band, alibi=None,
                sinks=None, soft_cap=None):
    """`banded._portable_core` with torch's fused attention kernel.

    The mask becomes an additive bias (`0` or `-inf`), with ALiBi's exact
    `-m_h·|p - j|` added: the band's interior blocks share one mask, so
    one `(b, span)` block of bias serves them (`_mask_parts`). Sinks use
    the flash kernel's log-sum-exp (`sink_attention`). With a soft-cap,
    which the fused kernel cannot apply, the blocks run as torch matrix
    products a few query blocks at a time, with a backward that
    recomputes the weights (`capped_attention`).

    Args:
        query: `(B, n·b, N, H)`, float32 or float64.
        key: `(B, S, K, H)`.
        value: `(B, S, K, V)`.
        mask: boolean `(B|1, n, b, span)`, every row with at least one
            key (`masks.open_empty_rows`): the kernels answer an empty row
            with NaN or the mean of the values depending on the version.
        scale: multiplies the logits.
        band: the `banded._Band` geometry.
        alibi: `None`, or the `N` slopes.
        sinks: `None`, or the `(N,)` sink logits.
        soft_cap: `None`, or `c > 0`.

    Returns:
        `(B, n·b, N, V)`; rows without keys are finite and zeroed by the
        caller.
    """
    import torch

    if sinks is None and not differentiated(query, key, value):
        out = _inference_band(
            query, key, value, mask, scale, band, alibi, soft_cap
        )
        if out is not None:
            return out
    batch, padded_len, num_heads, head = query.shape
    num_kv, value_head = key.shape[2], value.shape[3]
    groups = num_heads // num_kv
    n, b = band.num_blocks, band.block
    # The query blocks become the kernel's "heads" and the grouped query
    # heads extra rows: (B·K, n, G·b, H) against keys (B·K, n, span, H), so
    # keys are never repeated per group.
    q = query.reshape(batch, n, b, num_kv, groups, head)
    q = q.permute(0, 3, 1, 4, 2, 5).reshape(batch * num_kv, n, groups * b, head)
    k = _spans(key, band)  # (B·K, n, span, H)
    v = _spans(value, band)  # (B·K, n, span, V)
    before = band.query_offset - band.frame_start  # L·b
    sizes = (batch, num_kv, groups, b)
    slopes = None
    if alibi is not None:
        slopes = torch.tensor(alibi, dtype=q.dtype, device=q.device)
    sink_rows = None
    if sinks is not None:
        sink_rows = _sink_rows(sinks, q, sizes)  # (B·K, n, G·b)
    if soft_cap is None and sink_rows is not None:
        q, k, v = equal_sizes(q, k, v)  # the flash kernel's rule
    outs = []
    for blocks, part_mask in _mask_parts(mask):
        bias = _bias(part_mask, slopes, sizes, before, q.dtype)
        args = [x[:, blocks] for x in (q, k, v)]
        rows = None if sink_rows is None else sink_rows[:, blocks]
        if soft_cap is not None:
            outs.append(capped_attention().apply(
                *args, bias, rows, scale, soft_cap
            ))
        elif rows is not None:
            outs.append(sink_attention().apply(*args, bias, rows, scale))
        else:
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                *args, attn_mask=bias, scale=scale
            ))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    out = out[..., :value_head]  # (B·K, n, G·b, V)
    out = out.reshape(batch, num_kv, n, groups, b, value_head)
    out = out.permute(0, 2, 4, 1, 3, 5)  # (B, n, b, K, G, V)
    return out.reshape(batch, padded_len, num_heads, value_head)


def _inference_band(query, key, value, mask, scale, band, alibi, soft_cap):
    """`banded_core` without a gradient or sinks, and no copies.

    The kernel's batch is the query blocks and its heads the heads: query
    block `i` of batch row `β` is a strided view `(N, b, H)` of `(B, T, N,
    H)`, its keys a view `(K, span, H)` of the keys (consecutive spans
    overlap in place), and the kernel lays its output out as `(blocks, b,
    N, V)`, the layer's `(T, N, V)`. Blocks whose span reaches past the
    keys (the first `L` of a causal band) read a padded copy of their
    frame. This skips the other layout's copies of the queries, the key
    and value frames and the output, which with small blocks take a large
    share of the call next to the kernel. Grouped heads use `enable_gqa`.
    With a soft-cap the same views go through `_capped_blocks`, which
    skips the same copies that `capped_attention` makes on the other
    layout (`python -m benchmarks --features` times the soft-cap). `None`
    when no block lies inside the keys (short sequences).
    """
    import torch

    batch, _, num_heads, head = query.shape
    s_len, num_kv, value_head = key.shape[1], key.shape[2], value.shape[3]
    n, b, span = band.num_blocks, band.block, band.span
    start = band.frame_start  # key position of block 0's first span key
    inside = (max(0, -(start // b)), min(n, (s_len - span - start) // b + 1))
    if inside[0] >= inside[1]:
        return None
    key, value = key.contiguous(), value.contiguous()
    before = band.query_offset - band.frame_start  # L·b
    terms = None
    if alibi is not None:  # -m_h·|before + r - s|, (N, b, span)
        slopes = torch.tensor(alibi, dtype=query.dtype, device=query.device)
        r = before + torch.arange(b, dtype=query.dtype, device=query.device)
        distance = (r[:, None] - torch.arange(span, device=query.device)).abs()
        terms = -slopes[:, None, None] * distance

    def spans(x, first, count):  # keys of blocks [first, first + count)
        lo = start + first * b
        hi = lo + (count - 1) * b + span
        if lo < 0 or hi > s_len:
            zeros = x.new_zeros((max(0, -lo),) + x.shape[1:])
            after = x.new_zeros((max(0, hi - s_len),) + x.shape[1:])
            x = torch.cat([zeros, x[max(lo, 0) : max(min(hi, s_len), 0)],
                           after])
        else:
            x = x[lo:]
        features = x.shape[1] * x.shape[2]
        return x.as_strided(  # (m, K, span, X)
            (count, x.shape[1], span, x.shape[2]),
            (b * features, x.shape[2], features, 1),
        )

    rows = []
    for row in range(batch):
        q = query[row].reshape(n, b, num_heads, head).transpose(1, 2)
        row_mask = mask[row if mask.shape[0] > 1 else 0]  # (n, b, span)
        pieces = []
        for first, stop in ((0, inside[0]), inside, (inside[1], n)):
            if first == stop:
                continue
            part = row_mask[first:stop]  # (m, b, span)
            if bool((part == part[:1]).all()):
                part = part[:1]
            bias = torch.zeros(part.shape, dtype=query.dtype,
                               device=query.device)
            bias = bias.masked_fill_(~part, float("-inf"))[:, None]
            if terms is not None:
                bias = bias + terms  # (m|1, N, b, span)
            args = (q[first:stop], spans(key[row], first, stop - first),
                    spans(value[row], first, stop - first), bias)
            if soft_cap is None:
                out = torch.nn.functional.scaled_dot_product_attention(
                    *args, scale=scale, enable_gqa=num_kv != num_heads
                )  # (m, N, b, V), laid out as (m, b, N, V)
            else:
                out = _capped_blocks(*args, scale, soft_cap)
            pieces.append(out.transpose(1, 2))
        rows.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    out = torch.stack(rows) if batch > 1 else rows[0][None]
    return out.reshape(batch, n * b, num_heads, value_head)


def _capped_blocks(q, k, v, bias, scale, cap):
    """`capped_attention`'s forward without sinks or a gradient, on the
    views of `_inference_band`: one head at a time, its blocks are a batch
    of plain products whose operands are those views (rows `N·H` apart),
    so nothing is copied but a step's scores, which stay in the cache, and
    the row's softmax is torch's own fused kernel.

    `q` `(m, N, b, H)`, `k` `(m, K, span, H)`, `v` `(m, K, span, V)`,
    `bias` `(m|1, N|1, b, span)` with a finite entry in every row; returns
    `(m, N, b, V)`, laid out as `(m, b, N, V)`.
    """
    import torch

    m, num_heads, b, _ = q.shape
    groups, span = num_heads // k.shape[1], k.shape[2]
    out = q.new_empty((m, b, num_heads, v.shape[-1]))
    step_bytes = tuning.value("capped_step_bytes")
    step = max(1, step_bytes // (b * span * q.element_size()))
    for head in range(num_heads):
        for first in range(0, m, step):
            blocks = slice(first, first + step)
            logits = torch.matmul(
                q[blocks, head] * (scale / cap),
                k[blocks, head // groups].transpose(1, 2),
            ).tanh_()
            head_bias = bias[blocks if bias.shape[0] > 1 else slice(0, 1),
                             head if bias.shape[1] > 1 else 0]
            torch.add(head_bias, logits, alpha=cap, out=logits)
            out[blocks, :, head] = torch.matmul(
                torch.softmax(logits, -1), v[blocks, head // groups]
            )
    return out.transpose(1, 2)


def _mask_parts(mask):
    """`[(blocks, mask)]`: the band's query blocks in runs that share one
    mask, so that a run's additive bias is one `(b, span)` block broadcast
    over its blocks.

    Without padding masks or segments, every block of a band has the same
    mask except the first and last few, whose spans reach past the keys:
    the runs are those leading blocks, the interior, and the trailing ones.
    Any other pattern is one run of the whole mask.

    Args:
        mask: boolean `(B|1, n, b, span)`.

    Returns:
        A list of `(slice, mask)`; each mask is `(B|1, m, b, span)`, with
        `m = 1` for the interior run.
    """
    n = mask.shape[1]
    middle = mask[:, n // 2 : n // 2 + 1]
    same = (mask == middle).flatten(2).all(-1).all(0).tolist()  # (n,)
    first = same.index(True)  # the middle block is its own match
    last = n - same[::-1].index(True)
    if n < 3 or not all(same[first:last]):
        return [(slice(0, n), mask)]
    parts = []
    if first:
        parts.append((slice(0, first), mask[:, :first]))
    parts.append((slice(first, last), middle))
    if last < n:
        parts.append((slice(last, n), mask[:, last:]))
    return parts


def _bias(mask, slopes, sizes, before, dtype):
    """The additive bias of a run of blocks: `0` or `-inf` from `mask`
    `(B|1, m, b, span)`, plus ALiBi's `-m_h·|before + r - s|` when `slopes`
    is given; `(B·K|1, m, G·b, span)` (`B·K` rows when either the mask or
    ALiBi varies over them)."""
    import torch

    batch, num_kv, groups, b = sizes
    mask_batch, m, span = mask.shape[0], mask.shape[1], mask.shape[3]
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    bias = bias.masked_fill_(~mask, float("-inf"))[:, None, :, None]
    if slopes is None:
        rows = mask_batch * num_kv if mask_batch > 1 else 1
        bias = bias.expand(mask_batch, num_kv if mask_batch > 1 else 1, m,
                           groups, b, span)
        return bias.reshape(rows, m, groups * b, span)
    r = before + torch.arange(b, dtype=dtype, device=mask.device)
    distance = (r[:, None] - torch.arange(span, device=mask.device)).abs()
    term = -slopes.reshape(num_kv, 1, groups, 1, 1) * distance  # (K,1,G,b,s)
    bias = (bias + term).expand(batch, num_kv, m, groups, b, span)
    return bias.reshape(batch * num_kv, m, groups * b, span)


@functools.lru_cache(maxsize=1)
def capped_attention():
    """`torch.autograd.Function` of the soft-capped blocks.

    Forward: per step of `capped_chunk` query blocks (`tuning.py`; a
    step's scores are `capped_chunk · B·K · G·b · span` floats), the logits
    `cap·tanh(q·k·scale/cap)` (+ ALiBi), masked, go through a softmax with
    the sinks in its denominator, in place; only the output and each
    row's log-sum-exp are kept. Backward: the step's weights are recomputed
    from the log-sum-exp (FlashAttention's backward), with `1 - tanh²` for
    the cap, so no `(B·K, n, G·b, span)` tensor outlives a step.
    """
    import torch

    def steps(n):
        chunk = tuning.value("capped_chunk")
        return [slice(i, i + chunk) for i in range(0, n, chunk)]

    def _step(bias, step):  # a run's bias is one block, or one per block
        return bias if bias.shape[1] == 1 else bias[:, step]

    def capped(q_scaled, k, cap):
        return torch.matmul(q_scaled, k.transpose(-1, -2)).tanh_()

    class CappedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bias, sink_rows, scale, cap):
            q_scaled = q * (scale / cap)
            outs, lses = [], []
            for step in steps(q.shape[1]):
                logits = capped(q_scaled[:, step], k[:, step], cap).mul_(cap)
                logits.add_(_step(bias, step))  # the mask's -inf, ALiBi
                top = logits.amax(-1, keepdim=True)  # finite: no empty row
                if sink_rows is not None:
                    sink = sink_rows[:, step, :, None]
                    top = torch.maximum(top, sink)
                weights = logits.sub_(top).exp_()
                total = weights.sum(-1, keepdim=True)
                if sink_rows is not None:
                    total = total + torch.exp(sink - top)
                outs.append(torch.matmul(weights, v[:, step]).div_(total))
                lses.append((top + torch.log(total))[..., 0])
            out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=1)
            ctx.save_for_backward(q, k, v, bias, sink_rows, out, lse)
            ctx.scale, ctx.cap = scale, cap
            return out

        @staticmethod
        def backward(ctx, d_out):
            q, k, v, bias, sink_rows, out, lse = ctx.saved_tensors
            scale, cap = ctx.scale, ctx.cap
            q_scaled = q * (scale / cap)
            d_rows = (d_out * out).sum(-1)  # D = dO·O, (B·K, n, G·b)
            dqs, dks, dvs = [], [], []
            for step in steps(q.shape[1]):
                tanh = capped(q_scaled[:, step], k[:, step], cap)
                weights = (tanh * cap).add_(_step(bias, step))
                weights.sub_(lse[:, step, :, None]).exp_()  # masked: 0
                d_step = d_out[:, step]
                dvs.append(torch.matmul(weights.transpose(-1, -2), d_step))
                d_logits = torch.matmul(d_step, v[:, step].transpose(-1, -2))
                d_logits.sub_(d_rows[:, step, :, None]).mul_(weights)
                d_logits.mul_(tanh.square_().neg_().add_(1.0))  # cap' = 1-t²
                dqs.append(torch.matmul(d_logits, k[:, step]).mul_(scale))
                dks.append(
                    torch.matmul(d_logits.transpose(-1, -2), q[:, step])
                    .mul_(scale)
                )
            d_sinks = None
            if sink_rows is not None:
                d_sinks = -torch.exp(sink_rows - lse) * d_rows
            return (
                torch.cat(dqs, dim=1), torch.cat(dks, dim=1),
                torch.cat(dvs, dim=1), None, d_sinks, None, None,
            )

    return CappedAttention


@functools.lru_cache(maxsize=1)
def sink_attention():
    """`torch.autograd.Function`: torch's CPU flash kernel with sinks.

    The kernel returns each row's log-sum-exp `lse`; a sink `s` in the
    softmax's denominator scales the row by `exp(lse - lse')` with
    `lse' = logaddexp(lse, s)`. The kernel's own backward, given the
    scaled output and `lse'`, is then exactly the backward of attention
    over the keys plus a sink of value 0, and the sink's gradient is
    `-exp(s - lse')·(dO·O)`. So the keys' spans stay strided views (no
    sink key, no extra feature).
    """
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    )

    class SinkAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bias, sink_rows, scale):
            out, lse = flash(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
            lse_sinks = torch.logaddexp(lse.to(q.dtype), sink_rows)
            out = out.mul_(torch.exp(lse - lse_sinks)[..., None])
            ctx.save_for_backward(q, k, v, bias, sink_rows, out, lse_sinks)
            ctx.scale = scale
            return out

        @staticmethod
        def backward(ctx, d_out):
            q, k, v, bias, sink_rows, out, lse_sinks = ctx.saved_tensors
            d_out = d_out.contiguous()
            dq, dk, dv = flash_backward(
                d_out, q, k, v, out, lse_sinks, 0.0, False, attn_mask=bias,
                scale=ctx.scale,
            )
            d_rows = (d_out * out).sum(-1)
            d_sinks = -torch.exp(sink_rows - lse_sinks) * d_rows
            return dq, dk, dv, None, d_sinks, None

    return SinkAttention


def _sink_rows(sinks, q, sizes):
    """The sinks as one logit per query row, `(B·K, n, G·b)`."""
    batch, num_kv, groups, b = sizes
    rows, n = q.shape[0], q.shape[1]
    sink = sinks.to(q.dtype).reshape(1, num_kv, 1, groups, 1)
    return sink.expand(batch, num_kv, n, groups, b).reshape(
        rows, n, groups * b
    )


def equal_sizes(q, k, v):
    """Queries, keys and values zero-padded to one feature size, a multiple
    of 8: torch's CPU flash kernel takes only equal query and value sizes,
    and otherwise falls back to its math kernel, which writes the scores
    to memory and is much slower on long sequences."""
    import torch

    size = -(-max(q.shape[-1], v.shape[-1]) // 8) * 8

    def pad(x):
        if x.shape[-1] == size:
            return x
        zeros = x.new_zeros(x.shape[:-1] + (size - x.shape[-1],))
        return torch.cat([x, zeros], dim=-1)

    return pad(q), pad(k), pad(v)


def rotate_half(x, cos, sin, rotary_dim):
    """`rotary.RotaryEmbedding`'s rotation in torch, with in-place updates.

    `out = x·[cos, cos]`, then each half of the rotated features gets its
    `∓ x_other·sin` added in place (`addcmul_`): about two passes over `x`
    where the portable version makes four products, two sums and a concat,
    each writing a fresh tensor.

    Args:
        x: `(B, L, ..., H)`.
        cos, sin: `(L | B, L, 1, ..., d/2)`, float32 or wider.
        rotary_dim: `d`; features `[d:]` pass unchanged.

    Returns:
        The rotated `x`, in its dtype.
    """
    import torch

    half = rotary_dim // 2
    dtype = torch.promote_types(x.dtype, cos.dtype)
    rot = x[..., :rotary_dim].to(dtype)
    x1, x2 = rot[..., :half], rot[..., half:]
    out = rot * torch.cat([cos, cos], dim=-1)
    out[..., :half].addcmul_(x2, sin, value=-1.0)
    out[..., half:].addcmul_(x1, sin)
    out = out.to(x.dtype)
    if rotary_dim < x.shape[-1]:
        out = torch.cat([out, x[..., rotary_dim:]], dim=-1)
    return out


def rotate_pairs(x, cos, sin, rotary_dim):
    """`rotate_half` for the interleaved layout: features `2i` and
    `2i + 1` turn together (`RotaryEmbedding(interleaved=True)`).

    `out = x·cos` with each cos repeated for its pair, then the even and the
    odd features get their `∓ x_other·sin` in place, on strided views:
    fewer passes over `x`, and fewer fresh tensors, than the portable
    reshape, products and stack.

    Args and Returns: as `rotate_half`.
    """
    import torch

    dtype = torch.promote_types(x.dtype, cos.dtype)
    rot = x[..., :rotary_dim].to(dtype)
    out = rot * torch.repeat_interleave(cos, 2, dim=-1)
    out[..., 0::2].addcmul_(rot[..., 1::2], sin, value=-1.0)
    out[..., 1::2].addcmul_(rot[..., 0::2], sin)
    out = out.to(x.dtype)
    if rotary_dim < x.shape[-1]:
        out = torch.cat([out, x[..., rotary_dim:]], dim=-1)
    return out


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

