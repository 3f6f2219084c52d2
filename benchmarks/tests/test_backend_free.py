"""The benchmarks' parts that touch no backend: the configuration, the
units, FLOPs and caps, the cells, targets and reports built from made-up
results, the runner with a stand-in worker, and the command's errors.

Their outcome is the same on every backend: `keras-mha test` collects this
module on one backend of its run only (see `conftest.py`).
"""

import itertools
import json
import os
import re
import sys

import keras
import pytest

import keras_mha
from benchmarks import command
from benchmarks import plan
from benchmarks import report
from benchmarks import worker
from benchmarks.tests import conftest
from keras_mha.attention import dispatch

pytestmark = pytest.mark.backend_free


# ------------------------------------------------------------ report.md


def _made_up(unit):
    """A made-up `ok` result of `unit`."""
    if unit["kind"] == "matmul":
        return {"gflops": 50.0}
    if unit["kind"] == "projection":
        return {"time_s": 1e-3, "gflops": 100.0}
    if unit["kind"] == "fit":  # ours twice as fast
        return {"time_s": 0.1 if unit["impl"] == "ours" else 0.2,
                "first_call_s": 2.0, "compiler": "jit_compile=True",
                "jit_compile": True}
    if unit["kind"] == "floor":
        return {"time_s": 1e-4, "read_bytes": 2**20, "gb_per_s": 10.0}
    if unit["kind"] == "decode":
        return {"time_s": 2e-3, "ms_per_token": 2.0, "cache_bytes": 2**20}
    if unit["kind"] == "generate":
        return {"time_s": 0.1, "tokens": 24, "tokens_per_s": 240.0,
                "generated": [1] * 24}
    if unit["kind"] == "prefill":
        return {"time_s": 0.25, "peak_bytes": 2**20}
    if unit["kind"] == "feature":  # every feature 1.2x plain
        time_s = 0.25 if unit["feature"] == "plain" else 0.3
        return {"time_s": time_s, "peak_bytes": 2**20,
                "path": dispatch.BANDED}
    return {"time_s": 0.25, "peak_bytes": 2**20}


def _finished_run(backend="jax"):
    """The document of a run of the quick matrix with made-up results; one
    unit was skipped."""
    config = plan.load_config(None, "quick")
    units = {backend: plan.units_for(backend, config)}
    results = {unit["id"]: {"status": plan.OK, **_made_up(unit)}
               for unit in units[backend]}
    skipped = next(u for u in units[backend] if u.get("impl") == "keras")
    results[skipped["id"]] = {"status": plan.SKIPPED,
                              "reason": "over time cap (est. 99 s > 60 s)"}
    cells, matmul = report.build_cells(config, units, results)
    decode = report.build_decode(config, units, results)
    features = report.build_features(units, results)
    fit = report.build_fit(units, results)
    return {
        "what": "python -m benchmarks", "config": config, "backends": [backend],
        "machine": {"platform": "Linux", "processor": "x86_64", "cpus": 2,
                    "python": "3.11.0"},
        "backend_info": {backend: {"version": "0.0", "keras": "3.15.1"}},
        "matmul": matmul, "cells": cells, "decode": decode,
        "features": features, "fit": fit,
        "targets": report.targets(cells, [backend], features, decode, fit,
                                  config["batch"]),
        "seconds": 12.0,
    }


def test_report_md_has_every_row_of_the_terminal_report(tmp_path):
    document = _finished_run()
    path = tmp_path / "report.md"
    report.write_markdown(path, document, "bench.json")
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# `python -m benchmarks`\n")
    assert "`bench.json`" in text and "jax 0.0, keras 3.15.1" in text
    assert text.count("```") == 2  # one text block
    lines = text.splitlines()
    decode = document["decode"]
    rows = [line for line in lines if line.startswith("│ jax")]
    prefill = sum(mode in row for row in decode["prefill"]
                  for mode in plan.DECODE_MODES)
    assert len(rows) == (len(document["cells"]) + len(decode["generate"])
                         + prefill + len(document["fit"]))
    assert "projections (B*T, 512) @ (512, 512), GFLOP/s: B=1 T=256 100.0" \
        in text
    assert "x roof" in text and "2.00x" in text  # fit: keras / ours
    steps = [line for line in lines
             if line.startswith(("│ full ", "│ rolling "))]
    assert len(steps) == len(decode["steps"])
    labels = [line.split("│")[1].strip() for line in lines
              if line.startswith("│ ") and "banded" in line]
    assert labels == [plan.FEATURE_LABELS[f] for f in plan.FEATURES]
    assert "1.20x" in text and "baseline" in text
    assert not [line for line in lines if re.match(r"│ +│", line)], (
        "a row was wrapped: the table is wider than the page")
    assert "skip ~99 s" in text
    for target in document["targets"]:
        assert target["target"] in text


# ------------------------------------------------------------ the parent

# A stand-in worker: answers at once, except where the unit asks it to hang.
_FAKE_WORKER = """
import json, sys, time
print(json.dumps({"event": "hello", "version": "0"}), flush=True)
for line in sys.stdin:
    message = json.loads(line)
    unit = message["unit"]
    if unit["kind"] == "matmul":
        time.sleep(60)  # hangs: must be killed
    if unit.get("impl") == "keras" and not message["skip_compilers"]:
        print(json.dumps({"event": "trying", "compiler": "xla",
                          "fallback": True}), flush=True)
        time.sleep(60)  # a compiler that never returns
    print(json.dumps({"event": "trying", "compiler": "plain",
                      "fallback": False}), flush=True)
    print(json.dumps({"event": "warm"}), flush=True)
    result = {"status": "ok", "time_s": 0.5, "peak_bytes": 0,
              "skipped": message["skip_compilers"]}
    print(json.dumps({"event": "result", "id": unit["id"],
                      "result": result}), flush=True)
"""


def test_runner_kills_hung_workers_and_abandons_compilers(
    tmp_path, monkeypatch
):
    from benchmarks import runner

    monkeypatch.setattr(runner, "worker_command",
                        lambda path: [sys.executable, "-c", _FAKE_WORKER])
    config = plan.load_config(None, overrides={
        "lengths": [256, 512], "windows": [64], "modes": ["forward"],
        "implementations": ["keras", "ours"], "time_cap_s": 0.5})
    config.update(compile_allowance_s=0.5, decode=None, features=None,
                  small=None, fit=None)
    units = plan.units_for("jax", config)
    bench = runner.Runner(config, log_folder=str(tmp_path))
    try:
        results = bench.run({"jax": units})
    finally:
        bench.close()
    matmul, *projections = (results[u["id"]] for u in units
                            if u["kind"] in ("matmul", "projection"))
    attention = [results[u["id"]] for u in units if u["kind"] == "attention"]
    assert [r["status"] for r in projections] == [plan.OK] * 2
    assert matmul["status"] == plan.TIMED_OUT
    assert matmul["reason"] == ("set-up and first call (compilation "
                                "included) took over 1 s; worker killed")
    assert [r["status"] for r in attention] == [plan.OK] * 4
    keras_256, ours_256, keras_512, _ = attention
    # keras hung in "xla" once; it is skipped for the rest of its series.
    assert list(keras_256["skipped"]) == ["xla"]
    assert "took over 1 s" in keras_256["skipped"]["xla"]
    assert list(keras_512["skipped"]) == ["xla"]
    assert ours_256["skipped"] == {}
    # One start, a restart after the matmul, one after abandoning "xla".
    assert bench.backends["jax"]["workers_started"] == 3


# ------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backends", "numpy"], "numpy backend is not benchmarked"),
        (["--backends", "cuda"], "unknown backend 'cuda'"),
        (["--lengths", "1024,abc"], "--lengths: cannot read 'abc'"),
        (["--windows", "0"], "--windows: cannot read '0'"),
        (["--quick", "--long"], "exclude each other"),
        (["--features", "--long"], "--features and --long exclude"),
        (["--features", "--no-features"], "--features and --no-features"),
        (["--features", "--lengths", "1024"], "not --lengths"),
        (["--decode", "--features"], "--features and --decode exclude"),
        (["--decode", "--long"], "--decode and --long exclude"),
        (["--decode", "--no-decode"], "--decode and --no-decode exclude"),
        (["--decode", "--windows", "128"], "decode section, not --windows"),
        (["--repeats", "0"], "must be positive"),
        (["--config", "no-such-file.json"], "cannot read config"),
    ],
)
def test_errors_are_one_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert command.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("python -m benchmarks: error: ")
    assert message in err


@pytest.mark.parametrize(
    "config, args, message",
    [
        ({"lenghts": [1024]}, [], "unknown field(s) lenghts"),
        ({"lengths": [1024]}, ["--quick"], "no 'quick' object for --quick"),
        ({"lengths": []}, [], "lengths must be a list of positive integers"),
        ({"decode": {"positions": [9], "full_length": 9, "short_length": 4}},
         [], "every position must be < full_length"),
        ({"decode": {"positions": [64], "short_length": 64}}, [],
         "the first position must be < short_length"),
        ({"decode": {"short_length": 65536}}, [],
         "short_length must be < full_length"),
        ({"decode": {"generate": {"prompt_length": 128}}}, [],
         "prompt_length < max_length <= 256"),
        ({"decode": {"prefill": {"window": None}}}, [],
         "prefill must be an object of positive integers"),
        ({"decode": {"colour": 1}}, [], "decode must be null or an object "
         "with"),
        ({"decode": None}, ["--decode"], "decode section is null"),
        ({"features": {"features": ["rope"]}}, [], "must include plain"),
        ({"features": {"features": ["plain", "gqa"]}}, [],
         "features must be a list drawn from plain, rope"),
        ({"features": {"soft_cap": 0}}, [], "soft_cap a positive number"),
        ({"features": {"colour": 1}}, [], "features must be null or an "
         "object with"),
        ({"features": None}, ["--features"], "features section is null"),
        ({"small": {"batch": 0}}, [], "small: batch must be a positive"),
        ({"small": {"implementations": ["flash"]}}, [],
         "small: implementations must be a list drawn from keras"),
        ({"small": {"windows": []}}, [], "small: windows must be a list"),
        ({"small": {"colour": 1}}, [], "small must be null or an object"),
        ({"fit": {"window": 0}}, [], "fit: batch, length, layers, warmup"),
        ({"fit": {"colour": 1}}, [], "fit must be null or an object with"),
    ],
)
def test_config_errors(tmp_path, capsys, config, args, message):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(config))
    assert command.main(["--config", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message in err


def test_default_config_is_valid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # found beside the code, from any folder
    folder = os.path.dirname(os.path.abspath(plan.__file__))
    assert plan.load_config(None)["source"] == os.path.join(folder,
                                                            "bench.json")
    for profile in (None, "quick", "long"):
        config = plan.load_config(None, profile)
        assert config["lengths"] == sorted(config["lengths"])
    assert plan.load_config(None, "long")["lengths"] == [262144]


# ------------------------------------------- projections, small cells, fit


def test_plan_has_projections_small_cells_and_fit():
    config = plan.load_config(None)
    units = plan.units_for("jax", config)
    kinds = [u["kind"] for u in units]
    assert kinds[0] == "matmul"
    # A projection per (B, T) of the cells, next, in increasing B*T.
    projections = [u for u in units if u["kind"] == "projection"]
    assert kinds[1:1 + len(projections)] == ["projection"] * len(projections)
    assert [(u["B"], u["T"], u["shape"]) for u in projections] == [
        (1, 1024, [1024, 512, 512]), (8, 128, [1024, 512, 512]),
        (8, 256, [2048, 512, 512]), (1, 4096, [4096, 512, 512]),
        (8, 512, [4096, 512, 512]), (1, 16384, [16384, 512, 512]),
        (1, 65536, [65536, 512, 512])]
    # The small-model cells after the matrix's: B=8, no native peer.
    attention = [u for u in units if u["kind"] == "attention"]
    small = [u for u in attention if u["B"] == 8]
    assert attention[-len(small):] == small
    assert {u["B"] for u in attention} == {1, 8}
    assert [(u["T"], u["w"], u["impl"], u["mode"]) for u in small] == list(
        itertools.product([128, 256, 512], [None, 64],
                          ["keras", "ours", "ours_core"], plan.MODES))
    # The fit steps after them, then the feature cells.
    fit = [u for u in units if u["kind"] == "fit"]
    assert [(u["impl"], u["B"], u["T"], u["w"], u["layers"], u["warmup"],
             u["repeats"]) for u in fit] == [
        ("ours", 1, 4096, 128, 2, 3, 3), ("keras", 1, 4096, 128, 2, 3, 3)]
    assert kinds.index("fit") > len(kinds) - 1 - kinds[::-1].index(
        "attention")
    assert kinds.index("feature") > kinds.index("fit")
    assert len({u["id"] for u in units}) == len(units)
    # A small cell that is also one of the matrix's is measured once.
    same = {**config, "small": {**config["small"], "batch": 1,
                                "lengths": [1024]}}
    ids = [u["id"] for u in plan.units_for("jax", same)]
    assert len(set(ids)) == len(ids)
    assert "jax|B=1|T=1024|w=64|causal|ours|forward" in ids
    bare = plan.units_for("jax", {**config, "small": None, "fit": None})
    assert {u["B"] for u in bare if u["kind"] == "attention"} == {1}
    assert "fit" not in [u["kind"] for u in bare]
    assert not [u for u in plan.units_for("jax", config, only="features")
                if u["kind"] in ("projection", "fit")]
    quick = plan.load_config(None, "quick")
    assert quick["small"] == {"batch": 8, "lengths": [256],
                              "windows": [None, 64],
                              "implementations": ["keras", "ours"]}
    assert (quick["fit"]["length"], quick["fit"]["window"]) == (256, 32)


def test_fit_models_differ_only_in_their_attention():
    unit = {"B": 1, "T": 8, "w": 4, "layers": 2}
    ours = worker.transformer(
        lambda: keras_mha.MultiHeadAttention(2, 4, sliding_window=4), unit, 8)
    theirs = worker.transformer(
        lambda: keras.layers.MultiHeadAttention(2, 4), unit, 8)
    for model, cls in ((ours, keras_mha.MultiHeadAttention),
                       (theirs, keras.layers.MultiHeadAttention)):
        assert model.output.shape == (1, 8, 8)
        attention = [layer for layer in model.layers
                     if isinstance(layer, cls)]
        assert [layer.num_heads for layer in attention] == [2, 2]
    assert ours.count_params() == theirs.count_params()
    assert [type(layer) for layer in ours.layers
            if not isinstance(layer, keras_mha.MultiHeadAttention)] == [
        type(layer) for layer in theirs.layers
        if not isinstance(layer, keras.layers.MultiHeadAttention)]


def _matrix_cells(outcomes, rate=100.0, backends=("jax",)):
    """`(config, cells)`: `build_cells` of a small matrix (T in {16384,
    65536}, w in {none, 128}; keras, ours and ours core) and small cells
    (B=8, T=256, no window) with made-up results: 1 s and 1 MiB a unit
    unless `outcomes` maps (backend, B, T, w, impl, mode) to seconds, a
    status or result fields; every projection `rate` GFLOP/s (`None`: an
    error)."""
    config = plan.load_config(None, overrides={
        "lengths": [16384, 65536], "windows": [None, 128],
        "implementations": ["keras", "ours", "ours_core"],
        "small": {"lengths": [256], "windows": [None]}})
    config.update(fit=None, features=None, decode=None)
    units = {backend: plan.units_for(backend, config)
             for backend in backends}
    results = {}
    for backend, found in units.items():
        for unit in found:
            if unit["kind"] == "projection":
                results[unit["id"]] = (
                    {"status": plan.OK, "gflops": rate} if rate
                    else {"status": plan.ERROR, "reason": "because"})
            if unit["kind"] != "attention":
                continue
            outcome = outcomes.get((backend, unit["B"], unit["T"], unit["w"],
                                    unit["impl"], unit["mode"]), 1.0)
            if isinstance(outcome, str):
                results[unit["id"]] = {"status": outcome,
                                       "reason": "because"}
            else:
                fields = (outcome if isinstance(outcome, dict)
                          else {"time_s": outcome})
                results[unit["id"]] = {"status": plan.OK, "time_s": 1.0,
                                       "peak_bytes": 2**20, **fields}
    return config, report.build_cells(config, units, results)[0]


def test_the_roofline_is_the_layers_own_projections():
    config, cells = _matrix_cells({}, rate=100.0)
    found = {(c["B"], c["T"], c["w"], c["impl"]): c for c in cells}
    counts = plan.flops(config, 16384, 128, True)
    ours = found[1, 16384, 128, "ours"]
    assert ours["projection_gflops"] == 100.0
    forward = ours["forward"]
    assert forward["roofline_s"] == pytest.approx(counts["layer"] / 100e9)
    assert forward["time_over_roofline"] == pytest.approx(
        1.0 / forward["roofline_s"])
    assert forward["fraction_of_matmul"] == pytest.approx(
        1 / forward["time_over_roofline"])
    assert ours["forward_backward"]["roofline_s"] == pytest.approx(
        3 * forward["roofline_s"])
    core = found[1, 16384, 128, "ours_core"]["forward"]
    assert core["fraction_of_matmul"] == pytest.approx(
        counts["core"] / 1e9 / 100.0)
    assert "roofline_s" not in core
    # A rate timed alongside the layer's calls is the one it reads against.
    _, alongside = _matrix_cells({("jax", 1, 16384, 128, "ours", "forward"): {
        "time_s": 1.0, "projection_gflops": 50.0}})
    forward = next(c for c in alongside if (c["B"], c["T"], c["w"], c["impl"])
                   == (1, 16384, 128, "ours"))["forward"]
    assert forward["roofline_s"] == pytest.approx(counts["layer"] / 50e9)
    assert forward["fraction_of_matmul"] == pytest.approx(
        1 / forward["time_over_roofline"])
    small = found[8, 256, None, "ours"]
    assert small["layer_flops_forward"] == 8 * plan.flops(
        config, 256, None, True)["layer"]
    assert small["forward"]["keras_time_over_this"] == 1.0
    # Without a projection rate: no roofline and no fraction.
    _, cells = _matrix_cells({}, rate=None)
    assert all(c["projection_gflops"] is None
               and "roofline_s" not in c["forward"]
               and "fraction_of_matmul" not in c["forward"] for c in cells)


def test_roofline_and_no_window_targets():
    config, _ = _matrix_cells({})
    rate = 100.0
    roof = {w: plan.flops(config, 16384, w, True)["layer"] / (rate * 1e9)
            for w in (None, 128)}
    core = plan.flops(config, 16384, 128, True)["core"] / (rate * 1e9)
    _, cells = _matrix_cells({
        ("jax", 1, 16384, 128, "ours", "forward"): 1.4 * roof[128],
        ("torch", 1, 16384, 128, "ours", "forward"): 1.6 * roof[128],
        ("jax", 1, 16384, None, "ours", "forward"): {
            "time_s": 1.2 * roof[None], "peak_bytes": 2 * 2**30},
        ("torch", 1, 16384, None, "ours", "forward"): {
            "time_s": 1.2 * roof[None], "peak_bytes": 3 * 2**30},
        ("torch", 1, 65536, None, "ours", "forward"): plan.SKIPPED,
        ("jax", 1, 16384, 128, "ours_core", "forward"): core / 0.6,
        ("torch", 1, 16384, 128, "ours_core", "forward"): core / 0.3,
        ("torch", 8, 256, None, "ours", "forward_backward"): 1.1,
        **{(backend, 1, 16384, None, "keras", "forward"): 100.0
           for backend in ("jax", "torch")},
    }, rate, ("jax", "torch"))
    found = {t["id"]: t for t in report.targets(cells, ["jax", "torch"])}
    assert list(found)[:3] == ["roofline", "no_window_causal",
                               "no_window_long"]
    assert found["roofline"]["status"] == "not met"
    assert found["roofline"]["detail"].startswith("jax: 1.40x (")
    assert "torch: 1.60x" in found["roofline"]["detail"]
    assert found["no_window_causal"]["status"] == "not met"
    assert found["no_window_causal"]["detail"].startswith(
        "jax: peak 2048 MiB; jax: 1.20x")
    assert "torch: peak 3072 MiB" in found["no_window_causal"]["detail"]
    long_ = found["no_window_long"]
    assert long_["status"] == "not met"  # skipped is not completed
    assert long_["detail"] == ("jax: 1 s, peak 1 MiB; torch: ours: skipped "
                               "(because)")
    assert found["core_vs_matmul"]["status"] == "met"  # 60% on jax
    assert "jax: 60%" in found["core_vs_matmul"]["detail"]
    assert "torch: 30%" in found["core_vs_matmul"]["detail"]
    # The small-model cells count against Keras: 1 s / 1.1 s < 0.95.
    assert found["no_regression"]["status"] == "not met"
    assert "slowest: torch B=8 T=256 w=none forward_backward: 0.91x" in (
        found["no_regression"]["detail"])
    # Each within its bound: met; not in the run: n/a.
    _, cells = _matrix_cells({
        ("jax", 1, 16384, 128, "ours", "forward"): 1.49 * roof[128],
        ("jax", 1, 16384, None, "ours", "forward"): 1.49 * roof[None],
        ("jax", 1, 16384, None, "keras", "forward"): 100.0})
    found = {t["id"]: t for t in report.targets(cells, ["jax"])}
    for target in ("roofline", "no_window_causal", "no_window_long",
                   "no_regression"):
        assert found[target]["status"] == "met", found[target]
    assert found["core_vs_matmul"]["status"] == "not met"
    # The reference targets read the matrix's batch only.
    other = [{**c, "B": 2} if c["B"] == 1 else c for c in cells]
    found = {t["id"]: t for t in report.targets(other, ["jax"])}
    assert found["roofline"]["status"] == "n/a"
    assert found["no_window_long"]["status"] == "n/a"
    assert found["no_regression"]["status"] == "met"


def _fit_rows(outcomes, backends=("jax", "tensorflow", "torch")):
    """`build_fit` of the default fit section with made-up results: 1 s a
    step, compiled, unless `outcomes` maps (backend, impl) to a status or
    result fields."""
    config = plan.load_config(None)
    units = {backend: [u for u in plan.units_for(backend, config)
                       if u["kind"] == "fit"] for backend in backends}
    results = {}
    for found in units.values():
        for unit in found:
            outcome = outcomes.get((unit["backend"], unit["impl"]), {})
            results[unit["id"]] = (
                {"status": outcome, "reason": "because"}
                if isinstance(outcome, str) else
                {"status": plan.OK, "time_s": 1.0, "first_call_s": 9.0,
                 "compiler": "jit_compile=True", "jit_compile": True,
                 **outcome})
    return report.build_fit(units, results)


def test_fit_rows_and_their_target():
    backends = ["jax", "tensorflow", "torch"]
    not_compiled = {"compiler": "jit_compile=False", "jit_compile": False,
                    "note": "jit_compile=True: abandoned"}
    rows = _fit_rows({("jax", "ours"): {"time_s": 0.5},
                      ("tensorflow", "ours"): {"time_s": 1.25},
                      ("torch", "keras"): not_compiled})
    found = {(r["backend"], r["impl"]): r for r in rows}
    assert list(found) == list(itertools.product(backends, plan.FIT_IMPLS))
    assert (found["jax", "ours"]["T"], found["jax", "ours"]["w"]) == (4096,
                                                                      128)
    assert found["jax", "ours"]["keras_time_over_this"] == 2.0
    assert "keras_time_over_this" not in found["jax", "keras"]
    (target,) = report.targets([], backends, fit=rows)
    assert target["id"] == "fit_speed"
    assert target["status"] == "not met"  # tensorflow: 0.80x
    assert target["detail"] == (
        "jax: keras 1 s / ours 0.5 s = 2.00x; tensorflow: keras 1 s / ours "
        "1.25 s = 0.80x; torch: keras 1 s / ours 1 s = 1.00x; keras does not "
        "compile: jit_compile=True: abandoned")
    # Where Keras does not compile, the backend does not count.
    rows = _fit_rows({(backend, "ours"): {"time_s": 0.5}
                      for backend in ("jax", "tensorflow")}
                     | {("torch", "keras"): not_compiled})
    assert report.targets([], backends, fit=rows)[0]["status"] == "met"
    # Ours failing is a miss, Keras failing is not measured.
    rows = _fit_rows({("jax", "ours"): plan.ERROR,
                      ("torch", "keras"): plan.OUT_OF_MEMORY},
                     ("jax", "torch"))
    (target,) = report.targets([], ["jax", "torch"], fit=rows)
    assert target["status"] == "not met"
    assert target["detail"] == ("jax: ours: error (because); torch: keras: "
                                "out of memory (because)")
    rows = _fit_rows({("jax", "keras"): plan.TIMED_OUT}, ("jax",))
    assert report.targets([], ["jax"], fit=rows)[0]["status"] == "n/a"


# ------------------------------------------------------------ feature cells


def test_plan_has_a_unit_per_feature_and_mode():
    config = plan.load_config(None)
    units = plan.units_for("torch", config)
    kinds = [u["kind"] for u in units]
    features = [u for u in units if u["kind"] == "feature"]
    # After the attention cells, before decode; plain first; modes adjacent.
    assert kinds.index("feature") > max(
        i for i, kind in enumerate(kinds) if kind == "attention")
    assert kinds.index("decode") > max(
        i for i, kind in enumerate(kinds) if kind == "feature")
    assert [(u["feature"], u["mode"]) for u in features] == list(
        itertools.product(plan.FEATURES, plan.MODES))
    assert {(u["T"], u["w"], u["causal"], u["impl"]) for u in features} == {
        (16384, 128, True, "ours")}
    assert len({u["id"] for u in units}) == len(units)
    only = plan.units_for("torch", config, only="features")
    assert only == features
    quick = plan.load_config(None, "quick")["features"]
    assert (quick["length"], quick["window"]) == (512, 64)
    assert quick["features"] == list(plan.FEATURES)
    assert plan.units_for("torch", {**config, "features": None},
                          only="features") == []


def test_feature_arguments_turn_one_feature_on():
    config = plan.load_config(None)
    for feature in plan.FEATURES:
        arguments, segments = worker.feature_arguments(feature, config)
        layer = keras_mha.MultiHeadAttention(2, 4, **arguments)
        on = {"rope": layer.rotary_embedding is not None,
              "soft_cap": layer.attn_logits_soft_cap == 50.0,
              "sinks": layer.use_sinks, "alibi": layer.use_alibi,
              "segments": segments == 4}
        assert [name for name, value in on.items() if value] == (
            [] if feature == "plain" else [feature])
    # 4 equal runs per row; 10 tokens do not split evenly.
    assert worker.segment_ids(2, 8, 4).tolist() == [
        [0, 0, 1, 1, 2, 2, 3, 3]] * 2
    assert worker.segment_ids(1, 10, 4).tolist() == [
        [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]]
    assert worker.segment_ids(1, 8, 4).dtype == "int32"


def _feature_results(times):
    """Units of two features on jax and made-up results: `times` maps
    (feature, mode) to seconds or to a status."""
    config = plan.load_config(None, overrides={"features": {
        "features": ["plain", "rope", "alibi"]}})
    units = {"jax": plan.units_for("jax", config, only="features")}
    results = {}
    for unit in units["jax"]:
        outcome = times.get((unit["feature"], unit["mode"]))
        if isinstance(outcome, float):
            results[unit["id"]] = {"status": plan.OK, "time_s": outcome,
                                   "path": dispatch.BANDED}
        elif outcome is not None:
            results[unit["id"]] = {"status": outcome, "reason": "because"}
    return units, results


def test_feature_ratios_and_their_target():
    units, results = _feature_results({
        ("plain", "forward"): 1.0, ("plain", "forward_backward"): 3.0,
        ("rope", "forward"): 1.25, ("rope", "forward_backward"): 4.5,
        ("alibi", "forward"): 1.1, ("alibi", "forward_backward"): 3.3,
    })
    rows = {r["feature"]: r for r in report.build_features(units, results)}
    assert rows["plain"]["path"] == dispatch.BANDED
    assert "target" not in rows["plain"]
    rope = rows["rope"]
    assert rope["forward"]["ratio_to_plain"] == pytest.approx(1.25)
    assert rope["forward"]["within_target"]
    assert rope["forward_backward"]["ratio_to_plain"] == pytest.approx(1.5)
    assert not rope["forward_backward"]["within_target"]
    assert (rope["target"], rows["alibi"]["target"]) == ("not met", "met")
    (target,) = report.targets([], ["jax"], list(rows.values()))
    assert target["id"] == "feature_ratios"
    assert target["status"] == "not met"
    assert target["detail"] == ("jax: worst RoPE fwd+bwd 1.50x (above 1.3x "
                                "or unmeasured: RoPE fwd+bwd 1.50x)")


def test_feature_target_counts_failures_not_skips():
    base = {("plain", "forward"): 1.0, ("plain", "forward_backward"): 3.0,
            ("rope", "forward"): 1.0, ("rope", "forward_backward"): 3.0,
            ("alibi", "forward"): 1.0}
    skipped = report.build_features(*_feature_results(
        {**base, ("alibi", "forward_backward"): plan.SKIPPED}))
    failed = report.build_features(*_feature_results(
        {**base, ("alibi", "forward_backward"): plan.ERROR}))
    no_plain = report.build_features(*_feature_results(
        {**base, ("plain", "forward"): plan.OUT_OF_MEMORY}))
    assert [r.get("target") for r in skipped] == [None, "met", "met"]
    assert [r.get("target") for r in failed] == [None, "met", "not met"]
    assert [r.get("target") for r in no_plain] == [None, "not met",
                                                   "not met"]
    (target,) = report.targets([], ["jax"], failed)
    assert target["status"] == "not met"
    assert "ALiBi fwd+bwd: error" in target["detail"]
    assert report.targets([], ["jax"], skipped)[0]["status"] == "met"


# ------------------------------------------------------------ decode cells


def test_plan_has_the_decode_cells():
    config = plan.load_config(None)
    spec = config["decode"]
    assert (spec["full_length"], spec["short_length"], spec["window"],
            spec["positions"]) == (65536, 2048, 512, [1024, 16384, 65535])
    units = plan.units_for("jax", config)
    decode = [u for u in units if u["kind"] in (
        "floor", "decode", "generate", "prefill")]
    assert units[-len(decode):] == decode  # the section comes last
    assert plan.units_for("jax", config, only="decode") == decode
    assert len({u["id"] for u in units}) == len(units)
    # Floors first, in the fast mode: p + 1 slots of the full cache, the
    # rolling cache's w.
    floors = [(u["cache"], u["slots"], u["position"], u["reads"], u["mode"])
              for u in decode if u["kind"] == "floor"]
    assert floors == [("full", 65536, 1024, 1025, "compiled"),
                      ("full", 65536, 16384, 16385, "compiled"),
                      ("full", 65536, 65535, 65536, "compiled"),
                      ("rolling", 512, None, 512, "compiled")]
    assert [u["kind"] for u in decode[:4]] == ["floor"] * 4
    # The groups timed alternately: the floors go with ours in the fast
    # mode, which comes first.
    groups = [plan.decode_group(u) for u in decode
              if u["kind"] in ("floor", "decode")]
    assert list(dict.fromkeys(groups)) == [
        ("ours", "compiled"), ("ours", "eager"), ("keras_hub", "eager"),
        ("keras_hub", "compiled"), ("ours_default", "eager")]
    steps = [(u["impl"], u["cache"], u["slots"], u["mode"], u["position"])
             for u in decode if u["kind"] == "decode"]
    ours = [1, 1024, 16384, 65535]
    # Each (implementation, mode) is one group, timed alternately by its
    # first unit: its caches, each at its positions.
    expected = [
        cell for m in ("compiled", "eager") for cell in (
            [("ours", "full", 65536, m, p) for p in ours]
            + [("ours", "full", 2048, m, 1024)]
            + [("ours", "rolling", 512, m, p) for p in ours])
    ] + [
        cell for m in plan.DECODE_MODES for cell in (
            [("keras_hub", "full", 65536, m, p) for p in ours[1:]]
            + [("keras_hub", "full", 2048, m, 1024)])
    ] + [("ours_default", "full", slots, "eager", 1024)
         for slots in (65536, 2048)]
    assert steps == expected
    # Every position fits its full cache: index + 1 <= L.
    assert all(p + 1 <= slots for _, cache, slots, _, p in steps
               if cache == "full")
    generate = [u for u in decode if u["kind"] == "generate"]
    assert [(u["impl"], u["prompt_length"], u["max_length"])
            for u in generate] == [("ours", 8, 128), ("keras_hub", 8, 128)]
    prefill = [(u["cache"], u["T"], u["w"], u["mode"]) for u in decode
               if u["kind"] == "prefill"]
    assert prefill == [
        (cache, 8192, w, m) for w, name in ((128, "rolling"), (None, "full"))
        for m in plan.DECODE_MODES for cache in ("none", name)]
    # torch: eager only, its floors too.
    torch = plan.units_for("torch", config, only="decode")
    assert {u["mode"] for u in torch if "mode" in u} == {"eager"}
    assert plan.fast_mode("torch") == "eager"
    assert plan.fast_mode("tensorflow") == "compiled"
    assert plan.units_for("jax", {**config, "decode": None},
                          only="decode") == []
    quick = plan.load_config(None, "quick")["decode"]
    assert (quick["full_length"], quick["positions"],
            quick["prefill"]["length"]) == (1024, [64, 512], 256)
    # The profile changes the nested sections field by field.
    assert quick["generate"] == {"prompt_length": 8, "max_length": 32,
                                 "repeats": 1}


def test_decode_helpers():
    assert worker.causal_cache_mask(2, 4, 1).tolist() == [
        [[True, True, False, False]]] * 2
    inputs = worker.generate_inputs(1, 3, 6, 50)
    assert inputs["token_ids"].tolist() == [[1, 2, 3, 0, 0, 0]]
    assert inputs["token_ids"].dtype == "int32"
    assert inputs["padding_mask"].tolist() == [[True] * 3 + [False] * 3]


def _decode_document(backend, times):
    """`build_decode` of the default decode section on `backend` with
    made-up results: `times` maps (impl, cache, slots, position, mode) or
    (kind, ...) to seconds or to a status, else 2 ms a step."""
    config = plan.load_config(None)
    units = {backend: plan.units_for(backend, config, only="decode")}
    results = {}
    for unit in units[backend]:
        key = ((unit["impl"], unit["cache"], unit["slots"], unit["position"],
                unit["mode"]) if unit["kind"] == "decode"
               else ("read", unit["cache"], unit["position"])
               if unit["kind"] == "floor"
               else ("generate", unit["impl"]) if unit["kind"] == "generate"
               else ("prefill", unit["cache"], unit["mode"]))
        outcome = times.get(key)
        if isinstance(outcome, str):
            results[unit["id"]] = {"status": outcome, "reason": "because"}
            continue
        result = {"status": plan.OK, **_made_up(unit)}
        if outcome is not None:
            result["time_s"] = outcome
        if unit["kind"] == "generate":
            result["tokens_per_s"] = result["tokens"] / result["time_s"]
        results[unit["id"]] = result
    return report.build_decode(config, units, results)


def test_decode_ratios_and_their_targets():
    full = 65536
    decode = _decode_document("jax", {
        ("ours", "full", full, 1024, "eager"): 3e-3,
        ("ours", "full", 2048, 1024, "eager"): 2.5e-3,  # 1.2x
        ("keras_hub", "full", full, 1024, "eager"): 60e-3,  # 20x
        ("ours_default", "full", full, 1024, "eager"): 10e-3,  # 6x
        ("ours", "full", full, 1, "compiled"): 1e-3,
        ("read", "full", 65535): 2e-3,
        ("ours", "full", full, 65535, "compiled"): 8e-3,  # 1 + 3.5 x 2
        ("ours", "rolling", 512, 1, "compiled"): 1e-3,
        ("read", "rolling", None): 1e-3,
        ("ours", "rolling", 512, 65535, "compiled"): 2.5e-3,  # 1.25x p=1024
        ("generate", "ours"): 0.08,  # 300 against 240 tokens/s
        ("prefill", "full", "compiled"): 0.4,  # 1.6x
    })
    steps = {(r["impl"], r["cache"], r["slots"], r["position"]): r
             for r in decode["steps"]}
    step = steps["ours", "full", full, 1024]["eager"]
    assert step["keras_hub_over_this"] == pytest.approx(20.0)
    assert step["over_short_cache"] == pytest.approx(1.2)
    assert "over_floor_after_fixed" not in step  # no eager floor on jax
    last = steps["ours", "full", full, 65535]["compiled"]
    assert last["over_floor_after_fixed"] == pytest.approx(3.5)
    assert (last["floor_s"], last["fixed_s"]) == (2e-3, 1e-3)
    rolling = steps["ours", "rolling", 512, 65535]["compiled"]
    assert rolling["over_first_position"] == pytest.approx(1.25)
    assert rolling["over_floor_after_fixed"] == pytest.approx(1.5)
    assert "keras_hub_over_this" not in steps[
        "keras_hub", "full", full, 1024]["eager"]
    default = steps["ours_default", "full", full, 1024]
    assert default["label"] == "ours (default)"
    assert default["eager"]["keras_hub_over_this"] == pytest.approx(6.0)
    assert "compiled" not in default  # compiled steps are alike in both
    generate = {r["impl"]: r for r in decode["generate"]}
    assert generate["ours"]["over_keras_hub"] == pytest.approx(1.25)
    assert generate["ours"]["same_tokens"]
    prefill = {(r["cache"], r["w"]): r for r in decode["prefill"]}
    assert prefill["full", None]["compiled"]["over_no_cache"] == (
        pytest.approx(1.6))
    assert prefill["rolling", 128]["eager"]["over_no_cache"] == (
        pytest.approx(1.0))

    found = {t["id"]: t for t in report.targets([], ["jax"], (), decode)}
    assert list(found) == ["decode_cache_size", "decode_vs_keras_hub",
                           "default_decode_vs_keras_hub",
                           "decode_floor", "rolling_decode",
                           "generate_speed", "prefill_ratio"]
    assert {k: t["status"] for k, t in found.items()} == {
        "decode_cache_size": "met", "decode_vs_keras_hub": "met",
        "default_decode_vs_keras_hub": "met",
        "decode_floor": "not met", "rolling_decode": "not met",
        "generate_speed": "met", "prefill_ratio": "not met"}
    assert found["decode_cache_size"]["detail"] == (
        "jax: 3 ms / 2.5 ms = 1.20x")
    assert found["decode_vs_keras_hub"]["detail"] == (
        "jax: keras-hub 60 ms / ours 3 ms = 20.0x")
    assert found["default_decode_vs_keras_hub"]["detail"] == (
        "jax: keras-hub 60 ms / ours 10 ms = 6.0x")
    assert found["decode_floor"]["detail"] == (
        "jax compiled p=65535: 8 ms vs 3 x 2 ms + 1 ms = 7 ms ((t - fixed) "
        "/ floor = 3.50)")
    assert "jax compiled: slowest / fastest 1.25" in found[
        "rolling_decode"]["detail"]
    assert "jax eager: slowest / fastest 1.00" in found[
        "rolling_decode"]["detail"]
    assert "jax full w=none compiled 1.60x" in found["prefill_ratio"][
        "detail"]
    assert found["generate_speed"]["detail"] == (
        "jax: ours 300 / keras-hub 240 tokens/s = 1.25x, same tokens")


def test_decode_targets_count_our_failures_not_keras_hubs():
    full = 65536
    theirs_failed = _decode_document("torch", {
        ("keras_hub", "full", full, 1024, "eager"): plan.OUT_OF_MEMORY,
        ("generate", "keras_hub"): plan.NOT_AVAILABLE,
    })
    found = {t["id"]: t for t in report.targets([], ["torch"], (),
                                                theirs_failed)}
    assert found["decode_vs_keras_hub"]["status"] == "n/a"
    assert found["decode_vs_keras_hub"]["detail"] == (
        "torch: keras-hub: out of memory (because)")
    assert found["generate_speed"]["status"] == "n/a"
    # torch has no compiled mode: its floor targets read eager.
    assert found["decode_floor"]["detail"].startswith("torch eager p=65535")
    ours_failed = _decode_document("torch", {
        ("ours", "full", full, 1024, "eager"): plan.ERROR,
        ("ours", "rolling", 512, 16384, "eager"): plan.TIMED_OUT,
        ("prefill", "rolling", "eager"): plan.ERROR,
    })
    found = {t["id"]: t for t in report.targets([], ["torch"], (),
                                                ours_failed)}
    for target in ("decode_cache_size", "decode_vs_keras_hub",
                   "rolling_decode", "prefill_ratio"):
        assert found[target]["status"] == "not met", found[target]
    assert "torch: ours L=65536: error (because)" in found[
        "decode_cache_size"]["detail"]
    assert found["decode_floor"]["status"] == "met"


# ------------------------------------------------------------ FLOPs, caps


@pytest.mark.parametrize(
    "t_len, window, causal",
    [(1, None, True), (7, None, True), (7, None, False), (7, 1, True),
     (7, 3, True), (7, 3, False), (7, 10, True), (7, 10, False)],
)
def test_allowed_pairs_counts_the_mask(t_len, window, causal):
    expected = sum(
        1
        for t in range(t_len)
        for j in range(t_len)
        if (not causal or j <= t) and (window is None or abs(t - j) < window)
    )
    assert plan.allowed_pairs(t_len, t_len, window, causal) == expected


def test_flops_of_the_reference_cell():
    config = plan.load_config(None)
    counts = plan.flops(config, 16384, 128, True)
    # Every query sees min(t + 1, 128) keys.
    assert counts["pairs"] == 127 * 128 // 2 + (16384 - 127) * 128
    assert counts["core"] == 4 * 8 * 64 * counts["pairs"]
    assert counts["projections"] == 4 * 2 * 16384 * 512 * 512


def _unit(t_len, impl="keras", mode="forward"):
    return {"kind": "attention", "backend": "jax", "T": t_len, "w": 128,
            "causal": True, "impl": impl, "mode": mode}


def test_caps_extrapolate_from_the_last_measured_length():
    config = plan.load_config(None)  # time cap 60 s, memory cap 16 GiB
    history = [{"T": 1024, "status": plan.OK, "time_s": 0.5,
                "peak_bytes": 2**20},
               {"T": 4096, "status": plan.OK, "time_s": 4.0,
                "peak_bytes": 2**28}]
    # Dense: 4.0 s * 4^2 = 64 s > 60 s.
    reason = plan.cap_reason(_unit(16384), config, "dense", history)
    assert reason.startswith("over time cap (est. 64 s")
    # Banded: 4.0 s * 4 = 16 s, 256 MiB * 4 = 1 GiB: runs.
    assert plan.cap_reason(_unit(16384), config, "banded", history) is None
    # Memory: 1 GiB * 4^2 = 16 GiB > 8 GiB.
    history[-1].update(time_s=0.1, peak_bytes=2**30)
    reason = plan.cap_reason(_unit(16384), config, "dense", history,
                             memory_cap_bytes=8 * 2**30)
    assert reason.startswith("over memory cap (est. 16.0 GiB > 8.0 GiB")


def test_caps_spare_our_forward_and_follow_the_memory_growth():
    config = plan.load_config(None)  # time cap 60 s, memory cap 16 GiB
    # Every pair computed (time as T^2), O(T) memory (blocks).
    history = [{"T": 4096, "status": plan.OK, "time_s": 0.5,
                "peak_bytes": 2**28},
               {"T": 16384, "status": plan.OK, "time_s": 8.0,
                "peak_bytes": 2**30}]
    unit = {**_unit(65536, "ours"), "w": None}
    seconds, predicted, _ = plan.estimate(unit, config, "dense", history)
    assert seconds == pytest.approx(128.0)  # 8 s * 4^2
    assert predicted == pytest.approx(4 * 2**30)  # 1 GiB * 4: grew as T
    # Over the time cap, but our layer's forward must complete: it runs.
    assert plan.cap_reason(unit, config, "dense", history) is None
    for other in ({**unit, "impl": "keras"},
                  {**unit, "mode": "forward_backward"}):
        assert plan.cap_reason(other, config, "dense", history).startswith(
            "over time cap (est. 128 s")
    # Memory growing faster than T^2 is read as T^2; one measurement: T^2.
    history[0]["peak_bytes"] = 2**20
    assert plan.estimate(unit, config, "dense", history)[1] == (
        pytest.approx(16 * 2**30))
    assert plan.estimate(unit, config, "dense", history[1:])[1] == (
        pytest.approx(16 * 2**30))
    # The memory cap still holds for ours.
    reason = plan.cap_reason(unit, config, "dense", history[1:],
                             memory_cap_bytes=8 * 2**30)
    assert reason.startswith("over memory cap (est. 16.0 GiB > 8.0 GiB")


def test_caps_without_history_use_the_analytic_bytes():
    config = plan.load_config(None)
    dense = plan.dense_bytes(config, 65536)  # 8 * 65536^2 * 4 * 3
    assert dense == 8 * 65536**2 * 4 * 3
    reason = plan.cap_reason(_unit(65536), config, "dense", [], dense)
    assert reason.startswith("over memory cap")
    assert plan.cap_reason(_unit(1024), config, "dense", [],
                           plan.dense_bytes(config, 1024)) is None


def test_a_series_that_gave_up_stays_given_up():
    config = plan.load_config(None)
    history = [{"T": 1024, "status": plan.OK, "time_s": 0.01,
                "peak_bytes": 0},
               {"T": 4096, "status": plan.OUT_OF_MEMORY,
                "reason": "worker killed"}]
    reason = plan.cap_reason(_unit(16384), config, "dense", history)
    assert reason == "out of memory at T=4096 already (worker killed)"


def test_targets_compare_the_reference_cell():
    def cell(backend, impl, t_len, window, forward, both=None, peak=2**20):
        entry = {"backend": backend, "B": 1, "T": t_len, "w": window,
                 "causal": True, "impl": impl, "scope": plan.SCOPE[impl]}
        entry["forward"] = {"status": plan.OK, "time_s": forward,
                            "peak_bytes": peak}
        entry["forward_backward"] = (
            {"status": plan.OK, "time_s": both} if both else
            {"status": plan.SKIPPED, "reason": "over memory cap (est. 20 GiB)"}
        )
        return entry

    cells = [
        cell("jax", "ours", 16384, 128, 0.5, 1.0),
        cell("jax", "keras", 16384, 128, 5.0, 20.0),
        cell("jax", "ours", 65536, 128, 2.0, 4.0),
        cell("torch", "ours", 16384, 128, 0.5, 1.0, peak=3 * 2**30),
        cell("torch", "keras", 16384, 128, 5.0),
    ]
    results = {t["id"]: t for t in report.targets(cells, ["jax", "torch"])}
    training = results["training_speedup"]
    assert training["status"] == "met"  # 20x on jax; keras skipped on torch
    assert "torch: keras: skipped" in training["detail"]
    assert results["peak_memory"]["status"] == "not met"  # 3 GiB on torch
    scaling = results["linear_scaling"]
    assert scaling["status"] == "met"  # jax 2.0 s / 0.5 s; torch: no data
    assert "jax w=128: 4.00" in scaling["detail"]
    assert results["keras_over_ours"]["detail"] == (
        "torch: keras/ours = 10.0x; jax: keras/ours = 10.0x")


# ------------------------------------------------------------ collection


@pytest.mark.parametrize("backends, chosen", [
    ("tensorflow,jax,torch,numpy", "numpy"),
    ("jax,torch", "jax"),
    ("torch", "torch"),
    ("", None),  # plain pytest: collected on its backend
])
def test_backend_free_tests_are_collected_on_one_backend(backends, chosen,
                                                          monkeypatch):
    monkeypatch.setenv("KERAS_MHA_TEST_BACKENDS", backends)
    assert conftest.backend_free_backend() == chosen
