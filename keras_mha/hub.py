"""keras-hub's causal LMs on this library's attention: `adopt(model)`.

Each decoder block of a keras-hub backbone holds its attention layer under
`_self_attention_layer`. `adopt` reads every block's layer (its heads,
rotary embedding, scale, norms, window and soft-cap, by the readers of
`READERS`, keyed by the attention class's name), builds a `HubAttention`
that takes over the layer's own projections (the same `EinsumDense`
objects: nothing is copied, and LoRA, int8 quantization and layout maps
act on them as before) and puts it in the block's place. The blocks call
it as they called keras-hub's layer, with keras-hub's cache layout, so
`generate`, `fit`, `predict` and the block's masks work unchanged.

Nothing here imports keras-hub: a model comes from it or is refused.
"""

import dataclasses

import keras

from keras_mha.cached import CachedMultiHeadAttention

@keras.saving.register_keras_serializable(package="keras_mha")
class HubAttention(CachedMultiHeadAttention):
    """A keras-hub decoder block's attention, computed by this library.

    `CachedMultiHeadAttention` with the call of keras-hub's per-model
    attention layers (`LlamaAttention`, `CachedGemmaAttention`, ...):
    self-attention of `hidden_states` `(B, T, E)`, keras-hub's cache `(B,
    2, S, K, H)`, and the same results. `adopt` builds it; the constructor
    and config are `MultiHeadAttention`'s.

    Call arguments:
        hidden_states: `(B, T, E)`.
        attention_mask: as for `CachedMultiHeadAttention`: the block's
            causal (and window, and padding) mask, `(B, T, S)`.
        cache: `None` or `(B, 2, S, K, H)`.
        cache_update_index: with `cache`, the slot of the first new token.
        training: whether dropout is applied.

    Returns:
        `output` `(B, T, E)`, or `(output, cache)` with a cache.
    """

    _hidden = frozenset()  # public names keras-hub's layer did not use

    def __dir__(self):
        # Keras saves a sublayer under the first attribute naming it,
        # public names before private ones; the layer presents its
        # sublayers under keras-hub's names only, so a saved model's
        # weights sit at keras-hub's paths (see `_present_as`).
        return [n for n in super().__dir__() if n not in self._hidden]

    def _present_as(self, attention, sublayers):
        """Names the taken-over sublayers as keras-hub's `attention` did,
        and hides this layer's public names for them that it lacks."""
        for ours, (theirs, sublayer) in sublayers.items():
            if not hasattr(type(self), theirs):
                object.__setattr__(self, theirs, sublayer)  # not tracked
        self._hidden = frozenset(
            f"{ours}_dense" if ours in _PROJECTIONS else ours
            for ours in sublayers
        ) - {theirs for theirs, _ in sublayers.values()}

    def call(self, hidden_states, attention_mask=None, cache=None,
             cache_update_index=None, training=None):
        if cache is None:  # Gemma's layers take an index without a cache
            cache_update_index = None
        return super().call(
            hidden_states, hidden_states, attention_mask=attention_mask,
            cache=cache, cache_update_index=cache_update_index,
            training=training,
        )

    def compute_output_spec(self, hidden_states, attention_mask=None,
                            cache=None, cache_update_index=None,
                            training=None):
        if cache is None:
            cache_update_index = None
        return super().compute_output_spec(
            hidden_states, hidden_states, attention_mask=attention_mask,
            cache=cache, cache_update_index=cache_update_index,
        )


@dataclasses.dataclass
class Reading:
    """What a reader finds in a keras-hub attention layer.

    Attributes:
        kwargs: `HubAttention`'s constructor arguments.
        hidden_size: `E`.
        sublayers: `{our name: (keras-hub's attribute, layer)}`: the built
            projections (`query`, `key`, `value`, `output`), query/key
            norms (`query_norm`, `key_norm`) and the `rotary_embedding`,
            taken over as they are.
    """

    kwargs: dict
    hidden_size: int
    sublayers: dict


def _sublayers(attention, **names):
    """`{our name: (attribute, layer)}` for the first of each name's
    keras-hub attributes that the layer has (keras-hub names them
    `_query_dense` in one family, `query_dense` in another)."""
    found = {}
    for ours, candidates in names.items():
        for attribute in candidates:
            if getattr(attention, attribute, None) is not None:
                found[ours] = (attribute, getattr(attention, attribute))
                break
    return found


def _dense(name):
    return (f"_{name}_dense", f"{name}_dense")


_PROJECTIONS = dict(query=_dense("query"), key=_dense("key"),
                    value=_dense("value"), output=_dense("output"))


def _no_dropout(attention, name):
    rate = float(getattr(attention, "dropout", 0.0) or 0.0)
    if rate:
        raise ValueError(
            f"The {name} drops its attention's output at rate {rate}, and "
            "the layer drops attention weights: set the model's dropout "
            f"to 0 before `adopt`. Received: dropout={rate}"
        )


def _llama(attention, name):
    """Llama, Llama 3, Mistral, Mixtral, Qwen (2, MoE, 3, 3-MoE), Phi-3:
    projections `(E, N, H)` (Qwen's with biases), keras-hub's rotary
    layer, `1 / sqrt(H)`; Qwen 3's per-head norms `x·w`; the block builds
    the causal (and Mistral's window) mask, Qwen's layers apply their own
    window."""
    _no_dropout(attention, name)
    sublayers = _sublayers(
        attention, **_PROJECTIONS,
        query_norm=("_query_dense_layer_norm",),
        key_norm=("_key_dense_layer_norm",))
    sublayers["rotary_embedding"] = ("rotary_embedding_layer",
                                     attention.rotary_embedding_layer)
    query = sublayers["query"][1]
    hidden_size, num_heads, head_dim = query.kernel.shape
    window = None
    if getattr(attention, "use_sliding_window_attention", True):
        window = getattr(attention, "sliding_window_size", None)
    kwargs = dict(
        num_heads=int(num_heads), key_dim=int(head_dim),
        num_key_value_heads=int(sublayers["key"][1].kernel.shape[1]),
        use_bias=query.bias is not None,
        rotary_embedding=attention.rotary_embedding_layer,
        scale=float(attention._inv_norm_factor),
        sliding_window=None if window is None else int(window),
    )
    if "query_norm" in sublayers:
        kwargs.update(qk_norm="rms",
                      qk_norm_epsilon=float(sublayers["query_norm"][1].epsilon))
    return Reading(kwargs, int(hidden_size), sublayers)


def _gemma(attention, name):
    """Gemma and Gemma 2: projections `(N, E, H)`, a rotary layer whose
    output keras-hub reorders (the same for queries and keys, so no
    product changes), `1 / sqrt(H)` or `1 / sqrt(E / N)`, the soft-cap and
    the layer's own window."""
    _no_dropout(attention, name)
    sublayers = _sublayers(attention, **_PROJECTIONS,
                           rotary_embedding=("rope_layer",))
    num_heads = int(attention.num_query_heads)
    hidden_size = int(sublayers["query"][1].kernel.shape[1])
    head_dim = int(attention.head_dim)
    window = None
    if attention.use_sliding_window_attention:
        window = int(attention.sliding_window_size)
    normalizer = (head_dim if attention.query_head_dim_normalize
                  else hidden_size // num_heads)
    kwargs = dict(
        num_heads=num_heads, key_dim=head_dim,
        num_key_value_heads=int(attention.num_key_value_heads),
        use_bias=False, rotary_embedding=attention.rope_layer,
        scale=float(normalizer) ** -0.5,
        attn_logits_soft_cap=attention.logit_soft_cap,
        sliding_window=window,
    )
    return Reading(kwargs, hidden_size, sublayers)


READERS = {
    "LlamaAttention": _llama,
    "CachedMistralAttention": _llama,
    "CachedMixtralAttention": _llama,
    "QwenAttention": _llama,
    "QwenMoeAttention": _llama,
    "Qwen3Attention": _llama,
    "Qwen3MoeAttention": _llama,
    "Phi3Attention": _llama,
    "CachedGemmaAttention": _gemma,
}
# The attribute under which a family's decoder block holds its attention.
_BLOCK_ATTRIBUTES = ("_self_attention_layer", "attention")


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
    blocks = getattr(backbone, "transformer_layers", None)
    if not _from_keras_hub(backbone) or not blocks:
        raise ValueError(
            "`adopt` takes a keras-hub `CausalLM` or `Backbone` with "
            "decoder blocks (`backbone.transformer_layers`). Received: "
            f"model of type {type(model).__name__}"
        )
    plan = []
    for block in blocks:
        attribute = next((a for a in _BLOCK_ATTRIBUTES
                          if getattr(block, a, None) is not None), None)
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
        plan.append((block, attribute, attention,
                     reader(attention, type(attention).__name__)))
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


def _swap(block, attribute, attention, reading):
    layer = HubAttention(**reading.kwargs, name=attention.name,
                         dtype=attention.dtype_policy)
    layer._adopted.update(
        {ours: sublayer for ours, (_, sublayer) in reading.sublayers.items()
         if ours != "rotary_embedding"})  # that one is an argument
    shape = (None, None, reading.hidden_size)
    layer.build(shape, shape)
    layer._present_as(attention, reading.sublayers)
    # The block's tracker must forget the old layer, or its weights count
    # twice; a built block's state is locked.
    tracker = block._tracker
    locked = tracker.locked
    tracker.unlock()
    block._layers.remove(attention)
    tracker.stored_ids["layers"].discard(id(attention))
    setattr(block, attribute, layer)
    if locked:
        tracker.lock()
