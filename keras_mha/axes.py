"""The axes layout: inputs with any `attention_axes` in the paths' form.

The attention paths see one batch axis and one sequence axis,
`(B', T, N, X)`. Keras's layer attends over any set of axes with einsum
equations; this module folds the other axes into the batch and the
attention axes into the sequence, and back.
"""

import math

from keras import ops


class AxesLayout:
    """Moves inputs with any `attention_axes` to the `(B', T, N, X)` form.

    The attention paths see one batch axis and one sequence axis. Inputs of
    rank 3 with the default axes are already in that form and pass through
    untouched; otherwise non-attention axes are folded into the batch and
    attention axes into the sequence, as Keras's einsum equations do.
    """

    def __init__(self, rank, attention_axes):
        self.rank = rank
        inner = tuple(range(1, rank - 1))  # the non-batch, non-feature axes
        if attention_axes is None:
            axes = inner
        else:
            # Negative axes count from the end of the input, as in Keras.
            axes = tuple(a + rank if a < 0 else a for a in attention_axes)
            bad = [a for a, n in zip(attention_axes, axes) if n not in inner]
            if bad or len(set(axes)) != len(axes):
                raise ValueError(
                    "`attention_axes` must be distinct axes of the input "
                    f"other than batch (0) and features ({rank - 1}). "
                    f"Received: attention_axes={attention_axes} for inputs "
                    f"of rank {rank}"
                )
        self.attention_axes = tuple(sorted(axes))
        self.batch_axes = tuple(a for a in inner if a not in axes)
        self.multi_axis = len(self.attention_axes) > 1
        self.identity = rank == 3
        # Projected tensors have rank `rank + 1`: (B, ..., N, X).
        self.perm = (0, *self.batch_axes, *self.attention_axes, rank - 1, rank)
        self.inverse_perm = tuple(
            self.perm.index(i) for i in range(len(self.perm))
        )

    def _sizes(self, tensor, axes):
        shape = ops.shape(tensor)
        return [shape[a] for a in axes]

    def sequence_length(self, shape):
        """The static length of the attended sequence, or `None`."""
        dims = [shape[a] for a in self.attention_axes]
        return None if None in dims else math.prod(dims)

    def to_sequence(self, x):
        """`(B, ..., N, X)` -> `(B', T, N, X)`."""
        if self.identity:
            return x
        x = ops.transpose(x, self.perm)
        seq = math.prod(self._sizes(x, range(1 + len(self.batch_axes), self.rank - 1)))
        return ops.reshape(x, (-1, seq, x.shape[-2], x.shape[-1]))

    def from_sequence(self, x, query):
        """`(B', T, N, X)` -> `(B, ..., N, X)` laid out like `query`."""
        if self.identity:
            return x
        lead = self._sizes(query, (0, *self.batch_axes, *self.attention_axes))
        x = ops.reshape(x, (*lead, x.shape[-2], x.shape[-1]))
        return ops.transpose(x, self.inverse_perm)

    def token_mask(self, mask):
        """A Keras mask `(B, ...)` of the input -> `(B', T)`."""
        if mask is None or self.identity:
            return mask
        mask = ops.transpose(mask, self.perm[:-2])
        seq = math.prod(
            self._sizes(mask, range(1 + len(self.batch_axes), self.rank - 1))
        )
        return ops.reshape(mask, (-1, seq))

    def attention_mask_targets(self, query_shape, key_shape, num_heads):
        """`{rank: (description, shape)}`: what an `attention_mask` may be."""
        if self.identity:
            batch, t, s = query_shape[0], query_shape[1], key_shape[1]
            return {
                2: ("(T, S)", (t, s)),
                3: ("(B, T, S)", (batch, t, s)),
                4: ("(B, N, T, S)", (batch, num_heads, t, s)),
            }
        full = tuple(
            query_shape[a]
            for a in (0, *self.batch_axes, *self.attention_axes)
        ) + tuple(key_shape[a] for a in self.attention_axes)
        return {len(full): ("(B, <other axes>, <T axes>, <S axes>)", full)}

    def attention_mask(self, mask, query, key, num_heads):
        """A user `attention_mask` (checked) -> `(B'|1, N|1, T, S)` boolean."""
        if mask is None:
            return None
        if self.identity:
            return rank4_mask(mask)
        mask = ops.cast(ops.convert_to_tensor(mask), "bool")
        # Keras's multi-axis layout: (B, <batch axes>, <T axes>, <S axes>).
        q_axes = self._sizes(query, (0, *self.batch_axes, *self.attention_axes))
        s_axes = self._sizes(key, self.attention_axes)
        full = (*q_axes, *s_axes)
        mask = ops.broadcast_to(mask, full)
        seq_t = math.prod(q_axes[1 + len(self.batch_axes) :])
        seq_s = math.prod(s_axes)
        return ops.reshape(mask, (-1, 1, seq_t, seq_s))  # (B', 1, T, S)

    def scores_from_sequence(self, scores, query, key):
        """`(B', N, T, S)` -> Keras's `(B, <batch>, N, <T axes>, <S axes>)`."""
        if self.identity:
            return scores
        lead = self._sizes(query, (0, *self.batch_axes))
        t_axes = self._sizes(query, self.attention_axes)
        s_axes = self._sizes(key, self.attention_axes)
        return ops.reshape(
            scores, (*lead, scores.shape[1], *t_axes, *s_axes)
        )

    def scores_shape(self, query_shape, key_shape, num_heads):
        lead = tuple(query_shape[a] for a in (0, *self.batch_axes))
        t_axes = tuple(query_shape[a] for a in self.attention_axes)
        s_axes = tuple(key_shape[a] for a in self.attention_axes)
        return (*lead, num_heads, *t_axes, *s_axes)


def rank4_mask(mask):
    """A checked `attention_mask` of rank 2-4, any dtype (nonzero = may
    attend) -> boolean `(B|1, N|1, T, S)`."""
    mask = ops.cast(ops.convert_to_tensor(mask), "bool")
    rank = len(mask.shape)
    if rank == 2:
        return mask[None, None]  # (1, 1, T, S)
    if rank == 3:
        return mask[:, None]  # (B|1, 1, T|1, S)
    return mask


def keras_einsum_equations(rank, attention_axes):
    """Keras's `(dot_product_equation, combine_equation)` for inputs of
    `rank` attended over `attention_axes` (normalized, sorted).

    The projected tensors have rank `rank + 1`: `(B, ..., N, X)`, one
    letter per axis (`a`, `b`, ...). The keys take fresh letters on the
    attention axes. The product is `(batch axes and heads, query attention
    axes, key attention axes)`: `"aecd,abcd->acbe"` for rank 3, keys
    first, as `keras.layers.MultiHeadAttention` spells it.
    """
    letters = "abcdefghijklmnopqrstuvwxyz"
    projected = rank + 1
    query = letters[:projected]
    fresh = iter(letters[projected:])
    key = "".join(
        next(fresh) if axis in attention_axes else query[axis]
        for axis in range(projected)
    )
    kept = [a for a in range(projected - 1) if a not in attention_axes]
    product = "".join(
        [query[a] for a in kept]
        + [query[a] for a in attention_axes]
        + [key[a] for a in attention_axes]
    )
    return f"{key},{query}->{product}", f"{product},{key}->{query}"
