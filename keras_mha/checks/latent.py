"""Checks of a `MultiHeadLatentAttention` call: its inputs, masks, cache
and index, from shapes and dtypes alone (eager and symbolic)."""

import keras

from keras_mha.attention import paged as paged_lib
from keras_mha.checks.arguments import dims_agree
from keras_mha.checks.cache import cache_index
from keras_mha.checks.cache import part_shapes
from keras_mha.checks.inputs import defined_features
from keras_mha.checks.inputs import mask_argument
from keras_mha.checks.inputs import programs
from keras_mha.checks.paged import ragged_call


def shapes(query_shape, value_shape):
    for name, shape in (("query", query_shape), ("value", value_shape)):
        if len(shape) != 3:
            raise ValueError(
                f"`{name}` must have rank 3 (batch, sequence, features). "
                f"Received: {name}.shape={shape}"
            )
        defined_features(name, shape)
    if not dims_agree(query_shape[:1], value_shape[:1]):
        raise ValueError(
            "`query` and `value` must have the same batch size. Received: "
            f"query.shape={query_shape}, value.shape={value_shape}"
        )


def call(layer, *, query, value, key, query_mask, value_mask, key_mask,
         attention_mask, use_causal_mask, cache, cache_update_index,
         return_attention_scores=False, training=None, mask_mod=None,
         score_mod=None):
    """Checks a call from shapes and dtypes alone (eager and symbolic).

    Takes every argument of the call, by keyword; `return_attention_scores`
    and `training` need no check.
    """
    programs(mask_mod, score_mod)
    if paged_lib.is_paged(cache):  # a ragged call (`checks/paged.py`)
        return ragged_call(layer, (query, value, value), cache,
                           cache_update_index, use_causal_mask,
                           return_attention_scores, locals())
    query_shape, value_shape = tuple(query.shape), tuple(value.shape)
    shapes(query_shape, value_shape)
    if key is not None and key is not value:
        raise ValueError(
            "Keys and values both come from the latents of `value`: `key` "
            "must be `None` or `value` itself. Received: key with shape "
            f"{tuple(key.shape)}"
        )
    if layer.built:
        for name, shape in (("query", query_shape), ("value", value_shape)):
            size = layer.input_features[name]
            if shape[-1] != size:
                raise ValueError(
                    f"`{name}` must have {size} features, as when the layer "
                    f"was built. Received: {name}.shape={shape}"
                )
    for name, mask, shape in (
        ("query_mask", query_mask, query_shape),
        ("value_mask", value_mask, value_shape),
        ("key_mask", key_mask, value_shape),
    ):
        if mask is not None:
            mask_argument(name, mask, {2: ("(B, L)", shape[:2])})
    if attention_mask is not None:
        batch, t_len, s_len = query_shape[0], query_shape[1], value_shape[1]
        mask_argument("attention_mask", attention_mask, {
            2: ("(T, S)", (t_len, s_len)),
            3: ("(B, T, S)", (batch, t_len, s_len)),
            4: ("(B, N, T, S)",
                (batch, layer.settings.num_heads, t_len, s_len)),
        })
    if cache is None and cache_update_index is None:
        return
    if cache is None or cache_update_index is None:
        raise ValueError(
            "`cache` and `cache_update_index` go together. Received: "
            f"cache={'None' if cache is None else 'a cache'}, "
            f"cache_update_index={cache_update_index!r}"
        )
    if not use_causal_mask:
        raise ValueError(
            "Decoding with a cache needs `use_causal_mask=True`. "
            f"Received: use_causal_mask={use_causal_mask}"
        )
    if attention_mask is not None:
        raise ValueError(
            "`attention_mask` is not supported with a cache; pass "
            "`query_mask`/`value_mask` (the cache remembers padding). "
            "Received: attention_mask with shape "
            f"{tuple(attention_mask.shape)}"
        )
    if not dims_agree(value_shape[1:2], query_shape[1:2]):
        raise ValueError(
            "With a cache, `value` holds the new tokens: it must have the "
            f"length of `query`. Received: query.shape={query_shape}, "
            f"value.shape={value_shape}"
        )
    _cache(layer, cache, query_shape[0])
    cache_index(cache_update_index, query_shape[1],
                       cache[0].shape[1], layer.rolling_cache)


def _cache(layer, cache, batch):
    if not isinstance(cache, (tuple, list)) or len(cache) != 3 or not all(
        hasattr(part, "shape") and hasattr(part, "dtype") for part in cache
    ):
        raise TypeError(
            "`cache` must be the tuple `(latents, rope_keys, valid)` that "
            "`init_cache` returns. Received: cache of type "
            f"{type(cache).__name__}"
        )
    settings = layer.settings
    slots = settings.rolling_slots if layer.rolling_cache else None
    if slots is None and len(cache[0].shape) > 1:
        slots = cache[0].shape[1]
    expected = (
        (batch, slots, settings.kv_lora_rank),
        (batch, slots, settings.qk_rope_head_dim),
        (batch, slots),
    )
    part_shapes(cache, expected, "`(latents, rope_keys, valid)` of shapes "
                "(B, L, kv_lora_rank), (B, L, qk_rope_head_dim) and (B, L)")
    valid = keras.backend.standardize_dtype(cache[2].dtype)
    if valid != "bool":
        raise TypeError(
            "`cache[2]` (valid) must be a boolean tensor (see `init_cache`). "
            f"Received: cache[2].dtype={valid}"
        )
