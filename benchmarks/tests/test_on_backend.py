"""The benchmarks on the backend the suite runs on.

The end-to-end tests run `python -m benchmarks --quick --no-features
--no-decode` (the matrix, the small-model cells and the fit step),
`--quick --features` and `--quick --decode` on this backend (a worker
process, so it takes a while: it compiles every implementation twice);
the worker's timing is tested on this backend's worker. NumPy is not
benchmarked (no compiler, no autodiff): these tests are skipped there.
"""

import functools
import itertools
import json
import os
import subprocess
import sys

import keras
import pytest

import keras_mha
from benchmarks import default_step
from benchmarks import fit_step
from benchmarks import hub
from benchmarks import latent
from benchmarks import plan
from benchmarks import report
from benchmarks import worker
from keras_mha.attention import dispatch

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(
    BACKEND not in plan.BENCH_BACKENDS,
    reason=f"the {BACKEND} backend is not benchmarked (no compiler, no "
    "autodiff)")
# The checkout: `python -m benchmarks` runs from anywhere with it on the path.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

STATUSES = {plan.OK, plan.SKIPPED, plan.OUT_OF_MEMORY, plan.TIMED_OUT,
            plan.ERROR, plan.NOT_AVAILABLE}


def _end_to_end_backend():
    """The one backend of a `keras-mha test` run whose process runs the
    end-to-end `python -m benchmarks` runs (TensorFlow where it is in the
    run): they test the harness, which is the same for every backend, and
    each costs minutes. A direct pytest run (no `KERAS_MHA_TEST_BACKENDS`)
    runs them on its own backend."""
    named = [name for name in
             os.environ.get("KERAS_MHA_TEST_BACKENDS", "").split(",")
             if name in plan.BENCH_BACKENDS]
    if not named:
        return BACKEND
    return "tensorflow" if "tensorflow" in named else named[0]


def _skip_unless_end_to_end_backend():
    chosen = _end_to_end_backend()
    if chosen != BACKEND:
        pytest.skip(f"the end-to-end benchmark runs are run once per "
                    f"`keras-mha test`, on {chosen}")


def run_bench(*args, cwd):
    _skip_unless_end_to_end_backend()
    env = dict(os.environ, KERAS_BACKEND=BACKEND, PYTHONIOENCODING="utf-8",
               PYTHONPATH=os.pathsep.join(
                   [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        capture_output=True, text=True, encoding="utf-8", cwd=cwd, env=env,
        timeout=900,
    )


# ------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    result = run_bench("--quick", "--no-features", "--no-decode",
                       "--backends", BACKEND, "--out", "out", cwd=folder)
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
    cells = {(c["backend"], c["B"], c["T"], c["w"], c["causal"],
              c["impl"]): c for c in document["cells"]}
    small = config["small"]
    expected = set(itertools.product(
        [BACKEND], [config["batch"]], config["lengths"], config["windows"],
        config["causal"],
        plan.implementations_for(BACKEND, config["implementations"]),
    )) | set(itertools.product(
        [BACKEND], [small["batch"]], small["lengths"], small["windows"],
        config["causal"],
        plan.implementations_for(BACKEND, small["implementations"]),
    ))
    assert set(cells) == expected
    assert small["batch"] != config["batch"]  # the quick run has both
    for key, cell in cells.items():
        for mode in config["modes"]:
            _check_outcome(cell[mode], (key, mode))
        if cell["impl"] == "ours":  # the layer's own answer, per cell
            shape = (cell["B"], cell["T"],
                     config["num_heads"] * config["key_dim"])
            layer = keras_mha.MultiHeadAttention(
                config["num_heads"], config["key_dim"],
                sliding_window=cell["w"])
            path = layer.attention_path(shape, shape,
                                        use_causal_mask=cell["causal"])
            assert cell["forward"]["path"] == path, (key, cell)
            assert (cell["forward"]["complexity"] == "banded") == (
                path == dispatch.BANDED), (key, cell)
        paired = cell["impl"] in plan.PAIRED_IMPLS and (
            cell["B"] == small["batch"] or plan.unwindowed(cell))
        if paired:
            # Keras's layer and ours, call for call; each its own peak.
            for mode in config["modes"]:
                assert cell[mode]["timing"] == "alternately", (key, mode)
        else:
            for mode in config["modes"]:
                assert cell[mode].get("timing") != "alternately", (key, mode)
        # The small matrix is far from every cap: our layer must run, and
        # every cell has the projection rate of its B and T.
        if cell["impl"] in ("ours", "ours_core", "keras"):
            assert cell["forward"]["status"] == plan.OK, (key, cell)
            assert cell["forward_backward"]["status"] == plan.OK, (key, cell)
            assert cell["projection_gflops"] > 0, key
            assert cell["forward"]["fraction_of_matmul"] > 0, key
        if cell["impl"] in ("ours", "ours_core"):
            # The projection timed beside each of its calls (after each, or
            # in the rounds of the pair): its own rate.
            for mode in config["modes"]:
                assert cell[mode]["projection_gflops"] > 0, (key, mode)
        else:
            for mode in config["modes"]:
                assert "projection_gflops" not in cell[mode], (key, mode)
        if cell["scope"] == "layer":
            forward = cell["forward"]
            rate = forward.get("projection_gflops", cell["projection_gflops"])
            assert forward["roofline_s"] == pytest.approx(
                cell["layer_flops_forward"] / (rate * 1e9))
            assert forward["fraction_of_matmul"] == pytest.approx(
                1 / forward["time_over_roofline"])
    if BACKEND == "torch":
        flex = [c for c in cells.values() if c["impl"] == "flex_attention"]
        assert all(c["forward_backward"]["status"] == plan.NOT_AVAILABLE
                   for c in flex)
        assert all("block_mask_s" in c["forward"] for c in flex
                   if c["forward"]["status"] == plan.OK)


@pytest.mark.training
def test_quick_reports_matmul_fit_and_no_other_section(quick_run):
    _, document, _ = quick_run
    config = plan.load_config(None, "quick")
    rates = document["matmul"][BACKEND]
    assert rates["square"]["status"] == plan.OK
    assert rates["square"]["gflops"] > 0
    features = config["num_heads"] * config["key_dim"]
    assert [(r["B"], r["T"], r["shape"]) for r in rates["projections"]] == [
        (1, 256, [256, features, features]),
        (1, 512, [512, features, features]),
        (8, 256, [2048, features, features])]
    assert all(r["status"] == plan.OK and r["gflops"] > 0
               for r in rates["projections"])
    fit = {row["impl"]: row for row in document["fit"]}
    assert set(fit) == set(plan.FIT_IMPLS)
    for row in fit.values():
        assert row["status"] == plan.OK, row
        assert (row["T"], row["w"], row["layers"]) == (256, 32, 1)
        assert row["compiler"] in ("jit_compile=True", "jit_compile=False")
        assert isinstance(row["jit_compile"], bool)
        assert row["first_call_s"] > 0
    assert fit["ours"]["keras_time_over_this"] == pytest.approx(
        fit["keras"]["time_s"] / fit["ours"]["time_s"])
    assert document["features"] == []  # --no-features
    assert document["decode"] is None  # --no-decode


@pytest.mark.training
def test_quick_writes_plot_table_and_targets(quick_run):
    result, document, out = quick_run
    with open(out / "bench.png", "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "ours core" in result.stdout
    assert "targets" in result.stdout
    assert "Traceback" not in result.stderr
    markdown = (out / "report.md").read_text(encoding="utf-8")
    for text in (result.stdout, markdown):
        assert "ours core" in text and "targets" in text
        assert "projections (B*T, 512) @ (512, 512)" in text
        assert "Fit: one train_on_batch step" in text
    assert document["flops_definition"] == plan.FLOPS_DEFINITION
    assert document["peak_memory"]["method"]
    assert {t["status"] for t in document["targets"]} <= {
        "met", "not met", "n/a", "info"}
    found = [t["id"] for t in document["targets"]]
    assert found[-2:] == ["no_regression", "fit_speed"]
    assert {"roofline", "no_window_causal", "no_window_long"} <= set(found)


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
        config["num_heads"], config["key_dim"],
        **{"sliding_window": spec["window"], **arguments})
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
    # The feature cells only: no matmul, attention cells, fit, decode or
    # plot.
    assert document["what"] == "python -m benchmarks --features"
    assert document["cells"] == [] and document["decode"] is None
    assert document["fit"] == []
    assert [t["id"] for t in document["targets"]] == ["feature_ratios"]
    assert not (out / "bench.png").exists()
    markdown = (out / "report-features.md").read_text(encoding="utf-8")
    for text in (result.stdout, markdown):
        assert f"features, {BACKEND}, T={spec['length']}" in text
        assert "segment ids" in text and "x plain" in text
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench-decode")
    result = run_bench("--quick", "--decode", "--backends", BACKEND,
                       "--out", "out", cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(folder / "out" / "bench-decode.json",
              encoding="utf-8") as file:
        document = json.load(file)
    return result, document, folder / "out"


@pytest.mark.training
def test_decode_run_reports_every_step_with_its_ratios(decode_run):
    _, document, _ = decode_run
    spec = plan.load_config(None, "quick")["decode"]
    units = plan.units_for(BACKEND, plan.load_config(None, "quick"),
                           only="decode")
    steps = {(r["impl"], r["cache"], r["slots"], r["position"]): r
             for r in document["decode"]["steps"]}
    expected = {(u.get("impl", "read"), u["cache"], u["slots"],
                 u["position"]) for u in units
                if u["kind"] in ("decode", "floor")}
    assert set(steps) == expected
    modes = plan.decode_modes(BACKEND)
    first, last = spec["positions"][0], spec["positions"][-1]
    full, short = spec["full_length"], spec["short_length"]
    for key, row in steps.items():
        row_modes = ([plan.fast_mode(BACKEND)] if row["impl"] == "read"
                     else ["eager"] if row["impl"] == "ours_default"
                     else modes)
        assert [m for m in plan.DECODE_MODES if m in row] == row_modes, key
        for mode in row_modes:  # tiny sizes, keras-hub installed: all run
            outcome = row[mode]
            assert outcome["status"] == plan.OK, (key, mode, outcome)
            # A group's steps (the floors with ours), call for call.
            assert outcome["timing"] == "alternately", (key, mode)
            assert outcome["ms_per_token"] == pytest.approx(
                outcome["time_s"] * 1e3)
    assert steps["read", "full", full, last]["reads"] == last + 1
    assert steps["read", "rolling", spec["window"], None]["reads"] == (
        spec["window"])
    # Our cache and keras-hub's hold the same keys and values; ours adds a
    # boolean flag per slot (a byte).
    ours = steps["ours", "full", full, first][modes[0]]
    theirs = steps["keras_hub", "full", full, first][modes[0]]
    batch = plan.load_config(None, "quick")["batch"]
    assert ours["cache_bytes"] == theirs["cache_bytes"] + batch * full
    rolling = steps["ours", "rolling", spec["window"], first][modes[0]]
    assert rolling["cache_bytes"] * full == ours["cache_bytes"] * (
        spec["window"])
    for mode in modes:
        step = steps["ours", "full", full, first][mode]
        assert step["keras_hub_over_this"] == pytest.approx(
            steps["keras_hub", "full", full, first][mode]["time_s"]
            / step["time_s"])
        assert step["over_short_cache"] == pytest.approx(
            step["time_s"] / steps["ours", "full", short, first][mode][
                "time_s"])
        assert "over_first_position" in (
            steps["ours", "rolling", spec["window"], last][mode])
    default = steps["ours_default", "full", full, first]["eager"]
    assert default["keras_hub_over_this"] == pytest.approx(
        steps["keras_hub", "full", full, first]["eager"]["time_s"]
        / default["time_s"])
    fast = plan.fast_mode(BACKEND)
    step = steps["ours", "full", full, last][fast]
    fixed = steps["ours", "full", full, plan.FIXED_POSITION][fast]
    floor = steps["read", "full", full, last][fast]
    assert step["over_floor_after_fixed"] == pytest.approx(
        (step["time_s"] - fixed["time_s"]) / floor["time_s"])
    assert "over_floor_after_fixed" in (
        steps["ours", "rolling", spec["window"], last][fast])


@pytest.mark.training
def test_decode_run_reports_generate_prefill_and_targets(decode_run):
    result, document, out = decode_run
    spec = plan.load_config(None, "quick")["decode"]
    generate = {r["impl"]: r for r in document["decode"]["generate"]}
    assert set(generate) == set(plan.GENERATE_IMPLS)
    tokens = spec["generate"]["max_length"] - spec["generate"][
        "prompt_length"]
    for row in generate.values():
        assert row["status"] == plan.OK, row
        assert row["tokens"] == tokens and len(row["generated"]) == tokens
        assert row["tokens_per_s"] == pytest.approx(tokens / row["time_s"])
    # The same weights and greedy sampling: the same tokens.
    assert generate["ours"]["same_tokens"], generate
    # Timed call for call in one run: the same rounds under one meter.
    ours, theirs = generate["ours"], generate["keras_hub"]
    assert len(ours["times_s"]) == len(theirs["times_s"]) == ours["repeats"]
    assert ours["rss_peak_bytes"] == theirs["rss_peak_bytes"]
    assert generate["ours"]["over_keras_hub"] == pytest.approx(
        generate["ours"]["tokens_per_s"]
        / generate["keras_hub"]["tokens_per_s"])
    prefill = {(r["cache"], r["w"]): r for r in document["decode"]["prefill"]}
    window = spec["prefill"]["window"]
    assert set(prefill) == {("none", window), ("rolling", window),
                            ("none", None), ("full", None)}
    for (cache, w), row in prefill.items():
        assert row["T"] == spec["prefill"]["length"]
        for mode in plan.decode_modes(BACKEND):
            outcome = row[mode]
            assert outcome["status"] == plan.OK, (cache, w, mode, outcome)
            # With and without a cache, call for call.
            assert outcome["timing"] == "alternately", (cache, w, mode)
            if cache == "none":
                assert outcome["path"] in dispatch.PATHS
            else:
                assert outcome["over_no_cache"] == pytest.approx(
                    outcome["time_s"] / prefill["none", w][mode]["time_s"])
    # The decode cells only: no matmul, attention cells, features or plot.
    assert document["what"] == "python -m benchmarks --decode"
    assert document["cells"] == [] and document["features"] == []
    assert document["matmul"] == {} and document["fit"] == []
    assert [t["id"] for t in document["targets"]] == [
        "decode_cache_size", "decode_vs_keras_hub",
        "default_decode_vs_keras_hub", "decode_floor",
        "rolling_decode", "generate_speed", "prefill_ratio"]
    assert {t["status"] for t in document["targets"]} <= {"met", "not met"}
    assert not (out / "bench.png").exists()
    markdown = (out / "report-decode.md").read_text(encoding="utf-8")
    for text in (result.stdout, markdown):
        assert f"decode, {BACKEND}" in text
        assert "read (floor)" in text and "keras-hub" in text
        assert "GPT-2 generate" in text and "x no cache" in text
        for target in document["targets"]:
            assert target["target"] in text
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------ the worker


def test_cells_without_a_window_pair_keras_and_ours_while_calls_are_short():
    config = plan.load_config(None, "quick")
    bench_worker = worker.Worker(config)
    cell = {"kind": "attention", "backend": BACKEND, "B": config["batch"],
            "T": 4096, "causal": True, "mode": "forward"}
    keras_unit = dict(cell, impl="keras", w=None)

    def ran(seconds):  # Keras's layer at T=1,024 took `seconds` a call
        return [dict(cell, impl="keras", w=None, T=1024, status=plan.OK,
                     time_s=seconds)]

    # 16x a dense call at a quarter of T: 1.6 s pairs, 16 s does not.
    assert bench_worker._paired(keras_unit, "dense", ran(0.1))
    assert not bench_worker._paired(keras_unit, "dense", ran(1.0))
    # Nothing shorter ran: its FLOPs at the slow rate (2.6 s at T=4,096).
    assert bench_worker._paired(keras_unit, "dense", [])
    assert not bench_worker._paired(dict(keras_unit, T=65536), "dense", [])
    # A window shorter than T is never paired; one of T or more is.
    assert not bench_worker._paired(dict(keras_unit, w=128), "banded", [])
    assert bench_worker._paired(dict(keras_unit, w=4096), "dense", [])
    # Our layer pairs only where Keras's unit of its mode timed it.
    ours = dict(cell, impl="ours", w=None)
    assert not bench_worker._paired(ours, "dense", [])
    small = config["small"]
    for impl in plan.PAIRED_IMPLS:  # the small cells always pair
        unit = dict(cell, impl=impl, w=None, B=small["batch"],
                    T=small["lengths"][0])
        assert bench_worker._paired(unit, "dense", [])


def test_alternate_timing_takes_turns():
    bench_worker = worker.Worker(plan.load_config(None, "quick"))
    calls = []
    results = bench_worker.time_alternately(
        [(name, functools.partial(calls.append, name)) for name in "ab"],
        3, "both")
    # Two rounds of warm-up calls, then three timed rounds, every other one
    # in reverse order.
    assert calls == ["a", "b"] * 2 + ["a", "b", "b", "a", "a", "b"]
    assert set(results) == {"a", "b"}
    for result in results.values():
        assert result["repeats"] == 3 and len(result["times_s"]) == 3
        assert result["compiler"] == "both"


# ------------------------------------------------------------ fit_step


@pytest.mark.training
def test_fit_step_times_the_model_with_every_feature(capsys):
    """`python -m benchmarks.fit_step` on this backend, two batches an
    epoch; torch eagerly (Inductor's compilation of the model takes over a
    minute on a 2-core CPU)."""
    jit = BACKEND != "torch"
    fit_step.main(["--batches", "2"] + ([] if jit else ["--no-jit"]))
    header, _, row = capsys.readouterr().out.strip().splitlines()[-3:]
    assert "step, median ms" in header
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:3] == [BACKEND, "keras_mha", str(jit)]
    assert all(float(cell) > 0 for cell in cells[3:]), row
    windows = [layer.get_config()["sliding_window"] for layer in fit_step.model().layers
               if isinstance(layer, keras_mha.MultiHeadAttention)]
    assert windows == [4, None, 4, None]


# ------------------------------------------------------------ hub


@pytest.mark.training
def test_hub_times_a_swapped_step(capsys):
    """`python -m benchmarks.hub` on this backend at a short length: the
    model swapped (its blocks hold `HubAttention`), one timed step; torch
    eagerly, as for `fit_step`."""
    pytest.importorskip("keras_hub")
    jit = BACKEND != "torch"
    hub.main(["--length", "64", "--steps", "1"] + ([] if jit else ["--no-jit"]))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"{BACKEND} swapped T=64: first step ")
    assert "median step" in line and "GiB" in line
    blocks = hub.model(swapped=True).backbone.transformer_layers
    assert all(isinstance(b.attention, keras_mha.HubAttention)
               for b in blocks)


def test_hub_times_a_new_token(capsys):
    """`python -m benchmarks.hub --generate N`: greedy decoding after a
    prompt, a new token's time printed; fewer than 2 new tokens is a
    usage error."""
    pytest.importorskip("keras_hub")
    hub.main(["--length", "8", "--generate", "3", "--steps", "1"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"{BACKEND} swapped prompt=8: ")
    assert "ms a new token (3 new tokens)" in line
    with pytest.raises(SystemExit):
        hub.main(["--generate", "1"])


# ------------------------------------------------------------ latent


def test_latent_reports_the_cache_steps_and_floor():
    """`python -m benchmarks.latent --small --no-train`'s cells on this
    backend, each with a value."""
    rows = {cell: value for cell, value, _ in
            latent.run(latent.SMALL, repeats=1, train=False)}
    small = latent.SMALL
    assert rows["cache bytes, latent / MultiHeadAttention"].endswith(
        "= 1/4.0")  # a token: (32 + 8)·4 bytes and its flag, against
    # 4 heads·(24 + 16)·4 bytes and its flag
    slots, position = small["slots"], small["position"]
    for how in ("absorbed", "expanded"):
        for mode in latent._modes(BACKEND):
            assert float(rows[f"{how} step, L={slots}, p={position}, "
                              f"{mode}"]) > 0
    assert float(rows[f"absorbed step, L={slots}, p=1 (the fixed cost)"]) > 0
    assert float(rows[f"floor: one read of the {position} valid latents"]) > 0
    for ratio in ("expanded / absorbed step", "absorbed step / floor",
                  "(absorbed step - fixed cost) / floor"):
        assert rows[ratio].endswith("x")


# ------------------------------------------------------------ default step


def test_default_step_counts_faults_and_times_each_step():
    """`python -m benchmarks.default_step --small`'s steps, in this
    process: a time and a page count for each, the collector run before
    every fourth."""
    results = default_step.steps(default_step.SMALL, 4)
    assert len(results) == default_step.SMALL["steps"]
    assert all(ms > 0 and faults >= 0 for ms, faults in results)
