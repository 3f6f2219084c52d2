"""Multi-head latent attention's decode and training cells, on the active
backend (`KERAS_BACKEND`):

    python -m benchmarks.latent            # DeepSeek V3's head sizes
    python -m benchmarks.latent --small    # a quick run of the same cells

The issue's configuration: B = 1, 16 heads, nope 128, rope 64, v 128,
kv_lora_rank 512, a cache of L = 32,768 slots, the step at p = 16k; the
training step (expanded, forward and backward) at T = 4,096, causal,
against `MultiHeadAttention` with the same heads (key 192, value 128).

Cells, each the median of `--repeats` timed calls after a warm-up, the
compiled ones as `benchmarks.backends` compiles (`jax.jit` with the cache
donated, `tf.function(jit_compile=True)`; torch eagerly):

- the cache's bytes against a `MultiHeadAttention` cache with the same
  heads (keys `nope + rope`, values `v`), both with their flags;
- the absorbed step and the expanded step (each forced) at `p`: eager
  with a cache the caller owns (the write copies it), eager with an
  `in_place=True` cache, and compiled;
- the floor: one read of the valid latents and rope keys (their sum,
  compiled where the backend compiles), as the decode section's floors;
  and, as there, the absorbed step over it after its fixed cost, the same
  step at position `plan.FIXED_POSITION`, in the backend's fastest mode;
- the training step, expanded, against `MultiHeadAttention`'s.

Prints one table row per cell; the numbers of a shared machine are
indicative.
"""

import argparse
import statistics
import sys
import time

import numpy as np

ISSUE = dict(heads=16, nope=128, rope=64, value=128, rank=512, slots=32768,
             position=16384, features=1024, train_length=4096)
SMALL = dict(heads=4, nope=16, rope=8, value=16, rank=32, slots=2048,
             position=1024, features=64, train_length=256)


def _median_ms(backend, fn, repeats, warmup=1):
    for _ in range(warmup):
        backend.block(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.block(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


IN_PLACE = "eager, in place"


def _modes(name):
    """Eager with a cache the caller owns (each write returns a new cache,
    a copy of it), eager with an `in_place=True` cache (the write touches
    its slots only), and compiled where the backend compiles."""
    compiled = ("compiled",) if name in ("jax", "tensorflow") else ()
    return ("eager", IN_PLACE) + compiled


def _random(rng, shape, scale=0.05):
    return rng.normal(scale=scale, size=shape).astype("float32")


def _randomized(layer, rng):
    layer.set_weights([_random(rng, w.shape) if len(w.shape) > 1
                       else np.ones(w.shape, "float32")
                       for w in layer.get_weights()])
    return layer


def run(sizes, repeats, train=True):
    """`[(cell, value, unit)]` on the active backend."""
    import keras
    from keras import ops

    import keras_mha
    from benchmarks import backends
    from benchmarks import plan
    from keras_mha.attention import cache as cache_lib
    from keras_mha.attention import latent as latent_lib

    name = keras.backend.backend()
    backend = backends.get(name)
    rng = np.random.default_rng(0)
    s = sizes
    head = s["nope"] + s["rope"]
    layer = keras_mha.MultiHeadLatentAttention(
        s["heads"], s["rank"], s["nope"], s["rope"], s["value"],
        rotary_embedding=keras_mha.RotaryEmbedding(),
        kernel_initializer="zeros",
    )
    layer.build((1, None, s["features"]), (1, None, s["features"]))
    _randomized(layer, rng)
    rows = []

    # The cache's bytes, flags included.
    latent = sum(int(np.prod(shape)) * (1 if i == 2 else 4)
                 for i, shape in enumerate(_latent_shapes(s)))
    mha = sum(int(np.prod(shape)) * (1 if i == 2 else 4)
              for i, shape in enumerate(cache_lib.cache_shapes(
                  1, s["slots"], s["heads"], head, s["value"])))
    rows.append(("cache bytes, latent / MultiHeadAttention",
                 f"{latent:,} / {mha:,} = 1/{mha / latent:.1f}", ""))

    # Decode steps at `position`, the cache's valid slots below it.
    p, slots = s["position"], s["slots"]
    token = backend.tensor(_random(rng, (1, 1, s["features"]), 1.0))
    latents, rope_keys = (_random(rng, (1, slots, size), 1.0)
                          for size in (s["rank"], s["rope"]))

    def timed_step(how, mode, position):
        """The median ms of `how`'s step at `position` in `mode`, the
        cache's slots below `position` valid."""
        valid = np.zeros((1, slots), bool)
        valid[:, :position] = True
        cache = tuple(backend.tensor(x) for x in (latents, rope_keys, valid))
        if mode == IN_PLACE:
            cache = cache_lib.mark_in_place(cache,
                                            cache_lib.InPlaceLatentCache)
        state = {"cache": cache, "index": backend.index(position),
                 "mask": None}
        with latent_lib.force_computation(how):
            _, fn = backend.cached(layer, token, state,
                                   "eager" if mode == IN_PLACE else mode)[0]

            def step():
                state["index"] = backend.index(position)  # the same one
                return fn()

            return _median_ms(backend, step, repeats)

    steps = {}
    for how in latent_lib.COMPUTATIONS:
        for mode in _modes(name):
            steps[how, mode] = timed_step(how, mode, p)
            rows.append((f"{how} step, L={slots}, p={p}, {mode}",
                         f"{steps[how, mode]:.3g}", "ms"))
    # The fastest way each backend has to run a step: compiled where it
    # compiles, else eager with an in-place cache.
    fast = _modes(name)[-1]
    # Its fixed cost, as the decode section's floors take it: the same
    # step at position `FIXED_POSITION`, whatever a step costs before it
    # reads the slots (the projections, the call, and a compiled step's
    # copy of a cache it cannot donate).
    fixed = timed_step("absorbed", fast, plan.FIXED_POSITION)
    rows.append((f"absorbed step, L={slots}, p={plan.FIXED_POSITION} "
                 "(the fixed cost)", f"{fixed:.3g}", f"ms, {fast}"))
    rows.append(("expanded / absorbed step", f"{steps['expanded', fast] / steps['absorbed', fast]:.1f}x", fast))

    latents, rope_keys = backend.tensor(latents), backend.tensor(rope_keys)

    def total(latents, rope_keys):
        return ops.sum(latents[:, :p]) + ops.sum(rope_keys[:, :p])

    if name == "torch":
        read = backend.eager(lambda: total(latents, rope_keys))[0][1]
    else:
        read = backend.core(total, (latents, rope_keys), "forward")[0][1]
    floor = _median_ms(backend, read, repeats)
    rows.append((f"floor: one read of the {p} valid latents", f"{floor:.3g}",
                 "ms"))
    rows.append(("absorbed step / floor",
                 f"{steps['absorbed', fast] / floor:.1f}x", fast))
    rows.append(("(absorbed step - fixed cost) / floor",
                 f"{(steps['absorbed', fast] - fixed) / floor:.1f}x", fast))

    if train:
        length = s["train_length"]
        x = backend.tensor(_random(rng, (1, length, s["features"]), 1.0))
        mha_layer = keras_mha.MultiHeadAttention(
            s["heads"], head, value_dim=s["value"], use_bias=False,
            kernel_initializer="zeros",
        )
        mha_layer.build((1, length, s["features"]), (1, length,
                                                     s["features"]))
        _randomized(mha_layer, rng)
        times = {}
        for label, target in (("latent", layer), ("mha", mha_layer)):
            with latent_lib.force_computation("expanded"):
                _, fn = backend.layer(target, x, True,
                                      "forward_backward")[0]
                times[label] = _median_ms(backend, fn, repeats)
            rows.append((f"training step, T={length}, causal: {label}",
                         f"{times[label]:.3g}", "ms"))
        rows.append(("training step, latent / MultiHeadAttention",
                     f"{times['latent'] / times['mha']:.2f}x", ""))
    return rows


def _latent_shapes(s):
    return ((1, s["slots"], s["rank"]), (1, s["slots"], s["rope"]),
            (1, s["slots"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="small sizes, a quick run of the same cells")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-train", action="store_true",
                        help="leave the training step out")
    args = parser.parse_args(argv)
    import keras

    sizes = SMALL if args.small else ISSUE
    rows = run(sizes, args.repeats, train=not args.no_train)
    print(f"| {keras.backend.backend()} | | |")
    print("|---|---|---|")
    for cell, value, unit in rows:
        print(f"| {cell} | {value} | {unit} |")


if __name__ == "__main__":
    sys.exit(main())
