"""`keras-mha info`: versions, backends, and the path a call takes.

The path comes from `keras_mha.dispatch.choose_path`, the one rule the layer
uses. Its keyword arguments grow with the layer (sliding windows, lengths),
so `path_for` passes only the ones it declares and says which flags it did
not use.
"""

import inspect
import json
import os

# Flag -> the `choose_path` keywords that may carry it, first match wins.
_PATH_KEYWORDS = {
    "return_scores": ("return_attention_scores",),
    "dropout_training": ("dropout_active",),
    "key_dim": ("key_dim",),
    "value_dim": ("value_dim",),
    "sliding_window": ("sliding_window", "window"),
    "query_length": ("query_length", "query_len", "seq_len"),
    "key_length": ("key_length", "key_len"),
    "causal": ("use_causal_mask", "causal", "is_causal"),
    "attention_mask": ("has_attention_mask", "has_mask"),
}


def config_args(args):
    """The call-configuration flags of `args`, as command-line arguments."""
    argv = []
    for flag in ("return_scores", "dropout_training", "causal",
                 "attention_mask"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    for flag in ("key_dim", "value_dim", "sliding_window", "query_length",
                 "key_length"):
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    return argv


def call_configuration(args):
    """`(configuration, given)`: flag name -> value, and the flags set."""
    given = {
        flag
        for flag in _PATH_KEYWORDS
        if getattr(args, flag) not in (None, False)
    }
    key_dim = args.key_dim or 64
    query_length = args.query_length or 128
    configuration = {
        "return_scores": args.return_scores,
        "dropout_training": args.dropout_training,
        "causal": args.causal,
        "attention_mask": args.attention_mask,
        "key_dim": key_dim,
        "value_dim": args.value_dim or key_dim,
        "sliding_window": args.sliding_window,
        "query_length": query_length,
        "key_length": args.key_length or query_length,
    }
    return configuration, given


def path_for(choose_path, configuration, backend=None):
    """Calls `choose_path` with the keywords it accepts.

    Returns:
        `(path, ignored)`: the path's name and the flags that `choose_path`
        has no keyword for.
    """
    from keras_mha.cli import CLIError

    parameters = inspect.signature(choose_path).parameters
    takes_any = any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )
    kwargs, ignored = {}, []
    for flag, value in configuration.items():
        names = [n for n in _PATH_KEYWORDS[flag] if n in parameters]
        if names or takes_any:
            kwargs[(names or _PATH_KEYWORDS[flag])[0]] = value
        else:
            ignored.append(flag)
    if "backend" in parameters and backend is not None:
        kwargs["backend"] = backend
    missing = [
        name
        for name, p in parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and name not in kwargs
    ]
    if missing:
        raise CLIError(
            "keras_mha.dispatch.choose_path needs "
            f"{', '.join(missing)}, which `keras-mha info` has no flag for",
            exit_code=1,
        )
    return choose_path(**kwargs), ignored


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

    from keras_mha import dispatch
    from keras_mha.cli import BACKENDS, backend_installed, backend_version

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

    configuration, given = call_configuration(args)
    path, ignored = path_for(dispatch.choose_path, configuration, active)
    unused = [flag for flag in ignored if flag in given]
    described = ", ".join(
        f"{flag}={value}" for flag, value in configuration.items()
    )
    console.print(f"call: {described}")
    console.print(f"path: {path}")
    if unused:
        flags = ", ".join("--" + f.replace("_", "-") for f in unused)
        console.print(
            f"note: choose_path does not take {flags} yet; ignored"
        )
    return 0
