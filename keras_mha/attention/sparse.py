"""The block-sparse path: attention that visits only the blocks a mask keeps.

The call's whole mask is one `rules.Mask`: the `mask_mod` argument ANDed
with the spec's causal rule, window, chunks, padding, segment ids and dense
mask (`call_mask`). Queries and keys are cut into blocks of `b` positions,
and the mask's block map (`block_maps.bounds`) says which key blocks each query
block skips, keeps whole and keeps in part. Query block `i` visits its
whole blocks with no mask at all, then its partial ones with the mask
evaluated inside the block, with `blocked.py`'s online softmax; the custom
gradient recomputes the weights the same way, key block `j` visiting the
query blocks that keep it. So the work and the memory follow the kept
blocks: O(d·T·S) time for a mask of density `d`, O(B·N·T) memory. A
score function applies to each pair of blocks, and the gradient takes its
vector-Jacobian product there (`capabilities.pullback`).

On torch, whose eager loops pay for each pair of blocks, the native
route (`sparse_kernels.py`) hands the kept blocks to torch's fused kernel a
group of query blocks at a time, for a mask whose block map is known on the
host and a spec without soft-cap, ALiBi, score function or sinks.

The lists of blocks to visit are tensors, and every loop reads its trip
count from them: a mask known on the host (no data) gives constants,
computed once; a mask that reads the call's data (document ids, prefix
lengths) gives traced lists, so a compiled step visits each call's own
blocks without recompiling when only the data changes.

    query blocks   (n_q, B, K, b·G, H)   grouped heads ride along as rows
    key blocks     (n_k, B, K, b, H)
    scores         (B, K, b·G, b)        one pair of blocks
"""

import collections

import numpy as np
from keras import ops

import keras_mha.attention.block_maps as block_maps
import keras_mha.attention.blocked as blocked
import keras_mha.attention.capabilities as capabilities
import keras_mha.attention.explicit as explicit
import keras_mha.attention.logits as logits
import keras_mha.attention.masks as masks_lib
import keras_mha.attention.rules as rules
import keras_mha.attention.tuning as tuning

_Geometry = collections.namedtuple(
    "_Geometry",
    ["block", "query_blocks", "key_blocks", "query_length", "key_length",
     "groups", "soft_cap", "alibi", "use_sinks", "score_mod"],
)


def call_mask(spec):
    """The spec's whole mask as one `rules.Mask` (`None` for none)."""
    parts = [rules.Causal() if spec.causal else None]
    if spec.window is not None:
        parts.append(rules.Window(*spec.window))
    if spec.chunk is not None:
        parts.append(rules.Chunk(spec.chunk))
    if spec.query_mask is not None or spec.key_mask is not None:
        parts.append(rules.Padding(spec.key_mask, spec.query_mask))
    if spec.segment_ids is not None:
        parts.append(rules.Documents(spec.segment_ids, spec.key_segment_ids))
    if spec.attention_mask is not None:
        parts.append(rules.DenseMask(spec.attention_mask))
    parts.append(spec.mask_mod)
    result = None
    for part in parts:
        if part is not None:
            result = part if result is None else result & part
    return result


PORTABLE = "portable"
NATIVE = "native"
IMPLEMENTATIONS = (PORTABLE, NATIVE)


def native_available(backend=None):
    """Whether `implementation="native"` exists for the backend: torch's
    fused kernel a group of query blocks at a time
    (`sparse_kernels.block_sparse`)."""
    return capabilities.has_native_block_sparse(backend)


def sparse_attention(query, key, value, spec, block_size=None,
                     implementation=None):
    """Attention as `spec` asks, visiting only the blocks its mask keeps.

    The numbers are those of `explicit.explicit_attention`: a row with no
    allowed key gets 0; half precision is computed in float32.

    Args:
        query: `(B, T, N, H)`, queries at positions `0 .. T - 1`.
        key: `(B, S, K, H)`, keys at positions `0 .. S - 1`.
        value: `(B, S, K, V)`.
        spec: with a mask; without a cache, bias, weights or dropout
            (`dispatch.can_serve`); its scale, soft-cap, ALiBi, score
            function (one `takes_score_function` serves) and sinks apply
            block by block.
        block_size: `b`; the tuning table's `sparse_block` if `None`.
        implementation: `"portable"` (`keras.ops`, every backend, a pair
            of blocks at a time), `"native"` (torch's fused kernel, for a
            spec without soft-cap, ALiBi, score function or sinks and a
            block map known on the host), or `None` for native where it
            serves.

    Returns:
        `(B, T, N, V)` in the query's dtype.
    """
    native = _native(spec, implementation)  # a bad choice, named first
    t_len, s_len = query.shape[1], key.shape[1]
    out_dtype = query.dtype
    query, key, value = explicit.upcast(query, key, value)
    batch = ops.shape(query)[0]
    num_heads, num_kv = query.shape[2], key.shape[2]
    groups = num_heads // num_kv
    block = block_size or tuning.value("sparse_block")
    mask = call_mask(spec)  # never `None`: the spec is `masked`
    grid = block_maps.Grid(t_len, s_len, block, query.shape[0] or 1,
                           num_heads)
    if native:
        some, every = block_maps.bounds(mask, grid)
        if isinstance(some, np.ndarray) and isinstance(every, np.ndarray):
            import keras_mha.attention.sparse_kernels as sparse_kernels

            out = sparse_kernels.block_sparse(query, key, value, mask, some,
                                              every, block, spec.scale)
            return ops.cast(out, out_dtype)
        if implementation == NATIVE:
            raise ValueError(
                "`implementation='native'` needs a block map known on the "
                "host; this mask reads traced data. Received: "
                f"mask_mod={spec.mask_mod!r}")
    geometry = _Geometry(
        block=block, query_blocks=grid.num_query_blocks,
        key_blocks=grid.num_key_blocks, query_length=t_len,
        key_length=s_len, groups=groups, soft_cap=spec.soft_cap,
        alibi=None if spec.alibi is None else tuple(spec.alibi),
        use_sinks=spec.sinks is not None, score_mod=spec.score_mod,
    )
    lists = _visits(mask, grid)
    q = ops.multiply(query, ops.cast(spec.scale, query.dtype))
    q = _query_rows(blocked.pad(q, grid.num_query_blocks * block - t_len),
                    geometry)  # (n_q, B, K, b·G, H)
    k, v = (_key_blocks(x, geometry) for x in (key, value))
    if spec.sinks is None:
        sinks = ops.zeros((num_kv, groups), q.dtype)
    else:
        sinks = ops.reshape(ops.cast(spec.sinks, q.dtype), (num_kv, groups))
    tensors, rebuild = rules.tensors_of(mask)
    function = _attention(geometry, mask, rebuild, _owner(spec, mask))
    out = function(q, k, v, sinks, *lists, *tensors)  # (n_q, B, K, b·G, V)
    n_q = geometry.query_blocks
    out = ops.reshape(out, (n_q, -1, num_kv, block, groups, value.shape[3]))
    out = ops.transpose(out, (1, 0, 3, 2, 4, 5))  # (B, n_q, b, K, G, V)
    out = ops.reshape(out, (batch, n_q * block, num_heads, value.shape[3]))
    return ops.cast(out[:, :t_len], out_dtype)  # (B, T, N, V)


def _native(spec, implementation):
    """Whether the call goes to the backend's fused kernel a group of query
    blocks at a time (`sparse_kernels.block_sparse`), which takes no
    soft-cap, ALiBi, score function or sinks; an explicit choice it cannot
    serve is a named `ValueError`."""
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"Argument `implementation` must be one of {IMPLEMENTATIONS} or "
            f"`None`. Received: implementation={implementation!r}")
    serves = spec.soft_cap is None and spec.alibi is None \
        and spec.sinks is None and spec.score_mod is None
    if implementation == NATIVE:
        if not native_available():
            raise ValueError(
                "`implementation='native'` exists only on the torch "
                "backend. Received: implementation='native'")
        if not serves:
            raise ValueError(
                "`implementation='native'` takes no soft-cap, ALiBi, score "
                f"function or sinks. Received: soft_cap={spec.soft_cap}, "
                f"alibi={spec.alibi is not None}, "
                f"score_mod={spec.score_mod!r}, "
                f"sinks={spec.sinks is not None}")
        return True
    return implementation is None and native_available() and serves


def _query_rows(q, geometry):
    """`(B, n_q·b, N, H)` -> `(n_q, B, K, b·G, H)`."""
    n_q, block, groups = geometry.query_blocks, geometry.block, \
        geometry.groups
    num_kv = q.shape[2] // groups
    q = ops.reshape(q, (-1, n_q, block, num_kv, groups, q.shape[3]))
    q = ops.transpose(q, (1, 0, 3, 2, 4, 5))  # (n_q, B, K, b, G, H)
    return ops.reshape(q, (n_q, -1, num_kv, block * groups, q.shape[5]))


def _key_blocks(x, geometry):
    """`(B, S, K, X)` -> `(n_k, B, K, b, X)`."""
    n_k, block = geometry.key_blocks, geometry.block
    x = blocked.pad(x, n_k * block - geometry.key_length)
    x = ops.reshape(x, (-1, n_k, block, x.shape[2], x.shape[3]))
    return ops.transpose(x, (1, 0, 3, 2, 4))


def _visits(mask, grid):
    """The blocks to visit, as eight int32 tensors: for each query block
    its whole key blocks and their count, its partial ones and their
    count; then for each key block the query blocks that keep it whole,
    and in part. A last key block with padding is never whole."""
    some, every = block_maps.bounds(mask, grid)
    if grid.key_length % grid.block:
        last = ops.arange(grid.num_key_blocks) == grid.num_key_blocks - 1
        every = ops.logical_and(every, ops.logical_not(last)[None, :])
    some, every = ops.convert_to_tensor(some), ops.convert_to_tensor(every)
    partial = ops.logical_and(some, ops.logical_not(every))
    return (*block_maps.visit_lists(every), *block_maps.visit_lists(partial),
            *block_maps.visit_lists(ops.transpose(every)),
            *block_maps.visit_lists(ops.transpose(partial)))


def takes_score_function(score_mod, num_heads):
    """Whether the pairs of blocks can apply `score_mod` (a
    `rules.ScoreFunction`), probed once on a small block of logits: a
    function of each logit and its indices (a result of another shape, or
    an error, says it is not: the explicit path then runs it, and names
    its error), whose result carries no gradient of its own
    (`capabilities.carries_gradient`): the custom gradient differentiates
    it through its logits only, so a closure over a weight would lose the
    weight's gradient."""
    probe = ops.zeros((1, num_heads, 2, 3), "float32")
    indices = masks_lib.index_tensors(1, num_heads, ops.arange(2),
                                      ops.arange(3))
    try:
        result, carries = capabilities.carries_gradient(
            lambda score: score_mod.fn(score, *indices), probe)
    except Exception:  # not elementwise: the explicit path reports it
        return False
    shape = tuple(getattr(result, "shape", ()))
    return shape == (1, num_heads, 2, 3) and not carries


def _owner(spec, mask):
    """What keeps the call's compiled functions (`_attention`): its mask
    argument, else its score function's function, else the call's mask."""
    if spec.mask_mod is not None:
        return spec.mask_mod
    if spec.score_mod is not None and hasattr(spec.score_mod.fn,
                                              "__dict__"):
        return spec.score_mod.fn
    return mask


def _attention(geometry, mask, rebuild, owner):
    """The custom-gradient attention: `(q, k, v, sinks, *lists,
    *mask_tensors) -> out`, all in blocks; kept in the store of `owner`
    (the call's mask argument) for the whole mask's signature, so a mask
    reused across layers and steps traces it once."""
    store = owner.__dict__.setdefault("_sparse_functions", {})
    key = (geometry, rules.signature(mask))
    if key not in store:
        store[key] = _build(geometry, rebuild)
    return store[key]


def _build(geometry, rebuild):
    def attention(q, k, v, sinks, *rest):
        lists, tensors = rest[:8], rest[8:]
        mask = rebuild(list(tensors))
        rows = ops.arange(geometry.query_blocks, dtype="int32")
        cols = ops.arange(geometry.key_blocks, dtype="int32")
        out, lse, has_key = capabilities.loop_over_blocks(
            _forward_body(geometry, mask), (k, v, sinks),
            (rows, q) + lists[:4],
        )  # (n_q, B, K, b·G, V), (n_q, B, K, b·G, 1) twice

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            d_out = ops.where(has_key, upstream, ops.zeros_like(upstream))
            delta = ops.sum(ops.multiply(d_out, out), axis=-1, keepdims=True)
            d_q = capabilities.loop_over_blocks(
                _query_grad_body(geometry, mask), (k, v),
                (rows, q, d_out, lse, delta) + lists[:4],
            )
            d_k, d_v = capabilities.loop_over_blocks(
                _key_grad_body(geometry, mask), (q, d_out, lse, delta),
                (cols, k, v) + lists[4:],
            )
            d_sinks = blocked.sink_gradient(sinks, lse, delta, has_key,
                                            geometry.block, geometry.use_sinks)
            return (d_q, d_k, d_v, d_sinks) + (None,) * len(rest)

        return out, grad

    return blocked.differentiable(attention)


def _scores(geometry, mask, q_i, k_j, i, j, masked, pulled=False):
    """`(s, tanh, pull)`: the modified logits of query block `i` over key
    block `j`, `(B, K, b·G, b)`, the mask applied where `masked`;
    `tanh(logits / c)` under a soft-cap (its derivative needs it); with
    `pulled`, the pullback through the score function (else `None`)."""
    s, tanh = blocked.block_logits(q_i, k_j, geometry.soft_cap)
    b, groups, num_kv = geometry.block, geometry.groups, q_i.shape[1]
    row = ops.arange(b * groups, dtype="int32")
    query_at = ops.reshape(row // groups + i * b, (1, 1, -1, 1))
    key_at = ops.reshape(ops.arange(b, dtype="int32") + j * b, (1, 1, 1, -1))
    s = blocked.with_alibi(s, geometry.alibi, groups, b,
                           (query_at - key_at)[0, 0])  # (b·G, b)
    pull = None
    if geometry.score_mod is not None:
        scored = _score_function(geometry, i, j)
        s, pull = capabilities.pullback(scored, s) if pulled else (
            scored(s), None)
    if masked:
        head = ops.reshape(
            ops.arange(num_kv, dtype="int32"), (1, -1, 1, 1)
        ) * groups + ops.reshape(row % groups, (1, 1, -1, 1))
        batch = ops.reshape(ops.arange(ops.shape(q_i)[0], dtype="int32"),
                            (-1, 1, 1, 1))
        keep = ops.logical_and(
            mask.evaluate(batch, head, query_at, key_at),
            ops.less(key_at, geometry.key_length),
        )
        s = ops.where(keep, s, ops.cast(logits.MASKED_LOGIT, s.dtype))
    return s, tanh, pull


def _score_function(geometry, i, j):
    """The score function on the logits of query block `i` over key block
    `j`, `(B, K, b·G, b) -> (B, K, b·G, b)`. The function sees them as the
    explicit path shows it a call's, `(B, N, b, b)` with the index tensors
    (`masks.index_tensors`); a padded query or key reads the last real
    position (the mask drops them)."""
    b, groups = geometry.block, geometry.groups

    def scored(s):
        num_kv = s.shape[1]
        x = ops.reshape(s, (-1, num_kv, b, groups, b))
        x = ops.reshape(ops.transpose(x, (0, 1, 3, 2, 4)),
                        (-1, num_kv * groups, b, b))  # (B, N, b, b)
        steps = ops.arange(b, dtype="int32")
        queries = ops.minimum(steps + i * b, geometry.query_length - 1)
        keys = ops.minimum(steps + j * b, geometry.key_length - 1)
        x = geometry.score_mod(x, *masks_lib.index_tensors(
            ops.shape(x)[0], num_kv * groups, queries, keys))
        x = ops.transpose(ops.reshape(x, (-1, num_kv, groups, b, b)),
                          (0, 1, 3, 2, 4))
        return ops.reshape(x, (-1, num_kv, b * groups, b))

    return scored


def _at(x, index):
    """`x[index]` along the leading axis for a traced `index`: a gather,
    whose index may be data (TensorFlow's XLA takes a slice's start as a
    compile-time constant, and would compile once per list of blocks)."""
    return ops.take(x, index, axis=0)


def _visit(lists, step, state):
    """`state` through the whole blocks, then the partial ones, of one
    block's lists `(whole, n_whole, partial, n_partial)`; `step(state,
    other, masked)`."""
    whole, n_whole, partial, n_partial = lists
    state = ops.fori_loop(
        0, n_whole, lambda t, s: step(s, _at(whole, t), False), state)
    return ops.fori_loop(
        0, n_partial, lambda t, s: step(s, _at(partial, t), True),
        state)


def _forward_body(geometry, mask):
    def body(constants, x):
        k, v, sinks = constants
        i, q_i, *lists = x

        def step(state, j, masked):
            s, _, _ = _scores(geometry, mask, q_i, _at(k, j), i, j,
                              masked)
            return blocked.online_step(state, s, _at(v, j))

        state = _visit(lists, step, blocked.initial_state(q_i, v.shape[-1]))
        sink_rows = blocked.row_values(sinks, geometry.block) \
            if geometry.use_sinks else None
        return constants, blocked.finish_rows(state, sink_rows, True)

    return body


def _query_grad_body(geometry, mask):
    def body(constants, x):
        k, v = constants
        i, q_i, do_i, lse_i, delta_i, *lists = x

        def step(d_q, j, masked):
            k_j = _at(k, j)
            s, tanh, pull = _scores(geometry, mask, q_i, k_j, i, j, masked,
                                    pulled=True)
            d_s, _ = blocked.grads_of_scores(s, tanh, _at(v, j),
                                             do_i, lse_i, delta_i, pull)
            return ops.add(d_q, ops.einsum("bkrs,bksh->bkrh", d_s, k_j))

        return constants, _visit(lists, step, ops.zeros_like(q_i))

    return body


def _key_grad_body(geometry, mask):
    def body(constants, x):
        q, d_out, lse, delta = constants
        j, k_j, v_j, *lists = x

        def step(grads, i, masked):
            d_k, d_v = grads
            q_i, do_i = _at(q, i), _at(d_out, i)
            s, tanh, pull = _scores(geometry, mask, q_i, k_j, i, j, masked,
                                    pulled=True)
            d_s, p = blocked.grads_of_scores(
                s, tanh, v_j, do_i, _at(lse, i),
                _at(delta, i), pull)
            return (ops.add(d_k, ops.einsum("bkrs,bkrh->bksh", d_s, q_i)),
                    ops.add(d_v, ops.einsum("bkrs,bkrv->bksv", p, do_i)))

        grads = (ops.zeros_like(k_j), ops.zeros_like(v_j))
        return constants, _visit(lists, step, grads)

    return body
