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
- `cache.py`: the key/value cache that decoding reads and writes, and
  `decode.py`: attention over the cache itself, reading only what a step
  sees (`attend_cached` picks between them and the paths above);
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

from keras_mha.attention import cache as cache_lib
from keras_mha.attention import dispatch
from keras_mha.attention import sharded
from keras_mha.attention import tuning
from keras_mha.attention.banded import banded_attention
from keras_mha.attention.blocked import blocked_attention
from keras_mha.attention.decode import decode_attention
from keras_mha.attention.explicit import explicit_attention
from keras_mha.attention.fused import fused_attention
from keras_mha.attention.fused import fused_window_attention
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
    return triangular_attention(query, key, value, spec), None


def attend_cached(query, key, value, spec, cache, index, rolling):
    """Attention of a decoding call, and the cache after its write.

    Three routes, all with the same numbers (`dispatch.cache_route`);
    under `keras_mha.ContextParallel` a cache whose slots are sharded
    takes `in_place` as `sharded.cached_decode` (each device reads its own
    slots):

    - `"prompt"`: a Python index 0 (an empty cache): the tokens attend to
      themselves on any path (`banded` for a window, the causal kernels
      otherwise), and are written.
    - `"in_place"`: the tokens are written first, then `decode_attention`
      reads the cache itself up to the last position (a full cache) or
      its `w` slots (a rolling cache, one token).
    - `"concatenated"`: the cache's old slots followed by the new tokens
      on the explicit or fused path (returned weights, dropout, several
      tokens in a rolling cache).

    Args:
        query: `(B, T, N, H)`.
        key: the new tokens' keys `(B, T, K, H)`.
        value: their values `(B, T, K, V)`.
        spec: the call's spec; its `key_mask` marks the new real tokens.
        cache: `(keys, values, valid)` (see `cache.py`).
        index: the position of the first new token (int or tensor).
        rolling: whether slot = position mod L.

    Returns:
        `(output, weights, new_cache)`; weights `(B, N, T, L + T)` (the
        old slots, then the new tokens) when `spec.return_weights`.
    """
    route = dispatch.cache_route(spec, query.shape[1], index, rolling)
    if route == dispatch.IN_PLACE and sharded.shards_cache(
        spec.sharding, cache
    ):
        output, new_cache = sharded.cached_decode(
            query, (key, value), spec, cache, index, rolling
        )
        return output, None, new_cache
    if route != dispatch.PROMPT:  # the rest reads the whole cache
        spec = spec.replace(sharding=None)
    if route == dispatch.PROMPT:
        output, weights = attend(query, key, value, spec)
        new_cache = cache_lib.write(cache, key, value, spec.key_mask, 0,
                                    rolling)
        return output, weights, new_cache
    if route == dispatch.IN_PLACE:
        new_cache = cache_lib.write(cache, key, value, spec.key_mask, index,
                                    rolling)
        spec = spec.replace(query_offset=index, key_mask=None)
        return decode_attention(query, new_cache, spec, rolling), None, \
            new_cache
    keys, values, keys_valid, key_positions, new_cache = (
        cache_lib.attend_inputs(cache, key, value, spec.key_mask, index,
                                rolling)
    )
    spec = spec.replace(
        query_offset=index, key_positions=key_positions, key_mask=keys_valid
    )
    output, weights = attend(query, keys, values, spec)
    return output, weights, new_cache


__all__ = ["AttentionSpec", "attend", "attend_cached", "dispatch", "tuning"]
