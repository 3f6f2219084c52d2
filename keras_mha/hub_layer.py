"""The layer `adopt` puts in keras-hub's decoder blocks: `HubAttention`,
keras-hub's per-model call computed by this library, and the `CausalMask`
a swapped block hands it instead of a dense mask.

Nothing here imports keras-hub.
"""

import dataclasses

import keras
from keras import ops

from keras_mha import vllm
from keras_mha.cached import CachedMultiHeadAttention
from keras_mha.hub_readers import PROJECTIONS
from keras_mha.hub_views import HeadsOfDense
from keras_mha.hub_views import HeadsOfFused
from keras_mha.layer import MultiHeadAttention


@keras.saving.register_keras_serializable(package="keras_mha")
class HubAttention(CachedMultiHeadAttention):
    """A keras-hub decoder block's attention, computed by this library.

    `CachedMultiHeadAttention` with the call of keras-hub's per-model
    attention layers (`LlamaAttention`, `CachedGemmaAttention`, ...):
    self-attention of `hidden_states` `(B, T, E)`, keras-hub's cache `(B,
    2, S, K, H)`, and the same results. `adopt` builds it; the constructor
    and config are `MultiHeadAttention`'s, and `always_return_cache`:
    whether a call without a cache returns `(output, None)`, as GPT-NeoX's
    layer does.

    Call arguments:
        hidden_states: `(B, T, E)`.
        attention_mask: as for `CachedMultiHeadAttention`: the block's
            causal (and window, and padding) mask, `(B, T, S)`.
        cache: `None`, `(B, 2, S, K, H)`, or Gemma 3's pair of `(B, S, K,
            H)` keys and values (returned as a pair).
        cache_update_index: with `cache`, the slot of the first new token.
        cache_update_mask: Gemma 3's `(B, T)`: where false, a slot keeps
            what it held.
        training: whether dropout is applied.
        causal, key_mask: what a swapped block's `CausalMask` stands for,
            set by `__call__`: causal self-attention over the keys that
            `key_mask` `(B, S)` keeps.
        position_ids: Qwen3.5's M-RoPE positions: `None`; others are
            refused (the layer rotates each token at its index).

    Returns:
        `output` `(B, T, E)`, or `(output, cache)` with a cache.
    """

    _hidden = frozenset()  # public names keras-hub's layer did not use

    def __init__(self, *args, always_return_cache=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.always_return_cache = bool(always_return_cache)

    def get_config(self):
        return {**super().get_config(),
                "always_return_cache": self.always_return_cache}

    def __dir__(self):
        # Keras saves a sublayer under the first attribute naming it,
        # public names before private ones; the layer presents its
        # sublayers under keras-hub's names only, so a saved model's
        # weights sit at keras-hub's paths (see `_present_as`).
        return [n for n in super().__dir__() if n not in self._hidden]

    def take_over(self, attention, reading):
        """Builds the layer on keras-hub's `attention`'s own sublayers
        (`reading.sublayers`, used as they are, not copied) and presents
        them under `attention`'s names (`adopt`)."""
        self._adopted.update(
            {ours: sublayer for ours, (_, sublayer) in reading.sublayers.items()
             if ours != "rotary_embedding"})  # that one is an argument
        for theirs, sublayer in reading.passengers.items():
            setattr(self, theirs, sublayer)  # tracked: held, never called
        shape = (None, None, reading.hidden_size)
        self.build(shape, shape)
        self._present_as(attention, reading.sublayers)

    def _present_as(self, attention, sublayers):
        """Names the taken-over sublayers as keras-hub's `attention` did,
        and hides this layer's public names for them that it lacks."""
        for ours, (theirs, sublayer) in sublayers.items():
            if isinstance(sublayer, (HeadsOfDense, HeadsOfFused)):
                held = getattr(self, theirs, None)
                if held is sublayer:  # our name too (BLOOM's output)
                    sublayer.saves_dense = True
                    continue
                if isinstance(held, HeadsOfFused):
                    continue  # Qwen3.5's gate: its query view holds the name
                sublayer = sublayer.dense  # keras-hub's own layer
            if not hasattr(type(self), theirs):
                object.__setattr__(self, theirs, sublayer)  # not tracked
        self._hidden = frozenset(
            f"{ours}_dense" if ours in PROJECTIONS else ours
            for ours in sublayers
        ) - {theirs for theirs, _ in sublayers.values()}
        if "sinks" in sublayers:  # keras-hub's layer held them itself
            self._hidden |= {"_sinks_layer"}

    def save_own_variables(self, store):
        # Where keras-hub's layer held its sinks itself (gpt-oss), they are
        # saved as its own weight, so the file is keras-hub's.
        if "_sinks_layer" in self._hidden:
            store["0"] = self.sinks
        else:
            super().save_own_variables(store)

    def load_own_variables(self, store):
        if "_sinks_layer" in self._hidden:
            self.sinks.assign(store["0"])
        else:
            super().load_own_variables(store)

    def __call__(self, *args, **kwargs):
        for theirs, ours in _CALL_NAMES.items():  # SmolLM3's, Falcon's
            if theirs in kwargs:
                kwargs[ours] = kwargs.pop(theirs)
        # Gemma 3n's block hands its mask by position.
        kwargs.update(zip(_POSITIONAL, args[1:]))
        args = args[:1]
        # Falcon's block hands its ALiBi terms over; the layer makes the
        # same (`use_alibi`, `alibi_before_scale`).
        kwargs.pop("alibi", None)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, CausalMask):  # from a swapped block
            kwargs.update(attention_mask=None, causal=True,
                          key_mask=mask.padding)
        return super().__call__(*args, **kwargs)

    def call(self, hidden_states, attention_mask=None, cache=None,
             cache_update_index=None, cache_update_mask=None, training=None,
             causal=False, key_mask=None, position_ids=None):
        _no_position_ids(position_ids)
        serving = vllm.serving_context()
        if serving is not None:  # keras-hub's vLLM route
            return vllm.paged_attention(self, hidden_states, hidden_states,
                                        hidden_states, cache, serving)
        if cache is None:  # Gemma's layers take an index without a cache
            cache_update_index = None
        if causal:  # a `CausalMask`: the layer's own paths, no dense mask
            return self._uncached(MultiHeadAttention.call(
                self, hidden_states, hidden_states,
                **mask_arguments(attention_mask, causal, key_mask, training)))
        if cache is None:
            return self._uncached(super().call(
                hidden_states, hidden_states, attention_mask=attention_mask,
                training=training))
        if isinstance(cache, (tuple, list)):  # Gemma 3's `(keys, values)`
            return self._write_pair(hidden_states, attention_mask, cache,
                                    cache_update_index, cache_update_mask,
                                    training)
        return self._write_and_attend(
            hidden_states, attention_mask, cache, cache_update_index,
            cache_update_mask, training)

    def _write_pair(self, hidden_states, attention_mask, cache, index,
                    update_mask, training):
        """Gemma 3's cache, keys and values `(B, S, K, H)` apart. A step of
        one token reads it as this library's cache `(keys, values,
        valid)`, its mask's one row the slots' flags, so no step stacks or
        splits it; a longer call (a prompt, whose mask may hold image
        blocks) stacks it into keras-hub's one tensor."""
        if index is None or hidden_states.shape[1] != 1 \
                or attention_mask is None:
            output, new = self._write_and_attend(
                hidden_states, attention_mask, ops.stack(cache, axis=1),
                index, update_mask, training)
            return output, (new[:, 0], new[:, 1])
        keys, values = cache
        valid = slot_flags(attention_mask, keys)
        output, (new_keys, new_values, _) = MultiHeadAttention.call(
            self, hidden_states, hidden_states, use_causal_mask=True,
            cache=(keys, values, valid), cache_update_index=index,
            training=training)
        if update_mask is not None:
            new_keys, new_values = (
                _keep_unmasked(old[:, None], new[:, None], update_mask,
                               index)[:, 0]
                for old, new in ((keys, new_keys), (values, new_values)))
        return output, (new_keys, new_values)

    def _write_and_attend(self, hidden_states, attention_mask, cache, index,
                          update_mask, training):
        """keras-hub's cached call over a cache `(B, 2, S, K, H)`: the new
        tokens written at slots `index ...` where `update_mask` allows (all
        where `None`; none with `index=None`, which reads the cache as it
        is), then attending over it. Returns `(output, new cache)`."""
        output, new = CachedMultiHeadAttention.call(
            self, hidden_states, hidden_states, attention_mask=attention_mask,
            cache=cache, cache_update_index=index, training=training)
        if update_mask is not None and index is not None:
            new = _keep_unmasked(cache, new, update_mask, index)
        return output, new

    def compute_output_spec(self, hidden_states, attention_mask=None,
                            cache=None, cache_update_index=None,
                            cache_update_mask=None, training=None,
                            causal=False, key_mask=None, position_ids=None):
        _no_position_ids(position_ids)
        if cache is None:
            cache_update_index = None
        pair = isinstance(cache, (tuple, list))
        if pair:
            keys = cache[0]
            cache = keras.KerasTensor(
                (keys.shape[0], 2, *keys.shape[1:]), dtype=keys.dtype)
        spec = super().compute_output_spec(
            hidden_states, hidden_states, attention_mask=attention_mask,
            cache=cache, cache_update_index=cache_update_index,
        )
        if cache is None:
            return self._uncached(spec)
        if not pair:
            return spec
        part = keras.KerasTensor(keys.shape, dtype=keys.dtype)
        return spec[0], (part, part)

    def _uncached(self, output):
        """A call's result without a cache: `output`, or `(output, None)`."""
        return (output, None) if self.always_return_cache else output


def _no_position_ids(position_ids):
    if position_ids is not None:
        raise ValueError(
            "A swapped Qwen3.5 block was given M-RoPE `position_ids` (images "
            "or video), which the layer does not read: it rotates each "
            "token at its index. Received: position_ids of shape "
            f"{tuple(position_ids.shape)}"
        )


# The call's arguments after `hidden_states`, in order.
_POSITIONAL = ("attention_mask", "cache", "cache_update_index",
               "cache_update_mask", "training")
# The call's arguments as some blocks name them (SmolLM3's cache,
# Falcon's `inputs`), and ours.
_CALL_NAMES = {"self_attention_cache": "cache",
               "self_attention_cache_update_index": "cache_update_index",
               "inputs": "hidden_states"}


@dataclasses.dataclass(frozen=True)
class CausalMask:
    """A swapped block's mask as structure: causal self-attention over the
    keys that `padding` `(B, S)` keeps (`None`: all), within the layer's
    own window."""

    padding: object = None


def mask_arguments(attention_mask, causal, key_mask, training):
    """`MultiHeadAttention.call`'s mask arguments for a block's mask: a
    `CausalMask`'s rule (`causal`, the padding `key_mask`), or the dense
    `attention_mask`."""
    return dict(attention_mask=None if causal else attention_mask,
                use_causal_mask=causal, key_mask=key_mask, training=training)


def slot_flags(attention_mask, keys):
    """The slots `(B, S)` of a cache `keys` `(B, S, K, H)` that a cached
    call reads: the last query's row of the block's dense mask (causal and
    padding: each earlier query's row is the same up to its position, which
    the layer applies; for one query, its whole mask), or every slot."""
    if attention_mask is None:
        return ops.ones(ops.shape(keys)[:2], "bool")
    return ops.cast(attention_mask[:, -1, :], "bool")


def _keep_unmasked(old, new, update_mask, index):
    """`new` `(B, 2, S, K, H)` where `update_mask` `(B, T)` allows the
    write at slots `index ...` and `old` elsewhere (Gemma 3's
    `cache_update_mask`: a prompt's slots, filled with bidirectional image
    attention at the prefill, stay as they are)."""
    slots = ops.shape(old)[2]
    keep = ops.ones((ops.shape(old)[0], slots), "bool")
    keep = ops.slice_update(keep, [0, index],
                            ops.cast(update_mask, "bool"))
    return ops.where(keep[:, None, :, None, None], new, old)
