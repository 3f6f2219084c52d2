"""`keras-mha info`: versions, backends, and the path a call takes.

The path is the layer's own answer, `MultiHeadAttention.attention_path`:
the layer builds the spec of the described call as `call` does and asks the
one dispatch rule, so `info` cannot disagree with what a call runs.
"""

import json
import os

from keras_mha.cli.common import BACKENDS
from keras_mha.cli.common import backend_installed
from keras_mha.cli.common import backend_version

# Call-configuration flags: switches (`--causal`), sizes (`--key-dim 8`).
_SWITCHES = ("return_scores", "dropout_training", "causal", "query_mask",
             "value_mask", "key_mask", "attention_mask", "cache")
_SIZES = ("key_dim", "value_dim", "sliding_window", "query_length",
          "key_length")
# The path does not depend on these; any dropout rate > 0 takes the same.
_DROPOUT = 0.1
_NUM_HEADS = 8
_BATCH = 1


def config_args(args):
    """The call-configuration flags of `args`, as command-line arguments."""
    argv = ["--" + flag.replace("_", "-") for flag in _SWITCHES
            if getattr(args, flag)]
    for flag in _SIZES:
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    return argv


def call_configuration(args):
    """Flag name -> value, defaults filled in."""
    key_dim = args.key_dim or 64
    query_length = args.query_length or 128
    configuration = {flag: bool(getattr(args, flag)) for flag in _SWITCHES}
    configuration.update(
        key_dim=key_dim,
        value_dim=args.value_dim or key_dim,
        sliding_window=args.sliding_window,
        query_length=query_length,
        key_length=args.key_length or query_length,
    )
    return configuration


def path_for(configuration):
    """The path `keras_mha.MultiHeadAttention` takes for `configuration`
    (a `call_configuration`), on the active backend."""
    from keras_mha import MultiHeadAttention

    layer = MultiHeadAttention(
        num_heads=_NUM_HEADS,
        key_dim=configuration["key_dim"],
        value_dim=configuration["value_dim"],
        sliding_window=configuration["sliding_window"],
        dropout=_DROPOUT if configuration["dropout_training"] else 0.0,
    )
    features = _NUM_HEADS * configuration["key_dim"]
    return layer.attention_path(
        (_BATCH, configuration["query_length"], features),  # (B, T, E)
        (_BATCH, configuration["key_length"], features),  # (B, S, E)
        query_mask=configuration["query_mask"],
        value_mask=configuration["value_mask"],
        key_mask=configuration["key_mask"],
        attention_mask=configuration["attention_mask"],
        use_causal_mask=configuration["causal"],
        return_attention_scores=configuration["return_scores"],
        training=configuration["dropout_training"],
        cache=configuration["cache"],
    )


def default_backend():
    """`(backend, source)` that Keras picks without KERAS_BACKEND."""
    home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras"
    )
    config = os.path.join(home, "keras.json")
    try:
        with open(config) as file:
            return json.load(file).get("backend", "tensorflow"), config
    except (OSError, ValueError):
        return "tensorflow", "Keras's built-in default"


def run(args):
    import keras
    from rich.console import Console
    from rich.table import Table

    active = keras.backend.backend()
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"keras {keras.__version__}")
    table = Table(box=None, pad_edge=False, show_header=True)
    for column in ("backend", "version", "status"):
        table.add_column(column)
    for name in BACKENDS:
        installed = backend_installed(name)
        status = "installed" if installed else "not installed"
        if name == active:
            status += ", active"
        table.add_row(name, backend_version(name) or "-", status)
    console.print(table)

    default, source = default_backend()
    if os.environ.get("KERAS_BACKEND"):
        origin = "from KERAS_BACKEND"
    else:
        origin = f"from {source}"
    console.print(f"active backend: {active} ({origin})")
    console.print(f"default backend: {default} ({source})")

    configuration = call_configuration(args)
    described = ", ".join(
        f"{flag}={value}" for flag, value in configuration.items()
    )
    console.print(f"call: {described}")
    console.print(f"path: {path_for(configuration)}")
    return 0
