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

import inspect

from keras_mha.hub_gemma import Gemma3nHubAttention
from keras_mha.hub_gemma import Gemma4HubAttention
from keras_mha.hub_layer import CausalMask
from keras_mha.hub_layer import HubAttention
from keras_mha.hub_readers import READERS


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


# The layers `adopt` builds, by `Reading.layer`.
LAYERS = {"HubAttention": HubAttention,
          "Gemma3nHubAttention": Gemma3nHubAttention,
          "Gemma4HubAttention": Gemma4HubAttention}


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
