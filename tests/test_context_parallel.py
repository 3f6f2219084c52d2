"""Context parallelism gives the single-device results (JAX).

One subprocess with 8 host devices (`python tests/test_context_parallel.py`
prints a JSON report) runs one model under `keras_mha.ContextParallel` on
each mesh and without a distribution: its outputs, its gradients and the
losses of 3 `fit` steps must agree. The model covers a causal window with
sinks, segment ids and RoPE (the halo exchange, several hops when a shard
is shorter than the window), full causal self-attention with grouped
heads (the ring in zig-zag order), non-causal cross-attention over a
sharded encoder output (the ring in natural order), causal multi-head
latent attention (expanded, on the ring) and keras-hub's layer
(`CachedMultiHeadAttention`, non-causal), with padding from an
`Embedding(mask_zero=True)`. A layer then decodes with a cache whose slots
are sharded, and a latent layer with its latent cache (read whole by each
device). One process and one model keep the compiles few.
"""

import contextlib
import json
import re
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import jax_child_env
from conftest import skip_unless_jax_children_here

import keras_mha
from keras_mha.attention import dispatch
from keras_mha.attention import ring
from keras_mha.attention import sharded
from keras_mha.attention.sharded import ContextPlan
from keras_mha.attention.spec import AttentionSpec

DEVICES = 8
BATCH, LENGTH, ENCODED, FEATURES, VOCAB = 4, 256, 128, 16, 11
WINDOW = 64
CHUNK = 32  # divides T / P on every mesh: chunks stay on their shard
# mesh name -> (shape, axis names); "2x2x2" shards heads with `layout_map`.
MESHES = {
    "1x8": ((1, 8), ("batch", "context")),
    "2x4": ((2, 4), ("batch", "context")),
    "2x2x2": ((2, 2, 2), ("batch", "context", "model")),
}
# The model's attention outputs, each a case of the report.
CASES = ("window", "causal", "cross", "latent", "cached", "chunked")
TOLERANCE = 1e-5
# Each compile costs seconds on CI's 2 cores: `fit` (the same gradients
# as `test_gradients`, through Keras's train step) and decoding run on the
# meshes that add something: heads sharded too, and 8 shards of slots.
FIT_MESHES = ("2x2x2",)
DECODE_MESHES = ("1x8", "2x2x2")


def _build_model():
    tokens = keras.Input((LENGTH,), dtype="int32", name="tokens")
    segments = keras.Input((LENGTH,), dtype="int32", name="segments")
    encoded = keras.Input((ENCODED, FEATURES), name="encoded")
    h = keras.layers.Embedding(VOCAB, FEATURES, mask_zero=True,
                               name="embedding")(tokens)
    window = keras_mha.MultiHeadAttention(
        4, 8, sliding_window=WINDOW, use_sinks=True,
        rotary_embedding=keras_mha.RotaryEmbedding(), name="window",
    )(h, h, use_causal_mask=True, segment_ids=segments)
    h = keras.layers.LayerNormalization(name="norm")(h + window)
    causal = keras_mha.MultiHeadAttention(
        4, 8, num_key_value_heads=2,
        rotary_embedding=keras_mha.RotaryEmbedding(), name="causal",
    )(h, h, use_causal_mask=True)
    h = h + causal
    cross = keras_mha.MultiHeadAttention(4, 8, name="cross")(h, encoded)
    h = h + cross
    latent = keras_mha.MultiHeadLatentAttention(
        4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=8, q_lora_rank=8,
        rotary_embedding=keras_mha.RotaryEmbedding(interleaved=True),
        name="latent",
    )(h, h, use_causal_mask=True)
    h = h + latent
    cached = keras_mha.CachedMultiHeadAttention(4, 8, name="cached")(h, h)
    h = h + cached
    chunked = keras_mha.MultiHeadAttention(
        4, 8, attention_chunk_size=CHUNK,
        rotary_embedding=keras_mha.RotaryEmbedding(), name="chunked",
    )(h, h, use_causal_mask=True)
    out = keras.layers.Dense(FEATURES, name="out")(h + chunked)
    model = keras.Model(
        [tokens, segments, encoded],
        {"window": window, "causal": causal, "cross": cross,
         "latent": latent, "cached": cached, "chunked": chunked, "out": out},
    )
    rng = np.random.default_rng(0)
    model.set_weights([
        rng.normal(scale=0.2, size=w.shape).astype("float32")
        for w in model.get_weights()
    ])
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"out": "mse"},
    )
    return model


def _data(batches=1):
    rng = np.random.default_rng(1)
    size = BATCH * batches
    tokens = rng.integers(1, VOCAB, size=(size, LENGTH)).astype("int32")
    tokens[:, -37:] = 0  # padding at the end, across shards
    tokens[1, :5] = 0  # and at the start
    # Packed documents whose boundaries fall inside and between shards.
    segments = np.cumsum(rng.random((size, LENGTH)) < 0.01, axis=1)
    encoded = rng.normal(size=(size, ENCODED, FEATURES)).astype("float32")
    target = rng.normal(size=(size, LENGTH, FEATURES)).astype("float32")
    return [tokens, segments.astype("int32"), encoded], target


def _results(distribution, fit=True):
    """Outputs and gradients (one compile), then 3 `fit` steps."""
    import jax
    import jax.numpy as jnp

    inputs, target = _data()
    if distribution is None:
        model = _build_model()
        placed = inputs
    else:
        with distribution.scope():
            model = _build_model()
        placed = [
            jax.device_put(
                x, distribution.get_data_layout(x.shape).backend_layout
            )
            for x in inputs
        ]
    scope = distribution.scope() if distribution else _nothing()
    with scope:
        trainable = [v.value for v in model.trainable_variables]
        others = [v.value for v in model.non_trainable_variables]

        def loss(trainable):
            result, _ = model.stateless_call(trainable, others, placed)
            return jnp.mean(jnp.square(result["out"] - target)), result

        gradients, outputs = jax.jit(jax.grad(loss, has_aux=True))(trainable)
        history = None
        if fit:
            x, y = _data(3)
            history = model.fit(x, {"out": y}, batch_size=BATCH, epochs=1,
                                shuffle=False, verbose=0)
    names = [v.path for v in model.trainable_variables]
    assert len(set(names)) == len(names), names
    return (
        {name: np.asarray(outputs[name]) for name in (*CASES, "out")},
        {name: np.asarray(g) for name, g in zip(names, gradients)},
        # One epoch of 3 steps: Keras reports the running mean; the
        # per-step losses are compared through it and the weights.
        history and {"loss": history.history["loss"],
                     "weights": [np.asarray(w) for w in model.get_weights()]},
    )


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _diff(actual, expected):
    return float(np.max(np.abs(actual - expected) / (1 + np.abs(expected))))


def _distribution(mesh_name):
    import jax

    shape, axes = MESHES[mesh_name]
    mesh = keras.distribution.DeviceMesh(shape, axes, jax.devices())
    layout_map = None
    if "model" in axes:
        layout_map = keras_mha.layout_map(mesh, "model")
    return keras_mha.ContextParallel(mesh, layout_map=layout_map)


def _errors(mesh_name):
    """The messages of the errors raised at call time on this mesh."""
    distribution = _distribution(mesh_name)
    calls = {
        # 2 tokens more than a multiple of 4: no shard layout.
        "indivisible": (dict(sliding_window=8), LENGTH + 2, False),
        # A multiple of 4, not of 8: no zig-zag layout.
        "zigzag": ({}, LENGTH + 4, True),
    }
    found = {}
    with distribution.scope():
        for name, (kwargs, length, causal) in calls.items():
            layer = keras_mha.MultiHeadAttention(2, 4, **kwargs)
            x = np.zeros((2, length, 8), "float32")
            try:
                layer(x, x, use_causal_mask=causal)
            except ValueError as error:
                found[name] = str(error)
    return found


# Decoding layers: a full cache, a rolling cache of `DECODE_WINDOW` slots
# (the prompt is longer: the steps go round the ring), and a latent cache.
DECODE_KINDS = ("full", "rolling", "latent")
DECODE_WINDOW = 16


def _decode(distribution, kind):
    """A causal prompt with a cache, then 3 one-token steps under `jit`:
    the outputs, the cache's layout after the steps, and how many times
    the steps were traced through `sharded.cached_decode`."""
    import jax

    if kind == "latent":
        layer = keras_mha.MultiHeadLatentAttention(
            4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
            v_head_dim=8, rotary_embedding=keras_mha.RotaryEmbedding(),
            name="latent_decode",
        )
    else:
        window = DECODE_WINDOW if kind == "rolling" else None
        layer = keras_mha.MultiHeadAttention(
            4, 8, num_key_value_heads=2, use_sinks=True,
            sliding_window=window,
            rotary_embedding=keras_mha.RotaryEmbedding(), name="decode",
        )
    prompt = LENGTH // 4
    x = np.random.default_rng(3).normal(size=(BATCH, prompt + 3, FEATURES))
    x = x.astype("float32")
    layer.build(x.shape, x.shape)
    rng = np.random.default_rng(4)
    layer.set_weights([rng.normal(scale=0.2, size=w.shape).astype("float32")
                       for w in layer.get_weights()])
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        cache = layer.init_cache(BATCH, LENGTH // 2)
        out, cache = layer(x[:, :prompt], x[:, :prompt], use_causal_mask=True,
                           cache=cache, cache_update_index=0)
        outputs = [np.asarray(out)]
        step = jax.jit(lambda q, c, i: layer(q, q, use_causal_mask=True,
                                             cache=c, cache_update_index=i))
        with _counting(sharded, "cached_decode") as sharded_steps:
            for t in range(prompt, prompt + 3):
                out, cache = step(x[:, t:t + 1], cache, np.int32(t))
                outputs.append(np.asarray(out))
    layout = getattr(cache[0].sharding, "spec", None)
    return np.concatenate(outputs, axis=1), str(layout), sharded_steps[0]


@contextlib.contextmanager
def _counting(module, name):
    """Counts the calls of `module.name` in the block (traces, under
    `jit`): `[count]`."""
    original, count = getattr(module, name), [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield count
    finally:
        setattr(module, name, original)


HLO_WINDOW = 32  # w; shards of T / P = 64 tokens on 8 devices
_COLLECTIVE = re.compile(
    r"= \(?(\w+)\[([\d,]*)\][^=]*? "
    r"(collective-permute|all-gather|all-to-all|all-reduce|reduce-scatter)"
    r"(?:-start)?\("
)


def collectives(hlo_text):
    """`[(op, dtype, shape)]` of the collectives in compiled HLO text."""
    return [
        (op, dtype, [int(d) for d in dims.split(",") if d])
        for dtype, dims, op in _COLLECTIVE.findall(hlo_text)
    ]


def _hlo(**options):
    """The collectives of a causal layer's compiled forward on 1x8, with
    `options` (a window by default)."""
    import jax

    distribution = _distribution("1x8")
    layer = keras_mha.MultiHeadAttention(
        4, 8, **(options or {"sliding_window": HLO_WINDOW}))
    x = np.zeros((2, 64 * DEVICES, FEATURES), "float32")
    layer.build(x.shape, x.shape)
    placed = jax.device_put(
        x, distribution.get_data_layout(x.shape).backend_layout
    )
    with distribution.scope():
        forward = jax.jit(lambda x: layer(x, x, use_causal_mask=True))
        text = forward.lower(placed).compile().as_text()
    return collectives(text)


def _docs_example():
    """The docs' example (docs/scaling.md) on these 8 devices."""
    import io

    page = pathlib.Path(__file__).resolve().parents[1] / "docs/scaling.md"
    section = page.read_text(encoding="utf-8").split(
        "## Context parallelism", 1
    )[1]
    code = re.search(r"^```python\n(.*?)^```", section, re.S | re.M).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(page), "exec"), {"__name__": "__docs__"})
    return printed.getvalue().strip()


def main():
    import jax

    assert len(jax.devices()) == DEVICES, jax.devices()
    single = _results(None)
    single_decode = {kind: _decode(None, kind)[0] for kind in DECODE_KINDS}
    report = {}
    for mesh_name in MESHES:
        outputs, gradients, fit = _results(_distribution(mesh_name),
                                           fit=mesh_name in FIT_MESHES)
        report[mesh_name] = {
            "outputs": {
                name: _diff(outputs[name], single[0][name])
                for name in outputs
            },
            "gradients": {
                name: _diff(gradients[name], single[1][name])
                for name in gradients
            },
            "gradient_size": max(
                float(np.max(np.abs(g))) for g in single[1].values()
            ),
        }
        if fit:
            report[mesh_name]["losses"] = [fit["loss"], single[2]["loss"]]
            report[mesh_name]["weights"] = max(
                _diff(a, b) for a, b in zip(fit["weights"], single[2]["weights"])
            )
        if mesh_name in DECODE_MESHES:
            report[mesh_name]["decode"] = {}
            for kind in DECODE_KINDS:
                decoded, layout, traced = _decode(_distribution(mesh_name),
                                                  kind)
                report[mesh_name]["decode"][kind] = (
                    _diff(decoded, single_decode[kind]), layout, traced)
    report["errors"] = _errors("2x4")
    report["hlo"] = _hlo()
    # Chunks of 32 and of 128 over shards of 64 tokens.
    report["hlo_chunks"] = {chunk: _hlo(attention_chunk_size=chunk)
                            for chunk in (32, 128)}
    report["docs"] = _docs_example()
    print("REPORT " + json.dumps(report))


@pytest.fixture(scope="module")
def report():
    skip_unless_jax_children_here()
    env = jax_child_env(DEVICES)
    result = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).resolve())],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    lines = [line for line in result.stdout.splitlines()
             if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.parametrize("mesh", list(MESHES))
class TestSameAsOneDevice:
    @pytest.mark.parametrize("case", [*CASES, "out"])
    def test_outputs(self, report, mesh, case):
        assert report[mesh]["outputs"][case] < TOLERANCE, report[mesh]

    def test_gradients(self, report, mesh):
        gradients = report[mesh]["gradients"]
        assert report[mesh]["gradient_size"] > 1e-3  # else nothing to compare
        assert {name.split("/")[0] for name in gradients} >= set(CASES)
        worst = max(gradients, key=gradients.get)
        assert gradients[worst] < TOLERANCE, (worst, gradients[worst])


@pytest.mark.parametrize("kind", DECODE_KINDS)
@pytest.mark.parametrize("mesh", DECODE_MESHES)
def test_decode_with_a_sharded_cache(report, mesh, kind):
    """A prompt attended context-parallel, then steps over a cache whose
    slots each device holds a part of: a full cache, a rolling one (the
    steps wrap round its slots) and a latent one (absorbed steps)."""
    error, layout, traced = report[mesh]["decode"][kind]
    assert error < TOLERANCE
    # The steps read the cache shard by shard, and its slots stayed sharded
    # over the context axis.
    assert traced > 0
    assert "'context'" in layout


@pytest.mark.parametrize("mesh", FIT_MESHES)
def test_fit(report, mesh):
    losses, single = report[mesh]["losses"]
    np.testing.assert_allclose(losses, single, rtol=TOLERANCE)
    assert report[mesh]["weights"] < TOLERANCE


def test_indivisible_length(report):
    message = report["errors"]["indivisible"]
    assert "multiple of the context axis size 4" in message
    assert f"T={LENGTH + 2}" in message


def test_zigzag_length(report):
    message = report["errors"]["zigzag"]
    assert "multiple of twice the context axis size, 8" in message
    assert f"T={LENGTH + 4}" in message


def _free_port():
    import socket

    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def test_two_processes():
    """Two processes on localhost (`keras.distribution.initialize`, JAX's
    CPU collectives), the context axis across both: the outputs and
    gradients of one device (`tests/context_two_processes.py`)."""
    skip_unless_jax_children_here()
    env = jax_child_env(2)
    script = pathlib.Path(__file__).resolve().parent / "context_two_processes.py"
    port = str(_free_port())
    processes = [
        subprocess.Popen([sys.executable, str(script), port, str(rank)],
                         env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    reports = []
    for process, output in zip(processes, outputs):
        lines = [line for line in output.splitlines()
                 if line.startswith("REPORT ")]
        assert process.returncode == 0 and lines, output[-4000:]
        reports.append(json.loads(lines[-1][len("REPORT "):]))
    for report in reports:
        assert report["devices"] == 4
        assert report["difference"] < TOLERANCE, reports


def test_windowed_forward_sends_only_the_halo(report):
    """The compiled program of a windowed forward: collective-permutes of
    `w - 1` rows (keys, values and their validity), no gather of the
    sequence."""
    found = report["hlo"]
    assert found, "no collective at all: the halo was not exchanged"
    assert {op for op, _, _ in found} == {"collective-permute"}, found
    rows = {shape[1] for _, _, shape in found}
    assert rows == {HLO_WINDOW - 1}, found  # O(w), not T / P = 64


def test_chunks_within_shards_need_no_exchange(report):
    """Chunks that `T / P` holds whole: each device attends to its own
    tokens, and the compiled forward has no collective. Chunks that cross
    shards run on the whole sequence, which XLA gathers."""
    assert report["hlo_chunks"]["32"] == []
    assert "all-gather" in {op for op, _, _ in report["hlo_chunks"]["128"]}


def test_docs_example_on_8_devices(report):
    assert report["docs"] == f"(2, {64 * DEVICES}, 1000)"


def _mesh(shape=(2, 4), axes=("batch", "context")):
    # Device names only: nothing is placed.
    devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
    return keras.distribution.DeviceMesh(shape, axes, devices=devices)


class TestErrors:
    def test_unknown_axis(self):
        with pytest.raises(ValueError, match="Received: context_dim_name='seq'"):
            keras_mha.ContextParallel(_mesh(), context_dim_name="seq")
        with pytest.raises(ValueError, match="Received: batch_dim_name='data'"):
            keras_mha.ContextParallel(_mesh(), batch_dim_name="data")

    def test_same_axis_twice(self):
        with pytest.raises(ValueError, match="must differ"):
            keras_mha.ContextParallel(_mesh(), batch_dim_name="context")

    def test_layout_map_on_another_mesh(self):
        other = keras.distribution.LayoutMap(_mesh())
        with pytest.raises(ValueError, match="layout_map.device_mesh"):
            keras_mha.ContextParallel(_mesh(), layout_map=other)

    @pytest.mark.skipif(keras.backend.backend() == "jax",
                        reason="the error of the other backends")
    def test_other_backends_raise(self):
        layer = keras_mha.MultiHeadAttention(2, 4)
        x = np.zeros((1, 8, 8), "float32")
        layer(x, x)
        with keras_mha.ContextParallel(_mesh((1, 2))).scope():
            with pytest.raises(NotImplementedError,
                               match="Keras's distribution API is JAX-only"):
                layer(x, x)


class TestLayout:
    """The data layout and the routes, from shapes alone."""

    def test_data_layout(self):
        distribution = keras_mha.ContextParallel(_mesh())
        assert distribution.context_size == 4
        assert distribution.get_data_layout((8, 16, 3)).axes == (
            "batch", "context", None
        )
        assert distribution.get_data_layout((8,)).axes == ("batch",)
        # An axis 1 the context axis does not divide is not split.
        assert distribution.get_data_layout((8, 6)).axes == ("batch", None)

    @pytest.mark.parametrize(
        "changes, route",
        [
            (dict(window=(63, 0), causal=True), dispatch.HALO),
            (dict(window=(40, 20)), dispatch.HALO),
            (dict(causal=True), dispatch.RING),
            (dict(), dispatch.RING),
            (dict(window=(63, 0), return_weights=True), None),
            (dict(window=(63, 0), dropout=0.1), None),
            # Shards of 16 tokens: chunks of 16 stay on theirs, chunks
            # of 32 are cut (the whole sequence).
            (dict(causal=True, chunk=16), dispatch.HALO),
            (dict(causal=True, chunk=32), None),
        ],
        ids=["causal_window", "two_sided", "full_causal", "full", "weights",
             "dropout", "chunk_within_shards", "chunk_across_shards"],
    )
    def test_routes(self, changes, route):
        plan = ContextPlan(mesh=None, batch_axis="batch",
                           context_axis="context", size=4)
        spec = AttentionSpec(scale=1.0, sharding=plan, **changes)
        shapes = dispatch.Shapes(64, 64, 8, 8)
        assert dispatch.context_route(spec, shapes) == route
        # Cross-attention with a window: the ring, the masks at positions;
        # with chunks, the whole sequence.
        if route is not None:
            assert dispatch.context_route(
                spec, dispatch.Shapes(64, 32, 8, 8)
            ) == (None if spec.chunk else dispatch.RING)
        assert dispatch.context_route(spec.replace(sharding=None), shapes) \
            is None


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_zigzag_moves(size):
    """Device `d` ends with chunks `d` and `2P - 1 - d`, and back."""
    held = {d: [2 * d, 2 * d + 1] for d in range(size)}  # natural order
    zigzag = {d: [None, None] for d in range(size)}
    for (half, slot), pairs in ring.zigzag_moves(size).items():
        assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) \
            == len(pairs)  # one ppermute: a permutation
        for source, target in pairs:
            assert zigzag[target][slot] is None
            zigzag[target][slot] = held[source][half]
    assert zigzag == {d: [d, 2 * size - 1 - d] for d in range(size)}


if __name__ == "__main__":
    main()
