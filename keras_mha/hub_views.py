"""The views through which `HubAttention` uses keras-hub's own sublayers
where their shapes are not the layer's: a `Dense` of `N·H` features seen
as heads, one part of a fused projection, a rotary layer that returns
tables, and Gemma 4's rotation of the first part of each half of a head.
Each holds keras-hub's layer itself (nothing is copied), so LoRA, int8
quantization and layout maps act on it as before.

Nothing here imports keras-hub: the layers viewed come from it.
"""

import contextlib

import keras
from keras import ops

from keras_mha import rotary as rotary_lib


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


class HeadsOfFused(keras.layers.Layer):
    """One part of keras-hub's fused projection `dense` `(E, N, P·H)`,
    each head's features the parts in turn: GPT-NeoX's `query_key_value`
    (`[query | key | value]`), Qwen3.5's query (`[query | gate]`). Heads
    `(B, T, N, H)`, the `part`'s `H` of each head's, through `activation`
    if given (the gate's sigmoid). A layer's views of one `dense` share
    one `FusedProjection`, which projects a call's input once for all
    (the layer projects the parts of one input in turn). The `dense` is
    keras-hub's, saved where keras-hub's layer saved it: by the view that
    sits at keras-hub's attribute (`saves_dense`, Qwen3.5's query), else
    under keras-hub's name beside the views (GPT-NeoX's)."""

    saves_dense = False  # set by `HubAttention._present_as`

    def __init__(self, fused, part, activation=None, **kwargs):
        super().__init__(name=f"{fused.dense.name}_{part}",
                         dtype=fused.dense.dtype_policy, **kwargs)
        self.dense = fused.dense  # tracked: `projections.quantize` finds it
        self._fused = fused
        self.part = part
        self.activation = activation
        self.built = True

    def call(self, inputs):
        heads = self._fused.project(inputs, self.part)
        return heads if self.activation is None else self.activation(heads)

    def __dir__(self):
        return [n for n in super().__dir__() if n != "dense"]

    def save_own_variables(self, store):
        if self.saves_dense:
            self.dense.save_own_variables(store)

    def load_own_variables(self, store):
        if self.saves_dense:
            self.dense.load_own_variables(store)


class FusedProjection:
    """keras-hub's fused `(E, N, P·H)` projection of the `parts` (names),
    run once per input for its views: the output of the input last
    projected is kept until each part has been read from it once, then
    dropped, so a later call (new weights, a new trace) projects again."""

    def __init__(self, dense, head_dim, parts):
        self.dense = dense
        self.head_dim = head_dim
        self.parts = tuple(parts)
        self._input = self._output = None
        self._read = set()

    def project(self, inputs, part):
        if self._input is not inputs or part in self._read:
            self._input, self._output = inputs, self.dense(inputs)
            self._read = set()
        self._read.add(part)
        index = self.parts.index(part)
        heads = self._output[..., index * self.head_dim:
                             (index + 1) * self.head_dim]
        if len(self._read) == len(self.parts):
            self._input = self._output = None
        return heads


class HalvesRotation(keras.layers.Layer):
    """keras-hub's rotary layer `rope` turning, of each head of
    `head_dim` features, the first `rotary_dim / 2` of each half: pairs
    `(i, i + H/2)` for `i < rotary_dim / 2`, at the frequencies `rope`
    gives a head of `H` (Gemma 4's proportional rotation; all of the head
    when `rotary_dim` is `H`), the rest as they are. It turns tokens at
    `start_index + t`, or at `positions`, or at the positions `at(...)`
    holds for the length of a call (Gemma 4's blocks hand their
    `position_ids` to the attention layer). `rope` is keras-hub's layer,
    called as it is."""

    def __init__(self, rope, rotary_dim, head_dim, **kwargs):
        super().__init__(name=f"{rope.name}_halves", dtype=rope.dtype_policy,
                         autocast=False, **kwargs)
        self.rope = rope
        self.rotary_dim = int(rotary_dim)
        self.head_dim = int(head_dim)
        self._positions = None
        self.built = True

    @contextlib.contextmanager
    def at(self, positions):
        """Turns the tokens at `positions` `(B, T)` (`None`: at their
        indices) until the block exits."""
        self._positions = positions
        try:
            yield
        finally:
            self._positions = None

    def call(self, inputs, start_index=0, positions=None):
        if positions is None:
            positions = self._positions
        if self.rotary_dim == self.head_dim:
            return self.rope(inputs, start_index=start_index,
                             positions=positions)
        half, turned = self.head_dim // 2, self.rotary_dim // 2
        first, second = inputs[..., :half], inputs[..., half:]
        rotated = self.rope(
            ops.concatenate([first[..., :turned], second[..., :turned]], -1),
            start_index=start_index, positions=positions)
        first_turned, second_turned = ops.split(rotated, 2, axis=-1)
        return ops.concatenate([first_turned, first[..., turned:],
                                second_turned, second[..., turned:]], -1)
