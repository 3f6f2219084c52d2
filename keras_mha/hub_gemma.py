"""Gemma 3n's and Gemma 4's layers on this library's attention: keras-hub's
calls and caches (`Gemma3nTextAttention`, `Gemma4TextAttention`), and
their last layers, which read the keys and values of an earlier layer
(`keras_mha.sharing`).

Nothing here imports keras-hub.
"""

import keras
from keras import ops

from keras_mha.hub_layer import HubAttention
from keras_mha.hub_layer import mask_arguments
from keras_mha.hub_layer import slot_flags
from keras_mha.layer import MultiHeadAttention


class _SharingHubAttention(HubAttention):
    """What Gemma 3n's and Gemma 4's calls share: a call without a cache
    returns its own keys and values, and a layer built with
    `shared_key_value=True` reads an earlier layer's."""

    takes_shared_key_value = True

    def _own(self, hidden_states, mask):
        """`(output, keys, values)` of a call without a cache, the keys and
        values `(B, T, K, H)`."""
        output, (keys, values) = MultiHeadAttention.call(
            self, hidden_states, hidden_states, return_key_value=True,
            **mask)
        return output, keys, values

    def _read_shared(self, hidden_states, mask, keys, values, index,
                     whole):
        """The output over an earlier layer's `keys` and `values` `(B, S,
        K, H)`: a whole sequence's (`whole`), or a cache's slots up to the
        call's position `index + t`, which the dense mask's flags
        (`hub_layer.slot_flags`) mark."""
        if whole:
            return MultiHeadAttention.call(
                self, hidden_states, shared_key_value=(keys, values), **mask)
        valid = slot_flags(mask["attention_mask"], keys)
        mask = dict(mask, attention_mask=None, use_causal_mask=True)
        return MultiHeadAttention.call(
            self, hidden_states, shared_key_value=(keys, values, valid),
            cache_update_index=index, **mask)


@keras.saving.register_keras_serializable(package="keras_mha")
class Gemma3nHubAttention(_SharingHubAttention):
    """Gemma 3n's attention (`Gemma3nTextAttention`), computed by this
    library: `HubAttention` with Gemma 3n's call and cache.

    A call returns `(output, None, cache)`, as keras-hub's returns its
    weights in the middle (not computed here), and its cache `(B, 2, K, S,
    H)` holds the heads before the slots. Without a cache the cache
    returned is this call's keys and values, which the layers that share
    them read. A layer built with `shared_key_value=True` (keras-hub's
    `is_kv_shared_layer`) is handed the earlier layer's cache as its own
    and returns it as it is: the keys and values of a whole sequence (a
    cache of the sequence's length at index 0, as in training) with the
    block's `CausalMask`, or the slots a cached call reads up to its
    position (`MultiHeadAttention`'s `shared_key_value`).
    """

    def call(self, hidden_states, attention_mask=None, cache=None,
             cache_update_index=0, cache_update_mask=None, training=None,
             causal=False, key_mask=None):
        mask = mask_arguments(attention_mask, causal, key_mask, training)
        if self.settings.shared_key_value:
            keys, values = (_slots_first(cache[:, i]) for i in (0, 1))
            return self._read_shared(hidden_states, mask, keys, values,
                                     cache_update_index, whole=causal), \
                None, cache
        if cache is None:
            output, keys, values = self._own(hidden_states, mask)
            return output, None, ops.stack(
                (_slots_first(keys), _slots_first(values)), axis=1)
        output, new = self._write_and_attend(
            hidden_states, attention_mask,
            ops.transpose(cache, (0, 1, 3, 2, 4)),  # (B, 2, S, K, H)
            cache_update_index, cache_update_mask, training)
        return output, None, ops.transpose(new, (0, 1, 3, 2, 4))

    def compute_output_spec(self, hidden_states, attention_mask=None,
                            cache=None, *args, **kwargs):
        output = keras.KerasTensor(hidden_states.shape,
                                   dtype=self.compute_dtype)
        if cache is None:
            settings = self.settings
            cache = (hidden_states.shape[0], 2,
                     settings.num_key_value_heads, hidden_states.shape[1],
                     settings.key_dim)
        else:
            cache = cache.shape
        return output, None, keras.KerasTensor(cache,
                                               dtype=self.compute_dtype)



@keras.saving.register_keras_serializable(package="keras_mha")
class Gemma4HubAttention(_SharingHubAttention):
    """Gemma 4's attention (`Gemma4TextAttention`), computed by this
    library: `HubAttention` with Gemma 4's call and cache.

    A call returns `(output, cache)`. The model's cache is sized for its
    widest layer, `(B, 2, S, K', H')`: a layer reads and writes its own
    corner, `[..., :K, :H]`, and a call without a cache returns its own
    keys and values `(B, 2, T, K, H)`. Tokens turn at the block's
    `positions` where given (`hub_views.HalvesRotation.at`), else at their
    indices. A layer built with `shared_key_value=True` (keras-hub's
    `is_kv_shared_layer`) reads `shared_kv`, the earlier layer's keys and
    values: a whole sequence's without a cache, else the slots up to the
    call's position, and returns its own cache as it is. The block applies
    the window to its dense mask through `_mask_sliding_window`, which here
    leaves the mask as it is: the layer applies its own window.
    """

    def call(self, hidden_states, attention_mask=None, cache=None,
             cache_update_index=0, cache_update_mask=None, shared_kv=None,
             training=None, positions=None, causal=False, key_mask=None):
        mask = mask_arguments(attention_mask, causal, key_mask, training)
        with self.settings.rotary_embedding.at(positions):
            if self.settings.shared_key_value:
                return self._shared(hidden_states, mask, cache,
                                    cache_update_index, shared_kv)
            if cache is None:
                output, keys, values = self._own(hidden_states, mask)
                return output, ops.stack((keys, values), axis=1)
            output, new = self._write_and_attend(
                hidden_states, attention_mask, self._corner(cache),
                cache_update_index, cache_update_mask, training)
        if tuple(new.shape) != tuple(cache.shape):
            new = ops.slice_update(cache, (0,) * len(cache.shape), new)
        return output, new

    def _shared(self, hidden_states, mask, cache, index, shared_kv):
        if shared_kv is None:
            raise ValueError(
                f"The swapped Gemma 4 layer {self.name!r} reads an earlier "
                "layer's keys and values, and its block handed none. "
                "Received: shared_kv=None")
        keys, values = (self._corner(shared_kv[:, i]) for i in (0, 1))
        output = self._read_shared(hidden_states, mask, keys, values, index,
                                   whole=cache is None)
        if cache is None:  # a whole sequence's: returned as its cache
            return output, ops.stack((keys, values), axis=1)
        return output, cache

    def _corner(self, x):
        """This layer's heads and features of a cache sized for the
        model's widest layer."""
        settings = self.settings
        return x[..., :settings.num_key_value_heads, :settings.key_dim]

    def _mask_sliding_window(self, attention_mask, cache_update_index=0):
        """keras-hub's block asks its attention layer to window its dense
        mask; the layer applies its own window, so the mask stays."""
        return attention_mask

    def compute_output_shape(self, input_shape, *args, **kwargs):
        settings = self.settings
        return tuple(input_shape), (input_shape[0], 2, input_shape[1],
                                    settings.num_key_value_heads,
                                    settings.key_dim)

    def compute_output_spec(self, hidden_states, attention_mask=None,
                            cache=None, *args, **kwargs):
        output, shape = self.compute_output_shape(hidden_states.shape)
        if cache is not None:
            shape = cache.shape
        return (keras.KerasTensor(output, dtype=self.compute_dtype),
                keras.KerasTensor(shape, dtype=self.compute_dtype))


def _slots_first(x):
    """`(B, S, K, H)` <-> `(B, K, S, H)`."""
    return ops.transpose(x, (0, 2, 1, 3))
