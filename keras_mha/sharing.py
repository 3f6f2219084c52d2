"""Keys and values shared between layers (KV sharing: Gemma 3n, Gemma 4).

In those models the last layers project queries only: each attends over
the keys and values of the last earlier layer of its kind (sliding or
full), as that layer made them (normalized, rotated, padding zeroed).

- The earlier layer is any `MultiHeadAttention`. A call with
  `return_key_value=True` also returns `(keys, values)`, `(B, S, K, H)`
  and `(B, S, K, V)`: the heads it attended over, of this call's tokens.
- The layer that shares them is built with `shared_key_value=True` (and
  `key_value_source`, the earlier layer's index or name, which the caller
  routes by; `from_torch` sets it). It has no key or value projections
  (nor a key norm), and its call takes no `value` or `key`. It takes
  `shared_key_value`:
  - the pair, whose keys sit at positions `0 .. S - 1`, as in a call
    without a cache (training, a whole prompt);
  - or the earlier layer's cache as its cached call returned it, with the
    same `cache_update_index`. The cache is read, never written: the
    queries sit at `cache_update_index + t` and see the slots up to their
    own positions (`attention.attend_shared`). It keeps no cache of its
    own.
- A rolling cache (a window, chunks) forgets what a longer prompt's first
  tokens saw. A layer that shares one reads it a token at a time or for a
  first prompt within its slots. For a longer prompt it takes the pair,
  as Hugging Face's shared layers keep the earlier layer's full-length
  states.
"""

import keras


def is_cache(shared):
    """Whether a call's `shared_key_value` is a cache (`(keys, values,
    valid)`) rather than a `(keys, values)` pair (or `None`)."""
    return isinstance(shared, (tuple, list)) and len(shared) == 3


def stand_in(query, shared):
    """A `(B, S, E)` tensor spec standing for the inputs a shared layer
    does not take, for the shapes that read them: `S` the pair's length or
    the cache's slots, `E` the query's features."""
    return keras.KerasTensor(
        (query.shape[0], shared[0].shape[1], query.shape[-1]),
        dtype=query.dtype)
