"""Backend kernels of the cache's writes (`cache.py`).

In place: `ops.slice_update` copies the whole cache in an eager call
(torch clones it; JAX arrays are immutable), O(L) per token.
`write_slots` writes the `T` new slots of each of its tensors in place
instead: torch's `copy_` into the slots, TensorFlow's `InplaceUpdate`, and
on JAX a jitted `dynamic_update_slice` that donates the tensor, so XLA
reuses its buffer.

Functional, in eager calls on the CPU (torch, JAX): `copy_slots` returns
a new tensor, as `slice_update` does, but copies into memory that an
earlier cache of the same size no longer uses (`_Recycler`) instead of
fresh memory. A large fresh tensor comes from the system's `mmap`, and its
first write takes a page fault for every page, which costs more than the
copy itself (docs/performance.md gives both).

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


def copy_slots(cache, new, start, axis=1):
    """A new tensor holding `cache` with `new` in slots
    `[start, start + T)` of `axis`; `cache` is left as it was. torch and
    JAX, where `can_copy_slots` says so: the new tensor lies in recycled
    memory where there is some (`_Recycler`). `start` is an int or a scalar
    tensor whose range the caller checked."""
    import keras

    if keras.backend.backend() == "torch":
        import torch

        key = _torch_key(cache)
        storage = _RECYCLER.take(key)
        if storage is None:
            result = torch.empty_like(
                cache, memory_format=torch.contiguous_format)
        else:
            result = torch.empty(0, dtype=cache.dtype).set_(
                storage, 0, cache.shape)
        # Two copies that autograd records where `cache` or `new` carry
        # gradients, as it records `slice_update`'s.
        result.copy_(cache)
        result.narrow(axis, int(start), new.shape[axis]).copy_(new)
        _RECYCLER.watch(result, key, result.untyped_storage())
        return result
    # One device's buffers only: a jitted fill takes its arrays on one.
    key = (tuple(cache.shape), cache.dtype, next(iter(cache.devices())))
    new = new.astype(cache.dtype)
    free = _RECYCLER.take(key)
    if free is None:
        result = _jax_update(axis, donate=False)(cache, new, start)
    else:
        result = _jax_fill(axis)(free, cache, new, start, True)
    _RECYCLER.watch(result, key, result.addressable_data(0))
    return result


def can_copy_slots(cache, new):
    """Whether `copy_slots` serves a functional write of `new` into
    `cache`: an eager call on the CPU, on torch or JAX (a single device's
    concrete arrays). An accelerator's allocator already reuses freed
    memory."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        return not torch.compiler.is_compiling() \
            and cache.device.type == "cpu"
    if backend != "jax":
        return False
    import jax

    if isinstance(cache, jax.core.Tracer) or isinstance(new, jax.core.Tracer):
        return False
    devices = cache.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _torch_key(tensor):
    return tensor.numel() * tensor.element_size(), tensor.dtype


class _Recycler:
    """The memory of the tensors `copy_slots` made, once their owners let
    them go, kept for the next tensors of the same size.

    Each tensor made here is watched by a weak reference, which holds a
    handle on its memory: torch's storage, or on JAX a second array of the
    same buffer (`addressable_data`). When the tensor is collected, its
    handle joins the free list of its size, which never holds more
    handles than there are live tensors of that size made here: a
    decoding loop (each step's cache replacing the last) finds one free
    handle a cache, and when the loop's caches are dropped, their free
    memory goes with them. A handle is reused only while nothing else
    refers to its memory: a view or a NumPy array of a torch tensor keeps
    its storage from reuse (it then leaves the list); JAX keeps a collected
    array's buffer from donation while a NumPy view of it lives.
    """

    def __init__(self):
        self._free = {}  # key -> [handle]
        self._live = {}  # key -> number of live tensors
        self._watched = {}  # id(weakref) -> weakref

    def take(self, key):
        """A free handle of `key`'s size, or `None`."""
        free = self._free.get(key, [])
        while True:
            try:  # a collection in another thread may empty the list
                handle = free.pop()
            except IndexError:
                return None
            if _unshared(handle):
                return handle

    def watch(self, tensor, key, handle):
        """Counts `tensor` as live; its `handle` joins the free list of
        `key` once it is collected."""
        import weakref

        self._live[key] = self._live.get(key, 0) + 1

        def collected(ref):
            self._watched.pop(id(ref), None)
            live = self._live[key] = self._live[key] - 1
            free = self._free.setdefault(key, [])
            free.append(handle)
            del free[: max(0, len(free) - live)]

        ref = weakref.ref(tensor, collected)
        self._watched[id(ref)] = ref

    def free_bytes(self, sizes=None):
        """The bytes held in the free lists (of the tensors of `sizes`
        bytes only, if given)."""
        held = (_nbytes(h) for free in self._free.values() for h in free)
        return sum(n for n in held if sizes is None or n in sizes)


def _unshared(handle):
    """Whether nothing but the free list refers to `handle`'s memory."""
    if hasattr(handle, "_cdata"):  # a torch storage
        import torch

        # This storage object's reference alone: no tensor, view or NumPy
        # array of it is left.
        return torch._C._storage_Use_Count(handle._cdata) == 1
    return not handle.is_deleted()


def _nbytes(handle):
    return handle.nbytes() if callable(handle.nbytes) else handle.nbytes


_RECYCLER = _Recycler()


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
def _jax_update(axis, donate=True):
    """A jitted write of `new` into slots `[start, start + T)`; with
    `donate`, into the cache's own buffer (it is deleted)."""
    import jax

    @functools.partial(jax.jit, donate_argnums=(0,) if donate else ())
    def update(cache, new, start):
        return jax.lax.dynamic_update_slice(
            cache, new, _jax_starts(cache.ndim, axis, start))

    return update


@functools.lru_cache(maxsize=4)
def _jax_fill(axis):
    """A jitted copy of `cache` into the donated buffer `into`, `new`
    written into its slots `[start, start + T)`. The copy is a select on a
    runtime `true`: without a use of `into`, XLA would give the result a
    buffer of its own instead of `into`'s."""
    import jax

    @functools.partial(jax.jit, donate_argnums=(0,))
    def fill(into, cache, new, start, true):
        copied = jax.numpy.where(true, cache, into)
        return jax.lax.dynamic_update_slice(
            copied, new, _jax_starts(cache.ndim, axis, start))

    return fill


def _jax_starts(rank, axis, start):
    import jax

    zero = jax.numpy.zeros((), "int32")
    starts = [zero] * rank
    starts[axis] = jax.numpy.asarray(start, "int32")
    return tuple(starts)
