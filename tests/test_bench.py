"""`keras-mha bench`: the quick matrix end to end, and the parts around it.

The end-to-end tests run `python -m keras_mha bench --quick --no-features`
and `--quick --features` on the backend the suite runs on (a worker process
per backend, so it takes a while: it compiles every implementation twice).
NumPy is not benchmarked (no compiler, no autodiff): there the command must
say so in one line.
"""

import itertools
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import BACKEND

import keras_mha
from keras_mha import cli
from keras_mha.attention import dispatch
from keras_mha.cli.bench import plan
from keras_mha.cli.bench import report
from keras_mha.cli.bench import worker

STATUSES = {plan.OK, plan.SKIPPED, plan.OUT_OF_MEMORY, plan.TIMED_OUT,
            plan.ERROR, plan.NOT_AVAILABLE}


def run_bench(*args, cwd):
    env = dict(os.environ, KERAS_BACKEND=BACKEND, PYTHONIOENCODING="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "keras_mha", "bench", *args],
        capture_output=True, text=True, encoding="utf-8", cwd=cwd, env=env,
        timeout=900,
    )


# ------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    result = run_bench("--quick", "--no-features", "--backends", BACKEND,
                       "--out", "out", cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(folder / "out" / "bench.json", encoding="utf-8") as file:
        document = json.load(file)
    return result, document, folder / "out"


def _check_outcome(outcome, where):
    assert outcome["status"] in STATUSES, where
    if outcome["status"] == plan.OK:
        assert outcome["time_s"] > 0, where
        assert outcome["repeats"] >= 1, where
    else:
        assert outcome.get("reason"), where


@pytest.mark.training
def test_quick_reports_every_cell(quick_run):
    _, document, _ = quick_run
    config = plan.load_config(None, "quick")
    cells = {(c["backend"], c["T"], c["w"], c["causal"], c["impl"]): c
             for c in document["cells"]}
    expected = set(itertools.product(
        [BACKEND], config["lengths"], config["windows"], config["causal"],
        plan.implementations_for(BACKEND, config),
    ))
    assert set(cells) == expected
    for key, cell in cells.items():
        for mode in config["modes"]:
            _check_outcome(cell[mode], (key, mode))
        if cell["impl"] == "ours":  # the layer's own answer, per cell
            shape = (config["batch"], cell["T"],
                     config["num_heads"] * config["key_dim"])
            layer = keras_mha.MultiHeadAttention(
                config["num_heads"], config["key_dim"],
                sliding_window=cell["w"])
            path = layer.attention_path(shape, shape,
                                        use_causal_mask=cell["causal"])
            assert cell["forward"]["path"] == path, (key, cell)
            assert (cell["forward"]["complexity"] == "banded") == (
                path == dispatch.BANDED), (key, cell)
        # The small matrix is far from every cap: our layer must run.
        if cell["impl"] in ("ours", "ours_core", "keras"):
            assert cell["forward"]["status"] == plan.OK, (key, cell)
            assert cell["forward_backward"]["status"] == plan.OK, (key, cell)
    if BACKEND == "torch":
        flex = [c for c in cells.values() if c["impl"] == "flex_attention"]
        assert all(c["forward_backward"]["status"] == plan.NOT_AVAILABLE
                   for c in flex)
        assert all("block_mask_s" in c["forward"] for c in flex
                   if c["forward"]["status"] == plan.OK)


@pytest.mark.training
def test_quick_reports_decode_and_matmul(quick_run):
    _, document, _ = quick_run
    spec = plan.load_config(None, "quick")["decode"]
    entries = {(d["cache"], d["position"]): d for d in document["decode"]}
    assert set(entries) == set(itertools.product(["rolling", "full"],
                                                 spec["positions"]))
    for key, entry in entries.items():
        assert entry["status"] == plan.OK, (key, entry)
        assert entry["ms_per_token"] > 0
    rolling = entries["rolling", spec["positions"][0]]
    full = entries["full", spec["positions"][0]]
    assert rolling["slots"] == spec["window"]
    assert full["slots"] == spec["full_length"]
    assert rolling["cache_bytes"] < full["cache_bytes"]
    assert document["matmul"][BACKEND]["status"] == plan.OK
    assert document["matmul"][BACKEND]["gflops"] > 0
    assert document["features"] == []  # --no-features


@pytest.mark.training
def test_quick_writes_plot_table_and_targets(quick_run):
    result, document, out = quick_run
    with open(out / "bench.png", "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "ours core" in result.stdout
    assert "targets" in result.stdout
    assert "Traceback" not in result.stderr
    markdown = (out / "report.md").read_text(encoding="utf-8")
    assert "ours core" in markdown
    assert "targets" in markdown
    assert document["flops_definition"] == plan.FLOPS_DEFINITION
    assert document["peak_memory"]["method"]
    assert {t["status"] for t in document["targets"]} <= {
        "met", "not met", "n/a", "info"}


@pytest.fixture(scope="module")
def features_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench-features")
    result = run_bench("--quick", "--features", "--backends", BACKEND,
                       "--out", "out", cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(folder / "out" / "bench-features.json",
              encoding="utf-8") as file:
        document = json.load(file)
    return result, document, folder / "out"


def _feature_path(config, feature):
    """What our layer answers for a feature cell of `config`."""
    arguments, segments = worker.feature_arguments(feature, config)
    spec = config["features"]
    layer = keras_mha.MultiHeadAttention(
        config["num_heads"], config["key_dim"], sliding_window=spec["window"],
        **arguments)
    shape = (config["batch"], spec["length"],
             config["num_heads"] * config["key_dim"])
    return layer.attention_path(shape, shape, use_causal_mask=spec["causal"],
                                segment_ids=bool(segments))


@pytest.mark.training
def test_features_run_reports_every_feature_with_ratios(features_run):
    result, document, out = features_run
    config = plan.load_config(None, "quick")
    spec = config["features"]
    rows = {r["feature"]: r for r in document["features"]}
    assert list(rows) == spec["features"]
    for feature, row in rows.items():
        assert (row["backend"], row["T"], row["w"], row["causal"]) == (
            BACKEND, spec["length"], spec["window"], spec["causal"])
        assert row["path"] == _feature_path(config, feature), row
        for mode in spec["modes"]:
            outcome = row[mode]
            assert outcome["status"] == plan.OK, (feature, mode, outcome)
            assert outcome["path"] == row["path"]
            if feature == "plain":
                assert "ratio_to_plain" not in outcome
                continue
            ratio = outcome["time_s"] / rows["plain"][mode]["time_s"]
            assert outcome["ratio_to_plain"] == pytest.approx(ratio)
            assert outcome["within_target"] == (
                ratio <= report.MAX_FEATURE_RATIO)
        assert row.get("target", "baseline") in {"met", "not met",
                                                 "baseline"}
    # The feature cells only: no matmul, attention cells, decode or plot.
    assert document["what"] == "keras-mha bench --features"
    assert document["cells"] == [] and document["decode"] == []
    assert [t["id"] for t in document["targets"]] == ["feature_ratios"]
    assert not (out / "bench.png").exists()
    markdown = (out / "report-features.md").read_text(encoding="utf-8")
    for text in (result.stdout, markdown):
        assert f"features, {BACKEND}, T={spec['length']}" in text
        assert "segment ids" in text and "x plain" in text
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------ report.md


def _finished_run(backend="jax"):
    """The document of a run of the quick matrix with made-up results; one
    unit was skipped."""
    config = plan.load_config(None, "quick")
    units = {backend: plan.units_for(backend, config)}
    results = {}
    for unit in units[backend]:
        if unit["kind"] == "matmul":
            result = {"gflops": 50.0}
        elif unit["kind"] == "decode":
            result = {"ms_per_token": 1.5, "cache_bytes": 2**20}
        elif unit["kind"] == "feature":  # every feature 1.2x plain
            time_s = 0.25 if unit["feature"] == "plain" else 0.3
            result = {"time_s": time_s, "peak_bytes": 2**20,
                      "path": dispatch.BANDED}
        else:
            result = {"time_s": 0.25, "peak_bytes": 2**20}
        results[unit["id"]] = {"status": plan.OK, **result}
    skipped = next(u for u in units[backend] if u.get("impl") == "keras")
    results[skipped["id"]] = {"status": plan.SKIPPED,
                              "reason": "over time cap (est. 99 s > 60 s)"}
    cells, decode, matmul = report.build_cells(config, units, results)
    features = report.build_features(units, results)
    return {
        "what": "keras-mha bench", "config": config, "backends": [backend],
        "machine": {"platform": "Linux", "processor": "x86_64", "cpus": 2,
                    "python": "3.11.0"},
        "backend_info": {backend: {"version": "0.0", "keras": "3.15.1"}},
        "matmul": matmul, "cells": cells, "decode": decode,
        "features": features,
        "targets": report.targets(cells, [backend], features),
        "seconds": 12.0,
    }


def test_report_md_has_every_row_of_the_terminal_report(tmp_path):
    document = _finished_run()
    path = tmp_path / "report.md"
    report.write_markdown(path, document, "bench.json")
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# `keras-mha bench`\n")
    assert "`bench.json`" in text and "jax 0.0, keras 3.15.1" in text
    assert text.count("```") == 2  # one text block
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("│ jax")]
    assert len(rows) == len(document["cells"]) + len(document["decode"])
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
    if unit["impl"] == "keras" and not message["skip_compilers"]:
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
    from keras_mha.cli.bench import runner

    monkeypatch.setattr(runner, "worker_command",
                        lambda path: [sys.executable, "-c", _FAKE_WORKER])
    config = plan.load_config(None, overrides={
        "lengths": [256, 512], "windows": [64], "modes": ["forward"],
        "implementations": ["keras", "ours"], "time_cap_s": 0.5})
    config.update(compile_allowance_s=0.5, decode=None, features=None)
    units = plan.units_for("jax", config)
    bench = runner.Runner(config, log_folder=str(tmp_path))
    try:
        results = bench.run({"jax": units})
    finally:
        bench.close()
    matmul, *attention = (results[u["id"]] for u in units)
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
        (["--repeats", "0"], "must be positive"),
        (["--config", "no-such-file.json"], "cannot read config"),
    ],
)
def test_errors_are_one_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("keras-mha: error: ")
    assert message in err


@pytest.mark.parametrize(
    "config, args, message",
    [
        ({"lenghts": [1024]}, [], "unknown field(s) lenghts"),
        ({"lengths": [1024]}, ["--quick"], "no 'quick' object for --quick"),
        ({"lengths": []}, [], "lengths must be a list of positive integers"),
        ({"decode": {"window": 8, "positions": [9], "full_length": 9,
                     "repeats": 1}}, [], "every position must be < "
         "full_length"),
        ({"features": {"features": ["rope"]}}, [], "must include plain"),
        ({"features": {"features": ["plain", "gqa"]}}, [],
         "features must be a list drawn from plain, rope"),
        ({"features": {"soft_cap": 0}}, [], "soft_cap a positive number"),
        ({"features": {"colour": 1}}, [], "features must be null or an "
         "object with"),
        ({"features": None}, ["--features"], "features section is null"),
    ],
)
def test_config_errors(tmp_path, capsys, config, args, message):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(config))
    assert cli.main(["bench", "--config", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message in err


def test_default_config_is_valid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the packaged matrix, not the checkout's
    folder = os.path.join(os.path.dirname(cli.__file__), "matrices")
    assert plan.load_config(None)["source"] == os.path.join(folder,
                                                            "bench.json")
    for profile in (None, "quick", "long"):
        config = plan.load_config(None, profile)
        assert config["lengths"] == sorted(config["lengths"])
    assert plan.load_config(None, "long")["lengths"] == [262144]


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
    only = plan.units_for("torch", config, only_features=True)
    assert only == features
    quick = plan.load_config(None, "quick")["features"]
    assert (quick["length"], quick["window"]) == (512, 64)
    assert quick["features"] == list(plan.FEATURES)
    assert plan.units_for("torch", {**config, "features": None},
                          only_features=True) == []


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
    units = {"jax": plan.units_for("jax", config, only_features=True)}
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
        entry = {"backend": backend, "T": t_len, "w": window, "causal": True,
                 "impl": impl, "scope": plan.SCOPE[impl]}
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
