"""keras-hub's causal LMs on this library's attention: `adopt(model)`.

Each decoder block of a keras-hub backbone holds its attention layer (under
`_self_attention_layer`, gpt-oss's `self_attention_layer`, or Gemma's
`attention`). `adopt` reads every block's layer (its heads, rotary
embedding, scale, norms, window, sinks and soft-cap, by the readers of
`READERS`, keyed by the attention class's name), builds a `HubAttention`
that takes over the layer's own projections (the same `EinsumDense`
objects: nothing is copied, and LoRA, int8 quantization and layout maps
act on them as before) and puts it in the block's place. The blocks call
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

from keras_mha import projections
from keras_mha import rotary as rotary_lib
from keras_mha import vllm
from keras_mha.cached import CachedMultiHeadAttention
from keras_mha.layer import MultiHeadAttention


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
        cache: `None`, `(B, 2, S, K, H)`, or Gemma 3's pair of `(B, S, K,
            H)` keys and values (returned as a pair).
        cache_update_index: with `cache`, the slot of the first new token.
        cache_update_mask: Gemma 3's `(B, T)`: where false, a slot keeps
            what it held.
        training: whether dropout is applied.
        causal, key_mask: what a swapped block's `CausalMask` stands for,
            set by `__call__`: causal self-attention over the keys that
            `key_mask` `(B, S)` keeps.

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

    def take_over(self, attention, reading):
        """Builds the layer on keras-hub's `attention`'s own sublayers
        (`reading.sublayers`, used as they are, not copied) and presents
        them under `attention`'s names (`adopt`)."""
        self._adopted.update(
            {ours: sublayer for ours, (_, sublayer) in reading.sublayers.items()
             if ours != "rotary_embedding"})  # that one is an argument
        shape = (None, None, reading.hidden_size)
        self.build(shape, shape)
        self._present_as(attention, reading.sublayers)

    def _present_as(self, attention, sublayers):
        """Names the taken-over sublayers as keras-hub's `attention` did,
        and hides this layer's public names for them that it lacks."""
        for ours, (theirs, sublayer) in sublayers.items():
            if isinstance(sublayer, HeadsOfDense):
                if getattr(self, theirs, None) is sublayer:
                    continue  # our name too (BLOOM's `_output_dense`)
                sublayer = sublayer.dense  # keras-hub's own layer
            if not hasattr(type(self), theirs):
                object.__setattr__(self, theirs, sublayer)  # not tracked
        self._hidden = frozenset(
            f"{ours}_dense" if ours in _PROJECTIONS else ours
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
        for theirs, ours in _CALL_NAMES.items():  # SmolLM3's blocks
            if theirs in kwargs:
                kwargs[ours] = kwargs.pop(theirs)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, CausalMask):  # from a swapped block
            kwargs.update(attention_mask=None, causal=True,
                          key_mask=mask.padding)
        return super().__call__(*args, **kwargs)

    def call(self, hidden_states, attention_mask=None, cache=None,
             cache_update_index=None, cache_update_mask=None, training=None,
             causal=False, key_mask=None):
        serving = vllm.serving_context()
        if serving is not None:  # keras-hub's vLLM route
            return vllm.paged_attention(self, hidden_states, hidden_states,
                                        hidden_states, cache, serving)
        if cache is None:  # Gemma's layers take an index without a cache
            cache_update_index = None
        if causal:  # a `CausalMask`: the layer's own paths, no dense mask
            return MultiHeadAttention.call(
                self, hidden_states, hidden_states, training=training,
                key_mask=key_mask, use_causal_mask=True)
        pair = isinstance(cache, (tuple, list))  # Gemma 3's `(keys, values)`
        given = ops.stack(cache, axis=1) if pair else cache
        results = super().call(
            hidden_states, hidden_states, attention_mask=attention_mask,
            cache=given, cache_update_index=cache_update_index,
            training=training,
        )
        if cache is None:
            return results
        output, new = results
        if cache_update_mask is not None and cache_update_index is not None:
            new = _keep_unmasked(given, new, cache_update_mask,
                                 cache_update_index)
        return output, ((new[:, 0], new[:, 1]) if pair else new)

    def compute_output_spec(self, hidden_states, attention_mask=None,
                            cache=None, cache_update_index=None,
                            cache_update_mask=None, training=None,
                            causal=False, key_mask=None):
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
        if not pair:
            return spec
        part = keras.KerasTensor(keys.shape, dtype=keys.dtype)
        return spec[0], (part, part)


# The cache arguments as some blocks name them (SmolLM3's), and ours.
_CALL_NAMES = {"self_attention_cache": "cache",
               "self_attention_cache_update_index": "cache_update_index"}


class HeadsOfDense(keras.layers.Layer):
    """keras-hub's `Dense` seen as a projection of heads: into them, `(B,
    T, E)` to `(B, T, N, H)` (SmolLM3's `(E, N·H)` query, key and value),
    or with `merge=True` out of them, `(B, T, N, H)` to `(B, T, E)`
    (BLOOM's `(N·H, E)` output). The `Dense` is the same object, so LoRA
    and quantization act on it as before, and the view saves and loads
    the `Dense`'s weights as its own, where keras-hub's layer kept them."""

    def __init__(self, dense, num_heads, merge=False, **kwargs):
        super().__init__(name=f"{dense.name}_heads",
                         dtype=dense.dtype_policy, **kwargs)
        self.dense = dense
        self.num_heads = num_heads
        self.merge = merge
        self.built = True

    def call(self, inputs):
        if self.merge:
            return self.dense(ops.reshape(inputs, (*ops.shape(inputs)[:-2], -1)))
        x = self.dense(inputs)
        return ops.reshape(x, (*ops.shape(x)[:-1], self.num_heads, -1))

    def __dir__(self):
        # Keras saves the sublayers it finds in `dir`: the `Dense`'s
        # weights are this layer's own (below), not a sublayer's.
        return [n for n in super().__dir__() if n != "dense"]

    def save_own_variables(self, store):
        self.dense.save_own_variables(store)

    def load_own_variables(self, store):
        self.dense.load_own_variables(store)


class RotationFromTables(keras.layers.Layer):
    """RoPE at the frequencies of keras-hub's rotary layer `source` (SmolLM3's,
    whose call returns tables, not rotated heads): pairs `(i, i + H/2)` of
    whole heads turned by `p·inv_freq`, at positions `start_index + t` or
    `positions`; with `turns=False` (a NoPE layer, which holds the rotary
    layer all the same), none. Its weight is `source`'s `inv_freq`
    `(H/2,)`, the same variable, so it saves where keras-hub's layer saved
    it."""

    def __init__(self, source, turns=True, **kwargs):
        super().__init__(name=source.name, dtype=source.dtype_policy,
                         autocast=False, **kwargs)
        self.inv_freq = source.inv_freq  # tracked as the layer's weight
        self.turns = turns
        self.built = True

    def call(self, inputs, start_index=0, positions=None):
        if not self.turns:
            return inputs
        return rotary_lib.turn(
            inputs, rotary_lib.positions_of(inputs, start_index, positions),
            ops.cast(self.inv_freq, "float32"), inputs.shape[-1])


@dataclasses.dataclass(frozen=True)
class CausalMask:
    """A swapped block's mask as structure: causal self-attention over the
    keys that `padding` `(B, S)` keeps (`None`: all), within the layer's
    own window."""

    padding: object = None


def _structural(method):
    """The block's mask `method`, returning a `CausalMask` when the call has
    no cache and no mask of the caller's; the dense mask otherwise."""
    signature = inspect.signature(method)

    sequence = next(iter(signature.parameters))

    def compute_mask(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        padding = next((v for k, v in bound.items() if "padding_mask" in k),
                       None)
        # A cache, a mask of the caller's, Gemma 3's vision mask.
        given = any(v is not None for k, v in bound.items()
                    if k != sequence and "padding_mask" not in k
                    and "index" not in k)
        return method(*args, **kwargs) if given else CausalMask(padding)

    return compute_mask


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


@dataclasses.dataclass
class Reading:
    """What a reader finds in a keras-hub attention layer.

    Attributes:
        kwargs: `HubAttention`'s constructor arguments.
        hidden_size: `E`.
        sublayers: `{our name: (keras-hub's attribute, layer)}`: the built
            projections (`query`, `key`, `value`, `output`), query/key
            norms (`query_norm`, `key_norm`), the `sinks` and the
            `rotary_embedding`, taken over as they are.
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


def _no_dropout(rate, name):
    rate = float(rate or 0.0)
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
    _no_dropout(getattr(attention, "dropout", 0.0), name)
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
        # Qwen's layers keep theirs; Mistral's and Mixtral's keep the
        # window their blocks mask with.
        window = next((getattr(attention, n) for n in (
            "sliding_window_size", "_sliding_window", "sliding_window")
            if getattr(attention, n, None) is not None), None)
    kwargs = dict(
        num_heads=int(num_heads), key_dim=int(head_dim),
        num_key_value_heads=int(sublayers["key"][1].kernel.shape[1]),
        use_bias=query.bias is not None,
        rotary_embedding=attention.rotary_embedding_layer,
        scale=_logit_scale(attention),
        sliding_window=None if window is None else int(window),
    )
    if "query_norm" in sublayers:
        kwargs.update(qk_norm="rms",
                      qk_norm_epsilon=float(sublayers["query_norm"][1].epsilon))
    return Reading(kwargs, int(hidden_size), sublayers)


def _gpt_oss(attention, name):
    """gpt-oss: Llama's reading with biases, keras-hub's YaRN rotary layer,
    a sink logit per head (`sinks`, a weight of the layer itself, taken
    over as it is) and the layer's own window on every layer: keys `p - W
    <= j <= p`, `W + 1` of them."""
    if attention.head_dim is not None and attention.head_dim % 2:
        raise ValueError(
            f"The {name} rotates the first {attention.head_dim - 1} "
            "features of its odd heads, which `adopt` does not read. "
            f"Received: head_dim={attention.head_dim}"
        )
    reading = _llama(attention, name)
    window = attention.sliding_window
    reading.kwargs.update(
        use_sinks=True,
        sliding_window=int(window) + 1 if window and window > 0 else None)
    reading.sublayers["sinks"] = ("sinks", projections.Sinks.holding(
        attention.sinks, name="sinks", dtype=attention.dtype_policy))
    return reading


def _smollm3(attention, name):
    """SmolLM3: `Dense` projections `(E, N·H)` (seen as heads, not copied),
    the output projection `(N, H, E)`, RoPE at its rotary layer's own
    frequencies over whole heads on the layers of `rope_layer_enabled_list`
    (the others NoPE), `1 / sqrt(H)`; the block builds the causal mask."""
    _no_dropout(attention.attention_dropout, name)
    head_dim = int(attention.head_dim)
    if int(head_dim * attention.partial_rotary_factor) != head_dim:
        raise ValueError(
            f"The {name} rotates part of each head, which keras-hub's "
            "SmolLM3 applies to the whole head, and `adopt` does not read. "
            f"Received: partial_rotary_factor="
            f"{attention.partial_rotary_factor}"
        )
    heads = dict(query=attention.num_attention_heads,
                 key=attention.num_key_value_heads,
                 value=attention.num_key_value_heads)
    sublayers = {
        ours: (f"{ours[0]}_proj",
               HeadsOfDense(getattr(attention, f"{ours[0]}_proj"), count))
        for ours, count in heads.items()
    }
    sublayers["output"] = ("o_proj", attention.o_proj)
    rotary = RotationFromTables(attention.rotary_embedding,
                                turns=bool(attention.use_rope))
    kwargs = dict(
        num_heads=int(heads["query"]), key_dim=head_dim,
        num_key_value_heads=int(heads["key"]),
        use_bias=bool(attention.attention_bias), rotary_embedding=rotary,
        scale=_logit_scale(attention),
    )
    return Reading(kwargs, int(attention.hidden_size), sublayers)


def _bloom(attention, name):
    """BLOOM: biased projections `(E, N, H)`, `1 / sqrt(H)`, ALiBi with
    BLOOM's slopes added after the scale (keras-hub's `AlibiBias`, always
    of `alibi_bias_max=8`, adds `m·(j - S + 1)`, the layer's `-m·(p - j)`
    up to a shift of each row), and an output `Dense` `(N·H, E)` of the
    merged heads."""
    _no_dropout(attention.dropout, name)
    sublayers = _sublayers(attention, **_PROJECTIONS)
    num_heads = int(attention.num_heads)
    theirs, dense = sublayers["output"]
    sublayers["output"] = (theirs, HeadsOfDense(dense, num_heads, merge=True))
    hidden_size = int(sublayers["query"][1].kernel.shape[0])
    kwargs = dict(num_heads=num_heads, key_dim=int(attention.head_dim),
                  use_bias=True, scale=float(attention.inv_norm_factor),
                  use_alibi=True)
    return Reading(kwargs, hidden_size, sublayers)


def _logit_scale(attention):
    """The logit scale of keras-hub's Llama-family attention: it keeps it
    only as the private `_inv_norm_factor`, with no public attribute."""
    return float(attention._inv_norm_factor)


def _gemma(attention, name):
    """Gemma, Gemma 2 and Gemma 3: projections `(N, E, H)`, a rotary layer
    (whose output Gemma 1 and 2 reorder, the same for queries and keys, so
    no product changes), `1 / sqrt(H)` or `1 / sqrt(E / N)`, the soft-cap,
    the layer's own window; Gemma 3's query/key norms."""
    _no_dropout(getattr(attention, "dropout", 0.0), name)
    if getattr(attention, "use_bidirectional_attention", False):
        raise ValueError(
            f"The {name} attends both ways within its window "
            "(EmbeddingGemma), which `adopt` does not read. Received: "
            "use_bidirectional_attention=True"
        )
    sublayers = _sublayers(attention, **_PROJECTIONS,
                           rotary_embedding=("rope_layer",),
                           query_norm=("query_norm",),
                           key_norm=("key_norm",))
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
    if "query_norm" in sublayers:  # Gemma 3's, `x·(1 + w)`, called as is
        kwargs.update(qk_norm="rms", qk_norm_epsilon=float(
            sublayers["query_norm"][1].epsilon))
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
    "GptOssAttention": _gpt_oss,
    "SmolLM3Attention": _smollm3,
    "BloomAttention": _bloom,
    "CachedGemmaAttention": _gemma,
    "CachedGemma3Attention": _gemma,
}
# The attribute under which a family's decoder block holds its attention.
_BLOCK_ATTRIBUTES = ("_self_attention_layer", "self_attention_layer",
                     "self_attn", "attention")


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
    layer.take_over(attention, reading)
    _replace_sublayer(block, attribute, attention, layer)
    for name in _MASK_METHODS:
        if hasattr(block, name):
            object.__setattr__(block, name, _structural(getattr(block, name)))
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
