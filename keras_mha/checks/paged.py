"""Checks of a paged cache and of a ragged call (`attention/paged.py`).

Shapes and dtypes are checked in every call; the values of the page
table, positions and lengths where they have values (an eager call).
Traced, a token whose page is missing or out of the pool writes nothing
and is read by no query (the scratch page).
"""

import keras
import numpy as np
from keras import ops

from keras_mha.attention import paged as paged_lib
from keras_mha.attention import spec as spec_lib
from keras_mha.checks.arguments import boolean
from keras_mha.checks.arguments import choice
from keras_mha.checks.arguments import positive_int

_QUANTIZE = tuple(paged_lib.QUANTIZED)
# What a ragged call does not take, by argument name.
_UNSUPPORTED = ("query_mask", "value_mask", "key_mask", "attention_mask",
                "attention_bias", "segment_ids", "key_segment_ids")


def paged_cache(layer, num_pages, page_size, quantize, in_place):
    """Checks the arguments of `layer.init_paged_cache`."""
    positive_int("num_pages", num_pages)
    positive_int("page_size", page_size)
    choice("quantize", quantize, _QUANTIZE, allow_none=True)
    boolean("in_place", in_place)
    if quantize is not None:
        _holds(layer.compute_dtype, quantize)
        if not _has_dtype(quantize):
            raise ValueError(
                f"The {keras.backend.backend()} backend has no "
                f"`{quantize}` dtype for a quantized cache. Received: "
                f"quantize={quantize!r}"
            )


def _holds(compute_dtype, storage):
    if "float" not in keras.backend.standardize_dtype(compute_dtype):
        raise ValueError(
            f"A `{storage}` cache dequantizes into a float compute dtype; "
            f"this layer computes in {compute_dtype}. Received: "
            f"quantize={storage!r}, dtype={compute_dtype!r}"
        )


def _has_dtype(dtype):
    try:
        ops.zeros((1,), dtype)
    except Exception:  # the backend lacks the dtype
        return False
    return True


def ragged_call(layer, inputs, cache, batch, use_causal_mask,
                return_attention_scores, others):
    """Checks a call with a paged `cache` and a `RaggedBatch` as
    `cache_update_index`: `inputs` `(query, value, key)`, `others` the
    call's other arguments by name (a layer's call lacks some)."""
    query, value, key = inputs
    key = value if key is None else key
    for name in _UNSUPPORTED:
        if others.get(name) is not None:
            raise ValueError(
                f"A call with a paged cache takes no `{name}` (a ragged "
                f"call is causal self-attention). Received: {name}="
                f"{type(others[name]).__name__}"
            )
    if return_attention_scores:
        raise ValueError(
            "A call with a paged cache returns no scores. Received: "
            "return_attention_scores=True"
        )
    if not use_causal_mask:
        raise ValueError(
            "Decoding with a cache needs `use_causal_mask=True`. "
            f"Received: use_causal_mask={use_causal_mask}"
        )
    if not isinstance(batch, paged_lib.RaggedBatch):
        raise TypeError(
            "A call with a paged cache takes a `RaggedBatch` as "
            "`cache_update_index`. Received: cache_update_index="
            f"{type(batch).__name__}"
        )
    shapes = [tuple(x.shape) for x in (query, value, key)]
    if len(shapes[0]) != 3 or len(set(shapes)) != 1:
        raise ValueError(
            "A ragged call is self-attention of `(R, T, E)` tokens: query, "
            "value and key of one shape. Received: query.shape="
            f"{shapes[0]}, value.shape={shapes[1]}, key.shape={shapes[2]}"
        )
    _pool(layer, cache)
    _batch_shapes(batch, shapes[0][0])
    values = paged_lib.concrete(batch)
    if values is not None:
        _batch_values(layer, cache, values, shapes[0][1])


def pool_shapes(layer):
    """`((K, H), (K, V))` of `layer`'s pages; the latent layer's one head
    of `[latent, rope_key]` and no value pages: `((1, R + P), None)`."""
    settings = layer.settings
    if hasattr(settings, "kv_lora_rank"):
        return (1, settings.kv_lora_rank + settings.qk_rope_head_dim), None
    heads = settings.num_key_value_heads
    return (heads, settings.key_dim), (heads, settings.value_dim)


def _pool(layer, cache):
    expected = pool_shapes(layer)
    for name, pool, want in (("keys", cache.keys, expected[0]),
                             ("values", cache.values, expected[1])):
        if (pool is None) != (want is None):
            raise ValueError(
                f"The paged cache's {name} do not match this layer's "
                "(`init_paged_cache` makes them). Received: "
                f"cache.{name}={'None' if pool is None else 'pages'}"
            )
        if pool is None:
            continue
        if len(pool.shape) != 4 or tuple(pool.shape[2:]) != want:
            raise ValueError(
                f"The paged cache's {name} must be (pages + 1, page_size, "
                f"{want[0]}, {want[1]}) for this layer. Received: "
                f"cache.{name}.shape={tuple(pool.shape)}"
            )
    # A float pool comes autocast to the compute dtype (`Layer.__call__`).
    if cache.key_scales is not None:
        storage = keras.backend.standardize_dtype(cache.keys.dtype)
        choice("cache.keys.dtype", storage, _QUANTIZE)
        _holds(layer.compute_dtype, storage)


def _batch_shapes(batch, rows):
    table = batch.page_table
    if len(table.shape) != 2 or table.shape[0] != rows:
        raise ValueError(
            f"`page_table` must be (R, M) with R = {rows}, the query's "
            "rows. Received: page_table.shape="
            f"{tuple(table.shape)}"
        )
    for name in ("positions", "lengths"):
        part = getattr(batch, name)
        if tuple(part.shape) != (rows,):
            raise ValueError(
                f"`{name}` must be ({rows},), one per row. Received: "
                f"{name}.shape={tuple(part.shape)}"
            )


def _batch_values(layer, cache, values, length):
    table, positions, lengths = values
    pages, size = paged_lib.num_pages(cache), paged_lib.page_size(cache)
    if np.any(table < -1) or np.any(table >= pages):
        bad = int(table[(table < -1) | (table >= pages)][0])
        raise ValueError(
            f"A page index is out of the pool of {pages} pages. Received: "
            f"page_table entry {bad}"
        )
    if np.any(lengths < 0) or np.any(lengths > length) or np.any(
            positions < 0):
        raise ValueError(
            "A ragged call's offsets do not add up: each row needs "
            f"0 <= lengths <= T = {length} and positions >= 0. Received: "
            f"positions={positions.tolist()}, lengths={lengths.tolist()}"
        )
    settings = layer.settings
    reach = paged_lib.reach_of(spec_lib.AttentionSpec(
        scale=1.0, causal=True,
        chunk=getattr(settings, "attention_chunk_size", None),
        window=spec_lib.window_sides(settings.sliding_window, True)))
    writers = {}
    for row in np.nonzero(lengths)[0]:
        end = int(positions[row] + lengths[row])
        first = 0 if reach is None else int(reach[0](positions[row], np))
        needed = range(first // size, -(-end // size))
        if needed.stop > table.shape[1] or np.any(table[row, needed] < 0):
            raise ValueError(
                f"Row {row} is longer than its pages: positions "
                f"{first}..{end - 1} need pages {needed.start}.."
                f"{needed.stop - 1} of its page table. Received: page_table[{row}]="
                f"{table[row].tolist()}"
            )
        written = range(int(positions[row]) // size, needed.stop)
        for page in table[row, written].tolist():
            if writers.setdefault(page, row) != row:
                raise ValueError(
                    f"Rows {writers[page]} and {row} both write page "
                    f"{page}; a shared page is copied before its first "
                    "write (`PageAllocator.reserve`). Received: "
                    f"page_table={table.tolist()}"
                )
