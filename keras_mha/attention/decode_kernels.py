"""TensorFlow and JAX: an eager decode step compiled as one function.

`graph_decode` runs `decode.decode_attention`'s block loop as a
`tf.function` graph or under `jax.jit`, so its operations do not pay
Python's per-op dispatch in an eager call. torch's eager steps take
`kernels.decode_core` instead.
"""

import functools


def graph_decode(step, query, cache, spec, rolling, block_size, layout,
                 limit):
    """TensorFlow and JAX, eager: the decode step `step`
    (`decode_attention`) as one compiled function, traced once per
    geometry and spec: `tf.function` (a graph) or `jax.jit`.

    Run op by op, each of the block loop's operations costs 50-100 us of
    Python dispatch in an eager call (a cProfile of a TensorFlow step at
    p = 16k counted about 65 of them per block of 1,024 slots); compiled,
    the loop is a `while` whose trip count is the index, and the cache goes
    in without a copy. Measured on the 2-core CPU, the whole layer, one
    token, 8 heads of 64, 65,536 slots, TensorFlow: p = 1 / 1k / 16k / 64k
    took 21 / 27 / 139 / 528 ms op by op, 9.7 / 11.4 / 29 / 66 ms as a
    graph (9.6 ms at p = 1k with `jit_compile=True`, for twice the tracing
    time: not taken). JAX, `jax.jit` without donation (the step only reads
the cache): 12 / 16 / 74 / 330 ms op by op, 3.7 / 4.3 / 17 / 53 ms
compiled; a rolling cache of 512 slots 7.6 -> 2.3 ms.

    Args are `decode_attention`'s; the spec's tensors (offset, masks,
    sinks) are the function's inputs, its Python values part of its key.
    """
    from keras import ops

    offset = ops.cast(spec.query_offset, "int32")
    if limit is not None:
        limit = ops.cast(limit, "int32")
    sinks = None if spec.sinks is None else ops.convert_to_tensor(spec.sinks)
    function = _graph_decode_function(
        step, spec.scale, spec.causal, spec.window, spec.soft_cap,
        spec.alibi, rolling, block_size, layout,
    )
    return function(query, cache, offset, limit, spec.query_mask,
                    spec.attention_mask, sinks)


@functools.lru_cache(maxsize=64)
def _graph_decode_function(step, scale, causal, window, soft_cap, alibi,
                           rolling, block_size, layout):
    import keras

    from keras_mha.attention.spec import AttentionSpec

    def run(query, cache, offset, limit, query_mask, attention_mask, sinks):
        spec = AttentionSpec(
            scale=scale, causal=causal, window=window, soft_cap=soft_cap,
            alibi=alibi, query_offset=offset, query_mask=query_mask,
            attention_mask=attention_mask, sinks=sinks,
        )
        return step(query, cache, spec, rolling, block_size, layout, limit,
                    implementation="portable")

    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(run)
    import tensorflow as tf

    return tf.function(run)
