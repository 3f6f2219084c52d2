"""`keras-mha bench`: Keras's attention layer against ours, on your shapes.

For each sequence length T and window w given, it builds
`keras.layers.MultiHeadAttention(num_heads=N, key_dim=H, sliding_window=w)`
for self-attention inputs `(B, T, E)`, `E = N * H`, and
`keras_mha.MultiHeadAttention` with the same configuration and weights.
Each call is run as `Model.compile`'s default
(`jit_compile="auto"`) runs a training step on the backend: under
`jax.jit` on JAX, `tf.function` on TensorFlow (with XLA where there is a
GPU), eagerly on torch and NumPy. `--backward` times the forward and the
gradients of `0.5 * sum(y ** 2)` with respect to the input and the
weights (not on NumPy, which has no autodiff).

After one untimed call of each (compilation), the two layers are timed
alternately, call for call (Keras, ours; ours, Keras; ...), so that their
ratio is measured over the same seconds: whatever else the machine does
falls on both alike. Every timed call waits for its result on the device.
The table gives the median time per call of each, the ratio, and the path
our layer takes (`MultiHeadAttention.attention_path`); the device is the
one the backend computes on. A layer that fails at a size (out of memory)
says so in its cell, and the other sizes still run; on a CPU, Keras's layer
is not run at a size whose `(B, N, T, T)` scores would not fit in the
memory available. Interrupted (Ctrl-C), it shows the sizes measured so far
and exits with 130.

`--features` times our layer with each feature of real checkpoints against
the same layer without it instead (`bench_features.py`), causal, by
default at T=16k and w=128.
"""

import math
import os
import platform
import statistics
import time

import keras_mha.cli.bench_features as bench_features
from keras_mha.cli.common import CLIError
from keras_mha.cli.common import check_plot
from keras_mha.cli.common import device_line

LAYERS = ("keras", "ours")
# Keras's layer holds its `(B, N, T, T)` float32 scores and a few more
# arrays of that size (this many, forward and backward); on a CPU, a size
# whose estimate does not fit in the memory available is not run: the
# system would kill the process, not raise an error.
_SCORE_ARRAYS = 3
_SUFFIXES = {"k": 2**10, "m": 2**20}

# Flags passed on to a child process (`--backend`) as given.
_FLAGS = ("batch", "lengths", "heads", "key_dim", "window", "repeats",
          "plot")
_SWITCHES = ("causal", "backward", "decode", "latent", "features")


def child_args(args):
    """The flags of `args` but `--backend`, as command-line arguments."""
    argv = []
    for flag in _FLAGS:
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    return argv + ["--" + flag for flag in _SWITCHES if getattr(args, flag)]


# ----------------------------------------------------------------- arguments


def parse_sizes(text, what, allow_none=False):
    """`"1k,4096"` -> `[1024, 4096]`; `"none"` is `None` where allowed."""
    sizes = []
    for part in (p.strip().lower() for p in text.split(",")):
        if allow_none and part == "none":
            sizes.append(None)
            continue
        scale = _SUFFIXES.get(part[-1:], 1)
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) == 0:
            raise CLIError(f"--{what}: cannot read {part!r} (a positive "
                           f"integer such as 512 or 4k"
                           f"{', or none' if allow_none else ''}). "
                           f"Received: {what}={text}")
        sizes.append(int(digits) * scale)
    return list(dict.fromkeys(sizes))


# ------------------------------------------------------------------- timing


def time_alternately(calls, repeats, advance=None):
    """`{name: [seconds]}` of `calls`, `[(name, fn)]`, timed in turn.

    One untimed call of each first (compilation), then `repeats` rounds of
    one call of each, every other round in reverse order so that none
    always goes first. `advance()` is called after every call.
    """
    for _, fn in calls:
        fn()
        if advance is not None:
            advance()
    times = {name: [] for name, _ in calls}
    for number in range(repeats):
        for name, fn in calls[::-1] if number % 2 else calls:
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
            if advance is not None:
                advance()
    return times


def runner(layer, x, causal, backward):
    """A function of no arguments that runs one call of `layer(x, x)` (and
    its gradients if `backward`) as a compiled step, and waits for it."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_runner(layer, x, causal, backward)
    if backend == "tensorflow":
        return _tensorflow_runner(layer, x, causal, backward)
    if backend == "torch":
        return _torch_runner(layer, x, causal, backward)
    return lambda: layer(x, x, use_causal_mask=causal)  # NumPy: forward


def _jax_runner(layer, x, causal, backward):
    import jax

    trainable = [v.value for v in layer.trainable_variables]
    frozen = [v.value for v in layer.non_trainable_variables]

    def forward(weights, inputs):
        outputs, _ = layer.stateless_call(weights, frozen, inputs, inputs,
                                          use_causal_mask=causal)
        return outputs

    def loss(weights, inputs):
        return 0.5 * jax.numpy.sum(jax.numpy.square(forward(weights, inputs)))

    step = jax.jit(jax.grad(loss, argnums=(0, 1)) if backward else forward)
    return lambda: jax.block_until_ready(step(trainable, x))


def _tensorflow_runner(layer, x, causal, backward):
    import tensorflow as tf

    def forward(inputs):
        return layer(inputs, inputs, use_causal_mask=causal)

    def gradients(inputs):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            loss = 0.5 * tf.reduce_sum(tf.square(forward(inputs)))
        return tape.gradient(loss, [inputs] + layer.trainable_weights)

    gpu = bool(tf.config.list_logical_devices("GPU"))
    # Keras's `jit_compile="auto"`: XLA where there is an accelerator.
    step = tf.function(gradients if backward else forward, jit_compile=gpu)

    def run():
        result = step(x)
        if gpu:  # kernels run asynchronously
            tf.test.experimental.sync_devices()
        return result

    return run


def _torch_runner(layer, x, causal, backward):
    import torch

    weights = [v.value for v in layer.trainable_weights]
    inputs = x.detach().requires_grad_(backward)

    def step():
        if not backward:
            with torch.no_grad():
                return layer(inputs, inputs, use_causal_mask=causal)
        outputs = layer(inputs, inputs, use_causal_mask=causal)
        loss = 0.5 * torch.sum(torch.square(outputs))
        return torch.autograd.grad(loss, [inputs] + weights)

    def run():
        result = step()
        if inputs.is_cuda:  # kernels run asynchronously
            torch.cuda.synchronize()
        return result

    return run


# ------------------------------------------------------------------- device


def device_name():
    """`"GPU: NVIDIA H200"` or `"CPU: <model> (<n> cores)"`: where the
    active backend computes, as it reports it."""
    import keras

    backend = keras.backend.backend()
    name = None
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform != "cpu":
            name = f"{device.platform.upper()}: {device.device_kind}"
    elif backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            details = tf.config.experimental.get_device_details(gpus[0])
            name = f"GPU: {details.get('device_name', gpus[0].name)}"
    elif backend == "torch":
        import torch

        if torch.cuda.is_available():
            name = f"GPU: {torch.cuda.get_device_name(0)}"
    return name or f"CPU: {_processor()} ({os.cpu_count()} cores)"


def on_cpu(device):
    return device.startswith("CPU")


def _processor():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _available_bytes():
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---------------------------------------------------------------------- run


def run(args):
    """`keras-mha bench`: returns the exit code."""
    from rich.console import Console

    decode_run = _decode_run(args)
    if decode_run is not None:
        return decode_run(args, parse_sizes, time_alternately, device_name())
    features = getattr(args, "features", False)
    lengths = parse_sizes(args.lengths or ("16k" if features else "1k,4k"),
                          "lengths")
    windows = parse_sizes(args.window or ("128" if features else "none"),
                          "window", allow_none=True)
    repeats = args.repeats or 10
    _check_layer_flags(args, features)
    shape = {"batch": args.batch or 1, "heads": args.heads or 8,
             "key_dim": args.key_dim or 64}
    device = device_name()
    cells = [(t_len, window) for t_len in lengths for window in windows]
    helpers = None
    if features:
        helpers = bench_features.Helpers(runner, time_alternately, _reason,
                                         _describe, _window_text, _ms_text)
    rows, interrupted = _measure_cells(cells, shape, args, repeats, device,
                                       helpers)
    console = Console(highlight=False)
    _print_results(console, rows, args, shape, repeats, device, helpers)
    if interrupted:
        done = len({(row["T"], row["w"]) for row in rows})
        console.print(f"interrupted after {done} of {len(cells)} sizes")
        return 130
    return 0


def _decode_run(args):
    """The `run` of `--decode` (`decode_bench.py`) or of `--decode
    --latent` (`latent_bench.py`), their flags checked, or `None`."""
    if getattr(args, "decode", False) and getattr(args, "features", False):
        raise CLIError("--decode and --features exclude each other")
    if getattr(args, "latent", False):
        if not getattr(args, "decode", False):
            raise CLIError("--latent times multi-head latent attention's "
                           "decode step: use it with --decode")
        given = [flag for flag, value in (
            ("--key-dim", args.key_dim), ("--window", args.window),
            ("--backward", args.backward), ("--causal", args.causal),
            ("--plot", args.plot)) if value]
        if given:
            raise CLIError(f"--decode --latent times decode steps with "
                           f"DeepSeek V3's head sizes; it takes --lengths, "
                           f"--batch, --heads and --repeats. Received: "
                           f"{', '.join(given)}")
        from keras_mha.cli.latent_bench import run as run_latent

        return run_latent
    if getattr(args, "decode", False):
        from keras_mha.cli.decode_bench import run as run_decode

        return run_decode
    return None


def _check_layer_flags(args, features):
    """The flags of the layers' timing that the backend or `--features`
    rule out, and `--plot`'s file."""
    import keras

    if args.backward and keras.backend.backend() == "numpy":
        raise CLIError("--backward: the numpy backend runs inference only "
                       "(no autodiff); choose another with --backend NAME")
    if args.plot is not None and features:
        raise CLIError("--plot draws Keras's layer against ours: not with "
                       "--features")
    if args.plot is not None:
        check_plot(args.plot)


def _measure_cells(cells, shape, args, repeats, device, helpers):
    """`(rows, interrupted)`: the rows of each cell `(T, w)`, Keras's layer
    against ours, or each feature against none where `helpers` (of
    `bench_features`) is given; a progress bar on a terminal. A Ctrl-C
    stops it with the rows measured so far."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress,
                               TextColumn, TimeElapsedColumn)

    errors = Console(stderr=True)
    rows = []
    with Progress(
        TextColumn("{task.description:<20}"), BarColumn(),
        MofNCompleteColumn(), TimeElapsedColumn(), console=errors,
        transient=True, disable=not errors.is_terminal,
    ) as progress:
        # Per cell: a warm-up and the rounds of each layer.
        layers = 2 if helpers is None else len(bench_features.FEATURES)
        calls = layers * (repeats + 1)
        task = progress.add_task("", total=len(cells) * calls)
        try:
            for number, (t_len, window) in enumerate(cells):
                progress.update(
                    task, description=f"T={t_len} w={_window_text(window)}")
                advance = lambda: progress.advance(task)  # noqa: E731
                if helpers is not None:
                    rows += bench_features.measure(
                        shape, t_len, window, args.backward, repeats, advance,
                        helpers)
                else:
                    rows.append(_measure(shape, t_len, window, args.causal,
                                         args.backward, repeats, device,
                                         advance))
                progress.update(task, completed=(number + 1) * calls)
        except KeyboardInterrupt:  # what was measured is still shown
            return rows, True
    return rows, False


def _print_results(console, rows, args, shape, repeats, device, helpers):
    """The device, the table of `rows` and, with `--plot`, the plot."""
    mode = "forward+backward" if args.backward else "forward"
    console.print(device_line(device))
    if rows and helpers is not None:
        console.print(bench_features.table(rows, shape, mode, repeats,
                                           helpers))
    elif rows:
        console.print(_table(rows, shape, args.causal, mode, repeats))
    if args.plot is not None and rows:
        _save_plot(rows, args.plot, shape, args.causal, mode, device)
        console.print(f"plot written to {args.plot}")


def layer_pair(shape, t_len, window):
    """`(keras_layer, our_layer, x)`: both built for self-attention inputs
    `x` `(B, T, E)` with the same configuration and weights."""
    import keras
    import numpy as np

    import keras_mha

    size = (shape["batch"], t_len, shape["heads"] * shape["key_dim"])
    arguments = {"num_heads": shape["heads"], "key_dim": shape["key_dim"],
                 "sliding_window": window}
    theirs = keras.layers.MultiHeadAttention(**arguments)
    ours = keras_mha.MultiHeadAttention(**arguments)
    for layer in (theirs, ours):
        layer.build(size, size)
    # The same NumPy weights for both (their weights line up). Not
    # `keras_mha.from_keras`: Keras's `get_config` imports TensorFlow on
    # every backend.
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(w.shape, dtype=np.float32)
               / np.sqrt(max(w.shape[0], 1)) for w in theirs.get_weights()]
    for layer in (theirs, ours):
        layer.set_weights(weights)
    x = keras.ops.convert_to_tensor(
        rng.standard_normal(size, dtype=np.float32))
    return theirs, ours, x


def _measure(shape, t_len, window, causal, backward, repeats, device,
             advance):
    """One row: `{"T", "w", "keras", "ours", "path"}`, each layer's entry
    `{"seconds": [...]}` or `{"failed": why}`."""
    theirs, ours, x = layer_pair(shape, t_len, window)
    row = {"T": t_len, "w": window,
           "path": ours.attention_path(tuple(x.shape), tuple(x.shape),
                                       use_causal_mask=causal)}
    layers = {"keras": theirs, "ours": ours}
    too_large = _too_large(shape, t_len, device)
    if too_large is not None:
        row["keras"] = {"failed": too_large}
        del layers["keras"]
    calls = [(name, runner(layer, x, causal, backward))
             for name, layer in layers.items()]
    try:
        times = time_alternately(calls, repeats, advance)
    except Exception:
        # One of them failed (most often out of memory): each alone.
        times = {}
        for name, fn in calls:
            try:
                times.update(time_alternately([(name, fn)], repeats))
            except Exception as error:
                row[name] = {"failed": _reason(error)}
    for name, seconds in times.items():
        row[name] = {"seconds": seconds}
    return row


def _too_large(shape, t_len, device):
    """Why Keras's layer is not run at `t_len` on a CPU, or `None`."""
    if not on_cpu(device):
        return None
    available = _available_bytes()
    needed = (_SCORE_ARRAYS * shape["batch"] * shape["heads"] * t_len * t_len
              * 4)
    if available is None or needed < available:
        return None
    return (f"not run: its (B, N, T, T) scores need ~{needed / 2**30:.0f} "
            f"GiB, {available / 2**30:.0f} GiB available")


def _reason(error):
    """The error's type and first line, in at most 120 characters."""
    lines = [line.strip() for line in str(error).strip().splitlines()
             if line.strip()]
    text = f"{type(error).__name__}: {lines[0]}" if lines else \
        type(error).__name__
    return text[:120]


def _window_text(window):
    return "none" if window is None else str(window)


def _median_ms(entry):
    """The median of a layer's times in ms, or `None` if it did not run."""
    if entry is None or "seconds" not in entry:
        return None
    return 1e3 * statistics.median(entry["seconds"])


def _ms_text(ms):
    """Three significant digits, never an exponent: 0.0123, 1.23, 123,
    1,234."""
    if ms >= 100:
        return f"{ms:,.0f}"
    decimals = 2 - math.floor(math.log10(ms)) if ms > 0 else 3
    return f"{ms:.{min(decimals, 4)}f}"


def _describe(shape, causal, mode):
    return (f"{mode}, B={shape['batch']}, N={shape['heads']}, "
            f"H={shape['key_dim']}, "
            f"{'causal' if causal else 'bidirectional'}")


def _table(rows, shape, causal, mode, repeats):
    from rich.table import Table

    table = Table(title=_describe(shape, causal, mode),
                  caption=f"median of {repeats} calls each, timed "
                  "alternately", title_justify="left",
                  caption_justify="left")
    table.add_column("T", justify="right")
    table.add_column("window", justify="right")
    table.add_column("keras ms", justify="right")
    table.add_column("ours ms", justify="right")
    table.add_column("keras / ours", justify="right")
    table.add_column("our path")
    for row in rows:
        cells = []
        for name in LAYERS:
            ms = _median_ms(row.get(name))
            cells.append(_ms_text(ms) if ms is not None
                         else row.get(name, {}).get("failed", "-"))
        keras_ms, ours_ms = (_median_ms(row.get(n)) for n in LAYERS)
        ratio = (f"{keras_ms / ours_ms:.2f}x"
                 if keras_ms is not None and ours_ms else "-")
        table.add_row(str(row["T"]), _window_text(row["w"]), *cells, ratio,
                      row["path"])
    return table


# --------------------------------------------------------------------- plot


def _save_plot(rows, path, shape, causal, mode, device):
    """Time per call against T, log-log: a line per layer and window."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    windows = list(dict.fromkeys(row["w"] for row in rows))
    for number, window in enumerate(windows):
        for name, style in zip(LAYERS, ("--o", "-o")):
            points = [(row["T"], _median_ms(row.get(name))) for row in rows
                      if row["w"] == window]
            points = [(t, ms) for t, ms in points if ms is not None]
            if points:
                ax.plot(*zip(*points), style, color=f"C{number}",
                        label=f"{name}, w={_window_text(window)}")
    ax.set_xscale("log", base=2)
    lengths = sorted({row["T"] for row in rows})
    ax.set_xticks(lengths, [str(t) for t in lengths])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("T")
    ax.set_ylabel("ms per call")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{_describe(shape, causal, mode)}\n{device}", fontsize=9)
    try:
        figure.savefig(path, dpi=110)
    except (OSError, ValueError) as error:
        reason = (error.strerror if isinstance(error, OSError)
                  and error.strerror else str(error).splitlines()[0])
        raise CLIError(f"cannot write plot to {path}: {reason}")
    finally:
        plt.close(figure)
