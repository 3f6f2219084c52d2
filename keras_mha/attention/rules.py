"""Programmable attention: masks and score functions as objects.

A mask says which keys a query may see from absolute positions:
`mask(batch, head, query_position, key_position) -> bool`, `True` = may
attend, on integer index tensors that broadcast against each other (their
exact layout is the algorithm's: only broadcasting may be assumed).
Positions are absolute: a cache's queries sit at `cache_update_index + t`
and its keys at the positions their slots hold. Masks compose with `&`,
`|` and `~`, and every algorithm ANDs them with the call's own arguments.

A score function maps `(score, batch, head, query_position,
key_position)` to a score of the same shape and dtype, after the scale and
the layer's own logit features, before the masks (sinks stay outside it).

Each mask also bounds its blocks (`block_bounds`): for query blocks `i`
and key blocks `j`, whether some entry of the block may be kept (`some`)
and whether all are (`every`), both `(n_q, n_k)` booleans. A composition
combines its parts' bounds; an object with a closed form (causal, window,
chunk, documents, prefix-LM, padding) computes it from the blocks' first
and last positions; a `MaskFunction` is evaluated block by block, or on
the blocks' edges alone when it promises `monotone` structure. The bounds
are conservative: `some` may be `True` for an empty block (it is then
evaluated and masked), never `False` for a kept entry. `BlockMap` is
their readable form.
"""

import keras
import numpy as np
from keras import ops

import keras_mha.attention.block_maps as block_maps


# What a mask object keeps of its own computations: its block bounds per
# grid, the block-sparse path's functions per geometry.
STORES = ("_block_bounds", "_sparse_functions")


class Mask:
    """Which keys each query may see, as a function of positions.

    Subclasses implement `evaluate` and may override `block_bounds`.
    `data` is `True` for a mask that reads tensors of the call (document
    ids, prefix lengths, padding): its block map is then computed per
    call, as tensors where the call is traced, so a compiled step with
    new ids does not recompile. A mask without data has its block map
    computed once on the host, even under tracing, and reused.
    """

    data = False

    def __call__(self, batch, head, query_position, key_position):
        return self.evaluate(batch, head, query_position, key_position)

    def evaluate(self, batch, head, query_position, key_position):
        raise NotImplementedError

    def block_bounds(self, grid):
        """`(some, every)` `(n_q, n_k)` booleans; by default from the mask
        evaluated block by block."""
        return grid.evaluate_blocks(self)

    def __and__(self, other):
        return _And(self, as_mask(other, "other"))

    def __rand__(self, other):
        return _And(as_mask(other, "other"), self)

    def __or__(self, other):
        return _Or(self, as_mask(other, "other"))

    def __ror__(self, other):
        return _Or(as_mask(other, "other"), self)

    def __invert__(self):
        return _Not(self)

    def block_map(self, query_length, key_length=None, block_size=128,
                  batch_size=1, num_heads=1):
        """The mask's `BlockMap` for `T = query_length` queries at
        positions `0 .. T - 1` and `S = key_length` keys (`T` if `None`),
        in square blocks of `block_size`."""
        grid = block_maps.Grid(
            int(query_length), int(key_length or query_length),
            int(block_size), int(batch_size), int(num_heads))
        return block_maps.BlockMap(*block_maps.bounds(self, grid), grid)


class Causal(Mask):
    """Key `j` is visible from position `p` iff `j <= p`."""

    def evaluate(self, batch, head, query_position, key_position):
        return ops.greater_equal(query_position, key_position)

    def block_bounds(self, grid):
        q_first, q_last, k_first, k_last = grid.ranges()
        return k_first <= q_last, k_last <= q_first

    def __repr__(self):
        return "Causal()"


class Window(Mask):
    """Key `j` is visible from position `p` iff `p - left <= j <= p +
    right` (the layer's `sliding_window=(left, right)`)."""

    def __init__(self, left, right=0):
        for name, side in (("left", left), ("right", right)):
            if not isinstance(side, int) or isinstance(side, bool) \
                    or side < 0:
                raise ValueError(
                    f"`Window`'s `{name}` must be an int >= 0. Received: "
                    f"{name}={side!r}"
                )
        self.left, self.right = left, right

    def evaluate(self, batch, head, query_position, key_position):
        distance = query_position - key_position  # p - j
        return ops.logical_and(ops.less_equal(distance, self.left),
                               ops.greater_equal(distance, -self.right))

    def block_bounds(self, grid):
        q_first, q_last, k_first, k_last = grid.ranges()
        some = (k_last >= q_first - self.left) & (k_first <= q_last
                                                   + self.right)
        every = (k_first >= q_last - self.left) & (k_last <= q_first
                                                    + self.right)
        return some, every

    def __repr__(self):
        return f"Window({self.left}, {self.right})"


class Chunk(Mask):
    """Key `j` is visible from position `p` iff `j // size == p // size`
    (chunked attention, Llama 4)."""

    def __init__(self, size):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(
                f"`Chunk`'s `size` must be an int >= 1. Received: "
                f"size={size!r}"
            )
        self.size = size

    def evaluate(self, batch, head, query_position, key_position):
        return ops.equal(ops.floor_divide(query_position, self.size),
                         ops.floor_divide(key_position, self.size))

    def block_bounds(self, grid):
        q_first, q_last, k_first, k_last = (
            np.floor_divide(x, self.size) for x in grid.ranges())
        some = (q_first <= k_last) & (k_first <= q_last)
        every = (q_first == q_last) & (k_first == k_last) & (q_first
                                                             == k_first)
        return some, every

    def __repr__(self):
        return f"Chunk({self.size})"


class Documents(Mask):
    """A query sees only keys of its own document: packed sequences.

    Args:
        ids: integer `(B, L)`, the document of each position (a query's
            and a key's position index it).
        key_ids: `(B, L)` for the keys when they differ (cross-attention);
            `ids` by default.
    """

    data = True

    def __init__(self, ids, key_ids=None):
        self.ids = _integers(ids, "ids")
        self.key_ids = self.ids if key_ids is None else _integers(
            key_ids, "key_ids")

    def evaluate(self, batch, head, query_position, key_position):
        return ops.equal(_at(self.ids, batch, query_position),
                         _at(self.key_ids, batch, key_position))

    def block_bounds(self, grid):
        low_q, high_q = grid.block_extremes(self.ids, grid.query_length)
        low_k, high_k = grid.block_extremes(self.key_ids, grid.key_length)
        low_q, high_q = low_q[:, :, None], high_q[:, :, None]  # (B, n_q, 1)
        low_k, high_k = low_k[:, None, :], high_k[:, None, :]  # (B, 1, n_k)
        some = ops.logical_and(low_q <= high_k, low_k <= high_q)
        every = ops.logical_and(
            ops.logical_and(low_q == high_q, low_k == high_k),
            low_q == low_k)
        return ops.any(some, axis=0), ops.all(every, axis=0)

    def __repr__(self):
        return f"Documents(ids of shape {tuple(self.ids.shape)})"


class PrefixLM(Mask):
    """Prefix-LM: the first `prefix_lengths[b]` positions of sequence `b`
    see each other both ways; the rest is causal (`j <= p` or `j <
    prefix`).

    Args:
        prefix_lengths: integer `(B,)`.
    """

    data = True

    def __init__(self, prefix_lengths):
        self.prefix_lengths = _integers(prefix_lengths, "prefix_lengths",
                                        rank=1)
        self._rule = Causal() | _KeysBelow(self.prefix_lengths)

    def evaluate(self, batch, head, query_position, key_position):
        return self._rule.evaluate(batch, head, query_position, key_position)

    def block_bounds(self, grid):
        return block_maps.bounds(self._rule, grid)

    def __repr__(self):
        return "PrefixLM(prefix_lengths)"


class Padding(Mask):
    """Real tokens only: `query_mask[b, p]` and `key_mask[b, j]` (`True`
    = a real token), each `(B, L)` or `None`. A query that is padding
    sees nothing and gets an output of 0."""

    data = True

    def __init__(self, key_mask=None, query_mask=None):
        self.key_mask = None if key_mask is None else ops.cast(
            key_mask, "bool")
        self.query_mask = None if query_mask is None else ops.cast(
            query_mask, "bool")

    def evaluate(self, batch, head, query_position, key_position):
        result = None
        for tokens, position in ((self.query_mask, query_position),
                                 (self.key_mask, key_position)):
            if tokens is not None:
                real = _at(tokens, batch, position)
                result = real if result is None else ops.logical_and(
                    result, real)
        return ops.ones((), "bool") if result is None else result

    def block_bounds(self, grid):
        some = every = None
        for tokens, length, axis in ((self.query_mask, grid.query_length, 2),
                                     (self.key_mask, grid.key_length, 1)):
            if tokens is None:
                continue
            count_low, count_high = grid.block_extremes(
                ops.cast(tokens, "int32"), length)
            one_some = ops.expand_dims(count_high > 0, axis)  # any real
            one_every = ops.expand_dims(count_low > 0, axis)  # all real
            some = one_some if some is None else ops.logical_and(
                some, one_some)
            every = one_every if every is None else ops.logical_and(
                every, one_every)
        if some is None:
            return grid.everything()
        shape = (grid.num_query_blocks, grid.num_key_blocks)
        some, every = (ops.broadcast_to(x, (x.shape[0],) + shape)
                       for x in (some, every))  # (B, n_q, n_k)
        return ops.any(some, axis=0), ops.all(every, axis=0)

    def __repr__(self):
        return "Padding()"


class DenseMask(Mask):
    """A boolean tensor broadcastable to `(B, N, T, S)`, read at the
    positions (`mask[b, h, p, j]`): what `attention_mask` takes, as a
    mask object. Its block map is evaluated block by block."""

    data = True

    def __init__(self, mask):
        mask = ops.convert_to_tensor(mask)
        if len(mask.shape) != 4:
            raise ValueError(
                "`DenseMask` takes a mask of rank 4, broadcastable to "
                f"(B, N, T, S). Received: mask.shape={tuple(mask.shape)}"
            )
        self.mask = ops.cast(mask, "bool")

    def evaluate(self, batch, head, query_position, key_position):
        sizes = self.mask.shape
        index = 0
        for axis, at in enumerate((batch, head, query_position,
                                   key_position)):
            at = ops.zeros_like(at) if sizes[axis] == 1 else ops.clip(
                at, 0, sizes[axis] - 1)
            index = index * sizes[axis] + at
        return ops.take(ops.reshape(self.mask, (-1,)), index)

    def __repr__(self):
        return f"DenseMask(shape={tuple(self.mask.shape)})"


class MaskFunction(Mask):
    """A mask from any `fn(batch, head, query_position, key_position) ->
    bool` written in `keras.ops` on broadcast index tensors.

    Args:
        fn: the function; it must return a boolean tensor that broadcasts
            against its arguments.
        data: whether `fn` reads tensors of the call (closed over). Its
            block map is then computed per call; without `data`, once, on
            the host, and a function that turns out to read traced
            tensors is refused.
        monotone: a promise that, in every block, the mask is `True` on
            the whole block when it is on the block's four edges, and
            `False` on the whole block when it is on its edges (bands such
            as causal masks and windows, chunk and document boundaries).
            The block map then evaluates the edges alone: O(T·S / b)
            instead of O(T·S).
    """

    def __init__(self, fn, data=False, monotone=False):
        if not callable(fn):
            raise TypeError(
                f"`MaskFunction` takes a callable. Received: fn={fn!r}")
        self.fn, self.data, self.monotone = fn, bool(data), bool(monotone)

    def evaluate(self, batch, head, query_position, key_position):
        result = self.fn(batch, head, query_position, key_position)
        check_mask_result(result, (batch, head, query_position,
                                   key_position), self.fn)
        return result

    def block_bounds(self, grid):
        if self.monotone:
            return grid.evaluate_edges(self)
        return grid.evaluate_blocks(self)

    def __repr__(self):
        name = getattr(self.fn, "__name__", repr(self.fn))
        return f"MaskFunction({name})"


class ScoreFunction:
    """A score modification: `fn(score, batch, head, query_position,
    key_position) -> score`, in `keras.ops`, of the score's shape and
    dtype; applied after the scale and the layer's logit features (soft-cap,
    bias, ALiBi), before the masks."""

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(
                f"`ScoreFunction` takes a callable. Received: fn={fn!r}")
        self.fn = fn

    def __call__(self, score, batch, head, query_position, key_position):
        result = self.fn(score, batch, head, query_position, key_position)
        if not hasattr(result, "shape") or tuple(result.shape) != tuple(
            score.shape
        ) or keras.backend.standardize_dtype(result.dtype) != \
                keras.backend.standardize_dtype(score.dtype):
            raise ValueError(
                "A score function must return a score of the score's shape "
                f"and dtype, {tuple(score.shape)} {score.dtype}. Received: "
                f"{_describe(result)} from score_mod={self.fn!r}"
            )
        return result

    # Two of one function are one: a function passed to each call wraps
    # into a new object, and the sparse path keeps one program per function.
    def __eq__(self, other):
        return isinstance(other, ScoreFunction) and other.fn is self.fn

    def __hash__(self):
        return hash(("ScoreFunction", self.fn))

    def __repr__(self):
        return f"ScoreFunction({getattr(self.fn, '__name__', self.fn)!r})"


def as_mask(value, name="mask_mod"):
    """A `Mask`, from a mask or a plain function (`MaskFunction(fn)`)."""
    if isinstance(value, Mask):
        return value
    if callable(value):
        return MaskFunction(value)
    raise TypeError(
        f"`{name}` must be a `keras_mha` mask (`Causal()`, `Documents(ids)`, "
        f"`MaskFunction(fn)`, ...) or a function of (batch, head, "
        f"query_position, key_position). Received: {name}={value!r}"
    )


def as_score_function(value, name="score_mod"):
    """A `ScoreFunction`, from one or from a plain function."""
    if isinstance(value, ScoreFunction):
        return value
    if callable(value) and not isinstance(value, Mask):
        return ScoreFunction(value)
    raise TypeError(
        f"`{name}` must be a `ScoreFunction` or a function of (score, "
        f"batch, head, query_position, key_position). Received: "
        f"{name}={value!r}"
    )


def check_mask_result(result, arguments, fn):
    """A mask function's result must be boolean and broadcast against its
    arguments; a named `ValueError` otherwise."""
    dtype = getattr(result, "dtype", None)
    if dtype is None or keras.backend.standardize_dtype(dtype) != "bool":
        raise ValueError(
            "A mask function must return a boolean tensor (True = may "
            f"attend). Received: {_describe(result)} from mask_mod={fn!r}"
        )
    shapes = [tuple(x.shape) for x in arguments]
    try:
        np.broadcast_shapes(tuple(result.shape), *[
            tuple(1 if s is None else s for s in shape) for shape in shapes])
    except ValueError:
        raise ValueError(
            "A mask function's result must broadcast against its index "
            f"arguments of shapes {shapes}. Received: "
            f"{_describe(result)} from mask_mod={fn!r}"
        ) from None


def _describe(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return repr(x)


class _And(Mask):
    """Both masks; `_Or` is either. Bounds combine as the masks do."""

    symbol = "&"
    combine = staticmethod(ops.logical_and)
    combine_on_host = staticmethod(np.logical_and)

    def __init__(self, first, second):
        self.parts = (first, second)
        self.data = first.data or second.data

    def evaluate(self, *index):
        return self.combine(*(part.evaluate(*index) for part in self.parts))

    def block_bounds(self, grid):
        (some_a, every_a), (some_b, every_b) = (
            block_maps.bounds(part, grid) for part in self.parts)
        return self._bound(some_a, some_b), self._bound(every_a, every_b)

    def _bound(self, a, b):
        """Bounds stay on the host where both parts' are there."""
        if _is_numpy(a, b):
            return self.combine_on_host(a, b)
        return self.combine(a, b)

    def __repr__(self):
        return f"({self.parts[0]!r} {self.symbol} {self.parts[1]!r})"


class _Or(_And):
    symbol = "|"
    combine = staticmethod(ops.logical_or)
    combine_on_host = staticmethod(np.logical_or)


class _Not(Mask):
    def __init__(self, inner):
        self.inner, self.data = inner, inner.data

    def evaluate(self, *index):
        return ops.logical_not(self.inner.evaluate(*index))

    def block_bounds(self, grid):
        some, every = block_maps.bounds(self.inner, grid)
        return _negate(every), _negate(some)

    def __repr__(self):
        return f"~{self.inner!r}"


class _KeysBelow(Mask):
    """Key `j` is visible iff `j < lengths[b]`."""

    data = True

    def __init__(self, lengths):
        self.lengths = lengths

    def evaluate(self, batch, head, query_position, key_position):
        lengths = ops.take(self.lengths, ops.reshape(
            ops.clip(batch, 0, self.lengths.shape[0] - 1), (-1,)))
        lengths = ops.reshape(lengths, tuple(batch.shape))
        return ops.less(key_position, lengths)

    def block_bounds(self, grid):
        _, _, k_first, k_last = grid.ranges()
        lengths = ops.reshape(self.lengths, (-1, 1, 1))  # (B, 1, 1)
        some = ops.any(ops.less(k_first[None], lengths), axis=0)
        every = ops.all(ops.less(k_last[None], lengths), axis=0)
        shape = (grid.num_query_blocks, grid.num_key_blocks)
        return ops.broadcast_to(some, shape), ops.broadcast_to(every, shape)


def _negate(a):
    return ~a if isinstance(a, np.ndarray) else ops.logical_not(a)


def _is_numpy(*arrays):
    return all(isinstance(x, np.ndarray) for x in arrays)


def _integers(x, name, rank=2):
    x = ops.convert_to_tensor(x)
    if "int" not in keras.backend.standardize_dtype(x.dtype) or len(
        x.shape
    ) != rank:
        raise ValueError(
            f"`{name}` must be an integer tensor of rank {rank}. Received: "
            f"{name} of shape {tuple(x.shape)} and dtype {x.dtype}"
        )
    return ops.cast(x, "int32")


def _at(values, batch, position):
    """`values[b, p]` of `(B, L)` values at broadcast index tensors; a
    position outside `[0, L)` reads the nearest end."""
    size, length = values.shape
    if size == 1:
        batch = ops.zeros_like(batch)
    index = ops.clip(batch, 0, (size or 1) - 1) * length + ops.clip(
        position, 0, length - 1)
    return ops.take(ops.reshape(values, (-1,)), index)


def tensors_of(mask):
    """`(tensors, rebuild)`: the tensors a mask object holds (ids,
    lengths, token masks; not a function's closure), and
    `rebuild(tensors)`, the same mask holding others in their place: what
    a custom-gradient function takes as its arguments."""
    found = []

    def walk(obj):
        if isinstance(obj, Mask):
            return "mask", [(name, walk(value))
                            for name, value in _attributes(obj)]
        if isinstance(obj, tuple):
            return "tuple", [walk(part) for part in obj]
        if _is_tensor(obj):
            found.append(obj)
            return "tensor", len(found) - 1
        return None

    plan = walk(mask)

    def rebuild(tensors):
        def build(obj, plan):
            if plan is None:
                return obj
            kind, parts = plan
            if kind == "tensor":
                return tensors[parts]
            if kind == "tuple":
                return tuple(build(x, p) for x, p in zip(obj, parts))
            copy = object.__new__(type(obj))
            for name, part in parts:
                setattr(copy, name, build(getattr(obj, name), part))
            return copy

        return build(mask, plan)

    return found, rebuild


def signature(mask):
    """What a mask is apart from its tensors' values: its types, static
    parameters and tensors' shapes (a key for functions built for it,
    which take the tensors as arguments: `tensors_of`)."""
    def walk(obj):
        if isinstance(obj, Mask):
            return (type(obj).__name__,) + tuple(
                (name, walk(value)) for name, value in _attributes(obj))
        if isinstance(obj, tuple):
            return tuple(walk(part) for part in obj)
        if _is_tensor(obj):
            return (tuple(obj.shape), str(obj.dtype))
        return obj  # a number, a flag, or a function: itself

    return walk(mask)


def _attributes(mask):
    return [(name, value) for name, value in vars(mask).items()
            if name not in STORES]


def _is_tensor(obj):
    return hasattr(obj, "shape") and hasattr(obj, "dtype")
