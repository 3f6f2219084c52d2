"""What the running backend can do: the one module that names backends.

An algorithm asks for a capability by what it needs ("loop over blocks",
"a fused kernel that takes a window", "slots written in place"), never by
the backend's name; each function here answers for every backend, with the
reason next to the answer. Besides this module only the backends' own
kernels (`kernels.py`, `cache_kernels.py`, `decode_kernels.py`) and the
command line name a backend (`tests/test_structure.py` checks it).

A question takes an optional `backend`, the running one by default: the
dispatch rule and the tuning table answer for any backend in tests.
"""

import contextlib

import keras
from keras import ops

# The backends' names, as the tuning table keys its measurements.
JAX = "jax"
NUMPY = "numpy"
TENSORFLOW = "tensorflow"
TORCH = "torch"


def backend_name(backend=None):
    """`backend`, or the running backend's name when it is `None`."""
    return backend or keras.backend.backend()


# ------------------------------------------------------------ loops, graphs


def loop_over_blocks(body, constants, xs):
    """`body(constants, x)[1]` for each slice `x` of `xs` along axis 0,
    stacked: `scan` on JAX, `map` on the others.

    JAX: `lax.scan` caches its trace on the function object, so a caller
    that keeps one `body` per geometry does not retrace and recompile the
    loop on every eager call (`lax.map` wraps `body` in a fresh closure,
    which would). The others: Keras's TensorFlow `scan` wants outputs
    shaped like the carry; `map` has no carry.
    """
    if backend_name() == JAX:
        return ops.scan(body, constants, xs)[1]
    return ops.map(lambda x: body(constants, x)[1], xs)


def inference_only(backend=None):
    """NumPy computes no gradients: no `ops.custom_gradient` to wrap."""
    return backend_name(backend) == NUMPY


def tensors_carry_gradient_history(backend=None):
    """On torch a tensor carries its own gradient history (`requires_grad`,
    `detach()`); the others take gradients of traced functions."""
    return backend_name(backend) == TORCH


def compiling_one_graph():
    """Whether `torch.compile` (Dynamo) is tracing this call: the paths
    then keep to what it captures in one graph. Never off torch."""
    # `jax.jit` and `tf.function` trace any Python the paths run.
    if backend_name() != TORCH:
        return False
    import torch

    return torch.compiler.is_compiling()


def compiles_eager_call(tree):
    """Whether the call holding `tree`'s tensors is eager on a backend
    whose eager call `decode_kernels.graph_decode` compiles."""
    # TensorFlow outside a `tf.function`, JAX with no tracer among the
    # tensors. torch's eager step has its fused kernel instead, NumPy no
    # compiler.
    backend = backend_name()
    if backend == TENSORFLOW:
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == JAX:
        import jax

        leaves = jax.tree_util.tree_leaves(tree)
        return not any(isinstance(x, jax.core.Tracer) for x in leaves)
    return False


# ---------------------------------------------------------------- gradients


def pullback(fn, x):
    """`(fn(x), pull)`, where `pull(g)` is the vector-Jacobian product of
    `g` through `fn` at `x`: the chain rule through a user's function
    inside a custom gradient (`jax.vjp`, a TensorFlow tape, torch's
    autograd, which a backward pass runs with recording off). Not on
    NumPy, which takes no gradients."""
    backend = backend_name()
    if backend == JAX:
        import jax

        y, vjp = jax.vjp(fn, x)
        return y, lambda g: vjp(g)[0]
    if backend == TENSORFLOW:
        import tensorflow as tf

        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(x)
            y = fn(x)

        def pull(g):
            grad = tape.gradient(y, x, output_gradients=g)
            return ops.zeros_like(x) if grad is None else grad

        return y, pull
    import torch

    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        y = fn(x)

    def pull(g):
        if not y.requires_grad:  # `fn` does not read `x`
            return torch.zeros_like(x)
        return torch.autograd.grad(y, x, g)[0]

    return y.detach(), pull


def carries_gradient(fn, x):
    """`(fn(x), carries)`: `carries` says whether the result depends on a
    tensor other than `x` (which takes no gradient) that a gradient is or
    may be taken of: `fn` closed over a trained weight or over a tensor
    computed from one. A custom gradient that calls such a function would
    drop that tensor's gradient (torch, TensorFlow's tapes) or refuse it
    (JAX; TensorFlow for any trained variable the function reads)."""
    backend = backend_name()
    if backend == JAX:
        import jax

        # Differentiation (and `vmap`) traces its inputs with tracers of
        # their own kinds; a result of another kind than its argument's
        # read one of them.
        y = fn(x)
        if not isinstance(y, jax.core.Tracer):
            return y, False
        return y, type(y) is not type(x)
    if backend == TENSORFLOW:
        import tensorflow as tf
        from tensorflow.python.eager import record

        with tf.GradientTape() as reads:  # the trained variables it reads
            y = fn(x)
        return y, bool(reads.watched_variables()) or bool(
            record.should_record_backprop([y]))
    y = fn(x)
    return y, backend == TORCH and bool(y.requires_grad)


@contextlib.contextmanager
def host_scope():
    """Runs the block's ops on concrete values even inside a traced call
    (a mask's block map): `jax.ensure_compile_time_eval`, TensorFlow's
    `init_scope`; torch and NumPy compute eagerly anyway."""
    backend = backend_name()
    if backend == JAX:
        import jax

        with jax.ensure_compile_time_eval():
            yield
    elif backend == TENSORFLOW:
        import tensorflow as tf

        with tf.init_scope():
            yield
    else:
        yield


def is_concrete(x):
    """Whether tensor `x` holds values (not a tracer or a graph tensor)."""
    backend = backend_name()
    if backend == JAX:
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == TENSORFLOW:
        import tensorflow as tf

        return not tf.is_symbolic_tensor(x)
    if backend == TORCH:
        return not compiling_one_graph()
    return True


# ----------------------------------------------------- the fused kernel


def fused_takes_other_value_size(backend=None):
    """Whether `ops.dot_product_attention` takes values of another head
    size than the keys: not JAX's kernel, which wants one size."""
    return backend_name(backend) != JAX


def fused_takes_grouped_heads(backend=None):
    """Whether the fused kernel takes fewer key heads than query heads on
    every key head count: only JAX's."""
    # Keras's TensorFlow kernel fails for K == 1, its NumPy one for K > 1
    # (and its torch one repeats the heads itself).
    return backend_name(backend) == JAX


def fused_masks_finitely(backend=None):
    """Whether the fused kernel masks with a finite logit (TensorFlow's
    and NumPy's): a row with no key comes out finite."""
    # Such a row is the mean of the values: it needs no opening before
    # `zero_empty_rows`, only the row check (two graph ops fewer per call,
    # which a decode step on TensorFlow without XLA pays for each).
    return backend_name(backend) in (TENSORFLOW, NUMPY)


def fused_writes_scores(backend=None):
    """Whether the fused kernel writes the `T x S` scores: all but torch's,
    a flash kernel that never does."""
    # So on torch the blocked path takes only what the kernel cannot (a
    # soft-cap); elsewhere it also wins on length (`blocked_min_length`).
    return backend_name(backend) != TORCH


def fused_takes_window(backend=None):
    """Whether a fused kernel takes a sliding window itself: JAX's
    `dot_product_attention(local_window_size=...)`, no other."""
    return backend_name(backend) == JAX


# --------------------------------------------------------- native kernels


def recomputed(function, backend=None):
    """`function` with its intermediates recomputed in the backward pass
    instead of kept from the forward: `jax.checkpoint` on JAX, where it is
    measured (the banded path's chunks, `banded_recompute_bytes`);
    `function` itself elsewhere."""
    if backend_name(backend) != JAX:
        return function
    import jax

    return jax.checkpoint(function)


def has_native_band(backend=None):
    """Whether the band's blocks can go to a fused kernel
    (`kernels.banded_core`): torch's `scaled_dot_product_attention`."""
    return backend_name(backend) == TORCH


def has_native_block_sparse(backend=None):
    """Whether the block-sparse path's kept blocks can go to a fused kernel
    a group of query blocks at a time (`sparse_kernels.block_sparse`):
    torch's `scaled_dot_product_attention`, where the portable path's
    pairs of blocks run op by op."""
    return backend_name(backend) == TORCH


def has_native_decode_step(backend=None):
    """Whether an eager decode step has a native route: torch's fused
    kernel, TensorFlow's and JAX's compiled loop; not NumPy."""
    return backend_name(backend) in (TORCH, TENSORFLOW, JAX)


def has_fused_decode_kernel(backend=None):
    """Whether a decode step can read every slot at once in a fused kernel
    (`decode_kernels.decode_core`): torch's only."""
    return backend_name(backend) == TORCH


def products_read_strided_views(backend=None):
    """Whether batched products read strided keys without a copy: torch's
    per-head products do, so a packed product's zero blocks only add
    work there."""
    return backend_name(backend) == TORCH


def has_fused_projection(backend=None):
    """Whether a projection runs as one product that adds the bias
    (`kernels.project`, `torch.addmm`): on torch only."""
    # Keras's call is an einsum, then the bias added in a second pass that
    # writes a fresh tensor.
    return backend_name(backend) == TORCH


def has_fused_rotation(backend=None):
    """Whether the rotary embedding rotates with in-place updates
    (`kernels.rotate_half`, `rotate_pairs`): on torch only."""
    return backend_name(backend) == TORCH


# -------------------------------------------------------- state, devices


def slice_update_writes_input(backend=None):
    """Whether `ops.slice_update` assigns into the tensor it is given:
    Keras's NumPy one does; the others return a new tensor."""
    return backend_name(backend) == NUMPY


def select_writes_traced_token(backend=None):
    """Whether one traced token goes into a stacked cache by a select over
    the slots: on all but JAX, whose guarded write is the faster."""
    # Measured in a compiled `generate`: on TensorFlow and torch the select
    # beats a guarded `slice_update`; on JAX the guarded write wins.
    return backend_name(backend) != JAX


def variables_are_parameters(backend=None):
    """Whether a layer's variables are tracked as module parameters, to be
    tracked again once replaced (as `Model.quantize` does): on torch."""
    return backend_name(backend) == TORCH


def has_distribution_api(backend=None):
    """Whether Keras's distribution API (meshes, layouts, `ContextParallel`)
    runs: it is JAX-only."""
    return backend_name(backend) == JAX


def device_kind(x, backend=None):
    """The kind of device tensor `x` sits on, as its backend names it
    (`"cuda"`, `"cpu"`, `"TPU"`...), or `None` where `x` does not say.

    torch: the tensor's device type (`None` for `meta`, symbolic); JAX: a
    concrete array's device platform (a tracer says nothing); TensorFlow:
    the kind in an eager tensor's device string (a graph tensor's is
    empty); NumPy: always the CPU.
    """
    backend = backend_name(backend)
    if backend == TORCH:
        kind = getattr(getattr(x, "device", None), "type", None)
        return None if kind in (None, "meta") else kind
    if backend == JAX:
        import jax

        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return None
        return next(iter(x.devices())).platform
    if backend == TENSORFLOW:
        device = getattr(x, "device", "") or ""
        kind = device.rpartition("device:")[2].partition(":")[0]
        return kind or None
    return "cpu" if backend == NUMPY else None


def default_device_kind(backend=None):
    """The kind of device the backend computes on by default, as it names
    it: JAX's default backend, torch's CUDA or MPS when available,
    TensorFlow's first visible TPU or GPU, else the CPU."""
    backend = backend_name(backend)
    if backend == JAX:
        import jax

        return jax.default_backend()
    if backend == TORCH:
        import torch

        mps = getattr(torch.backends, "mps", None)
        if torch.cuda.is_available():
            return "cuda"
        if mps is not None and mps.is_available():
            return "mps"
        return "cpu"
    if backend == TENSORFLOW:
        import tensorflow as tf

        for kind in ("TPU", "GPU"):
            if tf.config.list_logical_devices(kind):
                return kind
    return "cpu"
