"""`keras-mha bench --decode`: one decode step, keras-hub's layer and ours.

For each cache size `L` given (`--lengths`, default 64k), one token
`(B, 1, N*H)` is decoded at position `p = min(1024, L - 1)` through a
cache of `L` slots filled with random keys and values, eagerly:

- keras-hub's `CachedMultiHeadAttention` with its `(B, 2, L, N, H)` cache
  and a causal `attention_mask` (its own step: a functional write into the
  cache, attention over every slot);
- `keras_mha.MultiHeadAttention` with a cache the caller owns (the
  default of `init_cache`: the step returns a new cache and leaves the one
  given unchanged);
- the same with `init_cache(..., in_place=True)`: the step writes its slot
  into the cache's own tensors.

Each call's new cache is passed to the next call (JAX deletes an in-place
cache's old tensors), at the same position. The three are timed
alternately, call for call (`bench.time_alternately`), so that their
ratios are measured over the same seconds (`bench.time_alternately`,
passed in: this module does not import `bench`). keras-hub is imported
only here; without it the command says so.
"""

import statistics

MAX_POSITION = 1024


def run(args, parse_sizes, time_alternately, device):
    """`keras-mha bench --decode`: returns the exit code."""
    import importlib.util

    from rich.console import Console

    from keras_mha.cli.common import CLIError
    from keras_mha.cli.common import device_line

    if importlib.util.find_spec("keras_hub") is None:
        raise CLIError("--decode compares with keras-hub's "
                       "CachedMultiHeadAttention: pip install keras-hub")
    lengths = parse_sizes(args.lengths or "64k", "lengths")
    repeats = args.repeats or 10
    shape = (args.batch or 1, args.heads or 8, args.key_dim or 64)
    rows = [measure(shape, slots, repeats, time_alternately)
            for slots in lengths]
    console = Console(highlight=False)
    console.print(device_line(device))
    console.print(table(rows, shape, repeats))
    return 0


def layers(shape):
    """keras-hub's layer and ours, built, with the same weights."""
    import keras_hub

    import keras_mha

    batch, num_heads, head = shape
    features = num_heads * head
    theirs = keras_hub.layers.CachedMultiHeadAttention(
        num_heads=num_heads, key_dim=head)
    ours = keras_mha.MultiHeadAttention(num_heads=num_heads, key_dim=head)
    for layer in (theirs, ours):
        layer.build((batch, 1, features), (batch, 1, features))
    ours.set_weights(theirs.get_weights())
    return theirs, ours


def measure(shape, slots, repeats, time_alternately):
    """`{"slots", "position", name: ms}` of one decode step of each."""
    import numpy as np
    from keras import ops

    from keras_mha.attention import cache as cache_lib
    from keras_mha.cli.common import without_gradients

    batch, num_heads, head = shape
    position = min(MAX_POSITION, slots - 1)
    theirs, ours = layers(shape)
    rng = np.random.default_rng(0)
    kv = rng.normal(size=(batch, 2, slots, num_heads, head)).astype("float32")
    token = ops.convert_to_tensor(
        rng.normal(size=(batch, 1, num_heads * head)).astype("float32"))
    mask = ops.convert_to_tensor(
        np.broadcast_to(np.arange(slots) <= position, (batch, 1, slots)))

    def filled(in_place):
        empty = ours.init_cache(batch, slots, in_place=in_place)
        keys, values = (ops.convert_to_tensor(kv[:, i]) for i in (0, 1))
        return cache_lib.write(empty, keys, values, None, 0, False)

    state = {"keras-hub": ops.convert_to_tensor(kv),
             "ours": filled(False), "ours in place": filled(True)}

    def step(name):
        def call():
            if name == "keras-hub":
                out, state[name] = theirs(token, token, attention_mask=mask,
                                          cache=state[name],
                                          cache_update_index=position)
            else:
                out, state[name] = ours(token, token, use_causal_mask=True,
                                        cache=state[name],
                                        cache_update_index=position)
            return ops.convert_to_numpy(out)  # waits for the result

        return name, call

    times = without_gradients(lambda: time_alternately(
        [step(name) for name in state], repeats))
    row = {"slots": slots, "position": position}
    row.update({name: statistics.median(t) * 1e3
                for name, t in times.items()})
    return row


def table(rows, shape, repeats):
    from rich.table import Table

    batch, num_heads, head = shape
    result = Table(title=(
        f"one decode step, eager: B={batch}, {num_heads} heads of {head}; "
        f"median ms of {repeats} calls each, timed alternately"))
    for column in ("cache L", "p", "keras-hub", "ours", "keras-hub / ours",
                   "ours in place", "keras-hub / in place"):
        result.add_column(column, justify="right")
    for row in rows:
        hub = row["keras-hub"]
        result.add_row(
            f"{row['slots']:,}", f"{row['position']:,}", f"{hub:.3g}",
            f"{row['ours']:.3g}", f"{hub / row['ours']:.3g}x",
            f"{row['ours in place']:.3g}",
            f"{hub / row['ours in place']:.3g}x")
    return result
