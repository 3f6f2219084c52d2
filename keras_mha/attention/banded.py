"""The banded path: sliding-window attention block by block, O(T·w).

Chunked attention (chunks of `C`) is banded too: every key a query sees
lies within `C - 1` of it, so its band is the window `(C - 1, C - 1)`
(`(C - 1, 0)` with causal) and the chunk's block diagonal is a mask inside
it, O(T·C). With a window too, the band is the narrower of the two
(`AttentionSpec.reach`).

Queries are cut into blocks of `b` consecutive positions. The keys a block
may see lie in one contiguous span: `[start - left, end + right]` for a
window `(left, right)` (`right = 0` when causal). With keys cut into blocks
of the same size and aligned with the query blocks, that span is a fixed
number of whole key blocks, so every query block gets the same static
number of keys and the band is a pair of batched matrix products:

    query blocks      (B, K, n, b, G, H)
    key/value spans   (B, K, n, span, H|V),  span = (L + 1 + R)·b
    scores            (B, K, n, b, G, span)

`n = ceil(T / b)`, `L = ceil(left / b)` key blocks before the query block,
`R = ceil(right / b)` after it (`0` when causal). Keys outside `[0, S)` are
padding and masked. The heads sit in front of the blocks so both products
are plain batched matrix products, and grouped query heads ride along as
extra rows (`G`), so keys and values are never repeated per group.

The portable path (`keras.ops` only) runs the blocks a chunk of `M` blocks
at a time in a loop, so the forward pass holds the scores of one chunk
(about `banded_chunk_bytes`, `tuning.py`), not of the whole band; the native path hands the
blocks to torch's fused attention kernel (`kernels.py`). All shapes follow
from the static `T`, `S`, window and `b`: the function traces under
`jax.jit` and `tf.function` (XLA included) with any batch size, and the
ordinary autodiff of each backend differentiates it in O(B·N·T·w) memory.
"""

import collections
import functools

import keras
from keras import ops

import keras_mha.attention.capabilities as capabilities
import keras_mha.attention.explicit as explicit
import keras_mha.attention.logits as logits
import keras_mha.attention.masks as masks_lib
import keras_mha.attention.tuning as tuning

PORTABLE = "portable"
NATIVE = "native"
IMPLEMENTATIONS = (PORTABLE, NATIVE)



def default_block_size(window):
    """The query block `b` for a window `(left, right)`.

    The next power of two at or above `w = max(left, right) + 1`, within
    the tuning table's `[banded_block_min, banded_block_max]`. A query
    block reads `L = ceil(left / b)` key blocks before it (and `R` after
    it without `causal`), so its scores hold `b + L·b` keys per query for
    `w` useful ones: larger blocks waste more of the span, smaller ones
    make the batched products too small to run well.
    """
    block = _round_up_pow2(max(window) + 1)  # >= w
    return max(tuning.value("banded_block_min"),
               min(tuning.value("banded_block_max"), block))


def native_available(backend=None):
    """Whether `implementation="native"` exists for the backend."""
    return capabilities.has_native_band(backend)


def banded_attention(
    query, key, value, spec, block_size=None, implementation=None
):
    """Sliding-window attention as `spec` asks, in O(B·N·T·w).

    The numbers are those of `explicit.explicit_attention` with the same
    spec: a query row with no allowed key gets an output of exactly 0 (and
    finite gradients); float16/bfloat16 inputs are computed in float32 and
    cast back. Dropout drops the band's weights with the spec's seed, as
    the explicit path drops its own.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`, `N % K == 0`; query head `n` reads key head
            `n // (N // K)` (the keys are not repeated per group).
        value: `(B, S, K, V)`.
        spec: an `AttentionSpec` with a window or chunks, a Python int
            `query_offset`, keys at their own positions (no
            `key_positions`), no dense mask and no weights returned (see
            `dispatch.can_serve`).
        block_size: the query block `b`. If `None`: the tuning table's
            `banded_native_inference_block` for the native kernel when no input
            will be differentiated (torch's grad mode is off, or nothing
            requires a gradient), `default_block_size` otherwise.
        implementation: `"portable"` (`keras.ops` only, every backend),
            `"native"` (torch's fused `scaled_dot_product_attention` on the
            blocks; torch only) or `None`, the native one where it exists
            and no dropout is asked for.

    Returns:
        `(B, T, N, V)` in the query's dtype.

    `T` and `S` must be known when tracing; `B` may be dynamic.
    """
    if implementation is None:
        implementation = (
            NATIVE if native_available() and not spec.dropout else PORTABLE
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"Argument `implementation` must be one of {IMPLEMENTATIONS} or "
            f"`None`. Received: implementation={implementation!r}"
        )
    if implementation == NATIVE and not native_available():
        raise ValueError(
            "`implementation='native'` exists only on the torch backend. "
            f"Received: backend={keras.backend.backend()!r}"
        )
    if implementation == NATIVE and spec.dropout:
        raise ValueError(
            "`implementation='native'` has no dropout (torch's kernel draws "
            f"from torch's own generator). Received: dropout={spec.dropout}"
        )
    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    t_len, s_len = query.shape[1], key.shape[1]
    if t_len is None or s_len is None:
        raise ValueError(
            "`banded_attention` needs static sequence lengths. Received: "
            f"query.shape={query.shape}, key.shape={key.shape}"
        )

    if block_size is None and implementation == NATIVE:
        import keras_mha.attention.kernels as kernels

        if not kernels.differentiated(query, key, value, spec.sinks):
            block_size = tuning.value("banded_native_inference_block")
    out_dtype = query.dtype
    query, key, value = explicit.upcast(query, key, value)
    # The native kernel never writes the scores: one chunk.
    score_bytes = None if implementation == NATIVE else _score_bytes(query)
    band = _band(t_len, s_len, spec, block_size, score_bytes)
    mask = _band_mask(band, spec)  # (B|1, n, b, span)
    # Without padding masks a query has keys unless it lies more than
    # `left` past the last key: only then is the row check worth its pass.
    has_key = None
    if (
        spec.has_token_masks
        or s_len == 0
        or band.query_offset + band.padded_len > s_len + band.window[0]
        or (band.attention_chunk_size is not None
            and band.query_offset + band.padded_len > s_len)
    ):
        mask, has_key = masks_lib.open_empty_rows(mask)  # (B|1, n, b, 1)
    query = _pad_axis1(query, 0, band.padded_len - t_len)  # (B, n·b, N, H)
    if implementation == NATIVE:
        import keras_mha.attention.kernels as kernels

        sinks = None if spec.sinks is None else ops.convert_to_tensor(
            spec.sinks
        )
        out = kernels.banded_core(
            query, key, value, mask, spec.scale, band, spec.alibi, sinks,
            spec.soft_cap,
        )
    else:
        keep = None
        if spec.dropout:
            keep = _keep_mask(query, key, band, spec.dropout, spec.seed)
        out = _portable_core(
            query, key, value, mask, spec, band, keep
        )
    # out: (B, n·b, N, V); rows with no allowed key are garbage until here.
    if has_key is not None:
        has_key = ops.reshape(has_key, (-1, band.padded_len, 1, 1))
        out = masks_lib.zero_empty_rows(out, has_key)
    return ops.cast(out[:, :t_len], out_dtype)  # (B, T, N, V)


class _Band(
    collections.namedtuple(
        "_Band",
        [
            "t_len",  # T
            "s_len",  # S
            "window",  # (left, right): the reach of the window and the chunk
            "causal",
            "attention_chunk_size",  # None or C, the spec's chunk size
            "query_offset",
            "block",  # b
            "num_chunks",  # c, chunks of the loop
            "chunk_blocks",  # M, query blocks per chunk of the loop
            "span_blocks",  # L + 1 + R
            "frame_start",
        ],
    )
):
    """The static geometry of one call.

    Query block `i` covers padded query rows `[i·b, (i+1)·b)` and reads
    frame blocks `i .. i + L + R`; the frame holds the keys at absolute
    positions `[frame_start, frame_start + F)`, `F = (n + L + R)·b`.
    """

    @property
    def num_blocks(self):  # n = c·M
        return self.num_chunks * self.chunk_blocks

    @property
    def padded_len(self):  # n·b
        return self.num_blocks * self.block

    @property
    def span(self):  # (L + 1 + R)·b
        return self.span_blocks * self.block

    @property
    def frame_blocks(self):  # n + L + R
        return self.num_blocks + self.span_blocks - 1

    @property
    def frame_len(self):  # F
        return self.frame_blocks * self.block

    def frame_bounds(self):
        """`(first, last, before, after)`: the frame is keys
        `[first, last)` with `before` and `after` padding positions."""
        start, stop = self.frame_start, self.frame_start + self.frame_len
        first, last = max(start, 0), min(stop, self.s_len)
        if first >= last:  # no key in the frame: all padding
            return 0, 0, self.frame_len, 0
        return first, last, first - start, stop - last


def _band(t_len, s_len, spec, block_size, score_bytes):
    """The geometry; chunks of about `banded_chunk_bytes` of scores, or one
    chunk when `score_bytes` (of one query-key pair, all heads) is `None`."""
    offset = spec.static_offset
    # Every |p - j| is below T + S + offset: a wider window changes no mask
    # entry, only the size of the spans.
    left, right = (min(side, t_len + s_len + offset) for side in spec.reach)
    if spec.causal:
        right = 0
    if block_size is None:
        block_size = default_block_size((left, right))
    block = min(block_size, _round_up_pow2(t_len))
    before = -(-left // block)  # L
    after = -(-right // block)  # R
    span_blocks = before + 1 + after
    num_blocks = -(-t_len // block)
    if score_bytes is None:
        chunk_blocks = num_blocks
    else:
        block_bytes = score_bytes * block * span_blocks * block
        chunk_bytes = tuning.value("banded_chunk_bytes")
        chunk_blocks = min(num_blocks, max(1, chunk_bytes // block_bytes))
    num_chunks = -(-num_blocks // chunk_blocks)
    # Pads fewer than `num_chunks` blocks.
    chunk_blocks = -(-num_blocks // num_chunks)
    return _Band(
        t_len=t_len,
        s_len=s_len,
        window=(left, right),
        causal=spec.causal,
        attention_chunk_size=spec.chunk,
        query_offset=offset,
        block=block,
        num_chunks=num_chunks,
        chunk_blocks=chunk_blocks,
        span_blocks=span_blocks,
        frame_start=offset - before * block,
    )


def _keep_mask(query, key, band, rate, seed):
    """Which attention weights survive dropout, in the portable core's
    layout `(c, B, K, M, b, G, span)`: drawn once, outside the loop, so the
    loop stays free of random state (`jax.lax.scan`, `tf.while_loop`)."""
    batch = ops.shape(query)[0]
    num_kv = key.shape[2]
    groups = query.shape[2] // num_kv
    shape = (band.num_chunks, batch, num_kv, band.chunk_blocks, band.block,
             groups,
             band.span)
    draws = keras.random.uniform(shape, dtype=query.dtype, seed=seed)
    return ops.greater_equal(draws, ops.cast(rate, draws.dtype))


def _portable_core(query, key, value, mask, spec, band, keep=None):
    """Attention of every query block over its span, in `keras.ops`.

    The blocks go through a loop a chunk at a time, so the scores of only
    one chunk (about `banded_chunk_bytes`) exist at once in the forward pass and
    stay in the cache, and the allocator reuses their memory instead of
    faulting in fresh pages for the whole band. On CPU this is faster
    than one pass over all blocks, on JAX and TensorFlow, forward and
    backward (the tuning table's `banded_chunk_bytes` names the benchmark
    that sizes the chunks). Autodiff keeps every chunk's weights for the
    backward pass, O(T·w) in all, unless they would take more than
    `banded_recompute_bytes`: then each chunk's are recomputed there.

    Args:
        query: `(B, n·b, N, H)`.
        key: `(B, S, K, H)`.
        value: `(B, S, K, V)`.
        mask: `(B|1, n, b, span)`.
        spec: the call's `AttentionSpec` (its scale, dropout rate,
            soft-cap, ALiBi and sinks).
        keep: `None`, or the dropout mask of `_keep_mask`.

    Returns:
        `(B, n·b, N, V)`.
    """
    batch = ops.shape(query)[0]
    num_heads, head = query.shape[2], query.shape[3]
    num_kv, value_head = key.shape[2], value.shape[3]
    groups = num_heads // num_kv
    c, chunk_blocks, b = band.num_chunks, band.chunk_blocks, band.block
    q = ops.multiply(query, ops.cast(spec.scale, query.dtype))
    q = ops.reshape(q, (batch, c, chunk_blocks, b, num_kv, groups, head))
    q = ops.transpose(q, (1, 0, 4, 2, 3, 5, 6))  # (c, B, K, M, b, G, H)
    # The grouped heads ride along as rows of both products, `b·G` rows
    # per block: no axis of size 1 (B, G) sits between XLA's products,
    # which would otherwise copy the scores to change their layout.
    rows = (c, -1, num_kv, chunk_blocks, b * groups)
    q = ops.reshape(q, rows + (head,))  # (c, B, K, M, b·G, H)
    k = _chunk_windows(_frame(key, band), band)  # (c, B, K, M+L+R, b, H)
    v = _chunk_windows(_frame(value, band), band)  # (c, B, K, M+L+R, b, V)
    # The mask enters the loop as booleans, one per query and key of the
    # band, and each chunk turns its own into a bias: built here as a
    # float bias repeated for the `G` rows of a group, it would be `4·G`
    # times larger, and autodiff keeps the loop's inputs for the backward.
    mask = ops.reshape(mask, (-1, c, chunk_blocks, b, band.span))
    mask = ops.transpose(mask, (1, 0, 2, 3, 4))[:, :, None]
    # mask: (c, B|1, 1, M, b, span)

    inputs = (q, k, v, mask)
    if keep is not None:
        inputs += (ops.reshape(keep, rows + (band.span,)),)
    # What every chunk reads whole: ALiBi's term and the sinks (zeros when
    # unused), carried through the loop unchanged.
    constants = (
        _alibi_term(band, spec.alibi, num_kv, groups, q.dtype),
        _sinks(spec.sinks, num_kv, groups, b, q.dtype),
    )
    # The weights autodiff would keep for the backward, all chunks: past
    # the budget each chunk's are recomputed there instead.
    weights_bytes = _score_bytes(query) * band.padded_len * band.span
    attend = _chunk_attention(
        band, spec.dropout if keep is not None else 0.0, spec.soft_cap,
        spec.alibi is not None, spec.sinks is not None,
        weights_bytes > tuning.value("banded_recompute_bytes"),
    )
    if c == 1:
        _, out = attend(constants, tuple(x[0] for x in inputs))
        out = ops.expand_dims(out, 0)
    else:  # `_chunk_attention` keeps one `attend` per geometry
        out = capabilities.loop_over_blocks(attend, constants, inputs)
    # out: (c, B, K, M, b·G, V)
    out = ops.reshape(out, rows[:4] + (b, groups, value_head))
    out = ops.transpose(out, (1, 0, 3, 4, 2, 5, 6))  # (B, c, M, b, K, G, V)
    return ops.reshape(out, (batch, band.padded_len, num_heads, value_head))


def _alibi_term(band, slopes, num_kv, groups, dtype):
    """`(1, K, 1, b·G, span)`: ALiBi's `-m_h·|p - j|` for every block (the
    distance of query row `r` and span key `s` is the same in each)."""
    if slopes is None:
        return ops.zeros((), dtype)
    before = band.query_offset - band.frame_start  # L·b
    distance = ops.subtract(
        ops.reshape(ops.arange(band.block, dtype="int32") + before, (-1, 1)),
        ops.reshape(ops.arange(band.span, dtype="int32"), (1, -1)),
    )  # (b, span)
    slopes = ops.reshape(
        ops.convert_to_tensor(slopes, dtype), (1, num_kv, 1, 1, groups, 1)
    )
    term = logits.alibi(slopes, distance[:, None, :], dtype)
    return ops.reshape(term, (1, num_kv, 1, band.block * groups, band.span))


def _sinks(sinks, num_kv, groups, block, dtype):
    """`(1, K, 1, b·G, 1)`: each query row's sink logit (or a zero)."""
    if sinks is None:
        return ops.zeros((), dtype)
    sinks = ops.reshape(ops.cast(sinks, dtype), (1, num_kv, 1, 1, groups, 1))
    sinks = ops.broadcast_to(sinks, (1, num_kv, 1, block, groups, 1))
    return ops.reshape(sinks, (1, num_kv, 1, block * groups, 1))


@functools.lru_cache(maxsize=64)
def _chunk_attention(band, rate, soft_cap, use_alibi, use_sinks,
                     recompute=False):
    """The attention of one chunk, one function object per geometry,
    dropout rate, choice of logit features and `recompute` (its weights
    recomputed in the backward pass, `capabilities.recomputed`, rather
    than kept: O(chunk) memory for them instead of O(T·w)).

    `jax.lax.scan` caches its trace on the function object: a fresh closure
    per call would retrace and recompile the loop on every eager call.
    """

    def attend(carry, inputs):
        q_c, k_c, v_c, mask_c = inputs[:4]
        alibi, sinks = carry
        k_c = _chunk_spans(k_c, band)  # (B, K, M, span, H)
        v_c = _chunk_spans(v_c, band)  # (B, K, M, span, V)
        scores = ops.einsum("bkcrh,bkcsh->bkcrs", q_c, k_c)
        # scores: (B, K, M, b·G, span)
        scores = logits.soft_cap(scores, soft_cap)
        if use_alibi:
            scores = ops.add(scores, alibi)
        # The mask as an additive bias (0 or MASKED_LOGIT): a sum, unlike
        # a select, lets XLA's CPU backend (JAX) fuse the two products and
        # the softmax between them into one kernel that never writes the
        # scores (a select splits them into three, with the scores written
        # between). The sum is the select's value: `s + MASKED_LOGIT`
        # rounds to MASKED_LOGIT for any logit below 1e22.
        mask_bias = ops.where(mask_c, ops.zeros((), scores.dtype),
                              ops.cast(logits.MASKED_LOGIT, scores.dtype))
        groups = q_c.shape[-2] // band.block
        if groups > 1:  # row r·G + g reads row r
            mask_bias = ops.repeat(mask_bias, groups, axis=-2)
        # mask_bias: (B|1, 1, M, b·G, span)
        scores = ops.add(scores, mask_bias)
        # The softmax with its division deferred to the output, `(b·G, V)`
        # per block instead of `(b·G, span)`. A row with no allowed key is
        # uniform (or all on its sink) here; the caller zeroes it.
        weights, total = logits.exp_and_sum(
            scores, sinks if use_sinks else None
        )  # total: (B, K, M, b·G, 1)
        if rate:
            kept = ops.cast(inputs[4], weights.dtype)  # (B, K, M, b·G, span)
            weights = ops.multiply(weights, ops.multiply(kept, 1.0 / (1.0 - rate)))
        out = ops.einsum("bkcrs,bkcsv->bkcrv", weights, v_c)
        out = ops.divide(out, total)
        return carry, out  # (B, K, M, b·G, V)

    return capabilities.recomputed(attend) if recompute else attend


def _chunk_windows(x, band):
    """Frame `(B, F, K, X)` -> `(c, B, K, M + L + R, b, X)`.

    Chunk `j` reads frame blocks `j·M .. j·M + M + L + R - 1`; neighbouring
    windows share `L + R` blocks, which are copied into both.
    """
    batch = ops.shape(x)[0]
    num_kv, features = x.shape[2], x.shape[3]
    width = band.chunk_blocks + band.span_blocks - 1
    x = ops.reshape(
        x, (batch, band.frame_blocks, band.block, num_kv, features)
    )  # (B, n + L + R, b, K, X)
    if band.num_chunks == 1:
        x = ops.expand_dims(x, 1)  # the whole frame: no gather to fuse
    else:
        starts = [
            [j * band.chunk_blocks + i for i in range(width)]
            for j in range(band.num_chunks)
        ]
        x = ops.take(x, ops.convert_to_tensor(starts, "int32"), axis=1)
    # x: (B, c, M + L + R, b, K, X)
    return ops.transpose(x, (1, 0, 4, 2, 3, 5))


def _chunk_spans(x, band):
    """`(B, K, M + L + R, b, X)` -> spans `(B, K, M, span, X)`.

    Span `i` is blocks `i .. i + L + R`: each key block is copied into the
    `L + 1 + R` spans that read it.
    """
    chunk_blocks = band.chunk_blocks
    shifted = [x[:, :, d : d + chunk_blocks] for d in range(band.span_blocks)]
    if len(shifted) == 1:
        return shifted[0]
    return ops.concatenate(shifted, axis=3)


def _band_mask(band, spec):
    """`(B|1, n, b, span)`: which key of its span each query may attend to
    (positions, chunks, padding and segments)."""
    query_mask, key_mask = spec.query_mask, spec.key_mask
    n, b = band.num_blocks, band.block
    # Query row r of block i sits at offset + i·b + r and key s of its span
    # at frame_start + i·b + s: their distance does not depend on i, so
    # the positions relative to the block start give every block's mask.
    before = band.query_offset - band.frame_start  # L·b
    mask = masks_lib.position_mask(
        ops.reshape(ops.arange(b, dtype="int32") + before, (b, 1)),
        ops.reshape(ops.arange(band.span, dtype="int32"), (1, band.span)),
        band.causal,
        band.window,
    )  # (b, span)
    key_positions = ops.arange(band.frame_len, dtype="int32")
    key_positions = _block_spans(
        ops.reshape(key_positions + band.frame_start, (1, band.frame_len)),
        band,
    )[0][:, None, :]  # (n, 1, span)
    in_range = ops.logical_and(
        ops.greater_equal(key_positions, 0),
        ops.less(key_positions, band.s_len),
    )  # (n, 1, span)
    mask = ops.logical_and(mask, in_range)  # (n, b, span)
    if band.attention_chunk_size is not None:
        # Chunks are not translation invariant: absolute positions.
        rows = ops.arange(band.padded_len, dtype="int32") + band.query_offset
        mask = ops.logical_and(mask, masks_lib.position_mask(
            ops.reshape(rows, (n, b, 1)), key_positions, False, None,
            band.attention_chunk_size,
        ))
    mask = mask[None]  # (1, n, b, span)
    if query_mask is not None:
        query_mask = ops.cast(query_mask, "bool")
        query_mask = _pad_axis1(query_mask, 0, band.padded_len - band.t_len)
        query_mask = ops.reshape(query_mask, (-1, n, b, 1))  # (B, n, b, 1)
        mask = ops.logical_and(mask, query_mask)
    if key_mask is not None:
        key_mask = _frame(ops.cast(key_mask, "bool"), band)  # (B, F)
        key_mask = _block_spans(key_mask, band)[:, :, None, :]  # (B, n, 1, span)
        mask = ops.logical_and(mask, key_mask)
    if spec.segment_ids is not None:
        query_ids = _pad_axis1(
            spec.segment_ids, 0, band.padded_len - band.t_len
        )
        query_ids = ops.reshape(query_ids, (-1, n, b, 1))  # (B, n, b, 1)
        key_ids = _block_spans(_frame(spec.key_segment_ids, band), band)
        key_ids = key_ids[:, :, None, :]  # (B, n, 1, span); padding masked
        mask = ops.logical_and(mask, ops.equal(query_ids, key_ids))
    return mask


def _block_spans(x, band):
    """`(B, F)` -> `(B, n, span)`: the frame positions each block reads."""
    x = ops.reshape(x, (-1, band.frame_blocks, band.block))  # (B, n+L+R, b)
    if band.span_blocks == 1:
        return x
    n = band.num_blocks
    shifted = [x[:, d : d + n] for d in range(band.span_blocks)]
    return ops.concatenate(shifted, axis=2)  # (B, n, span)


def _frame(x, band):
    """`(B, S, ...)` -> `(B, F, ...)`, the keys at frame positions.

    Positions outside `[0, S)` are zeros (and masked).
    """
    first, last, before, after = band.frame_bounds()
    return _pad_axis1(x[:, first:last], before, after)


def _pad_axis1(x, before, after):
    if before == 0 and after == 0:
        return x
    widths = [(0, 0)] * len(x.shape)
    widths[1] = (before, after)
    return ops.pad(x, widths)


def _score_bytes(query):
    """Bytes of the scores of one query-key pair: all heads, static batch."""
    batch = query.shape[0] or 1
    itemsize = 8 if ops.dtype(query) == "float64" else 4
    return batch * query.shape[2] * itemsize


def _round_up_pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())
