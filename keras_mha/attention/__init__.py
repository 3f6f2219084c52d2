"""Attention algorithms as pure functions of projected heads and a spec.

`attend(query, key, value, spec)` is the one entry: the dispatch rule reads
the spec and the shapes and runs one of the paths, each of which builds its
masks from the spec with the position rule of `masks.py`:

- `explicit.py`: materialized `(B, N, T, S)` weights (the reference);
- `fused.py`: `keras.ops.dot_product_attention`, and JAX's kernel with
  its own window;
- `banded.py`: sliding windows in O(T·w);
- `blocked.py`: causal self-attention in O(T) memory (an online softmax
  over key blocks, FlashAttention-2's recurrence);
- `triangular.py`: causal self-attention without the upper triangle;
- `sparse.py`: a mask object (`rules.py`: masks and score functions,
  programmable attention) visiting only the blocks it keeps;
- `cache.py`: the key/value cache that decoding reads and writes,
  `cache_layouts.py` its layouts (ours, keras-hub's, the latent cache's)
  a run of slots at a time, and `decode.py`: attention over the cache
  itself, reading only what a step sees (`attend_cached`, the one cached
  call, takes any layout; `dispatch.cache_route` picks between them and
  the paths above);
- `kernels.py`: backend kernels behind the portable paths' interfaces,
  `cache_kernels.py` the cache's in-place writes and `decode_kernels.py`
  the eager decode step's (torch's fused kernel over the slots; on
  TensorFlow and JAX the step compiled as one function);
- `sharded.py`: the routes of a sequence sharded over devices
  (`keras_mha.ContextParallel`): the halo exchange for windows, and
  `ring.py`, ring attention, with `partials.py`, the merge of attention
  over parts of the keys;
- `tuning.py`: the numbers the rule and the algorithms read, per backend
  and platform.

Nothing here imports the layer or the command line.
"""

from keras import ops

from keras_mha.attention import cache as cache_lib
from keras_mha.attention import cache_layouts
from keras_mha.attention import decode
from keras_mha.attention import capabilities
from keras_mha.attention import decode_kernels
from keras_mha.attention import dispatch
from keras_mha.attention import paged
from keras_mha.attention import sharded
from keras_mha.attention import tuning
from keras_mha.attention.banded import banded_attention
from keras_mha.attention.blocked import blocked_attention
from keras_mha.attention.decode import decode_attention
from keras_mha.attention.explicit import explicit_attention
from keras_mha.attention.fused import fused_attention
from keras_mha.attention.fused import fused_window_attention
from keras_mha.attention.sparse import sparse_attention
from keras_mha.attention.spec import AttentionSpec
from keras_mha.attention.triangular import triangular_attention


def attend(query, key, value, spec):
    """Attention of `query` over `key`/`value` as `spec` asks.

    Args:
        query: `(B, T, N, H)`.
        key: `(B, S, K, H)`, `N % K == 0`.
        value: `(B, S, K, V)`.
        spec: an `AttentionSpec`.

    Returns:
        `(output, weights)`: `(B, T, N, V)` in the query's dtype, and the
        `(B, N, T, S)` weights when `spec.return_weights` (else `None`).
    """
    shapes = dispatch.Shapes.of(query, key, value)
    if spec.sharding is not None:
        route = dispatch.context_route(spec, shapes)
        zigzag = route == dispatch.RING and sharded.uses_zigzag(spec, shapes)
        if route is not None:
            sharded.check_lengths(spec.sharding, shapes.query_length,
                                  shapes.key_length, zigzag)
        if route == dispatch.HALO:
            return sharded.halo_attention(query, key, value, spec, attend), None
        if route == dispatch.RING:
            return sharded.ring_route(query, key, value, spec, zigzag), None
        spec = spec.replace(sharding=None)
    path = dispatch.choose_path(
        spec, shapes, platform=tuning.device_platform(query),
    )
    if path == dispatch.EXPLICIT:
        output, weights = explicit_attention(query, key, value, spec)
        return output, weights if spec.return_weights else None
    if path == dispatch.FUSED:
        return fused_attention(query, key, value, spec), None
    if path == dispatch.BANDED:
        return banded_attention(query, key, value, spec), None
    if path == dispatch.BLOCKED:
        return blocked_attention(query, key, value, spec), None
    if path == dispatch.FUSED_WINDOW:
        return fused_window_attention(query, key, value, spec), None
    if path == dispatch.SPARSE:
        return sparse_attention(query, key, value, spec), None
    return triangular_attention(query, key, value, spec), None


def attend_cached(query, key, value, spec, cache, index, rolling,
                  layout=cache_layouts.FLAGGED, heads=None, value_size=None):
    """Attention of a decoding call, and the cache after its write.

    The one cached call of every layer and cache layout (`cache_layouts`):
    ours, keras-hub's one tensor (`CachedMultiHeadAttention`) and the
    latent cache (`MultiHeadLatentAttention`), and a paged cache, whose
    call is ragged (`paged.py`). Five routes, all with the same numbers, chosen by `dispatch.cache_route` alone; the algorithms
    by `dispatch.choose_path`. Under `keras_mha.ContextParallel` a cache
    whose slots are sharded takes `slot_write` as `sharded.cached_decode`
    (each device reads its own slots):

    - `"prompt"`: a Python index 0 (an empty cache): the tokens attend to
      themselves on any path (`banded` for a window, the causal kernels
      otherwise), and are written.
    - `"slot_write"`: the tokens are written first, then
      `decode.decode_attention` reads the cache itself up to the last new
      token (a full cache) or its `w` slots (a rolling cache, one token).
    - `"concatenated"`: the cache's old slots followed by the new tokens
      on the explicit or fused path (returned weights, dropout, several
      tokens in a rolling cache, keys computed by `heads`).
    - `"whole_cache"`: keras-hub's cache, written, then read whole on the
      usual paths, the slots after the new tokens hidden (returned
      weights, dropout, a cache of one block).
    - `"paged"`: a paged cache, with a `paged.RaggedBatch` as `index`:
      the rows' tokens written into their pages, then each row attends
      the pages it can see (`paged.attend`).

    Args:
        query: `(B, T, N, H)`.
        key: the new tokens' keys `(B, L, K, H)` (`L = T` but in
            keras-hub's cache); the latent cache's latents `(B, T, R)`.
        value: their values `(B, L, K, V)`; the latent cache's rope keys
            `(B, T, P)`.
        spec: the call's spec; its `key_mask` marks the new real tokens.
        cache: in `layout`, as the caller holds it (an in-place cache
            too).
        index: the position of the first new token (int or tensor).
        rolling: whether slot = position mod L.
        layout: `"flagged"` (ours), `"pair"` (keras-hub's) or `"latent"`.
        heads: `None` where the cache's entries are read as its keys and
            values (the latent cache as one shared head,
            `cache_layouts.latent_heads`); else a function of the entries
            (the cache's tensors but `valid`, `(B, S, ...)`) returning the
            keys `(B, S, K, H)` and values `(B, S, K, V)`: the latent cache
            up-projected, which is never read where it lies.
        value_size: a paged cache without value pages (the latent
            layer's) reads its values as the keys' first `value_size`
            features; `value` is then `None`.

    Returns:
        `(output, weights, new_cache)`: `(B, T, N, V)`; when
        `spec.return_weights`, the weights `(B, N, T, L + T)` (the old
        slots, then the new tokens), keras-hub's `(B, N, T, L)` (its slots
        after the write); the cache after the write, of the kind given.
    """
    if paged.is_paged(cache):
        output, new_cache = _paged(query, key, value, spec, cache, index,
                                   value_size)
        return output, None, new_cache
    if isinstance(cache, paged.PagedRows):
        output, new_cache = _paged_rows(query, key, value, spec, cache,
                                        index, rolling)
        return output, None, new_cache
    computed = heads is not None
    if heads is None:
        heads = cache_layouts.entry_heads(layout, query.dtype)
    num_slots = cache_layouts.num_slots(cache_layouts.tensors(cache, layout),
                                        layout)
    route = dispatch.cache_route(spec, query.shape[1], index, rolling,
                                 layout, num_slots, computed)
    if route == dispatch.SLOT_WRITE and sharded.shards_cache(
        spec.sharding, cache
    ):
        output, new_cache = sharded.cached_decode(
            query, (key, value), spec, cache, index, rolling, heads=heads
        )
        return output, None, new_cache
    if route != dispatch.PROMPT:  # the rest reads the whole cache
        spec = spec.replace(sharding=None)
    if route == dispatch.PROMPT:
        output, weights = attend(query, *_as_heads(heads, key, value), spec)
        new_cache = cache_layouts.write(cache, key, value, spec.key_mask, 0,
                                        rolling, layout)[0]
        return output, weights, new_cache
    if route == dispatch.SLOT_WRITE:
        return _slot_write(query, key, value, spec, cache, index, rolling,
                           layout)
    if route == dispatch.WHOLE_CACHE:
        return _whole_cache(query, key, value, spec, cache, index)
    keys, values, keys_valid, key_positions, new_cache = (
        cache_lib.attend_inputs(cache, key, value, spec.key_mask, index,
                                rolling)
    )
    spec = spec.replace(
        query_offset=index, key_positions=key_positions, key_mask=keys_valid
    )
    output, weights = attend(query, *_as_heads(heads, keys, values), spec)
    return output, weights, new_cache


def attend_shared(query, spec, cache, index, rolling):
    """Attention of queries at positions `index + t` over the cache of
    another layer, after that layer's call at the same `index` wrote it
    (keys and values shared between layers, `keras_mha.sharing`).

    The cache is read, never written. A step that `attend_cached` would
    read where it lies (`slot_write`) is read so here, up to the last
    query; any other reads the whole cache, each slot at the position it
    now holds, its flags the keys' mask.

    Args:
        query: `(B, T, N, H)`.
        spec: the call's spec, without a key mask.
        cache: `(keys, values, valid)` (`cache.py`).
        index: the position of the first query (int or tensor).
        rolling: whether slot = position mod L.

    Returns:
        `(output, weights)`, as `attend` returns them; the weights
        `(B, N, T, L)` over the cache's slots.
    """
    spec = spec.replace(sharding=None, query_offset=index)
    route = dispatch.cache_route(spec, query.shape[1], index, rolling)
    if route == dispatch.SLOT_WRITE:
        return decode.decode_attention(query, cache, spec, rolling), None
    keys, values, valid = cache
    positions = cache_lib.slot_positions(
        ops.cast(index, "int32") + ops.shape(query)[1], keys.shape[1],
        rolling)
    spec = spec.replace(key_positions=positions, key_mask=valid)
    return attend(query, ops.cast(keys, query.dtype),
                  ops.cast(values, query.dtype), spec)


def _paged(query, key, value, spec, cache, batch, value_size=None):
    """`attend_cached`'s `paged` route: the new tokens written into their
    pages, then each row's queries attend the pages they can see. A pool
    without value pages (the latent layer's) reads its values as the keys'
    first `value_size` features, and `value` is `None`."""
    rows = paged.token_rows(batch, query.shape[1], paged.page_size(cache),
                            paged.num_pages(cache))[0]
    cache = paged.write(cache, key, value, rows)
    sequence = paged.row_sequence(cache, batch, query.shape[1], spec,
                                  query.dtype, value_size)
    if sequence is not None:  # one row's chunk: its pages read once
        return _row_sequence(query, spec, *sequence), cache
    items = paged.work_items(batch, paged.page_size(cache),
                             paged.reach_of(spec), query.shape[1])
    value_size = None if cache.values is not None else value_size
    # A mask or score function is not among what the compiled step keys.
    if capabilities.compiles_eager_call((query, cache)) and not \
            spec.programmed:
        return decode_kernels.graph_paged(paged.attend, query, cache, batch,
                                          spec, items, value_size), cache
    return paged.attend(query, cache, batch, spec, items, value_size), cache


def _row_sequence(query, spec, keys, values, key_positions, start, count):
    """`_paged` for one row's chunk of `count` tokens at positions `start
    ...` over its pages as one sequence (`paged.row_sequence`): the usual
    paths, each key read once, where the work items would read the
    chunk's queries once per page. Queries past `count` get 0."""
    length = query.shape[1]
    real = ops.arange(length, dtype="int32")[None, :] < count  # (1, T)
    if spec.query_mask is not None:
        real = ops.logical_and(real, ops.cast(spec.query_mask, "bool"))
    # Causal: no query sees a slot past the chunk's last token.
    spec = spec.replace(sharding=None, causal=True, query_offset=start,
                        key_positions=key_positions, query_mask=real,
                        key_mask=None)
    output, _ = attend(query, keys, values, spec)
    return ops.where(real[:, :, None, None], output, ops.zeros_like(output))


def _paged_rows(query, key, value, spec, cache, index, rolling):
    """`attend_cached`'s `paged` route for a dense or rolling cache kept
    in pages (`paged.PagedRows`): every row writes the call's tokens from
    `index`, a rolling cache's a page at a time."""
    length = query.shape[1]
    chunk = paged.row_chunk(cache, rolling, length)
    pool, outputs = cache.pool, []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        batch = paged.rows_batch(cache, ops.cast(index, "int32") + start,
                                 stop - start)
        output, pool = _paged(query[:, start:stop], key[:, start:stop],
                              value[:, start:stop], spec, pool, batch)
        outputs.append(output)
    output = outputs[0] if len(outputs) == 1 else ops.concatenate(outputs, 1)
    return output, paged.PagedRows(pool, cache.page_table)


def _as_heads(heads, key, value):
    """The keys and values of a cache's entries (`attend_cached`)."""
    return (key, value) if heads is None else heads(key, value)


def _slot_write(query, key, value, spec, cache, index, rolling, layout):
    """`attend_cached`'s `slot_write` route: the tokens written into their
    slots, then the cache read where it lies, up to the last new token."""
    new_cache = cache_layouts.write(cache, key, value, spec.key_mask, index,
                                    rolling, layout)[0]
    limit = None  # the last query's position + 1 where `L = T`
    if key.shape[1] is None or key.shape[1] != query.shape[1]:
        limit = ops.cast(index, "int32") + ops.shape(key)[1]
    spec = spec.replace(query_offset=index, key_mask=None)
    output = decode.decode_attention(
        query, cache_layouts.tensors(new_cache, layout), spec, rolling,
        layout=layout, limit=limit,
    )
    return output, None, new_cache


def _whole_cache(query, key, value, spec, cache, index):
    """`attend_cached`'s `whole_cache` route: keras-hub's cache written,
    then read whole, the slots at or after the last new token hidden (it
    keeps no flags: they were never written)."""
    new_cache, keys, values = cache_layouts.write(
        cache, key, value, None, index, False, cache_layouts.PAIR,
        halves=True,
    )
    keys = ops.cast(keys, query.dtype)  # (B, L, K, H)
    values = ops.cast(values, query.dtype)  # (B, L, K, V)
    limit = ops.cast(index, "int32") + ops.shape(key)[1]
    spec = spec.replace(
        query_offset=index, whole_cache=True,
        key_mask=cache_layouts.written_below(ops.shape(keys)[1], limit),
    )
    output, weights = attend(query, keys, values, spec)
    return output, weights, new_cache


__all__ = ["AttentionSpec", "attend", "attend_cached", "attend_shared",
           "dispatch", "tuning"]
