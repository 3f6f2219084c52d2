"""Multi-head latent attention (DeepSeek V2/V3) as pure functions.

Every token has one latent `c` `(R,)` (`kv_lora_rank`, normalized) and one
rotated key `k_rope` `(P,)` shared by the heads. Per head `n`, with the
up-projection `W = kv_b` `(R, N, Hn + V)` split into its key half `W_k`
`(R, N, Hn)` and value half `W_v` `(R, N, V)`:

    key_n   = [c·W_k[:, n], k_rope]      (Hn + P)
    value_n = c·W_v[:, n]                 (V)
    query_n = [q_nope_n, q_rope_n]        (Hn + P)

Two computations give the same numbers:

- **expanded**: up-project every latent into per-head keys and values and
  attend over them on the usual paths (`attend`): `N·(Hn + P + V)` numbers
  per key, a product of `R·N·(Hn + V)` per key and call;
- **absorbed**: `q_nope_n·(c·W_k[:, n]) = (W_k[:, n]·q_nope_n)·c`, so the
  query becomes `[W_k[:, n]·q_nope_n, q_rope_n]` `(R + P)` and attends over
  one shared key/value head, keys `[c, k_rope]` `(R + P)` and values `c`
  `(R)` (grouped attention with `K = 1`); the head's context is then
  multiplied by `W_v[:, n]`. Nothing per key is computed: a decoding step
  reads the cache's latents where they lie (`cache_layouts.LATENT`).

The rule (`computation`): a call with a cache whose step writes its tokens
and reads the cache where it lies (the `"slot_write"` route of
`dispatch.cache_route`: decoding after the prompt, no returned weights, no
dropout) runs absorbed; every other call runs expanded (training, prompts,
returned weights, several tokens in a rolling cache), as does any call
whose `kv_b` is quantized (absorption reads its float kernel).
`force_computation` holds calls to one of them (tests, benchmarks).

The cache is `(latents (B, L, R), rope_keys (B, L, P), valid (B, L))`,
written and read with `cache.py`'s functions, which take any trailing
shape: slot `p` (or `p mod w` rolling) holds position `p`. A call with a
cache is `attention.attend_cached`'s, as every layer's: absorbed, the
cache's own layout (`cache_layouts.LATENT`); expanded, keys and values
computed from its entries (`heads`).
"""

from keras import ops

import keras_mha.attention as attention_lib
from keras_mha.attention import cache as cache_lib
from keras_mha.attention import cache_layouts
from keras_mha.attention import dispatch
from keras_mha.attention import overrides
import keras_mha.attention.paged as paged_lib

EXPANDED = "expanded"
ABSORBED = "absorbed"
COMPUTATIONS = (EXPANDED, ABSORBED)

# The computations `force_computation` blocks hold (`overrides.held`).
_forced = []


def force_computation(computation):
    """Runs every multi-head latent attention call in the block with
    `computation` (`"expanded"` or `"absorbed"`), whatever the rule says.
    For tests and benchmarks that compare the two on the same inputs."""
    return overrides.held(_forced, "computation", computation, COMPUTATIONS)


def computation(spec, query_length, cache=False, index=None, rolling=False,
                absorbable=True):
    """Which computation a call runs: `"expanded"` or `"absorbed"`.

    Args:
        spec: the call's spec (before the cache's positions are added).
        query_length: `T`.
        cache: whether the call has a cache.
        index: `cache_update_index`.
        rolling: whether the cache is rolling.
        absorbable: whether `kv_b`'s kernel can be read as floats (not
            quantized).
    """
    if _forced:
        return _forced[-1]
    if not absorbable or not cache:
        return EXPANDED
    route = dispatch.cache_route(spec, query_length, index, rolling)
    return ABSORBED if route == dispatch.SLOT_WRITE else EXPANDED


def zeros(batch_size, num_slots, kv_lora_rank, rope_dim, dtype,
          in_place=False):
    """An empty latent cache: `(latents, rope_keys, valid)`; with
    `in_place`, one the layer may update in place
    (`cache.InPlaceLatentCache`)."""
    cache = (
        ops.zeros((batch_size, num_slots, kv_lora_rank), dtype),
        ops.zeros((batch_size, num_slots, rope_dim), dtype),
        ops.zeros((batch_size, num_slots), "bool"),
    )
    if in_place:
        return cache_lib.mark_in_place(cache, cache_lib.InPlaceLatentCache)
    return cache


def expand(up_projected, rope_keys, nope_dim):
    """Per-head keys and values from up-projected latents.

    Args:
        up_projected: `kv_b(latents)`, `(B, S, N, Hn + V)`.
        rope_keys: `(B, S, P)`, rotated, shared by the heads.
        nope_dim: `Hn`.

    Returns:
        `(keys (B, S, N, Hn + P), values (B, S, N, V))`.
    """
    k_nope = up_projected[..., :nope_dim]  # (B, S, N, Hn)
    values = up_projected[..., nope_dim:]  # (B, S, N, V)
    shared = ops.broadcast_to(
        ops.expand_dims(ops.cast(rope_keys, k_nope.dtype), 2),
        tuple(ops.shape(k_nope)[:3]) + (rope_keys.shape[-1],),
    )  # (B, S, N, P)
    return ops.concatenate([k_nope, shared], axis=-1), values


def absorbed_query(q_nope, q_rope, key_kernel):
    """`(B, T, N, R + P)`: `[W_k[:, n]·q_nope_n, q_rope_n]` per head.

    Args:
        q_nope: `(B, T, N, Hn)`.
        q_rope: `(B, T, N, P)`, rotated.
        key_kernel: `W_k`, `(R, N, Hn)`.
    """
    key_kernel = ops.cast(key_kernel, q_nope.dtype)
    q_latent = ops.einsum("btnh,rnh->btnr", q_nope, key_kernel)  # (B,T,N,R)
    return ops.concatenate([q_latent, ops.cast(q_rope, q_nope.dtype)], -1)


def latent_head(latents, rope_keys, dtype):
    """The shared key/value head: keys `(B, S, 1, R + P)`, values `(B, S, 1,
    R)` (`cache_layouts.latent_heads`, the latent cache's reading)."""
    return cache_layouts.latent_heads(latents, rope_keys, dtype)


def absorbed_output(context, value_kernel):
    """`(B, T, N, V)`: each head's `(B, T, N, R)` latent context times its
    `W_v[:, n]` `(R, N, V)`."""
    value_kernel = ops.cast(value_kernel, context.dtype)
    return ops.einsum("btnr,rnv->btnv", context, value_kernel)


def latent_attention(q_nope, q_rope, latents, rope_keys, spec, up_project,
                     kernel, nope_dim, how, cache=None, index=None,
                     rolling=False):
    """Multi-head latent attention of one call, expanded or absorbed.

    Args:
        q_nope: `(B, T, N, Hn)`.
        q_rope: `(B, T, N, P)`, rotated at the queries' positions.
        latents: the new tokens' normalized latents `(B, S, R)` (`S = T`
            with a cache).
        rope_keys: their rotated shared keys `(B, S, P)`.
        spec: the call's `AttentionSpec` (`scale` is the layer's;
            `key_mask` marks the real new tokens).
        up_project: `kv_b` as a function `(B, S, R) -> (B, S, N, Hn + V)`.
        kernel: a function returning `kv_b`'s kernel `(R, N, Hn + V)`
            (read only when absorbed).
        nope_dim: `Hn`.
        how: `"expanded"` or `"absorbed"` (see `computation`).
        cache: `None`, or `(latents, rope_keys, valid)`.
        index: with a cache, the position of the first new token.
        rolling: whether the cache is rolling (slot = position mod L).

    Returns:
        `(context (B, T, N, V), weights, new_cache)`: weights `(B, N, T,
        S)` (with a cache, `(B, N, T, L + T)`: the old slots, then the new
        tokens) when `spec.return_weights`, else `None`; the new cache
        `None` without one.
    """
    dtype = q_nope.dtype
    heads = None  # absorbed: the cache read as one shared head
    if how == ABSORBED:
        w = kernel()
        w_key, w_value = w[..., :nope_dim], w[..., nope_dim:]
        query = absorbed_query(q_nope, q_rope, w_key)
    else:
        query = ops.concatenate([q_nope, q_rope], axis=-1)

        def heads(all_latents, all_rope_keys):
            up = up_project(ops.cast(all_latents, dtype))
            return expand(up, all_rope_keys, nope_dim)

    if cache is None:
        keys, values = (latent_head(latents, rope_keys, dtype)
                        if heads is None else heads(latents, rope_keys))
        context, weights = attention_lib.attend(query, keys, values, spec)
        new_cache = None
    elif paged_lib.is_paged(cache):  # pages of `[latent, rope_key]`
        keys = latent_head(latents, rope_keys, dtype)[0]
        context, weights, new_cache = attention_lib.attend_cached(
            query, keys, None, spec, cache, index, rolling,
            value_size=latents.shape[-1],
        )
    else:
        context, weights, new_cache = attention_lib.attend_cached(
            query, latents, rope_keys, spec, cache, index, rolling,
            layout=cache_layouts.LATENT, heads=heads,
        )
    if how == ABSORBED:
        context = absorbed_output(context, w_value)
    return context, weights, new_cache
