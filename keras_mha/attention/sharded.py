"""Context parallelism: attention over a sequence sharded along its axis.

Under `keras_mha.ContextParallel` the layer works on global tensors whose
axis 1 (the tokens) is split over the mesh's context axis into `P` shards
of `T / P` consecutive tokens (axis 0 over the batch axis). `attend`
hands such calls here (`dispatch.context_route`). Each route is a
`jax.shard_map` over the batch and context axes only: inside it a device
sees its own `(B / D, T / P, ...)` block, and any other mesh axis (heads
sharded by a `layout_map`) stays with XLA's automatic partitioning.

- `halo`: a window `(left, right)` needs, besides the shard's own keys,
  the `left` keys before it and the `right` after it. They arrive from the
  neighbouring shards by `ppermute` (several hops when a side is longer
  than a shard), and the shard attends to `left + T / P + right` keys
  locally on the usual paths. Traffic is O(w) rows per device, whatever
  `T` is; the backward pass sends the halo's gradients back the same way
  (the transpose of `ppermute` is the reverse `ppermute`).

Positions stay global (DESIGN.md, "Context parallelism"): inside a shard
the queries sit at `left + t` and the received keys from 0, which keeps
every distance `p - j` of the global call; keys the sequence does not have
(before the first shard, after the last) are masked. Per-token fields of
the spec (`_TOKEN_FIELDS`: padding masks and segment ids) are split like
the tokens and exchanged with the keys; the other tensors of the spec
(sinks) are replicated.
"""

import dataclasses
from typing import Any

from keras import ops

# Spec fields that hold one value per token: (field, side) with side
# "query" (split like the queries) or "key" (split like the keys, and
# exchanged with them).
_TOKEN_FIELDS = (
    ("query_mask", "query"),
    ("segment_ids", "query"),
    ("key_mask", "key"),
    ("key_segment_ids", "key"),
)

HALO = "halo"


@dataclasses.dataclass(frozen=True, eq=False)
class ContextPlan:
    """How the active `ContextParallel` shards a call.

    Attributes:
        mesh: the `jax.sharding.Mesh` of the distribution's device mesh.
        batch_axis: the mesh axis of the batch (axis 0).
        context_axis: the mesh axis of the tokens (axis 1).
        size: `P`, the number of shards along `context_axis`.
    """

    mesh: Any
    batch_axis: str
    context_axis: str
    size: int


def check_lengths(plan, query_length, key_length):
    """A `ValueError` unless `P` divides `T` and `S`."""
    for name, length in (("T", query_length), ("S", key_length)):
        if length is None or length % plan.size:
            raise ValueError(
                "Under `ContextParallel` the sequence length must be a "
                f"multiple of the context axis size {plan.size} "
                f"(`{plan.context_axis}`). Received: {name}={length}"
            )


def _token_spec(plan):
    from jax.sharding import PartitionSpec

    return PartitionSpec(plan.batch_axis, plan.context_axis)


def _shard_map(plan, function, arguments, in_specs, out_specs):
    import jax

    mapped = jax.shard_map(
        function,
        mesh=plan.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={plan.batch_axis, plan.context_axis},
        check_vma=False,
    )
    # Under `jit` always: eager `shard_map` cannot leave mesh axes (a
    # `layout_map`'s heads) to automatic partitioning. Inside a trace the
    # `jit` is inlined.
    return jax.jit(mapped)(*arguments)


def _split_spec(spec, plan):
    """The spec's tensors as shard_map arguments: `(names, values,
    in_specs)`; per-token fields split like the tokens, other tensors
    replicated. Python values stay in the spec."""
    from jax.sharding import PartitionSpec

    names, values, specs = [], [], []
    token_fields = dict(_TOKEN_FIELDS)
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name == "sharding" or not hasattr(value, "shape"):
            continue
        names.append(field.name)
        values.append(ops.convert_to_tensor(value))
        specs.append(
            _token_spec(plan) if field.name in token_fields
            else PartitionSpec()
        )
    return names, values, specs


def _neighbours(x, size, side, plan):
    """The `size` rows next to this shard on `side` ("left": before it,
    "right": after it), `(B, size, ...)`, received from the shards that
    hold them; zeros where the sequence has none.

    Each hop `h` brings rows from shard `i - h` (left) or `i + h` (right);
    the farthest hop sends only the rows needed.
    """
    import jax

    shard = x.shape[1]
    hops = -(-size // shard)
    pieces = []
    for hop in range(1, hops + 1):
        rows = min(shard, size - (hop - 1) * shard)
        if side == "left":
            block = x[:, shard - rows:]  # the last rows of shard i - h
            pairs = [(i, i + hop) for i in range(plan.size - hop)]
        else:
            block = x[:, :rows]  # the first rows of shard i + h
            pairs = [(i, i - hop) for i in range(hop, plan.size)]
        if pairs:
            block = jax.lax.ppermute(block, plan.context_axis, pairs)
        else:  # no shard that far away: nothing to receive
            block = ops.zeros_like(block)
        pieces.append(block)
    if side == "left":
        pieces.reverse()  # farthest first: natural order
    return ops.concatenate(pieces, axis=1)


def halo_sizes(spec, shard_length, plan):
    """`(before, after)`: the rows a shard receives on each side, the
    window's sides capped at what the other shards hold."""
    left, right = spec.window
    most = (plan.size - 1) * shard_length
    return min(left, most), min(right, most)


def halo_attention(query, key, value, spec, local_attend):
    """Sliding-window attention with the halo exchange (see the module).

    Args:
        query: `(B, T, N, H)`, sharded along axis 1 over the context axis.
        key: `(B, T, K, H)`, likewise (self-attention lengths, `S = T`).
        value: `(B, T, K, V)`.
        spec: the call's spec, with a window, keys at their own positions
            and its `sharding` plan.
        local_attend: `attend` for the shard's own call.

    Returns:
        `(B, T, N, V)`, sharded like the query.
    """
    plan = spec.sharding
    shard_length = query.shape[1] // plan.size
    before, after = halo_sizes(spec, shard_length, plan)
    names, values, specs = _split_spec(spec, plan)

    def local(q, k, v, *fields):
        fields = dict(zip(names, fields))
        valid = fields.pop("key_mask", None)
        if valid is None:
            valid = ops.ones(k.shape[:2], "bool")
        keyed = [k, v, ops.cast(valid, "int8")]
        key_ids = fields.get("key_segment_ids")
        if key_ids is not None:
            keyed.append(key_ids)

        def with_halo(x):
            parts = [x]
            if before:
                parts.insert(0, _neighbours(x, before, "left", plan))
            if after:
                parts.append(_neighbours(x, after, "right", plan))
            return ops.concatenate(parts, axis=1) if len(parts) > 1 else x

        keyed = [with_halo(x) for x in keyed]
        k, v, valid = keyed[:3]
        if key_ids is not None:
            fields["key_segment_ids"] = keyed[3]
        # Rows of shards that do not exist arrived as zeros: invalid keys.
        fields["key_mask"] = ops.cast(valid, "bool")
        local_spec = spec.replace(
            sharding=None, query_offset=before, **fields
        )
        output, _ = local_attend(q, k, v, local_spec)
        return output

    token = _token_spec(plan)
    return _shard_map(
        plan, local, (query, key, value, *values),
        (token, token, token, *specs), token,
    )
