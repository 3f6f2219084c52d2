"""The key/value cache for decoding, as pure functions of plain tensors.

Layout: a tuple `(keys, values, valid)` of three tensors, each slot a run
of its own: `keys` `(B, L, K, H)` and `values` `(B, L, K, V)` in the compute
dtype, and `valid` `(B, L)` boolean, true where a real (unpadded) token was
written. Keeping padding in the cache means a left-padded prompt stays
masked for every later decoding step. Apart, each tensor is read where it
lies: a product with the keys reads no values, and the sum of the weighted
values reads no keys, where one `(B, L, K, H + V + 1)` tensor would be
read whole by both.

Positions: a full cache stores position `p` in slot `p`. A rolling cache
(causal sliding window `w`) has `L = w` slots and stores position `p` in
slot `p mod w`, so it never grows. Which position a slot holds is derived
from the write index alone; nothing else is stored.

Ownership: the caller owns the cache it passes. By default a write is
functional: it returns new tensors and leaves the ones it was given as
they were (readable on JAX, unchanged on every backend), as keras-hub's
layer does. A cache made with `in_place=True` (`zeros`, `mark_in_place`)
is the layer's to update, and the value says so itself: it is an
`InPlaceCache` (`InPlaceLatentCache`, or `InPlacePairCache` around
keras-hub's one tensor), a named tuple of the same tensors. An eager write
into one touches the new slots only, in the buffers themselves
(`cache_kernels.write_slots`: torch, eager JAX, eager TensorFlow), and
returns a cache of the same type, so the opt-in follows the cache from
call to call. Nothing is recorded anywhere: a plain tuple of the same
tensors is the caller's, and its writes are functional. Named tuples are
pytrees to `keras.tree`, `jax.jit`, `tf.function` and `torch.compile`, so
the type survives a layer's call and a compiled step; traced writes stay
functional in both modes (XLA reuses a donated buffer). `decode.py` reads
the cache a block of slots at a time, each block one contiguous run.
"""

import numbers
import typing

from keras import ops

import keras_mha.attention.cache_kernels as cache_kernels
import keras_mha.attention.capabilities as capabilities


def concrete_int(x):
    """`x` as a Python int when it has a value (a Python int, or a tensor in
    an eager call); `None` when it is traced (`jax.jit`, `tf.function`,
    `torch.compile`). Under `torch.compile` a tensor's value would be read
    with a graph break, and the step recompiled for every new value."""
    if isinstance(x, numbers.Integral):
        return int(x)
    if capabilities.compiling_one_graph():
        return None
    try:
        return int(ops.convert_to_numpy(x))
    except Exception:  # a tracer or a symbolic tensor: no value yet
        return None


def cache_shapes(batch_size, num_slots, num_kv_heads, key_dim, value_dim):
    """The shapes of `(keys, values, valid)`."""
    return (
        (batch_size, num_slots, num_kv_heads, key_dim),
        (batch_size, num_slots, num_kv_heads, value_dim),
        (batch_size, num_slots),
    )


def zeros(batch_size, num_slots, num_kv_heads, key_dim, value_dim, dtype,
          in_place=False):
    """An empty cache: zero keys and values in `dtype`, no valid slot;
    with `in_place`, one the layer may update in place
    (`mark_in_place`)."""
    keys, values, valid = cache_shapes(
        batch_size, num_slots, num_kv_heads, key_dim, value_dim
    )
    cache = (
        ops.zeros(keys, dtype), ops.zeros(values, dtype),
        ops.zeros(valid, "bool"),
    )
    return mark_in_place(cache) if in_place else cache


class InPlaceCache(typing.NamedTuple):
    """`(keys, values, valid)` that calls may write in place (see the
    module's docstring); `tuple(cache)` is the same tensors, the
    caller's."""

    keys: typing.Any
    values: typing.Any
    valid: typing.Any


class InPlaceLatentCache(typing.NamedTuple):
    """A latent cache `(latents, rope_keys, valid)` that calls may write in
    place (`keras_mha.attention.latent`)."""

    latents: typing.Any
    rope_keys: typing.Any
    valid: typing.Any


class InPlacePairCache(typing.NamedTuple):
    """keras-hub's one `(B, 2, S, K, H)` cache tensor, which calls may
    write in place; `cache.keys_and_values` is the tensor."""

    keys_and_values: typing.Any


_IN_PLACE_TYPES = (InPlaceCache, InPlaceLatentCache, InPlacePairCache)


def mark_in_place(cache, kind=None):
    """`cache` (a tensor, or a tuple of tensors) as a cache calls may write
    in place: the same tensors in `kind` (an `InPlace*Cache` type; by
    default `InPlacePairCache` for a tensor, `InPlaceCache` for a tuple).
    The tensors are not touched. A cache whose tensors no in-place kernel
    serves (NumPy, torch with gradients, traced tensors) comes back as it
    was: its writes stay functional."""
    if is_in_place(cache):
        return cache
    pair = not isinstance(cache, (tuple, list))
    tensors = (cache,) if pair else tuple(cache)
    if not all(cache_kernels.can_write_slots(t) for t in tensors):
        return cache
    if kind is None:
        kind = InPlacePairCache if pair else InPlaceCache
    return kind(*tensors)


def is_in_place(cache):
    """Whether `cache` is one calls may write in place (`mark_in_place`):
    a property of the value, whatever its tensors. An eager write then
    writes into them; a traced one (`jax.jit`, `tf.function`,
    `torch.compile`) is functional, and returns a cache of the same
    type."""
    return isinstance(cache, _IN_PLACE_TYPES)


def pair_tensor(cache):
    """keras-hub's cache tensor of `cache`: `cache` itself, or that of an
    `InPlacePairCache`."""
    return cache.keys_and_values if isinstance(cache, InPlacePairCache) \
        else cache


def slot_positions(index, num_slots, rolling, slots=None):
    """Positions held by each slot before writing at `index`: `(L,)`, or
    of the slots `slots` only.

    A slot that holds no written position gets a negative position (a full
    cache's slots at or after `index` are stale or empty as well).
    """
    if slots is None:
        slots = ops.arange(num_slots, dtype="int32")
    index = ops.cast(index, "int32")
    if not rolling:
        return ops.where(slots < index, slots, -1)
    # The newest position p < index with p = slot (mod L); negative if none.
    return index - 1 - ops.mod(index - 1 - slots, num_slots)


def write(cache, key, value, valid, index, rolling):
    """Writes `T` new tokens at positions `index .. index+T-1`: into new
    tensors, or into the cache's own for an in-place cache in an eager
    call (see the module's docstring); the result is a cache of the same
    type.

    Args:
        cache: `(keys, values, valid)`, `(B, L, K, H)`, `(B, L, K, V)`,
            `(B, L)`.
        key: `(B, T, K, H)`.
        value: `(B, T, K, V)`.
        valid: `(B, T)` boolean, or `None` (all valid).
        index: absolute position of the first new token (int or tensor).
        rolling: whether slot = position mod L.

    Returns:
        The updated cache. With a rolling cache and `T > L`, only the last
        `L` tokens are kept.
    """
    in_place = _writes_in_place(cache)
    result = _write(cache, key, value, valid, index, rolling, in_place)
    if in_place and capabilities.tensors_carry_gradient_history():
        # A ring's select carries the new tokens' gradient history; an
        # in-place cache holds none (its writes run without gradients).
        result = tuple(t.detach() if t.requires_grad else t for t in result)
    return type(cache)(*result) if is_in_place(cache) else result


def _write(cache, key, value, valid, index, rolling, in_place):
    old_keys, old_values, old_valid = cache
    num_slots, length = old_keys.shape[1], key.shape[1]
    if rolling and length is not None and length > num_slots:
        # Only the last `L` tokens land: the rest would be overwritten.
        skip = length - num_slots
        key, value = key[:, skip:], value[:, skip:]
        valid = None if valid is None else valid[:, skip:]
        index, length = index + skip, num_slots
    if valid is None:
        valid = ops.ones(ops.shape(key)[:2], dtype="bool")
    new = (
        ops.cast(key, old_keys.dtype), ops.cast(value, old_values.dtype),
        ops.cast(valid, old_valid.dtype),
    )
    if not rolling or length == 1:
        # One contiguous run of slots: O(T), not O(L); in place on torch
        # (no gradient), and under `jax.jit` with the cache donated or XLA.
        if rolling:
            start = ops.mod(ops.cast(index, "int32"), num_slots)
        else:
            start = index
        fits = None
        if not rolling:  # one guard for the three
            start, fits = _guarded(start, length, num_slots, in_place)
        shared = {}
        return tuple(
            _write_run(part, run, start, fits=fits, shared=shared,
                       in_place=in_place)
            for part, run in zip(cache, new)
        )
    index = ops.cast(index, "int32")
    # Several tokens in a ring: the newest one landing in each slot
    # (negative: none), so a prompt longer than `L` keeps its last `L`.
    slots = ops.arange(num_slots, dtype="int32")
    source = length - 1 - ops.mod(index + length - 1 - slots, num_slots)
    written = ops.logical_and(source >= 0, source < length)  # (L,)
    source = ops.clip(source, 0, length - 1)
    result = []
    for part, run in zip(cache, new):
        gathered = ops.take(run, source, axis=1)
        where = ops.reshape(written, (1, num_slots) + (1,) * (run.ndim - 2))
        result.append(ops.where(where, gathered, part))
    return tuple(result)


def _write_run(cache, new, start, axis=1, fits=None, shared=None,
               in_place=False):
    """`new` written into slots `[start, start + T)` of `axis` of one
    tensor: into the tensor itself where `in_place` (`_writes_in_place`).

    A full cache's index is checked when it has a value
    (`keras_mha/checks/cache.py`). Traced, an out-of-range run (`start < 0`
    or past the last slot) writes nothing on every backend, rather than the
    clamped slots that `dynamic_update_slice` would write: `fits` is then
    the caller's guard (`_guard`), `None` where the run fits (a rolling
    cache's slot, a checked index). `shared`: a dict in which the runs of
    one write keep their start indices by rank, so the tensors written
    alike share one (a graph op per write instead of one per slice and per
    write).
    """
    if in_place:
        return cache_kernels.write_slots(cache, new, start, axis)
    rank = len(cache.shape)
    indices = None if shared is None else shared.get(rank)
    if indices is None:
        indices = _start_indices(start, rank, axis)
        if shared is not None:
            shared[rank] = indices
    if fits is not None:
        # A gather, not `ops.slice`: XLA under TensorFlow compiles a slice's
        # start as a constant, so a traced index would recompile the step
        # for every value (`tests/test_compile.py`).
        slots = ops.cast(start, "int32") + ops.arange(
            new.shape[axis], dtype="int32"
        )
        old = ops.take(cache, slots, axis=axis)
        new = ops.where(fits, new, old)
    if capabilities.slice_update_writes_input():
        # Copy, so the caller's cache stays as it was.
        cache = ops.copy(cache)
    return ops.slice_update(cache, indices, new)


def _start_indices(start, rank, axis):
    """The start of a run from slot `start` along `axis` in each axis of a
    tensor of `rank`: a tuple, or one int32 tensor for a tensor `start`."""
    if isinstance(start, int):
        indices = [0] * rank
        indices[axis] = start
        return tuple(indices)
    indices = [ops.zeros((), "int32")] * rank
    indices[axis] = ops.cast(start, "int32")
    return ops.stack(indices)


def _guarded(start, length, num_slots, in_place):
    """`(start, fits)` for `_write_run`: a tensor `start` guarded
    (`_guard`) unless the write is `in_place` (an eager call, whose index
    `checks.cache_index` checked); `fits` is `None` otherwise."""
    if isinstance(start, int) or in_place:
        return start, None
    value = concrete_int(start)
    if value is not None:  # eager: `checks.cache_index` checked it
        return value, None
    return _guard(start, length, num_slots)


def _guard(start, length, num_slots):
    """`(start, fits)` of a run of `length` slots from a tensor `start`:
    clamped into the cache, and whether it fitted as it was."""
    start = ops.cast(start, "int32")
    clamped = ops.clip(start, 0, num_slots - length)
    return clamped, ops.equal(clamped, start)  # 3 graph ops, not 6


def _writes_in_place(cache, in_place=None):
    """Whether `cache_kernels.write_slots` writes into the tensors of
    `cache` themselves: an in-place cache (`is_in_place`, or `in_place`
    where given, for keras-hub's bare tensor) whose every tensor the
    kernel serves now (`cache_kernels.can_write_slots`), outside
    `torch.compile` (a compiled write is functional, as under
    `jax.jit`)."""
    if in_place is None:
        in_place = is_in_place(cache)
    tensors = cache if isinstance(cache, tuple) else (cache,)
    return (
        in_place and not capabilities.compiling_one_graph()
        and all(cache_kernels.can_write_slots(t) for t in tensors)
    )


def write_pair(cache, key, value, index, halves=True, in_place=False):
    """keras-hub's cache `(B, 2, S, K, H)` with `key` and `value`
    `(B, T, K, H)` written at slots `index .. index + T - 1`; `in_place`:
    whether the tensor is that of an `InPlacePairCache` (`pair_tensor`).

    Returns:
        `(cache, keys, values)`: the updated cache tensor and its
        `(B, S, K, H)` keys and values. Where the write is in place (an
        in-place cache in an eager call) or `halves` is false, keys and
        values are `None`: the cache's halves hold them, sliced only where
        needed (an eager TensorFlow slice copies). Elsewhere (traced, for
        a step that reads the whole cache) the keys and the values are
        written separately and stacked, as keras-hub does: the attention
        then reads them without slicing the stacked cache (a transpose of
        a separate half is cheaper than one out of the stacked cache). Stacking copies the cache, so a step that reads the
        slots below its position writes one run in place instead. One
        traced token is written by a select over the slots instead of a
        guarded `slice_update` on TensorFlow and torch, where it is the
        faster of the two in a compiled `generate`; on JAX the guarded
        write is.
    """
    in_place = _writes_in_place(cache, in_place)
    key, value = ops.cast(key, cache.dtype), ops.cast(value, cache.dtype)
    if (
        halves and key.shape[1] == 1 and not isinstance(index, int)
        and capabilities.select_writes_traced_token()
        and not in_place
    ):
        # One token, traced: a select over the slots writes it, and writes
        # nothing for an index out of range, with no guard to build.
        hit = ops.equal(
            ops.arange(cache.shape[2], dtype="int32"), ops.cast(index, "int32")
        )
        hit = ops.reshape(hit, (1, -1, 1, 1))  # (1, S, 1, 1)
        keys = ops.where(hit, key, cache[:, 0])
        values = ops.where(hit, value, cache[:, 1])
        return ops.stack([keys, values], axis=1), keys, values
    index, fits = _guarded(index, key.shape[1], cache.shape[2], in_place)
    if not halves or in_place:
        new = ops.stack([key, value], axis=1)  # (B, 2, T, K, H)
        return _write_run(cache, new, index, axis=2, fits=fits,
                          in_place=in_place), None, None
    shared = {}  # both halves
    keys = _write_run(cache[:, 0], key, index, fits=fits, shared=shared)
    values = _write_run(cache[:, 1], value, index, fits=fits, shared=shared)
    return ops.stack([keys, values], axis=1), keys, values


def attend_inputs(cache, key, value, key_mask, index, rolling):
    """What a call with a cache attends to, and the cache after its write.

    Keys are the cache's slots as they were before this call followed by
    the new tokens, so a rolling cache can take a prompt longer than its
    window in one call.

    Args:
        cache: `(keys, values, valid)` (see the module's docstring).
        key: the new tokens' keys `(B, T, K, H)`.
        value: their values `(B, T, K, V)`.
        key_mask: `None` or boolean `(B, T)`, the new tokens that are real.
        index: the position of the first new token.
        rolling: whether slot = position mod L.

    Returns:
        `(keys, values, keys_valid, key_positions, new_cache)`: keys
        `(B, L + T, K, H)`, values `(B, L + T, K, V)`, boolean
        `(B, L + T)`, integer `(L + T,)` (negative: no token) and the cache.
    """
    old_key, old_value, old_valid = cache
    num_slots, length = old_key.shape[1], ops.shape(key)[1]
    index = ops.cast(index, "int32")
    old_positions = slot_positions(index, num_slots, rolling)
    new_positions = index + ops.arange(length, dtype="int32")
    new_valid = key_mask
    if new_valid is None:
        new_valid = ops.ones(ops.shape(key)[:2], dtype="bool")
    keys_valid = ops.concatenate(
        [old_valid, ops.cast(new_valid, "bool")], axis=1
    )  # (B, L + T)
    key_positions = ops.concatenate([old_positions, new_positions])
    keys = ops.concatenate([ops.cast(old_key, key.dtype), key], axis=1)
    values = ops.concatenate([ops.cast(old_value, value.dtype), value], axis=1)
    new_cache = write(cache, key, value, new_valid, index, rolling)
    return keys, values, keys_valid, key_positions, new_cache
