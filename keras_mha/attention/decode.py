"""The decode path: attention over the cache itself, reading only what a
step can see.

A decoding step writes its `T` new tokens into the cache first, then
attends over the cache. In a full cache slot `j` holds position `j`, and
no slot at or after `limit = index + T` is visible, so the step reads the
key blocks below `limit` only, a block at a time with an online softmax:
`ceil(limit / b)` blocks, a cost that follows the position, not the
cache's size. A rolling cache (one token at a time) is one block of its
`w` slots.

Three jobs, three pieces: `cache_layouts.py` reads a cache's layout (ours,
keras-hub's one tensor, the latent cache) a run of slots at a time;
`_route` chooses how a step runs; the runners (`_native_step`,
`_block_loop`) run it. The routes:

- `graph`: an eager step on TensorFlow and JAX, this function compiled as
  one function (`decode_kernels.graph_decode`: a graph, `jax.jit`), which
  saves the loop's per-op dispatch;
- `kernel`: an eager step on torch, its fused attention kernel over every
  slot below the limit, on strided views of the cache (a long step in
  chunks of slots merged by their log-sum-exp), and for the latent cache
  two products that read its latents and rope keys where they lie
  (`decode_kernels.decode_core`, `latent_core`);
- `loop`: the block loop in Python, op by op (an eager step elsewhere, or
  one that `force_implementation("portable")` holds);
- `one_block`: under `torch.compile` with a traced limit, one block of
  every slot (Dynamo cannot capture a loop whose trip count is a tensor);
- `while_loop`: traced (`jax.jit`, `tf.function`), a `keras.ops.while_loop`
  whose trip count is a tensor, so the step traces once;
- `whole`: traced, one query late in a large cache on JAX, every slot in
  one pass instead (the tuning table's `decode_whole_from`): XLA on CPU
  copies each block the loop slices, and the pass reads the cache where
  it lies.

Shapes: query `(B, T, N, H)`; the cache in one of `cache_layouts.LAYOUTS`.
The numbers are those of `explicit.explicit_attention` with the spec's
keys at their slots' positions: scale, soft-cap, ALiBi, sinks, masks, and
weights 0 for a row with nothing to attend to.
"""

import collections
import functools

import keras
from keras import ops

import keras_mha.attention.cache as cache_lib
import keras_mha.attention.cache_layouts as cache_layouts
import keras_mha.attention.capabilities as capabilities
import keras_mha.attention.explicit as explicit
import keras_mha.attention.logits as logits
import keras_mha.attention.masks as masks_lib
import keras_mha.attention.overrides as overrides
import keras_mha.attention.tuning as tuning

FLAGGED = cache_layouts.FLAGGED  # ours: (keys, values, valid), see `cache.py`
PAIR = cache_layouts.PAIR  # keras-hub's: (B, 2, L, K, H)
LATENT = cache_layouts.LATENT  # the latent cache, one key/value head

PORTABLE = "portable"  # the loop over key blocks, `keras.ops` only
NATIVE = "native"  # eager steps: torch's fused kernel; TF, JAX compiled
IMPLEMENTATIONS = (PORTABLE, NATIVE)

# The routes of a step (`_route`; the module's docstring says each).
GRAPH = "graph"  # eager, TensorFlow and JAX: this function compiled
KERNEL = "kernel"  # eager, torch: its fused kernel over the slots
LOOP = "loop"  # eager: the block loop, op by op
ONE_BLOCK = "one_block"  # `torch.compile`, a traced limit: every slot
WHILE_LOOP = "while_loop"  # traced: the trip count a tensor
WHOLE = "whole"  # traced, late in a large cache: one pass
ROUTES = (GRAPH, KERNEL, LOOP, ONE_BLOCK, WHILE_LOOP, WHOLE)

# The implementations `force_implementation` blocks hold (`overrides.held`).
_forced = []


def force_implementation(implementation):
    """Runs every eager decoding step in the block on `implementation`.

    `"portable"`: the block loop, op by op; `"native"`: the backend's own
    route for every eager step (torch's fused kernel over the slots below
    the limit, TensorFlow's and JAX's loop compiled as one function; a
    `ValueError` at the step on NumPy, which has none). Outside such a
    block the native route runs where it serves the step; traced steps
    always run the portable loop. For tests and benchmarks that compare
    the two on the same inputs, as `dispatch.force_path` compares the
    paths; `decode_attention`'s `implementation` argument comes first.
    """
    return overrides.held(_forced, "implementation", implementation,
                          IMPLEMENTATIONS)


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
        cache: holding the step's own tokens, in `layout`: ours, `(keys,
            values, valid)` (see `cache.py`; `valid` says where a real
            token was written), keras-hub's `(B, 2, L, K, H)`, or the
            latent cache (see `cache_layouts.py`).
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
            `decode_kernels.graph_decode`) or `None`: the one a
            `force_implementation` block holds, else the native route
            where it exists (on torch while its bias stays below the
            tuning table's `decode_native_bias_limit`). Traced steps always
            run the portable loop.

    Returns:
        `(B, T, N, V)` in the query's dtype.
    """
    implementation = _implementation(implementation)
    route, step = _route(implementation, (query, cache), functools.partial(
        _read, query, cache, spec, rolling, block_size, layout, limit))
    if route == GRAPH:
        import keras_mha.attention.decode_kernels as decode_kernels

        return decode_kernels.graph_decode(
            decode_attention, query, cache, spec, rolling, block_size,
            layout, limit,
        )
    out = _native_step(step) if route == KERNEL else _block_loop(step, route)
    return _heads_back(out, query.dtype)


# ------------------------------------------------------------ the step read

# A step's inputs, read once (`_read`): the scaled query `q` `(B, K, G, T,
# H)` in at least float32 and `B`, `batch`; the cache, its `layout`, `rolling`, the `spec`;
# `num_slots` `L`, `block` `b` and `value_dim` `V`; the query positions
# `(T,)`, the `limit` (an int32 scalar) and `known_limit`, its Python value
# in a full cache (`None` when traced, and in a rolling cache, which reads
# its `w` slots whatever the limit); the `query_mask` `(B, T)`; the terms
# that are `None` where unused: ALiBi's `slopes` `(1, K, G, 1, 1)`, the
# `dense` mask `(B|1, K|1, G|1, T|1, L)` and the `sinks` `(K, G)`.
_Step = collections.namedtuple("_Step", [
    "q", "batch", "cache", "layout", "rolling", "spec", "num_slots", "block",
    "value_dim", "query_positions", "limit", "known_limit", "query_mask",
    "slopes", "dense", "sinks",
])


def _read(query, cache, spec, rolling, block_size, layout, limit):
    """The `_Step` of `decode_attention`'s arguments."""
    num_slots = cache_layouts.num_slots(cache, layout)
    if block_size is None:
        block_size = block_size_for()
    block = num_slots if rolling else min(block_size, num_slots)
    (query,) = explicit.upcast(query)
    dtype = query.dtype
    batch, t_len = ops.shape(query)[0], query.shape[1]
    num_heads, key_dim = query.shape[2], query.shape[3]
    num_kv, value_dim = cache_layouts.head_sizes(cache, layout)
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
    return _Step(
        q, batch, cache, layout, rolling, spec, num_slots, block, value_dim,
        query_positions, limit,
        None if rolling else cache_lib.concrete_int(limit), query_mask,
        *_terms(spec, num_kv, groups, dtype),
    )


def _terms(spec, num_kv, groups, dtype):
    """`(slopes, dense, sinks)` of a step, laid out per key/value head and
    group (see `_Step`); `None` where the spec has none."""
    slopes = dense = sinks = None
    if spec.alibi is not None:
        slopes = ops.convert_to_tensor(spec.alibi, dtype)
        slopes = ops.reshape(slopes, (1, num_kv, groups, 1, 1))
    if spec.attention_mask is not None:
        # (B|1, N|1, T|1, L) -> (B|1, K|1, G|1, T|1, L)
        dense = spec.attention_mask
        lead, heads = dense.shape[0], dense.shape[1]
        dense = ops.reshape(
            dense,
            (-1 if lead != 1 else 1,)
            + ((num_kv, groups) if heads != 1 else (1, 1))
            + tuple(dense.shape[2:]),
        )
        dense = ops.cast(dense, "bool")
    if spec.sinks is not None:
        sinks = ops.reshape(ops.cast(spec.sinks, dtype), (num_kv, groups))
    return slopes, dense, sinks


def _heads_back(out, dtype):
    """`(B, K, G, T, V)` -> `(B, T, N, V)` in `dtype`."""
    batch, num_kv, groups, t_len, value_dim = (
        ops.shape(out)[0], *out.shape[1:]
    )
    out = ops.transpose(out, (0, 3, 1, 2, 4))
    return ops.cast(
        ops.reshape(out, (batch, t_len, num_kv * groups, value_dim)), dtype
    )


# ---------------------------------------------------------------- the route


def _implementation(implementation):
    """The implementation asked for (`decode_attention`'s argument, else
    the one a `force_implementation` block holds), checked: `PORTABLE`,
    `NATIVE`, or `None` (the native route where it serves the step)."""
    if implementation is None and _forced:
        implementation = _forced[-1]
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


def _route(implementation, tensors, read):
    """`(route, step)`: which of `ROUTES` runs a step, and the step read
    (`read()`, a `_Step`; `None` for `graph`, which reads it inside the
    compiled function). See the module's docstring for the routes."""
    if implementation != PORTABLE and capabilities.compiles_eager_call(
        tensors
    ):
        return GRAPH, None
    step = read()
    if _blocks(step) is not None:  # eager, or one block of a rolling cache
        return (KERNEL if _takes_native(implementation, step) else LOOP), step
    if capabilities.compiling_one_graph():
        return ONE_BLOCK, step
    return (WHOLE if _whole_chunks(step) else WHILE_LOOP), step


def _takes_native(implementation, step):
    """Whether an eager step runs `decode_kernels.decode_core` (see
    `decode_attention`'s `implementation`)."""
    if (implementation == PORTABLE
            or not capabilities.has_fused_decode_kernel()):
        return False
    if implementation == NATIVE:
        return True
    _, num_kv, groups, t_len, _ = step.q.shape
    varies = step.slopes is not None or (
        step.dense is not None and step.dense.shape[1] > 1
    )
    return (num_kv if varies else 1) * groups * t_len * step.num_slots <= (
        tuning.value("decode_native_bias_limit")
    )


def _blocks(step):
    """The blocks a step reads, `ceil(limit / b)`, as a Python int (one in
    a rolling cache); `None` where the limit is traced."""
    if step.rolling:
        return 1
    if step.known_limit is None:
        return None
    return max(1, -(-step.known_limit // step.block))


def _packed(step):
    """`(K, G)` where the products read each block in place
    (`_packed_query`: one query, on a backend whose products do not read
    strided keys without a copy anyway), else `None`."""
    _, num_kv, groups, t_len, _ = step.q.shape
    if t_len != 1 or capabilities.products_read_strided_views():
        return None
    return num_kv, groups


def _whole_chunks(step):
    """The chunks of a one-pass read of every slot of a traced step
    (`whole`): the most runs of equal length up to the tuning table's
    `decode_whole_runs`, at least 2; `None` where the step has no such
    pass: several queries, a rolling cache or another layout than ours, a
    backend without `decode_whole_from`, a cache of one block, or a
    prime number of slots."""
    num_slots = step.num_slots
    if (
        _packed(step) is None or step.layout != FLAGGED or step.rolling
        or tuning.value("decode_whole_from") is None
        or num_slots <= step.block
    ):
        return None
    most = tuning.value("decode_whole_runs")
    for chunks in range(min(most, num_slots // 2), 1, -1):
        if num_slots % chunks == 0:
            return chunks
    return None


# ---------------------------------------------------------------- the runs


def _native_step(step):
    """`(B, K, G, T, V)`: the step over its slots below the limit at once,
    with torch's fused kernel (`decode_kernels.decode_core`); the keys and
    the values are strided views of the cache, never copied."""
    import keras_mha.attention.decode_kernels as decode_kernels

    q, cache, spec = step.q, step.cache, step.spec
    size = step.num_slots if step.rolling else min(step.known_limit,
                                                   step.num_slots)
    if step.layout == LATENT:  # two parts read where they lie
        latents, rope_keys, written = (cache_layouts.run(part, 0, size)
                                       for part in cache)
    else:
        keys, values, written = cache_layouts.slots(cache, 0, size,
                                                    step.layout, q.dtype)
    positions = cache_lib.slot_positions(
        step.limit, step.num_slots, step.rolling,
        ops.arange(size, dtype="int32"),
    )
    mask = _slot_mask(step.query_positions, positions, written,
                      step.query_mask, spec.causal, spec.window,
                      spec.chunk)  # (B, 1, 1, T, S)
    if step.dense is not None:
        mask = ops.logical_and(mask, step.dense[..., :size])
    alibi = None
    if step.slopes is not None:
        distance = step.query_positions[:, None] - positions[None, :]
        alibi = logits.alibi(step.slopes, distance[None, None, None], q.dtype)
    mask, has_key = masks_lib.open_empty_rows(mask)
    if step.layout == LATENT:
        out = decode_kernels.latent_core(q, latents, rope_keys, mask, alibi,
                                         step.sinks, spec.soft_cap)
    else:
        out = decode_kernels.decode_core(q, keys, values, mask, alibi,
                                         step.sinks, spec.soft_cap)
    return masks_lib.zero_empty_rows(out, has_key)


def _block_loop(step, route):
    """`(B, K, G, T, V)`: the online softmax over the blocks below the
    limit, on `route`: `loop` and `one_block` in Python, `while_loop`
    traced, `whole` one pass late in the cache and the loop before."""
    q, spec = step.q, step.spec
    block = step.num_slots if route == ONE_BLOCK else step.block
    shape = (step.batch, *q.shape[1:4])  # (B, K, G, T)
    state = (
        ops.zeros((), "int32"),  # the block
        ops.full(shape + (1,), logits.MASKED_LOGIT, q.dtype),  # running max
        ops.zeros(shape + (1,), q.dtype),  # running denominator
        ops.zeros(shape + (step.value_dim,), q.dtype),  # running numerator
    )
    packed = _packed(step)
    constants = (
        q if packed is None else _packed_query(q), step.cache, step.limit,
        step.query_positions, step.query_mask,
    ) + tuple(x for x in (step.slopes, step.dense) if x is not None)
    geometry = (
        step.num_slots, step.rolling, spec.causal, spec.window, spec.chunk,
        spec.soft_cap, step.slopes is not None, step.dense is not None,
        step.layout, packed,
    )
    # `lru_cache`'s wrapper is a graph break under `torch.compile`.
    loop = _loop.__wrapped__ if capabilities.compiling_one_graph() else _loop
    cond, body = loop(block, *geometry)
    if route == WHOLE:
        # Late in a large cache: one pass over every slot beats the loop's
        # copies of each block (`decode_whole_from`).
        whole = _loop(step.num_slots, *geometry, _whole_chunks(step))[1]
        state = ops.cond(
            step.limit > int(tuning.value("decode_whole_from")
                             * step.num_slots),
            lambda: whole(*state, *constants)[:4],
            lambda: ops.while_loop(cond, body, state + constants)[:4],
        )
    elif route == WHILE_LOOP:  # the trip count is a tensor
        state = ops.while_loop(cond, body, state + constants)
    else:
        state = state + constants
        for _ in range(1 if route == ONE_BLOCK else _blocks(step)):
            state = body(*state)
    return _finish(step, *state[1:4])


def _finish(step, top, total, numerator):
    """`(B, K, G, T, V)` from the online softmax's state, the sinks joined
    to its denominator; 0 for a row with no key."""
    if step.sinks is not None:
        sinks = ops.reshape(step.sinks, (1, *step.sinks.shape, 1, 1))
        top, total, numerator = logits.fold_sink(top, total, numerator, sinks)
    out = ops.divide(numerator, ops.maximum(total, 1e-30))
    return ops.where(total > 0, out, ops.zeros_like(out))


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
    that many chunks of them (`_chunked_weighted`)."""
    read = cache_layouts.packed_slots if packed else cache_layouts.slots

    def cond(i, top, total, numerator, *constants):
        limit = constants[2]
        return i * block < limit

    def body(i, top, total, numerator, *constants):
        q, cache, limit, query_positions, query_mask = constants[:5]
        # The last block may overlap the one before it: its keys below
        # `i·b` were read already and are masked.
        start = ops.zeros((), "int32") if block == num_slots else (
            ops.minimum(i * block, num_slots - block))
        keys, values, written = read(cache, start, block, layout, q.dtype)
        slot = start + ops.arange(block, dtype="int32")
        positions = cache_lib.slot_positions(
            limit, num_slots, rolling, slot
        )  # (b,); negative: the slot holds no token yet
        scores = logits.soft_cap(_block_scores(q, keys, packed), soft_cap)
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
            zero = ops.zeros((), "int32")
            mask = ops.logical_and(mask, ops.slice(
                dense, (zero,) * 4 + (start,),
                tuple(dense.shape[:4]) + (block,),
            ))
        top, total, numerator = _online_step(
            top, total, numerator, scores, mask, values, packed, chunks
        )
        return (i + 1, top, total, numerator, *constants)

    return cond, body


def _block_scores(q, keys, packed):
    """`(B, K, G, T, b)`: the logits of a block's keys; `packed` (see
    `_loop`): one product with the packed query, keys `(B, b, K·H)`, or
    the latent cache's pair of parts, one product each."""
    if packed is None:
        return ops.einsum("bkgth,bskh->bkgts", q, keys)
    if isinstance(keys, tuple):  # q (B, R + P, N)
        rank = keys[0].shape[-1]
        scores = ops.matmul(keys[0], q[:, :rank]) + ops.matmul(
            keys[1], q[:, rank:]
        )  # (B, b, N)
    else:
        scores = ops.matmul(keys, q)  # (B, b, K·G)
    scores = ops.reshape(scores, (-1, scores.shape[1]) + packed + (1,))
    return ops.transpose(scores, (0, 2, 3, 4, 1))  # (B, K, G, 1, b)


def _online_step(top, total, numerator, scores, mask, values, packed,
                 chunks):
    """The online softmax's state `(top, total, numerator)` after one
    block's masked `scores` and its `values` (see `_loop`)."""
    scores = ops.where(
        mask, scores, ops.cast(logits.MASKED_LOGIT, scores.dtype)
    )
    new_top = ops.maximum(top, ops.amax(scores, axis=-1, keepdims=True))
    rescale = ops.exp(top - new_top)
    weights = ops.exp(scores - new_top) * ops.cast(mask, scores.dtype)
    total = total * rescale + ops.sum(weights, axis=-1, keepdims=True)
    if packed is None:
        part = ops.einsum("bkgts,bskv->bkgtv", weights, values)
    elif chunks is None:
        part = _packed_weighted(weights, values, packed)
    else:
        part = _chunked_weighted(weights, values, packed, chunks)
    return new_top, total, numerator * rescale + part


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
