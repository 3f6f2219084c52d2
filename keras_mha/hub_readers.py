"""How `adopt` reads each keras-hub attention class: one reader per family,
keyed by class name in `READERS`.

A reader returns a `Reading`: the `HubAttention` arguments (heads, rotary
embedding, scale, norms, window, sinks, soft-cap) and keras-hub's built
sublayers, taken over as they are (nothing is copied). A sublayer whose
shapes are not the layer's (a `Dense` of `N·H` features, GPT-NeoX's fused
query-key-value projection, a rotary layer that returns tables) is used
through a view that holds the same object (`hub_views.py`), so LoRA, int8
quantization and layout maps act on it as before.

Nothing here imports keras-hub: the layers read come from it.
"""

import dataclasses

from keras import ops

from keras_mha import projections
from keras_mha.hub_views import FusedProjection
from keras_mha.hub_views import HalvesRotation
from keras_mha.hub_views import HeadsOfDense
from keras_mha.hub_views import HeadsOfFused
from keras_mha.hub_views import RotationFromTables
from keras_mha.rotary import RotaryEmbedding


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
        passengers: `{keras-hub's attribute: layer}`: sublayers the layer
            holds at keras-hub's names, weights and all, and never calls
            (the key and value projections of Gemma 3n's layers that read
            an earlier layer's keys and values), so the model's weights and
            saved files stay keras-hub's.
        layer: the class `adopt` builds (`hub.LAYERS`): `"HubAttention"`,
            or `"Gemma3nHubAttention"`, `"Gemma4HubAttention"` for those
            models' calls and caches.
    """

    kwargs: dict
    hidden_size: int
    sublayers: dict
    passengers: dict = dataclasses.field(default_factory=dict)
    layer: str = "HubAttention"


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


PROJECTIONS = dict(query=_dense("query"), key=_dense("key"),
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
        attention, **PROJECTIONS,
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
    sublayers = _sublayers(attention, **PROJECTIONS)
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
    sublayers = _sublayers(attention, **PROJECTIONS,
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


def _gpt_neo_x(attention, name):
    """GPT-NeoX: one fused biased projection `(E, N, 3H)` seen as three
    (`HeadsOfFused`), keras-hub's rotary embedding on the first
    `rotary_dim` features of each head at the frequencies of a head of
    that size, `1 / sqrt(H)`, an output `Dense` `(N·H, E)` of the merged
    heads. The layer rotates a decoding step's query at its own position;
    keras-hub's rotates it at 0 (docs/keras_hub.md)."""
    _no_dropout(attention.dropout, name)
    head_dim = int(attention.attn_head_size)
    num_heads = int(attention.num_heads)
    fused = FusedProjection(getattr(attention, "_qkv_dense"), head_dim,
                            ("query", "key", "value"))
    sublayers = {part: ("_qkv_dense", HeadsOfFused(fused, part))
                 for part in fused.parts}
    output = getattr(attention, "_output_dense")
    sublayers["output"] = ("_output_dense",
                           HeadsOfDense(output, num_heads, merge=True))
    rotary = RotaryEmbedding(
        max_wavelength=attention.rotary_max_wavelength,
        rotary_dim=int(attention.rotary_dim), dtype=attention.dtype_policy)
    kwargs = dict(num_heads=num_heads, key_dim=head_dim, use_bias=True,
                  rotary_embedding=rotary, scale=head_dim**-0.5,
                  always_return_cache=True)
    return Reading(kwargs, int(attention.hidden_dim), sublayers)


def _qwen3_5(attention, name):
    """Qwen3.5's softmax layers: a query projection `(E, N, 2H)` of each
    head's query and gate (`HeadsOfFused`, the gate through its sigmoid),
    key and value `(E, K, H)`, per-head query/key norms of `1 + w` (called
    as they are), keras-hub's rotary embedding on the first `rotary_dim`
    features, `1 / sqrt(H)`, the layer's window. Its M-RoPE positions
    (images, video) are not read: a call with `position_ids` is refused."""
    _no_dropout(attention.dropout, name)
    head_dim = int(attention.head_dim)
    sublayers = _sublayers(attention, key=_dense("key"),
                           value=_dense("value"), output=_dense("output"),
                           query_norm=("_query_norm",),
                           key_norm=("_key_norm",))
    fused = FusedProjection(getattr(attention, "_query_dense"), head_dim,
                            ("query", "gate"))
    sublayers["query"] = ("_query_dense", HeadsOfFused(fused, "query"))
    sublayers["gate"] = ("_query_dense",
                         HeadsOfFused(fused, "gate", activation=ops.sigmoid))
    rotary = RotaryEmbedding(
        max_wavelength=attention.rope_max_wavelength,
        scaling_factor=attention.rope_scaling_factor,
        rotary_dim=int(attention.rotary_dim), dtype=attention.dtype_policy)
    window = attention.sliding_window_size
    kwargs = dict(
        num_heads=int(attention.num_query_heads), key_dim=head_dim,
        num_key_value_heads=int(attention.num_key_value_heads),
        use_bias=False, use_gate=True, rotary_embedding=rotary,
        scale=head_dim**-0.5, qk_norm="rms",
        qk_norm_epsilon=float(attention.layer_norm_epsilon),
        sliding_window=None if not window else int(window),
    )
    hidden_size = int(sublayers["key"][1].kernel.shape[0])
    return Reading(kwargs, hidden_size, sublayers)


def _falcon(attention, name):
    """Falcon: biased projections `(E, N, H)`, an output `Dense` `(N·H,
    E)` of the merged heads, `1 / sqrt(H)`, and ALiBi with BLOOM's slopes,
    which its block builds and the layer adds before the scale
    (`alibi_before_scale`): the layer computes the same terms itself, so
    the block's `alibi` tensor is not read."""
    _no_dropout(attention.attention_dropout_rate, name)
    sublayers = _sublayers(attention, **PROJECTIONS)
    num_heads = int(attention.num_heads)
    theirs, dense = sublayers["output"]
    sublayers["output"] = (theirs, HeadsOfDense(dense, num_heads, merge=True))
    kwargs = dict(num_heads=num_heads, key_dim=int(attention.head_dim),
                  use_bias=True, scale=float(attention.inv_norm_factor),
                  use_alibi=True, alibi_before_scale=True)
    hidden_size = int(sublayers["query"][1].kernel.shape[0])
    return Reading(kwargs, hidden_size, sublayers)


def _gemma3n(attention, name):
    """Gemma 3n: `Dense` projections `(E, N·H)` and an output `Dense` `(N·H,
    E)` (seen as heads), per-head query/key norms `x·w` (called as they
    are), values normalized without weights, keras-hub's rotary layer, a
    logit scale of 1, the layer's own window. Its last layers
    (`is_kv_shared_layer`) read the keys and values of the last earlier
    layer of their kind: they keep their own key and value projections as
    passengers, as keras-hub's layers keep them unused."""
    num_heads = int(attention.num_attention_heads)
    num_kv = int(attention.num_key_value_heads)
    shared = bool(attention.is_kv_shared_layer)
    views = dict(query=("q_proj", num_heads), key=("k_proj", num_kv),
                 value=("v_proj", num_kv))
    sublayers = {
        ours: (theirs, HeadsOfDense(getattr(attention, theirs), count))
        for ours, (theirs, count) in views.items()
        if ours == "query" or not shared
    }
    sublayers.update(
        output=("o_proj", HeadsOfDense(attention.o_proj, num_heads,
                                       merge=True)),
        query_norm=("q_norm", attention.q_norm),
        rotary_embedding=("rotary_embedding", attention.rotary_embedding))
    passengers = {}
    if shared:
        passengers = {theirs: getattr(attention, theirs)
                      for theirs in ("k_proj", "v_proj", "k_norm")}
    else:
        sublayers["key_norm"] = ("k_norm", attention.k_norm)
    window = attention.sliding_window
    kwargs = dict(
        num_heads=num_heads, key_dim=int(attention.head_dim),
        num_key_value_heads=num_kv, use_bias=bool(attention.attention_bias),
        dropout=float(attention.attention_dropout),
        rotary_embedding=attention.rotary_embedding, scale=1.0,
        qk_norm="rms", qk_norm_epsilon=float(attention.rms_norm_eps),
        value_norm=True, shared_key_value=shared,
        sliding_window=None if window is None else int(window),
    )
    return Reading(kwargs, int(attention.hidden_size), sublayers, passengers,
                   layer="Gemma3nHubAttention")


def _gemma4(attention, name):
    """Gemma 4: projections `(N, E, H)` (Gemma's), per-head query/key norms
    (called as they are), values normalized without weights, keras-hub's
    rotary layer turning the first part of each half of a head
    (`HalvesRotation`, at the block's `positions`), a logit scale of 1,
    the soft-cap, the sliding layers' window. Each layer's own heads and
    head size; on a global layer with `attention_k_eq_v` the values are
    the key projection's (the same `EinsumDense`, taken over for both).
    Its last layers read an earlier layer's keys and values (`shared_kv`)
    and hold no projections of their own."""
    if attention.use_bidirectional_attention:
        raise ValueError(
            f"The {name} attends both ways (an embedding model), which "
            "`adopt` does not read. Received: "
            "use_bidirectional_attention=True")
    shared = bool(attention.is_kv_shared_layer)
    sublayers = _sublayers(attention, query=("query_dense",),
                           output=("output_dense",),
                           query_norm=("query_norm",))
    if not shared:
        sublayers.update(_sublayers(attention, key=("key_dense",),
                                    key_norm=("key_norm",)))
        sublayers["value"] = next(
            (theirs, getattr(attention, theirs))
            for theirs in ("value_dense", "key_dense")
            if getattr(attention, theirs, None) is not None)
    rotation = HalvesRotation(attention.rope_layer, attention.rotary_dim,
                              attention.head_dim)
    sublayers["rotary_embedding"] = ("rope_layer", rotation)
    window = None
    if attention.use_sliding_window_attention and \
            not attention.is_global_attention:
        window = int(attention.sliding_window_size)
    kwargs = dict(
        num_heads=int(attention.num_query_heads),
        key_dim=int(attention.head_dim),
        num_key_value_heads=int(attention.effective_num_kv_heads),
        use_bias=False, dropout=float(attention.dropout or 0.0),
        rotary_embedding=rotation, scale=1.0,
        attn_logits_soft_cap=attention.logit_soft_cap, qk_norm="rms",
        qk_norm_epsilon=float(attention.layer_norm_epsilon),
        value_norm=True, shared_key_value=shared, sliding_window=window,
    )
    hidden_size = int(sublayers["query"][1].kernel.shape[1])
    return Reading(kwargs, hidden_size, sublayers,
                   layer="Gemma4HubAttention")


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
    "GPTNeoXAttention": _gpt_neo_x,
    "Qwen3_5Attention": _qwen3_5,
    "FalconAttention": _falcon,
    "Gemma3nTextAttention": _gemma3n,
    "Gemma4TextAttention": _gemma4,
}
