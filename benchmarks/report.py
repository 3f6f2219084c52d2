"""Results of `python -m benchmarks` as cells, targets, a table, JSON and a plot."""

import json
import math
import os
import re

from benchmarks import plan
from keras_mha.cli.common import CLIError

MIB = 2**20
GIB = 2**30

# The reference cell and thresholds (issues 3, 4 and 14).
TARGET_LENGTH = 16384
TARGET_WINDOW = 128
MAX_PEAK_BYTES = 2 * GIB
MAX_ROOFLINE_FACTOR = 1.5  # ours whole-layer forward time / roofline
MAX_CAUSAL_PEAK_BYTES = 2.5 * GIB  # T=16384, no window, causal, forward
LONG_CAUSAL_LENGTH = 65536  # no window, causal: ours completes
MAX_SCALING = 4.5  # time(T=65536) / time(T=16384), ideal 4
MIN_CORE_FRACTION = 0.5  # of the matmul rate, on at least one backend
MAX_FLEX_RATIO = 1.5  # torch: ours core / compiled flex_attention
MIN_TRAINING_SPEEDUP = 10.0  # keras / ours, forward+backward
MIN_NO_WINDOW_SPEED = 0.95  # keras time / ours time, w = none or w >= T
MIN_JAX_CAUSAL_SPEEDUP = 2.0  # keras / ours, jax, causal, no window
JAX_CAUSAL_LENGTH = 4096
MAX_FEATURE_RATIO = 1.3  # a feature's time / plain time, each mode
# The decode section's targets.
MAX_CACHE_SIZE_RATIO = 1.5  # eager step, full_length slots / short_length
MIN_DECODE_SPEEDUP = 10.0  # keras-hub / ours in place, eager, full_length
MIN_DEFAULT_DECODE_SPEEDUP = 5.0  # keras-hub / ours (a cache the caller owns)
MAX_FLOOR_FACTOR = 3.0  # compiled step <= factor * floor + fixed cost
MAX_ROLLING_SPREAD = 1.2  # rolling: slowest / fastest over the positions
MAX_ROLLING_FLOOR_FACTOR = 2.0  # rolling step <= factor * floor + fixed
MAX_PREFILL_RATIO = 1.3  # through a cache / without one
# A unit that ran and gave no time.
_FAILED = (plan.ERROR, plan.OUT_OF_MEMORY, plan.TIMED_OUT)
# Characters per line of `report.md`: the attention table is about 130 wide.
MARKDOWN_WIDTH = 150


# -------------------------------------------------------------------- cells


def _result(results, unit, missing):
    return dict(results.get(unit["id"]) or {"status": plan.NOT_RUN,
                                            "reason": missing})


def build_cells(config, units_by_backend, results, missing="not run"):
    """Units and results -> the JSON document's `cells` and `matmul`.

    `matmul[backend]`: `{"square": the square matmul's result with its
    `size`, "projections": [the result of each projection unit with its B,
    T and shape]}`. A cell is one (backend, B, T, w, causal, impl) with a
    result per mode (`_derive` adds the ratios). A unit without a result is
    `not run`, `missing` saying why.
    """
    matmul, cells = {}, {}
    for backend, units in units_by_backend.items():
        for unit in units:
            result = _result(results, unit, missing)
            if unit["kind"] in ("matmul", "projection"):
                rates = matmul.setdefault(backend, {"square": None,
                                                    "projections": []})
                if unit["kind"] == "matmul":
                    rates["square"] = {"size": unit["size"], **result}
                else:
                    rates["projections"].append({
                        "B": unit["B"], "T": unit["T"],
                        "shape": unit["shape"], **result})
            elif unit["kind"] == "attention":
                key = (backend, unit["B"], unit["T"], unit["w"],
                       unit["causal"], unit["impl"])
                cell = cells.setdefault(key, _new_cell(config, unit))
                cell[unit["mode"]] = result
    for cell in cells.values():
        _derive(cell, cells, matmul)
    return list(cells.values()), matmul


def _new_cell(config, unit):
    counts = plan.flops(config, unit["T"], unit["w"], unit["causal"],
                        unit["B"])
    scope = plan.SCOPE[unit["impl"]]
    return {
        "backend": unit["backend"], "B": unit["B"], "T": unit["T"],
        "w": unit["w"], "causal": unit["causal"], "impl": unit["impl"],
        "label": plan.LABELS[unit["impl"]], "scope": scope,
        "pairs": counts["pairs"],
        "useful_flops_forward": counts[scope],
        "layer_flops_forward": counts["layer"],
    }


def _ok(result):
    return bool(result) and result.get("status") == plan.OK


def _projection_rate(matmul, backend, batch, length):
    """GFLOP/s of the projection matmul at (B, T) on `backend`, or `None`
    where it was not measured."""
    for row in (matmul.get(backend) or {}).get("projections", ()):
        if (row["B"], row["T"]) == (batch, length) and _ok(row):
            return row["gflops"]
    return None


def _derive(cell, cells, matmul):
    """A cell's ratios, per measured mode: `useful_gflops`; against the
    projection matmul of the same backend, B and T (`projection_gflops`,
    the cell's), `fraction_of_matmul` (the core's and the layer's); for a
    whole layer, `roofline_s`, `time_over_roofline` and
    `keras_time_over_this` (Keras's time in the same cell / this).

    The projection rate, not the square matmul's, is the yardstick of both:
    the roofline is what the layer would cost if attention ran as fast as
    its own projections, and the core's fraction reads against the same
    rate, so a layer's `fraction_of_matmul` is `1 / time_over_roofline`.
    Ours (layer and core) time the projection after each of their own
    calls (`projection_gflops` in their result, `Worker.time_calls`'s
    `beside`), and read against that rate: JAX's projection at T=16,384
    read 240 and 459 GFLOP/s in two runs as a unit of its own, and the
    layer's time over its roofline 1.74x and 1.45x. Without a projection
    rate there is neither (the square rate, another shape, is for
    information only).
    """
    rate = _projection_rate(matmul, cell["backend"], cell["B"], cell["T"])
    cell["projection_gflops"] = rate
    keras = cells.get((cell["backend"], cell["B"], cell["T"], cell["w"],
                       cell["causal"], "keras"))
    for mode in plan.MODES:
        result = cell.get(mode)
        if not _ok(result):
            continue
        factor = 3 if mode == "forward_backward" else 1
        gflops = cell["useful_flops_forward"] * factor / result["time_s"] / 1e9
        result["useful_gflops"] = gflops
        own = result.get("projection_gflops") or rate
        if own:
            result["fraction_of_matmul"] = gflops / own
        if cell["scope"] == "layer":
            if own:
                roofline = (cell["layer_flops_forward"] * factor
                            / (own * 1e9))
                result["roofline_s"] = roofline
                result["time_over_roofline"] = result["time_s"] / roofline
            if keras is not None and _ok(keras.get(mode)):
                result["keras_time_over_this"] = (
                    keras[mode]["time_s"] / result["time_s"])


def build_fit(units_by_backend, results, missing="not run"):
    """The `fit` units and results -> the JSON document's `fit`: a row per
    (backend, impl) with the unit's B, T, w and layers and its result;
    ours, where both were measured, with `keras_time_over_this` (Keras's
    step time / ours)."""
    rows = {}
    for backend, units in units_by_backend.items():
        for unit in units:
            if unit["kind"] != "fit":
                continue
            rows[backend, unit["impl"]] = {
                "backend": backend, "impl": unit["impl"],
                "label": plan.LABELS[unit["impl"]],
                **{name: unit[name] for name in ("B", "T", "w", "layers")},
                **_result(results, unit, missing),
            }
    for (backend, impl), row in rows.items():
        keras = rows.get((backend, "keras"))
        if impl == "ours" and _ok(row) and _ok(keras):
            row["keras_time_over_this"] = keras["time_s"] / row["time_s"]
    return list(rows.values())


def build_decode(config, units_by_backend, results, missing="not run"):
    """The decode section's units and results -> the JSON document's
    `decode`: `{"config", "steps", "generate", "prefill"}`, or `None` when
    the run has none.

    `steps`: a row per (backend, impl, cache, slots, position) with a
    result per mode, `impl` `read` for the floors (`reads` slots; a rolling
    cache's floor has position `None`). A measured result of ours gets the
    ratios the targets read (`_derive_step`). `generate`: a row per
    (backend, impl) with `tokens_per_s`; ours gets `over_keras_hub` (its
    tokens/s / keras-hub's) and `same_tokens`. `prefill`: a row per
    (backend, cache, w) with a result per mode; through a cache,
    `over_no_cache` (its time / the same window's without a cache).
    """
    steps, generate, prefill = {}, {}, {}
    for backend, units in units_by_backend.items():
        for unit in units:
            kind = unit["kind"]
            if kind not in ("decode", "floor", "generate", "prefill"):
                continue
            result = _result(results, unit, missing)
            if kind in ("decode", "floor"):
                impl = unit["impl"] if kind == "decode" else "read"
                key = (backend, impl, unit["cache"], unit["slots"],
                       unit["position"])
                row = steps.setdefault(key, {
                    "backend": backend, "impl": impl,
                    "label": plan.DECODE_LABELS[impl], "cache": unit["cache"],
                    "slots": unit["slots"], "position": unit["position"],
                    **({"reads": unit["reads"]} if kind == "floor" else {}),
                })
                row[unit["mode"]] = result
            elif kind == "generate":
                generate[backend, unit["impl"]] = {
                    "backend": backend, "impl": unit["impl"],
                    "label": plan.DECODE_LABELS[unit["impl"]],
                    "prompt_length": unit["prompt_length"],
                    "max_length": unit["max_length"], **result,
                }
            else:
                row = prefill.setdefault((backend, unit["cache"], unit["w"]), {
                    "backend": backend, "cache": unit["cache"],
                    "T": unit["T"], "w": unit["w"],
                })
                row[unit["mode"]] = result
    if not (steps or generate or prefill):
        return None
    spec = config["decode"]
    for row in steps.values():
        _derive_step(row, steps, spec)
    for (backend, impl), row in generate.items():
        theirs = generate.get((backend, "keras_hub"))
        if impl == "ours" and _ok(row) and _ok(theirs):
            row["over_keras_hub"] = (row["tokens_per_s"]
                                     / theirs["tokens_per_s"])
            row["same_tokens"] = row["generated"] == theirs["generated"]
    for (backend, cache, window), row in prefill.items():
        plain = prefill.get((backend, "none", window), {})
        for mode in plan.DECODE_MODES:
            result = row.get(mode)
            if cache != "none" and _ok(result) and _ok(plain.get(mode)):
                result["over_no_cache"] = (result["time_s"]
                                           / plain[mode]["time_s"])
    return {"config": spec, "steps": list(steps.values()),
            "generate": list(generate.values()),
            "prefill": list(prefill.values())}


def _derive_step(row, steps, spec):
    """The ratios of one of our step rows, per measured mode:

    - `keras_hub_over_this`: keras-hub's time at the same cache, position
      and mode / this time;
    - `over_short_cache` (`full_length` slots at the first position): this
      time / ours with `short_length` slots there;
    - `over_first_position` (rolling): this time / the same cache's at the
      first position;
    - `floor_s`, `fixed_s` and `over_floor_after_fixed` = (this time -
      fixed) / floor, where the same cache has a floor in this mode; fixed
      = ours at `plan.FIXED_POSITION` in the same cache and mode.
    """
    if row["impl"] not in ("ours", "ours_default"):
        return
    backend, cache, slots, position = (row["backend"], row["cache"],
                                       row["slots"], row["position"])
    if row["impl"] == "ours_default":  # against keras-hub only
        theirs = steps.get((backend, "keras_hub", cache, slots, position), {})
        for mode in plan.DECODE_MODES:
            result = row.get(mode)
            if _ok(result) and _ok(theirs.get(mode)):
                result["keras_hub_over_this"] = (theirs[mode]["time_s"]
                                                 / result["time_s"])
        return
    first = spec["positions"][0]

    def other(impl, slots=slots, position=position):
        return steps.get((backend, impl, cache, slots, position), {})

    theirs = other("keras_hub")
    short = (other("ours", slots=spec["short_length"])
             if cache == "full" and slots == spec["full_length"]
             and position == first else {})
    start = (other("ours", position=first)
             if cache == "rolling" and position != first
             and position in spec["positions"] else {})
    floor = fixed = {}
    if position != plan.FIXED_POSITION and (cache == "rolling"
                                            or slots == spec["full_length"]):
        floor = other("read", position=None if cache == "rolling"
                      else position)
        fixed = other("ours", position=plan.FIXED_POSITION)
    for mode in plan.DECODE_MODES:
        result = row.get(mode)
        if not _ok(result):
            continue
        time_s = result["time_s"]
        if _ok(theirs.get(mode)):
            result["keras_hub_over_this"] = theirs[mode]["time_s"] / time_s
        if _ok(short.get(mode)):
            result["over_short_cache"] = time_s / short[mode]["time_s"]
        if _ok(start.get(mode)):
            result["over_first_position"] = time_s / start[mode]["time_s"]
        if _ok(floor.get(mode)) and _ok(fixed.get(mode)):
            result.update(
                floor_s=floor[mode]["time_s"], fixed_s=fixed[mode]["time_s"],
                over_floor_after_fixed=(time_s - fixed[mode]["time_s"])
                / floor[mode]["time_s"])


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


def _add_columns(table, columns, left):
    """`columns` added to a rich `table`: those in `left` left-justified,
    the others (numbers) right-justified."""
    for column in columns:
        table.add_column(column,
                         justify="left" if column in left else "right")


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


def targets(cells, backends, features=(), decode=None, fit=(), batch=1):
    """The issues' targets: `[{"id", "target", "status", "detail"}]`.

    Status: `met`, `not met`, `n/a` (not measured in this run) or `info`
    (a number the issues ask for, without a threshold). The attention
    cells' targets where the run has cells: those of a reference cell read
    the matrix's cells (batch `batch`), `no_regression` every cell, the
    small-model ones included; the fit step's where it has fit rows
    (`build_fit`), the features' where it has feature rows
    (`build_features`), the decode section's where it has one
    (`build_decode`).
    """
    found = []
    if cells:
        matrix = [cell for cell in cells if cell["B"] == batch]
        found += [check(matrix, backends) for check in _TARGETS]
        found.append(_no_regression(cells, backends))
    if fit:
        found.append(_fit_speed(fit, backends))
    if features:
        found.append(_feature_ratios(features, backends))
    if decode:
        found += [check(decode, backends) for check in _DECODE_TARGETS]
    return [{"id": key, "target": name, "status": status, "detail": detail}
            for key, name, status, detail in filter(None, found)]


_T, _W = TARGET_LENGTH, TARGET_WINDOW


def _ours_forward(cells, backend, length, window):
    """Our whole layer's causal forward in one cell: `(result, None)` where
    measured, else `(None, (passed, why))`, `passed` `False` where it ran
    or was skipped and gave no time (a target asks it to complete), `None`
    where it is not in this run or was not run."""
    result, why = _mode(cells, backend, length, window, "ours", "forward")
    if result is not None:
        return result, None
    cell = _find(cells, backend, length, window, "ours") or {}
    status = (cell.get("forward") or {}).get("status")
    failed = status in _FAILED + (plan.SKIPPED,)
    return None, (False if failed else None, f"{backend}: {why}")


def _roofline_check(result, backend):
    """`(passed, text)`: a whole layer's forward within
    `MAX_ROOFLINE_FACTOR` of its roofline."""
    if "time_over_roofline" not in result:
        return None, f"{backend}: no projection rate, no roofline"
    factor = result["time_over_roofline"]
    return factor <= MAX_ROOFLINE_FACTOR, (
        f"{backend}: {factor:.2f}x ({result['time_s']:.3g} s vs roofline "
        f"{result['roofline_s']:.3g} s)")


def _completion_checks(cells, backends, length, window):
    """`[(passed, text)]`: our layer's forward completes on each backend."""
    checks = []
    for backend in backends:
        result, missing = _ours_forward(cells, backend, length, window)
        checks.append(missing or (True, f"{backend}: {result['time_s']:.3g} "
                                  f"s, peak {result['peak_bytes'] / MIB:.0f} "
                                  "MiB"))
    return checks


def _roofline(cells, backends):
    checks = []
    for backend in backends:
        result, missing = _ours_forward(cells, backend, _T, _W)
        checks.append(missing or _roofline_check(result, backend))
    return ("roofline", f"T={_T}, w={_W}, causal, whole-layer forward: ours "
            f"<= {MAX_ROOFLINE_FACTOR:g}x the roofline (its projections' "
            "matmul rate) on every backend", *_verdict(checks))


def _no_window_causal(cells, backends):
    checks = []
    for backend in backends:
        result, missing = _ours_forward(cells, backend, _T, None)
        if missing:
            checks.append(missing)
            continue
        peak = result["peak_bytes"]
        checks.append((peak < MAX_CAUSAL_PEAK_BYTES,
                       f"{backend}: peak {peak / MIB:.0f} MiB"))
        checks.append(_roofline_check(result, backend))
    return ("no_window_causal", f"T={_T}, no window, causal, whole-layer "
            f"forward: ours completes on every backend, peak < "
            f"{MAX_CAUSAL_PEAK_BYTES / GIB:g} GiB, <= "
            f"{MAX_ROOFLINE_FACTOR:g}x the roofline", *_verdict(checks))


def _no_window_long(cells, backends):
    length = LONG_CAUSAL_LENGTH
    return ("no_window_long", f"T={length}, no window, causal, whole-layer "
            "forward: ours completes on every backend",
            *_verdict(_completion_checks(cells, backends, length, None)))


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
    return ("completes_on_tensorflow",
            f"T={_T}, w={_W} forward completes on tensorflow",
            *_verdict(_completion_checks(cells, ["tensorflow"], _T, _W)))


def _peak_memory(cells, backends):
    checks = []
    for backend in backends:
        result, missing = _ours_forward(cells, backend, _T, _W)
        if missing:
            checks.append(missing)
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
            checks.append((None, f"{backend}: "
                           f"{why or 'no projection rate'}"))
        else:
            fraction = result["fraction_of_matmul"]
            checks.append((fraction >= MIN_CORE_FRACTION,
                           f"{backend}: {fraction:.0%} "
                           f"({result['useful_gflops']:.1f} GFLOP/s)"))
    return ("core_vs_matmul", f"ours core at T={_T}, w={_W} >= "
            f"{MIN_CORE_FRACTION:.0%} of the matmul rate (the projections', "
            "same B and T) on >= 1 backend",
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
        if cell["impl"] != "ours" or not plan.unwindowed(cell):
            continue
        for mode in plan.MODES:
            result = cell.get(mode)
            if _ok(result) and "keras_time_over_this" in result:
                speeds.append((result["keras_time_over_this"],
                               f"{cell['backend']} B={cell['B']} "
                               f"T={cell['T']} w={_w(cell['w'])} {mode}"))
    if not speeds:
        status = "n/a"
        detail = "no cell with w = none or w >= T measured for both"
    else:
        slow = [s for s in speeds if s[0] < MIN_NO_WINDOW_SPEED]
        worst = min(speeds)
        status = "not met" if slow else "met"
        detail = (f"{len(speeds) - len(slow)}/{len(speeds)} cells ok; "
                  f"slowest: {worst[1]}: {worst[0]:.2f}x")
    return ("no_regression", "no regression for w = none and w >= T, "
            "small-model cells included, forward and forward+backward: "
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


def _fit_speed(fit, backends):
    """Ours faster than Keras's layer in the fit step on every backend where
    Keras's model compiles (`jit_compile` on); elsewhere the ratio is
    information."""
    checks = []
    for backend in backends:
        rows = {row["impl"]: row for row in fit if row["backend"] == backend}
        ours, keras = rows.get("ours"), rows.get("keras")
        problem = _unmeasured([("keras", keras, False), ("ours", ours, True)])
        if problem:
            checks.append((problem[0], f"{backend}: {problem[1]}"))
            continue
        ratio = ours["keras_time_over_this"]
        text = (f"{backend}: keras {keras['time_s']:.3g} s / ours "
                f"{ours['time_s']:.3g} s = {ratio:.2f}x")
        if not ours["jit_compile"]:
            text += " (ours not compiled)"
        if not keras["jit_compile"]:
            checks.append((None, f"{text}; keras does not compile: "
                           f"{keras.get('note') or 'jit_compile turned off'}"))
        else:
            checks.append((ratio > 1, text))
    first = fit[0]
    return ("fit_speed", f"one fit step (jit_compile=True), {first['layers']}"
            f"-layer causal transformer, T={first['T']}: ours "
            f"(w={_w(first['w'])}) faster than keras.layers."
            "MultiHeadAttention (causal) on every backend where keras "
            "compiles", *_verdict(checks))


# The targets of the matrix's reference cells (`no_regression` reads every
# cell: see `targets`).
_TARGETS = (_roofline, _no_window_causal, _no_window_long, _keras_over_ours,
            _completes_on_tensorflow, _peak_memory, _linear_scaling,
            _core_vs_matmul, _core_vs_flex, _training_speedup,
            _jax_causal_speedup)


# ------------------------------------------------------------ decode targets


def _step(decode, backend, impl, cache, slots, position, mode):
    """The result of one step (or floor) in `mode`, `None` if not in the
    run."""
    for row in decode["steps"]:
        if (row["backend"], row["impl"], row["cache"], row["slots"],
                row["position"]) == (backend, impl, cache, slots, position):
            return row.get(mode)
    return None


def _unmeasured(entries):
    """`entries`: `[(label, result, ours)]`. `None` when every result is
    measured, else `(passed, why)` for the first that is not: `False`
    where it is ours and ran without a time (error, out of memory, timed
    out), `None` (not measured) otherwise."""
    for label, result, ours in entries:
        if _ok(result):
            continue
        if not result:
            return None, f"{label}: not in this run"
        failed = ours and result.get("status") in _FAILED
        reason = f" ({result['reason']})" if result.get("reason") else ""
        return (False if failed else None), (
            f"{label}: {result['status']}{reason}")
    return None


def _ms(result):
    return f"{result['time_s'] * 1e3:.3g} ms"


def _decode_cache_size(decode, backends):
    spec = decode["config"]
    position, full, short = (spec["positions"][0], spec["full_length"],
                             spec["short_length"])
    checks = []
    for backend in backends:
        big = _step(decode, backend, "ours", "full", full, position, "eager")
        small = _step(decode, backend, "ours", "full", short, position,
                      "eager")
        problem = _unmeasured([(f"ours L={full}", big, True),
                            (f"ours L={short}", small, True)])
        if problem:
            checks.append((problem[0], f"{backend}: {problem[1]}"))
            continue
        ratio = big["time_s"] / small["time_s"]
        checks.append((ratio <= MAX_CACHE_SIZE_RATIO,
                       f"{backend}: {_ms(big)} / {_ms(small)} = "
                       f"{ratio:.2f}x"))
    return ("decode_cache_size", f"eager step at p={position}: ours with a "
            f"{full}-slot cache <= {MAX_CACHE_SIZE_RATIO:g}x ours with "
            f"{short} slots", *_verdict(checks))


def _decode_vs_keras_hub(decode, backends, impl="ours",
                         least=MIN_DECODE_SPEEDUP, name="decode_vs_keras_hub"):
    spec = decode["config"]
    position, full = spec["positions"][0], spec["full_length"]
    checks = []
    for backend in backends:
        ours = _step(decode, backend, impl, "full", full, position, "eager")
        theirs = _step(decode, backend, "keras_hub", "full", full, position,
                       "eager")
        problem = _unmeasured([("ours", ours, True),
                            ("keras-hub", theirs, False)])
        if problem:
            checks.append((problem[0], f"{backend}: {problem[1]}"))
            continue
        speedup = theirs["time_s"] / ours["time_s"]
        checks.append((speedup >= least,
                       f"{backend}: keras-hub {_ms(theirs)} / ours "
                       f"{_ms(ours)} = {speedup:.1f}x"))
    return (name, f"eager step at p={position}, L={full}: "
            f"{plan.DECODE_LABELS[impl]} >= {least:g}x faster than "
            "keras-hub's CachedMultiHeadAttention", *_verdict(checks))


def _default_decode_vs_keras_hub(decode, backends):
    return _decode_vs_keras_hub(decode, backends, "ours_default",
                                MIN_DEFAULT_DECODE_SPEEDUP,
                                "default_decode_vs_keras_hub")


def _floor_checks(decode, backend, cache, slots, positions, factor):
    """`[(passed, text)]`: in the backend's fast mode, ours at each of
    `positions` against `factor` x floor + fixed."""
    mode = plan.fast_mode(backend)
    fixed = _step(decode, backend, "ours", cache, slots, plan.FIXED_POSITION,
                  mode)
    checks = []
    for position in positions:
        ours = _step(decode, backend, "ours", cache, slots, position, mode)
        floor = _step(decode, backend, "read", cache, slots,
                      None if cache == "rolling" else position, mode)
        problem = _unmeasured([(f"ours p={position}", ours, True),
                            (f"ours p={plan.FIXED_POSITION}", fixed, True),
                            ("floor", floor, False)])
        if problem:
            checks.append((problem[0], f"{backend} {mode}: {problem[1]}"))
            continue
        ratio = ours["over_floor_after_fixed"]
        bound = factor * floor["time_s"] + fixed["time_s"]
        checks.append((ratio <= factor, f"{backend} {mode} p={position}: "
                       f"{_ms(ours)} vs {factor:g} x {_ms(floor)} + "
                       f"{_ms(fixed)} = {bound * 1e3:.3g} ms ((t - fixed) / "
                       f"floor = {ratio:.2f})"))
    return checks


def _decode_floor(decode, backends):
    spec = decode["config"]
    position, full = spec["positions"][-1], spec["full_length"]
    checks = []
    for backend in backends:
        checks += _floor_checks(decode, backend, "full", full, [position],
                                MAX_FLOOR_FACTOR)
    return ("decode_floor", f"compiled step (torch: eager) at p={position}, "
            f"L={full}: <= {MAX_FLOOR_FACTOR:g} x floor + fixed cost (floor: "
            f"reading the p + 1 valid slots once; fixed: ours at "
            f"p={plan.FIXED_POSITION})", *_verdict(checks))


def _rolling_decode(decode, backends):
    spec = decode["config"]
    window, positions = spec["window"], spec["positions"]
    checks = []
    for backend in backends:
        for mode in plan.decode_modes(backend):
            results = [_step(decode, backend, "ours", "rolling", window, p,
                             mode) for p in positions]
            problem = _unmeasured([(f"ours p={p}", r, True)
                                for p, r in zip(positions, results)])
            if problem:
                checks.append((problem[0],
                               f"{backend} {mode}: {problem[1]}"))
                continue
            times = [r["time_s"] for r in results]
            spread = max(times) / min(times)
            checks.append((spread <= MAX_ROLLING_SPREAD,
                           f"{backend} {mode}: slowest / fastest "
                           f"{spread:.2f}"))
        checks += _floor_checks(decode, backend, "rolling", window,
                                positions, MAX_ROLLING_FLOOR_FACTOR)
    return ("rolling_decode", f"rolling cache w={window}: per-token time "
            f"flat within {MAX_ROLLING_SPREAD - 1:.0%} from p={positions[0]} "
            f"to p={positions[-1]} (each mode) and <= "
            f"{MAX_ROLLING_FLOOR_FACTOR:g} x its floor (its {window} slots) + "
            "fixed cost (compiled; torch: eager)", *_verdict(checks))


def _generate_speed(decode, backends):
    rows = {(r["backend"], r["impl"]): r for r in decode["generate"]}
    checks = []
    for backend in backends:
        ours, theirs = rows.get((backend, "ours")), rows.get((backend,
                                                              "keras_hub"))
        problem = _unmeasured([("ours", ours, True),
                            ("keras-hub", theirs, False)])
        if problem:
            checks.append((problem[0], f"{backend}: {problem[1]}"))
            continue
        ratio = ours["over_keras_hub"]
        same = "same tokens" if ours["same_tokens"] else "other tokens"
        checks.append((ratio >= 1, f"{backend}: ours "
                       f"{ours['tokens_per_s']:.0f} / keras-hub "
                       f"{theirs['tokens_per_s']:.0f} tokens/s = "
                       f"{ratio:.2f}x, {same}"))
    first = (decode["generate"] or [{}])[0]
    return ("generate_speed", "tiny GPT-2 generate (greedy, prompt "
            f"{first.get('prompt_length')}, max_length "
            f"{first.get('max_length')}): ours tokens/s >= keras-hub's",
            *_verdict(checks))


def _prefill_ratio(decode, backends):
    checks = []
    for backend in backends:
        for row in decode["prefill"]:
            if row["backend"] != backend or row["cache"] == "none":
                continue
            for mode in plan.decode_modes(backend):
                result = row.get(mode)
                where = f"{backend} {row['cache']} w={_w(row['w'])} {mode}"
                if _ok(result) and "over_no_cache" in result:
                    ratio = result["over_no_cache"]
                    checks.append((ratio <= MAX_PREFILL_RATIO,
                                   f"{where} {ratio:.2f}x"))
                elif _ok(result):
                    checks.append((None, f"{where}: without a cache not "
                                   "measured"))
                else:
                    failed = (result or {}).get("status") in _FAILED
                    checks.append((False if failed else None,
                                   f"{where}: {_short(result)}"))
    spec = decode["config"]["prefill"]
    return ("prefill_ratio", f"prefill T={spec['length']} through the cache "
            f"at index 0 (rolling w={spec['window']}; full) <= "
            f"{MAX_PREFILL_RATIO:g}x the same forward without a cache, each "
            "mode", *_verdict(checks))


_DECODE_TARGETS = (_decode_cache_size, _decode_vs_keras_hub,
                   _default_decode_vs_keras_hub, _decode_floor,
                   _rolling_decode, _generate_speed, _prefill_ratio)


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
    if document.get("fit"):
        print_fit(console, document["fit"])
    if document["decode"]:
        print_decode(console, document["decode"])
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
        "memory during the timed forward calls (MiB); GFLOP/s from useful "
        "forward FLOPs (see flops_definition in the JSON); % matmul = that "
        "rate / the projection matmul's at the same B and T, x roof = "
        "forward time / roofline (whole-layer FLOPs at the projection "
        "rate); vs keras = keras time / this time, forward / forward+"
        "backward (whole layer only).", soft_wrap=True,
    )
    for backend in document["backends"]:
        line = _matmul_line(matmul.get(backend))
        if line:
            console.print(f"  {backend}: {line}", soft_wrap=True)
    table = Table(title="attention, N={num_heads}, H={key_dim}".format(
        **config))
    for column, justify in (
        ("backend", "left"), ("B", "right"), ("T", "right"), ("w", "right"),
        ("impl", "left"), ("fwd s", "right"), ("fwd+bwd s", "right"),
        ("peak MiB", "right"), ("GFLOP/s", "right"), ("% matmul", "right"),
        ("x roof", "right"), ("vs keras", "right"),
    ):
        table.add_column(column, justify=justify)
    footnotes = []
    previous = None
    for cell in sorted(cells, key=_cell_order):
        group = (cell["backend"], cell["B"], cell["T"])
        if previous is not None and group != previous:
            table.add_section()
        previous = group
        forward, both = cell.get("forward"), cell.get("forward_backward")
        window = _w(cell["w"])
        if both_causal:
            window = f"{window} {'causal' if cell['causal'] else 'bidir'}"
        row = [cell["backend"], str(cell["B"]), str(cell["T"]), str(window),
               cell["label"]]
        for result in (forward, both):
            row.append(_time_text(result, footnotes))
        if _ok(forward):
            row += [f"{forward['peak_bytes'] / MIB:.0f}",
                    f"{forward['useful_gflops']:.1f}",
                    (f"{forward['fraction_of_matmul']:.0%}"
                     if "fraction_of_matmul" in forward else "-"),
                    (f"{forward['time_over_roofline']:.2f}"
                     if "time_over_roofline" in forward else "-")]
        else:
            row += ["-", "-", "-", "-"]
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


def _matmul_line(rates):
    """One line of a backend's matmul rates: the square one, then each
    projection's (the roofline's yardstick) by B and T."""
    if not rates:
        return ""
    parts = []
    square = rates["square"]
    if square:
        parts.append(f"float32 matmul {square['size']}^2: " + (
            f"{square['gflops']:.1f} GFLOP/s" if _ok(square)
            else f"{_short(square)} ({square.get('reason', '')})"))
    rows = rates["projections"]
    if rows:
        features, columns = rows[0]["shape"][1:]
        parts.append(f"projections (B*T, {features}) @ ({features}, "
                     f"{columns}), GFLOP/s: " + ", ".join(
                         f"B={row['B']} T={row['T']} "
                         + (f"{row['gflops']:.1f}" if _ok(row)
                            else _short(row)) for row in rows))
    return "; ".join(parts)


def print_fit(console, rows):
    """The fit steps: ours against Keras's layer, per backend."""
    from rich.table import Table
    from rich.text import Text

    first = rows[0]
    console.print(
        f"Fit: one train_on_batch step (mse, Adam) of a {first['layers']}-"
        f"layer causal transformer (B={first['B']}, T={first['T']}) with "
        f"our attention (w={_w(first['w'])}) or Keras's (causal), compiled "
        "with jit_compile=True where Keras does (jit_compile = what ran); "
        "median s per step after the first (compilation included); vs "
        "keras = keras time / this time.", soft_wrap=True)
    table = Table(title="fit step")
    _add_columns(table, ("backend", "attention", "jit_compile",
                         "first step s", "step s", "vs keras"),
                 left=("backend", "attention", "jit_compile"))
    footnotes = []
    for row in rows:
        measured = _ok(row)
        table.add_row(
            row["backend"], row["label"],
            str(row["jit_compile"]) if measured else "-",
            f"{row['first_call_s']:.3g}" if measured else "-",
            _time_text(row, footnotes),
            (f"{row['keras_time_over_this']:.2f}x"
             if "keras_time_over_this" in row else "-"))
    console.print(table)
    for number, reason in enumerate(footnotes, start=1):
        console.print(Text(f"[{number}] {reason}"), soft_wrap=True)


def _cell_order(cell):
    impls = ("keras", "ours", "ours_core", "flex_attention", "jax_dpa")
    return (cell["backend"], cell["B"], cell["T"],
            -1 if cell["w"] is None else cell["w"], not cell["causal"],
            impls.index(cell["impl"]))


def print_decode(console, decode):
    """The decode section: a table of steps per backend, then the GPT-2
    generate and prefill tables."""
    from rich.table import Table
    from rich.text import Text

    spec = decode["config"]
    first, short = spec["positions"][0], spec["short_length"]
    console.print(
        "Decode: one token (T=1) at position p through a cache, median ms "
        "per token. compiled = jax.jit with the cache donated, "
        "tf.function(jit_compile=True); torch runs eagerly. Ratios: kh = "
        f"keras-hub's time / this; L{short} = this / ours with {short} "
        f"slots at p={first}; p{first} = this / the same cache at "
        f"p={first}; floor = (this - fixed) / floor, fixed = ours at "
        f"p={plan.FIXED_POSITION} in the same cache and mode, floor = "
        "reading the valid slots once (p + 1 of a full cache, the w of a "
        "rolling one; compiled, torch eager).", soft_wrap=True,
    )
    footnotes = []
    order = {"ours": 0, "ours_default": 1, "keras_hub": 2, "read": 3}
    for backend in dict.fromkeys(r["backend"] for r in decode["steps"]):
        modes = plan.decode_modes(backend)
        table = Table(title=f"decode, {backend}")
        for column in ("cache", "p", "impl"):
            table.add_column(column, justify="right" if column == "p"
                             else "left")
        for mode in modes:
            table.add_column(f"{mode} ms", justify="right")
            table.add_column(f"{mode} ratios", justify="left")
        rows = sorted(
            (r for r in decode["steps"] if r["backend"] == backend),
            key=lambda r: (r["cache"] == "rolling", r["slots"] == short,
                           r["position"] or 0, order[r["impl"]]))
        previous = None
        for row in rows:
            group = (row["cache"], row["slots"])
            if previous is not None and group != previous:
                table.add_section()
            previous = group
            cells = [f"{row['cache']} {row['slots']}",
                     "any" if row["position"] is None
                     else str(row["position"]), row["label"]]
            for mode in modes:
                result = row.get(mode)
                cells.append(_time_text(result, footnotes, scale=1e3)
                             if result else Text("-", style="dim"))
                cells.append(_step_ratios(result, spec))
            table.add_row(*cells)
        console.print(table)
    for number, reason in enumerate(footnotes, start=1):
        console.print(Text(f"[{number}] {reason}"), soft_wrap=True)
    if decode["generate"]:
        print_generate(console, decode["generate"])
    if decode["prefill"]:
        print_prefill(console, decode["prefill"])


def _step_ratios(result, spec):
    """The ratios of one step's result (see `print_decode`), or a floor's
    bytes and rate."""
    if not _ok(result):
        return ""
    if "read_bytes" in result:
        return (f"{result['read_bytes'] / MIB:.1f} MiB, "
                f"{result['gb_per_s']:.1f} GB/s")
    parts = []
    if "keras_hub_over_this" in result:
        parts.append(f"kh {result['keras_hub_over_this']:.1f}x")
    if "over_short_cache" in result:
        parts.append(f"L{spec['short_length']} "
                     f"{result['over_short_cache']:.2f}x")
    if "over_first_position" in result:
        parts.append(f"p{spec['positions'][0]} "
                     f"{result['over_first_position']:.2f}x")
    if "over_floor_after_fixed" in result:
        parts.append(f"floor {result['over_floor_after_fixed']:.2f}")
    return "; ".join(parts)


def print_generate(console, rows):
    from rich.table import Table
    from rich.text import Text

    first = rows[0]
    table = Table(title=(
        f"GPT-2 generate: tiny ({plan.GPT2['num_layers']} layers, "
        f"{plan.GPT2['num_heads']} heads, E={plan.GPT2['hidden_dim']}), "
        f"greedy, prompt {first['prompt_length']}, max_length "
        f"{first['max_length']}; as keras-hub compiles it"))
    _add_columns(table, ("backend", "attention", "tokens/s", "ms/token",
                         "x keras-hub", "tokens"),
                 left=("backend", "attention", "tokens"))
    footnotes = []
    for row in rows:
        if _ok(row):
            speed = [f"{row['tokens_per_s']:.1f}",
                     f"{1e3 / row['tokens_per_s']:.3f}"]
        else:
            speed = [_time_text(row, footnotes), ""]
        same = ("" if "same_tokens" not in row else
                "same as keras-hub" if row["same_tokens"] else
                "differ from keras-hub")
        table.add_row(row["backend"], row["label"], *speed,
                      (f"{row['over_keras_hub']:.2f}x"
                       if "over_keras_hub" in row else "-"), same)
    console.print(table)
    for number, reason in enumerate(footnotes, start=1):
        console.print(Text(f"[{number}] {reason}"), soft_wrap=True)


def print_prefill(console, rows):
    from rich.table import Table
    from rich.text import Text

    table = Table(title=(
        f"prefill: T={rows[0]['T']} through our layer's cache at "
        "cache_update_index=0 against the same forward without a cache, "
        "median ms"))
    _add_columns(table, ("backend", "w", "cache", "mode", "ms", "x no cache",
                         "path"),
                 left=("backend", "w", "cache", "mode", "path"))
    footnotes = []
    # Each window's modes in turn, the baseline above its cache.
    backends = list(dict.fromkeys(row["backend"] for row in rows))
    entries = sorted(
        ((row, mode) for row in rows
         for mode in plan.decode_modes(row["backend"]) if row.get(mode)),
        key=lambda entry: (backends.index(entry[0]["backend"]),
                           entry[0]["w"] is None,
                           plan.DECODE_MODES.index(entry[1]),
                           entry[0]["cache"] != "none"))
    previous = None
    for row, mode in entries:
        if previous is not None and row["backend"] != previous:
            table.add_section()
        previous = row["backend"]
        result = row[mode]
        table.add_row(
            row["backend"], str(_w(row["w"])), row["cache"], mode,
            _time_text(result, footnotes, scale=1e3),
            (f"{result['over_no_cache']:.2f}x"
             if "over_no_cache" in result else "-"),
            result.get("path") or "")
    console.print(table)
    for number, reason in enumerate(footnotes, start=1):
        console.print(Text(f"[{number}] {reason}"), soft_wrap=True)


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
        _add_columns(table, ("feature", "path", "fwd ms", "x plain",
                             "fwd+bwd ms", "x plain", "target"),
                     left=("feature", "path", "target"))
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
    commit = document.get("commit")
    where = f" of commit {commit[:12]}" if commit else ""
    lines = [
        f"# `{document['what']}`",
        "",
        f"{document['seconds']:.0f} s{where} on {machine['platform']} "
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

    # The matrix's cells: the small-model ones have another batch.
    cells = [cell for cell in document["cells"]
             if cell["B"] == document["config"]["batch"]]
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
    figure.suptitle("benchmarks: {mask}, B={batch}, N={num_heads}, "
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
