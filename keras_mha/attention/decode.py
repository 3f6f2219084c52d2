"""The decode path: attention over the cache itself, reading only what a
step can see.

A decoding step writes its `T` new tokens into the cache first, then
attends over the cache. In a full cache slot `j` holds position `j`, and
no slot at or after `limit = index + T` is visible, so the step reads the
key blocks below `limit` only, a block at a time with an online softmax:
`ceil(limit / b)` blocks, a cost that follows the position, not the
cache's size. In eager calls the limit is known and the blocks are a
Python loop; when it is traced (`jax.jit`, `tf.function`) they are a
`keras.ops.while_loop` whose trip count is a tensor, so the step traces
once. A rolling cache (one token at a time) is one block of its `w` slots.
Late in a large cache, a traced step of one token on JAX reads every slot
in one pass instead (the tuning table's `decode_whole_from`): XLA on CPU
copies each block the loop slices, and the pass reads the cache where it
lies.

Eager steps take a native route where the backend has one
(`decode_kernels.py`): on torch (`decode_core`), the fused attention kernel
over every slot below the limit, on strided views of the cache (a long
step in chunks of slots merged by their log-sum-exp), and for the latent
cache (`latent_core`) two products that read its latents and rope keys
where they lie; on TensorFlow and
JAX (`graph_decode`), the traced loop as one compiled function (a graph,
`jax.jit`), which saves the loop's per-op dispatch.

Shapes: query `(B, T, N, H)`; the cache `(keys, values, valid)`, `(B, L,
K, H)`, `(B, L, K, V)` and `(B, L)` (see `cache.py`). The numbers are those
of `explicit.explicit_attention` with the spec's keys at their slots'
positions: scale, soft-cap, ALiBi, sinks, masks, and weights 0 for a row
with nothing to attend to.
"""

import functools

import keras
from keras import ops

import keras_mha.attention.cache as cache_lib
import keras_mha.attention.capabilities as capabilities
import keras_mha.attention.explicit as explicit
import keras_mha.attention.logits as logits
import keras_mha.attention.masks as masks_lib
import keras_mha.attention.tuning as tuning

FLAGGED = "flagged"  # ours: (keys, values, valid), see `cache.py`
PAIR = "pair"  # keras-hub's: (B, 2, L, K, H), keys at [:, 0], values at [:, 1]
# Multi-head latent attention's: (latents (B, L, R), rope_keys (B, L, P),
# valid (B, L)), read as one key/value head: keys `[latent, rope_key]`
# (size R + P), values the latents (size R); see `latent.py`.
LATENT = "latent"

PORTABLE = "portable"  # the loop over key blocks, `keras.ops` only
NATIVE = "native"  # eager steps: torch's fused kernel; TF, JAX compiled
IMPLEMENTATIONS = (PORTABLE, NATIVE)
# The implementation of eager steps; `None`: the native one where it
# exists. Tests set it to run both.
IMPLEMENTATION = None

# A traced step of one query in a full cache of more than one block, past
# the tuning table's `decode_whole_from` of its slots, reads them all in one
# pass (`_whole_chunks`): the loop materializes every block it slices (XLA
# on CPU) before its products; the pass multiplies the keys and the values
# where they lie.


def native_available(backend=None):
    """Whether the native step exists for the backend (torch, tensorflow,
    jax)."""
    return capabilities.has_native_decode_step(backend)


def block_size_for(backend=None):
    """The keys per block of a full cache on `backend` (the active one):
    the tuning table's `decode_block`."""
    return tuning.value("decode_block", backend=backend)


def decode_attention(query, cache, spec, rolling, block_size=None,
                     layout=FLAGGED, limit=None, implementation=None):
    """Attention of `query` over `cache` after this step's write.

    Args:
        query: `(B, T, N, H)`, at positions `spec.query_offset + t`.
        cache: holding the step's own tokens: ours, `(keys, values,
            valid)` (see `cache.py`; `valid` says where a real token was
            written) or keras-hub's `(B, 2, L, K, H)` (`layout`).
        spec: an `AttentionSpec` whose `query_offset` is the step's index;
            a dense `attention_mask` `(B|1, N|1, T, L)` is read a block at a
            time; no bias, segment ids, dropout or weights.
        rolling: whether slot = position mod L (then `T = 1`).
        block_size: keys per block `b` of a full cache;
            `block_size_for()` if `None`.
        layout: `FLAGGED`, `PAIR` or `LATENT` (one key/value head).
        limit: no slot at or after it is read; the last query's position
            plus 1 if `None`.
        implementation: `"portable"` (the block loop, op by op in an
            eager call), `"native"` (every eager step on the backend's own
            route: torch's fused kernel over the slots below the limit at
            once, `decode_kernels.decode_core`; on TensorFlow and JAX the
            block loop as one compiled function,
            `decode_kernels.graph_decode`) or
            `None`:
            `IMPLEMENTATION`, else the native route where it exists (on
            torch while its bias stays below the tuning table's
            `decode_native_bias_limit`).
            Traced steps always run the portable loop.

    Returns:
        `(B, T, N, V)` in the query's dtype.
    """
    implementation = _implementation(implementation)
    if implementation != PORTABLE and capabilities.compiles_eager_call(
        (query, cache)
    ):
        import keras_mha.attention.decode_kernels as decode_kernels

        return decode_kernels.graph_decode(
            decode_attention, query, cache, spec, rolling, block_size,
            layout, limit,
        )
    out_dtype = query.dtype
    pair = layout == PAIR
    latent = layout == LATENT
    num_slots = _num_slots(cache, pair)
    if block_size is None:
        block_size = block_size_for()
    block = num_slots if rolling else min(block_size, num_slots)
    (query,) = explicit.upcast(query)
    dtype = query.dtype
    batch, t_len = ops.shape(query)[0], query.shape[1]
    num_heads, key_dim = query.shape[2], query.shape[3]
    if latent:
        num_kv, value_dim = 1, cache[0].shape[2]
    else:
        num_kv = cache.shape[3] if pair else cache[0].shape[2]
        value_dim = cache.shape[4] if pair else cache[1].shape[3]
    groups = num_heads // num_kv
    q = ops.multiply(query, ops.cast(spec.scale, dtype))
    q = ops.reshape(q, (batch, t_len, num_kv, groups, key_dim))
    q = ops.transpose(q, (0, 2, 3, 1, 4))  # (B, K, G, T, H)
    query_positions = ops.cast(spec.query_offset, "int32") + ops.arange(
        t_len, dtype="int32"
    )  # (T,)
    if limit is None:
        limit = query_positions[-1] + 1  # no slot at or after it is visible
    limit = ops.cast(limit, "int32")
    query_mask = spec.query_mask
    if query_mask is None:
        query_mask = ops.ones((batch, t_len), "bool")
    slopes = None
    if spec.alibi is not None:
        slopes = ops.convert_to_tensor(spec.alibi, dtype)
        slopes = ops.reshape(slopes, (1, num_kv, groups, 1, 1))
    dense = spec.attention_mask
    if dense is not None:  # (B|1, N|1, T|1, L) -> (B|1, K|1, G|1, T|1, L)
        lead, heads = dense.shape[0], dense.shape[1]
        dense = ops.reshape(
            dense,
            (-1 if lead != 1 else 1,)
            + ((num_kv, groups) if heads != 1 else (1, 1))
            + tuple(dense.shape[2:]),
        )
        dense = ops.cast(dense, "bool")
    blocks = 1 if rolling else _concrete_blocks(limit, block)
    sinks = None
    if spec.sinks is not None:
        sinks = ops.reshape(ops.cast(spec.sinks, dtype), (num_kv, groups))
    if _takes_native(implementation, blocks, q, num_slots, slopes, dense):
        size = num_slots if rolling else min(
            cache_lib.concrete_int(limit), num_slots
        )
        out = _native_step(
            q, cache, size, limit, query_positions, query_mask, spec, rolling,
            layout, slopes, dense, sinks,
        )
        return _heads_back(out, out_dtype)
    if blocks is None and capabilities.compiling_one_graph():
        # Dynamo cannot capture a loop whose trip count is a tensor: one
        # block of every slot, those at or after `limit` masked.
        block, blocks = num_slots, 1
    shape = (batch, num_kv, groups, t_len)
    state = (
        ops.zeros((), "int32"),  # the block
        ops.full(shape + (1,), logits.MASKED_LOGIT, dtype),  # running max
        ops.zeros(shape + (1,), dtype),  # running denominator
        ops.zeros(shape + (value_dim,), dtype),  # running numerator
    )
    # One query: the products read each block in place (`_packed_query`),
    # unless they read strided keys without a copy anyway.
    packed = t_len == 1 and not capabilities.products_read_strided_views()
    chunks = _whole_chunks(num_slots, block) if (
        packed and layout == FLAGGED and not rolling and blocks is None
    ) else None
    extra = ()
    if slopes is not None:
        extra += (slopes,)
    if dense is not None:
        extra += (dense,)
    if packed:
        q = _packed_query(q)
    constants = (q, cache, limit, query_positions, query_mask) + extra
    # `lru_cache`'s wrapper is a graph break under `torch.compile`.
    loop = _loop.__wrapped__ if capabilities.compiling_one_graph() else _loop
    cond, body = loop(
        block, num_slots, rolling, spec.causal, spec.window, spec.chunk,
        spec.soft_cap, slopes is not None, dense is not None, layout,
        (num_kv, groups) if packed else None,
    )
    if chunks is not None:
        # Traced, late in a large cache: one pass over every slot beats the
        # loop's copies of each block (`decode_whole_from`).
        whole = _loop(
            num_slots, num_slots, rolling, spec.causal, spec.window,
            spec.chunk, spec.soft_cap, slopes is not None, dense is not None,
            layout,
            (num_kv, groups), chunks,
        )[1]
        state = ops.cond(
            limit > int(tuning.value("decode_whole_from") * num_slots),
            lambda: whole(*state, *constants)[:4],
            lambda: ops.while_loop(cond, body, state + constants)[:4],
        )
    elif blocks is None:  # traced: the trip count is a tensor
        state = ops.while_loop(cond, body, state + constants)
    else:
        state = state + constants
        for _ in range(blocks):
            state = body(*state)
    _, top, total, numerator = state[:4]
    if sinks is not None:
        sinks = ops.reshape(sinks, (1, num_kv, groups, 1, 1))
        top, total, numerator = logits.fold_sink(top, total, numerator, sinks)
    out = ops.divide(numerator, ops.maximum(total, 1e-30))
    out = ops.where(total > 0, out, ops.zeros_like(out))  # (B, K, G, T, V)
    return _heads_back(out, out_dtype)


def _heads_back(out, dtype):
    """`(B, K, G, T, V)` -> `(B, T, N, V)` in `dtype`."""
    batch, num_kv, groups, t_len, value_dim = (
        ops.shape(out)[0], *out.shape[1:]
    )
    out = ops.transpose(out, (0, 3, 1, 2, 4))
    return ops.cast(
        ops.reshape(out, (batch, t_len, num_kv * groups, value_dim)), dtype
    )


def _implementation(implementation):
    """The implementation asked for (`decode_attention`'s argument, else
    `IMPLEMENTATION`), checked: `PORTABLE`, `NATIVE`, or `None` (the native
    route where it serves the step)."""
    if implementation is None:
        implementation = IMPLEMENTATION
    if implementation not in IMPLEMENTATIONS + (None,):
        raise ValueError(
            f"Argument `implementation` must be one of {IMPLEMENTATIONS} or "
            f"`None`. Received: implementation={implementation!r}"
        )
    if implementation == NATIVE and not native_available():
        raise ValueError(
            "`implementation='native'` exists only on the torch, "
            "tensorflow and jax backends. "
            f"Received: backend={keras.backend.backend()!r}"
        )
    return implementation


def _num_slots(cache, pair):
    """The slots of either layout."""
    return cache.shape[2] if pair else cache[0].shape[1]


def _takes_native(implementation, blocks, q, num_slots, slopes, dense):
    """Whether a torch step runs `decode_kernels.decode_core` (see
    `decode_attention`'s `implementation`)."""
    fused = capabilities.has_fused_decode_kernel()
    if implementation == PORTABLE or not fused:
        return False
    if blocks is None:  # traced (`torch.compile`): the limit has no value
        return False
    if implementation == NATIVE:
        return True
    _, num_kv, groups, t_len, _ = q.shape
    varies = slopes is not None or (dense is not None and dense.shape[1] > 1)
    return (num_kv if varies else 1) * groups * t_len * num_slots <= (
        tuning.value("decode_native_bias_limit")
    )


def _native_step(q, cache, size, limit, query_positions, query_mask, spec,
                 rolling, layout, slopes, dense, sinks):
    """`(B, K, G, T, V)`: the step over slots `[0, size)` at once, with
    torch's fused kernel (`decode_kernels.decode_core`); the keys and the
    values are strided views of the cache, never copied."""
    import keras_mha.attention.decode_kernels as decode_kernels

    if layout == LATENT:  # two parts read where they lie, not concatenated
        latents, rope_keys, written = (_run(part, 0, size) for part in cache)
    else:
        keys, values, written = _slots(cache, 0, size, layout, q.dtype)
    positions = cache_lib.slot_positions(
        limit, _num_slots(cache, layout == PAIR), rolling,
        ops.arange(size, dtype="int32"),
    )
    mask = _slot_mask(query_positions, positions, written, query_mask,
                      spec.causal, spec.window, spec.chunk)  # (B, 1, 1, T, S)
    if dense is not None:
        mask = ops.logical_and(mask, dense[..., :size])
    alibi = None
    if slopes is not None:
        distance = query_positions[:, None] - positions[None, :]
        alibi = logits.alibi(slopes, distance[None, None, None], q.dtype)
    mask, has_key = masks_lib.open_empty_rows(mask)
    if layout == LATENT:
        out = decode_kernels.latent_core(q, latents, rope_keys, mask, alibi,
                                         sinks, spec.soft_cap)
    else:
        out = decode_kernels.decode_core(q, keys, values, mask, alibi, sinks,
                                         spec.soft_cap)
    return masks_lib.zero_empty_rows(out, has_key)


def _slots(cache, start, size, layout, dtype):
    """`(keys, values, written)` of slots `[start, start + size)` of either
    layout: `(B, b, K, H)` and `(B, b, K, V)` in `dtype`, and `(B|1, b)`
    booleans (every slot of keras-hub's cache counts as written). On torch
    the keys and the values are views of the cache."""
    if layout == PAIR and size == cache.shape[2]:
        slots = cache
        keys, values = slots[:, 0], slots[:, 1]
        written = ops.ones((1, size), "bool")
    elif layout == PAIR:
        batch = ops.shape(cache)[0]
        slots = ops.slice(
            cache, (0, 0, start, 0, 0), (batch, 2, size) + tuple(cache.shape[3:])
        )  # (B, 2, b, K, H)
        keys, values = slots[:, 0], slots[:, 1]
        written = ops.ones((1, size), "bool")
    elif layout == LATENT:
        latents, rope_keys, written = (
            _run(part, start, size) for part in cache
        )  # (B, b, R), (B, b, P), (B, b)
        keys = ops.concatenate([latents, rope_keys], axis=-1)[:, :, None]
        values = latents[:, :, None]  # (B, b, 1, R)
    else:
        keys, values, written = (_run(part, start, size) for part in cache)
    return ops.cast(keys, dtype), ops.cast(values, dtype), written


def _run(tensor, start, size):
    """Slots `[start, start + size)` of one of our cache's tensors."""
    if size == tensor.shape[1]:  # all of them: no slice to trace
        return tensor
    starts = (0, start) + (0,) * (tensor.ndim - 2)
    shape = (ops.shape(tensor)[0], size) + tuple(tensor.shape[2:])
    return ops.slice(tensor, starts, shape)


def _slot_mask(query_positions, positions, written, query_mask, causal,
               window, chunk=None):
    """`(B, 1, 1, T|1, b)`: which of a block's slots, at `positions` `(b,)`
    (negative: no token) and `written` `(B|1, b)`, each query sees."""
    written = ops.logical_and(written, positions[None, :] >= 0)
    visible = masks_lib.position_mask(
        query_positions[:, None], positions[None, :], causal, window, chunk
    )  # (T, b) or None
    mask = written[:, None, :]
    if visible is not None:
        mask = ops.logical_and(visible[None], mask)  # (B, T, b)
    mask = ops.logical_and(mask, query_mask[:, :, None])  # (B, T, b)
    return mask[:, None, None]


@functools.lru_cache(maxsize=64)
def _loop(block, num_slots, rolling, causal, window, chunk, soft_cap,
          use_alibi, use_dense, layout, packed, chunks=None):
    """`(cond, body)` of the loop over key blocks, one pair per geometry and
    choice of features: `jax.lax.while_loop` caches its trace on them.
    `packed`: `(K, G)` when the query is `_packed_query`'s. `chunks`: the
    body reads every slot (`block = L`) and sums its weighted values over
    that many chunks of them (`_whole_chunks`)."""
    pair, latent = layout == PAIR, layout == LATENT

    def cond(i, top, total, numerator, *constants):
        limit = constants[2]
        return i * block < limit

    def body(i, top, total, numerator, *constants):
        q, cache, limit, query_positions, query_mask = constants[:5]
        batch = ops.shape(cache if pair else cache[0])[0]
        # The last block may overlap the one before it: its keys below
        # `i·b` were read already and are masked.
        zero = ops.zeros((), "int32")
        start = zero if block == num_slots else ops.minimum(
            i * block, num_slots - block)
        if packed and pair:
            slots = ops.slice(
                cache, (zero, zero, start, zero, zero),
                (batch, 2, block) + tuple(cache.shape[3:]),
            )  # (B, 2, b, K, H)
            rows = ops.cast(ops.reshape(slots, (batch, 2, block, -1)), q.dtype)
            keys, values = rows[:, 0], rows[:, 1]  # (B, b, K·H)
            written = ops.ones((1, block), "bool")
        elif packed and latent:
            latents, rope_keys, written = (
                _run(part, start, block) for part in cache
            )  # (B, b, R), (B, b, P), (B, b)
            # Two products, one per part, read each where it lies: no
            # concatenated copy of the keys.
            keys = tuple(ops.cast(x, q.dtype) for x in (latents, rope_keys))
            values = keys[0]
        elif packed:
            keys, values, written = (
                part if chunks is not None else _run(part, start, block)
                for part in cache
            )  # the whole pass reads every slot where it lies
            keys, values = (
                ops.cast(ops.reshape(x, (batch, block, -1)), q.dtype)
                for x in (keys, values)
            )  # (B, b, K·H), (B, b, K·V)
        else:
            keys, values, written = _slots(cache, start, block, layout,
                                           q.dtype)
        slot = start + ops.arange(block, dtype="int32")
        positions = cache_lib.slot_positions(
            limit, num_slots, rolling, slot
        )  # (b,); negative: the slot holds no token yet
        if packed and latent:  # q (B, R + P, N)
            rank = keys[0].shape[-1]
            scores = ops.matmul(keys[0], q[:, :rank]) + ops.matmul(
                keys[1], q[:, rank:]
            )  # (B, b, N)
            scores = ops.reshape(scores, (batch, block) + packed + (1,))
            scores = ops.transpose(scores, (0, 2, 3, 4, 1))  # (B, 1, N, 1, b)
        elif packed:
            scores = ops.matmul(keys, q)  # (B, b, K·G)
            scores = ops.reshape(scores, (batch, block) + packed + (1,))
            scores = ops.transpose(scores, (0, 2, 3, 4, 1))  # (B, K, G, 1, b)
        else:
            scores = ops.einsum("bkgth,bskh->bkgts", q, keys)
        scores = logits.soft_cap(scores, soft_cap)
        if use_alibi:  # slopes (1, K, G, 1, 1)
            distance = query_positions[:, None] - positions[None, :]  # (T, b)
            scores = scores + logits.alibi(
                constants[5], distance[None, None, None], scores.dtype
            )
        fresh = slot >= i * block  # (b,): not read by the block before
        written = ops.logical_and(written, fresh[None, :])
        mask = _slot_mask(query_positions, positions, written, query_mask,
                          causal, window, chunk)  # (B, 1, 1, T, b)
        if use_dense:
            dense = constants[-1]  # (B|1, K|1, G|1, T|1, L)
            shape = tuple(dense.shape[:4]) + (block,)
            dense = ops.slice(dense, (zero,) * 4 + (start,), shape)
            mask = ops.logical_and(mask, dense)
        scores = ops.where(
            mask, scores, ops.cast(logits.MASKED_LOGIT, scores.dtype)
        )
        new_top = ops.maximum(top, ops.amax(scores, axis=-1, keepdims=True))
        rescale = ops.exp(top - new_top)
        weights = ops.exp(scores - new_top) * ops.cast(mask, scores.dtype)
        total = total * rescale + ops.sum(weights, axis=-1, keepdims=True)
        if packed:
            if chunks is None:
                part = _packed_weighted(weights, values, packed)
            else:
                part = _chunked_weighted(weights, values, packed, chunks)
        else:
            part = ops.einsum("bkgts,bskv->bkgtv", weights, values)
        numerator = numerator * rescale + part
        return (i + 1, new_top, total, numerator, *constants)

    return cond, body


def _packed_query(q):
    """One query `(B, K, G, 1, H)` as a block-diagonal matrix `(B, K·H,
    K·G)`: row `k·H + h` of column `(k, g)` holds `q[k, g, h]`, every other
    entry 0.

    A block of keys `(B, b, K, H)` is then one contiguous `(B, b, K·H)`
    matrix, and its logits one product with it, reading the block where
    it lies. The per-head products would first transpose the keys and
    the values out of the slots: under `jax.jit` the two transposes copy
    every block the step reads, and take most of a late step's time.
    """
    num_kv, groups, head = q.shape[1], q.shape[2], q.shape[4]
    batch = ops.shape(q)[0]
    q = ops.transpose(q[:, :, :, 0], (0, 3, 1, 2))  # (B, H, K, G)
    eye = ops.eye(num_kv, dtype=q.dtype)  # (K', K)
    big = eye[None, :, None, :, None] * q[:, None]  # (B, K', H, K, G)
    return ops.reshape(big, (batch, num_kv * head, num_kv * groups))


def _packed_weighted(weights, values, heads):
    """`(B, K, G, 1, V)`: `weights` `(B, K, G, 1, b)` over `values` `(B, b,
    K·V)`, as one product with the whole block; each query head keeps its
    own head's part."""
    num_kv, groups = heads
    batch, block = ops.shape(values)[0], values.shape[1]
    w = ops.reshape(weights, (batch, num_kv * groups, block))
    out = ops.matmul(w, values)  # (B, K·G, K'·V)
    out = ops.reshape(out, (batch, num_kv, groups, num_kv, -1))
    eye = ops.eye(num_kv, dtype=out.dtype)[None, :, None, :, None]
    return ops.sum(out * eye, axis=3)[:, :, :, None]  # its own head


def _chunked_weighted(weights, values, heads, chunks):
    """`_packed_weighted` over every slot of the cache, as products summed
    over `chunks` runs of slots, then over the runs: XLA on CPU fuses the
    products into the sums and reads the values once, where they lie:
    faster than the one product of `_packed_weighted`, and far faster
    than one sum over all the slots (the tuning table's
    `decode_whole_runs` names the benchmark)."""
    num_kv, groups = heads
    batch, num_slots = ops.shape(values)[0], values.shape[1]
    run = num_slots // chunks
    values = ops.reshape(values, (batch, chunks, run, num_kv, 1, -1))
    weights = ops.reshape(weights, (batch, num_kv, groups, chunks, run))
    weights = ops.transpose(weights, (0, 3, 4, 1, 2))  # (B, n, r, K, G)
    out = ops.sum(ops.sum(values * weights[..., None], axis=2), axis=1)
    return out[:, :, :, None]  # (B, K, G, 1, V)


def _whole_chunks(num_slots, block):
    """The chunks of a one-pass read of all `num_slots`: the most runs of
    equal length up to the tuning table's `decode_whole_runs`, at least 2;
    `None` where the backend (`decode_whole_from`) or a cache of one block
    has no such pass, or `num_slots` is prime."""
    if tuning.value("decode_whole_from") is None or num_slots <= block:
        return None
    most = tuning.value("decode_whole_runs")
    for chunks in range(min(most, num_slots // 2), 1, -1):
        if num_slots % chunks == 0:
            return chunks
    return None


def _concrete_blocks(limit, block):
    """`ceil(limit / b)` as a Python int when `limit` has a value (eager
    calls), `None` when it is traced."""
    value = cache_lib.concrete_int(limit)
    return None if value is None else max(1, -(-value // block))
