"""Programmable attention's cells on the active backend (`KERAS_BACKEND`):

    python -m benchmarks.programmable                 # T = 16384
    python -m benchmarks.programmable --lengths 4096  # a quicker run

Forward + backward of attention over projected heads (`B = 1`, 4 heads of
64) at each length, compiled on JAX (`jax.jit`) and TensorFlow
(`tf.function(jit_compile=True)`), eager on torch. Cells, side by side in
one run:

- the full causal cost: `use_causal_mask` on the path the rule picks;
- masks on the block-sparse path, each with its kept fraction `d` of the
  `T × S` logits and two bounds on its time over causal's: `1.5·d + 0.1`
  (the target read literally: below the ideal `2·d` for any mask that keeps
  more than causal's half) and `1.5·(d / 0.5) + 0.1` (at most 1.5 times
  causal's time per kept logit):
  prefix-LM with half the sequence as prefix, 16 documents (causal),
  a random 10% block-sparse mask (blocks of 128), a causal window of 512
  written as a `MaskFunction`;
- the same window as the layer's own `sliding_window=512` (the banded
  path): the function's time over it;
- 16 documents at `T / 2` against `keras.layers.MultiHeadAttention` with
  the same dense mask (a layer call each, forward and backward).

With `--scores`, instead: 16 documents (causal) with a score function,
ALiBi written as `fn(score, batch, head, query, key)`, on the block-sparse
path, against the mask alone there and against the same call evaluated
whole on the explicit path (where a score function ran before the sparse
path took them), at each length.

With `--dense`, instead: each mask but the random one on the block-sparse
path against the same mask evaluated whole on the fused path, at each
length (what `sparse_min_length` reads).

Prints one row per cell; the numbers of a shared machine are indicative.
"""

import argparse
import os
import statistics
import time

import numpy as np

HEADS, HEAD, BLOCK = 4, 64, 128


def _timed(fn, repeats):
    fn()  # compile, and build the block maps
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _forward_backward(loss, args):
    """A function running `loss(*args)` and its gradient, compiled where
    the backend compiles."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(
            args)))))
        return lambda: jax.block_until_ready(step(*args))
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def step(*tensors):
            with tf.GradientTape() as tape:
                tape.watch(tensors)
                value = loss(*tensors)
            return value, tape.gradient(value, tensors)

        tensors = [tf.convert_to_tensor(a) for a in args]
        return lambda: [t.numpy() for t in tf.nest.flatten(step(*tensors))
                        if t is not None]
    import torch

    tensors = [torch.tensor(a, requires_grad=True) for a in args]

    def run():
        value = loss(*tensors)
        return torch.autograd.grad(value, tensors)

    return run


def _density(mask, length):
    """The kept fraction of the `T × S` logits, counted a block row of
    queries at a time on the host."""
    import keras

    kept = 0
    keys = np.arange(length)[None, None, None, :]
    for start in range(0, length, 1024):
        rows = np.arange(start, min(start + 1024, length))
        index = [keras.ops.convert_to_tensor(x, "int32") for x in (
            np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 1, 1)),
            rows[None, None, :, None], keys)]
        kept += np.sum(keras.ops.convert_to_numpy(mask.evaluate(*index)))
    return kept / length ** 2


def _masks(length):
    import keras

    import keras_mha

    ops = keras.ops
    ids = (np.arange(length) // (length // 16))[None].astype("int32")
    blocks = -(-length // BLOCK)
    table = np.random.default_rng(0).random((blocks, blocks)) < 0.1
    np.fill_diagonal(table, True)  # every query sees a block
    flat = table.reshape(-1)

    def block_sparse(b, h, q, k):
        return ops.take(ops.convert_to_tensor(flat),
                        (q // BLOCK) * blocks + k // BLOCK)

    def window(b, h, q, k):
        return ops.logical_and(q >= k, q - k < 512)

    return {
        "prefix-LM, half prefix": keras_mha.PrefixLM(
            np.array([length // 2], "int32")),
        "16 documents": keras_mha.Causal() & keras_mha.Documents(ids),
        "random 10% blocks": keras_mha.MaskFunction(block_sparse),
        "window 512 (MaskFunction)": keras_mha.MaskFunction(
            window, monotone=True),
    }


def _attention_loss(spec):
    import keras

    from keras_mha.attention import attend

    def loss(q, k, v):
        return keras.ops.sum(attend(q, k, v, spec)[0])

    return loss


def run(lengths, repeats):
    import keras

    from keras_mha.attention import AttentionSpec
    from keras_mha.attention import spec as spec_lib

    rng = np.random.default_rng(0)
    scale = spec_lib.default_scale(HEAD)
    backend = keras.backend.backend()
    print("| backend | T | cell | d | ms | / causal | 1.5·d + 0.1 | "
          "3·d + 0.1 |")
    print("|---|---|---|---|---|---|---|---|")
    for length in lengths:
        q, k, v = (rng.normal(size=(1, length, HEADS, HEAD)).astype(
            "float32") for _ in range(3))
        causal = _timed(_forward_backward(_attention_loss(AttentionSpec(
            scale=scale, causal=True)), (q, k, v)), repeats)
        print(f"| {backend} | {length} | causal | 0.5 | "
              f"{1e3 * causal:.0f} | 1.00 | | |")
        for name, mask in _masks(length).items():
            density = _density(mask, length)
            spent = _timed(_forward_backward(_attention_loss(AttentionSpec(
                scale=scale, mask_mod=mask)), (q, k, v)), repeats)
            print(f"| {backend} | {length} | {name} | {density:.3f} | "
                  f"{1e3 * spent:.0f} | {spent / causal:.2f} | "
                  f"{1.5 * density + 0.1:.2f} | {3 * density + 0.1:.2f} |")
            if name.startswith("window"):
                banded = _timed(_forward_backward(_attention_loss(
                    AttentionSpec(scale=scale, causal=True,
                                  window=(511, 0))), (q, k, v)), repeats)
                print(f"| {backend} | {length} | sliding_window=512 | "
                      f"{density:.3f} | {1e3 * banded:.0f} | "
                      f"function / built-in {spent / banded:.2f} | 1.20 | |")
        _against_keras(length // 2, repeats, rng)


def _against_keras(length, repeats, rng):
    """16 documents at `length`: our layer with the mask object against
    Keras's layer with the same dense mask."""
    import keras

    import keras_mha

    backend = keras.backend.backend()
    x = rng.normal(size=(1, length, HEADS * HEAD)).astype("float32")
    ids = (np.arange(length) // (length // 16))[None].astype("int32")
    dense = (ids[:, :, None] == ids[:, None, :]) & np.tril(
        np.ones((length, length), bool))[None]
    ours = keras_mha.MultiHeadAttention(HEADS, HEAD)
    theirs = keras.layers.MultiHeadAttention(HEADS, HEAD)
    ours(x[:, :8], x[:, :8])
    theirs(x[:, :8], x[:, :8])
    mask = keras_mha.Causal() & keras_mha.Documents(ids)
    times = {}
    for name, call in (
        ("ours", lambda t: ours(t, t, mask_mod=mask)),
        ("keras", lambda t: theirs(t, t, attention_mask=dense)),
    ):
        times[name] = _timed(_forward_backward(
            lambda t, call=call: keras.ops.sum(call(t)), (x,)), repeats)
    print(f"| {backend} | {length} | 16 documents, layer: keras / ours | | "
          f"{1e3 * times['ours']:.0f} | "
          f"{times['keras'] / times['ours']:.1f}x | 5x | |")


def _alibi(score, batch, head, query, key):
    import keras

    ops = keras.ops
    slopes = ops.convert_to_tensor(
        [2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)], score.dtype)
    return score - ops.take(slopes, head) * ops.cast(
        ops.abs(query - key), score.dtype)


def run_scores(lengths, repeats):
    """A score function on the block-sparse path: its cost over the mask
    alone, and the explicit path's time over it."""
    import keras

    import keras_mha
    from keras_mha.attention import AttentionSpec
    from keras_mha.attention import dispatch

    rng = np.random.default_rng(0)
    backend = keras.backend.backend()
    print("| backend | T | sparse + score function, ms | / mask alone | "
          "explicit / sparse |")
    print("|---|---|---|---|---|")
    for length in lengths:
        q, k, v = (rng.normal(size=(1, length, HEADS, HEAD)).astype(
            "float32") for _ in range(3))
        ids = (np.arange(length) // (length // 16))[None].astype("int32")
        mask = keras_mha.Causal() & keras_mha.Documents(ids)
        scores = keras_mha.ScoreFunction(_alibi)
        times = {}
        for name, path, score_mod in (
            ("alone", dispatch.SPARSE, None),
            ("scored", dispatch.SPARSE, scores),
            ("explicit", dispatch.EXPLICIT, scores),
        ):
            loss = _attention_loss(AttentionSpec(
                scale=HEAD ** -0.5, mask_mod=mask, score_mod=score_mod))

            def forced(q, k, v, path=path, loss=loss):
                with dispatch.force_path(path):
                    return loss(q, k, v)

            times[name] = _timed(_forward_backward(forced, (q, k, v)),
                                 repeats)
        print(f"| {backend} | {length} | {1e3 * times['scored']:.0f} | "
              f"{times['scored'] / times['alone']:.2f} | "
              f"{times['explicit'] / times['scored']:.1f}x |")


def run_dense(lengths, repeats):
    """The block-sparse path's time over the dense mask's, per mask."""
    import keras

    from keras_mha.attention import AttentionSpec
    from keras_mha.attention import dispatch

    rng = np.random.default_rng(0)
    backend = keras.backend.backend()
    print("| backend | T | mask | sparse / dense |")
    print("|---|---|---|---|")
    for length in lengths:
        q, k, v = (rng.normal(size=(1, length, HEADS, HEAD)).astype(
            "float32") for _ in range(3))
        for name, mask in _masks(length).items():
            if name.startswith("random"):
                continue
            loss = _attention_loss(AttentionSpec(scale=HEAD ** -0.5,
                                                 mask_mod=mask))
            times = {}
            for path in (dispatch.SPARSE, dispatch.FUSED):
                def forced(q, k, v, path=path):
                    with dispatch.force_path(path):
                        return loss(q, k, v)

                times[path] = _timed(_forward_backward(forced, (q, k, v)),
                                     repeats)
            print(f"| {backend} | {length} | {name} | "
                  f"{times[dispatch.SPARSE] / times[dispatch.FUSED]:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense", action="store_true",
                        help="the block-sparse path against the dense mask")
    parser.add_argument("--scores", action="store_true",
                        help="a score function on the block-sparse path")
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
    lengths = [int(n) for n in args.lengths.split(",")]
    runner = run_dense if args.dense else run_scores if args.scores else run
    runner(lengths, args.repeats)


if __name__ == "__main__":
    main()
