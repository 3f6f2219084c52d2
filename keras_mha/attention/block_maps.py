"""Block maps: which blocks of the `T × S` logits a mask skips, keeps whole
and keeps in part (`rules.py`'s masks compute their bounds over a `Grid`;
`sparse.py` visits the blocks they keep).

`some` and `every` are `(n_q, n_k)` booleans: whether some entry of a
block may be kept, and whether all are. They are conservative: `some` may
be `True` for an empty block (which is then evaluated and masked), never
`False` for a kept entry. A mask known before the call has them as NumPy
arrays, computed once on the host (in `capabilities.host_scope`, even
inside a traced call) and kept in the mask's own store; one that reads the
call's data has them as tensors, computed per call.
"""

import collections

import keras
import numpy as np
from keras import ops

import keras_mha.attention.capabilities as capabilities


class Grid(collections.namedtuple(
    "Grid", ["query_length", "key_length", "block", "batch_size",
             "num_heads"])):
    """Queries at positions `0 .. T - 1` over keys `0 .. S - 1`, in
    square blocks of `block`, for `batch_size` sequences and `num_heads`
    heads: what a block map is computed for."""

    @property
    def num_query_blocks(self):
        return -(-self.query_length // self.block)

    @property
    def num_key_blocks(self):
        return -(-self.key_length // self.block)

    def ranges(self):
        """`(q_first (n_q, 1), q_last, k_first (1, n_k), k_last)`, int
        NumPy arrays: the first and last real position of each block."""
        b = self.block
        q_first = np.arange(self.num_query_blocks)[:, None] * b
        k_first = np.arange(self.num_key_blocks)[None, :] * b
        return (q_first, np.minimum(q_first + b - 1, self.query_length - 1),
                k_first, np.minimum(k_first + b - 1, self.key_length - 1))

    def everything(self):
        shape = (self.num_query_blocks, self.num_key_blocks)
        return np.ones(shape, bool), np.ones(shape, bool)

    def block_extremes(self, values, length):
        """`(low, high)` `(B, n)`: each block's least and greatest of the
        `(B, L)` `values` at positions `0 .. length - 1` (the last real
        one repeated into the padding)."""
        values = values[:, :length]
        blocks = -(-length // self.block)
        pad = blocks * self.block - length
        if pad:
            values = ops.concatenate(
                [values, ops.repeat(values[:, -1:], pad, axis=1)], axis=1)
        values = ops.reshape(values, (-1, blocks, self.block))
        return ops.min(values, axis=-1), ops.max(values, axis=-1)

    def _index(self, query_positions, key_positions):
        batch = ops.reshape(ops.arange(self.batch_size, dtype="int32"),
                            (-1, 1, 1, 1))
        head = ops.reshape(ops.arange(self.num_heads, dtype="int32"),
                           (1, -1, 1, 1))
        return (batch, head,
                ops.reshape(ops.convert_to_tensor(query_positions, "int32"),
                            (1, 1, -1, 1)),
                ops.reshape(ops.convert_to_tensor(key_positions, "int32"),
                            (1, 1, 1, -1)))

    def _padded(self, length, blocks):
        return np.minimum(np.arange(blocks * self.block), length - 1)

    def evaluate_blocks(self, mask):
        """`(some, every)` from the mask evaluated on every entry, a few
        query blocks at a time."""
        n_q, n_k, b = self.num_query_blocks, self.num_key_blocks, self.block
        keys = self._padded(self.key_length, n_k)
        queries = self._padded(self.query_length, n_q)
        per_step = max(1, (1 << 22) // (b * b * n_k * self.batch_size
                                         * self.num_heads))
        some, every = [], []
        for start in range(0, n_q, per_step):
            rows = queries[start * b:(start + per_step) * b]
            kept = ops.broadcast_to(
                mask.evaluate(*self._index(rows, keys)),
                (self.batch_size, self.num_heads, len(rows), len(keys)))
            kept = ops.reshape(kept, (self.batch_size, self.num_heads, -1, b,
                                      n_k, b))
            some.append(ops.any(kept, axis=(0, 1, 3, 5)))
            every.append(ops.all(kept, axis=(0, 1, 3, 5)))
        return ops.concatenate(some, 0), ops.concatenate(every, 0)

    def evaluate_edges(self, mask):
        """`(some, every)` from the mask evaluated on each block's first and
        last rows and columns (`MaskFunction(monotone=True)`)."""
        n_q, n_k, b = self.num_query_blocks, self.num_key_blocks, self.block
        q_first, q_last, k_first, k_last = self.ranges()
        size = (self.batch_size, self.num_heads)
        keys = self._padded(self.key_length, n_k)
        queries = self._padded(self.query_length, n_q)
        rows = np.stack([q_first[:, 0], q_last[:, 0]], 1).reshape(-1)
        on_rows = ops.broadcast_to(mask.evaluate(*self._index(rows, keys)),
                                   size + (2 * n_q, n_k * b))
        on_rows = ops.reshape(on_rows, size + (n_q, 2, n_k, b))
        cols = np.stack([k_first[0], k_last[0]], 1).reshape(-1)
        on_cols = ops.broadcast_to(mask.evaluate(*self._index(queries, cols)),
                                   size + (n_q * b, 2 * n_k))
        on_cols = ops.reshape(on_cols, size + (n_q, b, n_k, 2))
        some = ops.logical_or(ops.any(on_rows, axis=(0, 1, 3, 5)),
                              ops.any(on_cols, axis=(0, 1, 3, 5)))
        every = ops.logical_and(ops.all(on_rows, axis=(0, 1, 3, 5)),
                                ops.all(on_cols, axis=(0, 1, 3, 5)))
        return some, every


class BlockMap:
    """Which key blocks each query block skips, keeps whole and keeps in
    part: what the block-sparse path visits.

    Attributes:
        some, every: `(n_q, n_k)` booleans (NumPy, or tensors when the
            mask reads traced data): a block is skipped where `some` is
            `False`, full where `every` is `True`, partial otherwise.
        grid: the `Grid` it was computed for.
    """

    def __init__(self, some, every, grid):
        self.some, self.every, self.grid = some, every, grid

    @property
    def kinds(self):
        """`(n_q, n_k)` int8 NumPy: 0 skipped, 1 partial, 2 full."""
        some, every = (np.asarray(keras.ops.convert_to_numpy(x), bool)
                       for x in (self.some, self.every))
        return np.where(every, 2, np.where(some, 1, 0)).astype(np.int8)

    @property
    def density(self):
        """The fraction of the `T × S` entries in kept blocks."""
        kinds = self.kinds
        q_first, q_last, k_first, k_last = self.grid.ranges()
        area = (q_last - q_first + 1) * (k_last - k_first + 1)
        return float(np.sum(area * (kinds > 0)) / np.sum(area))

    def __repr__(self):
        kinds = self.kinds
        rows = "\n".join("  " + "".join(".#"[k] if k < 2 else "█"
                                        for k in row) for row in kinds[:64])
        return (
            f"BlockMap({kinds.shape[0]}×{kinds.shape[1]} blocks of "
            f"{self.grid.block}: {int(np.sum(kinds == 2))} full, "
            f"{int(np.sum(kinds == 1))} partial, "
            f"{int(np.sum(kinds == 0))} skipped; density "
            f"{self.density:.3f})\n{rows}"
        )


def bounds(mask, grid):
    """`(some, every)` of `mask` over `grid`: NumPy where known on the
    host, tensors where the mask reads traced data.

    A mask without data is computed on the host even inside a traced
    call, once per grid (kept in the mask's own store); one whose function
    turns out to read traced tensors is refused.
    """
    store = mask.__dict__.setdefault("_block_bounds", {})
    if grid in store:
        return store[grid]
    if mask.data:
        some, every = mask.block_bounds(grid)
    else:
        refused = ValueError(
            "The mask reads traced tensors, but its block map was promised "
            "static. Pass `MaskFunction(fn, data=True)` for a mask that "
            f"depends on the call's data. Received: mask_mod={mask!r}")
        try:
            with capabilities.host_scope():
                some, every = mask.block_bounds(grid)
        except ValueError:  # the function's own result, named
            raise
        except Exception as error:  # a traced tensor out of its graph
            raise refused from error
        if not (_concrete(some) and _concrete(every)):
            raise refused
    some, every = (_as_numpy_if_concrete(x, grid) for x in (some, every))
    if isinstance(some, np.ndarray) and isinstance(every, np.ndarray):
        store[grid] = (some, every)
    return some, every


def _concrete(x):
    return isinstance(x, np.ndarray) or capabilities.is_concrete(x)


def _as_numpy_if_concrete(x, grid):
    shape = (grid.num_query_blocks, grid.num_key_blocks)
    if isinstance(x, np.ndarray):
        return np.broadcast_to(x, shape).copy()
    if capabilities.is_concrete(x):
        return np.broadcast_to(
            np.asarray(keras.ops.convert_to_numpy(x), bool), shape).copy()
    return ops.broadcast_to(x, shape)


def visit_lists(keep):
    """`(cols, counts)` of a boolean `(n, m)` map: row `i` keeps the
    columns `cols[i, :counts[i]]`, ascending (int32 tensors)."""
    m = keep.shape[1]
    keep = ops.convert_to_tensor(keep)
    at = ops.arange(m, dtype="int32")[None, :]
    order = ops.where(keep, at, at + m)
    cols = ops.mod(ops.sort(order, axis=-1), m)
    return cols, ops.sum(ops.cast(keep, "int32"), axis=-1)
