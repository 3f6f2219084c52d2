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
  (the transpose of `ppermute` is the reverse `ppermute`). Chunks of `C`
  that `T / P` holds whole take a halo of none: each shard attends to its
  own tokens, whose chunks start where the global ones do.

- `ring`: any other call without a dense mask or bias passes key/value
  blocks around the devices with an online softmax (`ring.py`); causal
  self-attention in zig-zag order, so every device does the same work.

Positions stay global (docs/design.md, "One sequence over many devices"):
inside a shard the queries sit at `left + t` and the received keys from 0,
which keeps every distance `p - j` of the global call; keys the sequence
does not have (before the first shard, after the last) are masked.
Per-token fields of the spec (`_TOKEN_FIELDS`: padding masks and segment
ids) are split like the tokens and exchanged with the keys; the other
tensors of the spec (sinks) are replicated.
"""

import dataclasses
from typing import Any

from keras import ops

import keras_mha.attention.cache as cache_lib
import keras_mha.attention.partials as partials
import keras_mha.attention.ring as ring

# Spec fields that hold one value per token: (field, side) with side
# "query" (split like the queries) or "key" (split like the keys, and
# exchanged with them).
_TOKEN_FIELDS = (
    ("query_mask", "query"),
    ("segment_ids", "query"),
    ("key_mask", "key"),
    ("key_segment_ids", "key"),
)



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


def check_lengths(plan, query_length, key_length, zigzag=False):
    """A `ValueError` unless `P` divides `T` and `S` (`2P` in zig-zag
    order)."""
    shards = 2 * plan.size if zigzag else plan.size
    what = (
        f"twice the context axis size, {shards}, for causal attention in "
        "zig-zag order" if zigzag else
        f"the context axis size {shards}"
    )
    for name, length in (("T", query_length), ("S", key_length)):
        if length is None or length % shards:
            raise ValueError(
                "Under `ContextParallel` the sequence length must be a "
                f"multiple of {what} (`{plan.context_axis}`). "
                f"Received: {name}={length}"
            )


def uses_zigzag(spec, shapes):
    """Whether the ring takes the tokens in zig-zag order: causal
    self-attention (`T = S`)."""
    return spec.causal and shapes.query_length == shapes.key_length


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
    window's sides capped at what the other shards hold; none with chunks
    (`dispatch.context_route` takes them here when no shard boundary cuts
    one)."""
    if spec.chunk is not None:
        return 0, 0
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


def ring_route(query, key, value, spec, zigzag):
    """Ring attention over the context axis (see `ring.py`).

    Args:
        query: `(B, T, N, H)`, sharded along axis 1 over the context axis.
        key: `(B, S, K, H)`, likewise.
        value: `(B, S, K, V)`.
        spec: the call's spec, with its `sharding` plan.
        zigzag: whether to lay the tokens out in zig-zag order.

    Returns:
        `(B, T, N, V)`, sharded like the query.
    """
    import jax

    plan = spec.sharding
    names, values, specs = _split_spec(spec, plan)

    def local(q, k, v, *fields):
        fields = dict(zip(names, fields))
        local_spec = spec.replace(
            sharding=plan, sinks=fields.get("sinks"),
            **{name: None for name, _ in _TOKEN_FIELDS},
        )
        index = jax.lax.axis_index(plan.context_axis)
        return ring.ring_attention(q, k, v, fields, local_spec, index, zigzag)

    token = _token_spec(plan)
    return _shard_map(
        plan, local, (query, key, value, *values),
        (token, token, token, *specs), token,
    )


def shards_cache(plan, cache):
    """Whether a decoding step reads `cache` with its slots sharded over
    the context axis: a cache (full or rolling) whose slots `P`
    divides."""
    num_slots = cache[0].shape[1]
    return (
        plan is not None and num_slots is not None
        and num_slots % plan.size == 0
    )


def _slot_tokens(slots, start, length, num_slots, rolling):
    """For the global slots `slots` `(L / P,)` of a write of `length`
    tokens from position `start`: `(token, lands, positions)`, the new
    token each slot takes (clipped), whether it takes one, and the
    position each slot holds after the write (negative: none yet)."""
    if rolling:
        positions = cache_lib.slot_positions(start + length, num_slots,
                                             True, slots)
        token = positions - start
        lands = token >= 0
    else:
        positions = slots
        token = slots - start
        lands = ops.logical_and(token >= 0, token < length)
    return ops.clip(token, 0, length - 1), lands, positions


def cached_decode(query, new, spec, cache, index, rolling=False,
                  heads=None):
    """A decoding step over a cache whose slots are sharded.

    Each device writes the new tokens into the slots it holds, attends to
    them, and the devices' parts `(out, lse)` merge by their log-sum-exps
    across the context axis (flash-decoding over devices): only `(B, T, N,
    V + 1)` numbers per device cross the axis, whatever `L` is. A rolling
    cache (slot = position mod L) is sharded the same way: its slots hold
    the last `L` positions, wherever each lies.

    Args:
        query: `(B, T, N, H)`, replicated over the context axis.
        new: the new tokens' tensors, one for each of the cache's but
            `valid`: `(key (B, T, K, H), value (B, T, K, V))`, or a latent
            cache's `(latents, rope_keys)`.
        spec: the call's spec: causal, `key_mask` marks the new real
            tokens, and its `sharding` plan.
        cache: `(..., valid)`, `(B, L, ...)` sharded along axis 1.
        index: the position of the first new token (int or scalar tensor).
        rolling: whether slot = position mod L.
        heads: a function of a device's cache tensors but `valid` (after
            the write) returning its `(keys, values)` `(B, L / P, K, H)`,
            `(B, L / P, K, V)`; `None`: they are the keys and values.

    Returns:
        `(output, new_cache)`: `(B, T, N, V)`, and the cache, sharded as
        it came.
    """
    import jax
    from jax.sharding import PartitionSpec

    plan = spec.sharding
    length = query.shape[1]
    batch_only = PartitionSpec(plan.batch_axis)
    slots_spec = _token_spec(plan)
    new = tuple(new)
    parts = len(new)
    valid = spec.key_mask
    if valid is None:
        valid = ops.ones(ops.shape(new[0])[:2], "bool")
    sinks = None if spec.sinks is None else ops.convert_to_tensor(spec.sinks)
    query_mask = spec.query_mask
    local_spec = spec.replace(sharding=None, key_mask=None, query_mask=None,
                              segment_ids=None, key_segment_ids=None,
                              sinks=None)

    def local(q, *arguments):
        arguments = list(arguments)
        runs = arguments[: parts + 1]  # the new tokens' tensors and valid
        held = arguments[parts + 1 : 2 * parts + 2]  # the device's slots
        start = ops.cast(arguments[2 * parts + 2], "int32")
        extra = arguments[2 * parts + 3 :]
        heads_sinks = extra.pop(0) if sinks is not None else None
        rows = extra.pop(0) if query_mask is not None else None
        device = jax.lax.axis_index(plan.context_axis)
        num_slots = held[0].shape[1]
        slots = device * num_slots + ops.arange(num_slots, dtype="int32")
        token, lands, positions = _slot_tokens(
            slots, start, length, num_slots * plan.size, rolling)
        new_cache = []
        for part, run in zip(held, runs):
            gathered = ops.cast(ops.take(run, token, axis=1), part.dtype)
            where = ops.reshape(lands, (1, num_slots) + (1,) * (part.ndim - 2))
            new_cache.append(ops.where(where, gathered, part))
        written = new_cache[-1]
        if heads is None:
            keys, values = new_cache[:2]
        else:
            keys, values = heads(*new_cache[:-1])
        query_positions = start + ops.arange(length, dtype="int32")
        mask = partials.block_mask(
            local_spec, query_positions, positions, (rows, None),
            (written, None),
        )
        out, lse = partials.part(q, keys, values, local_spec,
                                 query_positions, positions, mask)
        # The devices' parts merged by their log-sum-exps.
        top = jax.lax.stop_gradient(jax.lax.pmax(lse, plan.context_axis))
        scale = ops.exp(lse - top)
        total = jax.lax.psum(scale, plan.context_axis)
        out = jax.lax.psum(out * scale[..., None], plan.context_axis)
        out = out / total[..., None]
        lse = top + ops.log(total)
        out = partials.finish((out, lse), heads_sinks, q.dtype)
        return (out, *new_cache)

    extra, extra_specs = [], []
    if sinks is not None:
        extra.append(sinks)
        extra_specs.append(PartitionSpec())
    if query_mask is not None:
        extra.append(query_mask)
        extra_specs.append(batch_only)
    arguments = (query, *new, valid, *cache,
                 ops.convert_to_tensor(index, "int32"), *extra)
    in_specs = ((batch_only,) * (parts + 2) + (slots_spec,) * (parts + 1)
                + (PartitionSpec(), *extra_specs))
    output, *new_cache = _shard_map(
        plan, local, arguments, in_specs,
        (batch_only,) + (slots_spec,) * (parts + 1),
    )
    return output, tuple(new_cache)
