"""Paged key/value caches and ragged calls, as pure functions of plain
tensors.

A paged cache is one pool of pages for all the sequences a model serves,
and a page table per sequence (docs/serving.md):

- `PagedCache(keys, values, key_scales, value_scales)`: `keys` `(P + 1,
  Z, K, H)` and `values` `(P + 1, Z, K, V)`, `P` pages of `Z` slots; the
  last page is scratch, where writes that land nowhere go, and is never
  read. Unquantized, the pages hold the compute dtype and the scales are
  `None`; quantized (`QUANTIZED`), they hold int8 or float8 and the scales
  `(P + 1, Z, K)` float32, one per token and key/value head.
- `RaggedBatch(page_table, positions, lengths)`: the `R` rows of one call.
  `page_table` `(R, M)` int32: page `i` of row `r` holds its positions
  `[i·Z, (i + 1)·Z)` (`-1`: none). `positions` `(R,)`: the position of the
  row's first new token, which is how many tokens it has cached.
  `lengths` `(R,)`: its new tokens this call, at most the call's `T`; a
  row with 0 is idle.

A call's queries are batched `(R, T, N, H)`, row `r`'s first `lengths[r]`
real: prefill chunks and decode steps mix in one call. It first writes the
new keys and values into their pages (quantized, where the cache is), then
attends. The attention runs over work items, one per (row, page) a row's
queries can see: a row's pages from the first its window or chunk reaches
to the last it has written. Each item's scores are those of one page, and
the items of a row are combined by one softmax over them, so a call costs
what its rows attend, never the pool's size or its longest row. Quantized
pages are read as stored, item by item: their scales multiply the
scores and the weights, never a dequantized copy of the cache.

Under tracing the work items are the whole page table (`R·M` items, the
idle ones masked), so a compiled step has one shape whatever the rows'
positions and lengths; eager calls list the live items only, rounded up
to a power of two so that a backend compiling per shape sees few shapes.
"""

import math
import typing

import keras
import numpy as np
from keras import ops

import keras_mha.attention.cache_kernels as cache_kernels
import keras_mha.attention.capabilities as capabilities
import keras_mha.attention.logits as logits_lib
import keras_mha.attention.masks as masks_lib
import keras_mha.attention.tuning as tuning

# The quantized storage dtypes, with the largest value each holds.
QUANTIZED = {"int8": 127.0, "float8_e4m3fn": 448.0}


class PagedCache(typing.NamedTuple):
    """A pool of key and value pages (see the module's docstring); its
    writes are functional: a call returns a new pool."""

    keys: typing.Any
    values: typing.Any
    key_scales: typing.Any = None
    value_scales: typing.Any = None


class InPlacePagedCache(typing.NamedTuple):
    """A `PagedCache` that an eager call writes in place: the new slots
    only, into the pool's own tensors (torch, TensorFlow; JAX donates
    them). Traced writes are functional."""

    keys: typing.Any
    values: typing.Any
    key_scales: typing.Any = None
    value_scales: typing.Any = None


class RaggedBatch(typing.NamedTuple):
    """The rows of one ragged call (see the module's docstring)."""

    page_table: typing.Any
    positions: typing.Any
    lengths: typing.Any


class PagedRows(typing.NamedTuple):
    """A dense or rolling cache of `B` sequences kept in pages (a
    quantized one: `init_cache(..., quantize=...)`): `pool`, a
    `PagedCache`, and `page_table` `(B, M)`, each row's fixed pages. A
    rolling cache's rows reuse their pages in turn: page `i` of row `b` is
    its `i mod n`-th, `n` pages holding a window and a chunk of writes."""

    pool: typing.Any
    page_table: typing.Any


def is_paged(cache):
    """Whether `cache` is a paged cache (either kind)."""
    return isinstance(cache, (PagedCache, InPlacePagedCache))


def rows(batch_size, max_length, slots, rolling, num_kv_heads, key_dim,
         value_dim, dtype, quantize=None, in_place=False):
    """An empty `PagedRows` for `batch_size` sequences of up to
    `max_length` tokens; `slots`: the rolling cache's (`w` or `C`) when
    `rolling`, else `max_length`. Pages of `ROW_PAGE` slots (fewer for a
    short cache)."""
    size = min(ROW_PAGE, slots)
    width = -(-max_length // size)
    # A rolling row's writes go `size` tokens at a time (`row_chunk`), so
    # `slots - 1` keys back and `size` new ones must sit on distinct pages.
    per_row = -(-(slots - 1 + size) // size) + 1 if rolling else width
    table = (np.arange(batch_size)[:, None] * per_row
             + np.arange(width)[None] % per_row).astype("int32")
    pool = zeros(batch_size * per_row, size, num_kv_heads, key_dim,
                 value_dim, dtype, quantize=quantize, in_place=in_place)
    return PagedRows(pool, ops.convert_to_tensor(table))


ROW_PAGE = 16


def rows_batch(cache, index, length):
    """The `RaggedBatch` of a call on a `PagedRows` writing `length`
    tokens of every row from position `index`."""
    num_rows = cache.page_table.shape[0]
    index = ops.cast(index, "int32")
    return RaggedBatch(cache.page_table,
                       ops.zeros((num_rows,), "int32") + index,
                       ops.full((num_rows,), length, "int32"))


def row_chunk(cache, rolling, length):
    """The most tokens one write-and-attend takes on a `PagedRows`: a
    rolling row's page size (so a window's pages are never overwritten
    while read), else all `length`."""
    return page_size(cache.pool) if rolling else length


def zeros(num_pages, page_size, num_kv_heads, key_dim, value_dim, dtype,
          quantize=None, in_place=False):
    """An empty pool of `num_pages` pages of `page_size` slots (and the
    scratch page); `quantize`: `None`, `"int8"` or `"float8_e4m3fn"`.
    `value_dim=None`: no value pages, the values being the keys' first
    features (the latent layer's: keys `[latent, rope_key]`, values the
    latents)."""
    rows = (num_pages + 1, page_size, num_kv_heads)
    store = dtype if quantize is None else quantize
    shared = value_dim is None  # the values are the keys' first features
    tensors = [ops.zeros(rows + (key_dim,), store),
               None if shared else ops.zeros(rows + (value_dim,), store)]
    if quantize is not None:
        tensors += [ops.ones(rows, "float32"),
                    None if shared else ops.ones(rows, "float32")]
    kind = PagedCache
    if in_place and all(cache_kernels.can_write_rows(t) for t in tensors
                        if t is not None):
        kind = InPlacePagedCache
    return kind(*tensors)


def num_pages(cache):
    """`P`, the pool's pages (the scratch page not counted)."""
    return cache.keys.shape[0] - 1


def page_size(cache):
    """`Z`, the slots of a page."""
    return cache.keys.shape[1]


def quantization(cache):
    """The pool's storage dtype where it is quantized, else `None`."""
    if cache.key_scales is None:
        return None
    return keras.backend.standardize_dtype(cache.keys.dtype)


# ------------------------------------------------------------- quantizing


def quantize(x, storage):
    """`(values, scales)`: `x` `(.., K, H)` in `storage` (a key of
    `QUANTIZED`) with one float32 scale per `(.., K)`, its largest
    magnitude over the largest value `storage` holds (1 for a zero
    row)."""
    x = ops.cast(x, "float32")
    top = ops.amax(ops.abs(x), axis=-1)
    scales = ops.where(top > 0, top / QUANTIZED[storage], 1.0)
    scaled = x / scales[..., None]
    if storage == "int8":
        scaled = ops.clip(ops.round(scaled), -127.0, 127.0)
    return ops.cast(scaled, storage), scales


# ---------------------------------------------------------------- writing


def token_rows(batch, length, size, pages):
    """Where each new token goes: `(rows, positions, live)`, `rows`
    `(R, T)` the flat slot `page·Z + slot` of the pool (the scratch
    page's first for a token that is padding, or whose page is missing or
    out of the pool), `positions` `(R, T)` the tokens' positions, `live`
    `(R, T)` which tokens are written."""
    table = ops.convert_to_tensor(batch.page_table, "int32")
    offsets = ops.arange(length, dtype="int32")
    positions = ops.cast(batch.positions, "int32")[:, None] + offsets
    logical = positions // size
    width = table.shape[1]
    page = ops.take_along_axis(table, ops.clip(logical, 0, width - 1), 1)
    live = ops.logical_and(
        offsets[None, :] < ops.cast(batch.lengths, "int32")[:, None],
        ops.logical_and(logical < width,
                        ops.logical_and(page >= 0, page < pages)),
    )
    rows = ops.where(live, page * size + positions % size, pages * size)
    return rows, positions, live


def write(cache, keys, values, rows):
    """The pool with the new tokens' `keys` `(R, T, K, H)` and `values`
    written at flat slots `rows` `(R, T)` (`token_rows`), quantized where
    the pool is; in place for an `InPlacePagedCache` in an eager call."""
    storage = quantization(cache)
    flat_rows = ops.reshape(rows, (-1,))
    new = []
    for new_tokens, pool, scales in ((keys, cache.keys, cache.key_scales),
                                     (values, cache.values,
                                      cache.value_scales)):
        if pool is None:  # values read from the keys
            new.append((None, None))
            if storage is not None:
                new.append((None, None))
        elif storage is None:
            new.append((ops.cast(new_tokens, pool.dtype), pool))
        else:
            quantized, token_scales = quantize(new_tokens, storage)
            new.append((quantized, pool))
            new.append((token_scales, scales))
    in_place = isinstance(cache, InPlacePagedCache) and not (
        capabilities.compiling_one_graph()) and all(
            cache_kernels.can_write_rows(pool) for _, pool in new
            if pool is not None)
    written = [None if pool is None else
               _write_rows(pool, tokens, flat_rows, in_place)
               for tokens, pool in new]
    if storage is None:
        written += [None, None]
    else:  # keys, key scales, values, value scales -> the fields' order
        written = [written[0], written[2], written[1], written[3]]
    return type(cache)(*written)


def _write_rows(pool, tokens, flat_rows, in_place):
    """`pool` `(P + 1, Z, ...)` with `tokens` `(R, T, ...)` at flat slots
    `flat_rows` `(R·T,)`."""
    shape = tuple(pool.shape)
    flat = ops.reshape(pool, (shape[0] * shape[1],) + shape[2:])
    tokens = ops.reshape(ops.cast(tokens, pool.dtype),
                         (-1,) + shape[2:])
    if in_place:
        cache_kernels.write_rows(flat, flat_rows, tokens)
        return pool
    if capabilities.slice_update_writes_input():
        flat = ops.copy(flat)
    flat = ops.scatter_update(flat, flat_rows[:, None], tokens)
    return ops.reshape(flat, shape)


def copy_pages(cache, sources, targets):
    """The pool with pages `targets` overwritten by pages `sources` (both
    int sequences of the same length): a shared page copied before its
    first write (`keras_mha.serving.PageAllocator`)."""
    if len(sources) == 0:
        return cache
    sources = ops.convert_to_tensor(np.asarray(sources, "int32"))
    targets = np.asarray(targets, "int32")
    copied = []
    for pool in cache:
        if pool is None:
            copied.append(None)
            continue
        shape = tuple(pool.shape)
        row = math.prod(shape[2:])
        pages = ops.reshape(pool, (shape[0], shape[1] * row))
        new = ops.take(pages, sources, axis=0)
        if capabilities.slice_update_writes_input():
            pages = ops.copy(pages)
        pages = ops.scatter_update(
            pages, ops.convert_to_tensor(targets[:, None]), new)
        copied.append(ops.reshape(pages, shape))
    return type(cache)(*copied)


# -------------------------------------------------------------- attending


def token_positions(batch, query):
    """`(R, T)` int32: the positions of a ragged call's tokens, row `r`'s
    from `batch.positions[r]` on."""
    return ops.cast(batch.positions, "int32")[:, None] + ops.arange(
        ops.shape(query)[1], dtype="int32")


def concrete(batch):
    """`(page_table, positions, lengths)` as NumPy arrays where the batch
    has values (an eager call); `None` where it is traced."""
    if capabilities.compiling_one_graph():
        return None
    try:
        return tuple(np.asarray(ops.convert_to_numpy(part))
                     for part in batch)
    except Exception:  # a tracer or a symbolic tensor: no value yet
        return None


def work_items(batch, size, reach, length):
    """`(rows, pages, grid)`: the work items of a call of `length` (`T`)
    tokens, `rows` and `pages` int32 `(W,)`, row `r`'s page `i` for each
    page whose slots its queries may see; a dead item has row `R` (one
    past the last) or a page past the table. `reach`: `reach_of(spec)`.

    Eager, the items are listed, live ones only. Traced, they are an `(R,
    span)` grid, in order (`grid` true): every page of the table, or with
    a window or chunks the `span` pages from each row's first visible one,
    so a compiled call's cost follows the window, not the table."""
    table = batch.page_table
    num_rows, width = table.shape[0], table.shape[1]
    values = concrete(batch)
    if values is None:
        span = width if reach is None else min(
            width, -(-(reach[1] + length) // size) + 1)
        grid = ops.arange(num_rows * span, dtype="int32")
        rows, pages = grid // span, grid % span
        if reach is not None:
            first = reach[0](ops.cast(batch.positions, "int32"), ops) // size
            pages = pages + ops.take(first, rows)
        return rows, pages, True
    starts, counts = (np.asarray(x, "int64") for x in values[1:])
    firsts = np.zeros_like(starts) if reach is None else reach[0](
        starts, np) // size
    rows, pages = [], []
    for r in np.nonzero(counts)[0]:
        end = min(-(-(starts[r] + counts[r]) // size), width)
        pages.extend(range(firsts[r], end))
        rows.extend([r] * (end - firsts[r]))
    total = max(1, 1 << max(len(rows) - 1, 0).bit_length())
    rows += [num_rows] * (total - len(rows))
    pages += [0] * (total - len(pages))
    return (ops.convert_to_tensor(np.asarray(rows, "int32")),
            ops.convert_to_tensor(np.asarray(pages, "int32")), False)


def row_sequence(cache, batch, length, spec, dtype, value_size=None):
    """A one-row call of several tokens (a prefill chunk), eager: its
    pages' keys and values in order as one sequence, from the first page
    its queries may see, for the usual paths to attend to.

    Returns `(keys, values, key_positions, start, count)`: `(1, S, K, H)`
    and `(1, S, K, V)` in `dtype`, `(S,)` int32, and the row's first
    position and token count; `None` for any other call (several rows,
    one token, traced), a quantized pool (its pages are dequantized as the
    work items read them, never copied), a row with a page outside the
    pool, or where the tuning table's `paged_row_sequence` says the work
    items win.
    """
    if length < 2 or batch.page_table.shape[0] != 1 or quantization(
            cache) or not tuning.value("paged_row_sequence"):
        return None  # quantized pages: dequantized as read, never copied
    arrays = concrete(batch)  # read on the host once the call qualifies
    if arrays is None:
        return None
    table, (start,), (count,) = arrays[0], *(
        np.asarray(x, "int64") for x in arrays[1:])
    size = page_size(cache)
    reach = reach_of(spec)
    first = 0 if reach is None else int(reach[0](start, np)) // size
    last = -(-(start + count) // size)
    physical = table[0, first:last]
    if count < 1 or last > table.shape[1] or np.any(
            (physical < 0) | (physical >= num_pages(cache))):
        return None
    physical = ops.convert_to_tensor(physical.astype("int32"))
    keys = _pages(cache.keys, physical, dtype)
    values = keys[..., :value_size] if cache.values is None else _pages(
        cache.values, physical, dtype)
    positions = first * size + np.arange(keys.shape[1], dtype="int32")
    return (keys, values, ops.convert_to_tensor(positions), int(start),
            int(count))


def _pages(pool, physical, dtype):
    """The pages `physical` `(P,)` of `pool` as one sequence `(1, P·Z, K,
    D)` in `dtype`."""
    x = ops.cast(ops.take(pool, physical, axis=0), dtype)  # (P, Z, K, D)
    return ops.reshape(x, (1, -1, *x.shape[2:]))


def reach_of(spec):
    """`None` (every position visible), or `(reach, back)` for `spec`'s
    window or chunk: `reach(starts, xp)` the earliest position a query
    of a row starting at `starts` may see (`xp`: `numpy` or
    `keras.ops`), `back` how far before a query that can be."""
    left = None if spec.window is None else spec.window[0]
    chunk = spec.chunk
    if left is None and chunk is None:
        return None

    def reach(starts, xp):
        earliest = starts * 0 if left is None else xp.maximum(
            starts - left, 0)
        if chunk is not None:
            earliest = xp.maximum(earliest, (starts // chunk) * chunk)
        return earliest

    back = min(x for x in (left, None if chunk is None else chunk - 1)
               if x is not None)
    return reach, back


def attend(query, cache, batch, spec, items, value_size=None):
    """`(R, T, N, V)`: each row's queries attending its pages after the
    call's write, in the query's dtype; padded queries get 0.

    Args:
        query: `(R, T, N, H)`, rotated at the tokens' positions.
        cache: the pool after the write.
        batch: the call's `RaggedBatch`.
        spec: the call's `AttentionSpec` (scale, window, chunk, soft-cap,
            sinks, ALiBi, a mask and a score function, whose batch index
            is the row); causal.
        items: `work_items`' `(rows, pages, grid)`.
        value_size: for a pool without value pages, `V`: the values are
            the keys' first `V` features.
    """
    rows, logical, grid = items
    num_rows, length, heads, _ = query.shape
    size, groups = page_size(cache), cache.keys.shape[2]
    dtype = _float_dtype(query.dtype)
    live_row = rows < num_rows
    row = ops.minimum(rows, num_rows - 1)
    table = ops.convert_to_tensor(batch.page_table, "int32")
    width = table.shape[1]
    physical = ops.take(ops.reshape(table, (-1,)),
                        row * width + ops.minimum(logical, width - 1))
    valid_page = ops.logical_and(
        ops.logical_and(live_row, logical < width),
        ops.logical_and(physical >= 0, physical < num_pages(cache)))
    physical = ops.where(valid_page, physical, num_pages(cache))
    # (W, Z, K, H), (W, Z, K, V); quantized, their scales `(W, K, 1, 1,
    # Z)` multiply the scores and the weights instead (`_scaled`).
    keys = ops.cast(ops.take(cache.keys, physical, axis=0), dtype)
    key_scales = _scales(cache.key_scales, physical, dtype)
    if cache.values is None:
        values, value_scales = keys[..., :value_size], key_scales
    else:
        values = ops.cast(ops.take(cache.values, physical, axis=0), dtype)
        value_scales = _scales(cache.value_scales, physical, dtype)
    starts = ops.take(ops.cast(batch.positions, "int32"), row)
    ends = starts + ops.take(ops.cast(batch.lengths, "int32"), row)
    query_positions = starts[:, None] + ops.arange(length, dtype="int32")
    key_positions = logical[:, None] * size + ops.arange(size, dtype="int32")
    q = ops.reshape(ops.cast(ops.take(query, row, axis=0), dtype),
                    (-1, length, groups, heads // groups, query.shape[3]))
    scores = _scaled(ops.einsum("wtkgh,wskh->wkgts", q, keys),
                     key_scales) * ops.cast(spec.scale, dtype)
    # (W, K, G, T, Z)
    scores = logits_lib.soft_cap(scores, spec.soft_cap)
    distance = query_positions[:, :, None] - key_positions[:, None, :]
    if spec.alibi is not None:
        slopes = ops.reshape(ops.convert_to_tensor(spec.alibi, dtype),
                             (1, groups, -1, 1, 1))
        scores = scores + logits_lib.alibi(slopes, distance[:, None, None],
                                           dtype)
    mask = masks_lib.position_mask(query_positions[:, :, None],
                                   key_positions[:, None, :], True,
                                   spec.window, spec.chunk)  # (W, T, Z)
    seen = ops.logical_and(key_positions < ends[:, None],
                           valid_page[:, None])  # (W, Z)
    mask = ops.logical_and(mask, seen[:, None, :])[:, None, None]
    if spec.programmed:  # the batch index is the row
        index = (
            ops.reshape(row, (-1, 1, 1, 1, 1)),
            ops.reshape(ops.arange(heads, dtype="int32"),
                        (1, groups, -1, 1, 1)),
            query_positions[:, None, None, :, None],
            key_positions[:, None, None, None, :],
        )
        if spec.score_mod is not None:
            scores = spec.score_mod(scores, *index)
        if spec.mask_mod is not None:
            mask = ops.logical_and(mask, spec.mask_mod.evaluate(*index))
    return _combine(scores, mask, (values, value_scales),
                    _by_row(rows, num_rows, grid), spec.sinks, query, batch)


def _scales(scales, physical, dtype):
    """The work items' scales `(W, K, 1, 1, Z)` in `dtype`, or `None`."""
    if scales is None:
        return None
    scales = ops.cast(ops.take(scales, physical, axis=0), dtype)
    return ops.transpose(scales, (0, 2, 1))[:, :, None, None, :]


def _scaled(x, scales):
    """`x` `(W, K, G, T, Z)` times each slot's scale: a product with
    quantized keys (or values) is the product with their dequantized
    values, `q·(k·s) = (q·k)·s`, and the pages are read as stored."""
    return x if scales is None else x * scales


def _float_dtype(dtype):
    """The dtype the scores are computed in: float32 for a half dtype."""
    dtype = keras.backend.standardize_dtype(dtype)
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def _by_row(rows, num_rows, grid):
    """`(total, spread)`: `total(x, kind)` reduces items `(W, ...)` to
    rows `(R, ...)` (`kind` "sum" or "max"), `spread(x)` takes each
    item's row of `(R, ...)`. A grid's items reshape into `(R, M, ...)`;
    listed ones are summed by a product with which row holds each, and a
    dead item (row `R`) belongs to none."""
    row = ops.minimum(rows, num_rows - 1)

    def spread(x):
        return ops.take(x, row, axis=0)

    if grid:
        def total(x, kind):
            x = ops.reshape(x, (num_rows, -1) + tuple(x.shape[1:]))
            return (ops.sum if kind == "sum" else ops.amax)(x, axis=1)
    else:
        # Which items each row holds, `(R, W)`: sums are one product, and
        # a maximum is over the row's items only (a dead item in none).
        holds = ops.equal(ops.arange(num_rows, dtype="int32")[:, None],
                          rows[None, :])

        def total(x, kind):
            if kind == "sum":
                sums = ops.matmul(ops.cast(holds, x.dtype),
                                  ops.reshape(x, (x.shape[0], -1)))
                return ops.reshape(sums, (num_rows,) + tuple(x.shape[1:]))
            held = ops.reshape(holds, tuple(holds.shape) + (1,) * (
                len(x.shape) - 1))
            return ops.amax(ops.where(held, x[None], logits_lib.MASKED_LOGIT),
                            axis=1)

    return total, spread


def _combine(scores, mask, values_and_scales, by_row, sinks, query,
             batch):
    """The softmax over each row's items: `(R, T, N, V)`."""
    _, groups, per_group, length, _ = scores.shape
    num_rows = query.shape[0]
    total_of, spread = by_row
    masked = ops.where(mask, scores, logits_lib.MASKED_LOGIT)
    row_top = total_of(ops.amax(masked, axis=-1), "max")  # (R, K, G, T)
    if sinks is not None:
        sink = ops.reshape(ops.cast(sinks, scores.dtype),
                           (1, groups, per_group, 1))
        row_top = ops.maximum(row_top, sink)
    exp = ops.where(mask, ops.exp(masked - spread(row_top)[..., None]), 0.0)
    total = total_of(ops.sum(exp, axis=-1), "sum")  # (R, K, G, T)
    values, scales = values_and_scales
    weighted = total_of(ops.einsum("wkgts,wskv->wkgtv", _scaled(exp, scales),
                                   values), "sum")
    if sinks is not None:
        total = total + ops.exp(sink - row_top)
    context = ops.where(total[..., None] > 0, weighted / ops.maximum(
        total, 1e-30)[..., None], 0.0)  # (R, K, G, T, V)
    context = ops.reshape(ops.transpose(context, (0, 3, 1, 2, 4)),
                          (num_rows, length, groups * per_group, -1))
    real = ops.arange(length, dtype="int32")[None, :] < ops.cast(
        batch.lengths, "int32")[:, None]
    context = ops.where(real[:, :, None, None], context, 0.0)
    return ops.cast(context, query.dtype)
