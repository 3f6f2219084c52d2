"""nGPT's learned scales in a `transformers` attention module (Dory), read
into the layer.

nGPT stores a learned scale as `s` and uses `s · scale`, a fixed `scale`
the module keeps beside it. Dory's module holds two, each `(N·H,)`:

- `sqk`, with `sqk_scale`: the queries, after the rotary embedding, times
  `(sqk · sqk_scale)²`, one factor per head's feature. A rotation mixes
  the features of each pair it turns, so the factor cannot move into the
  query projection: it is the layer's `query_scale` (`use_query_scale`).
- `s_gate`, with `s_gate_scale`: the output gate's argument times
  `(s_gate · s_gate_scale)²` before its sigmoid, one factor per output of
  the gate projection, which folds into that projection's rows.

Nothing here imports torch or `transformers`.
"""

import dataclasses

from keras_mha import host


def query_scale(module, used, size):
    """The `(N·H,)` factors of the queries after the rotary embedding, or
    `None` for a module without `sqk` (or one not of `size`, which leaves
    `sqk` unread)."""
    factors = _factors(module, "sqk")
    if factors is None or factors.shape[0] != size:
        return None  # `sqk` unread: refused by name
    used.add("sqk")
    return factors.astype("float32")


def folded_gate(module, used, gate):
    """The gate's `Dense` (one row per head's feature) with `s_gate`'s
    factors folded into its rows and bias, or `gate` as it is for a module
    without `s_gate` (or without a gate, which leaves `s_gate` unread)."""
    factors = None if gate is None else _factors(module, "s_gate")
    if factors is None or factors.shape[0] != gate.weight.shape[0]:
        return gate  # `s_gate` unread: refused by name
    used.add("s_gate")
    return dataclasses.replace(
        gate, weight=gate.weight * factors[:, None],
        bias=None if gate.bias is None else gate.bias * factors)


def _factors(module, name):
    """`(s · scale)²` of the parameter `name` and its `name_scale`, or
    `None` where the module lacks either."""
    parameter = dict(module.named_parameters(recurse=False)).get(name)
    scale = getattr(module, f"{name}_scale", None)
    if parameter is None or not isinstance(scale, (int, float)):
        return None
    return (host.to_numpy(parameter).astype("float64") * float(scale)) ** 2
