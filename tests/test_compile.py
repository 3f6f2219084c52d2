"""Steps that compile once.

A decoding step with a tensor `cache_update_index` traces once and
compiles once under `jax.jit` and `tf.function(jit_compile=True)`, whatever
the index's value: counted over ten steps, with a Python counter in the
traced function and the backend's own count of compilations. On JAX that is
`jax.monitoring`'s backend-compile events. On TensorFlow one trace may
still compile several XLA programs: an input that an XLA op needs as a
constant (a slice's start, a shape) is compiled in as its value, so the
step recompiles for every index. The programs are counted as the distinct
HLO modules of the ten steps' arguments. Under `torch.compile`, Dynamo's
own counters: no graph is captured after the first step, and no graph
break starts in our code (Keras's layer call has its own).

A `fit` step with `jit_compile=True` of a model with every feature is
traced during the first two steps and never again.
"""

import contextlib
import functools
import logging
import os
import re

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_mha
from util import make_layer
from util import to_numpy

STEPS = 10
COMPILED = pytest.mark.skipif(
    BACKEND == "numpy", reason="NumPy has no compiler"
)


def _decoder(x, case):
    """A layer with RoPE and grouped heads, and its empty cache: ours
    `(keys, values, valid)` full or rolling, keras-hub's, or the latent
    layer's."""
    kwargs = dict(num_heads=2, key_dim=4, num_key_value_heads=1,
                  rotary_embedding=keras_mha.RotaryEmbedding())
    if case == "latent":
        layer = keras_mha.MultiHeadLatentAttention(
            num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
            qk_rope_head_dim=4, v_head_dim=4,
            rotary_embedding=keras_mha.RotaryEmbedding(),
        )
        layer.build(x.shape, x.shape)
        return layer, layer.init_cache(x.shape[0], STEPS)
    if case == "keras_hub":
        layer = keras_mha.CachedMultiHeadAttention(**kwargs)
        layer.build(x.shape, x.shape)
        return layer, layer.init_cache(x.shape[0], STEPS)
    if case == "rolling":
        kwargs["sliding_window"] = 4
    layer = make_layer(x, x, **kwargs)
    return layer, layer.init_cache(x.shape[0], STEPS)


def _counted(fn):
    """`(compiled, programs)`: `fn` compiled, and a function of the
    arguments of every call made so far that counts the programs compiled
    for them."""
    if BACKEND == "torch":
        import torch
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        compiled_fn = torch.compile(fn, backend="aot_eager")
        graphs, breaks = [], []

        def run(*args):  # decoding: no gradient, as in `generate`
            with _graph_breaks() as messages, torch.no_grad():
                out = compiled_fn(*args)
            breaks.extend(messages)
            graphs.append(counters["stats"]["unique_graphs"])
            return out

        def programs(calls):
            ours = _our_graph_breaks(breaks)
            assert not ours, ours[0]
            return len(set(graphs))

        return run, programs
    if BACKEND == "jax":
        import jax

        events = []

        def listen(event, duration, **kwargs):
            if event == "/jax/core/compile/backend_compile_duration":
                events.append(event)

        jax.monitoring.register_event_duration_secs_listener(listen)
        jitted = jax.jit(fn)

        def run(*args):  # the compilations during the step's own calls
            before = len(events)
            try:
                return jitted(*args)
            finally:
                run.compilations += len(events) - before

        run.compilations = 0

        def programs(calls):
            jax.monitoring.unregister_event_duration_listener(listen)
            assert jitted._cache_size() == 1
            return run.compilations

        return run, programs
    import tensorflow as tf

    function = tf.function(fn, jit_compile=True)

    def programs(calls):
        assert function.experimental_get_tracing_count() == 1
        return len({
            _program(function.experimental_get_compiler_ir(*args)(stage="hlo"))
            for args in calls
        })

    return function, programs


def _program(hlo):
    """An HLO module's text without what names it: its metadata and the
    names of its instructions and computations, numbered in order."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    names = {}
    return re.sub(
        r"%[\w.\-]+", lambda m: names.setdefault(m[0], f"%{len(names)}"), hlo
    )


@COMPILED
@pytest.mark.parametrize("case", ["full", "rolling", "keras_hub", "latent"])
def test_decoding_steps_compile_once(rng, case):
    """Ten steps with a tensor index: one trace, one compiled program (on
    torch: no graph after the first step), and the eager steps'
    outputs."""
    x = rng.normal(size=(2, STEPS, 8)).astype("float32")
    layer, cache = _decoder(x, case)
    traces = []

    def step(token, cache, index):
        if BACKEND != "torch":  # Dynamo guards on a list it appends to
            traces.append(1)
        if case == "keras_hub":  # keras-hub's call: the mask is the caller's
            return layer(token, token, cache=cache, cache_update_index=index)
        return layer(token, token, use_causal_mask=True, cache=cache,
                     cache_update_index=index)

    if BACKEND == "torch":  # one eager call first, as Keras's `fit` does
        step(keras.ops.convert_to_tensor(x[:, :1]), cache,
             keras.ops.convert_to_tensor(0, dtype="int32"))
    run, programs = _counted(step)
    calls, outputs = [], []
    for i in range(STEPS):
        args = (keras.ops.convert_to_tensor(x[:, i : i + 1]), cache,
                keras.ops.convert_to_tensor(i, dtype="int32"))
        calls.append(args)
        out, cache = run(*args)
        outputs.append(to_numpy(out))
    if BACKEND != "torch":
        assert len(traces) == 1
    assert programs(calls) == 1
    if case == "keras_hub":  # a step never sees the slots after it
        full = layer(x, x, attention_mask=np.tril(np.ones((STEPS,) * 2)))
    else:
        full = layer(x, x, use_causal_mask=True)
    np.testing.assert_allclose(np.concatenate(outputs, 1), to_numpy(full),
                               atol=1e-5, rtol=1e-5)


@COMPILED
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_ragged_steps_compile_once(rng, quantize):
    """Ragged steps over a paged cache, rows at different positions and
    with different numbers of new tokens from step to step (prefill
    chunks, decode steps, idle rows): one trace, one program, and the
    rows' outputs equal the eager steps'."""
    from keras_mha.attention import paged

    x = rng.normal(size=(3, 4, 8)).astype("float32")
    layer = make_layer(x, x, num_heads=2, key_dim=4, num_key_value_heads=1,
                       sliding_window=5,
                       rotary_embedding=keras_mha.RotaryEmbedding())
    table = np.arange(15, dtype="int32").reshape(3, 5)[:, ::-1].copy()
    lengths = [(4, 2, 0), (1, 2, 3), (1, 0, 1), (0, 1, 1), (1, 1, 1)]

    def step(tokens, pool, batch):
        return layer(tokens, tokens, use_causal_mask=True, cache=pool,
                     cache_update_index=batch)

    pools = [layer.init_paged_cache(16, 4, quantize=quantize)] * 2
    if BACKEND == "torch":  # one eager call first, as Keras's `fit` does
        step(x, pools[1], paged.RaggedBatch(table, np.zeros(3, "int32"),
                                            np.zeros(3, "int32")))
    run, programs = _counted(step)
    positions, calls = np.zeros(3, "int32"), []
    for count in lengths:
        batch = paged.RaggedBatch(*(keras.ops.convert_to_tensor(a) for a in (
            table, positions, np.asarray(count, "int32"))))
        args = (keras.ops.convert_to_tensor(x), pools[0], batch)
        calls.append(args)
        out, pools[0] = run(*args)
        eager, pools[1] = step(x, pools[1], batch)
        for r, n in enumerate(count):
            np.testing.assert_allclose(to_numpy(out)[r, :n],
                                       to_numpy(eager)[r, :n], atol=1e-5)
        positions += np.asarray(count, "int32")
    assert programs(calls) == 1


@COMPILED
def test_new_documents_and_prefixes_do_not_recompile(rng, monkeypatch):
    """A step whose mask reads document ids and prefix lengths, called
    with other boundaries each time: one trace, one program, on the
    block-sparse path where the compiler runs it (its block lists are
    then traced), and the eager step's numbers."""
    from keras_mha.attention import dispatch
    from keras_mha.attention import tuning

    monkeypatch.setitem(tuning.OVERRIDES, "sparse_block", 8)
    x = rng.normal(size=(2, 40, 8)).astype("float32")
    layer = make_layer(x, x, num_heads=2, key_dim=4, num_key_value_heads=1)

    def step(x, ids, prefix):
        mask = keras_mha.Causal() & keras_mha.Documents(ids) | (
            keras_mha.PrefixLM(prefix) & keras_mha.Documents(ids))
        with dispatch.force_path(dispatch.SPARSE):
            return layer(x, x, mask_mod=mask)

    if BACKEND == "torch":
        step(x, np.zeros((2, 40), "int32"), np.zeros(2, "int32"))
    run, programs = _counted(step)
    calls = []
    for bounds, prefix in (((5, 20), (3, 9)), ((17, 33), (0, 30)),
                           ((1, 2), (12, 1))):
        ids = np.zeros((2, 40), "int32")
        for bound in bounds:
            ids[:, bound:] += 1
        args = tuple(keras.ops.convert_to_tensor(a) for a in (
            x, ids, np.asarray(prefix, "int32")))
        calls.append(args)
        np.testing.assert_allclose(to_numpy(run(*args)),
                                   to_numpy(step(*args)), atol=1e-5)
    assert programs(calls) == 1


def _every_feature_model():
    """Two blocks: a causal window with sinks, RoPE and per-head RMS
    query/key norms; then full causal attention with ALiBi, chunks, the
    query temperature, YaRN and weightless L2 norms over the projections.
    Grouped heads, soft-cap and dropout in both. Compiled by `fit`
    (`jit_compile=True`)."""
    inputs = keras.Input((STEPS, 16))
    h = inputs
    blocks = (
        dict(sliding_window=4, use_sinks=True, qk_norm="rms",
             rotary_embedding=keras_mha.RotaryEmbedding()),
        dict(use_alibi=True, attention_chunk_size=4,
             query_temperature=(4.0, 0.1), qk_norm="l2",
             qk_norm_scope="projection",
             rotary_embedding=keras_mha.RotaryEmbedding(
                 rope_type="yarn", scaling_factor=4.0,
                 original_max_position_embeddings=4)),
    )
    for features in blocks:
        attention = keras_mha.MultiHeadAttention(
            num_heads=4, key_dim=4, num_key_value_heads=2, dropout=0.1,
            attn_logits_soft_cap=20.0, **features,
        )
        h = keras.layers.LayerNormalization()(
            h + attention(h, h, use_causal_mask=True)
        )
    model = keras.Model(inputs, keras.layers.Dense(16)(h))
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    return model


# The frames of Keras's own machinery for calling a layer: a graph break
# entered from our code through one of them is Keras's, not ours.
_KERAS_CALL_FRAMES = ("keras/src/utils/traceback_utils.py",
                      "keras/src/layers/layer.py",
                      "keras/src/ops/operation.py")


def _our_graph_breaks(messages):
    """The graph breaks (Dynamo's log messages) whose innermost frame in
    `keras_mha` called an op or the standard library, not a Keras layer."""
    ours = []
    for message in messages:
        frames = re.findall(r'File "([^"]+)", line (\d+)', message)
        inside = [i for i, (path, _) in enumerate(frames)
                  if f"{os.sep}keras_mha{os.sep}" in path]
        if not inside:
            continue
        after = frames[inside[-1] + 1:]
        if not after or not after[0][0].endswith(_KERAS_CALL_FRAMES):
            ours.append(message)
    return ours


@contextlib.contextmanager
def _graph_breaks():
    """Collects Dynamo's log messages of graph breaks (each with its user
    stack) into the list it yields; nothing on backends other than torch."""
    messages = []
    if BACKEND != "torch":
        yield messages
        return
    log = logging.getLogger("torch._dynamo.symbolic_convert.__graph_breaks")

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(logging.DEBUG)
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


@pytest.mark.training
@COMPILED
def test_fit_step_compiles_once(rng, monkeypatch):
    """`fit` with `jit_compile=True`: the model's step is traced during
    the first two steps and never again. Under `torch.compile`, counted by
    Dynamo's own counters, no graph break starts in our code (Keras's
    layer call and train step have their own). Dynamo runs with the
    `aot_eager` backend: the graph capture is what the layer must
    survive, and Inductor's code generation would take minutes here."""
    calls = []
    if BACKEND == "torch":
        import torch
        from torch._dynamo.utils import counters

        compile_ = torch.compile
        monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(
            fn, backend="aot_eager", **kwargs))
        torch._dynamo.reset()
        counters.clear()

        def traced():
            return (counters["frames"]["total"],
                    counters["stats"]["unique_graphs"])
    else:
        call = keras_mha.MultiHeadAttention.call

        @functools.wraps(call)  # Keras reads the signature
        def counted(self, *args, **kwargs):
            calls.append(1)  # Python runs only while a step is traced
            return call(self, *args, **kwargs)

        monkeypatch.setattr(keras_mha.MultiHeadAttention, "call", counted)

        def traced():
            return len(calls)

    model = _every_feature_model()
    x = rng.normal(size=(4, STEPS, 16)).astype("float32")
    y = rng.normal(size=(4, STEPS, 16)).astype("float32")
    before = model.get_weights()
    losses = []
    with _graph_breaks() as messages:
        for step in range(5):
            losses.append(float(model.train_on_batch(x, y)))
            if step == 1:
                after_two = traced()
    assert traced() == after_two
    assert np.isfinite(losses).all()
    changed = [not np.allclose(a, b)
               for a, b in zip(before, model.get_weights())]
    assert sum(changed) >= len(changed) - 2  # all but the key biases
    if BACKEND == "torch":
        # Keras's train step breaks at least at `loss.backward()`.
        assert messages, "the log of graph breaks was not captured"
        ours = _our_graph_breaks(messages)
        assert not ours, ours[0]
    else:
        assert after_two > 0
