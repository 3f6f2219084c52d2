"""`keras-mha bench --decode --latent`: one decode step of multi-head latent
attention, absorbed and expanded, and of `MultiHeadAttention`.

For each cache size `L` given (`--lengths`, default 32k), one token
`(B, 1, E)` is decoded at position `p = L // 2` through caches of `L`
slots filled with random contents, eagerly, by a
`keras_mha.MultiHeadLatentAttention` with DeepSeek V3's head sizes
(`kv_lora_rank` 512, `qk_nope_head_dim` 128, `qk_rope_head_dim` 64,
`v_head_dim` 128) and `--heads` heads (default 16):

- absorbed (the layer's own choice for a decode step), with a cache the
  caller owns (the default of `init_cache`: the step returns a new cache)
  and with an `in_place=True` cache;
- expanded (forced), with an `in_place=True` cache: the latents below the
  position up-projected into every head's keys and values at each step;
- `keras_mha.MultiHeadAttention` with the same heads and head sizes (keys
  of 192, values of 128) and an `in_place=True` cache of its own.

A table per cache size gives each step's cache, the median milliseconds of
its calls, timed alternately (`bench.time_alternately`, passed in), and
its time over the absorbed in-place step's.
"""

import statistics

RANK, NOPE, ROPE, VALUE = 512, 128, 64, 128
FEATURES = 1024
STEPS = ("absorbed", "absorbed in place", "expanded in place",
         "MultiHeadAttention in place")


def run(args, parse_sizes, time_alternately, device):
    """`keras-mha bench --decode --latent`: returns the exit code."""
    from rich.console import Console

    from keras_mha.cli.common import device_line

    lengths = parse_sizes(args.lengths or "32k", "lengths")
    repeats = args.repeats or 10
    batch, num_heads = args.batch or 1, args.heads or 16
    rows = [measure(batch, num_heads, slots, repeats, time_alternately)
            for slots in lengths]
    console = Console(highlight=False)
    console.print(device_line(device))
    for row in rows:
        console.print(table(row, batch, num_heads, repeats))
    return 0


def layers(num_heads):
    """The latent layer and `MultiHeadAttention` with its heads, built,
    with random weights."""
    import numpy as np

    import keras_mha

    latent = keras_mha.MultiHeadLatentAttention(
        num_heads, RANK, NOPE, ROPE, VALUE,
        rotary_embedding=keras_mha.RotaryEmbedding(),
    )
    mha = keras_mha.MultiHeadAttention(
        num_heads, NOPE + ROPE, value_dim=VALUE, use_bias=False,
        rotary_embedding=keras_mha.RotaryEmbedding(),
    )
    rng = np.random.default_rng(0)
    for layer in (latent, mha):
        layer.build((1, 1, FEATURES), (1, 1, FEATURES))
        layer.set_weights([
            rng.normal(scale=0.05, size=w.shape).astype(w.dtype)
            if len(w.shape) > 1 else np.ones(w.shape, w.dtype)
            for w in layer.get_weights()
        ])
    return latent, mha


def measure(batch, num_heads, slots, repeats, time_alternately):
    """`{"slots", "position", "latent bytes", "mha bytes", step: ms}`."""
    import numpy as np
    from keras import ops

    from keras_mha.attention import cache as cache_lib
    from keras_mha.attention import latent as latent_lib
    from keras_mha.cli.common import without_gradients

    position = slots // 2
    latent, mha = layers(num_heads)
    rng = np.random.default_rng(1)

    def random(*shape):
        return ops.convert_to_tensor(
            rng.normal(size=shape).astype("float32"))

    def valid():
        return ops.convert_to_tensor(np.repeat(
            (np.arange(slots) < position)[None], batch, axis=0))

    def latent_cache(in_place):
        cache = (random(batch, slots, RANK), random(batch, slots, ROPE),
                 valid())
        if in_place:
            return cache_lib.mark_in_place(cache,
                                           cache_lib.InPlaceLatentCache)
        return cache

    mha_cache = cache_lib.mark_in_place((
        random(batch, slots, num_heads, NOPE + ROPE),
        random(batch, slots, num_heads, VALUE), valid()))
    token = random(batch, 1, FEATURES)
    state = {"absorbed": latent_cache(False),
             "absorbed in place": latent_cache(True),
             "expanded in place": latent_cache(True),
             "MultiHeadAttention in place": mha_cache}

    def step(name):
        layer = mha if name.startswith("MultiHead") else latent
        computation = "expanded" if name.startswith("expanded") else "absorbed"

        def call():
            with latent_lib.force_computation(computation):
                out, state[name] = layer(
                    token, token, use_causal_mask=True, cache=state[name],
                    cache_update_index=position)
            return ops.convert_to_numpy(out)  # waits for the result

        return name, call

    row = {"slots": slots, "position": position,
           "latent bytes": _bytes(state["absorbed"]),
           "mha bytes": _bytes(mha_cache)}
    times = without_gradients(lambda: time_alternately(
        [step(name) for name in STEPS], repeats))
    row.update({name: statistics.median(t) * 1e3
                for name, t in times.items()})
    return row


def _bytes(cache):
    """The bytes of a cache's tensors, from their shapes and dtypes."""
    import math

    import keras
    import numpy as np

    return sum(
        math.prod(tensor.shape)
        * np.dtype(keras.backend.standardize_dtype(tensor.dtype)).itemsize
        for tensor in cache
    )


def table(row, batch, num_heads, repeats):
    """One cache size's table: a row per step."""
    from rich.table import Table

    result = Table(title=(
        f"one decode step, eager, L={row['slots']:,}, p={row['position']:,}"
        f": B={batch}, {num_heads} heads; latent: kv_lora_rank {RANK}, nope "
        f"{NOPE}, rope {ROPE}, v {VALUE}; median of {repeats} calls each, "
        f"timed alternately"))
    for column in ("step", "cache", "ms", "/ absorbed in place"):
        result.add_column(column, justify="left" if column == "step"
                          else "right")
    fast = row["absorbed in place"]
    for name in STEPS:
        cache = row["mha bytes" if name.startswith("MultiHead")
                    else "latent bytes"]
        result.add_row(name, _size(cache),
                       f"{row[name]:.3g}", f"{row[name] / fast:.3g}x")
    return result


def _size(count):
    """Bytes in KiB below 1 MiB, else in MiB."""
    if count < 2 ** 20:
        return f"{count / 2 ** 10:,.1f} KiB"
    return f"{count / 2 ** 20:,.1f} MiB"
