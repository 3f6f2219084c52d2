"""`AttentionSpec`: what one call asks of attention, as an immutable value.

The layer describes a call once (positions, masks, window, dropout, the
scale and the features of current models) and hands the spec, with the
projected heads, to `keras_mha.attention.attend`. The dispatch rule reads
it to pick an algorithm, and every algorithm builds its masks from it with
the one position rule of `masks.py`. A new feature is a field here and a few
lines in each algorithm, never a branch in the layer.

Positions: query `t` sits at `query_offset + t`; key `j` at `j`, or at
`key_positions[j]` when given (a cache's slots hold other positions).
"""

import dataclasses
import math
import numbers
from typing import Any


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionSpec:
    """The attention one call asks for, apart from the projected heads.

    Shapes use `B` batch, `N` query heads, `T` queries, `S` keys.

    Attributes:
        scale: multiplies the logits `q·k`.
        causal: key `j` is visible from position `p` only if `j <= p`.
        window: `None`, or `(left, right)`: key `j` is visible from
            position `p` iff `p - left <= j <= p + right`.
        chunk: `None`, or `C`: key `j` is visible from position `p` iff
            `j // C == p // C` (chunked attention, Llama 4).
        query_offset: the position of query 0: a Python int, or a scalar
            integer tensor (a cache's index).
        key_positions: `None` (key `j` at position `j`), or an integer
            tensor `(S,)` of positions; a negative one is never visible.
        query_mask: `None` or boolean `(B, T)`, `True` = a real query.
        key_mask: `None` or boolean `(B, S)`, `True` = a real key.
        attention_mask: `None` or boolean, broadcastable to `(B, N, T, S)`
            (rank 4), `True` = may attend.
        dropout: the rate at which attention weights are dropped; 0 for
            none (inference, or no dropout).
        seed: what `keras.random` takes as `seed` (the layer's
            `SeedGenerator`), used with `dropout > 0`.
        return_weights: whether the caller wants the `(B, N, T, S)` weights.
        flash_attention: `None` (auto), `True` (require the fused kernel's
            flash attention) or `False` (never), as
            `keras.ops.dot_product_attention` takes it.
        bias: `None`, or a float tensor broadcastable to `(B, N, T, S)`
            (rank 4), added to the logits.
        soft_cap: `None`, or `c > 0`: logits become `c·tanh(logits / c)`
            after scaling.
        sinks: `None`, or a float tensor `(N,)`: one logit per head that
            joins each row's softmax denominator and is then dropped.
        alibi: `None`, or ALiBi's slopes `m_h` (a tuple of `N` floats):
            `-m_h·|p - j|` is added to the logits.
        segment_ids: `None`, or an integer tensor `(B, T)`: a query sees
            only keys of the same id.
        key_segment_ids: the keys' ids `(B, S)`, set whenever
            `segment_ids` is.
        sharding: `None`, or the `sharded.ContextPlan` of the active
            `keras_mha.ContextParallel`: the tokens are sharded over its
            context axis and `attend` takes a context-parallel route.
        mask_mod: `None`, or a `rules.Mask` (programmable attention): a
            function of the batch, head, query and key positions (absolute
            positions), ANDed with every mask above.
        score_mod: `None`, or a `rules.ScoreFunction`: maps each logit
            with its batch, head, query and key positions, after the
            soft-cap, bias and ALiBi, before the masks.
        whole_cache: whether the keys are every slot of a decoding
            cache after its write, read whole (keras-hub's cache on
            `attend_cached`'s `whole_cache` route); the dispatch rule reads
            it (`explicit_cached_step`).

    The order inside attention is that of `logits.py` (docs/design.md, "The
    order inside attention").
    """

    scale: float
    causal: bool = False
    window: Any = None
    chunk: Any = None
    query_offset: Any = 0
    key_positions: Any = None
    query_mask: Any = None
    key_mask: Any = None
    attention_mask: Any = None
    dropout: float = 0.0
    seed: Any = None
    return_weights: bool = False
    flash_attention: Any = None
    bias: Any = None
    soft_cap: Any = None
    sinks: Any = None
    alibi: Any = None
    segment_ids: Any = None
    key_segment_ids: Any = None
    sharding: Any = None
    mask_mod: Any = None
    score_mod: Any = None
    whole_cache: bool = False

    def replace(self, **changes):
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def has_token_masks(self):
        """Whether some tokens may be hidden from others apart from their
        positions (padding or segments)."""
        return (
            self.query_mask is not None
            or self.key_mask is not None
            or self.segment_ids is not None
        )

    @property
    def static_offset(self):
        """`query_offset` as a Python int, or `None` if it is a tensor."""
        if isinstance(self.query_offset, numbers.Integral):
            return int(self.query_offset)
        return None

    @property
    def keys_at_own_positions(self):
        """Whether query `t` sits at `t` and key `j` at `j` (no cache)."""
        return self.key_positions is None and self.static_offset == 0

    @property
    def reach(self):
        """`(left, right)`: the farthest keys a query may see, `p - left <=
        j <= p + right`, from the window and the chunk (`(C - 1, C - 1)`,
        right 0 with causal); `None` when neither bounds them."""
        if self.chunk is None:
            return self.window
        side = self.chunk - 1
        chunk = (side, 0 if self.causal else side)
        if self.window is None:
            return chunk
        return tuple(min(a, b) for a, b in zip(self.window, chunk))

    @property
    def plain_causal(self):
        """Whether the only mask is top-left causal: a backend's native
        causal kernel can serve it without a mask tensor (if no bias,
        ALiBi or sinks asks for more)."""
        return (
            self.causal
            and self.window is None
            and self.chunk is None
            and self.keys_at_own_positions
            and not self.has_token_masks
            and self.attention_mask is None
            and self.mask_mod is None
        )

    @property
    def masked(self):
        """Whether any mask applies: a rule, tokens, a dense mask or a mask
        object."""
        return (
            self.causal
            or self.window is not None
            or self.chunk is not None
            or self.has_token_masks
            or self.attention_mask is not None
            or self.mask_mod is not None
        )

    @property
    def programmed(self):
        """Whether the call has a mask or score function."""
        return self.mask_mod is not None or self.score_mod is not None


def window_sides(sliding_window, causal=False):
    """A layer's `sliding_window` -> `(left, right)`, or `None`.

    `w` is `(w - 1, w - 1)`: `|p - j| < w`, the same as Keras's layer; a
    pair `(left, right)` is itself. With `causal` the right side is 0,
    which the causal mask imposes anyway.
    """
    if sliding_window is None:
        return None
    if isinstance(sliding_window, (tuple, list)):
        left, right = (int(side) for side in sliding_window)
    else:
        left = right = int(sliding_window) - 1
    return (left, 0 if causal else right)


def default_scale(key_dim):
    return 1.0 / math.sqrt(float(key_dim))
