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
import re
import sys
import tempfile

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


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, not usage + error."""

    def error(self, message):
        raise CLIError(f"{message} (see {self.prog} --help)")


def guarded(run, prog=PROG):
    """`run()`'s exit code; every failure is one line on stderr, never a
    traceback: a `CLIError` its own code, Ctrl-C 130, anything else 1."""
    for stream in (sys.stdout, sys.stderr):
        # Token names are Cyrillic; never crash on a narrow terminal encoding.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        return run() or 0
    except CLIError as error:
        print_error(error, prog)
        return error.exit_code
    except KeyboardInterrupt:
        print_error("interrupted", prog)
        return 130
    except Exception as error:  # the promise: one line, never a traceback
        message = str(error).strip().splitlines()
        detail = f": {message[0]}" if message else ""
        print_error(f"{type(error).__name__}{detail}", prog)
        return 1


def print_error(message, prog=PROG):
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


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


def backend_env(name, quiet=True):
    """The environment of a child process that runs on backend `name`.

    `quiet`: the backends' C++ logs below FATAL are off (TensorFlow's, and
    XLA's in TensorFlow and JAX), so that one-line outputs are not buried;
    the child still drops what they print before that setting applies
    (`import_keras`). A variable the user set is kept.
    """
    env = dict(os.environ, KERAS_BACKEND=name)
    if quiet:
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


# A backend's C++ log line (absl's format: severity, date, time), absl's
# notice about lines logged before it was set up, and the continuation of
# TensorFlow's CPU-feature notice.
_BACKEND_LOG = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\)|"
    r"[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ |"
    r"To enable the following instructions)"
)


def import_keras():
    """Imports Keras, and with it the backend; returns the module.

    Libraries linked into TensorFlow log from C++ as they load (no CUDA
    driver, cuDNN factories, CPU features), before `TF_CPP_MIN_LOG_LEVEL` or
    any other setting applies: what the import writes to file descriptor 2
    is held and passed on without those lines (a FATAL one passes). Keras
    already imported: returned as it is.
    """
    if "keras" in sys.modules:
        return sys.modules["keras"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to guard
        import keras

        return keras
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            import keras
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode("utf-8", errors="replace")
            kept = [line for line in text.splitlines(keepends=True)
                    if not _BACKEND_LOG.match(line)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
    return keras


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


INSTALL_PLOT = 'pip install "keras-mha[plot]"'


def check_plot(path):
    """A `CLIError` unless a plot can be written to `path`: matplotlib is
    installed and the folder is writable."""
    if importlib.util.find_spec("matplotlib") is None:
        raise CLIError(f"--plot needs matplotlib: {INSTALL_PLOT}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise CLIError(f"cannot write plot to {path}: {folder} is not a "
                       "writable folder")


def device_line(device):
    """The first line of a benchmark's output: the device, the active
    backend and its version, Keras's version."""
    import keras

    backend = keras.backend.backend()
    versions = f"{backend} {backend_version(backend) or ''}".strip()
    return f"device: {device} ({versions}, keras {keras.__version__})"


def without_gradients(fn):
    """`fn()`, under `torch.no_grad()` on torch (as inference runs)."""
    import keras

    if keras.backend.backend() != "torch":
        return fn()
    import torch

    with torch.no_grad():
        return fn()

