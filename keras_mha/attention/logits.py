"""What happens to the logits between `q·k` and the weights.

The order is fixed (docs/design.md, "The order inside attention"): logits =
`(q·k) × scale`; `c·tanh(logits / c)` with a soft-cap `c`; plus the
`attention_bias`; plus ALiBi's `-m_h·|p - j|`; then every mask; then the
softmax, with one sink logit per head in its denominator when the spec has
sinks. Every path applies these functions to its own layout of the scores:
they broadcast, and know nothing of which axes are which.
"""

import math
import warnings

from keras import ops

# Masked logits are replaced by this before the softmax (float32 scores).
# Finite, so rows with nothing to attend to stay finite before being zeroed.
MASKED_LOGIT = -1e30


def softmax(scores):
    """`ops.softmax` over the last axis, without Keras's warning for an axis
    of size 1: one key (`S = 1`) is a valid input here. Only that case
    enters `warnings.catch_warnings`, which `torch.compile` cannot trace."""
    if scores.shape[-1] != 1:
        return ops.softmax(scores, axis=-1)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "You are using a softmax over axis", UserWarning
        )
        return ops.softmax(scores, axis=-1)


def masked_softmax(scores, mask):
    """Softmax over the last axis; masked keys and empty rows get 0."""
    if mask is None:
        return softmax(scores)
    scores = ops.where(mask, scores, ops.cast(MASKED_LOGIT, scores.dtype))
    weights = softmax(scores)
    # A row whose keys are all masked is uniform here; the product zeroes it.
    return ops.multiply(weights, ops.cast(mask, weights.dtype))


def alibi_slopes(num_heads):
    """ALiBi's slope `m_h` of each of `num_heads` heads (Python floats).

    Press et al.: `m_h = 2^(-8(h+1)/N)` when `N` is a power of two. Otherwise
    BLOOM's rule: the slopes of the power of two `P` below `N`, then every
    other slope of `2P` for the remaining `N - P` heads.
    """
    def geometric(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    power = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(power)
    if power < num_heads:
        slopes += geometric(2 * power)[0::2][: num_heads - power]
    return tuple(slopes)


def soft_cap(scores, cap):
    """`cap · tanh(scores / cap)`, or `scores` when `cap` is `None`."""
    if cap is None:
        return scores
    cap = ops.cast(cap, scores.dtype)
    return ops.multiply(cap, ops.tanh(ops.divide(scores, cap)))


def alibi(slopes, distance, dtype):
    """`-m_h · |p - j|` from the slopes `(heads-shaped)` and `p - j`.

    Args:
        slopes: float tensor shaped to broadcast against `distance`'s
            layout, with the heads on their own axis.
        distance: integer tensor of `p - j`.
        dtype: the scores' dtype.
    """
    return ops.multiply(
        ops.cast(ops.negative(slopes), dtype),
        ops.cast(ops.abs(distance), dtype),
    )


def add(scores, term):
    """`scores + term` (`term` may be `None`), in the scores' dtype."""
    if term is None:
        return scores
    return ops.add(scores, ops.cast(term, scores.dtype))


def weights(scores, mask, sinks=None):
    """The softmax over the last axis, masked keys and empty rows 0.

    Args:
        scores: the modified logits.
        mask: boolean, broadcastable to `scores` (`None`: every key).
        sinks: `None`, or one logit per row broadcastable to
            `scores[..., :1]`: it joins each row's denominator and is then
            dropped (gpt-oss's sinks). A row whose keys are all masked puts
            all its weight on the sink: weights 0.

    Returns:
        Weights shaped like `scores`.
    """
    if sinks is None:
        return masked_softmax(scores, mask)
    if mask is not None:
        scores = ops.where(
            mask, scores, ops.cast(MASKED_LOGIT, scores.dtype)
        )
    exp, denominator = exp_and_sum(scores, ops.cast(sinks, scores.dtype))
    return ops.divide(exp, denominator)


def exp_and_sum(scores, sinks=None):
    """The softmax over the last axis before its division: `(exp(scores -
    top), sum)`, `top` each row's largest logit and `sum` `(.., 1)` the
    denominator.

    `sinks`: `None`, or one logit per row broadcastable to
    `scores[..., :1]`, which joins `top` and the denominator (gpt-oss's
    sinks; `fold_sink` folds one into an online softmax).
    """
    top = ops.amax(scores, axis=-1, keepdims=True)
    if sinks is not None:
        top = ops.maximum(top, sinks)
    exp = ops.exp(ops.subtract(scores, top))
    total = ops.sum(exp, axis=-1, keepdims=True)
    if sinks is not None:
        total = ops.add(total, ops.exp(ops.subtract(sinks, top)))
    return exp, total


def fold_sink(top, total, accumulated, sinks):
    """An online softmax's state with the sink logits `sinks` joined to its
    denominator (`exp_and_sum` does it in one pass).

    Args:
        top: `(.., 1)` the largest logit of each row so far.
        total: `(.., 1)` the sum of `exp(logit - top)`.
        accumulated: `(.., V)` the sum of `exp(logit - top) · value`.
        sinks: one logit per row, broadcastable to `top`; a sink has no
            value.

    Returns:
        `(top, total, accumulated)` rescaled to the new `top`.
    """
    new_top = ops.maximum(top, sinks)
    rescale = ops.exp(ops.subtract(top, new_top))
    total = ops.add(ops.multiply(total, rescale),
                    ops.exp(ops.subtract(sinks, new_top)))
    return new_top, total, ops.multiply(accumulated, rescale)


def dense_term(spec, query_positions, key_positions, bias, dtype):
    """The additive term of a dense layout: bias plus ALiBi.

    Args:
        spec: the call's `AttentionSpec`.
        query_positions: integer `(T,)`, the queries' positions.
        key_positions: integer `(S,)`, the keys' positions.
        bias: `None`, or the spec's bias for these queries and keys,
            broadcastable to `(B, N, T, S)`.
        dtype: the scores' dtype.

    Returns:
        `(B|1, N|1, T, S)` in `dtype`, or `None` when there is no term.
    """
    term = None if bias is None else ops.cast(bias, dtype)
    if spec.alibi is not None:
        slopes = ops.reshape(
            ops.convert_to_tensor(spec.alibi, dtype), (1, -1, 1, 1)
        )  # (1, N, 1, 1)
        distance = ops.subtract(
            ops.reshape(query_positions, (1, 1, -1, 1)),
            ops.reshape(key_positions, (1, 1, 1, -1)),
        )  # (1, 1, T, S)
        term = add(alibi(slopes, distance, dtype), term)
    return term
