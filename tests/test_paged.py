"""Paged caches and ragged calls (`keras_mha/attention/paged.py`).

A ragged call's rows are held, sequence by sequence, to the layer's full
causal pass over each row's whole sequence (which the rest of the suite
holds to the float64 reference): every feature, windows whose pages are
freed and handed to others, pages in scrambled order, a shared prefix
copied on write. Quantized pages are held to a float64 computation over
keys and values quantized as the cache stores them. A step writes only the
pages its rows own; bad input is a named error.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from conftest import BACKEND

import keras_mha
from keras_mha import serving
from keras_mha.attention import attend_cached
from keras_mha.attention import paged
from keras_mha.attention import tuning
from util import attention_spec
from util import make_layer
from util import to_numpy

ROWS, LENGTH, FEATURES = 3, 12, 16
# `(row lengths)` of the calls each test makes: a prefill of several
# lengths, then decode steps beside a prefill chunk, then one token each.
STEPS = ((5, 7, 0), (1, 3, 6), (1, 1, 4), (1, 1, 1))
WIDTH = 7  # every call's `T`: one shape for every step

FEATURES_OF = {
    "gqa_rope": dict(rotary_embedding=keras_mha.RotaryEmbedding()),
    "window": dict(sliding_window=3,
                   rotary_embedding=keras_mha.RotaryEmbedding()),
    "chunk": dict(attention_chunk_size=4,
                  rotary_embedding=keras_mha.RotaryEmbedding()),
    "soft_cap_sinks": dict(attn_logits_soft_cap=2.0, use_sinks=True,
                           rotary_embedding=keras_mha.RotaryEmbedding()),
    "alibi_norms": dict(use_alibi=True, qk_norm="rms",
                        query_temperature=(3.0, 0.5)),
}


def _layer(x, **features):
    layer = make_layer(x, x, num_heads=4, key_dim=8, num_key_value_heads=2,
                       **features)
    if layer.sinks is not None:
        layer.sinks.assign(np.linspace(-1.0, 1.0, 4).astype("float32"))
    return layer


def _table(rng, pages_per_row=6, num_pages=24):
    """A page table of distinct pages in scrambled order."""
    pages = rng.permutation(num_pages)[: ROWS * pages_per_row]
    return pages.reshape(ROWS, pages_per_row).astype("int32")


def _run(layer, x, table, pool, steps=STEPS, before_step=None):
    """The ragged calls of `steps` over `x` `(R, LENGTH, E)`: each row's
    outputs, position by position, and the pool."""
    positions = np.zeros(ROWS, "int32")
    outputs = [[] for _ in range(ROWS)]
    for number, lengths in enumerate(steps):
        lengths = np.asarray(lengths, "int32")
        tokens = np.zeros((ROWS, WIDTH, x.shape[2]), "float32")
        for r in range(ROWS):
            tokens[r, : lengths[r]] = x[r, positions[r]: positions[r]
                                        + lengths[r]]
        if before_step is not None:
            table, pool = before_step(number, table, pool, positions)
        batch = paged.RaggedBatch(table, positions.copy(), lengths)
        out, pool = layer(tokens, tokens, use_causal_mask=True, cache=pool,
                          cache_update_index=batch)
        out = to_numpy(out)
        for r in range(ROWS):
            outputs[r].extend(out[r, : lengths[r]])
        positions += lengths
    return [np.asarray(o) for o in outputs], pool


def _assert_rows_match_full_pass(layer, x, outputs, atol=2e-5):
    full = to_numpy(layer(x, x, use_causal_mask=True))
    for r, out in enumerate(outputs):
        np.testing.assert_allclose(out, full[r, : len(out)], atol=atol,
                                   rtol=atol)


@pytest.mark.parametrize("feature", sorted(FEATURES_OF))
def test_ragged_rows_match_the_full_pass(rng, feature):
    x = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype("float32")
    layer = _layer(x, **FEATURES_OF[feature])
    outputs, _ = _run(layer, x, _table(rng), layer.init_paged_cache(24, 2))
    assert [len(o) for o in outputs] == [8, 12, 11]
    _assert_rows_match_full_pass(layer, x, outputs)


@pytest.mark.parametrize("feature", ["window", "soft_cap_sinks", "int8"])
def test_one_rows_chunks_read_its_pages_as_one_sequence(rng, feature,
                                                        monkeypatch):
    """A call of one row and several tokens (a prefill chunk) attends its
    pages as one sequence on the usual paths (`paged.row_sequence`): the
    same outputs as the work items, and as the full causal pass. Quantized
    pages keep the work items, which dequantize them as they read."""
    x = rng.normal(size=(1, LENGTH, FEATURES)).astype("float32")
    layer = _layer(x, **FEATURES_OF.get(feature, FEATURES_OF["gqa_rope"]))
    quantize = "int8" if feature == "int8" else None
    table = rng.permutation(8)[:6].reshape(1, 6).astype("int32")
    taken = []
    original = paged.row_sequence

    def counted(*args, **kwargs):
        taken.append(original(*args, **kwargs) is not None)
        return original(*args, **kwargs)

    monkeypatch.setitem(tuning.OVERRIDES, "paged_row_sequence", True)
    outputs = {}
    for route in ("sequence", "items"):
        monkeypatch.setattr(paged, "row_sequence", counted if route ==
                            "sequence" else lambda *a, **k: None)
        pool, position, got = layer.init_paged_cache(8, 2, quantize), 0, []
        for length in (5, 4, 1, 2):
            tokens = np.zeros((1, 5, FEATURES), "float32")
            tokens[0, :length] = x[0, position:position + length]
            batch = paged.RaggedBatch(table, np.array([position], "int32"),
                                      np.array([length], "int32"))
            out, pool = layer(tokens, tokens, use_causal_mask=True,
                              cache=pool, cache_update_index=batch)
            got.append(to_numpy(out)[0])  # padded queries too
            position += length
        outputs[route] = np.stack(got)
    assert taken == [quantize is None] * 4
    np.testing.assert_allclose(outputs["sequence"], outputs["items"],
                               atol=2e-5, rtol=2e-5)
    if quantize is None:
        real = [out[:length] for out, length in zip(outputs["sequence"],
                                                    (5, 4, 1, 2))]
        _assert_rows_match_full_pass(layer, x, [np.concatenate(real)])


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_latent_ragged_rows_match_the_full_pass(rng, quantize):
    """`MultiHeadLatentAttention`'s pages hold `[latent, rope_key]` once
    (no value pages); its ragged call, absorbed, matches its full pass
    (int8: within its rounding)."""
    x = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype("float32")
    layer = keras_mha.MultiHeadLatentAttention(
        num_heads=4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=4, rotary_embedding=keras_mha.RotaryEmbedding())
    layer.build(x.shape, x.shape)
    pool = layer.init_paged_cache(24, 2, quantize=quantize)
    assert pool.values is None and tuple(pool.keys.shape[2:]) == (1, 12)
    outputs, _ = _run(layer, x, _table(rng), pool)
    if quantize is None:
        _assert_rows_match_full_pass(layer, x, outputs)
    else:
        full = to_numpy(layer(x, x, use_causal_mask=True))
        error = max(np.abs(o - full[r, : len(o)]).max()
                    for r, o in enumerate(outputs))
        assert 0 < error < 0.02 * np.abs(full).max()


def test_a_window_frees_pages_that_others_then_write(rng):
    """Row 0's pages outside its window are freed after each step and
    handed to row 2, which writes them; row 0 still matches."""
    x = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype("float32")
    layer = _layer(x, sliding_window=3,
                   rotary_embedding=keras_mha.RotaryEmbedding())
    table = _table(rng, num_pages=18)
    spare = table[2].tolist()
    table[2] = -1

    def free_and_reuse(number, table, pool, positions):
        table, freed = table.copy(), []
        # Row 0's next query, at `positions[0]`, sees 3 keys back: the
        # pages below are never read again.
        for index in range(max(int(positions[0]) - 2, 0) // 2):
            if table[0, index] >= 0:
                freed.append(table[0, index])
                table[0, index] = -1
        for index in np.nonzero(table[2] < 0)[0]:
            table[2, index] = (freed or spare).pop(0)
        return table, pool

    outputs, _ = _run(layer, x, table, layer.init_paged_cache(24, 2),
                      before_step=free_and_reuse)
    _assert_rows_match_full_pass(layer, x, outputs)


def test_window_work_skips_the_pages_it_cannot_see():
    """The work items of a windowed row start at its window's first page,
    and a row with no new token has none."""
    spec = attention_spec(4, window=4, causal=True)  # (left, right) (3, 0)
    batch = paged.RaggedBatch(np.arange(12, dtype="int32").reshape(2, 6),
                              np.array([9, 4], "int32"),
                              np.array([1, 0], "int32"))
    rows, pages, grid = paged.work_items(batch, 2, paged.reach_of(spec), 1)
    rows, pages = to_numpy(rows), to_numpy(pages)
    assert not grid
    live = rows < 2
    assert pages[live].tolist() == [3, 4] and rows[live].tolist() == [0, 0]


def test_a_shared_prefix_is_copied_on_first_write(rng):
    """Two sequences share a 6-token prompt (page 1 half full). The
    allocator gives the first writer a copy of the shared page; both then
    match their own full passes, and the full page stays shared."""
    x = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype("float32")
    x[1, :6] = x[0, :6]
    layer = _layer(x, rotary_embedding=keras_mha.RotaryEmbedding())
    allocator = serving.PageAllocator(num_pages=8, page_size=4,
                                      max_sequences=ROWS,
                                      max_pages_per_sequence=3)
    pool = layer.init_paged_cache(8, 4)

    def step(counts, rows_tokens):
        tokens = np.zeros((ROWS, WIDTH, FEATURES), "float32")
        for row, values in rows_tokens.items():
            tokens[row, : len(values)] = values
        return layer(tokens, tokens, use_causal_mask=True, cache=pool,
                     cache_update_index=allocator.batch(counts))

    row, _ = allocator.add()
    allocator.reserve(row, 6)
    _, pool = step({row: 6}, {row: x[0, :6]})
    allocator.advance(row, range(6))
    other = allocator.fork(row)
    shared = allocator.pages(row)[:2]
    assert [allocator.references(p) for p in shared] == [2, 2]
    outputs = {row: [], other: []}
    for position in range(6, 9):
        for r in (row, other):
            sources, targets = allocator.reserve(r, 1)
            pool = paged.copy_pages(pool, sources, targets)
        out, pool = step({row: 1, other: 1}, {row: x[0, position: position
                                                      + 1],
                                              other: x[1, position: position
                                                       + 1]})
        for r in (row, other):
            allocator.advance(r, [position])
            outputs[r].append(to_numpy(out)[r, 0])
    assert allocator.pages(row)[0] == allocator.pages(other)[0]
    assert allocator.pages(row)[1] != allocator.pages(other)[1]
    full = to_numpy(layer(x, x, use_causal_mask=True))
    for r, sequence in ((row, 0), (other, 1)):
        np.testing.assert_allclose(np.asarray(outputs[r]),
                                   full[sequence, 6:9], atol=2e-5)


def _quantized(x, storage):
    """`x` float64 quantized as the cache stores it, and dequantized."""
    top = np.abs(x).max(-1, keepdims=True)
    scale = np.where(top > 0, top / paged.QUANTIZED[storage], 1.0)
    scale = scale.astype("float32").astype("float64")
    scaled = (x / scale).astype("float32")
    if storage == "int8":
        stored = np.clip(np.round(scaled), -127, 127)
    else:
        stored = scaled.astype(ml_dtypes.float8_e4m3fn).astype("float64")
    return stored * scale


def _has(dtype):
    try:
        keras.ops.zeros((1,), dtype)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("storage", sorted(paged.QUANTIZED))
def test_quantized_pages_match_float64_over_the_same_quantization(
        rng, storage):
    if not _has(storage):
        pytest.skip(f"{BACKEND} has no {storage}")
    q = rng.normal(size=(2, 3, 4, 8)).astype("float32")
    k = rng.normal(size=(2, 3, 2, 8)).astype("float32") * 3
    v = rng.normal(size=(2, 3, 2, 8)).astype("float32")
    pool = paged.zeros(6, 4, 2, 8, 8, "float32", quantize=storage)
    batch = paged.RaggedBatch(np.array([[4, 1], [0, 5]], "int32"),
                              np.zeros(2, "int32"), np.array([3, 2], "int32"))
    spec = attention_spec(8, causal=True)
    out, _, pool = attend_cached(q, k, v, spec, pool, batch, False)
    assert keras.backend.standardize_dtype(pool.keys.dtype) == storage
    keys, values = _quantized(k.astype("float64"), storage), _quantized(
        v.astype("float64"), storage)
    for r, length in enumerate((3, 2)):
        kk, vv = (np.repeat(t[r, :length], 2, axis=1) for t in (keys,
                                                               values))
        logits = np.einsum("tnh,snh->nts", q[r, :length], kk) / np.sqrt(8)
        logits = np.where(np.tril(np.ones((length, length), bool)),
                          logits, -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        expected = np.einsum("nts,snv->tnv", weights, vv)
        np.testing.assert_allclose(to_numpy(out)[r, :length], expected,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("storage", sorted(paged.QUANTIZED))
@pytest.mark.parametrize("rolling", [False, True])
def test_quantized_dense_and_rolling_caches_match_float64(rng, storage,
                                                          rolling):
    """`init_cache(..., quantize=...)`'s cache (`paged.PagedRows`): a
    7-token prompt, then one token at a time to 14, against float64 over
    the same quantization. Rolling: a causal window of 3, 4 slots, the
    prompt written a page at a time and the pages reused in turn."""
    if not _has(storage):
        pytest.skip(f"{BACKEND} has no {storage}")
    q = rng.normal(size=(2, 14, 4, 8)).astype("float32")
    k = rng.normal(size=(2, 14, 2, 8)).astype("float32") * 3
    v = rng.normal(size=(2, 14, 2, 8)).astype("float32")
    window = (2, 0) if rolling else None
    cache = paged.rows(2, 14, 3 if rolling else 14, rolling, 2, 8, 8,
                       "float32", quantize=storage)
    spec = attention_spec(8, window=window, causal=True)
    outputs = []
    for start, stop in [(0, 7)] + [(t, t + 1) for t in range(7, 14)]:
        out, _, cache = attend_cached(q[:, start:stop], k[:, start:stop],
                                      v[:, start:stop], spec, cache, start,
                                      rolling)
        outputs.append(to_numpy(out))
    keys = np.repeat(_quantized(k.astype("float64"), storage), 2, axis=2)
    values = np.repeat(_quantized(v.astype("float64"), storage), 2, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, keys) / np.sqrt(8)
    position = np.arange(14)
    allowed = position[None, :] <= position[:, None]
    if rolling:
        allowed &= position[None, :] > position[:, None] - 3
    logits = np.where(allowed, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bnts,bsnv->btnv", weights, values)
    np.testing.assert_allclose(np.concatenate(outputs, 1), expected,
                               atol=1e-5, rtol=1e-5)
    if rolling:  # 3 keys back and a page of writes: 3 pages of 3 a row
        assert tuple(cache.pool.keys.shape[:2]) == (2 * 3 + 1, 3)


def test_a_quantized_cache_decodes_as_the_layer_does(rng):
    """The layer's decode over an int8 cache stays within 2% of its full
    pass (int8's rounding; the exact computation is the test above), and
    an index past its pages is named."""
    x = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype("float32")
    layer = _layer(x, sliding_window=4,
                   rotary_embedding=keras_mha.RotaryEmbedding())
    cache = layer.init_cache(ROWS, LENGTH, quantize="int8")
    assert isinstance(cache, paged.PagedRows)
    out, cache = layer(x[:, :WIDTH], x[:, :WIDTH], use_causal_mask=True,
                       cache=cache, cache_update_index=0)
    outputs = [to_numpy(out)]
    for t in range(WIDTH, LENGTH):
        out, cache = layer(x[:, t:t + 1], x[:, t:t + 1],
                           use_causal_mask=True, cache=cache,
                           cache_update_index=t)
        outputs.append(to_numpy(out))
    full = to_numpy(layer(x, x, use_causal_mask=True))
    error = np.abs(np.concatenate(outputs, 1) - full).max()
    assert 0 < error < 0.02 * np.abs(full).max()  # int8's, not float's
    with pytest.raises(ValueError, match="out of range"):
        layer(x[:, :1], x[:, :1], use_causal_mask=True, cache=cache,
              cache_update_index=LENGTH + 4)


def test_quantized_int8_pool_bytes():
    """int8 pages and their scales: a quarter of float32's bytes plus one
    scale per token and head."""
    pool = paged.zeros(4, 16, 2, 64, 64, "float32", quantize="int8")
    dense = paged.zeros(4, 16, 2, 64, 64, "float32")
    size = lambda c: sum(to_numpy(t).nbytes for t in c if t is not None)
    assert size(pool) / size(dense) == pytest.approx((64 + 4) / 256)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_step_writes_only_its_rows_pages(rng, in_place):
    x = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype("float32")
    layer = _layer(x, rotary_embedding=keras_mha.RotaryEmbedding())
    table = _table(rng)
    pool = layer.init_paged_cache(24, 2, in_place=in_place)
    _, pool = _run(layer, x, table, pool, steps=STEPS[:2])
    before = [to_numpy(t).copy() for t in pool[:2]]
    batch = paged.RaggedBatch(table, np.array([6, 10, 6], "int32"),
                              np.array([1, 0, 2], "int32"))
    tokens = x[:, :2]
    _, pool = layer(tokens, tokens, use_causal_mask=True, cache=pool,
                    cache_update_index=batch)
    assert isinstance(pool, paged.InPlacePagedCache) == (
        in_place and BACKEND in ("torch", "tensorflow"))
    written = {(table[0, 3], 0), (table[2, 3], 0), (table[2, 3], 1)}
    for old, new in zip(before, (to_numpy(t) for t in pool[:2])):
        for page in range(24):  # the scratch page apart
            for slot in range(2):
                same = np.array_equal(old[page, slot], new[page, slot])
                assert same != ((page, slot) in written), (page, slot)


def _call(layer, pool, table, positions, lengths, width=2):
    tokens = np.zeros((len(positions), width, FEATURES), "float32")
    batch = paged.RaggedBatch(np.asarray(table, "int32"),
                              np.asarray(positions, "int32"),
                              np.asarray(lengths, "int32"))
    return layer(tokens, tokens, use_causal_mask=True, cache=pool,
                 cache_update_index=batch)


@pytest.mark.parametrize("table, positions, lengths, message", [
    ([[0, 24]], [0], [2], "out of the pool of 24 pages"),
    ([[0, -1]], [1], [2], "Row 0 is longer than its pages"),
    ([[0, 1], [1, 2]], [2, 0], [1, 2], "Rows 0 and 1 both write page 1"),
    ([[0, 1]], [0], [3], "offsets do not add up"),
    ([[0, 1]], [-1], [1], "offsets do not add up"),
])
def test_bad_ragged_calls_are_named(rng, table, positions, lengths,
                                    message):
    x = rng.normal(size=(1, 2, FEATURES)).astype("float32")
    layer = _layer(x)
    pool = layer.init_paged_cache(24, 2)
    with pytest.raises(ValueError, match=message):
        _call(layer, pool, table, positions, lengths)


def test_bad_paged_caches_are_named(rng):
    x = rng.normal(size=(1, 2, FEATURES)).astype("float32")
    layer = _layer(x)
    with pytest.raises(ValueError, match="quantize"):
        layer.init_paged_cache(4, 2, quantize="int4")
    with pytest.raises(ValueError, match="Received: num_pages=0"):
        layer.init_paged_cache(0, 2)
    wide = paged.zeros(4, 2, 3, 8, 8, "float32")
    with pytest.raises(ValueError, match=r"\(pages \+ 1, page_size, 2, 8\)"):
        _call(layer, wide, [[0]], [0], [1])
    with pytest.raises(TypeError, match="RaggedBatch"):
        layer(x, x, use_causal_mask=True, cache=layer.init_paged_cache(4, 2),
              cache_update_index=0)
    with pytest.raises(ValueError, match="no `attention_mask`"):
        layer(x, x, use_causal_mask=True, cache=layer.init_paged_cache(4, 2),
              cache_update_index=paged.RaggedBatch(
                  np.zeros((1, 1), "int32"), np.zeros(1, "int32"),
                  np.ones(1, "int32")),
              attention_mask=np.ones((1, 2, 2), bool))
    if not _has("float8_e4m3fn"):
        with pytest.raises(ValueError, match="no `float8_e4m3fn` dtype"):
            layer.init_paged_cache(4, 2, quantize="float8_e4m3fn")
    pool = paged.zeros(4, 2, 2, 8, 8, "int16")
    scales = keras.ops.ones((5, 2, 2))
    with pytest.raises(ValueError, match="cache.keys.dtype"):
        _call(layer, paged.PagedCache(*pool[:2], scales, scales), [[0]],
              [0], [1])
