"""The `keras-mha` command line, on the backend the suite runs on.

Each subcommand runs once as `python -m keras_mha ...` in a child process
(a few seconds each: the child imports Keras and the backend); error paths
that need no backend call `main()` in this process.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_mha
from keras_mha import cli
from keras_mha.attention import dispatch
from keras_mha.cli import bench
from keras_mha.cli import compare
from keras_mha.cli import decode_bench
from keras_mha.cli import demo
from keras_mha.cli import info
from keras_mha.cli import latent_bench
from keras_mha.cli import testrun

TOKENS = ("банк", "у", "реки")

# TensorFlow logs these from C++ at import, before any setting applies.
_TENSORFLOW_LOG = re.compile(
    r"^(WARNING: All log messages before absl|[IWEF]\d{4} |"
    r"To enable the following instructions)"
)


def backend_log_lines(text):
    return [line for line in text.splitlines() if _TENSORFLOW_LOG.match(line)]


def run_cli(*args, cwd=None, timeout=300):
    env = dict(os.environ, KERAS_BACKEND=BACKEND, PYTHONIOENCODING="utf-8")
    # As in a user's shell: importing this suite's backends set it here.
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return subprocess.run(
        [sys.executable, "-m", "keras_mha", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def error_lines(stderr):
    """stderr without TensorFlow's start-up log."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip() and not _TENSORFLOW_LOG.match(line)
    ]


def assert_one_error_line(stderr):
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    assert lines[0].startswith("keras-mha: error: ")
    assert "Traceback" not in stderr


# ---------------------------------------------------------------------- demo


def expected_demo_weights():
    """softmax(q . k / sqrt(2)) for "банк", from the numbers of the story."""
    heads = [
        ([3, 0], [[3, 0], [0, 1], [0, 1]]),
        ([0, 3], [[0, 0], [0, 1], [0, 3]]),
    ]
    weights = []
    for query, keys in heads:
        logits = np.asarray(keys, "float64") @ np.asarray(query, "float64")
        logits /= math.sqrt(2.0)
        e = np.exp(logits - logits.max())
        weights.append(e / e.sum())
    return np.stack(weights)  # (N, S)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One `demo` child; with `--plot` when matplotlib is installed."""
    plot = None
    args = ["demo"]
    if importlib.util.find_spec("matplotlib") is not None:
        plot = tmp_path_factory.mktemp("demo") / "attention.png"
        args += ["--plot", str(plot)]
    return run_cli(*args), plot


def test_demo_prints_the_layers_weights(demo_run):
    result, _ = demo_run
    assert result.returncode == 0, result.stderr
    assert backend_log_lines(result.stderr) == []
    rows = {}
    for line in result.stdout.splitlines():
        match = re.fullmatch(r"head (\d): (.*)", line)
        if match:
            cells = dict(c.split("=") for c in match.group(2).split(", "))
            assert tuple(cells) == TOKENS
            rows[int(match.group(1))] = [float(cells[t]) for t in TOKENS]
    assert sorted(rows) == [1, 2]
    printed = np.array([rows[1], rows[2]])
    np.testing.assert_allclose(printed, expected_demo_weights(), atol=0.0051)
    assert printed.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.01, 0.98]]
    last = result.stdout.strip().splitlines()[-1 if demo_run[1] is None else -2]
    assert "Different heads attend to different tokens" in last
    assert f"backend {BACKEND}" in last


def test_demo_weights_come_from_the_layer():
    weights = demo.attention_weights()  # (N, T, S), on this backend
    np.testing.assert_allclose(
        weights[:, 0, :], expected_demo_weights(), atol=1e-6
    )
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-6)


def test_demo_plot_is_a_png(demo_run):
    pytest.importorskip("matplotlib")
    result, plot = demo_run
    assert result.returncode == 0, result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", ["demo", "info"])
def test_unknown_backend_is_one_line(command, capsys):
    assert cli.main([command, "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("keras-mha: error: unknown backend 'nope'")


def test_demo_missing_backend(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else find_spec(name, *a),
    )
    assert cli.main(["demo", "--backend", "torch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "'torch' is not installed" in err


def test_demo_unwritable_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "missing" / "attention.png"
    assert cli.main(["demo", "--plot", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("keras-mha: error: cannot write plot")
    assert captured.out == ""


def test_demo_plot_without_matplotlib(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not importable
    assert cli.main(["demo", "--plot", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert 'pip install "keras-mha[plot]"' in err


# ---------------------------------------------------------------------- info


def test_info_child_forwards_every_flag():
    # `--backend` runs info again in a child; the mask flags must survive.
    result = run_cli("info", "--backend", BACKEND, "--causal",
                     "--sliding-window", "16", "--query-length", "1024",
                     "--value-mask")
    assert result.returncode == 0, result.stderr
    assert backend_log_lines(result.stderr) == []  # the child's start-up
    out = result.stdout
    assert re.search(rf"^active backend: {BACKEND} ", out, re.M)
    for backend in cli.BACKENDS:
        assert re.search(rf"^{backend} ", out, re.M)
    assert re.search(r"^call: .*\bvalue_mask=True, key_mask=False, "
                     r"attention_mask=False\b", out, re.M)
    assert re.search(r"^path: banded$", out, re.M)


def test_info_flags_round_trip():
    flags = ["--return-scores", "--dropout-training", "--causal",
             "--query-mask", "--value-mask", "--key-mask", "--attention-mask",
             "--cache", "--key-dim", "8", "--value-dim", "16",
             "--sliding-window", "4", "--query-length", "32",
             "--key-length", "64"]
    parser = cli.build_parser()
    args = parser.parse_args(["info", *flags])
    assert sorted(info.config_args(args)) == sorted(flags)
    again = parser.parse_args(["info", *info.config_args(args)])
    assert info.call_configuration(again) == info.call_configuration(args)
    assert all(info.call_configuration(args)[flag] for flag in (
        "query_mask", "value_mask", "key_mask", "attention_mask", "cache"))


def _path_of_a_call(flags, monkeypatch):
    """The path a real call of the layer takes for `info`'s flags: what the
    dispatch rule answers inside the call."""
    given = info.call_configuration(
        cli.build_parser().parse_args(["info", *flags]))
    t_len, s_len = given["query_length"], given["key_length"]
    layer = keras_mha.MultiHeadAttention(
        num_heads=2, key_dim=given["key_dim"], value_dim=given["value_dim"],
        sliding_window=given["sliding_window"],
        dropout=0.5 if given["dropout_training"] else 0.0,
    )
    rng = np.random.default_rng(0)
    query = rng.normal(size=(1, t_len, 4)).astype("float32")  # (B, T, E)
    kwargs = {}
    if given["cache"]:
        value = query  # the new tokens; the keys are in the cache
        kwargs.update(cache=layer.init_cache(1, s_len), cache_update_index=0)
        s_len = t_len
    else:
        value = rng.normal(size=(1, s_len, 4)).astype("float32")
    for name, shape in (("query_mask", (1, t_len)),
                        ("value_mask", (1, s_len)),
                        ("key_mask", (1, s_len)),
                        ("attention_mask", (1, t_len, s_len))):
        if given[name]:
            kwargs[name] = np.ones(shape, bool)
    seen = []
    choose_path = dispatch.choose_path

    def recording(*args, **kw):
        seen.append(choose_path(*args, **kw))
        raise _Chosen()  # the path is known: nothing left to compute

    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "choose_path", recording)
        with pytest.raises(_Chosen):
            layer(query, value, use_causal_mask=given["causal"],
                  return_attention_scores=given["return_scores"],
                  training=given["dropout_training"], **kwargs)
    assert len(seen) == 1, seen
    return seen[0]


class _Chosen(Exception):
    """Stops a call once the dispatch rule has answered."""


WINDOW_1024 = ["--causal", "--sliding-window", "16", "--query-length", "1024"]


@pytest.mark.parametrize(
    "flags, path",
    [
        ([], None),
        (["--return-scores"], dispatch.EXPLICIT),  # the weights are needed
        (["--dropout-training"], dispatch.EXPLICIT),
        (["--key-dim", "8", "--value-dim", "16"], None),
        (["--causal", "--sliding-window", "4", "--query-length", "4096"],
         dispatch.BANDED),
        # A dense mask rules the band out; token masks do not.
        (WINDOW_1024 + ["--attention-mask"], dispatch.FUSED),
        (WINDOW_1024 + ["--value-mask"], dispatch.BANDED),
        (WINDOW_1024 + ["--key-mask"], dispatch.BANDED),
        (WINDOW_1024 + ["--query-mask"], dispatch.BANDED),
        (["--causal", "--cache", "--query-length", "1", "--key-length", "64"],
         None),
    ],
    ids=["default", "scores", "dropout", "value_dim", "window",
         "window_dense_mask", "window_value_mask", "window_key_mask",
         "window_query_mask", "cache"],
)
def test_info_path_is_the_calls(flags, path, capsys, monkeypatch):
    assert cli.main(["info", *flags]) == 0
    printed = re.findall(r"^path: (\w+)$", capsys.readouterr().out, re.M)
    assert printed == [_path_of_a_call(flags, monkeypatch)]
    if path is not None:
        assert printed == [path]


# ------------------------------------------------------------------- compare

TINY_MATRIX = {
    "defaults": {"batch": 2, "query_length": 4, "features": 4,
                 "layer": {"num_heads": 2, "key_dim": 2}},
    "cases": [
        {"name": "causal, left padding", "causal": True,
         "query_padding": {"left": [0, 2]},
         "keras_note": "rows with nothing to attend to"},
        {"name": "cross, window", "cross": True, "key_length": 6,
         "key_features": 3, "layer": {"sliding_window": 2}},
    ],
}


def test_compare_child(tmp_path):
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps(TINY_MATRIX))
    out = tmp_path / "results.json"
    result = run_cli("compare", "--backends", BACKEND, "--matrix",
                     str(matrix), "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "causal, left padding" in result.stdout
    results = json.loads(out.read_text())
    assert results["failed"] is False
    cases = results["backends"][BACKEND]["cases"]
    assert sorted(cases) == sorted(c["name"] for c in TINY_MATRIX["cases"])
    for case in cases.values():
        assert float(case["ours"]["error"]) <= 1e-5
        assert set(case["ours"]["calls"]) == {
            "output", "output_with_scores", "scores"}


def test_compare_matrix_ships_with_the_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout
    cases = compare.load_matrix(compare.default_matrix())
    assert len(cases) > 1 and all(case["name"] for case in cases)
    folder = os.path.join(os.path.dirname(cli.__file__), "matrices")
    assert str(compare.default_matrix()) == os.path.join(folder,
                                                         "compare.json")


def test_compare_rejects_a_bad_matrix(tmp_path, capsys):
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps({"cases": [{"name": "x", "wat": 1}]}))
    assert cli.main(["compare", "--backends", BACKEND,
                     "--matrix", str(matrix)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown field(s) wat" in err


def test_compare_reference_matches_the_tests_reference():
    from reference import reference_attention

    rng = np.random.default_rng(0)
    batch, t_len, s_len, features, heads, kv_heads, size = 2, 4, 5, 3, 4, 2, 3
    named = {}
    flat = {}
    shapes = {"query": (features, heads, size), "key": (features, kv_heads,
              size), "value": (features, kv_heads, size), "gate":
              (features, heads, size), "attention_output": (heads, size,
                                                            features)}
    for name, shape in shapes.items():
        kernel, bias = rng.normal(size=shape), rng.normal(size=shape[-1:])
        if name != "attention_output":
            bias = rng.normal(size=shape[1:])
        named[name] = {"kernel": kernel, "bias": bias}
        flat_name = "output" if name == "attention_output" else name
        flat[flat_name], flat[flat_name + "_bias"] = kernel, bias
    query = rng.normal(size=(batch, t_len, features))
    value = rng.normal(size=(batch, s_len, features))
    query_mask = np.array([[1, 1, 1, 1], [0, 0, 1, 1]], bool)
    value_mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    case = {**compare.CASE_DEFAULTS, "cross": True, "causal": True,
            "layer": {"sliding_window": 2}}
    inputs = {"query": query, "value": value, "query_mask": query_mask,
              "value_mask": value_mask, "attention_mask": None}
    allowed = compare.allowed_mask(case, inputs)
    assert not allowed.any(axis=-1).all()  # some rows are empty
    ours = compare.reference_attention(named, query, value, value, allowed)
    theirs = reference_attention(
        flat, query, value, query_mask=query_mask, value_mask=value_mask,
        use_causal_mask=True, sliding_window=2,
    )
    np.testing.assert_allclose(ours[0], theirs[0], atol=1e-12)
    np.testing.assert_allclose(ours[1], theirs[1], atol=1e-12)


# --------------------------------------------------------------------- bench

# Tiny shapes: the first calls compile, the timed ones take milliseconds.
BENCH_FLAGS = ["--lengths", "16", "--window", "none,8", "--heads", "2",
               "--key-dim", "4", "--repeats", "2", "--causal"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One `bench` child: forward+backward where the backend has autodiff,
    with `--plot` when matplotlib is installed."""
    args = ["bench", *BENCH_FLAGS]
    if BACKEND != "numpy":
        args.append("--backward")
    plot = None
    if importlib.util.find_spec("matplotlib") is not None:
        plot = tmp_path_factory.mktemp("bench") / "bench.png"
        args += ["--plot", str(plot)]
    return run_cli(*args), plot


def test_bench_prints_both_layers_and_their_ratio(bench_run):
    result, plot = bench_run
    assert result.returncode == 0, result.stderr
    assert backend_log_lines(result.stderr) == []
    out = result.stdout
    assert re.search(rf"^device: (CPU|GPU): .*\({BACKEND} ", out, re.M), out
    mode = "forward" if BACKEND == "numpy" else "forward\\+backward"
    assert re.search(rf"^{mode}, B=1, N=2, H=4, causal", out, re.M), out
    assert "median of 2 calls each, timed alternately" in out
    header = [c.strip() for c in re.split("[┃│]", next(
        line for line in out.splitlines() if "keras ms" in line))[1:-1]]
    assert header == ["T", "window", "keras ms", "ours ms", "keras / ours",
                      "our path"]
    rows = [[c.strip() for c in line.split("│")[1:-1]]
            for line in out.splitlines()
            if re.match(r"^│ +\d", line)]
    assert [row[:2] for row in rows] == [["16", "none"], ["16", "8"]]
    for t_len, window, keras_ms, ours_ms, ratio, path in rows:
        assert float(ratio.rstrip("x")) == pytest.approx(
            float(keras_ms.replace(",", "")) / float(ours_ms.replace(",", "")),
            rel=0.05)
        assert path in dispatch.PATHS
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_layers_compute_the_same():
    # The two layers timed get the same weights: the same function.
    theirs, ours, x = bench.layer_pair(
        {"batch": 2, "heads": 2, "key_dim": 4}, 12, 4)
    for causal in (False, True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(ours(x, x, use_causal_mask=causal)),
            keras.ops.convert_to_numpy(theirs(x, x, use_causal_mask=causal)),
            atol=1e-5)


def test_bench_times_alternately():
    calls = []
    times = bench.time_alternately(
        [(name, lambda name=name: calls.append(name)) for name in "ab"], 3)
    # One untimed call each, then three rounds, every other one reversed.
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert {name: len(seconds) for name, seconds in times.items()} == {
        "a": 3, "b": 3}


def test_bench_decode_times_three_steps(capsys):
    """`bench --decode`: keras-hub's step, ours with a cache the caller
    owns and ours in place, in one table with both ratios."""
    args = cli.build_parser().parse_args(
        ["bench", "--decode", "--lengths", "16", "--heads", "2",
         "--key-dim", "4", "--repeats", "1"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "one decode step, eager: B=1, 2 heads of 4" in out
    rows = [[c.strip() for c in line.split("│")[1:-1]]
            for line in out.splitlines() if re.match(r"^│ +\d", line)]
    assert len(rows) == 1 and rows[0][:2] == ["16", "15"]
    slots, position, hub, ours, ratio, in_place, in_place_ratio = rows[0]
    # Each printed to 3 significant digits.
    assert float(ratio.rstrip("x")) == pytest.approx(
        float(hub) / float(ours), rel=0.02)
    assert float(in_place_ratio.rstrip("x")) == pytest.approx(
        float(hub) / float(in_place), rel=0.02)


def test_bench_decode_steps_compute_the_same():
    # keras-hub's step and ours get the same weights: the same function.
    theirs, ours = decode_bench.layers((2, 2, 4))
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    causal = np.tril(np.ones((5, 5), bool))[None]
    expected, _ = theirs(x, x, attention_mask=causal,
                         cache=keras.ops.zeros((2, 2, 5, 2, 4)),
                         cache_update_index=0)
    actual, _ = ours(x, x, use_causal_mask=True,
                     cache=ours.init_cache(2, 5), cache_update_index=0)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(actual),
                               keras.ops.convert_to_numpy(expected),
                               atol=1e-5)


def test_bench_latent_times_four_steps(capsys):
    """`bench --decode --latent`: the latent layer's absorbed step with a
    cache the caller owns and in place, its expanded step and
    `MultiHeadAttention`'s, each with its cache's size and its time over
    the absorbed in-place step's."""
    args = cli.build_parser().parse_args(
        ["bench", "--decode", "--latent", "--lengths", "16", "--heads", "2",
         "--repeats", "1"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "one decode step, eager, L=16, p=8: B=1, 2 heads" in out
    rows = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.split("│")[1:-1]]
        for line in out.splitlines() if line.startswith("│ "))}
    assert list(rows) == list(latent_bench.STEPS)
    fast = float(rows["absorbed in place"][1])
    for name, (cache, ms, ratio) in rows.items():
        assert float(ratio.rstrip("x")) == pytest.approx(
            float(ms) / fast, rel=0.02), name
    # Latents and rope keys (4 bytes each) and a flag per slot, against
    # keys and values of every head.
    latent = 16 * (latent_bench.RANK + latent_bench.ROPE) * 4 + 16
    mha = 16 * 2 * (latent_bench.NOPE + latent_bench.ROPE
                    + latent_bench.VALUE) * 4 + 16
    assert rows["absorbed"][0] == f"{latent / 1024:,.1f} KiB"
    assert rows["MultiHeadAttention in place"][0] == f"{mha / 1024:,.1f} KiB"


@pytest.mark.parametrize("flags, message", [
    (["--latent"], "use it with --decode"),
    (["--latent", "--decode", "--features"],
     "--decode and --features exclude each other"),
    (["--decode", "--latent", "--key-dim", "8", "--causal"],
     "Received: --key-dim, --causal"),
])
def test_bench_latent_rejects_what_it_does_not_take(flags, message, capsys):
    assert cli.main(["bench", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_child_forwards_every_flag():
    flags = ["--batch", "2", "--lengths", "1k,4k", "--heads", "4",
             "--key-dim", "16", "--window", "none,128", "--repeats", "3",
             "--plot", "a.png", "--causal", "--backward", "--decode",
             "--latent", "--features"]
    args = cli.build_parser().parse_args(["bench", "--backend", "jax",
                                          *flags])
    assert bench.child_args(args) == flags


def test_bench_features_layers():
    """`--features`: our layer with each feature on, the plain layer's
    projection weights in each, each computing something else."""
    from keras_mha.cli import bench_features

    layers, x = bench_features.feature_layers(
        {"batch": 1, "heads": 2, "key_dim": 4}, 12, 4)
    layers = dict(layers)
    assert list(layers) == list(bench_features.FEATURES)
    assert layers["qk_norm"].qk_norm == "rms"
    assert (layers["chunked"].attention_chunk_size,
            layers["chunked"].sliding_window) == (4, None)
    assert layers["yarn"].rotary_embedding.get_config()["rope_type"] == "yarn"
    assert layers["temperature"].query_temperature == (8192.0, 0.1)
    plain = layers.pop("plain")
    expected = keras.ops.convert_to_numpy(plain(x, x, use_causal_mask=True))
    for feature, layer in layers.items():
        for got, want in zip(layer.get_weights(), plain.get_weights()):
            np.testing.assert_array_equal(got, want)
        out = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
        # Llama 4's temperature is 1 below position 8191.
        assert np.allclose(out, expected) == (feature == "temperature")


def test_bench_features_table():
    from rich.console import Console

    from keras_mha.cli import bench_features

    rows = [{"T": 16, "w": 8, "feature": feature, "path": "banded",
             "seconds": [0.002 * (1 + i / 10)] * 3}
            for i, feature in enumerate(bench_features.FEATURES)]
    rows[-1] = {**rows[-1], "failed": "MemoryError"}
    del rows[-1]["seconds"]
    console = Console(width=120, record=True)
    helpers = bench_features.Helpers(bench.runner, bench.time_alternately,
                                     bench._reason, bench._describe,
                                     bench._window_text, bench._ms_text)
    console.print(bench_features.table(
        rows, {"batch": 1, "heads": 2, "key_dim": 4}, "forward", 3, helpers))
    text = console.export_text()
    assert "forward, B=1, N=2, H=4, causal" in text
    assert re.search(r"qk_norm +│ +2\.20 │ +1\.10x │ banded", text), text
    assert re.search(r"yarn +│ +2\.60 │ +1\.30x", text), text
    assert "MemoryError" in text


def test_bench_sizes():
    assert bench.parse_sizes("512,1k, 4K,1k", "lengths") == [512, 1024,
                                                             4096]
    assert bench.parse_sizes("none,128", "window", allow_none=True) == [
        None, 128]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "1k,abc"], "--lengths: cannot read 'abc'"),
        (["--lengths", "0"], "--lengths: cannot read '0'"),
        (["--window", "none,-1"], "--window: cannot read '-1'"),
        (["--lengths", "none"], "--lengths: cannot read 'none'"),
        (["--heads", "0"], "must be positive"),
        (["--backend", "nope"], "unknown backend 'nope'"),
    ],
)
def test_bench_errors_are_one_line(args, message, capsys):
    assert cli.main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("keras-mha: error: ") and message in err


@pytest.mark.skipif(BACKEND != "numpy",
                    reason="NumPy's error: the other backends differentiate")
def test_bench_backward_needs_autodiff(capsys):
    assert cli.main(["bench", "--backward"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "the numpy backend runs inference only" in err


# ------------------------------------------------------------- a quiet start

# Builds every subcommand's parser and parses a call of each, as `main`
# does before it runs anything.
_PARSE_EVERY_COMMAND = """
import json, sys
from keras_mha.cli import build_parser
parser = build_parser()
for argv in (["demo"], ["info", "--causal"], ["compare"],
             ["bench", "--lengths", "1k", "--backward"], ["test"]):
    parser.parse_known_args(argv)
print(json.dumps(sorted(name for name in ("keras", "tensorflow", "jax",
                                          "torch") if name in sys.modules)))
"""


def test_the_parser_imports_no_backend_and_no_keras():
    # A fresh process: this one has imported Keras already.
    result = subprocess.run([sys.executable, "-c", _PARSE_EVERY_COMMAND],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_help_is_quiet():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert backend_log_lines(result.stdout) == []
    for command in ("demo", "info", "compare", "bench", "test"):
        assert re.search(rf"^    {command} ", result.stdout, re.M), command


# ---------------------------------------------------------------------- test


def test_test_outside_a_checkout(tmp_path):
    result = run_cli("test", "--backends", BACKEND, cwd=tmp_path)
    assert result.returncode == 2
    assert_one_error_line(result.stderr)
    assert "needs a source checkout (a folder with tests/" in result.stderr
    assert "run it from the repository root" in result.stderr
    assert result.stderr.rstrip().endswith(
        f"Received: cwd={os.path.realpath(tmp_path)}")


@pytest.mark.parametrize("present", ["tests", "pyproject.toml"])
def test_test_needs_tests_and_pyproject(present, tmp_path, monkeypatch,
                                        capsys):
    if present == "tests":
        (tmp_path / "tests").mkdir()
    else:
        (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["test", "--backends", BACKEND]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert "needs a source checkout" in captured.err
    assert captured.out == ""  # nothing ran


def test_test_missing_backend_fails(tmp_path, monkeypatch, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(testrun, "backend_installed", lambda name: False)
    assert cli.main(["test", "--backends", "torch"]) == 1
    out = capsys.readouterr().out
    assert "torch: not installed" in out and out.rstrip().endswith("FAIL")


def test_test_parses_pytest_counts():
    run = testrun._Run("jax")
    lines = ["..s.\n", "=== short test summary info ===\n",
             "\x1b[32m3 passed\x1b[0m, 1 skipped in 61.02s (0:01:01)\n"]

    class Process:
        stdout = iter(lines)

        def wait(self):
            return 0

    run.process = Process()
    run.read()
    assert run.counts == "3 passed, 1 skipped in 61.02s (0:01:01)"
    assert run.passed


def test_test_names_files_instead_of_the_folder(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    whole = testrun._command(["-k", "a"], color=False)
    assert whole[3:5] == ["tests", "-q"] and whole[-2:] == ["-k", "a"]
    one = testrun._command(["tests/test_a.py::test_a"], color=False)
    assert "tests" not in one and one[-1] == "tests/test_a.py::test_a"
    # A checkout with the development benchmarks runs their tests too.
    (tmp_path / "benchmarks" / "tests").mkdir(parents=True)
    both = testrun._command([], color=False)
    assert both[3:5] == ["tests", os.path.join("benchmarks", "tests")]


def test_test_tells_each_run_the_backends_of_the_whole_run(tmp_path):
    env = testrun._env("jax", str(tmp_path), ["jax", "numpy"])
    assert env["KERAS_BACKEND"] == "jax"
    assert env["KERAS_MHA_TEST_BACKENDS"] == "jax,numpy"


def test_test_runs_with_the_test_flags_of_xla_where_it_compiles(
        tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    for backend in ("jax", "tensorflow"):
        env = testrun._env(backend, str(tmp_path), [backend])
        assert env["XLA_FLAGS"] == (
            "--xla_dump_to=/tmp/x --xla_cpu_use_fusion_emitters=false "
            "--xla_backend_optimization_level=0")
    # torch's session compiles nothing with XLA (the JAX children of the
    # multi-device tests get the flags from `conftest.jax_child_env`).
    assert testrun._env("torch", str(tmp_path), ["torch"])["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/x")
    # A choice given stays.
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")
    assert testrun._env("jax", str(tmp_path), ["jax"])["XLA_FLAGS"] == (
        "--xla_cpu_use_fusion_emitters=true "
        "--xla_backend_optimization_level=0")


def test_test_runs_share_a_folder_removed_at_the_end(tmp_path, monkeypatch,
                                                      capsys):
    """Every backend's run of one `keras-mha test` gets the same
    `KERAS_MHA_TEST_SHARED` folder (the checkpoints are saved there once);
    the run removes it."""
    pytest.importorskip("jax")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "tests").mkdir()
    seen = tmp_path / "seen"
    (tmp_path / "tests" / "test_a.py").write_text(
        "import os, pathlib\n"
        "def test_a():\n"
        "    shared = os.environ['KERAS_MHA_TEST_SHARED']\n"
        "    assert os.path.isdir(shared)\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(shared + '\\n')\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["test", "--backends", "jax,numpy", "-j", "2"]) == 0
    capsys.readouterr()
    folders = seen.read_text().split()
    assert len(folders) == 2 and folders[0] == folders[1]
    assert not os.path.exists(folders[0])
