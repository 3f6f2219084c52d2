"""The benchmark worker: one process, one backend (`KERAS_BACKEND`).

Started by the parent as `python -m benchmarks.worker CONFIG.json`.
It reads one message per line on stdin, `{"unit", "history",
"memory_cap_bytes", "skip_compilers"}`, and answers on its original stdout
with `{"event": "trying"}` and `{"event": "warm"}` around each first call,
then `{"event": "result", "id", "result"}`. Whatever libraries print goes
to stderr (the parent's log file). The parent (`runner.py`) owns the
time-outs and replaces a worker that died.

A feature unit is an attention unit of our whole layer with one feature on
(`feature_arguments`); it records the path the layer takes like the others.
A `matmul` unit times a square matmul, a `projection` unit the matmul of
one of the layer's projections at a cell's B and T, in this process (the
roofline's rate); a `fit` unit one `train_on_batch` step of a small causal
transformer (`transformer`).
The decode section's units (`decode`, `floor`, `generate`, `prefill`, see
`plan.decode_units`) fill their caches with random keys and values before
timing, so every slot a step reads holds a real token.
What a target compares is timed together, call for call, by the first
unit of it to run: Keras's layer and ours at a small-model cell or a cell
without a window, with the projection matmul (`_paired_result`); the two
`generate` units (keras-hub's attention
and ours); the `decode` steps of one implementation in one mode (every
cache at every position), with the floors for ours in the fast mode
(`plan.decode_group`); a prefill with and without its cache.

A unit is timed after a warm-up call (compilation included, reported as
`first_call_s`); the timed calls are `repeats` (fewer if they would take
longer than the time cap together), the result their median. Peak memory
covers the timed calls only (`memory.py`).
"""

import functools
import gc
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from unittest import mock

import numpy as np

from benchmarks import backends
from benchmarks import memory
from benchmarks import plan
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


# ------------------------------------------------------------------- decode


def causal_cache_mask(batch, num_slots, position):
    """`(B, 1, S)` bool: keras-hub's mask of one token at `position`, which
    may attend to the slots `<= position`."""
    allowed = np.arange(num_slots) <= position  # (S,)
    return np.broadcast_to(allowed, (batch, 1, num_slots)).copy()


def generate_inputs(batch, prompt_length, max_length, vocabulary_size):
    """keras-hub's `generate` inputs without a preprocessor: `token_ids`
    `(B, max_length)` int32, a prompt of `prompt_length` tokens (ids from 1,
    the same every run) then zeros, and `padding_mask` marking the
    prompt."""
    prompt = 1 + np.arange(prompt_length) % (vocabulary_size - 1)
    token_ids = np.zeros((batch, max_length), "int32")
    token_ids[:, :prompt_length] = prompt
    padding_mask = np.arange(max_length)[None, :] < prompt_length
    return {"token_ids": token_ids,
            "padding_mask": np.broadcast_to(padding_mask,
                                            (batch, max_length)).copy()}


def keras_hub_missing():
    """Why keras-hub's units cannot run, or `None`."""
    if importlib.util.find_spec("keras_hub") is None:
        return 'keras-hub is not installed (pip install "keras-hub>=0.32")'
    return None


def gpt2_backbone(attention):
    """The tiny GPT-2 of `plan.GPT2`, its decoders' attention layers built
    from `attention` (keras-hub's `CachedMultiHeadAttention` or ours),
    with the same NumPy weights whichever it is."""
    import keras_hub
    from keras_hub.src.layers.modeling import transformer_decoder

    # GPT2Backbone builds its TransformerDecoders as it is constructed;
    # each builds its attention from this module's name.
    with mock.patch.object(transformer_decoder, "CachedMultiHeadAttention",
                           attention):
        backbone = keras_hub.models.GPT2Backbone(**plan.GPT2)
    # Weights of this scale keep greedy decoding from one repeated token,
    # so the two attentions' tokens are a check worth making.
    rng = np.random.default_rng(0)
    backbone.set_weights([rng.normal(scale=0.2, size=w.shape).astype(w.dtype)
                          for w in backbone.get_weights()])
    return backbone


# ---------------------------------------------------------------------- fit


def transformer(attention, unit, features):
    """The `fit` unit's model on inputs `(B, T, E)`: `layers` pre-norm
    causal blocks (LayerNorm, self-attention with `use_causal_mask=True`,
    residual; LayerNorm, Dense(4E, gelu), Dense(E), residual), then
    Dense(E). `attention()` makes each block's attention layer."""
    import keras

    inputs = keras.Input((unit["T"], features), batch_size=unit["B"])
    x = inputs  # (B, T, E)
    for _ in range(unit["layers"]):
        h = keras.layers.LayerNormalization()(x)
        x = x + attention()(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(4 * features, activation="gelu")(h)
        x = x + keras.layers.Dense(features)(h)
    return keras.Model(inputs, keras.layers.Dense(features)(x))


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
        if unit["kind"] in ("matmul", "projection"):
            return self.matmul(unit)
        if unit["kind"] in ("fit", "decode", "floor", "generate", "prefill"):
            return getattr(self, unit["kind"])(unit)
        # An attention or a feature unit.
        return self.attention(unit, history, memory_cap_bytes)

    # --- timing

    def time_calls(self, fn, repeats, on_warm=None, warmup=1, beside=None):
        """`warmup` untimed calls (the first compiles: `first_call_s`), then
        up to `repeats` timed calls: a result.

        Fewer calls are timed when they would take longer than the time
        cap together (at least one). `beside`: a yardstick timed after each
        timed call (`beside_time_s`, its median; warmed with `fn`), so that
        a ratio of the two spans the same seconds. Its memory stays under
        the peak: its inputs exist before the meter starts, and it must
        need less than one call of `fn` (a projection's matmul beside our
        layer or core, whose outputs alone are as large).
        """
        block = self.backend.block
        started = time.perf_counter()
        out = fn()
        block(out)
        first = time.perf_counter() - started
        del out
        if on_warm is not None:
            on_warm(first)
        warm, extra = first, warmup - 1
        if first < 1.0 and repeats > 1:  # a warm call sets the repeat count
            extra = max(extra, 1)
        for _ in range(extra):
            started = time.perf_counter()
            out = fn()
            block(out)
            warm = time.perf_counter() - started
            del out
        if beside is not None:
            block(beside())
        cap = self.config["time_cap_s"]
        count = max(1, min(repeats, int(cap // max(warm, 1e-9))))
        times, yardstick = [], []
        self.meter.start()
        try:
            for _ in range(count):
                started = time.perf_counter()
                out = fn()
                block(out)
                times.append(time.perf_counter() - started)
                del out
                if beside is not None:
                    started = time.perf_counter()
                    block(beside())
                    yardstick.append(time.perf_counter() - started)
        finally:
            peak, absolute = self.meter.stop()
        result = _timed(times, first, peak, absolute)
        if yardstick:
            result["beside_time_s"] = statistics.median(yardstick)
        return result

    def time_alternately(self, calls, repeats, compiler):
        """`{name: result}` (`time_calls`'s) of the named `calls`, timed in
        turn, one call of each per round, so that whatever else the
        machine does in those seconds falls on all of them alike; every
        other round runs them in reverse order, so none always goes first
        (timing keras-hub's model against itself read 0.97-1.00x in the
        same order each round). Each is warmed by two calls first; the time
        cap bounds the rounds."""
        block = self.backend.block
        self.emit({"event": "trying", "compiler": compiler,
                   "fallback": False})
        first, warm = {}, {}
        for number in range(2):
            for name, fn in calls:
                started = time.perf_counter()
                block(fn())
                (warm if number else first)[name] = (time.perf_counter()
                                                     - started)
            if number == 0:
                self.emit({"event": "warm",
                           "first_call_s": sum(first.values())})
        cap = self.config["time_cap_s"]
        count = max(1, min(repeats, int(cap // max(sum(warm.values()),
                                                     1e-9))))
        times = {name: [] for name, _ in calls}
        self.meter.start()
        try:
            for number in range(count):
                for name, fn in calls[::-1] if number % 2 else calls:
                    started = time.perf_counter()
                    block(fn())
                    times[name].append(time.perf_counter() - started)
        finally:
            peak, absolute = self.meter.stop()
        return {name: dict(_timed(times[name], first[name], peak, absolute),
                           compiler=compiler)
                for name, _ in calls}

    def time_candidates(self, candidates, repeats, warmup=1, beside=None):
        """Times the first candidate that runs (`time_calls`); notes why
        others did not.

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
                    self.emit({"event": "warm", "first_call_s": first})),
                    warmup=warmup, beside=beside)
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

    def time_group(self, cells, repeats):
        """`{name: result}` of the named `cells`, `[(name, candidates)]`:
        each cell's compiler picked and warmed by `time_candidates` (one
        timed call), then the cells timed alternately (`time_alternately`)
        on what they picked."""
        calls, picked = [], {}
        for name, candidates in cells:
            picked[name] = self.time_candidates(candidates, 1)
            calls.append((name, dict(candidates)[picked[name]["compiler"]]))
        results = self.time_alternately(calls, repeats, "alternately")
        for name, result in results.items():
            chosen = picked[name]
            result.update(compiler=chosen["compiler"], timing="alternately",
                          first_call_s=chosen["first_call_s"])
            if "note" in chosen:
                result["note"] = chosen["note"]
        return results

    def drop_setup(self):
        self._setup_key = self._setup = None
        gc.collect()

    # --- set-up

    def _random(self, shape):
        return self.rng.standard_normal(shape, dtype=np.float32)

    def _layer(self, cls, t_len, batch=None, **kwargs):
        """A built `cls` layer of the config's heads for inputs `(B, T, E)`,
        `B` = `batch` (the matrix's by default)."""
        config = self.config
        layer = cls(
            num_heads=config["num_heads"], key_dim=config["key_dim"],
            kernel_initializer="zeros", bias_initializer="zeros", **kwargs,
        )
        shape = (batch or config["batch"], t_len, config["num_heads"]
                 * config["key_dim"])
        layer.build(shape, shape)
        # NumPy weights: no random kernels to compile, the same every run,
        # and the same for Keras's layer and ours (their weights line up),
        # so that the two compute the same numbers.
        rng = np.random.default_rng(1)
        layer.set_weights([
            rng.standard_normal(w.shape, dtype=np.float32)
            / math.sqrt(max(w.shape[0], 1))
            for w in layer.get_weights()
        ])
        return layer

    def _layer_class(self, impl):
        """Keras's layer for `"keras"`, ours otherwise."""
        import keras_mha

        if impl == "keras":
            return self.keras.layers.MultiHeadAttention
        return keras_mha.MultiHeadAttention

    def _layer_arguments(self, unit):
        """`(arguments, segment count)` of our layer in `unit` (see
        `feature_arguments`): none for an attention unit."""
        if unit["kind"] != "feature":
            return {}, 0
        return feature_arguments(unit["feature"], self.config)

    def _cell(self, unit):
        """The built layer and input (and segment ids), or q, k, v, of
        `unit`'s cell."""
        key = (unit["impl"], unit["B"], unit["T"], unit["w"], unit["causal"],
               unit.get("feature"))
        if key == self._setup_key:
            return self._setup
        self.drop_setup()
        config, impl = self.config, unit["impl"]
        batch, t_len = unit["B"], unit["T"]
        heads, head = config["num_heads"], config["key_dim"]
        if plan.SCOPE[impl] == "layer":
            arguments, segments = self._layer_arguments(unit)
            setup = {
                "layer": self._layer(self._layer_class(impl), t_len, batch,
                                     sliding_window=unit["w"], **arguments),
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
        shape = (unit["B"], unit["T"],
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
                                         causal, block, unit["B"])
        else:
            analytic = plan.dense_bytes(self.config, unit["T"], unit["B"])
        return ("banded" if banded else "dense"), path, analytic

    def core_fn(self, unit):
        """Our attention core: the banded function with a window, else what
        the one entry `attend` runs (the blocked or triangular path where
        the rule picks it, the fused one otherwise)."""
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
        if self._paired(unit, complexity, history):
            return {**self._paired_result(unit), **extra}
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
        beside = None
        if unit["kind"] == "attention" and impl in ("ours", "ours_core"):
            beside, count = self._projection(unit["B"], unit["T"])
        result = self.time_candidates(candidates, self.config["repeats"],
                                      beside=beside)
        if "beside_time_s" in result:  # the roofline's rate, alongside
            result["projection_time_s"] = result.pop("beside_time_s")
            result["projection_gflops"] = (
                count / result["projection_time_s"] / 1e9)
        return {**result, **extra}

    def _paired(self, unit, complexity, history):
        """Whether `unit` is Keras's layer or ours at a cell whose ratio is
        a target, timed together (`_paired_result`): a small-model cell, or
        a cell without a window (or with `w >= T`) where one call of
        Keras's layer is expected within `PAIRED_MAX_CALL_S` (predicted
        from shorter T, `plan.estimate`, or from its FLOPs at
        `PAIRED_SLOW_RATE` where none ran). Our unit at such a cell runs
        alone where Keras's unit of its mode did not time it (Keras's was
        not paired, was skipped or failed, or is not in the run)."""
        if unit["kind"] != "attention" or unit["impl"] not in plan.PAIRED_IMPLS:
            return False
        small = self.config.get("small")
        if (small is not None and unit["B"] == small["batch"]
                and set(plan.PAIRED_IMPLS) <= set(small["implementations"])):
            return True
        if not plan.unwindowed(unit):
            return False
        if unit["impl"] != "keras":  # ours: only beside Keras's timing
            return (self._setup_key == _pair_key(unit)
                    and (unit["impl"], unit["mode"]) in self._setup["results"])
        seconds, _, _ = plan.estimate(unit, self.config, complexity, history)
        if seconds is None:
            seconds = plan.unit_flops(self.config, unit) / PAIRED_SLOW_RATE
        return seconds <= PAIRED_MAX_CALL_S

    def _paired_result(self, unit):
        """Keras's layer and ours at one cell, timed alternately.

        A call of a small-model cell takes milliseconds, and timed one unit
        after the other, the ratio of the two carried whatever the machine
        did between the units (the same cells read 0.86x and 1.03x in two
        runs of one commit; torch at B=1, T=4,096, where both layers run
        one kernel, read 0.94x). The first of the cell's units of a mode
        builds both layers on the same input and times their calls in turn
        with the projection matmul, our roofline's yardstick
        (`time_alternately`); the other unit reports its half. The memory
        peak is each layer's own: one more call of each, metered alone.
        """
        cell = _pair_key(unit)
        if cell != self._setup_key:
            self.drop_setup()
            shape = (unit["B"], unit["T"],
                     self.config["num_heads"] * self.config["key_dim"])
            self._setup_key = cell
            self._setup = {
                "layers": {
                    impl: self._layer(self._layer_class(impl), unit["T"],
                                      unit["B"], sliding_window=unit["w"])
                    for impl in plan.PAIRED_IMPLS
                },
                "x": self.backend.tensor(self._random(shape)),
                "projection": self._projection(unit["B"], unit["T"]),
                "results": {},
            }
        setup, mode = self._setup, unit["mode"]
        if (unit["impl"], mode) not in setup["results"]:
            candidates = [
                self.backend.layer(setup["layers"][impl], setup["x"],
                                   unit["causal"], mode)
                for impl in plan.PAIRED_IMPLS
            ]
            results = self._time_pair(list(zip(*candidates)),
                                      max(self.config["repeats"],
                                          PAIRED_ROUNDS),
                                      setup["projection"])
            for impl, result in results.items():
                setup["results"][impl, mode] = result
        return setup["results"].pop((unit["impl"], mode))

    def _time_pair(self, rounds, repeats, projection):
        """`time_alternately` of the first compiler both layers run with
        (`rounds`: per compiler, one candidate per layer) and of the
        `projection` (`(call, FLOPs)`), whose rate goes into our layer's
        result, then each layer's memory peak alone."""
        notes = []
        yardstick, count = projection
        for number, candidates in enumerate(rounds):
            compiler = candidates[0][0]
            if compiler in self.skip_compilers:
                notes.append(f"{compiler}: {self.skip_compilers[compiler]}")
                continue
            calls = [(impl, fn) for impl, (_, fn)
                     in zip(plan.PAIRED_IMPLS, candidates)]
            try:
                results = self.time_alternately(
                    calls + [("projection", yardstick)], repeats, compiler)
            except Exception as error:
                if is_oom(error) or number == len(rounds) - 1:
                    raise
                notes.append(f"{compiler}: {first_line(error)}")
                continue
            beside = results.pop("projection")["time_s"]
            results["ours"].update(projection_time_s=beside,
                                   projection_gflops=count / beside / 1e9)
            for impl, fn in calls:
                self.meter.start()
                try:
                    self.backend.block(fn())
                finally:
                    peak, absolute = self.meter.stop()
                results[impl].update(peak_bytes=peak, rss_peak_bytes=absolute,
                                     timing="alternately")
                if notes:
                    results[impl]["note"] = "; ".join(notes)
            return results
        raise RuntimeError("every compiler was abandoned: " + "; ".join(notes))

    # --- yardsticks, fit and decode

    def matmul(self, unit):
        """A float32 matmul rate: the square one (`size`), or a projection's
        `(B*T, E) @ (E, N*H)` (`shape`), compiled as the backend compiles
        (`Backend.matmul`)."""
        if unit["kind"] == "projection":
            call, count = self._projection(unit["B"], unit["T"])
        else:
            size = unit["size"]
            call, count = self._matmul((size, size, size)), 2 * size ** 3
        result = self.time_candidates([(self.backend.compiler, call)],
                                      unit["repeats"])
        result["gflops"] = count / result["time_s"] / 1e9
        return result

    def _projection(self, batch, t_len):
        """`(call, FLOPs)`: one of the layer's projections at `batch` and
        `t_len` as one matmul `(B*T, E) @ (E, N*H)` (`plan.projection_shape`),
        on random inputs made now."""
        shape = plan.projection_shape(self.config, batch, t_len)
        return self._matmul(shape), 2 * math.prod(shape)

    def _matmul(self, shape):
        rows, inner, columns = shape
        a = self.backend.tensor(self._random((rows, inner)))
        b = self.backend.tensor(self._random((inner, columns)))
        return self.backend.matmul(a, b)

    def fit(self, unit):
        """One `train_on_batch` step (mean squared error, Adam) of
        `transformer` with our layer (`sliding_window=w`) or Keras's
        (causal, no window: the causal transformer Keras builds; its own
        `sliding_window` is a dense `(T, T)` mask, which XLA took over six
        minutes to constant-fold at T=4096 on a 2-core CPU, against seconds
        for the causal mask alone), compiled as Keras compiles a model:
        `jit_compile=True` (XLA on jax and tensorflow, `torch.compile` on
        torch), else `jit_compile=False` where that fails or its first step
        does not finish in time. `jit_compile` in the result is what Keras
        ran (it turns it off for a model with a layer that does not support
        it); `first_call_s` is the first step, compilation included, before
        `warmup - 1` more untimed steps (the first few after it can still be
        slow under `torch.compile`)."""
        import keras_mha

        self.drop_setup()
        keras = self.keras
        keras.utils.set_random_seed(0)  # the same initial weights each run
        config = self.config
        heads = {"num_heads": config["num_heads"],
                 "key_dim": config["key_dim"]}
        attention = (
            functools.partial(keras.layers.MultiHeadAttention, **heads)
            if unit["impl"] == "keras" else
            functools.partial(keras_mha.MultiHeadAttention, **heads,
                              sliding_window=unit["w"]))
        features = config["num_heads"] * config["key_dim"]  # E
        model = transformer(attention, unit, features)
        shape = (unit["B"], unit["T"], features)  # (B, T, E)
        x, y = (self.backend.tensor(self._random(shape)) for _ in range(2))

        def step(jit):
            compiled = []

            def run():
                if not compiled:  # the first call compiles, in its time
                    model.compile(optimizer="adam", loss="mse",
                                  jit_compile=jit)
                    compiled.append(jit)
                return model.train_on_batch(x, y)

            return run

        result = self.time_candidates(
            [(f"jit_compile={jit}", step(jit)) for jit in (True, False)],
            unit["repeats"], unit["warmup"])
        result["jit_compile"] = bool(model.jit_compile)
        return result

    def _decode_layer(self, impl, cache, slots):
        """`(layer, cache)` of a decode cell: our layer (a rolling cache of
        `slots` slots when `cache` is `"rolling"`; in place for `ours`, the
        caller's for `ours_default`) or keras-hub's, the cache filled with
        random keys and values (ours: every slot a real token)."""
        import keras_mha
        from keras_mha.attention import cache as cache_lib

        config = self.config
        batch, heads, head = (config["batch"], config["num_heads"],
                              config["key_dim"])
        if impl == "keras_hub":
            import keras_hub

            layer = self._layer(keras_hub.layers.CachedMultiHeadAttention, 1)
            tensors = self.backend.tensor(
                self._random((batch, 2, slots, heads, head)))  # (B,2,S,N,H)
            return layer, tensors
        rolling = cache == "rolling"
        layer = self._layer(keras_mha.MultiHeadAttention, 1,
                            sliding_window=slots if rolling else None)
        key, value = (self.backend.tensor(self._random(
            (batch, slots, heads, head))) for _ in range(2))  # (B, S, N, H)
        empty = layer.init_cache(batch, slots, in_place=impl == "ours")
        tensors = cache_lib.write(empty, key, value, None, 0, rolling)
        return layer, tensors

    def decode(self, unit):
        """One decode step at `position`, the cache threaded from call to
        call; or a floor (`floor`).

        The first unit of a group (`plan.decode_group`: an implementation
        in a mode, the floors with ours in the fast mode) times every unit
        of the group with `time_group`, each cache at each of its
        positions, and the group's other units report their part of that
        run: the ratios of the decode targets (a position against another,
        a cache size against another, a step against its floor) are then
        measured over the same seconds. Timed one after the other, 10
        calls each, they also carried whatever the machine did in between:
        the rolling cache's steps, which all read the same `w` slots, read
        1.03-1.31x slowest over fastest across runs (the same steps over
        200 alternate rounds: 1.02x); the eager JAX step at p = 1k in
        65,536 slots 1.16-1.58x the one in 2,048 (1.09-1.18x alternately);
        and JAX's floor at p = 64k 4.8-8.0 ms.
        """
        missing = unit["kind"] == "decode" and (
            unit["impl"] == "keras_hub" and keras_hub_missing())
        if missing:
            return {"status": plan.NOT_AVAILABLE, "reason": missing}
        group = plan.decode_group(unit)
        name = (unit["kind"], unit["cache"], unit["slots"], unit["position"])
        if self._setup_key == ("decode", group) and name in self._setup:
            return self._setup.pop(name)
        self.drop_setup()
        members = [u for u in plan.decode_units(self.name,
                                                self.config["decode"])
                   if u["kind"] in ("decode", "floor")
                   and plan.decode_group(u) == group]
        cells, caches, extra = [], {}, {}
        for member in members:
            cell = (member["kind"], member["cache"], member["slots"],
                    member["position"])
            make = (self._floor_cell if member["kind"] == "floor"
                    else self._step_cell)
            candidates, extra[cell] = make(member, caches)
            cells.append((cell, candidates))
        results = self.time_group(cells, self.config["decode"]["repeats"])
        for cell, result in results.items():
            result.update(extra[cell], ms_per_token=result["time_s"] * 1e3)
            if "read_bytes" in result:
                result["gb_per_s"] = (result["read_bytes"] / result["time_s"]
                                      / 1e9)
        self._setup_key, self._setup = ("decode", group), results
        return self._setup.pop(name)

    floor = decode

    def _step_cell(self, unit, caches):
        """`(candidates, fields)` of a decode step: its cache's calls
        (`backend.cached`, one per cache in `caches`, its state threaded)
        pointed at the unit's position first."""
        batch = self.config["batch"]
        slots = unit["slots"]
        key = (unit["cache"], slots)
        if key not in caches:
            features = self.config["num_heads"] * self.config["key_dim"]
            token = self.backend.tensor(self._random((batch, 1, features)))
            layer, tensors = self._decode_layer(unit["impl"], unit["cache"],
                                                slots)
            state = {"cache": tensors, "index": None, "mask": None}
            caches[key] = (state, self.backend.cached(
                layer, token, state, unit["mode"]), _bytes(tensors))
        state, candidates, cache_bytes = caches[key]
        mask = (self.backend.tensor(causal_cache_mask(
            batch, slots, unit["position"]))
            if unit["impl"] == "keras_hub" else None)
        at = functools.partial(_place, state,
                               self.backend.index(unit["position"]), mask)
        return ([(c, _then(at, fn)) for c, fn in candidates],
                {"cache_bytes": cache_bytes})

    def _floor_cell(self, unit, caches):
        """`(candidates, fields)` of a floor: the sums of the `reads` valid
        slots of random keys and values shaped as our cache's of `slots`
        slots, read once (its flags, a byte a slot, are left out)."""
        from keras import ops

        from keras_mha.attention import cache as cache_lib

        config = self.config
        key = ("floor", unit["cache"], unit["slots"])
        if key not in caches:
            shapes = cache_lib.cache_shapes(
                config["batch"], unit["slots"], config["num_heads"],
                config["key_dim"], config["key_dim"])[:2]  # (B, S, K, H)
            caches[key] = tuple(self.backend.tensor(self._random(shape))
                                for shape in shapes)
        cache, reads = caches[key], unit["reads"]

        def total(keys, values):
            return ops.sum(keys[:, :reads]) + ops.sum(values[:, :reads])

        candidates = (self.backend.eager(lambda: total(*cache))
                      if unit["mode"] == "eager"
                      else self.backend.core(total, cache, "forward"))
        return candidates, {
            "read_bytes": _bytes(cache) * reads // unit["slots"]}

    def generate(self, unit):
        """Greedy `GPT2CausalLM.generate` of the tiny GPT-2 (keras-hub
        compiles it: `jax.jit`, `tf.function`, torch eagerly), a prompt of
        `prompt_length` tokens filled up to `max_length`; tokens per
        second and the tokens generated.

        The first of the two `generate` units builds the model with each
        attention and times their calls alternately (`time_alternately`),
        so that the ratio of the two is measured over the same seconds;
        the other unit then reports its half of that run. Timed one after
        the other, the ratio also carried whatever the machine did between
        the two units."""
        missing = keras_hub_missing()
        if missing:
            return {"status": plan.NOT_AVAILABLE, "reason": missing}
        key = ("generate", unit["prompt_length"], unit["max_length"])
        if key == self._setup_key and unit["impl"] in self._setup:
            return self._setup.pop(unit["impl"])
        import keras_hub

        import keras_mha

        self.drop_setup()
        attentions = {"keras_hub": keras_hub.layers.CachedMultiHeadAttention,
                      "ours": keras_mha.CachedMultiHeadAttention}
        prompt, length = unit["prompt_length"], unit["max_length"]
        inputs = generate_inputs(self.config["batch"], prompt, length,
                                 plan.GPT2["vocabulary_size"])
        calls, last = [], {}
        for impl in plan.GENERATE_IMPLS:
            model = keras_hub.models.GPT2CausalLM(
                gpt2_backbone(attentions[impl]), preprocessor=None)
            model.compile(sampler="greedy")

            def run(model=model, impl=impl):
                last[impl] = model.generate(dict(inputs), stop_token_ids=None)
                return last[impl]

            calls.append((impl, run))
        results = self.time_alternately(
            calls, self.config["decode"]["generate"]["repeats"],
            "keras-hub generate")
        tokens = self.config["batch"] * (length - prompt)
        for impl, result in results.items():
            generated = np.asarray(
                self.keras.ops.convert_to_numpy(last[impl]["token_ids"]))
            result.update(tokens=tokens,
                          tokens_per_s=tokens / result["time_s"],
                          generated=generated[0, prompt:].tolist())
        self._setup_key = key
        self._setup = results
        return self._setup.pop(unit["impl"])

    def prefill(self, unit):
        """The prompt of `T` tokens through our layer: without a cache
        (`layer(x, x, use_causal_mask=True)`), or through a rolling cache
        (a window) or a full one of `T` slots at `cache_update_index=0`, a
        Python int. The first unit of a (window, mode) times both with
        `time_group` (timed one after the other, 3 calls each, TensorFlow's
        eager rolling prefill read 1.36x the forward in one run, and
        1.00x over 15 alternate rounds); the other reports its part."""
        import keras_mha

        config = self.config
        key = ("prefill", unit["w"], unit["mode"])
        if key == self._setup_key and unit["cache"] in self._setup:
            return self._setup.pop(unit["cache"])
        self.drop_setup()
        features = config["num_heads"] * config["key_dim"]
        layer = self._layer(keras_mha.MultiHeadAttention, unit["T"],
                            sliding_window=unit["w"])
        x = self.backend.tensor(self._random(
            (config["batch"], unit["T"], features)))
        state = {"cache": layer.init_cache(config["batch"], unit["T"]),
                 "index": 0, "mask": None}
        results = self.time_group([
            ("none", self.backend.eager(
                lambda: layer(x, x, use_causal_mask=True))
             if unit["mode"] == "eager"
             else self.backend.layer(layer, x, True, "forward")),
            (plan.prefill_cache(unit["w"]),
             self.backend.cached(layer, x, state, unit["mode"])),
        ], config["decode"]["prefill"]["repeats"])
        results["none"]["path"] = layer.attention_path(
            tuple(x.shape), tuple(x.shape), use_causal_mask=True)
        self._setup_key, self._setup = key, results
        return self._setup.pop(unit["cache"])


def _pair_key(unit):
    """The cell whose Keras and our layers `Worker._paired_result` times
    together."""
    return ("paired", unit["B"], unit["T"], unit["w"], unit["causal"])


# A cell without a window is timed in pairs where one call of Keras's layer
# is expected to take at most this many seconds, predicted at this rate in
# FLOP/s where no shorter T ran: a longer call's ratio is not at the mercy
# of the machine's jitter, and two such layers' warm-up, rounds and peaks
# could overrun the timed calls' deadline (`runner.timed_timeout`).
PAIRED_MAX_CALL_S = 5.0
PAIRED_SLOW_RATE = 10e9
# Rounds of a paired cell's alternate timing, at least: the same
# jitted program timed against itself there read 0.92-1.09x over 15 rounds
# on the 2-core CPU, and wider over 5.
PAIRED_ROUNDS = 15


def _timed(times, first, peak, absolute):
    """A timed unit's result: the median of `times`, the first call's time
    and the memory peak added and absolute."""
    return {"status": plan.OK, "time_s": statistics.median(times),
            "times_s": times, "repeats": len(times), "first_call_s": first,
            "peak_bytes": peak, "rss_peak_bytes": absolute}


def _place(state, index, mask):
    """Points a decode cell's threaded `state` at its step's position."""
    state["index"], state["mask"] = index, mask


def _then(before, fn):
    """`fn()` after `before()`."""
    def run():
        before()
        return fn()

    return run


def _bytes(tensors):
    """The bytes of a tensor or a tuple of them (our cache)."""
    import keras

    if isinstance(tensors, (tuple, list)):
        return sum(_bytes(tensor) for tensor in tensors)
    dtype = keras.backend.standardize_dtype(tensors.dtype)
    return int(np.prod(tensors.shape)) * np.dtype(dtype).itemsize


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
