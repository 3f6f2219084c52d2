"""The cache layouts a decoding call reads and writes (ours, keras-hub's,
the latent cache's), a run of slots at a time.

- `FLAGGED`, ours: `(keys (B, L, K, H), values (B, L, K, V), valid (B, L))`
  (see `cache.py`); `valid` says where a real token was written.
- `PAIR`, keras-hub's: one tensor `(B, 2, L, K, H)`, keys at `[:, 0]`,
  values at `[:, 1]`; it has no flags, so every slot counts as written
  (a step's limit hides those it has not reached).
- `LATENT`, multi-head latent attention's: `(latents (B, L, R), rope_keys
  (B, L, P), valid (B, L))`, read as one key/value head: keys `[latent,
  rope_key]` (size `R + P`), values the latents (size `R`); see
  `latent.py`.

`slots` reads a run of slots as per-head keys and values; `packed_slots`
reads it as the rows of one product per block (`decode._packed_query`);
`entry_heads` turns the new tokens' entries into keys and values for the
usual paths; `write` writes the new tokens in any layout.
"""

from keras import ops

import keras_mha.attention.cache as cache_lib

FLAGGED = "flagged"
PAIR = "pair"
LATENT = "latent"
LAYOUTS = (FLAGGED, PAIR, LATENT)


def tensors(cache, layout):
    """A cache's tensors as the caller holds it: keras-hub's one tensor out
    of an in-place cache's wrapper (`cache.pair_tensor`), the tuples as
    they are."""
    return cache_lib.pair_tensor(cache) if layout == PAIR else cache


def num_slots(cache, layout):
    """`L`, the slots of a cache's tensors in `layout` (`tensors`)."""
    return cache.shape[2] if layout == PAIR else cache[0].shape[1]


def head_sizes(cache, layout):
    """`(K, V)`: the key/value heads of a cache in `layout`, and the size
    of its values."""
    if layout == LATENT:
        return 1, cache[0].shape[2]
    if layout == PAIR:
        return cache.shape[3], cache.shape[4]
    return cache[0].shape[2], cache[1].shape[3]


def latent_heads(latents, rope_keys, dtype):
    """The latent cache's one key/value head in `dtype`: keys `(B, S, 1, R +
    P)`, `[latent, rope_key]`, and values `(B, S, 1, R)`, the latents."""
    latents = ops.cast(latents, dtype)
    keys = ops.concatenate([latents, ops.cast(rope_keys, dtype)], axis=-1)
    return keys[:, :, None], latents[:, :, None]


def entry_heads(layout, dtype):
    """`None` where a layout's entries are its keys and values (ours,
    keras-hub's), else the function of the entries that gives them (the
    latent cache's `latent_heads`, in `dtype`)."""
    if layout != LATENT:
        return None
    return lambda latents, rope_keys: latent_heads(latents, rope_keys, dtype)


def run(tensor, start, size):
    """Slots `[start, start + size)` of one of a tuple cache's tensors."""
    if size == tensor.shape[1]:  # all of them: no slice to trace
        return tensor
    starts = (0, start) + (0,) * (tensor.ndim - 2)
    shape = (ops.shape(tensor)[0], size) + tuple(tensor.shape[2:])
    return ops.slice(tensor, starts, shape)


def slots(cache, start, size, layout, dtype):
    """`(keys, values, written)` of slots `[start, start + size)`: `(B, b,
    K, H)` and `(B, b, K, V)` in `dtype`, and `(B|1, b)` booleans. On
    torch the keys and the values are views of the cache."""
    if layout == PAIR:
        if size == cache.shape[2]:
            block = cache
        else:
            batch = ops.shape(cache)[0]
            block = ops.slice(
                cache, (0, 0, start, 0, 0),
                (batch, 2, size) + tuple(cache.shape[3:]),
            )  # (B, 2, b, K, H)
        keys, values = block[:, 0], block[:, 1]
        written = ops.ones((1, size), "bool")
    elif layout == LATENT:
        latents, rope_keys, written = (run(part, start, size)
                                       for part in cache)
        keys, values = latent_heads(latents, rope_keys, dtype)
    else:
        keys, values, written = (run(part, start, size) for part in cache)
    return ops.cast(keys, dtype), ops.cast(values, dtype), written


def packed_slots(cache, start, size, layout, dtype):
    """`(keys, values, written)` of slots `[start, start + size)` as the
    rows of one product each, read where they lie: keys `(B, b, K·H)` and
    values `(B, b, K·V)` in `dtype`; for the latent cache the keys are
    the pair `(latents (B, b, R), rope_keys (B, b, P))` (two products, no
    concatenated copy) and the values the latents."""
    if layout == PAIR:
        batch, zero = ops.shape(cache)[0], ops.zeros((), "int32")
        block = ops.slice(
            cache, (zero, zero, start, zero, zero),
            (batch, 2, size) + tuple(cache.shape[3:]),
        )  # (B, 2, b, K, H)
        rows = ops.cast(ops.reshape(block, (batch, 2, size, -1)), dtype)
        return rows[:, 0], rows[:, 1], ops.ones((1, size), "bool")
    if layout == LATENT:
        latents, rope_keys, written = (run(part, start, size)
                                       for part in cache)
        keys = tuple(ops.cast(x, dtype) for x in (latents, rope_keys))
        return keys, keys[0], written
    keys, values, written = (run(part, start, size) for part in cache)
    keys, values = (
        ops.cast(ops.reshape(x, (-1, size, x.shape[2] * x.shape[3])), dtype)
        for x in (keys, values)
    )  # (B, b, K·H), (B, b, K·V)
    return keys, values, written


def write(cache, key, value, valid, index, rolling, layout, halves=False):
    """`(new_cache, keys, values)`: the cache, as the caller holds it (an
    in-place one too), with the new tokens' entries written at positions
    `index ..` (`cache.write`; keras-hub's cache by `cache.write_pair`),
    and with `halves`, keras-hub's `(B, L, K, H)` keys and values after
    the write; `None` for the other layouts."""
    if layout == PAIR:
        in_place = cache_lib.is_in_place(cache)
        new_cache, keys, values = cache_lib.write_pair(
            cache_lib.pair_tensor(cache), key, value, index, halves=halves,
            in_place=in_place,
        )
        if halves and keys is None:  # the cache's halves hold them
            keys, values = new_cache[:, 0], new_cache[:, 1]
        if in_place:
            new_cache = cache_lib.InPlacePairCache(new_cache)
        return new_cache, keys, values
    return cache_lib.write(cache, key, value, valid, index, rolling), None, \
        None


def written_below(size, limit):
    """`(1, L)` booleans: keras-hub's slots below `limit`, the written ones
    (it keeps no flags); slot `j` holds position `j`."""
    return (ops.arange(size, dtype="int32") < limit)[None, :]
