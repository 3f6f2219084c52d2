"""A Gemma-3-shaped keras-hub model's training step, swapped by
`keras_mha.adopt` or keras-hub's own, on the active backend:

    python -m benchmarks.hub --length 4096              # swapped
    python -m benchmarks.hub --length 4096 --keras-hub  # keras-hub's own

The model is keras-hub's `Gemma3Backbone` (in a `Gemma3CausalLM`): 6
layers, 5 local with a window of 512 and 1 global, hidden 256, 4 query
heads and 1 key/value head of 64, query/key norms; B = 1. One step is
`train_on_batch` (forward, backward of the mean cross-entropy, an SGD
update), compiled as Keras compiles a model (`jit_compile=True`). The
first step compiles and is not timed; the median of `--steps` more is
printed, with the process's peak resident memory. Run each side in its
own process, on an idle machine, and compare.

    python -m benchmarks.hub --length 4096 --generate 256
    python -m benchmarks.hub --length 4096 --generate 256 --keras-hub

time greedy decoding after a prompt of `--length` tokens: `generate`'s
function (compiled as keras-hub compiles it) to `length + 1` tokens and to `length
+ N`, the median of `--steps` runs of each after one that compiles; a new
token's time is their difference over `N - 1`, so the prompt's prefill
is not counted.

    python -m benchmarks.hub --swap-time

times `adopt` itself on a 26-layer backbone shaped as Gemma 3 1B (hidden
1,152, 4 query heads and 1 key/value head of 256).
"""

import argparse
import resource
import statistics
import sys
import time

import numpy as np

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 256, 256, 4, 1, 64, 512


def model(swapped, jit_compile=True):
    """The benchmark's causal LM, compiled; adopted when `swapped`."""
    import keras
    import keras_hub

    import keras_mha

    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=VOCAB, image_size=16, num_layers=6,
        num_query_heads=HEADS, num_key_value_heads=KV_HEADS,
        hidden_dim=HIDDEN, intermediate_dim=2 * HIDDEN, head_dim=HEAD_DIM,
        use_query_key_norm=True, use_sliding_window_attention=True,
        sliding_window_size=WINDOW,
    )
    causal_lm = keras_hub.models.Gemma3CausalLM(backbone=backbone,
                                                preprocessor=None)
    if swapped:
        keras_mha.adopt(causal_lm)
    causal_lm.compile(
        optimizer=keras.optimizers.SGD(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return causal_lm


def swap_time():
    """Prints how long `adopt` takes on a 26-layer Gemma-3-1B-shaped
    backbone."""
    import keras_hub

    import keras_mha

    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=VOCAB, image_size=16, num_layers=26,
        num_query_heads=4, num_key_value_heads=1, hidden_dim=1152,
        intermediate_dim=2 * 1152, head_dim=256, use_query_key_norm=True,
        use_sliding_window_attention=True, sliding_window_size=WINDOW,
    )
    start = time.perf_counter()
    keras_mha.adopt(backbone)
    print(f"adopt, 26 layers: {time.perf_counter() - start:.3f} s")


def generate_time(causal_lm, length, new_tokens, runs):
    """Seconds per new token of greedy decoding after a prompt of
    `length` tokens (the module's docstring)."""
    import keras

    prompt = np.random.default_rng(0).integers(3, VOCAB, size=length)
    causal_lm.compile(sampler="greedy")
    # What `generate` runs: `jax.jit`, `tf.function(jit_compile=True)`,
    # torch under `no_grad`.
    generate = causal_lm.make_generate_function()

    def median_run(total):
        ids = np.zeros((1, total), "int32")
        ids[0, :length] = prompt
        inputs = {"token_ids": ids, "padding_mask": ids > 0}
        generate(dict(inputs), stop_token_ids=None)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            out = generate(dict(inputs), stop_token_ids=None)
            keras.ops.convert_to_numpy(out["token_ids"])  # waits for it
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    one, many = median_run(length + 1), median_run(length + new_tokens)
    return (many - one) / (new_tokens - 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keras-hub", action="store_true",
                        help="keras-hub's own attention (not swapped)")
    parser.add_argument("--no-jit", action="store_true",
                        help="train eagerly (`jit_compile=False`)")
    parser.add_argument("--swap-time", action="store_true",
                        help="time `adopt` on a 26-layer backbone")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="time greedy decoding of N new tokens after "
                        "the prompt (N >= 2)")
    args = parser.parse_args(argv)
    import keras

    if args.swap_time:
        return swap_time()
    side = "keras-hub" if args.keras_hub else "swapped"
    if args.generate:
        if args.generate < 2:
            parser.error(f"--generate must be at least 2. Received: "
                         f"{args.generate}")
        causal_lm = model(swapped=not args.keras_hub)
        seconds = generate_time(causal_lm, args.length, args.generate,
                                args.steps)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"{keras.backend.backend()} {side} prompt={args.length}: "
              f"{seconds * 1e3:.2f} ms a new token "
              f"({args.generate} new tokens), peak {peak:.2f} GiB")
        return None

    tokens = np.random.default_rng(0).integers(
        3, VOCAB, size=(1, args.length + 1))
    inputs = {"token_ids": tokens[:, :-1],
              "padding_mask": np.ones((1, args.length), bool)}
    causal_lm = model(swapped=not args.keras_hub,
                      jit_compile=not args.no_jit)
    start = time.perf_counter()
    causal_lm.train_on_batch(inputs, tokens[:, 1:])
    first = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        causal_lm.train_on_batch(inputs, tokens[:, 1:])
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB
    print(f"{keras.backend.backend()} {side} T={args.length}: "
          f"first step {first:.2f} s, median step "
          f"{statistics.median(times):.3f} s, peak {peak:.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())
