"""What `python -m benchmarks` measures: the configuration, the units, the FLOPs
and the caps. Nothing here touches a backend.

A *cell* is one (backend, B, T, w, causal, implementation); it is measured
in one or two *units*, one per mode (`forward`, `forward_backward`). The
matrix's cells have its `batch`; the `small` section adds small-model cells
(B = 8, T in {128, 256, 512}, with and without a small window; keras, ours
and ours_core). The yardsticks are a float32 square `matmul` (`matmul_size`,
for information) and a `projection` per (B, T) of the cells, the matmul
`(B*T, E) @ (E, N*H)` of each of the layer's four projections, whose rate
sets the roofline and the "% matmul" of every cell at that B and T. A `fit`
unit is one `train_on_batch` step of a small causal transformer (the `fit`
section) with our layer or Keras's in its blocks. A *feature cell* is one
(backend, feature) of the `features` section: our
whole layer at one T and w with one feature of current models on (RoPE,
soft-cap, sinks, ALiBi, segment ids), or none (`plain`, the baseline of
its ratios); it has a unit per mode too. The `decode` section has four
kinds of units (`decode_units`): `decode`, one token at position p
through a cache (ours or keras-hub's layer, a full or rolling cache,
`eager` or `compiled`); `floor`, reading the cache's valid slots once;
`generate`, a tiny keras-hub GPT-2's `generate`; `prefill`, a prompt
through the cache at index 0 or the same forward without one. Each unit
ends with a status: `ok`, `skipped`, `out of memory`, `timed out`, `error`,
`n/a` or `not run` (interrupted), and every one but `ok` carries a reason.
Units are never dropped.

Caps (`cap_reason`): a unit is skipped without running when its predicted
time per call exceeds `time_cap_s` or its predicted peak memory exceeds the
memory cap. Predictions extrapolate the same series measured at the longest
shorter T, `x * (T / T_prev) ** e`: for the time `e = 2` for dense
algorithms and `e = 1` for banded ones; for the memory the same, unless two
shorter T were measured, then the growth between them (between 1 and the
time's exponent: a dense algorithm may hold O(T) memory). Before any
measurement the memory is the analytic size of the scores,
`B*N*T*S*4 bytes * dense_bytes_factor` (banded: `S` = the band's span),
and the time unknown. The time cap spares our whole layer's forward
(`time_capped`): the issues ask it to complete at every T, and the runner's
wall clock still stops a call that hangs. A series that was skipped, ran
out of memory or timed out at some T is skipped at every longer T.
"""

import math
import os

import numpy as np

from keras_mha.cli.common import CLIError
from keras_mha.cli.common import read_json

BENCH_BACKENDS = ("tensorflow", "jax", "torch")
MODES = ("forward", "forward_backward")
# `native` is each backend's own attention kernel, where it has one.
NATIVE = {"torch": "flex_attention", "jax": "jax_dpa"}
IMPLEMENTATIONS = ("keras", "ours", "ours_core", "native")
# Whole layer (projections + attention) or attention core (projected q,k,v).
SCOPE = {"keras": "layer", "ours": "layer", "ours_core": "core",
         "flex_attention": "core", "jax_dpa": "core"}
LABELS = {"keras": "keras", "ours": "ours", "ours_core": "ours core",
          "flex_attention": "flex_attention", "jax_dpa": "jax.nn.dpa"}
# The `fit` step: a small causal transformer with our layer, then with
# Keras's, in its blocks.
FIT_IMPLS = ("ours", "keras")
# The layers of a small-model cell or one without a window, timed
# alternately (`worker.py`).
PAIRED_IMPLS = ("keras", "ours")
# Feature cells: our layer with one feature on; `plain` is the layer
# without any, the baseline of every ratio (see `worker.feature_arguments`).
FEATURES = ("plain", "rope", "soft_cap", "sinks", "alibi", "segments")
FEATURE_LABELS = {"plain": "plain", "rope": "RoPE", "soft_cap": "soft-cap",
                  "sinks": "sinks", "alibi": "ALiBi",
                  "segments": "segment ids"}
# Decode cells: `keras_mha.MultiHeadAttention` with an in-place cache
# (`init_cache(..., in_place=True)`: `ours`), with a cache the caller owns
# (the default: `ours_default`, eager steps in the full caches at the
# first position), keras-hub's `CachedMultiHeadAttention` with its own
# (`(B, 2, S, N, H)`, a causal `attention_mask`), and the floor: reading
# the valid cache slots once.
DECODE_IMPLS = ("ours", "keras_hub", "ours_default")
DECODE_LABELS = {"ours": "ours (in place)", "keras_hub": "keras-hub",
                 "ours_default": "ours (default)", "read": "read (floor)"}
# The attentions of the `generate` cells.
GENERATE_IMPLS = ("ours", "keras_hub")
# `compiled`: `jax.jit` with the cache donated, `tf.function(jit_compile=
# True)`; torch runs eagerly only.
DECODE_MODES = ("eager", "compiled")
COMPILED_DECODE_BACKENDS = ("jax", "tensorflow")
# The fixed cost of a step: ours at this position, in the same cache.
FIXED_POSITION = 1
# The tiny keras-hub GPT-2 of the `generate` units.
GPT2 = {"vocabulary_size": 50, "num_layers": 2, "num_heads": 2,
        "hidden_dim": 64, "intermediate_dim": 128, "max_sequence_length": 256}

OK = "ok"
SKIPPED = "skipped"
OUT_OF_MEMORY = "out of memory"
TIMED_OUT = "timed out"
ERROR = "error"
NOT_AVAILABLE = "n/a"
NOT_RUN = "not run"
# A unit in one of these states makes the same unit at longer T skip too.
GAVE_UP = (SKIPPED, OUT_OF_MEMORY, TIMED_OUT)

FLOPS_DEFINITION = (
    "useful FLOPs, forward: attention core = 4*B*N*H*pairs (QK^T and PV, "
    "2*H each per allowed (query, key) pair; pairs = sum over queries of "
    "the number of keys the causal/window mask allows); whole layer = core "
    "+ 4 projections of 2*B*T*E*(N*H) each (query, key, value, output). "
    "forward+backward counts 3x the forward FLOPs (each matmul has two "
    "matmuls in its backward). Masked-out pairs, softmax and padding are "
    "not counted. Rate = useful FLOPs / median time; projection rate = the "
    "float32 rate of one (B*T, E) @ (E, N*H) matmul, the shape of each "
    "projection, timed in the same worker at the cell's B and T (ours: "
    "after each of its timed calls); '% of "
    "matmul' = rate / projection rate; roofline = whole-layer useful FLOPs "
    "/ projection rate (the layer's time if attention ran as fast as its "
    "projections)."
)

_DEFAULTS = {
    "backends": list(BENCH_BACKENDS),
    "batch": 1,
    "num_heads": 8,
    "key_dim": 64,
    "lengths": [1024, 4096, 16384, 65536],
    "windows": [None, 128, 512],
    "causal": [True],
    "implementations": list(IMPLEMENTATIONS),
    "modes": list(MODES),
    "repeats": 5,
    "time_cap_s": 60.0,
    "compile_allowance_s": 180.0,
    "memory_cap_gib": 16.0,
    "dense_bytes_factor": 3.0,
    "matmul_size": 2048,
    "matmul_repeats": 10,
    "decode": {"window": 512, "full_length": 65536, "short_length": 2048,
               "positions": [1024, 16384, 65535], "repeats": 10,
               "generate": {"prompt_length": 8, "max_length": 128,
                            "repeats": 30},
               "prefill": {"length": 8192, "window": 128, "repeats": 3}},
    "features": {"length": 16384, "window": 128, "causal": True,
                 "features": list(FEATURES), "modes": list(MODES),
                 "soft_cap": 50.0, "segments": 4},
    "small": {"batch": 8, "lengths": [128, 256, 512], "windows": [None, 64],
              "implementations": ["keras", "ours", "ours_core"]},
    "fit": {"batch": 1, "length": 4096, "window": 128, "layers": 2,
            "warmup": 3, "repeats": 3},
}
_PROFILES = ("quick", "long")


# ------------------------------------------------------------ configuration


def default_config_path():
    """The default matrix, `benchmarks/bench.json`."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "bench.json")


def load_config(path=None, profile=None, overrides=None):
    """The checked configuration: the file (`benchmarks/bench.json` by
    default; fields it leaves out take `_DEFAULTS`), then the profile
    (`quick` or `long`, an object of the file), then command-line
    overrides."""
    path = path or default_config_path()
    given = read_json(path, "config")
    where = f"config {path}"
    if not isinstance(given, dict):
        raise CLIError(f"{where}: not a JSON object")
    unknown = sorted(set(given) - set(_DEFAULTS) - set(_PROFILES))
    if unknown:
        raise CLIError(f"{where}: unknown field(s) {', '.join(unknown)}")
    config = _merge(_DEFAULTS, {k: v for k, v in given.items()
                                if k not in _PROFILES})
    if profile is not None:
        changes = given.get(profile)
        if not isinstance(changes, dict):
            raise CLIError(f"{where}: no {profile!r} object for --{profile}")
        unknown = sorted(set(changes) - set(_DEFAULTS))
        if unknown:
            raise CLIError(f"{where}, {profile}: unknown field(s) "
                           f"{', '.join(unknown)}")
        config = _merge(config, changes)
    config = _merge(config, {k: v for k, v in (overrides or {}).items()
                             if v is not None})
    _check(config, where)
    config["source"] = os.path.abspath(path)
    config["profile"] = profile or "default"
    return config


def _merge(base, changes):
    """`base` with `changes`; an object in both is merged field by field, at
    every depth."""
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merge(base[key], value)
        else:
            merged[key] = value
    return merged


def _positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and value > 0)


def _check(config, where):
    def fail(message):
        raise CLIError(f"{where}: {message}")

    for name in ("batch", "num_heads", "key_dim", "repeats", "matmul_size",
                 "matmul_repeats"):
        if not _positive_int(config[name]):
            fail(f"{name} must be a positive integer, got {config[name]!r}")
    for name in ("time_cap_s", "compile_allowance_s", "memory_cap_gib",
                 "dense_bytes_factor"):
        if not _positive_number(config[name]):
            fail(f"{name} must be a positive number, got {config[name]!r}")
    backends = config["backends"]
    if not isinstance(backends, list) or not backends:
        fail("backends must be a non-empty list")
    for backend in backends:
        if backend == "numpy":
            fail("the numpy backend is not benchmarked (no compiler, no "
                 f"autodiff); choose from {', '.join(BENCH_BACKENDS)}")
        if backend not in BENCH_BACKENDS:
            fail(f"unknown backend {backend!r}; choose from "
                 f"{', '.join(BENCH_BACKENDS)}")
    _check_cells(config, fail)
    causal = config["causal"]
    if not isinstance(causal, list) or not causal or not all(
        isinstance(c, bool) for c in causal
    ):
        fail(f"causal must be a list of true/false, got {causal!r}")
    modes = config["modes"]
    if not isinstance(modes, list) or not modes or not set(modes) <= set(
        MODES
    ):
        fail(f"modes must be a list drawn from {', '.join(MODES)}, got "
             f"{modes!r}")
    if config["decode"] is not None:
        config["decode"] = _check_decode(config["decode"], fail)
    if config["features"] is not None:
        config["features"] = _check_features(config["features"], fail)
    if config["small"] is not None:
        config["small"] = _check_small(config["small"], fail)
    if config["fit"] is not None:
        config["fit"] = _check_fit(config["fit"], fail)
    # Keep the order given, drop repeats.
    for name in ("backends", "causal", "modes"):
        config[name] = list(dict.fromkeys(config[name]))


def _check_cells(section, fail, where=""):
    """Checks a section's `lengths`, `windows` and `implementations` (the
    matrix's, the small cells'); leaves them without repeats, the lengths
    sorted (caps extrapolate upwards)."""
    lengths = section["lengths"]
    if not isinstance(lengths, list) or not lengths or not all(
        _positive_int(t) for t in lengths
    ):
        fail(f"{where}lengths must be a list of positive integers, got "
             f"{lengths!r}")
    windows = section["windows"]
    if not isinstance(windows, list) or not windows or not all(
        w is None or _positive_int(w) for w in windows
    ):
        fail(f"{where}windows must be a list of positive integers or null, "
             f"got {windows!r}")
    names = section["implementations"]
    if not isinstance(names, list) or not names or not set(names) <= set(
        IMPLEMENTATIONS
    ):
        fail(f"{where}implementations must be a list drawn from "
             f"{', '.join(IMPLEMENTATIONS)}, got {names!r}")
    section["lengths"] = sorted(set(lengths))
    for name in ("windows", "implementations"):
        section[name] = list(dict.fromkeys(section[name]))


def _check_small(small, fail):
    """The checked `small` section, a new object: the small-model cells
    (its batch, lengths, windows and implementations; the matrix's causal
    settings and modes)."""
    fields = {"batch", "lengths", "windows", "implementations"}
    if not isinstance(small, dict) or set(small) != fields:
        fail(f"small must be null or an object with "
             f"{', '.join(sorted(fields))}")
    if not _positive_int(small["batch"]):
        fail(f"small: batch must be a positive integer, got "
             f"{small['batch']!r}")
    small = dict(small)
    _check_cells(small, fail, "small: ")
    return small


def _check_fit(fit, fail):
    """The checked `fit` section, a new object."""
    fields = {"batch", "length", "window", "layers", "warmup", "repeats"}
    if not isinstance(fit, dict) or set(fit) != fields:
        fail(f"fit must be null or an object with "
             f"{', '.join(sorted(fields))}")
    if not (all(_positive_int(fit[name])
                for name in fields - {"window"})
            and (fit["window"] is None or _positive_int(fit["window"]))):
        fail("fit: batch, length, layers, warmup and repeats must be "
             "positive integers and window one or null")
    return dict(fit)


def _check_decode(decode, fail):
    """The checked `decode` section, a new object, its positions sorted
    without repeats."""
    fields = {"window", "full_length", "short_length", "positions",
              "repeats", "generate", "prefill"}
    if not isinstance(decode, dict) or set(decode) != fields:
        fail("decode must be null or an object with "
             f"{', '.join(sorted(fields))}")
    positions = decode["positions"]
    if not (all(_positive_int(decode[name]) for name in (
                "window", "full_length", "short_length", "repeats"))
            and isinstance(positions, list) and positions
            and all(_positive_int(p) for p in positions)):
        fail("decode: window, full_length, short_length and repeats must be "
             "positive integers and positions a list of them")
    positions = sorted(set(positions))
    if decode["short_length"] >= decode["full_length"]:
        fail("decode: short_length must be < full_length (the target "
             "compares the two caches)")
    if positions[-1] >= decode["full_length"]:
        fail(f"decode: every position must be < full_length (index + 1 <= "
             f"L), got {positions[-1]}")
    if positions[0] >= decode["short_length"]:
        fail(f"decode: the first position must be < short_length (the "
             f"short cache is compared there), got {positions[0]}")
    generate, prefill = decode["generate"], decode["prefill"]
    if not isinstance(generate, dict) or set(generate) != {
        "prompt_length", "max_length", "repeats"
    } or not all(_positive_int(v) for v in generate.values()):
        fail("decode: generate must be an object of positive integers "
             "prompt_length, max_length and repeats")
    if not generate["prompt_length"] < generate["max_length"] <= GPT2[
        "max_sequence_length"
    ]:
        fail(f"decode: generate needs prompt_length < max_length <= "
             f"{GPT2['max_sequence_length']} (the GPT-2's longest sequence)")
    if not isinstance(prefill, dict) or set(prefill) != {
        "length", "window", "repeats"
    } or not all(_positive_int(v) for v in prefill.values()):
        fail("decode: prefill must be an object of positive integers "
             "length, window and repeats")
    return {**decode, "positions": positions, "generate": dict(generate),
            "prefill": dict(prefill)}


def _check_features(features, fail):
    """The checked `features` section, a new object (the defaults' stays
    as it is), its lists without repeats."""
    fields = {"length", "window", "causal", "features", "modes", "soft_cap",
              "segments"}
    if not isinstance(features, dict) or set(features) != fields:
        fail("features must be null or an object with "
             f"{', '.join(sorted(fields))}")
    if not (_positive_int(features["length"])
            and (features["window"] is None
                 or _positive_int(features["window"]))
            and isinstance(features["causal"], bool)
            and _positive_number(features["soft_cap"])
            and _positive_int(features["segments"])):
        fail("features: length and segments must be positive integers, "
             "window one or null, causal true or false and soft_cap a "
             "positive number")
    for name, allowed in (("features", FEATURES), ("modes", MODES)):
        values = features[name]
        if not isinstance(values, list) or not values or not set(
            values
        ) <= set(allowed):
            fail(f"features: {name} must be a list drawn from "
                 f"{', '.join(allowed)}, got {values!r}")
    if "plain" not in features["features"]:
        fail("features: features must include plain (the baseline of "
             "every ratio)")
    if features["segments"] > features["length"]:
        fail("features: segments must be at most length (each segment "
             "needs a token)")
    return {**features, "features": list(dict.fromkeys(features["features"])),
            "modes": list(dict.fromkeys(features["modes"]))}


def parse_list(text, what, item):
    """`"1024,4096"` -> `[1024, 4096]` through `item`, one clear error."""
    if text is None:
        return None
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            values.append(item(part))
        except ValueError:
            raise CLIError(f"--{what}: cannot read {part!r}")
    if not values:
        raise CLIError(f"--{what}: nothing given")
    return values


def window_item(text):
    """`none` -> `None`, else a positive integer."""
    if text.lower() in ("none", "null", "off"):
        return None
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def length_item(text):
    text = text.lower()
    scale = 1
    if text.endswith("k"):
        text, scale = text[:-1], 1024
    value = int(text) * scale
    if value <= 0:
        raise ValueError(text)
    return value


# -------------------------------------------------------------------- units


def implementations_for(backend, names):
    """The implementations of `names` (a section's `implementations`)
    measured on `backend`, in that order."""
    found = []
    for name in names:
        if name == "native":
            if backend in NATIVE:
                found.append(NATIVE[backend])
        else:
            found.append(name)
    return found


def unwindowed(cell):
    """Whether a cell (or unit) has no window, or one of at least its T:
    where ours must keep up with Keras (the no-regression target)."""
    return cell["w"] is None or cell["w"] >= cell["T"]


def unit_id(unit):
    kind, backend = unit["kind"], unit["backend"]
    if kind == "matmul":
        return f"{backend}|matmul {unit['size']}"
    if kind == "projection":
        return f"{backend}|projection B={unit['B']} T={unit['T']}"
    if kind == "fit":
        return (f"{backend}|fit {unit['impl']} B={unit['B']} T={unit['T']} "
                f"w={unit['w']} layers={unit['layers']}")
    if kind == "decode":
        return (f"{backend}|decode {unit['impl']} {unit['cache']} "
                f"L={unit['slots']} p={unit['position']} {unit['mode']}")
    if kind == "floor":
        return (f"{backend}|floor {unit['cache']} L={unit['slots']} "
                f"reads={unit['reads']} {unit['mode']}")
    if kind == "generate":
        return f"{backend}|generate {unit['impl']}"
    if kind == "prefill":
        return (f"{backend}|prefill {unit['cache']} T={unit['T']} "
                f"w={unit['w']} {unit['mode']}")
    causal = "causal" if unit["causal"] else "bidirectional"
    if kind == "feature":
        return (f"{backend}|feature {unit['feature']}|T={unit['T']}|"
                f"w={unit['w']}|{causal}|{unit['mode']}")
    return (f"{backend}|B={unit['B']}|T={unit['T']}|w={unit['w']}|{causal}|"
            f"{unit['impl']}|{unit['mode']}")


def series_key(unit):
    """Units of one series differ only in T; caps extrapolate along it."""
    return (unit["backend"], unit["B"], unit["impl"], unit["w"],
            unit["causal"], unit["mode"])


def cell_sections(config):
    """`[(B, lengths, windows, implementations)]`: the matrix's cells, then
    the small-model cells where the config has them."""
    sections = [(config["batch"], config["lengths"], config["windows"],
                 config["implementations"])]
    small = config.get("small")
    if small is not None:
        sections.append((small["batch"], small["lengths"], small["windows"],
                         small["implementations"]))
    return sections


def units_for(backend, config, only=None):
    """Every unit of one backend, in the order a worker runs them.

    The yardsticks come first: the square matmul, then a projection per
    (B, T) of the cells, in increasing B*T. Attention units follow, the
    matrix's then the small-model cells', each in increasing T (so each
    unit's caps can be predicted from the shorter ones), the two modes of a
    cell next to each other (they share one built layer); a small cell that
    is also one of the matrix's is measured once. Then the `fit` steps
    (ours, then Keras's), the feature cells, `plain` first; the decode
    section last (`decode_units`). A section set to `None` (`small`, `fit`,
    `decode`, `features`) has no units; `only` (`"features"` or `"decode"`)
    keeps that section alone.
    """
    units = []
    if only is None:
        units.append({"kind": "matmul", "backend": backend,
                      "size": config["matmul_size"],
                      "repeats": config["matmul_repeats"]})
        sizes = sorted({(batch, length) for batch, lengths, _, _
                        in cell_sections(config) for length in lengths},
                       key=lambda size: (size[0] * size[1], size))
        for batch, length in sizes:
            units.append({"kind": "projection", "backend": backend,
                          "B": batch, "T": length,
                          "shape": projection_shape(config, batch, length),
                          "repeats": config["matmul_repeats"]})
        for batch, lengths, windows, names in cell_sections(config):
            for length in lengths:
                for window in windows:
                    for causal in config["causal"]:
                        for impl in implementations_for(backend, names):
                            for mode in config["modes"]:
                                units.append({
                                    "kind": "attention", "backend": backend,
                                    "B": batch, "T": length, "w": window,
                                    "causal": causal, "impl": impl,
                                    "mode": mode,
                                })
        fit = config.get("fit")
        if fit is not None:
            for impl in FIT_IMPLS:
                units.append({"kind": "fit", "backend": backend,
                              "impl": impl, "B": fit["batch"],
                              "T": fit["length"], "w": fit["window"],
                              "layers": fit["layers"],
                              "warmup": fit["warmup"],
                              "repeats": fit["repeats"]})
    spec = config["features"]
    if spec is not None and only in (None, "features"):
        for feature in spec["features"]:
            for mode in spec["modes"]:
                units.append({
                    "kind": "feature", "backend": backend,
                    "B": config["batch"], "T": spec["length"],
                    "w": spec["window"], "causal": spec["causal"],
                    "impl": "ours", "feature": feature, "mode": mode,
                })
    if config["decode"] is not None and only in (None, "decode"):
        units += decode_units(backend, config["decode"])
    unique = {}
    for unit in units:
        unit["id"] = unit_id(unit)
        unique.setdefault(unit["id"], unit)
    return list(unique.values())


def decode_modes(backend):
    """The modes of the decode section's units on `backend`."""
    return [mode for mode in DECODE_MODES
            if mode == "eager" or backend in COMPILED_DECODE_BACKENDS]


def fast_mode(backend):
    """The mode the floors are read in and the floor targets compare:
    `compiled` where there is one, else `eager` (torch)."""
    return decode_modes(backend)[-1]


def decode_caches(spec, impl):
    """`[(cache, slots, positions)]`: the caches `impl` decodes with. Ours:
    a full cache of `full_length` slots at the fixed position and every
    position, one of `short_length` at the first position, a rolling one of
    `window` slots at the positions of the full one; keras-hub's: the full
    caches, at the same positions but the fixed one."""
    positions = spec["positions"]
    if impl == "ours_default":
        return [("full", spec["full_length"], positions[:1]),
                ("full", spec["short_length"], positions[:1])]
    fixed = [FIXED_POSITION] if impl == "ours" else []
    caches = [("full", spec["full_length"],
               sorted(set(fixed + positions))),
              ("full", spec["short_length"], positions[:1])]
    if impl == "ours":
        caches.append(("rolling", spec["window"],
                       sorted(set(fixed + positions))))
    return caches


def decode_group(unit):
    """`(impl, mode)`: the group of steps a `decode` or `floor` unit is
    timed with (the floors with ours in the fast mode)."""
    if unit["kind"] == "floor":
        return ("ours", unit["mode"])
    return (unit["impl"], unit["mode"])


def prefill_cache(window):
    """The cache a prefill with `window` goes through: `"rolling"` (a
    window) or `"full"`."""
    return "full" if window is None else "rolling"


def decode_units(backend, spec):
    """The decode section's units of one backend, in the order it runs them.

    First the groups of steps (`decode_group`), each timed alternately by
    its first unit (`worker.Worker.decode`): ours (in place) in the fast
    mode with the floors (reading the `p + 1` valid slots of a full cache
    at each position, the `w` slots of a rolling one), which come first;
    ours in the other mode; keras-hub's in each mode; ours with a cache the
    caller owns, eagerly. A group holds every cache at
    its positions in increasing order. Then `generate` with keras-hub's
    attention and with ours; then the prefills, each window (the rolling
    one, none) without a cache and through one.
    """
    units = []
    fast = fast_mode(backend)
    for impl in DECODE_IMPLS:
        modes = decode_modes(backend)
        if impl == "ours":
            modes = [fast] + [mode for mode in modes if mode != fast]
        if impl == "ours_default":  # compiled steps are the same in both
            modes = ["eager"]
        for mode in modes:
            if impl == "ours" and mode == fast:
                for position in spec["positions"]:
                    units.append({
                        "kind": "floor", "backend": backend, "cache": "full",
                        "slots": spec["full_length"], "position": position,
                        "reads": position + 1, "mode": mode})
                units.append({"kind": "floor", "backend": backend,
                              "cache": "rolling", "slots": spec["window"],
                              "position": None, "reads": spec["window"],
                              "mode": mode})
            for cache, slots, positions in decode_caches(spec, impl):
                for position in positions:
                    units.append({
                        "kind": "decode", "backend": backend, "impl": impl,
                        "cache": cache, "slots": slots, "position": position,
                        "mode": mode,
                    })
    generate = spec["generate"]
    for impl in GENERATE_IMPLS:
        units.append({"kind": "generate", "backend": backend, "impl": impl,
                      "prompt_length": generate["prompt_length"],
                      "max_length": generate["max_length"]})
    prefill = spec["prefill"]
    for window in (prefill["window"], None):
        for mode in decode_modes(backend):
            for name in ("none", prefill_cache(window)):
                units.append({"kind": "prefill", "backend": backend,
                              "cache": name, "T": prefill["length"],
                              "w": window, "mode": mode})
    return units


# -------------------------------------------------------------------- FLOPs


def allowed_pairs(t_len, s_len, window, causal):
    """Sum over queries of the number of keys the mask allows (no cache).

    Query `t` may see keys `max(0, t - w + 1) .. min(S - 1, t + w - 1)`,
    the upper end `t` when causal (see docs/design.md, "Masks are positions compared").
    """
    t = np.arange(t_len, dtype=np.int64)
    low = np.zeros_like(t)
    high = np.full_like(t, s_len - 1)
    if causal:
        high = np.minimum(high, t)
    if window is not None:
        low = np.maximum(low, t - window + 1)
        high = np.minimum(high, t + window - 1)
    return int(np.maximum(high - low + 1, 0).sum())


def flops(config, t_len, window, causal, batch=None):
    """Useful forward FLOPs: `{"core", "projections", "layer", "pairs"}`
    at `batch` (the matrix's by default)."""
    batch = batch or config["batch"]
    heads, head = config["num_heads"], config["key_dim"]
    features = heads * head  # E
    pairs = allowed_pairs(t_len, t_len, window, causal)
    core = 4 * batch * heads * head * pairs
    projections = 4 * 2 * batch * t_len * features * heads * head
    return {"pairs": pairs, "core": core, "projections": projections,
            "layer": core + projections}


def unit_flops(config, unit):
    """Useful FLOPs of one call of an attention unit (see FLOPS_DEFINITION)."""
    counts = flops(config, unit["T"], unit["w"], unit["causal"], unit["B"])
    useful = counts["layer" if SCOPE[unit["impl"]] == "layer" else "core"]
    return useful * (3 if unit["mode"] == "forward_backward" else 1)


# --------------------------------------------------------------------- caps


def projection_shape(config, batch, t_len):
    """`[B*T, E, N*H]`: one of the layer's projections as a matmul
    `(B*T, E) @ (E, N*H)` (here `E = N*H`)."""
    features = config["num_heads"] * config["key_dim"]
    return [batch * t_len, features, features]


def dense_bytes(config, t_len, batch=None):
    """The `(B, N, T, S)` float32 scores, times `dense_bytes_factor`, at
    `batch` (the matrix's by default)."""
    return ((batch or config["batch"]) * config["num_heads"] * t_len * t_len * 4
            * config["dense_bytes_factor"])


def banded_bytes(config, t_len, window, causal, block, batch=None):
    """The banded path's `(B, N, T, span)` float32 scores, times the factor,
    at `batch` (the matrix's by default)."""
    before = -(-(window - 1) // block)
    span = (before + 1 + (0 if causal else before)) * block
    padded = -(-t_len // block) * block
    return ((batch or config["batch"]) * config["num_heads"] * padded * span * 4
            * config["dense_bytes_factor"])


def estimate(unit, config, complexity, history, analytic_bytes=None):
    """Predicted `(seconds, bytes, previous)` of one call of `unit`.

    `history` holds the results of the same series (`series_key`) at shorter
    T. From the longest one measured, time and peak memory are extrapolated
    as `x_prev * (T / T_prev) ** e`, with `e = 2` for dense algorithms
    (O(T*S)) and `e = 1` for banded ones (O(T*w)). Where two shorter T were
    measured with some memory, the memory's `e` is instead its growth
    between the last two, kept between 1 and the time's `e`: a path that
    computes every pair may still hold O(T) memory (blocks, a fused
    kernel), and the prediction must not skip it for the memory it does not
    use. Without a measurement, the time is unknown (`None`) and the memory
    is `analytic_bytes`. `previous` is the latest shorter unit, if any.
    """
    exponent = 1 if complexity == "banded" else 2
    shorter = sorted((r for r in history if r["T"] < unit["T"]),
                     key=lambda r: r["T"])
    previous = shorter[-1] if shorter else None
    measured = [r for r in shorter if r.get("status") == OK]
    if not measured:
        return None, analytic_bytes, previous
    last = measured[-1]
    seconds = last["time_s"] * (unit["T"] / last["T"]) ** exponent
    peak = max(last.get("peak_bytes") or 0, 0)
    memory_exponent = exponent
    if len(measured) > 1 and peak > 0 and (measured[-2].get("peak_bytes")
                                           or 0) > 0:
        before = measured[-2]
        growth = math.log(peak / before["peak_bytes"]) / math.log(
            last["T"] / before["T"])
        memory_exponent = min(max(growth, 1.0), exponent)
    predicted = peak * (unit["T"] / last["T"]) ** memory_exponent
    return seconds, predicted, previous


def time_capped(unit):
    """Whether the time cap may skip `unit`: all but our whole layer's
    forward, which the issues' targets ask to complete at every T of the
    matrix (the roofline, T=65536 without a window); the runner's wall
    clock still stops a call that hangs, and the memory cap still holds."""
    return not (unit["impl"] == "ours" and unit["mode"] == "forward")


def cap_reason(unit, config, complexity, history, analytic_bytes=None,
               memory_cap_bytes=None):
    """Why `unit` is skipped without running, or `None` to run it."""
    seconds, predicted, previous = estimate(
        unit, config, complexity, history, analytic_bytes
    )
    if previous is not None and previous.get("status") in GAVE_UP:
        return (f"{previous['status']} at T={previous['T']} already "
                f"({previous.get('reason', '')})").replace(" ()", "")
    if (seconds is not None and seconds > config["time_cap_s"]
            and time_capped(unit)):
        return (f"over time cap (est. {seconds:.0f} s > "
                f"{config['time_cap_s']:g} s)")
    cap = memory_cap_bytes or config["memory_cap_gib"] * 2**30
    if predicted is not None and predicted > cap:
        return (f"over memory cap (est. {predicted / 2**30:.1f} GiB > "
                f"{cap / 2**30:.1f} GiB)")
    return None
