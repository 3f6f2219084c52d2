"""`python -m benchmarks`: its arguments and the run (see the package's doc)."""

import os
import platform
import sys
import time

from keras_mha.cli.common import CLIError
from keras_mha.cli.common import Parser
from keras_mha.cli.common import backend_installed
from keras_mha.cli.common import guarded
from keras_mha.cli.common import positive_float
from keras_mha.cli.common import positive_int

PROG = "python -m benchmarks"
DEFAULT_OUT = "bench-out"


def build_parser():
    """The parser of `python -m benchmarks`."""
    parser = Parser(
        prog=PROG,
        description="The development benchmarks of keras-mha. Times "
        "keras_mha.MultiHeadAttention, "
        "keras.layers.MultiHeadAttention and native attention kernels "
        "(forward, forward+backward, peak memory) on each backend, each in "
        "its own process, against a roofline from the layer's own "
        "projection matmuls; small-model cells (B=8); one fit step of a "
        "small causal transformer with our layer and with Keras's; our "
        "layer with each feature (RoPE, soft-cap, "
        "sinks, ALiBi, segment ids, qk_norm, chunks, YaRN, the query "
        "temperature) against none; and decoding: ours and "
        "keras-hub's CachedMultiHeadAttention per token, eager and "
        "compiled, against the floor of reading the cache, a tiny GPT-2 "
        "generate with either attention, and a prefill through the cache. "
        "Reports the acceptance targets as met or not met. Matrix: --config "
        "FILE, by default benchmarks/bench.json.",
    )
    parser.add_argument("--backends", metavar="A,B",
                        help="comma-separated (default: the config's, where "
                        "installed)")
    parser.add_argument("--lengths", metavar="T,T",
                        help="sequence lengths, e.g. 1024,4096 or 16k")
    parser.add_argument("--windows", metavar="W,W",
                        help="sliding windows, 'none' for no window")
    parser.add_argument("--repeats", type=positive_int, metavar="N",
                        help="timed calls per unit (median)")
    parser.add_argument("--time-cap", type=positive_float, metavar="S",
                        help="seconds one call may take (predicted from "
                        "shorter T; default 60)")
    parser.add_argument("--memory-cap", type=positive_float, metavar="GIB",
                        help="GiB one unit may add (default 16)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny matrix for smoke tests")
    parser.add_argument("--long", action="store_true",
                        help="the long-sequence case only: T=262144, "
                        "w=128, ours (layer and core), forward")
    parser.add_argument("--decode", action="store_true",
                        help="the decode cells only: per-token steps of "
                        "ours and keras-hub's CachedMultiHeadAttention, "
                        "eager and compiled, against the floor of reading "
                        "the cache; a tiny GPT-2 generate with either "
                        "attention; a prefill through the cache (the "
                        "config's decode section: full caches of 65536 and "
                        "2048 slots, a rolling one of 512, prefill T=8192 "
                        "by default); writes bench-decode.json and "
                        "report-decode.md")
    parser.add_argument("--no-decode", action="store_true",
                        help="skip the decode cells")
    parser.add_argument("--features", action="store_true",
                        help="the feature cells only: our layer with RoPE, "
                        "soft-cap, sinks, ALiBi, segment ids, qk_norm, "
                        "chunks, YaRN or the query temperature against "
                        "plain (the config's features section: T=16384, "
                        "w=128 by default); writes bench-features.json "
                        "and report-features.md")
    parser.add_argument("--no-features", action="store_true",
                        help="skip the feature cells")
    parser.add_argument("--no-fit", action="store_true",
                        help="skip the fit step (one train_on_batch of a "
                        "small causal transformer, ours against Keras's "
                        "layer; the config's fit section)")
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"folder for bench.json, report.md and "
                        f"bench.png (default {DEFAULT_OUT})")
    parser.add_argument("--config", metavar="FILE",
                        help="matrix (default: benchmarks/bench.json)")
    return parser


def main(argv=None):
    """Entry point of `python -m benchmarks`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return guarded(lambda: run(build_parser().parse_args(argv)), PROG)


def run(args):
    """Runs the parsed `args`; returns the exit code."""
    from benchmarks import plan

    if args.quick and args.long:
        raise CLIError("--quick and --long exclude each other")
    only = "features" if args.features else "decode" if args.decode else None
    if args.features and args.decode:
        raise CLIError("--features and --decode exclude each other")
    if only is not None:
        for flag, given in (("--long", args.long),
                            (f"--no-{only}", getattr(args, f"no_{only}"))):
            if given:
                raise CLIError(f"--{only} and {flag} exclude each other")
        for flag, given in (("--lengths", args.lengths),
                            ("--windows", args.windows)):
            if given is not None:
                raise CLIError(f"--{only} takes its sizes from the config's "
                               f"{only} section, not {flag}")
    overrides = {
        "lengths": plan.parse_list(args.lengths, "lengths", plan.length_item),
        "windows": plan.parse_list(args.windows, "windows", plan.window_item),
        "repeats": args.repeats,
        "time_cap_s": args.time_cap,
        "memory_cap_gib": args.memory_cap,
    }
    if args.backends is not None:
        overrides["backends"] = plan.parse_list(args.backends, "backends",
                                                str)
    profile = "quick" if args.quick else "long" if args.long else None
    config = plan.load_config(args.config, profile, overrides)
    if args.no_decode or args.long:
        config["decode"] = None
    if args.no_features or args.long:
        config["features"] = None
    if args.no_fit or args.long:
        config["fit"] = None
    if args.long:
        config["small"] = None
    if only is not None and config[only] is None:
        raise CLIError(f"--{only}: the config's {only} section is null")
    missing = [b for b in config["backends"] if not backend_installed(b)]
    if args.backends is not None and missing:
        raise CLIError(f"backend {missing[0]!r} is not installed "
                       f'(pip install "keras-mha[{missing[0]}]")')
    backends = [b for b in config["backends"] if b not in missing]
    if not backends:
        raise CLIError("none of the backends "
                       f"{', '.join(config['backends'])} is installed")
    config["backends"] = backends
    from benchmarks import report

    out = report.check_output_folder(args.out)
    case = "long" if args.long else only
    return _bench(config, out, case, skipped=missing)


def _bench(config, out, case, skipped):
    """Runs the units and writes the report. `case`: `None` (the matrix),
    `"long"` (the matrix of the long profile, no plot), `"features"` or
    `"decode"` (that section's cells only, no plot)."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress,
                               TextColumn, TimeElapsedColumn)

    from benchmarks import plan
    from benchmarks import report
    from benchmarks import runner

    only = case if case in ("features", "decode") else None
    units = {b: plan.units_for(b, config, only=only)
             for b in config["backends"]}
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 150)
    errors = Console(stderr=True, highlight=False)
    if skipped:
        console.print(f"not installed, not benchmarked: {', '.join(skipped)}")
    os.makedirs(out, exist_ok=True)
    for backend in config["backends"]:  # each worker's stderr, appended
        log = os.path.join(out, f"worker-{backend}.log")
        if os.path.exists(log):
            os.remove(log)
    total = sum(len(u) for u in units.values())
    done = []

    def log_line(unit, result):
        # Without a terminal there is no progress bar: one line per unit.
        done.append(unit)
        time_s = result.get("time_s")
        outcome = (f"{time_s:.4g} s" if result["status"] == plan.OK
                   else f"{result['status']}: {result.get('reason', '')}")
        print(f"[{len(done)}/{total}] {runner.describe(unit)}: {outcome}",
              file=sys.stderr, flush=True)

    started = time.perf_counter()
    bench = runner.Runner(config, log_folder=out, on_result=(
        None if errors.is_terminal else log_line))
    suffix = f"-{case}" if case else ""
    json_path = os.path.join(out, f"bench{suffix}.json")
    markdown_path = os.path.join(out, f"report{suffix}.md")

    def document(missing):
        cells, matmul = report.build_cells(config, units, bench.results,
                                           missing)
        decode = report.build_decode(config, units, bench.results, missing)
        features = report.build_features(units, bench.results, missing)
        fit = report.build_fit(units, bench.results, missing)
        found = {
            "what": PROG + (f" --{case}" if case else ""),
            "config": config,
            "machine": _machine(),
            "commit": _commit(),
            "backends": config["backends"],
            "backend_info": bench.backends,
            "flops_definition": plan.FLOPS_DEFINITION,
            "peak_memory": _memory_method(bench.backends),
            "matmul": matmul,
            "cells": cells,
            "fit": fit,
            "decode": decode,
            "features": features,
            "seconds": round(time.perf_counter() - started, 1),
        }
        if case != "long":
            found["targets"] = report.targets(cells, config["backends"],
                                              features, decode, fit,
                                              config["batch"])
        return found

    interrupted = False
    try:
        with Progress(
            TextColumn("{task.description:<48}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(), console=errors,
            disable=not errors.is_terminal,
        ) as progress:
            bench.progress = progress
            tasks = {b: progress.add_task(b, total=len(units[b]))
                     for b in units}
            for backend in units:
                bench.run({backend: units[backend]}, tasks)
                # What is done so far survives a crash of this process.
                report.write_json(json_path, document("not run yet"))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bench.close()
    final = document("interrupted")
    report.print_report(console, final)
    report.write_json(json_path, final)
    console.print(f"wrote {json_path}")
    report.write_markdown(markdown_path, final, os.path.basename(json_path))
    console.print(f"wrote {markdown_path}")
    if case is None:
        png_path = os.path.join(out, "bench.png")
        console.print(report.write_plot(png_path, final)
                      or f"wrote {png_path}")
    failed = sum(r.get("status") == plan.ERROR for r in bench.results.values())
    if failed:
        console.print(f"{failed} unit(s) ended in an error; tracebacks in "
                      f"{os.path.join(out, 'worker-<backend>.log')}")
    console.print(f"total {final['seconds']:.0f} s")
    if interrupted:
        return 130
    return 1 if failed else 0


def _commit():
    """The checkout's commit (as asv records one per result), or `None`."""
    import subprocess

    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def _machine():
    return {"platform": platform.platform(), "processor":
            platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version()}


def _memory_method(backends):
    from benchmarks import memory

    methods = sorted({info.get("memory_method") for info in backends.values()
                      if info.get("memory_method")})
    return {"method": ", ".join(methods) or "unknown",
            "description": " ".join(memory.__doc__.split())}
