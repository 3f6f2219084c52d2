"""`keras-mha compare`: our layer and Keras's against a float64 reference.

The parent process starts one worker per backend (`python -m keras_mha
compare --worker`, with `KERAS_BACKEND` set), shows a progress bar while they
run and prints one table: rows are cases, columns are backends.

A worker runs every case of the matrix (`--matrix FILE`, by default
`matrices/compare.json`, shipped with the package): it builds
`keras_mha.MultiHeadAttention` with random weights drawn by NumPy (so every
backend sees the same numbers), gives `keras.layers.MultiHeadAttention` the
same weights, calls each twice (plain, which takes the fused path, and with
`return_attention_scores=True`, the explicit path) and measures both against
`reference_attention`. It prints one JSON object per line on stdout.

Error = max|y - ref| / max(1, max|ref|) over the outputs and the weights of
both calls. Tolerance: 1e-5 in float32, 1e-2 under a `mixed_*` policy.
"""

import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from keras_mha.cli.common import BACKENDS
from keras_mha.cli.common import CLIError
from keras_mha.cli.common import backend_env
from keras_mha.cli.common import backend_installed
from keras_mha.cli.common import backend_version
from keras_mha.cli.common import packaged_matrix
from keras_mha.cli.common import read_json

FLOAT32_TOLERANCE = 1e-5
MIXED_TOLERANCE = 1e-2

# Case fields and their defaults; `layer` holds the layers' arguments.
CASE_DEFAULTS = {
    "name": None,
    "batch": 2,
    "query_length": 6,
    "features": 8,
    "cross": False,  # separate `value` (and `key`); self-attention otherwise
    "key_length": None,  # S, cross only; T by default
    "value_features": None,  # cross only; `features` by default
    "key_features": None,  # cross only: a separate `key` tensor
    "constant_key": False,  # every key position gets the same input vector
    "scale": 1.0,  # inputs are standard normal times this
    "causal": False,
    "query_padding": None,  # {"left" | "right": [padded tokens per batch]}
    "value_padding": None,  # cross only; in self-attention keys are queries
    "attention_mask": None,  # probability that a (t, s) pair is allowed
    "seed": 0,
    "layer": {},
    "keras_note": None,  # why Keras may differ from the reference here
}


# ----------------------------------------------------------------- reference


def reference_attention(weights, query, value, key, allowed):
    """The layer's output and weights in float64, written plainly.

    Args:
        weights: sublayer name -> {"kernel": ..., "bias": ...} (bias optional).
        query: `(B, T, E)`; value: `(B, S, E_v)`; key: `(B, S, E_k)`.
        allowed: boolean `(B, 1, T, S)`, every mask already AND-combined.

    Returns:
        `(output (B, T, E), probabilities (B, N, T, S))`; a row with no
        allowed key has probabilities 0.
    """

    def project(x, name):
        w = weights[name]
        y = np.einsum("bte,enh->btnh", x, w["kernel"])  # (B, T, N, H)
        return y + w["bias"] if "bias" in w else y

    q = project(query, "query")  # (B, T, N, H)
    k = project(key, "key")  # (B, S, K, H)
    v = project(value, "value")  # (B, S, K, V)
    groups = q.shape[2] // k.shape[2]
    k = np.repeat(k, groups, axis=2)  # query head n reads head n // groups
    v = np.repeat(v, groups, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    logits = np.where(allowed, logits, -np.inf)
    row_max = logits.max(axis=-1, keepdims=True)
    exp = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))
    total = exp.sum(axis=-1, keepdims=True)
    probs = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
    context = np.einsum("bnts,bsnv->btnv", probs, v)  # (B, T, N, V)
    if "gate" in weights:
        context = context / (1.0 + np.exp(-project(query, "gate")))
    output = np.einsum(
        "btnv,nve->bte", context, weights["attention_output"]["kernel"]
    )
    if "bias" in weights["attention_output"]:
        output = output + weights["attention_output"]["bias"]
    return output, probs


# -------------------------------------------------------------------- matrix


def default_matrix():
    """The matrix shipped with the package, `matrices/compare.json`."""
    return packaged_matrix("compare.json")


def load_matrix(path):
    """The cases of a matrix file, defaults filled in and checked."""
    matrix = read_json(path, "matrix")
    if not isinstance(matrix, dict) or not isinstance(
        matrix.get("cases"), list
    ):
        raise CLIError(f'matrix {path} needs a "cases" list')
    given_defaults = matrix.get("defaults", {})
    unknown = sorted(set(given_defaults) - set(CASE_DEFAULTS))
    if unknown:
        raise CLIError(f"matrix {path}, defaults: unknown field(s) "
                       f"{', '.join(unknown)}")
    defaults = {**CASE_DEFAULTS, **given_defaults}
    cases, names = [], set()
    for number, given in enumerate(matrix["cases"], start=1):
        where = f"matrix {path}, case {number}"
        if not isinstance(given, dict):
            raise CLIError(f"{where}: not an object")
        unknown = sorted(set(given) - set(CASE_DEFAULTS))
        if unknown:
            raise CLIError(f"{where}: unknown field(s) {', '.join(unknown)}")
        case = {**defaults, **given}
        case["layer"] = {**defaults.get("layer", {}), **given.get("layer", {})}
        if not case["name"] or case["name"] in names:
            raise CLIError(f"{where}: needs a unique name")
        names.add(case["name"])
        for field in ("query_padding", "value_padding"):
            spec = case[field]
            if spec is not None and not (
                isinstance(spec, dict)
                and len(spec) == 1
                and set(spec) <= {"left", "right"}
                and len(next(iter(spec.values()))) == case["batch"]
            ):
                raise CLIError(
                    f'{where}: {field} must look like {{"left": [0, 3]}}, '
                    "one count per batch element"
                )
        if not case["cross"] and any(
            case[field] is not None
            for field in ("key_length", "value_features", "key_features",
                          "value_padding")
        ):
            raise CLIError(f"{where}: key/value fields need \"cross\": true")
        if case["constant_key"] and case["key_features"] is None:
            raise CLIError(f"{where}: constant_key needs key_features")
        cases.append(case)
    return cases


def tolerance(case):
    policy = str(case["layer"].get("dtype") or "float32")
    return MIXED_TOLERANCE if policy.startswith("mixed") else FLOAT32_TOLERANCE


def _padding_mask(spec, batch, length):
    """`{"left": [0, 3]}` -> `(B, L)` boolean, True for real tokens."""
    if spec is None:
        return None
    mask = np.ones((batch, length), dtype=bool)
    (side, counts), = spec.items()
    for b, count in enumerate(counts):
        if side == "left":
            mask[b, :count] = False
        else:
            mask[b, length - count :] = False
    return mask


def make_inputs(case, rng):
    """The case's inputs as float32 arrays and masks (None where unused)."""
    batch, t_len, scale = case["batch"], case["query_length"], case["scale"]
    s_len = case["key_length"] or t_len

    def normal(length, features):
        x = rng.standard_normal((batch, length, features)) * scale
        return x.astype("float32")

    inputs = {"query": normal(t_len, case["features"]), "value": None,
              "key": None, "attention_mask": None}
    if case["cross"]:
        inputs["value"] = normal(s_len, case["value_features"]
                                 or case["features"])
        if case["constant_key"]:
            key = normal(1, case["key_features"])
            inputs["key"] = np.repeat(key, s_len, axis=1)
        elif case["key_features"] is not None:
            inputs["key"] = normal(s_len, case["key_features"])
    inputs["query_mask"] = _padding_mask(case["query_padding"], batch, t_len)
    inputs["value_mask"] = _padding_mask(case["value_padding"], batch, s_len)
    # Padded tokens are zero vectors, so `keras.layers.Masking` finds them.
    for name, mask in (("query", "query_mask"), ("value", "value_mask"),
                       ("key", "value_mask")):
        if inputs[name] is not None and inputs[mask] is not None:
            inputs[name][~inputs[mask]] = 0.0
    if case["attention_mask"] is not None:
        inputs["attention_mask"] = (
            rng.random((batch, t_len, s_len)) < case["attention_mask"]
        )
    return inputs


def allowed_mask(case, inputs):
    """Every mask source, AND-combined: `(B, 1, T, S)` boolean."""
    query_mask = inputs["query_mask"]
    value_mask = inputs["value_mask"]
    if not case["cross"]:
        value_mask = query_mask  # self-attention: the keys are the queries
    batch, t_len = inputs["query"].shape[:2]
    s_len = t_len if inputs["value"] is None else inputs["value"].shape[1]
    allowed = np.ones((batch, 1, t_len, s_len), dtype=bool)
    t = np.arange(t_len)[:, None]
    s = np.arange(s_len)[None, :]
    if case["causal"]:
        allowed &= s <= t
    window = case["layer"].get("sliding_window")
    if window is not None:
        allowed &= np.abs(t - s) < window
    if query_mask is not None:
        allowed &= query_mask[:, None, :, None]
    if value_mask is not None:
        allowed &= value_mask[:, None, None, :]
    if inputs["attention_mask"] is not None:
        allowed &= inputs["attention_mask"][:, None]
    return allowed


# -------------------------------------------------------------------- worker


def _random_weights(layer, rng):
    """Fresh weights for `layer`, and the same by sublayer name (float64)."""
    arrays, named = [], {}
    for variable in layer.weights:
        sublayer, kind = variable.path.split("/")[-2:]
        shape = tuple(variable.shape)
        if kind == "kernel":
            fan_in = math.prod(shape[:2] if sublayer == "attention_output"
                               else shape[:1])
            array = rng.normal(0.0, 1.0 / math.sqrt(fan_in), shape)
        else:
            array = rng.normal(0.0, 0.5, shape)
        array = array.astype("float32")
        arrays.append(array)
        named.setdefault(sublayer, {})[kind] = array.astype("float64")
    return arrays, named


def _error(result, expected):
    import keras

    result = np.asarray(keras.ops.convert_to_numpy(result), dtype="float64")
    if result.shape != expected.shape:
        raise ValueError(f"shape {result.shape}, expected {expected.shape}")
    scale = max(1.0, float(np.max(np.abs(expected))))
    return float(np.max(np.abs(result - expected))) / scale


def _measure(layer, case, inputs, expected, expected_probs):
    """Errors of both calls of `layer`, or the exception it raised."""
    import keras

    def tensor(name, mask_name):
        if inputs[name] is None:
            return None
        x = keras.ops.convert_to_tensor(inputs[name])
        if mask_name is not None and inputs[mask_name] is not None:
            # A Keras mask on the tensor, the way models pass padding.
            x = keras.layers.Masking(mask_value=0.0)(x)
        return x

    def call(**kwargs):
        # Fresh tensors each call: Keras's layer clears its inputs' masks.
        query = tensor("query", "query_mask")
        value = tensor("value", "value_mask") if case["cross"] else query
        return layer(
            query,
            value,
            key=tensor("key", "value_mask"),
            attention_mask=tensor("attention_mask", None),
            use_causal_mask=case["causal"],
            **kwargs,
        )

    errors = {}
    try:
        errors["output"] = _error(call(), expected)
        output, probs = call(return_attention_scores=True)
        errors["output_with_scores"] = _error(output, expected)
        errors["scores"] = _error(probs, expected_probs)
    except Exception as error:
        return {**_raised(error), "calls": errors}
    values = list(errors.values())
    # `max` is order-dependent with NaN; any NaN makes the whole case NaN.
    worst = math.nan if any(map(math.isnan, values)) else max(values)
    return {"error": worst, "calls": errors}


def _raised(error):
    """An outcome for a layer that raised: infinitely wrong, and why."""
    message = str(error).strip().splitlines()
    return {
        "error": math.inf,
        "exception": type(error).__name__,
        "message": message[0][:200] if message else "",
    }


def _unaccepted(layer_class, kwargs):
    parameters = inspect.signature(layer_class.__init__).parameters
    return sorted(name for name in kwargs
                  if name != "dtype" and name not in parameters)


def run_case(case):
    """One case on the active backend: a JSON-ready result."""
    import keras

    from keras_mha import MultiHeadAttention

    result = {"case": case["name"], "tolerance": tolerance(case)}
    started = time.perf_counter()
    rng = np.random.default_rng(case["seed"])
    inputs = make_inputs(case, rng)
    # Weights come from NumPy; zeros skip compiling JAX's random kernels.
    kwargs = {"kernel_initializer": "zeros", "bias_initializer": "zeros",
              **case["layer"]}
    missing = _unaccepted(MultiHeadAttention, kwargs)
    if missing:
        result["skipped"] = f"the layer has no {', '.join(missing)}"
        return result
    shapes = [inputs["query"].shape,
              (inputs["value"] if case["cross"] else inputs["query"]).shape]
    if inputs["key"] is not None:
        shapes.append(inputs["key"].shape)
    try:
        ours = MultiHeadAttention(**kwargs)
        ours.build(*shapes)
        arrays, weights = _random_weights(ours, rng)
        ours.set_weights(arrays)
    except Exception as error:
        result["ours"] = _raised(error)
        return result

    query = inputs["query"].astype("float64")
    value = query if not case["cross"] else inputs["value"].astype("float64")
    key = value if inputs["key"] is None else inputs["key"].astype("float64")
    expected, expected_probs = reference_attention(
        weights, query, value, key, allowed_mask(case, inputs)
    )
    result["ours"] = _measure(ours, case, inputs, expected, expected_probs)

    missing = _unaccepted(keras.layers.MultiHeadAttention, kwargs)
    if missing:
        result["keras"] = {
            "skipped": "keras.layers.MultiHeadAttention has no "
            + ", ".join(missing)
        }
    else:
        try:
            theirs = keras.layers.MultiHeadAttention(**kwargs)
            theirs.build(*shapes)
            theirs.set_weights(ours.get_weights())
        except Exception as error:
            result["keras"] = _raised(error)
        else:
            result["keras"] = _measure(
                theirs, case, inputs, expected, expected_probs
            )
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def _emit(record):
    print(json.dumps(_strings_for_nonfinite(record)), flush=True)


def _strings_for_nonfinite(value):
    """NaN and infinity are not JSON: write them as "nan" / "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strings_for_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strings_for_nonfinite(v) for v in value]
    return value


def worker(matrix_path):
    """`compare --worker`: runs the matrix, one JSON line per case."""
    import keras

    cases = load_matrix(matrix_path or default_matrix())
    backend = keras.backend.backend()
    _emit({"backend": backend, "version": backend_version(backend),
           "keras": keras.__version__, "cases": len(cases)})
    for case in cases:
        _emit(run_case(case))
    return 0


# -------------------------------------------------------------------- parent


def _as_float(value):
    return float(value) if isinstance(value, str) else value


def _within(outcome, limit):
    """Whether a measured outcome (ours or Keras's) is within `limit`."""
    error = _as_float(outcome.get("error", math.inf))
    return error is not None and math.isfinite(error) and error <= limit


def _start_worker(backend, matrix_path):
    """A worker process; `matrix_path` `None` runs the packaged matrix."""
    stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8",
                                    errors="replace")
    env = backend_env(backend)
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(
        [sys.executable, "-m", "keras_mha", "compare", "--worker",
         *([] if matrix_path is None else ["--matrix", matrix_path])],
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
        text=True,
        encoding="utf-8",
    )
    return process, stderr


def _collect(backend, matrix_path, progress, task):
    """Runs one worker to the end; returns its results for the JSON file."""
    process, stderr = _start_worker(backend, matrix_path)
    results = {"backend": backend, "cases": {}}
    try:
        for line in process.stdout:
            line = line.strip()
            try:
                record = json.loads(line)
            except ValueError:
                continue  # something else printed to stdout
            if not isinstance(record, dict):
                continue
            if "case" in record:
                results["cases"][record["case"]] = record
                progress.advance(task)
            else:
                results.update(version=record.get("version"),
                               keras=record.get("keras"))
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode != 0:
        stderr.seek(0)
        lines = [line.strip() for line in stderr.read().splitlines()
                 if line.strip()]
        ours = [line for line in lines if line.startswith("keras-mha: error:")]
        last = (ours or lines or ["no output"])[-1]
        results["failure"] = (
            f"worker exited with code {process.returncode}: {last}"
        )
    stderr.close()
    return results


def run(backends=None, matrix=None, json_path=None):
    """`keras-mha compare`: returns the exit code."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress,
                               TextColumn, TimeElapsedColumn)

    if backends is None:
        backends = [b for b in BACKENDS if backend_installed(b)]
    for backend in backends:
        if not backend_installed(backend):
            raise CLIError(f"backend {backend!r} is not installed "
                           f'(pip install "keras-mha[{backend}]")')
    if matrix is not None:
        matrix = os.path.abspath(matrix)
    cases = load_matrix(matrix or default_matrix())  # here, not per worker
    if json_path is not None:
        _check_writable(json_path)

    all_results = {}
    stderr_console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description:>10}"), BarColumn(),
        MofNCompleteColumn(), TimeElapsedColumn(),
        console=stderr_console,
    ) as progress:
        tasks = {b: progress.add_task(b, total=len(cases), start=False)
                 for b in backends}
        for backend in backends:
            progress.start_task(tasks[backend])
            started = time.perf_counter()
            all_results[backend] = _collect(backend, matrix, progress,
                                            tasks[backend])
            all_results[backend]["seconds"] = round(
                time.perf_counter() - started, 1)
            progress.stop_task(tasks[backend])

    failed = report(cases, backends, all_results)
    if json_path is not None:
        document = {
            "matrix": str(matrix or default_matrix()),
            "tolerance": {"float32": FLOAT32_TOLERANCE,
                          "mixed": MIXED_TOLERANCE},
            "error": "max|y - ref| / max(1, max|ref|)",
            "failed": failed,
            "backends": all_results,
        }
        try:
            with open(json_path, "w", encoding="utf-8") as file:
                json.dump(_strings_for_nonfinite(document), file, indent=2,
                          ensure_ascii=False)
        except OSError as error:
            raise CLIError(f"cannot write {json_path}: {error.strerror}")
    return 1 if failed else 0


def _check_writable(path):
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise CLIError(f"cannot write {path}: {folder} is not a writable "
                       "folder")


def _keras_reason(case, outcome, footnotes):
    """The footnote number explaining why Keras differs here."""
    if "skipped" in outcome:
        reason = outcome["skipped"]
    elif "exception" in outcome:
        raised = f"Keras raised {outcome['exception']}"
        if case["keras_note"]:
            reason = f"{case['keras_note']} ({raised})"
        else:
            reason = f"{raised}: {outcome.get('message', '')}".rstrip(": ")
    else:
        reason = case["keras_note"] or "Keras differs from the reference " \
            "(no known reason)"
    if reason not in footnotes:
        footnotes.append(reason)
    return footnotes.index(reason) + 1


def _format(error):
    error = _as_float(error)
    return "nan" if error is None or math.isnan(error) else f"{error:.1e}"


def report(cases, backends, all_results):
    """Prints the table and footnotes; returns whether any of ours failed."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 160)
    console.print(
        "Error vs the float64 reference, max|y - ref| / max(1, max|ref|), "
        f"of keras_mha (and of Keras where it differs); tolerance "
        f"{FLOAT32_TOLERANCE:g} in float32, {MIXED_TOLERANCE:g} in mixed "
        "precision.",
        soft_wrap=True,
    )
    table = Table()
    table.add_column("case")
    for backend in backends:
        version = all_results[backend].get("version")
        table.add_column(f"{backend} {version}" if version else backend)
    footnotes, failed = [], False
    for case in cases:
        row = [case["name"]]
        limit = tolerance(case)
        for backend in backends:
            result = all_results[backend]["cases"].get(case["name"])
            if result is None:
                row.append(Text("not run", style="red"))
                failed = True
                continue
            if "skipped" in result:
                note = _keras_reason(case, result, footnotes)
                row.append(Text(f"skipped [{note}]"))
                continue
            ours = result["ours"]
            if _within(ours, limit):
                cell = Text(_format(ours["error"]), style="green")
            else:
                failed = True
                what = ours.get("exception") or _format(ours["error"])
                cell = Text(f"FAIL {what}", style="bold red")
            theirs = result.get("keras", {})
            if "skipped" in theirs or not _within(theirs, limit):
                note = _keras_reason(case, theirs, footnotes)
                if "skipped" in theirs:
                    shown = "n/a"
                else:
                    shown = theirs.get("exception") or _format(theirs["error"])
                cell.append(f"\nkeras {shown} [{note}]", style="yellow")
            row.append(cell)
        table.add_row(*row)
    console.print(table)
    for number, reason in enumerate(footnotes, start=1):
        console.print(Text(f"[{number}] {reason}"))
    for backend in backends:
        if "failure" in all_results[backend]:
            failed = True
            console.print(Text(f"{backend}: {all_results[backend]['failure']}",
                               style="bold red"))
    timing = ", ".join(f"{b} {all_results[b]['seconds']}s" for b in backends)
    console.print(f"time per backend, start-up included: {timing}")
    if failed:
        console.print(Text("FAILED: some of our errors exceed the tolerance",
                           style="bold red"))
    else:
        console.print(Text("OK: all of our errors are within the tolerance",
                           style="green"))
    return failed
