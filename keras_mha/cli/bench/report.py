"""Results of `keras-mha bench` as cells, targets, a table, JSON and a plot."""

import json
import math
import os
import re

from keras_mha.cli.bench import plan
from keras_mha.cli.common import CLIError

MIB = 2**20
GIB = 2**30

# The reference cell and thresholds (issues 3 and 4).
TARGET_LENGTH = 16384
TARGET_WINDOW = 128
MAX_PEAK_BYTES = 2 * GIB
MAX_SCALING = 4.5  # time(T=65536) / time(T=16384), ideal 4
MIN_CORE_FRACTION = 0.5  # of the matmul rate, on at least one backend
MAX_FLEX_RATIO = 1.5  # torch: ours core / compiled flex_attention
MIN_TRAINING_SPEEDUP = 10.0  # keras / ours, forward+backward
MIN_NO_WINDOW_SPEED = 0.95  # keras time / ours time, w = none or w >= T
MIN_JAX_CAUSAL_SPEEDUP = 2.0  # keras / ours, jax, causal, no window
JAX_CAUSAL_LENGTH = 4096
MAX_FEATURE_RATIO = 1.3  # a feature's time / plain time, each mode
# Characters per line of `report.md`: the attention table is about 130 wide.
MARKDOWN_WIDTH = 150


# -------------------------------------------------------------------- cells


def build_cells(config, units_by_backend, results, missing="not run"):
    """Units and results -> the JSON document's `cells`, `decode`, `matmul`.

    A unit without a result is `not run`, `missing` saying why.
    """
    matmul, cells, decode = {}, {}, []
    for backend, units in units_by_backend.items():
        for unit in units:
            result = dict(results.get(unit["id"]) or {
                "status": plan.NOT_RUN, "reason": missing})
            if unit["kind"] == "matmul":
                matmul[backend] = {"size": unit["size"], **result}
            elif unit["kind"] == "decode":
                decode.append({
                    "backend": backend, "cache": unit["cache"],
                    "position": unit["position"],
                    "window": (config["decode"]["window"]
                               if unit["cache"] == "rolling" else None),
                    **result,
                })
            elif unit["kind"] == "attention":
                key = (backend, unit["T"], unit["w"], unit["causal"],
                       unit["impl"])
                cell = cells.setdefault(key, _new_cell(config, unit))
                cell[unit["mode"]] = result
    for cell in cells.values():
        _derive(cell, cells, matmul)
    return list(cells.values()), decode, matmul


def _new_cell(config, unit):
    counts = plan.flops(config, unit["T"], unit["w"], unit["causal"])
    scope = plan.SCOPE[unit["impl"]]
    return {
        "backend": unit["backend"], "T": unit["T"], "w": unit["w"],
        "causal": unit["causal"], "impl": unit["impl"],
        "label": plan.LABELS[unit["impl"]], "scope": scope,
        "pairs": counts["pairs"],
        "useful_flops_forward": counts[scope],
        "layer_flops_forward": counts["layer"],
    }


def _ok(result):
    return bool(result) and result.get("status") == plan.OK


def _derive(cell, cells, matmul):
    rate = matmul.get(cell["backend"], {})
    rate = rate.get("gflops") if _ok(rate) else None
    keras = cells.get((cell["backend"], cell["T"], cell["w"], cell["causal"],
                       "keras"))
    for mode in plan.MODES:
        result = cell.get(mode)
        if not _ok(result):
            continue
        factor = 3 if mode == "forward_backward" else 1
        gflops = cell["useful_flops_forward"] * factor / result["time_s"] / 1e9
        result["useful_gflops"] = gflops
        if rate:
            result["fraction_of_matmul"] = gflops / rate
        if cell["scope"] == "layer":
            if rate:
                roofline = (cell["layer_flops_forward"] * factor
                            / (rate * 1e9))
                result["roofline_s"] = roofline
                result["time_over_roofline"] = result["time_s"] / roofline
            if keras is not None and _ok(keras.get(mode)):
                result["keras_time_over_this"] = (
                    keras[mode]["time_s"] / result["time_s"])


def build_features(units_by_backend, results, missing="not run"):
    """Feature units and results -> the JSON document's `features`.

    One row per (backend, feature): `backend`, `feature`, `label`, `T`,
    `w`, `causal`, `path` (what our layer ran) and a result per mode. A
    measured result of a feature other than `plain` has `ratio_to_plain`
    (its time / plain's, same backend and mode) and `within_target`
    (`ratio <= MAX_FEATURE_RATIO`); such a row has `target`: `met`, `not
    met` or `n/a` over its modes (see `_feature_pass`).
    """
    rows = {}
    for backend, units in units_by_backend.items():
        for unit in units:
            if unit["kind"] != "feature":
                continue
            row = rows.setdefault((backend, unit["feature"]), {
                "backend": backend, "feature": unit["feature"],
                "label": plan.FEATURE_LABELS[unit["feature"]],
                "T": unit["T"], "w": unit["w"], "causal": unit["causal"],
                "path": None,
            })
            result = dict(results.get(unit["id"]) or {
                "status": plan.NOT_RUN, "reason": missing})
            row[unit["mode"]] = result
            row["path"] = row["path"] or result.get("path")
    for (backend, feature), row in rows.items():
        if feature == "plain":
            continue
        plain = rows.get((backend, "plain"), {})
        for mode in plan.MODES:
            result, base = row.get(mode), plain.get(mode)
            if _ok(result) and _ok(base):
                ratio = result["time_s"] / base["time_s"]
                result["ratio_to_plain"] = ratio
                result["within_target"] = ratio <= MAX_FEATURE_RATIO
        row["target"] = _status([_feature_pass(row.get(mode), plain.get(mode))
                                 for mode in plan.MODES if row.get(mode)])
    return list(rows.values())


def _feature_pass(result, plain):
    """Whether one feature unit meets its target: its ratio, else `False`
    where it or plain ran and gave no time (error, out of memory, timed
    out), `None` where either was not measured (skipped, not run)."""
    if result and "within_target" in result:
        return result["within_target"]
    failed = (plan.ERROR, plan.OUT_OF_MEMORY, plan.TIMED_OUT)
    if any((r or {}).get("status") in failed for r in (result, plain)):
        return False
    return None


# ------------------------------------------------------------------ targets


def _find(cells, backend, length, window, impl, causal=True):
    for cell in cells:
        if (cell["backend"], cell["T"], cell["w"], cell["causal"],
                cell["impl"]) == (backend, length, window, causal, impl):
            return cell
    return None


def _mode(cells, backend, length, window, impl, mode, causal=True):
    """`(result, None)` if measured, else `(None, why not)`."""
    cell = _find(cells, backend, length, window, impl, causal)
    label = plan.LABELS.get(impl, impl)
    if cell is None:
        return None, f"{label} T={length} w={_w(window)} not in this run"
    result = cell.get(mode)
    if _ok(result):
        return result, None
    if not result:
        return None, f"{label} {mode.replace('_', '+')}: not in this run"
    return None, f"{label}: {result['status']}" + (
        f" ({result['reason']})" if result.get("reason") else "")


def _w(window):
    return "none" if window is None else window


def _status(passes, need_all=True):
    """`passes`: each True, False or None (not measured) -> `met`, `not
    met` or `n/a`."""
    measured = [passed for passed in passes if passed is not None]
    if not measured:
        return "n/a"
    passed = all(measured) if need_all else any(measured)
    return "met" if passed else "not met"


def _verdict(checks, need_all=True):
    """checks: list of (passed or None, text) -> (status, detail)."""
    detail = "; ".join(text for _, text in checks) or "no data"
    return _status([passed for passed, _ in checks], need_all), detail


def targets(cells, backends, features=()):
    """The issues' targets: `[{"id", "target", "status", "detail"}]`.

    Status: `met`, `not met`, `n/a` (not measured in this run) or `info`
    (a number the issues ask for, without a threshold). The attention
    cells' targets where the run has cells, the features' where it has
    feature rows (`build_features`).
    """
    found = [check(cells, backends) for check in _TARGETS] if cells else []
    if features:
        found.append(_feature_ratios(features, backends))
    return [{"id": key, "target": name, "status": status, "detail": detail}
            for key, name, status, detail in filter(None, found)]


_T, _W = TARGET_LENGTH, TARGET_WINDOW


def _roofline(cells, backends):
    notes = []
    for backend in backends:
        result, why = _mode(cells, backend, _T, _W, "ours", "forward")
        if result is None:
            notes.append(f"{backend}: {why}")
        elif "time_over_roofline" in result:
            notes.append(f"{backend}: {result['time_over_roofline']:.2f}x "
                         f"({result['time_s']:.3f} s vs roofline "
                         f"{result['roofline_s']:.3f} s)")
    return ("roofline",
            f"T={_T}, w={_W}, causal, whole-layer forward: ours / roofline",
            "info", "; ".join(notes) or "no data")


def _keras_over_ours(cells, backends):
    notes = []
    for backend in ("torch", "jax"):
        if backend not in backends:
            continue
        ours, why = _mode(cells, backend, _T, _W, "ours", "forward")
        keras, keras_why = _mode(cells, backend, _T, _W, "keras", "forward")
        if ours is None or keras is None:
            notes.append(f"{backend}: {why or keras_why}")
        else:
            notes.append(f"{backend}: keras/ours = "
                         f"{keras['time_s'] / ours['time_s']:.1f}x")
    return ("keras_over_ours",
            f"T={_T}, w={_W} forward: keras / ours on torch and jax", "info",
            "; ".join(notes) or "no data")


def _completes_on_tensorflow(cells, backends):
    if "tensorflow" not in backends:
        return None
    result, why = _mode(cells, "tensorflow", _T, _W, "ours", "forward")
    if result is not None:
        status, detail = "met", f"{result['time_s']:.3f} s"
    else:
        in_run = _find(cells, "tensorflow", _T, _W, "ours") is not None
        status, detail = ("not met" if in_run else "n/a"), why
    return ("completes_on_tensorflow",
            f"T={_T}, w={_W} forward completes on tensorflow", status, detail)


def _peak_memory(cells, backends):
    checks = []
    for backend in backends:
        result, why = _mode(cells, backend, _T, _W, "ours", "forward")
        if result is None:
            in_run = _find(cells, backend, _T, _W, "ours") is not None
            checks.append((False if in_run else None, f"{backend}: {why}"))
        else:
            peak = result["peak_bytes"]
            checks.append((peak < MAX_PEAK_BYTES,
                           f"{backend}: {peak / MIB:.0f} MiB"))
    return ("peak_memory", f"T={_T}, w={_W} forward: peak memory < "
            f"{MAX_PEAK_BYTES / GIB:g} GiB", *_verdict(checks))


def _linear_scaling(cells, backends):
    checks = []
    windows = sorted({c["w"] for c in cells if c["w"] is not None})
    for backend in backends:
        for window in windows:
            long_, why = _mode(cells, backend, 4 * _T, window, "ours",
                               "forward")
            short, short_why = _mode(cells, backend, _T, window, "ours",
                                     "forward")
            if long_ is None or short is None:
                checks.append((None, f"{backend} w={window}: "
                               f"{why or short_why}"))
            else:
                ratio = long_["time_s"] / short["time_s"]
                checks.append((ratio <= MAX_SCALING,
                               f"{backend} w={window}: {ratio:.2f}"))
    return ("linear_scaling", f"linear scaling: ours forward time "
            f"T={4 * _T} / T={_T} <= {MAX_SCALING}", *_verdict(checks))


def _core_vs_matmul(cells, backends):
    checks = []
    for backend in backends:
        result, why = _mode(cells, backend, _T, _W, "ours_core", "forward")
        if result is None or "fraction_of_matmul" not in result:
            checks.append((None, f"{backend}: {why or 'no matmul rate'}"))
        else:
            fraction = result["fraction_of_matmul"]
            checks.append((fraction >= MIN_CORE_FRACTION,
                           f"{backend}: {fraction:.0%} "
                           f"({result['useful_gflops']:.1f} GFLOP/s)"))
    return ("core_vs_matmul", f"ours core at T={_T}, w={_W} >= "
            f"{MIN_CORE_FRACTION:.0%} of the matmul rate on >= 1 backend",
            *_verdict(checks, need_all=False))


def _core_vs_flex(cells, backends):
    if "torch" not in backends:
        return None
    ours, why = _mode(cells, "torch", _T, _W, "ours_core", "forward")
    flex, flex_why = _mode(cells, "torch", _T, _W, "flex_attention",
                           "forward")
    if ours is None or flex is None:
        status, detail = "n/a", why or flex_why
    else:
        ratio = ours["time_s"] / flex["time_s"]
        status = "met" if ratio <= MAX_FLEX_RATIO else "not met"
        detail = (f"ours core {ours['time_s']:.3f} s / flex_attention "
                  f"{flex['time_s']:.3f} s = {ratio:.2f}x")
    return ("core_vs_flex_attention", f"torch: ours core forward within "
            f"{MAX_FLEX_RATIO}x of compiled flex_attention (T={_T}, w={_W})",
            status, detail)


def _training_speedup(cells, backends):
    checks = []
    for backend in backends:
        ours, why = _mode(cells, backend, _T, _W, "ours", "forward_backward")
        keras, keras_why = _mode(cells, backend, _T, _W, "keras",
                                 "forward_backward")
        if keras is None:
            checks.append((None, f"{backend}: {keras_why}"))
        elif ours is None:
            checks.append((False, f"{backend}: {why}"))
        else:
            speedup = keras["time_s"] / ours["time_s"]
            checks.append((speedup >= MIN_TRAINING_SPEEDUP,
                           f"{backend}: {speedup:.1f}x"))
    return ("training_speedup", f"forward+backward at T={_T}, w={_W}: ours "
            f">= {MIN_TRAINING_SPEEDUP:g}x faster than keras where keras "
            "completes", *_verdict(checks))


def _no_regression(cells, backends):
    speeds = []  # (keras time / ours time, where)
    for cell in cells:
        if cell["impl"] != "ours" or not (
            cell["w"] is None or cell["w"] >= cell["T"]
        ):
            continue
        for mode in plan.MODES:
            result = cell.get(mode)
            if _ok(result) and "keras_time_over_this" in result:
                speeds.append((result["keras_time_over_this"],
                               f"{cell['backend']} T={cell['T']} "
                               f"w={_w(cell['w'])} {mode}"))
    if not speeds:
        status = "n/a"
        detail = "no cell with w = none or w >= T measured for both"
    else:
        slow = [s for s in speeds if s[0] < MIN_NO_WINDOW_SPEED]
        worst = min(speeds)
        status = "not met" if slow else "met"
        detail = (f"{len(speeds) - len(slow)}/{len(speeds)} cells ok; "
                  f"slowest: {worst[1]}: {worst[0]:.2f}x")
    return ("no_regression", "no regression for w = none and w >= T: "
            f"keras time / ours time >= {MIN_NO_WINDOW_SPEED}", status,
            detail)


def _jax_causal_speedup(cells, backends):
    if "jax" not in backends:
        return None
    length = JAX_CAUSAL_LENGTH
    ours, why = _mode(cells, "jax", length, None, "ours", "forward")
    keras, keras_why = _mode(cells, "jax", length, None, "keras", "forward")
    if ours is None or keras is None:
        status, detail = "n/a", why or keras_why
    else:
        speedup = keras["time_s"] / ours["time_s"]
        status = "met" if speedup >= MIN_JAX_CAUSAL_SPEEDUP else "not met"
        detail = f"keras / ours = {speedup:.2f}x"
    return ("jax_causal_speedup", f"jax, causal, no window, T={length} "
            f"forward: ours >= {MIN_JAX_CAUSAL_SPEEDUP:g}x faster than keras",
            status, detail)


def _feature_ratios(features, backends):
    """Every feature within `MAX_FEATURE_RATIO` of plain, on every backend
    and in every mode: per backend the worst ratio and each miss."""
    passes, notes = [], []
    for backend in backends:
        rows = {r["feature"]: r for r in features if r["backend"] == backend}
        plain = rows.pop("plain", {})
        ratios, misses = [], []
        for row in rows.values():
            for mode in plan.MODES:
                result = row.get(mode)
                if not result:
                    continue
                passes.append(_feature_pass(result, plain.get(mode)))
                where = f"{row['label']} {_mode_name(mode)}"
                if "ratio_to_plain" in result:
                    ratios.append((result["ratio_to_plain"], where))
                    if not result["within_target"]:
                        misses.append(f"{where} "
                                      f"{result['ratio_to_plain']:.2f}x")
                elif not _ok(result):
                    misses.append(f"{where}: {_short(result)}")
                else:
                    misses.append(f"{where}: plain "
                                  f"{_short(plain.get(mode))}")
        if not rows:
            continue
        text = f"{backend}: " + (
            "worst {1} {0:.2f}x".format(*max(ratios)) if ratios
            else "no ratio")
        if misses:
            text += (f" (above {MAX_FEATURE_RATIO:g}x or unmeasured: "
                     f"{', '.join(misses)})")
        notes.append(text)
    first = features[0]
    names = ", ".join(dict.fromkeys(
        r["label"] for r in features if r["feature"] != "plain"))
    return ("feature_ratios", f"T={first['T']}, w={_w(first['w'])}"
            f"{', causal' if first['causal'] else ''}, ours: each feature "
            f"({names}) <= {MAX_FEATURE_RATIO:g}x the plain time, forward "
            "and forward+backward", _status(passes),
            "; ".join(notes) or "no data")


def _mode_name(mode):
    return {"forward": "fwd", "forward_backward": "fwd+bwd"}[mode]


_TARGETS = (_roofline, _keras_over_ours, _completes_on_tensorflow,
            _peak_memory, _linear_scaling, _core_vs_matmul, _core_vs_flex,
            _training_speedup, _no_regression, _jax_causal_speedup)


# -------------------------------------------------------------------- table


def _short(result):
    """A table entry for a unit that did not produce a time."""
    if not result:
        return "-"  # not in this run's modes
    status, reason = result.get("status"), result.get("reason") or ""
    if status == plan.SKIPPED:
        estimate = re.search(r"est\. ([\d.]+ (s|GiB))", reason)
        if estimate:
            return f"skip ~{estimate.group(1)}"
        shorter = re.search(r"at T=(\d+) already", reason)
        return f"skip (T={shorter.group(1)})" if shorter else "skipped"
    return {plan.OUT_OF_MEMORY: "OOM", plan.TIMED_OUT: "timeout",
            plan.NOT_AVAILABLE: "n/a", plan.ERROR: "error",
            plan.NOT_RUN: "not run"}.get(status, str(status))


def _time_text(result, footnotes, scale=1):
    """Seconds (times `scale`), or why not; a footnote for failures and
    compiler notes."""
    from rich.text import Text

    if _ok(result):
        text, note, style = Text(f"{result['time_s'] * scale:.4g}"), \
            result.get("note"), None
    else:
        text, note = Text(_short(result)), None
        status = (result or {}).get("status")
        if status in (plan.ERROR, plan.OUT_OF_MEMORY, plan.TIMED_OUT,
                      plan.NOT_AVAILABLE):
            note = result.get("reason", "")
        style = "dim" if status in (None, plan.NOT_AVAILABLE) else (
            "yellow" if status == plan.SKIPPED else "red")
    if note:
        if note not in footnotes:
            footnotes.append(note)
        text.append(f" [{footnotes.index(note) + 1}]")
    if style:
        text.stylize(style)
    return text


def print_report(console, document):
    """Every table of `document`, then its targets."""
    if document["cells"]:
        print_cells(console, document)
    if document["decode"]:
        print_decode(console, document)
    if document.get("features"):
        print_features(console, document["features"])
    if document.get("targets"):
        print_targets(console, document["targets"])


def print_cells(console, document):
    """The attention cells' table, with the matmul rates above it."""
    from rich.table import Table
    from rich.text import Text

    cells, config = document["cells"], document["config"]
    both_causal = len(config["causal"]) > 1
    matmul = document["matmul"]
    console.print(
        "Median seconds per call; peak = largest increase of resident "
        "memory during the timed forward calls (MiB); GFLOP/s and % of the "
        "matmul rate from useful forward FLOPs (see flops_definition in the "
        "JSON); vs keras = keras time / this time, forward / forward+"
        "backward (whole layer only).", soft_wrap=True,
    )
    for backend in document["backends"]:
        rate = matmul.get(backend, {})
        if _ok(rate):
            console.print(f"  {backend}: float32 matmul {rate['size']}^2: "
                          f"{rate['gflops']:.1f} GFLOP/s")
        elif rate:
            console.print(f"  {backend}: matmul {_short(rate)}: "
                          f"{rate.get('reason', '')}")
    table = Table(title="attention, B={batch}, N={num_heads}, "
                  "H={key_dim}".format(**config))
    for column, justify in (
        ("backend", "left"), ("T", "right"), ("w", "right"),
        ("impl", "left"), ("fwd s", "right"), ("fwd+bwd s", "right"),
        ("peak MiB", "right"), ("GFLOP/s", "right"), ("% matmul", "right"),
        ("vs keras", "right"),
    ):
        table.add_column(column, justify=justify)
    footnotes = []
    previous = None
    for cell in sorted(cells, key=_cell_order):
        group = (cell["backend"], cell["T"], cell["w"], cell["causal"])
        if previous is not None and group[:2] != previous[:2]:
            table.add_section()
        previous = group
        forward, both = cell.get("forward"), cell.get("forward_backward")
        window = _w(cell["w"])
        if both_causal:
            window = f"{window} {'causal' if cell['causal'] else 'bidir'}"
        row = [cell["backend"], str(cell["T"]), str(window), cell["label"]]
        for result in (forward, both):
            row.append(_time_text(result, footnotes))
        if _ok(forward):
            row += [f"{forward['peak_bytes'] / MIB:.0f}",
                    f"{forward['useful_gflops']:.1f}",
                    (f"{forward['fraction_of_matmul']:.0%}"
                     if "fraction_of_matmul" in forward else "-")]
        else:
            row += ["-", "-", "-"]
        speed = []
        for result in (forward, both):
            if _ok(result) and "keras_time_over_this" in result:
                speed.append(f"{result['keras_time_over_this']:.2f}x")
            else:
                speed.append("-")
        row.append(" / ".join(speed) if cell["scope"] == "layer" else "")
        table.add_row(*row)
    console.print(table)
    for number, reason in enumerate(footnotes, start=1):
        console.print(Text(f"[{number}] {reason}"), soft_wrap=True)
    extras = [c for c in cells if _ok(c.get("forward"))
              and "block_mask_s" in c["forward"]]
    if extras:
        console.print("flex_attention block-mask build (not in its times), "
                      "median s: " + ", ".join(
                          f"T={c['T']} w={_w(c['w'])} "
                          f"{c['forward']['block_mask_s']:.3g}"
                          for c in extras), soft_wrap=True)


def _cell_order(cell):
    impls = ("keras", "ours", "ours_core", "flex_attention", "jax_dpa")
    return (cell["backend"], cell["T"], -1 if cell["w"] is None else cell["w"],
            not cell["causal"], impls.index(cell["impl"]))


def print_decode(console, document):
    from rich.table import Table

    spec = document["config"]["decode"]
    table = Table(title="decode: one token (T=1) at position p, ours")
    for column in ("backend", "cache", "p", "ms/token", "cache MiB"):
        table.add_column(column, justify="left" if column in (
            "backend", "cache") else "right")
    previous = None
    for entry in document["decode"]:
        if previous is not None and entry["backend"] != previous:
            table.add_section()
        previous = entry["backend"]
        cache = (f"rolling, w={spec['window']}" if entry["cache"] == "rolling"
                 else f"full, {spec['full_length']} slots")
        if _ok(entry):
            table.add_row(entry["backend"], cache, str(entry["position"]),
                          f"{entry['ms_per_token']:.3f}",
                          f"{entry['cache_bytes'] / MIB:.1f}")
        else:
            table.add_row(entry["backend"], cache, str(entry["position"]),
                          f"{_short(entry)}: {entry.get('reason', '')}", "-")
    console.print(table)


def print_features(console, rows):
    """One table per backend: each feature's times and ratios to plain."""
    from rich.table import Table
    from rich.text import Text

    console.print(
        "Features: our whole layer with one feature on (plain: none), "
        "median milliseconds per call; x plain = this time / plain's, same "
        f"backend and mode; target: <= {MAX_FEATURE_RATIO:g}x in both "
        "modes; path = the attention path the layer took.", soft_wrap=True,
    )
    footnotes = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        first = next(r for r in rows if r["backend"] == backend)
        table = Table(title=f"features, {backend}, T={first['T']}, "
                      f"w={_w(first['w'])}"
                      f"{', causal' if first['causal'] else ''}")
        for column in ("feature", "path", "fwd ms", "x plain", "fwd+bwd ms",
                       "x plain", "target"):
            table.add_column(column, justify="left" if column in (
                "feature", "path", "target") else "right")
        for row in rows:
            if row["backend"] != backend:
                continue
            cells = [row["label"], row["path"] or "-"]
            for mode in plan.MODES:
                result = row.get(mode)
                cells.append(_time_text(result, footnotes, scale=1e3))
                cells.append(f"{result['ratio_to_plain']:.2f}x"
                             if result and "ratio_to_plain" in result
                             else "-")
            target = row.get("target", "baseline")
            cells.append(Text(target, style=_STATUS_STYLES.get(target, "")))
            table.add_row(*cells)
        console.print(table)
    for number, reason in enumerate(footnotes, start=1):
        console.print(Text(f"[{number}] {reason}"), soft_wrap=True)


_STATUS_STYLES = {"met": "green", "not met": "bold red", "n/a": "dim",
                  "info": "cyan"}


def print_targets(console, items):
    from rich.text import Text

    console.print(Text("targets", style="bold"))
    for item in items:
        line = Text(f"  {item['status']:>7}  ",
                    style=_STATUS_STYLES[item["status"]])
        line.append(f"{item['target']}: {item['detail']}", style="default")
        console.print(line, soft_wrap=True)


# ---------------------------------------------------------------- JSON, PNG


def write_json(path, document):
    with open(path, "w", encoding="utf-8") as file:
        json.dump(_finite(document), file, indent=1)


def write_markdown(path, document, json_name):
    """The whole report, as the terminal shows it, in a Markdown file.

    The tables are `print_report`'s own, rendered without colour at a fixed
    width into one text block, under a line that names the run, the machine
    and the versions; `json_name` is the JSON file beside it.
    """
    import io

    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=MARKDOWN_WIDTH, color_system=None,
                      force_terminal=False, highlight=False)
    print_report(console, document)
    machine = document["machine"]
    versions = ", ".join(
        f"{backend} {info.get('version') or '?'}"
        for backend, info in document["backend_info"].items())
    keras = {info.get("keras") for info in document["backend_info"].values()
             if info.get("keras")}
    if keras:
        versions += f", keras {', '.join(sorted(keras))}"
    lines = [
        f"# `{document['what']}`",
        "",
        f"{document['seconds']:.0f} s on {machine['platform']} "
        f"({machine['processor']}, {machine['cpus']} CPUs, Python "
        f"{machine['python']}); {versions or 'no backend started'}. Every "
        f"unit, with the reason of each skip, is in `{json_name}`.",
        "",
        "```text",
        *(line.rstrip() for line in buffer.getvalue().rstrip().splitlines()),
        "```",
        "",
    ]
    with open(path, "w", encoding="utf-8") as file:
        file.write("\n".join(lines))


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_plot(path, document):
    """Time against T, log-log; one panel per backend x window.

    Returns `None`, or a one-line reason why no plot was written.
    """
    try:
        import matplotlib
    except ImportError:
        return ('matplotlib is not installed: no plot (pip install '
                '"keras-mha[plot]")')
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    cells = document["cells"]
    backends = document["backends"]
    # One mask per figure: causal where the run has it.
    causal = any(c["causal"] for c in cells) or not cells
    windows = list(dict.fromkeys(c["w"] for c in sorted(
        cells, key=lambda c: -1 if c["w"] is None else c["w"])))
    if not cells or not windows:
        windows = [None]
    figure, axes = plt.subplots(
        len(backends), len(windows), squeeze=False, sharex=True,
        figsize=(4.2 * len(windows) + 1, 3.4 * len(backends) + 0.6),
        layout="constrained",
    )
    colors = {"keras": "tab:red", "ours": "tab:blue", "ours_core": "tab:cyan",
              "flex_attention": "tab:green", "jax_dpa": "tab:purple"}
    for row, backend in enumerate(backends):
        for column, window in enumerate(windows):
            ax = axes[row][column]
            ax.set_title(f"{backend}, w={_w(window)}", fontsize=10)
            for impl, color in colors.items():
                for mode, style in (("forward", "-o"),
                                    ("forward_backward", "--x")):
                    points = sorted(
                        (c["T"], c[mode]["time_s"]) for c in cells
                        if c["backend"] == backend and c["w"] == window
                        and c["impl"] == impl and c["causal"] == causal
                        and _ok(c.get(mode))
                    )
                    if points:
                        ax.plot(*zip(*points), style, color=color,
                                markersize=4, label=f"{plan.LABELS[impl]}"
                                f"{' fwd+bwd' if mode != 'forward' else ''}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            if row == len(backends) - 1:
                ax.set_xlabel("T")
            if column == 0:
                ax.set_ylabel("seconds per call")
    legend = {}
    for ax in figure.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if legend:
        figure.legend(legend.values(), legend.keys(), loc="outside lower "
                      "center", ncol=min(len(legend), 5), fontsize=8)
    figure.suptitle("keras-mha bench: {mask}, B={batch}, N={num_heads}, "
                    "H={key_dim}; solid forward, dashed forward+backward"
                    .format(mask="causal" if causal else "bidirectional",
                            **document["config"]), fontsize=11)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def check_output_folder(folder):
    folder = os.path.abspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CLIError(f"--out {folder}: exists and is not a folder")
    parent = folder if os.path.isdir(folder) else os.path.dirname(folder)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise CLIError(f"--out {folder}: {parent} is not a writable folder")
    return folder
