"""The benchmark worker: one process, one backend (`KERAS_BACKEND`).

Started by the parent as `python -m keras_mha.cli.bench.worker CONFIG.json`.
It reads one message per line on stdin, `{"unit", "history",
"memory_cap_bytes", "skip_compilers"}`, and answers on its original stdout
with `{"event": "trying"}` and `{"event": "warm"}` around each first call,
then `{"event": "result", "id", "result"}`. Whatever libraries print goes
to stderr (the parent's log file). The parent (`runner.py`) owns the
time-outs and replaces a worker that died.

A feature unit is an attention unit of our whole layer with one feature on
(`feature_arguments`); it records the path the layer takes like the others.

A unit is timed after a warm-up call (compilation included, reported as
`first_call_s`); the timed calls are `repeats` (fewer if they would take
longer than the time cap together), the result their median. Peak memory
covers the timed calls only (`memory.py`).
"""

import gc
import json
import math
import os
import re
import statistics
import sys
import time
import traceback

import numpy as np

from keras_mha.cli.bench import backends
from keras_mha.cli.bench import memory
from keras_mha.cli.bench import plan
from keras_mha.cli.common import backend_version

_OOM = re.compile(
    r"out of memory|resource.?exhausted|can.?t allocate memory|"
    r"cannot allocate memory|std::bad_alloc|\bOOM\b",
    re.IGNORECASE,
)


# ------------------------------------------------------------------- timing


def first_line(error):
    lines = [l.strip() for l in str(error).strip().splitlines() if l.strip()]
    text = f"{type(error).__name__}: {lines[0]}" if lines else \
        type(error).__name__
    return text[:300]


def is_oom(error):
    return isinstance(error, MemoryError) or bool(
        _OOM.search(f"{type(error).__name__} {error}")
    )


# ----------------------------------------------------------------- features


def feature_arguments(feature, config):
    """`(layer arguments, segment count)` of a feature cell: what
    `keras_mha.MultiHeadAttention` gets on top of `sliding_window`, and how
    many equal segments the call's `segment_ids` split each row into (0:
    no `segment_ids`)."""
    import keras_mha

    spec = config["features"]
    if feature == "rope":
        return {"rotary_embedding": keras_mha.RotaryEmbedding()}, 0
    if feature == "soft_cap":
        return {"attn_logits_soft_cap": spec["soft_cap"]}, 0
    if feature == "sinks":
        return {"use_sinks": True}, 0
    if feature == "alibi":
        return {"use_alibi": True}, 0
    if feature == "segments":
        return {}, spec["segments"]
    if feature == "plain":
        return {}, 0
    raise ValueError(f"unknown feature {feature!r}")


def segment_ids(batch, t_len, count):
    """`(B, T)` int32: `count` equal runs of ids 0, 1, ... per row."""
    ids = np.arange(t_len) * count // t_len  # (T,)
    return np.broadcast_to(ids, (batch, t_len)).astype("int32")


# -------------------------------------------------------------------- units


class Worker:
    """Runs units on the active backend; keeps the last cell's set-up, which
    the forward and forward+backward units of a cell share."""

    def __init__(self, config, emit=None):
        import keras

        self.keras = keras
        self.emit = emit or (lambda record: None)
        self.skip_compilers = {}
        self.config = config
        self.name = keras.backend.backend()
        self.backend = backends.get(self.name)
        if self.backend is None:
            raise SystemExit(f"the {self.name} backend is not benchmarked")
        self.meter = memory.PeakMeter()
        self.rng = np.random.default_rng(0)
        self.scale = 1.0 / math.sqrt(config["key_dim"])
        self._setup_key = None
        self._setup = None

    def run(self, unit, history=(), memory_cap_bytes=None,
            skip_compilers=None):
        """One unit's result. `skip_compilers`: `{compiler: why}`, the
        candidates not to try (the parent saw their first call hang)."""
        self.skip_compilers = dict(skip_compilers or {})
        if unit["kind"] == "matmul":
            return self.matmul(unit)
        if unit["kind"] == "decode":
            return self.decode(unit)
        # An attention or a feature unit.
        return self.attention(unit, history, memory_cap_bytes)

    # --- timing

    def time_calls(self, fn, repeats, on_warm=None):
        """One warm-up call, then up to `repeats` timed calls: a result.

        Fewer calls are timed when they would take longer than the time
        cap together (at least one).
        """
        block = self.backend.block
        started = time.perf_counter()
        out = fn()
        block(out)
        first = time.perf_counter() - started
        del out
        if on_warm is not None:
            on_warm(first)
        warm = first
        if first < 1.0 and repeats > 1:  # a warm call sets the repeat count
            started = time.perf_counter()
            out = fn()
            block(out)
            warm = time.perf_counter() - started
            del out
        cap = self.config["time_cap_s"]
        count = max(1, min(repeats, int(cap // max(warm, 1e-9))))
        times = []
        self.meter.start()
        try:
            for _ in range(count):
                started = time.perf_counter()
                out = fn()
                block(out)
                times.append(time.perf_counter() - started)
                del out
        finally:
            peak, absolute = self.meter.stop()
        return {
            "status": plan.OK,
            "time_s": statistics.median(times),
            "times_s": times,
            "repeats": count,
            "first_call_s": first,
            "peak_bytes": peak,
            "rss_peak_bytes": absolute,
        }

    def time_candidates(self, candidates, repeats):
        """Times the first candidate that runs; notes why others did not.

        The parent hears `trying` before each candidate's first call and
        `warm` after it, so it can give compilation its own deadline; a
        candidate it abandoned comes back in `skip_compilers`. Running out
        of memory is no reason to try the next candidate.
        """
        notes = [f"{c}: {self.skip_compilers[c]}"
                 for c, _ in candidates if c in self.skip_compilers]
        left = [(c, fn) for c, fn in candidates
                if c not in self.skip_compilers]
        if not left:
            raise RuntimeError("every compiler was abandoned: "
                               + "; ".join(notes))
        for number, (compiler, fn) in enumerate(left):
            last = number == len(left) - 1
            self.emit({"event": "trying", "compiler": compiler,
                       "fallback": not last})
            try:
                result = self.time_calls(fn, repeats, on_warm=lambda first: (
                    self.emit({"event": "warm", "first_call_s": first})))
            except Exception as error:
                if is_oom(error) or last:
                    raise
                notes.append(f"{compiler}: {first_line(error)}")
                continue
            result["compiler"] = compiler
            if notes:
                result["note"] = "; ".join(notes)
            return result
        raise AssertionError("unreachable")

    def drop_setup(self):
        self._setup_key = self._setup = None
        gc.collect()

    # --- set-up

    def _random(self, shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    def _layer(self, cls, t_len, **kwargs):
        config = self.config
        layer = cls(
            num_heads=config["num_heads"], key_dim=config["key_dim"],
            kernel_initializer="zeros", bias_initializer="zeros", **kwargs,
        )
        shape = (config["batch"], t_len, config["num_heads"]
                 * config["key_dim"])
        layer.build(shape, shape)
        # NumPy weights: no random kernels to compile, the same every run.
        layer.set_weights([
            self._random(w.shape) / math.sqrt(max(w.shape[0], 1))
            for w in layer.get_weights()
        ])
        return layer

    def _layer_arguments(self, unit):
        """`(arguments, segment count)` of our layer in `unit` (see
        `feature_arguments`): none for an attention unit."""
        if unit["kind"] != "feature":
            return {}, 0
        return feature_arguments(unit["feature"], self.config)

    def _cell(self, unit):
        """The built layer and input (and segment ids), or q, k, v, of
        `unit`'s cell."""
        key = (unit["impl"], unit["T"], unit["w"], unit["causal"],
               unit.get("feature"))
        if key == self._setup_key:
            return self._setup
        self.drop_setup()
        config, impl = self.config, unit["impl"]
        batch, t_len = config["batch"], unit["T"]
        heads, head = config["num_heads"], config["key_dim"]
        if plan.SCOPE[impl] == "layer":
            import keras_mha

            cls = (self.keras.layers.MultiHeadAttention if impl == "keras"
                   else keras_mha.MultiHeadAttention)
            arguments, segments = self._layer_arguments(unit)
            setup = {
                "layer": self._layer(cls, t_len, sliding_window=unit["w"],
                                     **arguments),
                "x": self.backend.tensor(
                    self._random((batch, t_len, heads * head))),
                "segment_ids": self.backend.tensor(
                    segment_ids(batch, t_len, segments)) if segments
                else None,
            }
        else:
            shape = ((batch, heads, t_len, head) if impl == "flex_attention"
                     else (batch, t_len, heads, head))
            setup = {"qkv": [self.backend.tensor(self._random(shape))
                             for _ in range(3)]}
        self._setup_key, self._setup = key, setup
        return setup

    # --- attention

    def path(self, unit):
        """The attention path our layer takes for this cell, as the layer
        answers it (`attention_path`: the call's spec, the dispatch rule)."""
        import keras_mha

        config = self.config
        arguments, segments = self._layer_arguments(unit)
        layer = keras_mha.MultiHeadAttention(
            num_heads=config["num_heads"], key_dim=config["key_dim"],
            sliding_window=unit["w"], **arguments,
        )
        shape = (config["batch"], unit["T"],
                 config["num_heads"] * config["key_dim"])  # (B, T, E)
        return layer.attention_path(shape, shape,
                                    use_causal_mask=unit["causal"],
                                    segment_ids=bool(segments))

    def complexity(self, unit):
        """`(complexity, path, analytic bytes)` of an attention unit.

        `banded` (O(T*w)) for our banded function, for our layer when
        dispatch picks a banded path, and for flex_attention with a window;
        `dense` (O(T*S)) otherwise. The analytic bytes (the memory cap's
        guess before any shorter T was measured) are the scores' size times
        `dense_bytes_factor`; none for flex_attention, which never holds
        them.
        """
        from keras_mha.attention import dispatch
        from keras_mha.attention.banded import default_block_size
        from keras_mha.attention.spec import window_sides

        impl, window, causal = unit["impl"], unit["w"], unit["causal"]
        path = None
        if impl == "ours":
            path = self.path(unit)
            banded = path == dispatch.BANDED
        else:
            banded = impl in ("ours_core", "flex_attention") and \
                window is not None
        if impl == "flex_attention":
            analytic = None
        elif banded:
            block = default_block_size(window_sides(window, causal))
            analytic = plan.banded_bytes(self.config, unit["T"], window,
                                         causal, block)
        else:
            analytic = plan.dense_bytes(self.config, unit["T"])
        return ("banded" if banded else "dense"), path, analytic

    def core_fn(self, unit):
        """Our attention core: the banded function with a window, else what
        the one entry `attend` runs (the triangular path where the rule
        picks it, the fused one otherwise)."""
        from keras_mha.attention import AttentionSpec
        from keras_mha.attention import attend
        from keras_mha.attention import banded_attention
        from keras_mha.attention.spec import window_sides

        window, causal = unit["w"], unit["causal"]
        spec = AttentionSpec(scale=self.scale, causal=causal,
                             window=window_sides(window, causal))
        if window is not None:
            return lambda q, k, v: banded_attention(q, k, v, spec)
        return lambda q, k, v: attend(q, k, v, spec)[0]

    def attention(self, unit, history, memory_cap_bytes):
        impl, mode = unit["impl"], unit["mode"]
        complexity, path, analytic = self.complexity(unit)
        extra = {"complexity": complexity}
        if path is not None:
            extra["path"] = path
        if impl == "flex_attention" and mode == "forward_backward":
            return {"status": plan.NOT_AVAILABLE, "reason": "no CPU backward",
                    **extra}
        reason = plan.cap_reason(unit, self.config, complexity, history,
                                 analytic, memory_cap_bytes)
        if reason is not None:
            return {"status": plan.SKIPPED, "reason": reason, **extra}
        setup = self._cell(unit)
        if plan.SCOPE[impl] == "layer":
            candidates = self.backend.layer(setup["layer"], setup["x"],
                                            unit["causal"], mode,
                                            setup["segment_ids"])
        elif impl == "ours_core":
            candidates = self.backend.core(self.core_fn(unit), setup["qkv"],
                                           mode)
        else:
            candidates, info = self.backend.native(
                *setup["qkv"], unit["w"], unit["causal"], self.scale, mode
            )
            extra.update(info)
        result = self.time_candidates(candidates, self.config["repeats"])
        return {**result, **extra}

    # --- yardstick and decode

    def matmul(self, unit):
        size = unit["size"]
        a, b = (self.backend.tensor(self._random((size, size)))
                for _ in range(2))
        result = self.time_candidates(
            [(self.backend.compiler, self.backend.matmul(a, b))],
            unit["repeats"])
        result["gflops"] = 2 * size**3 / result["time_s"] / 1e9
        return result

    def decode(self, unit):
        """One decode step of our layer at `position`, cache threaded."""
        import keras_mha

        spec = self.config["decode"]
        key = ("decode", unit["cache"])
        if key != self._setup_key:
            self.drop_setup()
            window = spec["window"] if unit["cache"] == "rolling" else None
            layer = self._layer(keras_mha.MultiHeadAttention, 1,
                                sliding_window=window)
            batch = self.config["batch"]
            # A rolling cache has `window` slots whatever the length.
            cache = layer.init_cache(batch, spec["full_length"])
            features = self.config["num_heads"] * self.config["key_dim"]
            token = self.backend.tensor(self._random((batch, 1, features)))
            state = {"cache": cache}
            self._setup_key = key
            self._setup = {
                "state": state,
                "candidates": self.backend.decode(layer, token, state),
                "cache_bytes": int(np.prod(cache.shape))
                * np.dtype(self.keras.backend.standardize_dtype(
                    cache.dtype)).itemsize,
                "slots": int(cache.shape[1]),
            }
        setup = self._setup
        setup["state"]["index"] = self.backend.index(unit["position"])
        result = self.time_candidates(setup["candidates"], spec["repeats"])
        # Later positions reuse what compiled and skip what failed.
        setup["candidates"] = [c for c in setup["candidates"]
                               if c[0] == result["compiler"]]
        result.update(cache_bytes=setup["cache_bytes"], slots=setup["slots"],
                      ms_per_token=result["time_s"] * 1e3)
        return result


# --------------------------------------------------------------------- main


def main(config_path):
    """Serves units until stdin ends; returns the exit code."""
    # The protocol keeps the real stdout; anything printed goes to stderr.
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(record):
        protocol.write(json.dumps(record) + "\n")
        protocol.flush()

    with open(config_path, encoding="utf-8") as file:
        config = json.load(file)
    worker = Worker(config, emit)
    # What the imports created lives as long as the process: keep it out of
    # every later collection (a full one takes about a second otherwise).
    gc.collect()
    gc.freeze()
    emit({"event": "hello", "backend": worker.name,
          "version": backend_version(worker.name),
          "keras": worker.keras.__version__,
          "memory_method": worker.meter.method, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        unit = message["unit"]
        started = time.perf_counter()
        try:
            result = worker.run(unit, message.get("history", ()),
                                message.get("memory_cap_bytes"),
                                message.get("skip_compilers"))
        except Exception as error:
            status = plan.OUT_OF_MEMORY if is_oom(error) else plan.ERROR
            result = {"status": status, "reason": first_line(error)}
            print(f"unit {unit['id']}:", file=sys.stderr)
            traceback.print_exc()
            worker.drop_setup()
        result["wall_s"] = time.perf_counter() - started
        emit({"event": "result", "id": unit["id"], "result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
