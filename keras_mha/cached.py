"""`keras_mha.CachedMultiHeadAttention`: keras-hub's cached layer, our paths.

A drop-in for `keras_hub.layers.CachedMultiHeadAttention`: the same call,
cache layout `(B, 2, S, K, H)` and results, computed by projecting with the
layer's weights, describing the call as an `AttentionSpec` and handing it to
`keras_mha.attention` (`attend`, or `attend_cached`, the one cached call of
every layer, for a step that writes the cache), so every feature of
`MultiHeadAttention` works here too. The layer adapts keras-hub's call and
cache layout only: which route and which path run is the dispatch rule's.
"""

import keras
from keras import ops

from keras_mha import checks
from keras_mha import heads as heads_lib
from keras_mha import hooks
from keras_mha import projections
from keras_mha import vllm
from keras_mha.attention import attend
from keras_mha.attention import attend_cached
from keras_mha.attention import cache as cache_lib
from keras_mha.attention import cache_layouts
from keras_mha.layer import MultiHeadAttention


@keras.saving.register_keras_serializable(package="keras_mha")
class CachedMultiHeadAttention(MultiHeadAttention):
    """`MultiHeadAttention` with keras-hub's key/value cache.

    A drop-in for `keras_hub.layers.CachedMultiHeadAttention` (keras-hub
    0.32; registered as `keras_mha>CachedMultiHeadAttention`): same call,
    same cache, same results, and
    `set_weights(keras_hub_layer.get_weights())` works both ways. The
    constructor, weights and config are those of `MultiHeadAttention`, so
    grouped heads, `sliding_window`, `rotary_embedding`, `scale`,
    `attn_logits_soft_cap`, `use_sinks`, `use_alibi`, `use_gate`, the
    query/key norms and the query temperature work with a cache too.

    A call runs in one of three modes:

    - no cache: attention of `query` over `key`/`value`;
    - `cache` with `cache_update_index=None`: attention over the cache as it
      is (`key` and `value` are not read), e.g. a cross-attention cache
      computed once;
    - `cache` with `cache_update_index=i`: the `L` new keys and values are
      projected and written at slots `i .. i+L-1` (into a new cache, or in
      place into a cache of `init_cache(..., in_place=True)`, as
      `MultiHeadAttention.init_cache` says),
      and the queries attend over the updated cache, reading only the slots
      below `i + L`: a step's cost follows its position, not `S`. A
      cache of one block or less (the tuning table's `decode_block`) is
      read whole, as are returned scores and dropout
      (`dispatch.cache_route`).

    Positions: key slot `j` holds position `j`; queries sit at `i + t` with
    an index, at `t` otherwise. The causal mask is the caller's (as in
    keras-hub, through `attention_mask`); the sliding window, ALiBi and the
    rotary embedding read these positions. The rotary embedding turns
    queries at their positions and new keys at `i + l` before they are
    written, so the cache holds rotated keys.

    Differences from keras-hub's layer, on purpose:

    - with `cache_update_index=i`, slots at or after `i + L` (not written
      yet) are never attended; keras-hub attends to them (zeros, or stale
      values) wherever `attention_mask` allows. Its `TransformerDecoder`'s
      causal mask never allows them, so decoders agree.
    - a query row with no key to attend to gives a context of 0 (the output
      is the output bias); keras-hub's gives the mean of the values.
    - `sliding_window` and `use_gate` apply; keras-hub's `call` ignores
      both.
    - as in keras-hub, the Keras masks of the inputs are not read: padding
      goes into `attention_mask` (its `TransformerDecoder` merges them).
    - a float `attention_mask` means nonzero = may attend (docs/design.md);
      Keras's explicit path keeps values above 0.5.
    - an out-of-range `cache_update_index` is a `ValueError` in every eager
      call, a tensor one too, and writes nothing when traced; keras-hub's
      writes the clamped last slot on JAX and TensorFlow and raises torch's
      `IndexError`.
    - keras-hub's vLLM route is taken as keras-hub's layers take it (see
      `keras_mha.vllm`): while its serving context is active, the
      projected heads go to its paged attention, rotated at the context's
      positions; sinks, ALiBi, chunks, returned scores and cross-attention
      are refused there by name.

    The constructor's arguments are `MultiHeadAttention`'s. A cache stores
    keys and values in one tensor, so decoding with a cache needs
    `value_dim == key_dim`.

    Call arguments:
        query: `(B, T, E)` (or `(B, ..., E)` with `attention_axes`, without
            a cache).
        value: `(B, L, E_v)`: the keys' and values' inputs; with a cache and
            an index, the `L` new tokens (`L` need not be `T`).
        key: `(B, L, E_k)`; `value` if `None`.
        attention_mask: boolean, integer or float, nonzero = may attend,
            broadcastable to `(B, T, S)`: `(T, S)`, `(B|1, T|1, S)` or
            `(B|1, N|1, T, S)`. `S` is the keys' length, or the cache's
            `S` with a cache.
        cache: `None`, or `(B, 2, S, K, H)` floats: keys at `[:, 0]`, values
            at `[:, 1]` (see `init_cache`); or such a tensor in an
            `InPlacePairCache` (`init_cache(..., in_place=True)`).
        cache_update_index: `None`, or an int or scalar integer tensor: the
            slot where the new keys and values are written. Only with a
            cache.
        return_attention_scores: also return the attention weights.
        training: whether dropout is applied.
        mask_mod, score_mod: a mask and a score function, as
            `MultiHeadAttention` takes them, at the positions above
            (keras-hub's layer has neither).

    Returns:
        As keras-hub's layer does, `output` `(B, T, E)` (or `output_shape`);
        `(output, scores)` with `return_attention_scores`;
        `(output, cache)` with a cache; `(output, scores, cache)` with both.
        Scores are `(B, N, T, S)`; the cache is the updated one (the one
        given when `cache_update_index=None`).
    """

    takes_shared_key_value = False  # keras-hub's call

    def call(
        self,
        query,
        value,
        key=None,
        attention_mask=None,
        cache=None,
        cache_update_index=None,
        return_attention_scores=False,
        training=None,
        mask_mod=None,
        score_mod=None,
    ):
        if key is None:
            key = value
        serving = vllm.serving_context()
        if serving is not None:  # keras-hub's vLLM route
            return vllm.paged_attention(
                self, query, value, key, cache, serving,
                return_attention_scores,
                programmed=mask_mod is not None or score_mod is not None)
        given, cache = cache, cache_lib.pair_tensor(cache)  # the tensor
        _check_call(
            self, query, value, key, attention_mask, cache,
            cache_update_index, return_attention_scores, mask_mod=mask_mod,
            score_mod=score_mod,
        )
        layout = self._layout
        query, value, key = projections.normalized_inputs(self, query, value,
                                                          key)
        gate = self._gate_dense(query) if self._use_gate else None
        q = layout.to_sequence(self._query_dense(query))  # (B', T, N, H)
        offset = 0 if cache_update_index is None else cache_update_index
        q = heads_lib.queries(self, q, offset)  # norms, RoPE, temperature
        if cache is None or cache_update_index is not None:
            k = layout.to_sequence(self._key_dense(key))  # (B', L, K, H)
            v = layout.to_sequence(self._value_dense(value))  # (B', L, K, V)
            k = heads_lib.keys(self, k, offset)
            v = heads_lib.values(self, v)
        spec = self._describe(query, key, attention_mask, training,
                              return_attention_scores, mask_mod=mask_mod,
                              score_mod=score_mod)
        if cache is None:
            context, scores = attend(q, k, v, spec)  # (B', T, N, V)
            if return_attention_scores:
                scores = layout.scores_from_sequence(scores, query, key)
        elif cache_update_index is None:  # the cache as it is
            # A cache is read whole on one device (no `sharding`).
            k = ops.cast(cache[:, 0], q.dtype)  # (B, S, K, H)
            v = ops.cast(cache[:, 1], q.dtype)  # (B, S, K, V)
            context, scores = attend(q, k, v, spec.replace(sharding=None))
        else:  # the one cached call, in keras-hub's layout
            context, scores, given = attend_cached(
                q, k, v, spec.replace(sharding=None), given,
                cache_update_index, rolling=False, layout=cache_layouts.PAIR,
            )
        return self._project_back(
            context, gate, query,
            scores if return_attention_scores else None, given,
        )

    def compute_output_spec(self, *args, **kwargs):
        call = hooks.call_arguments(CachedMultiHeadAttention.call,
                                    _check_call, self, args, kwargs)
        query, value, cache = call["query"], call["value"], call["cache"]
        key = value if call["key"] is None else call["key"]
        query_shape, key_shape = tuple(query.shape), tuple(key.shape)
        output = keras.KerasTensor(
            self.compute_output_shape(query_shape, tuple(value.shape),
                                      key_shape),
            dtype=self.compute_dtype,
        )
        scores = None
        if call["return_attention_scores"]:
            if cache is None:
                layout = checks.input_shapes(
                    query_shape, tuple(value.shape), key_shape,
                    self._attention_axes,
                )
                shape = layout.scores_shape(
                    query_shape, key_shape, self._num_heads
                )
            else:
                shape = (query_shape[0], self._num_heads, query_shape[1],
                         cache.shape[2])
            scores = keras.KerasTensor(shape, dtype=self.compute_dtype)
        if cache is not None:
            cache = keras.KerasTensor(cache.shape, dtype=cache.dtype)
        return hooks.results(output, scores, cache)

    # ------------------------------------------------------------------ cache

    @property
    def rolling_cache(self):
        """Always `False`: keras-hub's cache has a slot per position."""
        return False

    def init_cache(self, batch_size, max_length, in_place=False):
        """A zero cache for decoding up to `max_length` tokens.

        Args:
            batch_size: `B`.
            max_length: `S`, the number of slots.
            in_place: whether calls may write into this cache's tensor,
                as `MultiHeadAttention.init_cache` describes. `False` (the
                default), or a cache made by `ops.zeros` as keras-hub's
                users do: each call returns a new tensor and leaves the
                one given unchanged, as keras-hub's layer does (an eager
                step copies the cache, O(S)).

        Returns:
            A `(B, 2, S, K, H)` tensor of zeros in the compute dtype, the
            layout of keras-hub's cache; with `in_place=True` (on a backend
            with an in-place write), that tensor in a
            `keras_mha.attention.cache.InPlacePairCache`, the value that
            says the layer may write it, which each call returns in turn
            (`cache.keys_and_values` is the tensor).
        """
        slots = checks.cache_slots(self, batch_size, max_length, in_place)
        _check_cache_heads(self)
        shape = (batch_size, 2, slots, self._num_key_value_heads,
                 self._key_dim)
        cache = ops.zeros(shape, dtype=self.compute_dtype)
        return cache_lib.mark_in_place(cache) if in_place else cache


def _check_cache_heads(layer):
    if layer.settings.value_dim != layer.settings.key_dim:
        raise ValueError(
            "A cache `(B, 2, S, K, H)` holds keys and values in one tensor: "
            "it needs `value_dim == key_dim`. Received: "
            f"key_dim={layer.settings.key_dim}, "
            f"value_dim={layer.settings.value_dim}"
        )


def _check_call(
    layer, query, value, key, attention_mask, cache, cache_update_index,
    return_attention_scores, training=None, mask_mod=None, score_mod=None,
):
    """Checks a call from shapes and dtypes alone (eager and symbolic).

    Takes every argument of the call; `training` needs no check.
    """
    key = value if key is None else key
    shapes, layout = checks.built_inputs(layer, query, value, key)
    checks.scores_and_flash(layer, return_attention_scores)
    checks.programs(mask_mod, score_mod, layout,
                    layer.settings.attention_axes)
    key_shape = shapes["key"]
    if cache is None:
        if cache_update_index is not None:
            raise ValueError(
                "`cache_update_index` should not be set if `cache` is "
                "`None`. Received: cache=None, "
                f"cache_update_index={cache_update_index!r}"
            )
    else:
        _check_cache(layer, layout, shapes, cache)
        if cache_update_index is not None:
            checks.cache_index(cache_update_index, key_shape[1],
                               cache.shape[2], rolling=False)
        key_shape = (shapes["query"][0], cache.shape[2], key_shape[-1])
    if attention_mask is not None:
        checks.mask_argument(
            "attention_mask",
            attention_mask,
            layout.attention_mask_targets(
                shapes["query"], key_shape, layer.settings.num_heads
            ),
        )


def _check_cache(layer, layout, shapes, cache):
    if not layout.identity:
        raise ValueError(
            "A cache needs inputs of rank 3 (batch, sequence, features). "
            f"Received: query.shape={shapes['query']}"
        )
    checks.cache_tensor(cache)
    _check_cache_heads(layer)
    expected = (
        shapes["query"][0], 2, None, layer.settings.num_key_value_heads,
        layer.settings.key_dim,
    )
    shape = tuple(cache.shape)
    if len(shape) != 5 or not checks.dims_agree(shape, expected):
        raise ValueError(
            "`cache` must have shape (B, 2, S, K, H) = "
            f"{expected} (keys at [:, 0], values at [:, 1]; see "
            f"`init_cache`). Received: cache.shape={shape}"
        )

