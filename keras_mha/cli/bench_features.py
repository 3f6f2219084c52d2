"""`keras-mha bench --features`: what each feature of real checkpoints
costs our layer, as a ratio to the same layer without it.

For each length T and window w, our `MultiHeadAttention` (causal, a
sliding window of w) is timed alternately, call for call, with the same
layer and one feature on: `qk_norm="rms"`, chunks of w in place of the
window (`attention_chunk_size`, Llama 4's chunked layers; chunks of 128
without a window), gpt-oss's YaRN rotary embedding, Llama 4's
`query_temperature`. Each is run as `keras-mha bench` runs a layer, with
the same projection weights, and the table gives each one's median time
per call, its ratio to the plain layer's over the same seconds, and the
path it takes. `bench` passes its helpers in (`Helpers`): this module does
not import it.
"""

import collections
import statistics

# What `bench.py` lends: its compiled step of a layer, the alternate
# timing, and its texts of an error, a window and milliseconds.
Helpers = collections.namedtuple(
    "Helpers", ["runner", "time_alternately", "reason", "describe",
                "window_text", "ms_text"])

FEATURES = ("plain", "qk_norm", "chunked", "yarn", "temperature")
_CHUNK_WITHOUT_WINDOW = 128


def feature_arguments(feature, window):
    """What `keras_mha.MultiHeadAttention` gets for `feature` besides its
    heads: the window, and the feature."""
    import keras_mha

    if feature == "chunked":
        return {"attention_chunk_size": window or _CHUNK_WITHOUT_WINDOW}
    arguments = {"sliding_window": window}
    if feature == "qk_norm":
        arguments["qk_norm"] = "rms"
    elif feature == "yarn":
        arguments["rotary_embedding"] = keras_mha.RotaryEmbedding(
            150000, scaling_factor=32.0, rope_type="yarn",
            original_max_position_embeddings=4096, truncate=False,
        )
    elif feature == "temperature":
        arguments["query_temperature"] = (8192.0, 0.1)
    return arguments


def feature_layers(shape, t_len, window):
    """`([(feature, layer)], x)`: our layer with each feature, built for
    self-attention inputs `x` `(B, T, E)`, the same projection weights in
    each (a norm's scales stay ones)."""
    import keras
    import numpy as np

    import keras_mha

    size = (shape["batch"], t_len, shape["heads"] * shape["key_dim"])
    rng = np.random.default_rng(0)
    layers, weights = [], None
    for feature in FEATURES:
        layer = keras_mha.MultiHeadAttention(
            num_heads=shape["heads"], key_dim=shape["key_dim"],
            **feature_arguments(feature, window),
        )
        layer.build(size, size)
        if weights is None:  # the plain layer's: the projections
            weights = [rng.standard_normal(w.shape, dtype=np.float32)
                       / np.sqrt(max(w.shape[0], 1))
                       for w in layer.get_weights()]
        layer.set_weights(weights + layer.get_weights()[len(weights):])
        layers.append((feature, layer))
    x = keras.ops.convert_to_tensor(
        rng.standard_normal(size, dtype=np.float32))
    return layers, x


def measure(shape, t_len, window, backward, repeats, advance, helpers):
    """One row per feature: `{"T", "w", "feature", "path", "seconds"}` or
    `"failed"` instead of `"seconds"`."""
    layers, x = feature_layers(shape, t_len, window)
    calls = [(feature, helpers.runner(layer, x, True, backward))
             for feature, layer in layers]
    rows = []
    try:
        times = helpers.time_alternately(calls, repeats, advance)
    except Exception as error:  # most often out of memory
        times = {}
        failed = helpers.reason(error)
    for feature, layer in layers:
        row = {"T": t_len, "w": window, "feature": feature,
               "path": layer.attention_path(tuple(x.shape), tuple(x.shape),
                                            use_causal_mask=True)}
        if feature in times:
            row["seconds"] = times[feature]
        else:
            row["failed"] = failed
        rows.append(row)
    return rows


def table(rows, shape, mode, repeats, helpers):
    from rich.table import Table

    result = Table(
        title=helpers.describe(shape, True, mode) + ", each feature against "
        "the plain layer", caption=f"median of {repeats} calls each, timed "
        "alternately with the plain layer", title_justify="left",
        caption_justify="left")
    for name in ("T", "window", "feature", "ms", "/ plain"):
        result.add_column(name, justify="left" if name == "feature"
                          else "right")
    result.add_column("path")
    plain = {}
    for row in rows:
        ms = (1e3 * statistics.median(row["seconds"]) if "seconds" in row
              else None)
        if row["feature"] == "plain":
            plain[row["T"], row["w"]] = ms
        base = plain.get((row["T"], row["w"]))
        ratio = (f"{ms / base:.2f}x" if ms is not None and base
                 and row["feature"] != "plain" else "-")
        result.add_row(str(row["T"]), helpers.window_text(row["w"]),
                       row["feature"], helpers.ms_text(ms) if ms is not None
                       else row["failed"], ratio, row["path"])
    return result
