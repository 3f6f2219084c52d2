"""Backend kernels of the cache's writes (`cache.py`).

In place: `ops.slice_update` copies the whole cache in an eager call
(torch clones it; JAX arrays are immutable), O(L) per token.
`write_slots` writes the `T` new slots of each of its tensors in place
instead: torch's `copy_` into the slots, TensorFlow's `InplaceUpdate`, and
on JAX a jitted `dynamic_update_slice` that donates the tensor, so XLA
reuses its buffer.

A functional write is `ops.slice_update`'s (`cache.py`): a new tensor in
memory the backend's allocator gives. This module keeps no memory of its
own; how to let the allocator reuse a dropped cache's memory on the CPU is
in docs/performance.md.

Each function imports its backend.
"""

import functools


def write_slots(cache, new, start, axis=1):
    """`cache` with `new` written into slots `[start, start + T)` of
    `axis` (`T = new.shape[axis]`), in place where the backend allows it.

    torch and TensorFlow: the same tensor comes back, its slots written.
    JAX (eager calls only): the cache passed in is donated and must not be
    used again. `start` is an int or a scalar tensor whose range the
    caller checked.
    """
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        with torch.no_grad():
            cache.narrow(axis, int(start), new.shape[axis]).copy_(new)
        return cache
    if backend == "tensorflow":
        return _tf_write_rows(cache, new, start, axis)
    return _jax_update(axis)(cache, new.astype(cache.dtype), start)


def can_write_slots(cache):
    """Whether `write_slots` serves this cache: torch without gradients;
    a concrete (not traced) JAX array; an eager TensorFlow tensor (not a
    variable) while no gradient tape records."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        return not cache.requires_grad
    if backend == "jax":
        import jax

        return not isinstance(cache, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf

        try:
            from tensorflow.python.eager import record
        except ImportError:  # a TensorFlow without it: write functionally
            return False
        return (
            tf.executing_eagerly()
            and isinstance(cache, tf.Tensor)
            and hasattr(cache, "numpy")  # an EagerTensor, not symbolic
            and not record.could_possibly_record()
        )
    return False


def _tf_write_rows(cache, new, start, axis):
    """TensorFlow's in-place write: `InplaceUpdate` on a reshaped view.

    An eager tensor is immutable to `tf.tensor_scatter_nd_update` and
    `slice_update`, which copy it whole, O(L) a token. `InplaceUpdate`
    writes rows of its input's own buffer, which `reshape` shares; the
    cache as rows `(prod(shape[:axis + 1]), prod(shape[axis + 1:]))` takes
    the new slots as whole rows, O(T).
    """
    import math

    import tensorflow as tf

    shape = tuple(cache.shape)
    outer, length = math.prod(shape[:axis]), new.shape[axis]
    row = math.prod(shape[axis + 1 :])
    rows = (
        tf.range(outer)[:, None] * shape[axis]
        + tf.cast(start, "int32")
        + tf.range(length)[None, :]
    )
    flat = tf.reshape(cache, (outer * shape[axis], row))
    tf.raw_ops.InplaceUpdate(
        x=flat, i=tf.reshape(rows, (-1,)),
        v=tf.reshape(tf.cast(new, cache.dtype), (outer * length, row)),
    )
    return cache


@functools.lru_cache(maxsize=8)
def _jax_update(axis):
    """A jitted write of `new` into slots `[start, start + T)` of the
    cache's own buffer, donated (it is deleted)."""
    import jax

    @functools.partial(jax.jit, donate_argnums=(0,))
    def update(cache, new, start):
        return jax.lax.dynamic_update_slice(
            cache, new, _jax_starts(cache.ndim, axis, start))

    return update


def _jax_starts(rank, axis, start):
    import jax

    zero = jax.numpy.zeros((), "int32")
    starts = [zero] * rank
    starts[axis] = jax.numpy.asarray(start, "int32")
    return tuple(starts)


def write_rows(flat, rows, new):
    """`new` `(n, ...)` written into rows `rows` `(n,)` of `flat` `(R,
    ...)` in place: a paged cache's new slots (`paged.write`). torch's
    `index_copy_`, TensorFlow's `InplaceUpdate` (`can_write_rows`).
    Returns `flat`."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        with torch.no_grad():
            flat.index_copy_(0, rows.to(torch.long), new.to(flat.dtype))
        return flat
    import tensorflow as tf

    tf.raw_ops.InplaceUpdate(x=flat, i=rows, v=tf.cast(new, flat.dtype))
    return flat


def can_write_rows(tensor):
    """Whether `write_rows` serves `tensor` now (`can_write_slots`'s
    rule) on torch and TensorFlow; not on JAX, whose arrays a reshape
    copies, nor on NumPy."""
    import keras

    if keras.backend.backend() not in ("torch", "tensorflow"):
        return False
    return can_write_slots(tensor)

