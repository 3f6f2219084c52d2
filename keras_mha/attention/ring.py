"""Ring attention: full attention over a sequence sharded on a context axis.

Each of the `P` devices keeps its queries and passes its block of keys and
values (with their padding masks and segment ids) to the next device,
`P - 1` times, so every query block meets every key block once. Each step
gives a part `(out, lse)` over the keys at hand, merged with the parts
before by their log-sum-exps (`partials.py`, an online softmax over the
ring). Per device, keys and values take O(S / P) memory, and the scores
of one pair of blocks exist at a time.

Causal self-attention would leave the first device idle after one step
and the last busy at every step. In zig-zag order the sequence is cut into
`2P` chunks and device `i` holds chunks `i` and `2P - 1 - i`: at each ring
step after the first, a device either attends with both its query chunks
to the first chunk it received (which lies before both), or with its
second query chunk to both received chunks (which lie between its own),
the same work either way. The tokens are moved into zig-zag order on
entry and back on exit by `ppermute`, so the layer's caller sees the
natural order.

Positions are global: a device computes its queries' positions and those
of the keys it holds from the device indices, and every mask, ALiBi term
and causal comparison uses them.
"""

from keras import ops

import keras_mha.attention.partials as partials


def zigzag_moves(size):
    """The chunk moves into zig-zag order: `{(half, slot): pairs}`.

    In natural order device `s` holds chunks `2s` (half 0) and `2s + 1`
    (half 1) of `2P`; in zig-zag order device `d` holds chunk `d` (slot 0)
    and chunk `2P - 1 - d` (slot 1). Each value lists the `(source,
    destination)` devices of the chunks that go from `half` to `slot`:
    one `ppermute` each.
    """
    moves = {}
    for chunk in range(2 * size):
        source, half = divmod(chunk, 2)
        if chunk < size:
            destination, slot = chunk, 0
        else:
            destination, slot = 2 * size - 1 - chunk, 1
        moves.setdefault((half, slot), []).append((source, destination))
    return moves


def _move(x, moves, axis, inverse):
    """Reorders the two chunks of every device's `x` `(B, 2c, ...)`."""
    import jax

    pieces = ops.split(x, 2, axis=1)
    result = [None, None]
    for (half, slot), pairs in moves.items():
        source, target = (slot, half) if inverse else (half, slot)
        if inverse:
            pairs = [(b, a) for a, b in pairs]
        moved = jax.lax.ppermute(pieces[source], axis, pairs)
        result[target] = moved if result[target] is None else ops.add(
            result[target], moved
        )  # the devices that receive nothing here got zeros
    return ops.concatenate(result, axis=1)


def ring_attention(query, key, value, fields, spec, index, zigzag):
    """One device's part of ring attention (inside `shard_map`).

    Args:
        query: `(B, T/P, N, H)`, this device's queries in natural order.
        key: `(B, S/P, K, H)`.
        value: `(B, S/P, K, V)`.
        fields: this device's per-token spec fields by name (`query_mask`,
            `segment_ids`, `key_mask`, `key_segment_ids`, when given).
        spec: the call's spec (its sinks already local).
        index: this device's index on the context axis (a scalar tensor).
        zigzag: whether the tokens go into zig-zag order (causal
            self-attention, `T = S`).

    Returns:
        `(B, T/P, N, V)` in the query's dtype, natural order.
    """
    import jax

    plan = spec.sharding
    size, axis = plan.size, plan.context_axis
    t_local, s_local = query.shape[1], key.shape[1]
    query_tokens = [fields.get("query_mask"), fields.get("segment_ids")]
    key_tokens = [fields.get("key_mask"), fields.get("key_segment_ids")]
    moves = zigzag_moves(size) if zigzag else None

    def into(x):
        return x if x is None or not zigzag else _into(x, moves, axis)

    query, key, value = into(query), into(key), into(value)
    query_tokens = [into(x) for x in query_tokens]
    key_tokens = [into(x) for x in key_tokens]
    index = ops.cast(index, "int32")
    query_positions = _positions(index, t_local, size, zigzag)
    batch = ops.shape(query)[0]
    num_heads, value_dim = query.shape[2], value.shape[3]
    chunk = t_local // 2

    def visible(held, q_rows, k_rows, source):
        """The part of query rows `q_rows` over key rows `k_rows` of the
        keys `held` from device `source` (slices of the local layout)."""
        keys, values, tokens = held
        key_positions = _positions(source, s_local, size, zigzag)[k_rows]
        mask = partials.block_mask(
            spec, query_positions[q_rows], key_positions,
            [None if x is None else x[:, q_rows] for x in query_tokens],
            [None if x is None else x[:, k_rows] for x in tokens],
        )
        return partials.part(
            query[:, q_rows], keys[:, k_rows], values[:, k_rows], spec,
            query_positions[q_rows], key_positions, mask,
        )

    every = slice(None)
    first, second = slice(0, chunk), slice(chunk, None)
    ring_pairs = [(i, (i + 1) % size) for i in range(size)]

    def step(carry, step_index):
        held, total = carry
        held = jax.tree_util.tree_map(
            lambda x: _ppermute_any(x, axis, ring_pairs), held
        )
        source = (index - step_index) % size
        if not zigzag:
            current = visible(held, every, every, source)
        else:
            def earlier(held):
                # The received chunk `source < index` precedes both query
                # chunks; its other chunk follows both.
                return visible(held, every, first, source)

            def later(held):
                # Both received chunks lie between this device's two:
                # only the second query chunk sees them.
                empty = partials.empty(batch, chunk, num_heads, value_dim)
                out, lse = visible(held, second, every, source)
                return (ops.concatenate([empty[0], out], axis=1),
                        ops.concatenate([empty[1], lse], axis=1))

            current = jax.lax.cond(source < index, earlier, later, held)
        return (held, partials.merge(total, current)), None

    # Step 0: the device's own keys; then `P - 1` steps around the ring,
    # one compiled body whatever `P` is.
    held = (key, value, key_tokens)
    total = visible(held, every, every, index)
    if size > 1:
        (_, total), _ = jax.lax.scan(
            step, (held, total), ops.arange(1, size, dtype="int32")
        )
    out = partials.finish(total, spec.sinks, query.dtype)
    if zigzag:
        out = _move(out, moves, axis, True)
    return out


def _into(x, moves, axis):
    """`x` `(B, 2c, ...)` moved into zig-zag order (`_move`), booleans
    too."""
    is_bool = x.dtype == "bool"
    moved = _move(ops.cast(x, "int8") if is_bool else x, moves, axis, False)
    return ops.cast(moved, "bool") if is_bool else moved


def _ppermute_any(x, axis, pairs):
    import jax

    if x.dtype == "bool":
        return ops.cast(jax.lax.ppermute(ops.cast(x, "int8"), axis, pairs),
                        "bool")
    return jax.lax.ppermute(x, axis, pairs)


def _positions(index, length, size, zigzag):
    """The global positions `(length,)` of device `index`'s tokens."""
    if not zigzag:
        return ops.arange(length, dtype="int32") + index * length
    chunk = length // 2
    local = ops.arange(chunk, dtype="int32")
    return ops.concatenate(
        [local + index * chunk, local + (2 * size - 1 - index) * chunk]
    )
