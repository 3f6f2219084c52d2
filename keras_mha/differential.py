"""Differential attention: pairs of heads, one's attention minus a learned
multiple of the other's (Ye et al., "Differential Transformer", 2024).

With `differential=λ_init`, `MultiHeadAttention`'s `N` heads pair up: head
`i` with head `i + N/2`. Each attends as usual, with its own query and
key (and its group's key/value head under GQA). Then

    out_i = RMSNorm(o_i - λ·o_{i + N/2}) · (1 - λ_init)

with `λ = exp(λ_q1 · λ_k1) - exp(λ_q2 · λ_k2) + λ_init`. The norm is over
each pair's `V` features, without a weight. The output projection then
takes the `N/2` pairs' `N/2 · V` features.

Subtracting the second map cancels the attention both heads give to the
same keys, the paper's "noise". The four `(H,)` vectors are weights of
the `Differential` sublayer, so `λ` trains as the paper's does. The
heads' values are `V` features wide. A model of `transformers`' DiffLlama
has values of `H` features and gives each pair both halves of a pair of
value heads, so `from_torch` makes its layer with `V = 2H`
(`huggingface.py`).
"""

import keras
from keras import ops

from keras_mha import heads


class Differential(keras.layers.Layer):
    """The weights `lambda_q1`, `lambda_k1`, `lambda_q2`, `lambda_k2`
    `(H,)` and the pairs' combination; a sublayer built after the sinks.

    Args:
        num_heads: `N`, even.
        key_dim: `H`, the vectors' size.
        lambda_init: `λ_init`.
        epsilon: the norm's.
    """

    def __init__(self, num_heads, key_dim, lambda_init, epsilon=1e-5,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.lambda_init = lambda_init
        self.epsilon = epsilon

    def build(self, input_shape=None):
        # The paper's initialization: N(0, 0.1) for each vector.
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, self.add_weight(
                name=name, shape=(self.key_dim,),
                initializer=keras.initializers.RandomNormal(stddev=0.1)))

    def factor(self):
        """`λ`, a scalar in the weights' dtype."""
        return (ops.exp(ops.sum(self.lambda_q1 * self.lambda_k1))
                - ops.exp(ops.sum(self.lambda_q2 * self.lambda_k2))
                + self.lambda_init)

    def call(self, context):
        """`(B, ..., N, V)` heads -> `(B, ..., N/2, V)` pairs."""
        half = self.num_heads // 2
        dtype = keras.backend.standardize_dtype(context.dtype)
        # In float32 at least: the pairs' difference cancels what both
        # heads share, which a half dtype would round away.
        wide = "float64" if dtype == "float64" else "float32"
        x = ops.cast(context, wide)
        x = x[..., :half, :] - ops.cast(self.factor(), wide) * x[..., half:, :]
        x = heads.normalize(x, "head", self.epsilon)
        return ops.cast(x * (1.0 - self.lambda_init), dtype)
