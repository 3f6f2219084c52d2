"""The eager decode step's backend kernels.

TensorFlow and JAX: `graph_decode` runs `decode.decode_attention`'s block
loop as a `tf.function` graph or under `jax.jit`, so its operations do not
pay Python's per-op dispatch in an eager call.

torch: `decode_core` reads every slot of a step at once with the fused
attention kernel, on strided views of the cache (its soft-cap and sinks
share `kernels.py`'s autograd functions with the band); `latent_core` does
the same for multi-head latent attention's one shared head, with two
products that read the latents and the rope keys where they lie.
"""

import functools

import keras_mha.attention.tuning as tuning


def graph_decode(step, query, cache, spec, rolling, block_size, layout,
                 limit):
    """TensorFlow and JAX, eager: the decode step `step`
    (`decode_attention`) as one compiled function, traced once per
    geometry and spec: `tf.function` (a graph) or `jax.jit`.

    Run op by op, every one of the block loop's operations pays Python's
    dispatch in an eager call, and a block takes dozens of them; compiled,
    the loop is a `while` whose trip count is the index, and the cache goes
    in without a copy. The compiled step is much faster on CPU, the more
    so the more slots it reads (`python -m benchmarks --decode` times it;
    the numbers are in docs/performance.md). On TensorFlow the graph is
    not compiled with XLA (`jit_compile=True`): it runs no faster, and it
    traces for longer. On JAX `jax.jit` donates nothing: the step only
    reads the cache.

    Args are `decode_attention`'s; the spec's tensors (offset, masks,
    sinks) are the function's inputs, its Python values part of its key.
    """
    from keras import ops

    offset = ops.cast(spec.query_offset, "int32")
    if limit is not None:
        limit = ops.cast(limit, "int32")
    sinks = None if spec.sinks is None else ops.convert_to_tensor(spec.sinks)
    function = _graph_decode_function(
        step, spec.scale, spec.causal, spec.window, spec.chunk,
        spec.soft_cap, spec.alibi, rolling, block_size, layout,
    )
    return function(query, cache, offset, limit, spec.query_mask,
                    spec.attention_mask, sinks)


@functools.lru_cache(maxsize=64)
def _graph_decode_function(step, scale, causal, window, chunk, soft_cap,
                           alibi, rolling, block_size, layout):
    from keras_mha.attention.spec import AttentionSpec

    def run(query, cache, offset, limit, query_mask, attention_mask, sinks):
        spec = AttentionSpec(
            scale=scale, causal=causal, window=window, chunk=chunk,
            soft_cap=soft_cap,
            alibi=alibi, query_offset=offset, query_mask=query_mask,
            attention_mask=attention_mask, sinks=sinks,
        )
        return step(query, cache, spec, rolling, block_size, layout, limit,
                    implementation="portable")

    return _graph(run)


def _graph(run):
    """`run` as one compiled function: `jax.jit` or `tf.function`."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(run)
    import tensorflow as tf

    return tf.function(run)


def graph_paged(attend, query, cache, batch, spec, items, value_size):
    """TensorFlow and JAX, eager: a ragged call's attention (`attend`,
    `paged.attend`) as one compiled function, traced once per geometry
    (rows, tokens, work items, pool) and spec, as `graph_decode` compiles
    the dense step: run op by op, each of its few dozen operations pays
    Python's dispatch, and on JAX each is compiled for every new shape."""
    from keras import ops

    from keras_mha.attention.paged import RaggedBatch

    rows, pages, grid = items
    sinks = None if spec.sinks is None else ops.convert_to_tensor(spec.sinks)
    batch = RaggedBatch(*(ops.convert_to_tensor(part, "int32")
                          for part in batch))
    function = _graph_paged_function(attend, spec.scale, spec.window,
                                     spec.chunk, spec.soft_cap, spec.alibi,
                                     grid, value_size)
    return function(query, cache, batch, sinks, rows, pages)


@functools.lru_cache(maxsize=64)
def _graph_paged_function(attend, scale, window, chunk, soft_cap, alibi,
                          grid, value_size):
    from keras_mha.attention.spec import AttentionSpec

    def run(query, cache, batch, sinks, rows, pages):
        spec = AttentionSpec(scale=scale, causal=True, window=window,
                             chunk=chunk, soft_cap=soft_cap, alibi=alibi,
                             sinks=sinks)
        return attend(query, cache, batch, spec, (rows, pages, grid),
                      value_size)

    return _graph(run)


def decode_core(q, keys, values, mask, alibi=None, sinks=None,
                soft_cap=None):
    """A decoding step over the slots below its limit at once: torch's
    fused kernel on strided views of the cache (`decode._native_step`).

    The portable step reads the slots a block at a time with an online
    softmax, and its per-block products dominate. The flash kernel reads
    the first `p` slots at once, the keys and values where they lie
    (`python -m benchmarks --backends torch --decode`).

    Args:
        q: `(B, K, G, T, H)`, already scaled.
        keys: `(B, S, K, H)`, a view of the cache's slots.
        values: `(B, S, K, V)`.
        mask: boolean `(B|1, K|1, G|1, T, S)`, every row with at least one
            key (`masks.open_empty_rows`).
        alibi: `None`, or ALiBi's term broadcastable against `mask`.
        sinks: `None`, or the `(K, G)` sink logits.
        soft_cap: `None`, or `c > 0`.

    Returns:
        `(B, K, G, T, V)`.
    """
    import torch

    import keras_mha.attention.kernels as kernels

    batch, num_kv, groups, t_len, head = q.shape
    value_head = values.shape[-1]
    rows = q.reshape(batch, num_kv, groups * t_len, head)
    k = keys.permute(0, 2, 1, 3).to(q.dtype)  # (B, K, S, H), strided
    v = values.permute(0, 2, 1, 3).to(q.dtype)
    term = q.new_zeros(()) if alibi is None else alibi.to(q.dtype)
    bias = torch.where(mask, term, float("-inf"))  # (B|1, K|1, G|1, T, S)
    lead, heads, span = bias.shape[0], bias.shape[1], bias.shape[-1]
    bias = bias.expand(lead, heads, groups, t_len, span).reshape(
        lead, heads, groups * t_len, span
    )
    sink_rows = None
    if sinks is not None:
        sink_rows = sinks.to(q.dtype).reshape(1, num_kv, groups, 1).expand(
            batch, num_kv, groups, t_len
        ).reshape(batch, num_kv, groups * t_len)
    if soft_cap is not None:
        out = kernels.capped_attention().apply(
            rows, k, v, bias, sink_rows, 1.0, soft_cap
        )
    elif sink_rows is not None:
        rows, k, v = kernels.equal_sizes(rows, k, v)  # the kernel's rule
        out = kernels.sink_attention().apply(rows, k, v, bias, sink_rows, 1.0)
    elif (batch == 1 and span >= tuning.value("decode_chunked_from")
          and not kernels.differentiated(rows, k, v)):
        out = _chunked_step(rows, k, v, bias)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            rows, k, v, attn_mask=bias, scale=1.0
        )
    return out[..., :value_head].reshape(
        batch, num_kv, groups, t_len, value_head
    )


def _chunked_step(rows, k, v, bias):
    """`scaled_dot_product_attention(rows, k, v, attn_mask=bias)` for one
    batch row over many slots, the slots cut into chunks that are the flash
    kernel's batch: each of its tasks reads a run of slots, not one head's
    every slot, and the chunks' outputs merge by their log-sum-exp. The
    tuning table sets the chunk (`decode_chunk`) and the slots from which
    a step takes this route (`decode_chunked_from`).

    `rows` `(1, K, R, H)`, `k` `(1, K, S, H)` and `v` `(1, K, S, V)` (views
    of the cache), `bias` `(1, K|1, R, S)` with a finite entry in every
    row; returns `(1, K, R, V)`.
    """
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    chunk = tuning.value("decode_chunk")
    whole = k.shape[2] // chunk * chunk

    def chunks(x):  # (1, K, S, X) -> (S // chunk, K, chunk, X), a view
        return x[0, :, :whole].unflatten(1, (-1, chunk)).transpose(0, 1)

    masks = [bias[0, :, :, :whole].unflatten(2, (-1, chunk)).permute(
        2, 0, 1, 3
    )]  # (S // chunk, K|1, R, chunk)
    parts = [flash(
        rows.expand(whole // chunk, *rows.shape[1:]), chunks(k), chunks(v),
        0.0, False, attn_mask=masks[0], scale=1.0,
    )]
    if whole < k.shape[2]:
        masks.append(bias[..., whole:])
        parts.append(flash(
            rows, k[:, :, whole:], v[:, :, whole:], 0.0, False,
            attn_mask=masks[1], scale=1.0,
        ))
    out = torch.cat([part[0] for part in parts])  # (chunks, K, R, V)
    # The kernel answers a row without a key in its chunk with 0 and a
    # log-sum-exp of 0: such a chunk leaves the merge.
    live = torch.cat([m.isfinite().any(-1) for m in masks])  # (.., K|1, R)
    lse = torch.cat([part[1] for part in parts]).masked_fill(
        ~live, float("-inf")
    )  # (chunks, K, R)
    weights = torch.exp(lse - lse.amax(0))[..., None]
    return ((out * weights).sum(0) / weights.sum(0))[None]


def latent_core(q, latents, rope_keys, mask, alibi=None, sinks=None,
                soft_cap=None):
    """An absorbed latent decoding step (`decode.LATENT`) over the slots
    below its limit at once, on torch: the logits of every head against
    the latents and the rope keys as two products that read each where it
    lies, a softmax over the slots, and one product with the latents.

    The fused kernel would need the keys `[latent, rope_key]` as one
    tensor (a copy of every slot read) and, with key and value sizes that
    differ, runs torch's unfused path, which scales a copy of the keys.
    With one shared head, the logits are `(G·T, S)` per batch row, a small
    fraction of the `S·(R + P)` numbers the step reads.

    Args:
        q: `(B, 1, G, T, R + P)`, already scaled.
        latents: `(B, S, R)`, a view of the cache's slots.
        rope_keys: `(B, S, P)`.
        mask: boolean `(B|1, 1, G|1, T, S)`, every row with at least one
            key (`masks.open_empty_rows`).
        alibi: `None`, or ALiBi's term broadcastable against `mask`.
        sinks: `None`, or the `(1, G)` sink logits.
        soft_cap: `None`, or `c > 0`.

    Returns:
        `(B, 1, G, T, R)`.
    """
    import torch

    batch, _, groups, t_len, _ = q.shape
    rank = latents.shape[-1]
    rows = q.reshape(batch, groups * t_len, -1)
    lat = latents.to(q.dtype)
    # The slots as the product's rows: for a few heads' rows, MKL runs
    # `(S, R)·(R, G·T)` faster than `(G·T, R)·(R, S)`.
    scores = torch.bmm(lat, rows[..., :rank].transpose(1, 2))  # (B, S, G·T)
    scores = scores.baddbmm_(rope_keys.to(q.dtype),
                             rows[..., rank:].transpose(1, 2))
    scores = scores.transpose(1, 2).reshape(batch, 1, groups, t_len, -1)
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if alibi is not None:
        scores = scores + alibi.to(q.dtype)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more logit per row, with no value
        sink = sinks.to(q.dtype).reshape(1, 1, groups, 1, 1).expand(
            batch, 1, groups, t_len, 1)
        weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        weights = torch.softmax(scores, -1)
    out = torch.bmm(weights.reshape(batch, groups * t_len, -1), lat)
    return out.reshape(batch, 1, groups, t_len, rank)
