"""The `keras-mha` command line: `demo`, `info`, `compare`, `bench`, `test`.

This module parses arguments and turns every failure into one line on stderr
and an exit code; the work of each subcommand lives in its own module
(`demo.py`, `info.py`, `compare.py`, `bench.py`, `testrun.py`), imported
only when that subcommand runs, so that `--help` and building the parser
import neither Keras nor a backend. What they share is in `common.py`; they
import it, never this module. The library never imports the command line,
and neither imports the development benchmarks (`benchmarks/`, outside the
package).

A Keras process has exactly one backend, fixed when Keras is imported, so
everything that runs on a chosen backend runs in a child process with
`KERAS_BACKEND` set (`run_child`).

Exit codes: 0 success, 1 a check failed (compare, test), 2 usage errors
(unknown or missing backend, bad path, missing optional dependency),
130 interrupted.
"""

import argparse
import importlib.metadata
import subprocess
import sys

from keras_mha.cli.common import BACKENDS
from keras_mha.cli.common import PROG
from keras_mha.cli.common import CLIError
from keras_mha.cli.common import Parser
from keras_mha.cli.common import backend_env
from keras_mha.cli.common import check_backend
from keras_mha.cli.common import guarded
from keras_mha.cli.common import import_keras
from keras_mha.cli.common import parse_backends
from keras_mha.cli.common import positive_int


def run_child(backend, args):
    """Runs `python -m keras_mha ARGS` on `backend`; returns its exit code.

    The child inherits stdout and stderr, so its output is the user's; a
    Ctrl-C reaches it too, and its exit code is the answer.
    """
    check_backend(backend)
    command = [sys.executable, "-m", "keras_mha", *args]
    child = subprocess.Popen(command, env=backend_env(backend))
    try:
        return child.wait()
    except KeyboardInterrupt:
        return child.wait()  # it ends as it handles the interrupt


# -------------------------------------------------------------------- parser


# `info`'s call configuration: switches (flag, help) and sizes (flag,
# metavar, help).
_INFO_SWITCHES = (
    ("--return-scores", "return_attention_scores=True"),
    ("--dropout-training", "dropout > 0 and training=True"),
    ("--causal", "use_causal_mask=True"),
    ("--query-mask", "the query has a Keras mask (B, T), e.g. padding"),
    ("--value-mask", "the value has a Keras mask (B, S), e.g. padding"),
    ("--key-mask", "the key has a Keras mask (B, S)"),
    ("--attention-mask", "a dense attention_mask (B, T, S) is given"),
    ("--cache", "the call decodes with a key/value cache"),
)
_INFO_SIZES = (
    ("--key-dim", "H", "key_dim (default 64)"),
    ("--value-dim", "V", "value_dim (default: key_dim)"),
    ("--sliding-window", "W", "sliding_window"),
    ("--query-length", "T", "query length (default 128)"),
    ("--key-length", "S", "key/value length (default: query length)"),
)
# `bench`'s, as `info`'s.
_BENCH_SIZES = (
    ("--batch", "B", "batch size (default 1)"),
    ("--heads", "N", "number of heads (default 8)"),
    ("--key-dim", "H", "size of each head (default 64)"),
)
_BENCH_SWITCHES = (
    ("--causal", "use_causal_mask=True"),
    ("--backward", "time forward+backward: the gradients with respect to "
     "the input and the weights"),
    ("--features", "time our layer (causal) with each feature of real "
     "checkpoints (qk_norm, chunks of w, a YaRN RoPE, the query "
     "temperature) against the same layer without, alternately (default "
     "T=16k, w=128)"),
    ("--decode", "time one eager decode step instead: keras-hub's "
     "CachedMultiHeadAttention, ours with a cache the caller owns (the "
     "default) and ours with an in-place cache, at p=1k in caches of "
     "--lengths slots (default 64k)"),
    ("--latent", "with --decode: time one eager decode step of "
     "MultiHeadLatentAttention instead (DeepSeek V3's head sizes, --heads "
     "default 16): absorbed with a cache the caller owns and in place, "
     "expanded, and MultiHeadAttention with the same heads, at p=L/2 in "
     "caches of --lengths slots (default 32k)"),
)


def _add_switches(parser, switches):
    """A `store_true` flag per `(flag, help)` of `switches`."""
    for flag, help_text in switches:
        parser.add_argument(flag, action="store_true", help=help_text)


def _add_sizes(parser, sizes):
    """A positive-integer flag per `(flag, metavar, help)` of `sizes`."""
    for flag, metavar, help_text in sizes:
        parser.add_argument(flag, type=positive_int, metavar=metavar,
                            help=help_text)


def _add_backend_flag(parser, what):
    parser.add_argument(
        "--backend",
        metavar="NAME",
        help=f"run {what} in a child process with KERAS_BACKEND=NAME "
        f"({', '.join(BACKENDS)})",
    )


def build_parser():
    """The `keras-mha` parser: its options, and a subparser per command."""
    parser = Parser(
        prog=PROG,
        description="Multi-head attention for Keras 3: demo, environment "
        "info, cross-backend comparison, a benchmark against Keras's layer "
        "on your shapes, and the test suite on every backend.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_command in (_add_demo, _add_info, _add_compare, _add_bench,
                        _add_test):
        add_command(commands)
    return parser


def _add_demo(commands):
    """`keras-mha demo` and its arguments."""
    demo = commands.add_parser(
        "demo",
        help="two heads attending to different tokens of 'банк у реки'",
        description="The classic two-heads example: in 'банк у реки' (bank "
        "by the river) one head of the layer attends from 'банк' to itself, "
        "the other to 'реки'.",
    )
    _add_backend_flag(demo, "the demo")
    demo.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw both heads' 3x3 attention maps (needs matplotlib)",
    )


def _add_info(commands):
    """`keras-mha info` and its arguments: a call's configuration."""
    info = commands.add_parser(
        "info",
        help="versions, backends and the attention path a call takes",
        description="Keras and backend versions, the active backend, and "
        "which attention path a call with the given configuration takes, as "
        "the layer answers it (MultiHeadAttention.attention_path).",
    )
    _add_backend_flag(info, "info")
    config = info.add_argument_group("call configuration")
    _add_switches(config, _INFO_SWITCHES)
    _add_sizes(config, _INFO_SIZES)


def _add_compare(commands):
    """`keras-mha compare` and its arguments."""
    compare = commands.add_parser(
        "compare",
        help="our layer and Keras's against a float64 reference, per backend",
        description="Runs a matrix of cases on each backend (each in its own "
        "process) and reports the error of keras_mha.MultiHeadAttention and "
        "of keras.layers.MultiHeadAttention against a float64 NumPy "
        "reference. Exits 1 if any of our errors exceeds its tolerance.",
    )
    compare.add_argument("--backends", metavar="A,B",
                         help="comma-separated (default: all installed)")
    compare.add_argument("--json", metavar="FILE",
                         help="write all results as JSON")
    compare.add_argument("--matrix", metavar="FILE",
                         help="cases (default: the packaged "
                         "keras_mha/cli/matrices/compare.json)")
    compare.add_argument("--worker", action="store_true",
                         help=argparse.SUPPRESS)


def _add_bench(commands):
    """`keras-mha bench` and its arguments: the shapes timed."""
    bench = commands.add_parser(
        "bench",
        help="time Keras's MultiHeadAttention and ours on your shapes",
        description="Times keras.layers.MultiHeadAttention and "
        "keras_mha.MultiHeadAttention (same configuration and weights) on "
        "self-attention inputs (B, T, N*H) on the active backend's device, "
        "compiled as Model.compile's default runs a step, the two called "
        "alternately so that their ratio is measured over the same seconds. "
        "Prints the median time per call of each, the ratio and the path "
        "our layer takes.",
    )
    _add_backend_flag(bench, "the benchmark")
    bench.add_argument("--lengths", metavar="T,T",
                       help="sequence lengths, e.g. 512,1k,4k (default 1k,4k)")
    bench.add_argument("--window", metavar="W,W",
                       help="sliding windows, 'none' for none, e.g. none,128 "
                       "(default none)")
    _add_sizes(bench, _BENCH_SIZES)
    _add_switches(bench, _BENCH_SWITCHES)
    bench.add_argument("--repeats", type=positive_int, metavar="R",
                       help="timed calls of each layer (default 10)")
    bench.add_argument("--plot", metavar="FILE.png",
                       help="also draw time per call against T (needs "
                       "matplotlib)")


def _add_test(commands):
    """`keras-mha test` and its own arguments (the others go to pytest)."""
    test = commands.add_parser(
        "test",
        allow_abbrev=False,  # `--back` is someone's pytest flag, not ours
        help="run the project's tests on each backend",
        description="Runs `pytest tests benchmarks/tests` of the current "
        "directory (a source checkout) on each backend in its own process "
        "(KERAS_BACKEND=<backend>, KERAS_HOME=configs/<backend>). Other "
        "arguments, or everything after `--`, go to pytest; test files "
        "named there replace the two folders.",
    )
    test.add_argument("--backends", metavar="A,B",
                      help="comma-separated (default: tensorflow,jax,torch,"
                      "numpy)")
    # Two at once: each backend's run is mostly one busy thread (JAX spends
    # it compiling), so two overlap well on a 2-core machine.
    test.add_argument("-j", "--jobs", type=positive_int, default=2,
                      metavar="N", help="backends run at once (default 2)")


def _version():
    try:
        return importlib.metadata.version("keras-mha")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------- main


def _parse(argv):
    """Parses `argv`; only `test` passes unknown arguments on (to pytest)."""
    parser = build_parser()
    passthrough = []
    if argv and argv[0] == "test" and "--" in argv:
        split = argv.index("--")
        argv, passthrough = argv[:split], argv[split + 1 :]
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "test":
        raise CLIError(
            f"unrecognized arguments: {' '.join(unknown)} "
            f"(see {PROG} {args.command or ''} --help)".replace("  ", " ")
        )
    args.pytest_args = unknown + passthrough
    if args.command is None:
        raise CLIError(f"no command given; choose from demo, info, compare, "
                       f"bench, test (see {PROG} --help)")
    return args


def _here_or_child(args, child_args, run):
    """The command of `args` run here, Keras imported first (`run()`), or
    with `--backend` in a child process given `child_args`."""
    if args.backend is not None:
        return run_child(args.backend, [args.command, *child_args])
    import_keras()
    return run()


def _dispatch(args):
    if args.command == "demo":
        from keras_mha.cli import demo

        plot = [] if args.plot is None else ["--plot", args.plot]
        return _here_or_child(args, plot, lambda: demo.run(plot=args.plot))
    if args.command == "info":
        from keras_mha.cli import info

        return _here_or_child(args, info.config_args(args),
                              lambda: info.run(args))
    if args.command == "compare":
        from keras_mha.cli import compare

        if args.worker:
            import_keras()
            return compare.worker(args.matrix)
        return compare.run(
            backends=parse_backends(args.backends),
            matrix=args.matrix,
            json_path=args.json,
        )
    if args.command == "bench":
        from keras_mha.cli import bench

        return _here_or_child(args, bench.child_args(args),
                              lambda: bench.run(args))
    if args.command == "test":
        from keras_mha.cli import testrun

        return testrun.run(
            backends=parse_backends(args.backends),
            jobs=args.jobs,
            pytest_args=args.pytest_args,
        )
    raise CLIError(f"unknown command {args.command!r}")


def main(argv=None):
    """Entry point of `keras-mha` and `python -m keras_mha`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return guarded(lambda: _dispatch(_parse(argv)))
