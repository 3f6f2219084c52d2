"""What every `keras-mha` subcommand shares: errors, backends, arguments.

This module imports no other module of the command line, so each
subcommand imports it and never the parser (`keras_mha.cli`).
"""

import argparse
import importlib.metadata
import importlib.resources
import importlib.util
import os
import pathlib

PROG = "keras-mha"
BACKENDS = ("tensorflow", "jax", "torch", "numpy")

# Distributions that provide each backend's module, for version look-ups
# that do not import it.
_DISTRIBUTIONS = {
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-macos"),
    "jax": ("jax",),
    "torch": ("torch",),
    "numpy": ("numpy",),
}


class CLIError(Exception):
    """A failure reported as one line on stderr, with an exit code."""

    def __init__(self, message, exit_code=2):
        super().__init__(message)
        self.exit_code = exit_code


# ------------------------------------------------------------------ backends


def backend_installed(name):
    """Whether the backend's module can be imported (NumPy always can)."""
    return name == "numpy" or importlib.util.find_spec(name) is not None


def backend_version(name):
    """The installed version of the backend, without importing it."""
    for dist in _DISTRIBUTIONS[name]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_backend(name):
    """Raises `CLIError` unless `name` is a known, installed backend."""
    if name not in BACKENDS:
        raise CLIError(
            f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}"
        )
    if not backend_installed(name):
        raise CLIError(
            f"backend {name!r} is not installed "
            f'(pip install "keras-mha[{name}]")'
        )


def parse_backends(text):
    """`"jax,torch"` -> `["jax", "torch"]`, each checked; `None` stays."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CLIError(f"no backend named in --backends={text!r}")
    for name in names:
        if name not in BACKENDS:
            raise CLIError(
                f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}"
            )
    return list(dict.fromkeys(names))


def backend_env(name, quiet_tensorflow=True):
    """The environment of a child process that runs on backend `name`."""
    env = dict(os.environ, KERAS_BACKEND=name)
    if quiet_tensorflow:
        # TensorFlow's C++ start-up messages would bury one-line outputs.
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


# ----------------------------------------------------------------- arguments


def _positive(convert, kind):
    """An argparse `type`: `convert(text)`, which must be > 0."""

    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}")
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive: {value}")
        return value

    return parse


positive_int = _positive(int, "an integer")
positive_float = _positive(float, "a number")


# ------------------------------------------------------------------ matrices


def packaged_matrix(name):
    """A default matrix shipped with the package (`matrices/NAME`).

    Read with `read_json`; it is found wherever the package is installed,
    whatever the current folder.
    """
    return importlib.resources.files(__package__).joinpath("matrices", name)


def read_json(path, what):
    """The JSON document at `path` (a file name or a `packaged_matrix`);
    a `CLIError` naming `what` otherwise."""
    import json

    source = pathlib.Path(path) if isinstance(path, str) else path
    try:
        with source.open(encoding="utf-8") as file:
            return json.load(file)
    except OSError as error:
        raise CLIError(f"cannot read {what} {path}: {error.strerror}")
    except ValueError as error:
        raise CLIError(f"{what} {path} is not valid JSON: {error}")
