"""One `fit` step of a small model with every feature, on the active
backend (`KERAS_BACKEND`), compiled as Keras compiles a model:

    python -m benchmarks.fit_step            # our layer, jit_compile=True
    python -m benchmarks.fit_step --keras    # Keras's layer, the same model

The model: 4 blocks of attention (B = 8, T = 16, E = 32; 4 query heads of
8 sharing 2 key/value heads, RoPE, soft-cap 20, RMS query/key norms,
dropout 0.1; even blocks with sinks and a causal window of 4), a residual
and a `LayerNormalization` each, then a `Dense`; mean squared error, Adam.
With `--keras` each attention is `keras.layers.MultiHeadAttention` with
the same heads and dropout (Keras's layer has none of the other features),
as the floor the trainer itself sets.

`fit` runs one epoch of `--batches` batches to compile and warm up, then
two more, each batch timed by a callback. It prints the first epoch's
time (compilation included), the median of the timed batches, and the
wall time of the two epochs per batch (the trainer's work between batches
included). Compare backends by running it once per backend.

`--skip-guard-eval` (torch) times the two epochs under
`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`: Dynamo then
skips checking its guards on every call, which shows what they cost.
"""

import argparse
import contextlib
import statistics
import sys
import time

import numpy as np

BATCH, LENGTH, FEATURES, BLOCKS = 8, 16, 32, 4


def model(keras_layer=False):
    """The benchmark's model, uncompiled."""
    import keras

    import keras_mha

    inputs = keras.Input((LENGTH, FEATURES))
    hidden = inputs
    for block in range(BLOCKS):
        if keras_layer:
            attention = keras.layers.MultiHeadAttention(
                num_heads=4, key_dim=8, dropout=0.1)
        else:
            window = (dict(sliding_window=4, use_sinks=True)
                      if block % 2 == 0 else {})
            attention = keras_mha.MultiHeadAttention(
                num_heads=4, key_dim=8, num_key_value_heads=2, dropout=0.1,
                attn_logits_soft_cap=20.0, qk_norm="rms",
                rotary_embedding=keras_mha.RotaryEmbedding(), **window)
        mixed = attention(hidden, hidden, use_causal_mask=True)
        hidden = keras.layers.LayerNormalization()(hidden + mixed)
    return keras.Model(inputs, keras.layers.Dense(FEATURES)(hidden))


def run(batches, keras_layer=False, jit_compile=True, skip_guards=False):
    """`(first_epoch_s, median_step_ms, wall_step_ms)` on the active
    backend."""
    import keras

    keras.utils.set_random_seed(0)
    network = model(keras_layer)
    network.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x, y = (rng.normal(size=(BATCH * batches, LENGTH, FEATURES))
            .astype("float32") for _ in range(2))

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    timer = Timer()
    fit = dict(batch_size=BATCH, verbose=0, shuffle=False, callbacks=[timer])
    start = time.perf_counter()
    network.fit(x, y, epochs=1, **fit)
    first = time.perf_counter() - start
    timer.times = []
    stance = contextlib.nullcontext()
    if skip_guards:
        import torch

        stance = torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    with stance:
        start = time.perf_counter()
        network.fit(x, y, epochs=2, **fit)
        wall = (time.perf_counter() - start) / (2 * batches)
    return first, statistics.median(timer.times) * 1e3, wall * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keras", action="store_true",
                        help="Keras's MultiHeadAttention in the same model")
    parser.add_argument("--batches", type=int, default=60,
                        help="batches an epoch (default 60)")
    parser.add_argument("--no-jit", action="store_true",
                        help="jit_compile=False")
    parser.add_argument("--skip-guard-eval", action="store_true",
                        help="torch: time without Dynamo's guard checks")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches must be at least 1. Received: "
                     f"--batches={args.batches}")
    import keras

    if args.skip_guard_eval and keras.backend.backend() != "torch":
        parser.error(f"--skip-guard-eval is for the torch backend. "
                     f"Received: KERAS_BACKEND={keras.backend.backend()}")
    first, median, wall = run(args.batches, args.keras, not args.no_jit,
                              args.skip_guard_eval)
    layer = "keras" if args.keras else "keras_mha"
    print("| backend | layer | jit_compile | first epoch, s "
          "| step, median ms | step, wall ms |")
    print("|---|---|---|---|---|---|")
    print(f"| {keras.backend.backend()} | {layer} | {not args.no_jit} "
          f"| {first:.1f} | {median:.2f} | {wall:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
