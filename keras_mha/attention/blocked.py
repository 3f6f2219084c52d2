"""The blocked path: causal self-attention in O(T) memory.

FlashAttention-2's recurrence in `keras.ops`. Queries and keys are cut into
`n` blocks of `b` positions. Query block `i` reads key blocks `0 .. i` with
an online softmax (a running row maximum `top`, sum of exponentials `total`
and weighted sum `accumulated`), so of the `(T, T)` scores only one
`(b, b)` block per head exists at a time, and the blocks above the diagonal
are never computed. Only the diagonal block needs the causal mask. With chunks
of `C` (`spec.chunk`), query block `i` starts at the key block of its
chunk's first position instead of 0, and key block `j` is read back by the
query blocks up to its chunk's end: O(T·C) blocks in all, the chunks'
boundaries masked inside the blocks they cut.

    query blocks   (n, B, K, b·G, H)    grouped heads ride along as rows
    key blocks     (n, B, K, b, H)
    scores         (B, K, b·G, b)       one pair of blocks

Row `r·G + g` of a query block is query `r` of head `g` in its group: the
products have three axes of batch and one of rows, with no axis of size 1
between them (a lone `B` or `G` makes XLA's CPU backend copy each block's
scores to another layout).

The backward pass is a custom gradient that keeps only the output and each
row's log-sum-exp, and recomputes the block weights from them: one sweep
over the query blocks for their gradient, one over the key blocks for the
keys' and values' (each accumulates its own blocks, so no sweep writes
into another's). Memory is O(B·N·T) forward and backward.

The outer sweep is `scan` (JAX) or `map`, the inner one a `fori_loop`
whose trip count is the block index: one trace under `jax.jit` and
`tf.function`, whatever `T`.
"""

import collections
import functools

from keras import ops

import keras_mha.attention.capabilities as capabilities
import keras_mha.attention.explicit as explicit
import keras_mha.attention.logits as logits
import keras_mha.attention.masks as masks_lib
import keras_mha.attention.tuning as tuning


def default_block_size(length):
    """`b` for `T = length`: the tuning table's `blocked_block`, or
    `blocked_large_block` from `T = blocked_large_from`."""
    if length >= tuning.value("blocked_large_from"):
        return tuning.value("blocked_large_block")
    return tuning.value("blocked_block")

_Geometry = collections.namedtuple(
    "_Geometry",
    [
        "block",  # b
        "num_blocks",  # n
        "groups",  # G, query heads per key head
        "soft_cap",  # None or c
        "alibi",  # None or the slopes, a tuple of N floats
        "use_sinks",
        "query_mask",  # whether each has a per-token tensor
        "key_mask",
        "segments",
        "chunk",  # None or C
    ],
)


def blocked_attention(query, key, value, spec, block_size=None):
    """Causal self-attention as `spec` asks, in O(B·N·T) memory.

    The numbers are those of `explicit.explicit_attention`: a row with no
    allowed key (padding, segments) gets an output of 0 and gradients of
    0; float16/bfloat16 are computed in float32 and cast back.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, T, K, H)`, `N % K == 0`.
        value: `(B, T, K, V)`.
        spec: a causal `AttentionSpec` without a window, dense mask or
            bias, dropout or cache (see `dispatch.can_serve`); its scale,
            soft-cap, ALiBi, sinks, chunks, padding masks and segment ids
            apply block by block.
        block_size: `b`; `default_block_size(T)` if `None`.

    Returns:
        `(B, T, N, V)` in the query's dtype.

    `T` must be static; `B` may be dynamic.
    """
    length = explicit.static_self_length("blocked_attention", query, key)
    out_dtype = query.dtype
    query, key, value = explicit.upcast(query, key, value)
    batch = ops.shape(query)[0]
    num_heads, num_kv = query.shape[2], key.shape[2]
    groups = num_heads // num_kv
    block = min(block_size or default_block_size(length), max(1, length))
    num_blocks = -(-length // block)
    padded = num_blocks * block
    geometry = _Geometry(
        block=block,
        num_blocks=num_blocks,
        groups=groups,
        soft_cap=spec.soft_cap,
        alibi=None if spec.alibi is None else tuple(spec.alibi),
        use_sinks=spec.sinks is not None,
        query_mask=spec.query_mask is not None,
        key_mask=spec.key_mask is not None,
        segments=spec.segment_ids is not None,
        chunk=spec.chunk,
    )
    q = ops.multiply(query, ops.cast(spec.scale, query.dtype))
    q = ops.reshape(
        pad(q, padded - length),
        (batch, num_blocks, block, num_kv, groups, query.shape[3]),
    )
    q = ops.transpose(q, (1, 0, 3, 2, 4, 5))  # (n, B, K, b, G, H)
    q = ops.reshape(
        q, (num_blocks, -1, num_kv, block * groups, query.shape[3])
    )  # (n, B, K, b·G, H)
    k, v = (_key_blocks(pad(x, padded - length), geometry)
            for x in (key, value))  # (n, B, K, b, H|V)
    if spec.sinks is None:
        sinks = ops.zeros((num_kv, groups), q.dtype)
    else:
        sinks = ops.reshape(ops.cast(spec.sinks, q.dtype), (num_kv, groups))
    rows, keys = _token_blocks(spec, geometry, padded - length)
    out = _attention(geometry)(q, k, v, sinks, *rows, *keys)
    # out: (n, B, K, b·G, V)
    out = ops.reshape(
        out, (num_blocks, -1, num_kv, block, groups, value.shape[3])
    )
    out = ops.transpose(out, (1, 0, 3, 2, 4, 5))  # (B, n, b, K, G, V)
    out = ops.reshape(out, (batch, padded, num_heads, value.shape[3]))
    return ops.cast(out[:, :length], out_dtype)  # (B, T, N, V)


def pad(x, after):
    if not after:
        return x
    return ops.pad(x, [(0, 0), (0, after)] + [(0, 0)] * (len(x.shape) - 2))


def _key_blocks(x, geometry):
    """`(B, n·b, K, X)` -> `(n, B, K, b, X)`."""
    x = ops.reshape(
        x, (-1, geometry.num_blocks, geometry.block, x.shape[2], x.shape[3])
    )
    return ops.transpose(x, (1, 0, 3, 2, 4))


def _token_blocks(spec, geometry, padding):
    """The call's per-token tensors in blocks: `(rows, keys)`.

    `rows`: the query mask and the query ids, `(n, B, b·G)` (each query's
    value repeated for the `G` heads of its rows); `keys`: the key mask and
    the key ids, `(n, B, b)`; each only where the geometry says the call
    has it. With ids and no key mask, a key mask marks the padding (whose
    id would match).
    """
    def blocks(x, dtype):
        x = pad(ops.cast(x, dtype), padding)
        x = ops.reshape(x, (-1, geometry.num_blocks, geometry.block))
        return ops.transpose(x, (1, 0, 2))

    def row_blocks(x, dtype):
        x = blocks(x, dtype)
        return x if geometry.groups == 1 else ops.repeat(
            x, geometry.groups, axis=2
        )

    rows, keys = [], []
    if geometry.query_mask:
        rows.append(row_blocks(spec.query_mask, "bool"))
    if geometry.key_mask:
        keys.append(blocks(spec.key_mask, "bool"))
    elif geometry.segments:
        keys.append(blocks(ops.ones_like(spec.key_segment_ids, "bool"),
                           "bool"))
    if geometry.segments:
        rows.append(row_blocks(spec.segment_ids, "int32"))
        keys.append(blocks(spec.key_segment_ids, "int32"))
    return tuple(rows), tuple(keys)


def _unpack(geometry, rows, keys):
    """`(query_mask, query_ids, key_mask, key_ids)`, `None` where absent."""
    rows, keys = list(rows), list(keys)
    query_mask = rows.pop(0) if geometry.query_mask else None
    key_mask = keys.pop(0) if geometry.key_mask or geometry.segments else None
    query_ids = rows.pop(0) if geometry.segments else None
    key_ids = keys.pop(0) if geometry.segments else None
    return query_mask, query_ids, key_mask, key_ids


def _has_token_masks(geometry):
    return geometry.query_mask or geometry.key_mask or geometry.segments


def _at(x, index):
    """`x[index]` along the leading axis, for a traced `index`."""
    shape = list(ops.shape(x))
    start = [index] + [0] * (len(shape) - 1)
    return ops.squeeze(ops.slice(x, start, [1] + shape[1:]), 0)


def _pick(tensors, index):
    return tuple(_at(x, index) for x in tensors)


def _scores(geometry, q_i, k_j, i, j, rows, keys, diagonal):
    """The modified, masked logits of query block `i` over key block `j`,
    `(B, K, b·G, b)`, and `tanh(logits / c)` when there is a soft-cap
    (its derivative needs it)."""
    s, tanh = block_logits(q_i, k_j, geometry.soft_cap)
    b, groups = geometry.block, geometry.groups
    offsets = ops.subtract(
        ops.reshape(ops.arange(b * groups, dtype="int32") // groups,
                    (b * groups, 1)),
        ops.reshape(ops.arange(b, dtype="int32"), (1, b)),
    )  # (b·G, b): query row - key column within the blocks
    s = with_alibi(s, geometry.alibi, groups, b,
                   ops.add(offsets, ops.cast((i - j) * b, "int32")))
    mask = None
    if diagonal:
        mask = ops.greater_equal(offsets, 0)[None, None]
    if geometry.chunk is not None:
        query_at = ops.arange(b * groups, dtype="int32") // groups + i * b
        key_at = ops.arange(b, dtype="int32") + j * b
        same = masks_lib.position_mask(query_at[:, None], key_at[None, :],
                                       False, None, geometry.chunk)  # (b·G, b)
        mask = same[None, None] if mask is None else ops.logical_and(
            mask, same[None, None])
    query_mask, query_ids, key_mask, key_ids = _unpack(geometry, rows, keys)
    for extra in (
        None if query_mask is None else query_mask[:, None, :, None],
        None if key_mask is None else key_mask[:, None, None, :],
        None if query_ids is None else ops.equal(
            query_ids[:, None, :, None], key_ids[:, None, None, :]
        ),
    ):
        if extra is not None:
            mask = extra if mask is None else ops.logical_and(mask, extra)
    if mask is not None:
        s = ops.where(mask, s, ops.cast(logits.MASKED_LOGIT, s.dtype))
    return s, tanh


def block_logits(q_i, k_j, soft_cap):
    """`(s, tanh)`: the logits of query rows `(B, K, r, H)` over a key
    block `(B, K, b, H)`, `(B, K, r, b)`, soft-capped, and `tanh(logits /
    c)` under a cap `c` (its derivative needs it; else `None`)."""
    s = ops.einsum("bkrh,bksh->bkrs", q_i, k_j)  # (B, K, r, b)
    tanh = None
    if soft_cap is not None:
        cap = ops.cast(soft_cap, s.dtype)
        tanh = ops.tanh(ops.divide(s, cap))
        s = ops.multiply(cap, tanh)
    return s, tanh


def with_alibi(s, alibi, groups, block, distance):
    """The block's logits plus ALiBi's `-m_h·|p - j|` (`alibi`: the slopes,
    or `None`), `distance` broadcasting as `(r, b)`: query row - key."""
    if alibi is None:
        return s
    slopes = ops.reshape(ops.convert_to_tensor(alibi, s.dtype),
                         (-1, groups))  # (K, G)
    return ops.add(s, logits.alibi(row_values(slopes, block), distance,
                                   s.dtype))


def _first_key_block(geometry, i):
    """The first key block query block `i` may see: 0, or with chunks the
    block of the first position of its first query's chunk."""
    if geometry.chunk is None:
        return 0
    chunk, block = geometry.chunk, geometry.block
    return ops.floor_divide(ops.floor_divide(i * block, chunk) * chunk, block)


def _end_query_block(geometry, j):
    """One past the last query block that may see key block `j`: `n`, or
    with chunks the block after its last key's chunk."""
    if geometry.chunk is None:
        return geometry.num_blocks
    chunk, block = geometry.chunk, geometry.block
    last = (ops.floor_divide(j * block + block - 1, chunk) + 1) * chunk - 1
    return ops.minimum(ops.floor_divide(last, block) + 1, geometry.num_blocks)


@functools.lru_cache(maxsize=64)
def _attention(geometry):
    """The custom-gradient attention of one geometry: `(q, k, v, sinks,
    *tokens) -> out`, all in blocks."""
    forward, query_grads, key_grads = (
        _forward_body(geometry), _query_grad_body(geometry),
        _key_grad_body(geometry),
    )
    blocks = geometry.num_blocks

    def attention(q, k, v, sinks, *tokens):
        count = len(tokens) - int(geometry.key_mask or geometry.segments) \
            - int(geometry.segments)
        rows, keys = tokens[:count], tokens[count:]
        indices = ops.arange(blocks, dtype="int32")
        out, lse, has_key = capabilities.loop_over_blocks(
            forward, (k, v, sinks, keys), (indices, q, k, v, rows, keys)
        )  # (n, B, K, b·G, V), (n, B, K, b·G, 1) twice

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            d_out = upstream
            if _has_token_masks(geometry):  # zeroed rows pass nothing back
                d_out = ops.where(has_key, d_out, ops.zeros_like(d_out))
            # FlashAttention-2's D: each row's dO·O, (n, B, K, b·G, 1).
            delta = ops.sum(ops.multiply(d_out, out), axis=-1, keepdims=True)
            d_q = capabilities.loop_over_blocks(
                query_grads, (k, v, keys),
                (indices, q, k, v, d_out, lse, delta, rows, keys),
            )
            d_k, d_v = capabilities.loop_over_blocks(
                key_grads, (q, d_out, lse, delta, rows),
                (indices, k, v, keys),
            )
            d_sinks = sink_gradient(sinks, lse, delta, has_key,
                                    geometry.block, geometry.use_sinks)
            return (d_q, d_k, d_v, d_sinks) + (None,) * len(tokens)

        return out, grad

    return differentiable(attention)


def differentiable(attention):
    """`attention`, returning `(out, grad)`, as a function of its inputs
    with that gradient (on NumPy, which computes no gradients, its output
    alone)."""
    if capabilities.inference_only():
        return lambda *args: attention(*args)[0]
    return ops.custom_gradient(attention)


def sink_gradient(sinks, lse, delta, has_key, block, use_sinks=True):
    """The sinks' gradient `(K, G)`: a sink is a key of value 0, `dL/ds =
    -sum P(sink)·D` over the rows `(n, B, K, b·G, 1)` that saw a key; 0
    without sinks."""
    if not use_sinks:
        return ops.zeros_like(sinks)
    p_sink = ops.exp(ops.subtract(row_values(sinks, block), lse))
    per_row = ops.where(has_key, ops.multiply(p_sink, delta), 0.0)
    num_kv, groups = sinks.shape
    per_row = ops.reshape(per_row, (ops.shape(lse)[0], -1, num_kv, block,
                                    groups))  # (n, B, K, b, G)
    return ops.negative(ops.sum(per_row, axis=(0, 1, 3)))  # (K, G)


def row_values(per_head, block):
    """One value per query head `(K, G)` -> per row `(1, K, b·G, 1)`."""
    num_kv, groups = per_head.shape
    rows = ops.broadcast_to(
        ops.reshape(per_head, (num_kv, 1, groups)), (num_kv, block, groups)
    )
    return ops.reshape(rows, (1, num_kv, block * groups, 1))


def _forward_body(geometry):
    """Query block `i` over key blocks `0 .. i`: `(out, lse, has_key)`."""

    def body(constants, x):
        k, v, sinks, keys_all = constants
        i, q_i, k_i, v_i, rows, keys_i = x

        def update(state, k_j, v_j, j, keys_j, diagonal):
            s, _ = _scores(geometry, q_i, k_j, i, j, rows, keys_j, diagonal)
            return online_step(state, s, v_j)

        state = update(initial_state(q_i, v.shape[-1]), k_i, v_i, i, keys_i,
                       True)
        top, total, accumulated = ops.fori_loop(
            _first_key_block(geometry, i), i,
            lambda j, state: update(state, _at(k, j), _at(v, j), j,
                                    _pick(keys_all, j), False),
            state,
        )
        return constants, finish_rows(
            (top, total, accumulated),
            row_values(sinks, geometry.block) if geometry.use_sinks
            else None,
            _has_token_masks(geometry),
        )

    return body


def _query_grad_body(geometry):
    """`dq` of query block `i`, over key blocks `0 .. i`."""

    def body(constants, x):
        k, v, keys_all = constants
        i, q_i, k_i, v_i, do_i, lse_i, delta_i, rows, keys_i = x

        def update(d_q, k_j, v_j, j, keys_j, diagonal):
            d_s, _ = _score_grads(geometry, q_i, k_j, v_j, i, j, rows,
                                  keys_j, diagonal, do_i, lse_i, delta_i)
            return ops.add(d_q, ops.einsum("bkrs,bksh->bkrh", d_s, k_j))

        d_q = update(ops.zeros_like(q_i), k_i, v_i, i, keys_i, True)
        d_q = ops.fori_loop(
            _first_key_block(geometry, i), i,
            lambda j, d_q: update(d_q, _at(k, j), _at(v, j), j,
                                  _pick(keys_all, j), False),
            d_q,
        )
        return constants, d_q

    return body


def _key_grad_body(geometry):
    """`(dk, dv)` of key block `j`, over query blocks `j .. n - 1` (up to
    its chunk's end with chunks)."""

    def body(constants, x):
        q, d_out, lse, delta, rows_all = constants
        j, k_j, v_j, keys = x

        def update(grads, i, diagonal):
            d_k, d_v = grads
            q_i, do_i = _at(q, i), _at(d_out, i)
            d_s, p = _score_grads(
                geometry, q_i, k_j, v_j, i, j, _pick(rows_all, i), keys,
                diagonal, do_i, _at(lse, i), _at(delta, i),
            )
            d_v = ops.add(d_v, ops.einsum("bkrs,bkrv->bksv", p, do_i))
            d_k = ops.add(d_k, ops.einsum("bkrs,bkrh->bksh", d_s, q_i))
            return d_k, d_v

        grads = update((ops.zeros_like(k_j), ops.zeros_like(v_j)), j, True)
        grads = ops.fori_loop(
            j + 1, _end_query_block(geometry, j),
            lambda i, grads: update(grads, i, False), grads,
        )
        return constants, grads

    return body


def _score_grads(geometry, q_i, k_j, v_j, i, j, rows, keys, diagonal, do_i,
                 lse_i, delta_i):
    """`(dS, P)` of block pair `(i, j)`: the weights recomputed from the
    saved log-sum-exp, and the gradient of the logits `q·k` before the
    soft-cap, `dS = P ⊙ (dO·Vᵀ - D)`, times `1 - tanh²` under a cap."""
    s, tanh = _scores(geometry, q_i, k_j, i, j, rows, keys, diagonal)
    return grads_of_scores(s, tanh, v_j, do_i, lse_i, delta_i)


def initial_state(q_i, value_dim):
    """An online softmax's state before any key: `(top, total,
    accumulated)`, `(.., 1)`, `(.., 1)` and `(.., V)` for query rows
    `q_i` `(.., H)`."""
    stats = ops.shape(q_i)[:-1] + (1,)
    return (
        ops.full(stats, logits.MASKED_LOGIT, q_i.dtype),
        ops.zeros(stats, q_i.dtype),
        ops.zeros(ops.shape(q_i)[:-1] + (value_dim,), q_i.dtype),
    )


def online_step(state, s, v_j):
    """The online softmax's state after the block of logits `s` `(B, K,
    r, b)` over values `v_j` `(B, K, b, V)` (FlashAttention-2's update)."""
    top, total, accumulated = state
    new_top = ops.maximum(top, ops.amax(s, axis=-1, keepdims=True))
    correction = ops.exp(ops.subtract(top, new_top))
    p = ops.exp(ops.subtract(s, new_top))  # (B, K, r, b)
    total = ops.add(ops.multiply(total, correction),
                    ops.sum(p, axis=-1, keepdims=True))
    accumulated = ops.add(ops.multiply(accumulated, correction),
                          ops.einsum("bkrs,bksv->bkrv", p, v_j))
    return new_top, total, accumulated


def finish_rows(state, sink_rows, zero_empty):
    """`(out, lse, has_key)` of a finished online softmax: the sinks (or
    `None`) folded in, and rows that saw no key (their maximum still the
    masked logit) zeroed where `zero_empty`. A row that visited no block
    at all has a total of 0: its log-sum-exp is the masked logit's."""
    top, total, accumulated = state
    has_key = ops.greater(top, logits.MASKED_LOGIT / 2)
    if sink_rows is not None:
        top, total, accumulated = logits.fold_sink(top, total, accumulated,
                                                   sink_rows)
    total = ops.where(ops.greater(total, 0), total, ops.ones_like(total))
    out = ops.divide(accumulated, total)
    if zero_empty:
        out = ops.where(has_key, out, ops.zeros_like(out))
    return out, ops.add(top, ops.log(total)), has_key


def grads_of_scores(s, tanh, v_j, do_i, lse_i, delta_i, pull=None):
    """`(dS, P)` of a block of logits `s`: the weights recomputed from the
    saved log-sum-exp, and the gradient of the logits before the soft-cap,
    `dS = P ⊙ (dO·Vᵀ - D)`, through a score function's `pull` (or `None`,
    see `capabilities.pullback`), times `1 - tanh²` under a cap (`tanh` or
    `None`)."""
    p = ops.exp(ops.subtract(s, lse_i))  # (B, K, r, b)
    d_p = ops.einsum("bkrv,bksv->bkrs", do_i, v_j)
    d_s = ops.multiply(p, ops.subtract(d_p, delta_i))
    if pull is not None:
        d_s = pull(d_s)
    if tanh is not None:
        d_s = ops.multiply(d_s, ops.subtract(1.0, ops.square(tanh)))
    return d_s, p
