"""keras-hub's causal LMs on this library's attention: `adopt(model)`.

Each decoder block of a keras-hub backbone holds its attention layer (under
`_self_attention_layer`, gpt-oss's `self_attention_layer`, or Gemma's
`attention`). `adopt` reads every block's layer (its heads, rotary
embedding, scale, norms, window, sinks and soft-cap, by the readers of
`hub_readers.READERS`, keyed by the attention class's name), builds a
`HubAttention` that takes over the layer's own projections (the same
`EinsumDense` objects: nothing is copied, and LoRA, int8 quantization and
layout maps act on them as before) and puts it in the block's place. The blocks call
it as they called keras-hub's layer, with keras-hub's cache layout, so
`generate`, `fit`, `predict` and the block's masks work unchanged.

Without a cache (training, scoring, `predict`), a swapped block does not
build its dense `(B, T, S)` mask: `adopt` wraps the block's mask method so
that it hands the layer a `CausalMask` (the padding, and the rule: causal)
instead, and the layer runs the path the rule allows: banded, O(T·w), for
a window. With a cache, or a mask of the caller's, the block's own method
runs and the layer takes its dense mask.

Nothing here imports keras-hub: a model comes from it or is refused.
"""

import dataclasses
import inspect

import keras
from keras import ops

from keras_mha import vllm
from keras_mha.cached import CachedMultiHeadAttention
from keras_mha.hub_readers import PROJECTIONS
from keras_mha.hub_readers import READERS
from keras_mha.hub_readers import HeadsOfDense
from keras_mha.hub_readers import HeadsOfFused
from keras_mha.hub_readers import RotationFromTables  # noqa: F401 (docs)
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
                self, hidden_states, hidden_states, training=training,
                key_mask=key_mask, use_causal_mask=True))
        pair = isinstance(cache, (tuple, list))  # Gemma 3's `(keys, values)`
        given = ops.stack(cache, axis=1) if pair else cache
        results = super().call(
            hidden_states, hidden_states, attention_mask=attention_mask,
            cache=given, cache_update_index=cache_update_index,
            training=training,
        )
        if cache is None:
            return self._uncached(results)
        output, new = results
        if cache_update_mask is not None and cache_update_index is not None:
            new = _keep_unmasked(given, new, cache_update_mask,
                                 cache_update_index)
        return output, ((new[:, 0], new[:, 1]) if pair else new)

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


@keras.saving.register_keras_serializable(package="keras_mha")
class Gemma3nHubAttention(HubAttention):
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

    takes_shared_key_value = True

    def call(self, hidden_states, attention_mask=None, cache=None,
             cache_update_index=0, cache_update_mask=None, training=None,
             causal=False, key_mask=None):
        mask = dict(attention_mask=None if causal else attention_mask,
                    use_causal_mask=causal, key_mask=key_mask,
                    training=training)
        if self.settings.shared_key_value:
            keys, values = (_slots_first(cache[:, i]) for i in (0, 1))
            if causal:  # the whole sequence's keys and values
                shared = dict(shared_key_value=(keys, values))
            else:  # slots written up to the call's position
                valid = _valid_slots(attention_mask, keys)
                shared = dict(shared_key_value=(keys, values, valid),
                              cache_update_index=cache_update_index)
                mask.update(attention_mask=None, use_causal_mask=True)
            return MultiHeadAttention.call(
                self, hidden_states, **mask, **shared), None, cache
        if cache is None:
            output, (keys, values) = MultiHeadAttention.call(
                self, hidden_states, hidden_states, return_key_value=True,
                **mask)
            return output, None, ops.stack(
                (_slots_first(keys), _slots_first(values)), axis=1)
        given = ops.transpose(cache, (0, 1, 3, 2, 4))  # (B, 2, S, K, H)
        output, new = CachedMultiHeadAttention.call(
            self, hidden_states, hidden_states,
            attention_mask=attention_mask, cache=given,
            cache_update_index=cache_update_index, training=training)
        if cache_update_mask is not None:
            new = _keep_unmasked(given, new, cache_update_mask,
                                 cache_update_index)
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


def _valid_slots(attention_mask, keys):
    """The slots `(B, S)` a shared layer's cached call reads: the last
    query's row of the block's mask (causal and padding: each earlier
    query's row is the same up to its position, which the layer applies),
    or every slot."""
    if attention_mask is None:
        return ops.ones(ops.shape(keys)[:2], "bool")
    return ops.cast(attention_mask[:, -1, :], "bool")


def _slots_first(x):
    """`(B, S, K, H)` <-> `(B, K, S, H)`."""
    return ops.transpose(x, (0, 2, 1, 3))


# The layers `adopt` builds, by `Reading.layer`.
LAYERS = {"HubAttention": HubAttention,
          "Gemma3nHubAttention": Gemma3nHubAttention}


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


def _structural(method, whole_cache=False):
    """The block's mask `method`, returning a `CausalMask` when the call has
    no cache and no mask of the caller's; the dense mask otherwise. With
    `whole_cache` (a block whose layer reads an earlier layer's keys and
    values as its cache, Gemma 3n's), a cache `(B, 2, K, S, H)` of the
    sequence's own length at index 0 is a whole sequence's keys and values
    (training, a first prompt), and counts as none."""
    signature = inspect.signature(method)

    sequence = next(iter(signature.parameters))

    def compute_mask(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        if whole_cache and _whole_sequence(bound, sequence):
            bound = {**bound, "cache": None}
        padding = next((v for k, v in bound.items() if "padding_mask" in k),
                       None)
        # A cache, a mask of the caller's, Gemma 3's vision mask.
        given = any(v is not None for k, v in bound.items()
                    if k != sequence and "padding_mask" not in k
                    and "index" not in k)
        return method(*args, **kwargs) if given else CausalMask(padding)

    return compute_mask


def _whole_sequence(bound, sequence):
    cache = bound.get("cache")
    index = bound.get("cache_update_index", 0)
    length = bound[sequence].shape[1]
    return (cache is not None and isinstance(index, int) and index == 0
            and length is not None and cache.shape[3] == length)


# The block methods that build a decoder block's dense mask.
_MASK_METHODS = ("_compute_self_attention_mask", "_compute_attention_mask")


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


# The attribute under which a family's decoder block holds its attention.
_BLOCK_ATTRIBUTES = ("_self_attention_layer", "self_attention_layer",
                     "self_attn", "attention", "attention_layer")
# The attribute under which a hybrid family's block holds linear attention
# (Qwen3.5's `GatedDeltaNet`), which `adopt` leaves as it is.
_LINEAR_ATTRIBUTES = ("_linear_attn",)


def adopt(model):
    """Puts this library's attention in every decoder block of a keras-hub
    model, in place, and returns the model.

    Args:
        model: a keras-hub `CausalLM` (its `backbone`'s blocks are swapped)
            or `Backbone`.

    Returns:
        `model`, whose blocks now hold `HubAttention` layers computing what
        keras-hub's did, on the same weight variables. A model adopted
        already is returned as it is.

    Raises:
        ValueError: for a model that is not a keras-hub backbone or causal
            LM, or a block whose attention has no reader (named with its
            class); the model is then left unchanged.
    """
    backbone = getattr(model, "backbone", model)
    blocks = getattr(getattr(backbone, "language_model", backbone),
                     "transformer_layers", None)  # Gemma 3n's text model
    if not _from_keras_hub(backbone) or not blocks:
        raise ValueError(
            "`adopt` takes a keras-hub `CausalLM` or `Backbone` with "
            "decoder blocks (`backbone.transformer_layers`). Received: "
            f"model of type {type(model).__name__}"
        )
    plan, last_of_kind = [], {}
    for index, block in enumerate(blocks):
        attribute = next((a for a in _BLOCK_ATTRIBUTES
                          if getattr(block, a, None) is not None), None)
        if attribute is None and any(getattr(block, a, None) is not None
                                     for a in _LINEAR_ATTRIBUTES):
            continue  # linear attention, not softmax: left as it is
        attention = getattr(block, attribute or _BLOCK_ATTRIBUTES[0], None)
        if isinstance(attention, HubAttention):
            continue  # adopted already
        reader = _reader(attention)
        if reader is None:
            raise ValueError(
                f"`adopt` has no reader for the {type(attention).__name__} "
                f"of {type(backbone).__name__}'s `{block.name}`: its "
                "attention is not one `adopt` knows. Received: "
                f"{attribute}={type(attention).__name__}"
            )
        reading = reader(attention, type(attention).__name__)
        _route_shared(reading, index, last_of_kind)
        plan.append((block, attribute, attention, reading))
    for block, *rest in plan:  # every block read: now swap
        _swap(block, *rest)
    return model


def _from_keras_hub(obj):
    return any(cls.__module__.startswith("keras_hub.")
               for cls in type(obj).__mro__)


def _reader(attention):
    for cls in type(attention).__mro__:
        if cls.__name__ in READERS:
            return READERS[cls.__name__]
    return None


def _route_shared(reading, index, last_of_kind):
    """Sets a shared layer's `key_value_source`: the last earlier block of
    its kind (its window), as Gemma 3n's model routes caches."""
    kind = reading.kwargs.get("sliding_window")
    if reading.kwargs.get("shared_key_value"):
        reading.kwargs["key_value_source"] = last_of_kind.get(kind)
    else:
        last_of_kind[kind] = index


def _swap(block, attribute, attention, reading):
    layer = LAYERS[reading.layer](**reading.kwargs, name=attention.name,
                                  dtype=attention.dtype_policy)
    layer.take_over(attention, reading)
    _replace_sublayer(block, attribute, attention, layer)
    for name in _MASK_METHODS:
        if hasattr(block, name):
            object.__setattr__(block, name, _structural(
                getattr(block, name),
                whole_cache=reading.kwargs.get("shared_key_value", False)))
            break


def _replace_sublayer(block, attribute, old, new):
    """Puts `new` in `block`'s `attribute`, where `old` was. Keras's
    tracker (`Layer._tracker`, `Layer._layers`) must forget `old`, or its
    weights count twice, and a built block's state is locked: Keras has no
    public way to replace a tracked sublayer."""
    tracker = block._tracker
    locked = tracker.locked
    tracker.unlock()
    block._layers.remove(old)
    tracker.stored_ids["layers"].discard(id(old))
    setattr(block, attribute, new)
    if locked:
        tracker.lock()
