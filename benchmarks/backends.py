"""How each backend compiles, differentiates and times a call.

Every method that builds something to time returns `[(compiler, fn)]`:
zero-argument functions to try in order, the first that runs is timed.
Only TensorFlow has two: `tf.function(jit_compile=True)`, then plain
`tf.function` where XLA fails or does not finish its first call in time
(the parent abandons it, see `runner.py`). JAX runs under `jax.jit`, torch
eagerly (`flex_attention` under `torch.compile`); `eager` runs a call as
it is on every backend (what a first user runs), and a cached call
(`cached`, decoding) has both modes.

Forward+backward is the gradient of `0.5 * sum(y^2)` with respect to every
input (and, for a layer, every trainable weight), with the backend's own
autodiff: `jax.grad` under `jax.jit`, `tf.GradientTape` under
`tf.function`, `torch.autograd.grad`. A layer's `segment_ids` are an input
of the compiled function, as in training (a constant could be folded into
the program), and are not differentiated.
"""

import statistics
import time

# From this T on, flex_attention's block masks are built compiled: the
# uncompiled build materializes (T, T) int64 index tensors (2 GiB each at
# T=16384).
FLEX_COMPILED_MASK_LENGTH = 8192


def get(name):
    """The backend object for Keras backend `name`, or `None`."""
    backend = {"jax": Jax, "tensorflow": TensorFlow, "torch": Torch}.get(name)
    return None if backend is None else backend()


def _held(segment_ids):
    """The inputs a layer call gets besides `x`, not differentiated."""
    return () if segment_ids is None else (segment_ids,)


def _segments(held):
    """`_held`'s inputs back as the layer's keyword arguments."""
    return {"segment_ids": held[0]} if held else {}


def _cached_arguments(cache, index, mask):
    """The keyword arguments of a call with a cache: keras-hub's layer reads
    its causal `attention_mask` `(B, 1, S)`, ours `use_causal_mask`."""
    causal = ({"use_causal_mask": True} if mask is None
              else {"attention_mask": mask})
    return {"cache": cache, "cache_update_index": index, **causal}


class Backend:
    name = None
    compiler = None

    def tensor(self, array):
        import keras

        return keras.ops.convert_to_tensor(array)

    def block(self, result):
        """Waits until `result` is computed (JAX dispatches asynchronously)."""
        return result

    def eager(self, fn):
        """`fn` called as it is, no compiler."""
        return [("eager", fn)]

    def _eager_cached(self, layer, inputs, state):
        def run():
            out, state["cache"] = layer(inputs, inputs, **_cached_arguments(
                state["cache"], state["index"], state["mask"]))
            return out

        return self.eager(run)


class Jax(Backend):
    name = "jax"
    compiler = "jax.jit"

    def __init__(self):
        import jax

        self.jax = jax

    def block(self, result):
        return self.jax.block_until_ready(result)

    def core(self, fn, args, mode, held=()):
        """`fn(*args, *held)`, or its gradient w.r.t. every one of `args`."""
        jax = self.jax
        if mode == "forward":
            compiled = jax.jit(fn)
        else:

            def loss(*inputs):
                return 0.5 * jax.numpy.sum(jax.numpy.square(fn(*inputs)))

            compiled = jax.jit(
                jax.grad(loss, argnums=tuple(range(len(args))))
            )
        return [(self.compiler, lambda: compiled(*args, *held))]

    def layer(self, layer, x, causal, mode, segment_ids=None):
        trainable = [v.value for v in layer.trainable_variables]
        frozen = [v.value for v in layer.non_trainable_variables]

        def call(weights, inputs, *segments):
            out, _ = layer.stateless_call(
                weights, frozen, inputs, inputs, use_causal_mask=causal,
                **_segments(segments),
            )
            return out

        return self.core(call, (trainable, x), mode, _held(segment_ids))

    def native(self, q, k, v, window, causal, scale, mode):
        """`jax.nn.dot_product_attention` with a local window."""
        local = None
        if window is not None:
            # `(left, right)` keys besides the query itself; ours is
            # |p - j| < w: w - 1 on each side, 0 on the right when causal.
            local = (window - 1, 0 if causal else window - 1)

        def attend(q, k, v):
            return self.jax.nn.dot_product_attention(
                q, k, v, scale=scale, is_causal=causal,
                local_window_size=local,
            )

        return self.core(attend, (q, k, v), mode), {}

    def matmul(self, a, b):
        compiled = self.jax.jit(self.jax.numpy.matmul)
        return lambda: compiled(a, b)

    def cached(self, layer, inputs, state, mode):
        """One call of `layer` on `inputs` with `state["cache"]` at
        `state["index"]` (and keras-hub's `state["mask"]`), the new cache
        threaded back into `state`: eagerly, or under `jax.jit` with the
        cache donated, as a decode loop does, so XLA may update it in
        place. A Python index (a prefill at 0) is a constant of the
        program, a tensor one an argument."""
        if mode == "eager":
            return self._eager_cached(layer, inputs, state)
        trainable = [v.value for v in layer.trainable_variables]
        frozen = [v.value for v in layer.non_trainable_variables]

        def step(weights, inputs, cache, index, mask):
            (out, new_cache), _ = layer.stateless_call(
                weights, frozen, inputs, inputs,
                **_cached_arguments(cache, index, mask),
            )
            return out, new_cache

        static = (3,) if isinstance(state["index"], int) else ()
        compiled = self.jax.jit(step, donate_argnums=(2,),
                                static_argnums=static)

        def run():
            out, state["cache"] = compiled(trainable, inputs, state["cache"],
                                          state["index"], state["mask"])
            return out

        return [(self.compiler, run)]

    def index(self, position):
        return self.jax.numpy.asarray(position, dtype="int32")


class TensorFlow(Backend):
    name = "tensorflow"
    compiler = "tf.function(jit_compile=True)"

    def __init__(self):
        import tensorflow as tf

        self.tf = tf
        self._gpu = bool(tf.config.list_logical_devices("GPU"))

    def block(self, result):
        # On a GPU, eager ops and compiled functions return before their
        # kernels finish.
        if self._gpu:
            self.tf.test.experimental.sync_devices()
        return result

    def _candidates(self, make):
        return [(self.compiler, make(True)),
                ("tf.function (no XLA)", make(False))]

    def _compile(self, call, args, weights, mode, held=()):
        """`call(*args, *held)`, or its gradient w.r.t. `args` and
        `weights`."""
        tf = self.tf

        def make(jit):
            if mode == "forward":
                compiled = tf.function(call, jit_compile=jit)
            else:

                def gradients(*inputs):
                    watched = inputs[:len(args)]
                    with tf.GradientTape() as tape:
                        for tensor in watched:
                            tape.watch(tensor)
                        loss = 0.5 * tf.reduce_sum(tf.square(call(*inputs)))
                    return tape.gradient(loss, list(watched) + list(weights))

                compiled = tf.function(gradients, jit_compile=jit)
            return lambda: compiled(*args, *held)

        return self._candidates(make)

    def core(self, fn, args, mode):
        return self._compile(fn, args, [], mode)

    def layer(self, layer, x, causal, mode, segment_ids=None):
        def call(inputs, *segments):
            return layer(inputs, inputs, use_causal_mask=causal,
                         **_segments(segments))

        return self._compile(call, (x,), layer.trainable_weights, mode,
                             _held(segment_ids))

    def matmul(self, a, b):
        compiled = self.tf.function(self.tf.matmul, jit_compile=True)
        return lambda: compiled(a, b)

    def cached(self, layer, inputs, state, mode):
        """As `Jax.cached`: eagerly, or under `tf.function` (XLA first)."""
        if mode == "eager":
            return self._eager_cached(layer, inputs, state)

        def make(jit):
            def step(inputs, cache, index, mask):
                return layer(inputs, inputs,
                             **_cached_arguments(cache, index, mask))

            compiled = self.tf.function(step, jit_compile=jit)

            def run():
                out, state["cache"] = compiled(inputs, state["cache"],
                                              state["index"], state["mask"])
                return out

            return run

        return self._candidates(make)

    def index(self, position):
        return self.tf.constant(position, dtype="int32")


class Torch(Backend):
    name = "torch"
    compiler = "eager"

    def __init__(self):
        import torch
        import torch._dynamo

        self.torch = torch
        # A compilation per length must not fall back to eager.
        torch._dynamo.config.cache_size_limit = 256
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = 256
        self._flex = None
        self._window = None

    def block(self, result):
        if self.torch.cuda.is_available():  # kernels run asynchronously
            self.torch.cuda.synchronize()
        return result

    def core(self, fn, args, mode, weights=(), held=()):
        """`fn(*args, *held)`, or its gradient w.r.t. `args` and
        `weights`."""
        torch = self.torch
        if mode == "forward":

            def run():
                with torch.no_grad():
                    return fn(*args, *held)

            return [(self.compiler, run)]
        inputs = [a.detach().requires_grad_(True) for a in args]
        sources = inputs + list(weights)

        def run():
            loss = 0.5 * torch.sum(torch.square(fn(*inputs, *held)))
            return torch.autograd.grad(loss, sources)

        return [(self.compiler, run)]

    def layer(self, layer, x, causal, mode, segment_ids=None):
        def call(inputs, *segments):
            return layer(inputs, inputs, use_causal_mask=causal,
                         **_segments(segments))

        weights = [v.value for v in layer.trainable_weights]
        return self.core(call, (x,), mode, weights, _held(segment_ids))

    def native(self, q, k, v, window, causal, scale, mode):
        """Compiled `flex_attention` with a sliding-window block mask.

        `q, k, v`: `(B, N, T, H)`. Forward only (the caller reports the
        backward on CPU as n/a). Returns `(candidates, info)`, `info` with
        the block mask's build times: the first build (compilation
        included) and the median of three more. The window is a tensor the
        mask reads, not a constant, so one compilation per T serves every
        window.
        """
        torch = self.torch
        from torch.nn.attention import flex_attention as flex

        if self._flex is None:
            self._flex = torch.compile(flex.flex_attention, dynamic=False)
            self._window = torch.tensor(1, dtype=torch.int64)
        current = self._window

        def causal_mask(b, h, q_idx, kv_idx):  # True = may attend, as ours
            return (q_idx >= kv_idx) & (q_idx - kv_idx < current)

        def window_mask(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx < current) & (kv_idx - q_idx < current)

        t_len = q.shape[2]
        info = {}
        block_mask = None  # no mask at all: bidirectional without window
        if causal or window is not None:
            # No window is a window of T: the plain causal mask.
            current.fill_(t_len if window is None else window)
            compiled = t_len >= FLEX_COMPILED_MASK_LENGTH
            info["block_mask_compiled"] = compiled

            def build():
                return flex.create_block_mask(
                    causal_mask if causal else window_mask, None, None,
                    t_len, t_len, device="cpu", _compile=compiled,
                )

            started = time.perf_counter()
            block_mask = build()
            info["block_mask_first_s"] = time.perf_counter() - started
            times = []
            for _ in range(3):
                started = time.perf_counter()
                block_mask = build()
                times.append(time.perf_counter() - started)
            info["block_mask_s"] = statistics.median(times)
        attend = self._flex

        def run():
            with torch.no_grad():
                return attend(q, k, v, block_mask=block_mask, scale=scale)

        return [("torch.compile", run)], info

    def matmul(self, a, b):
        return lambda: self.torch.matmul(a, b)

    def eager(self, fn):
        torch = self.torch

        def run():
            with torch.no_grad():
                return fn()

        return [("eager", run)]

    def cached(self, layer, inputs, state, mode):
        """As `Jax.cached`, eagerly only."""
        return self._eager_cached(layer, inputs, state)

    def index(self, position):
        return self.torch.tensor(position, dtype=self.torch.int32)
