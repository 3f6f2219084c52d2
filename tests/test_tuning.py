"""The tuning table, the platform, and the dispatch rule on each platform.

The table (`tuning.py`): every entry resolves, says why in one line and
names the benchmark that measures it; overrides win. The platform
(`tuning.device_platform`): read from the tensors, faked with
`tuning.assume_platform`. The rule (`dispatch.choose_path`) on CPUs, GPUs
and TPUs, on both sides of every threshold, for every backend's name.
JAX's native window path (`fused_window`), forced on this machine, against
the float64 reference.
"""

import pathlib
import re
import types
from unittest import mock

import keras
import numpy as np
import pytest
from conftest import BACKEND
from util import assert_close
from util import attention_spec
from util import layer_gradients
from util import make_layer
from util import random_inputs
from util import reference
from util import to_numpy

from keras_mha import attention as attention_lib
from keras_mha.attention import AttentionSpec
from keras_mha.attention import dispatch
from keras_mha.attention import explicit
from keras_mha.attention import fused
from keras_mha.attention import tuning

BACKENDS = ("jax", "tensorflow", "torch", "numpy")
KERNEL_BACKENDS = ("jax", "tensorflow", "torch")
CPU, GPU, TPU = tuning.CPU, tuning.GPU, tuning.TPU
PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_mha"


def _setting(name, backend="jax", platform=CPU):
    return tuning.value(name, backend=backend, platform=platform)


# ------------------------------------------------------------------ the table


class TestTable:
    def test_every_entry_says_why_and_names_its_benchmark(self):
        diary = re.compile(
            r"earlier|session|machine|AVX|yesterday|\b[0-9a-f]{7,40}\b", re.I
        )
        for name, backend, platform, _, reason, benchmark in tuning.rows():
            where = (name, backend, platform)
            assert backend in BACKENDS + (tuning.ANY,), where
            assert platform in tuning.PLATFORMS + (tuning.ANY,), where
            assert reason and "\n" not in reason, where
            assert not diary.search(reason), where
            assert "python -m benchmarks" in benchmark or benchmark == "none", (
                where)

    def test_every_setting_is_read_by_the_library(self):
        sources = "\n".join(
            path.read_text(encoding="utf-8")
            for path in PACKAGE.rglob("*.py") if path.name != "tuning.py"
        )
        unread = [name for name in tuning.TABLE if f'"{name}"' not in sources]
        assert unread == []

    def test_every_setting_resolves_where_it_is_read(self):
        for name, entries in tuning.TABLE.items():
            backends = {backend for backend, _ in entries}
            if tuning.ANY in backends:
                backends = set(BACKENDS)
            for backend in sorted(backends):
                for platform in tuning.PLATFORMS:
                    tuning.entry(name, backend, platform)  # no error

    def test_lookup_takes_the_most_specific_key(self, monkeypatch):
        any_ = tuning.ANY
        monkeypatch.setitem(tuning.TABLE, "blocked_block", {
            ("jax", GPU): tuning.Entry(1, "a", "none"),
            ("jax", any_): tuning.Entry(2, "b", "none"),
            (any_, GPU): tuning.Entry(3, "c", "none"),
            (any_, any_): tuning.Entry(4, "d", "none"),
        })
        for backend, platform, expected in (
            ("jax", GPU, 1), ("jax", TPU, 2), ("torch", GPU, 3),
            ("torch", CPU, 4),
        ):
            assert _setting("blocked_block", backend, platform) == expected

    def test_a_setting_without_a_value_here_is_an_error(self):
        with pytest.raises(ValueError, match="capped_chunk.*backend='jax'"):
            tuning.entry("capped_chunk", "jax", CPU)
        with pytest.raises(ValueError, match="name='block_size'"):
            tuning.value("block_size")

    def test_overrides_win_on_every_backend_and_platform(self, monkeypatch):
        monkeypatch.setitem(tuning.OVERRIDES, "blocked_min_length", 7)
        for backend in BACKENDS:
            for platform in tuning.PLATFORMS:
                assert _setting("blocked_min_length", backend, platform) == 7
        assert tuning.entry("blocked_min_length", "jax", CPU).value == 512
        spec = AttentionSpec(scale=1.0, causal=True)
        shapes = dispatch.Shapes(7, 7, 4, 4)
        assert dispatch.choose_path(spec, shapes, "jax", CPU) == dispatch.BLOCKED

    def test_environment_pairs(self):
        parsed = tuning._from_environment(
            " blocked_block=128, decode_whole_from=none,"
            "dense_scores_budget=inf , explicit_cached_step=TRUE,"
            "decode_whole_from=0.5,"
        )
        assert parsed == {
            "blocked_block": 128, "decode_whole_from": 0.5,
            "dense_scores_budget": float("inf"), "explicit_cached_step": True,
        }
        assert tuning._from_environment("") == {}
        for text in ("block_size=1", "blocked_block", "blocked_block=big"):
            with pytest.raises(ValueError, match="KERAS_MHA_TUNING|Received"):
                tuning._from_environment(text)


# --------------------------------------------------------------- the platform


class TestPlatform:
    def test_device_kinds(self):
        for kind, expected in (
            ("cpu", CPU), ("CPU", CPU), ("gpu", GPU), ("cuda", GPU),
            ("rocm", GPU), ("mps", GPU), ("tpu", TPU), ("TPU", TPU),
            ("xla", TPU),
        ):
            assert tuning._named(kind) == expected, kind

    def test_what_each_backend_reads_from_a_tensor(self):
        def torch_like(kind):
            return types.SimpleNamespace(device=types.SimpleNamespace(type=kind))

        def tf_like(device):
            return types.SimpleNamespace(device=device)

        for backend, x, expected in (
            ("torch", torch_like("cuda"), GPU),
            ("torch", torch_like("cpu"), CPU),
            ("torch", torch_like("meta"), None),  # symbolic: the default
            ("tensorflow", tf_like("/job:localhost/replica:0/task:0/"
                                   "device:GPU:0"), GPU),
            ("tensorflow", tf_like("/job:w/replica:0/task:0/device:TPU:3"),
             TPU),
            ("tensorflow", tf_like("/device:CPU:0"), CPU),
            ("tensorflow", tf_like(""), None),  # in a graph: the default
            ("numpy", np.zeros(1), CPU),
        ):
            assert tuning._tensor_platform(backend, x) == expected, (backend, x)

    def test_a_tensor_placed_on_the_cpu(self):
        with keras.device("cpu:0"):
            x = keras.ops.zeros((2, 3))
        assert tuning.device_platform(x) == CPU
        with tuning.assume_platform(GPU):
            assert tuning.device_platform(x) == GPU

    def test_assume_platform_nests_and_restores(self):
        before = tuning.device_platform()
        with tuning.assume_platform(TPU):
            with tuning.assume_platform(GPU):
                assert tuning.device_platform() == GPU
            assert tuning.device_platform() == TPU
        assert tuning.device_platform() == before
        with pytest.raises(ValueError, match="platform='cuda'"):
            with tuning.assume_platform("cuda"):
                pass


# -------------------------------------------------------------------- the rule


def _path(platform, backend="jax", length=4096, s_len=None, key_dim=4,
          value_dim=4, batch=1, heads=4, **fields):
    spec = AttentionSpec(scale=1.0, **fields)
    shapes = dispatch.Shapes(length, s_len or length, key_dim, value_dim,
                             batch, heads)
    return dispatch.choose_path(spec, shapes, backend=backend,
                                platform=platform)


def _bias(length):
    return np.zeros((1, 1, 1, length), "float32")


def _banded_sides(backend, platform):
    """`(window, S, banded)` on both sides of `banded_min_ratio` (w = 100)
    and of `banded_min_length` (w = 2), causal windows `(w - 1, 0)`."""
    ratio = _setting("banded_min_ratio", backend, platform)
    length = _setting("banded_min_length", backend, platform)
    return [
        ((99, 0), ratio * 100 - 1, False), ((99, 0), ratio * 100, True),
        ((1, 0), length - 1, False), ((1, 0), length, True),
    ]


class TestRuleOnCpu:
    """The fastest path, as the table measured it."""

    @pytest.mark.parametrize("backend", KERNEL_BACKENDS)
    def test_causal_thresholds(self, backend):
        def path(length, **fields):
            return _path(CPU, backend, length, causal=True, **fields)

        at = _setting("blocked_min_length", backend)
        # torch's kernel never writes the scores: the blocks only for what
        # it cannot take. No kernel takes a soft-cap: the blocks, else the
        # scores.
        blocked = dispatch.BLOCKED if backend != "torch" else dispatch.FUSED
        assert path(at) == blocked
        assert path(at - 1) == dispatch.FUSED
        assert path(at, soft_cap=2.0) == dispatch.BLOCKED
        assert path(at - 1, soft_cap=2.0) == dispatch.EXPLICIT
        tri = _setting("triangular_min_length", backend)
        if backend == "jax":
            assert path(tri, bias=_bias(tri)) == dispatch.TRIANGULAR
            assert path(tri - 1, bias=_bias(tri - 1)) == dispatch.FUSED
        else:
            assert tri == float("inf")
            assert path(8192, bias=_bias(8192)) == dispatch.FUSED

    @pytest.mark.parametrize("backend", KERNEL_BACKENDS)
    def test_window_thresholds(self, backend):
        for window, length, banded in _banded_sides(backend, CPU):
            assert _path(CPU, backend, length, causal=True, window=window) == (
                dispatch.BANDED if banded else dispatch.FUSED
            ), (window, length)

    def test_numpy_runs_the_kernel(self):
        assert _path(CPU, "numpy", 16384, causal=True) == dispatch.FUSED

    def test_no_native_window_on_cpu(self):
        for backend in KERNEL_BACKENDS:
            assert _path(CPU, backend, 64, causal=True, window=(7, 0)) == (
                dispatch.FUSED)


@pytest.mark.parametrize("platform", [GPU, TPU])
class TestRuleWhereNothingIsMeasured:
    """Keras's layer's kernel for what it fuses; the CPU's rule for the
    rest."""

    @pytest.mark.parametrize("backend", KERNEL_BACKENDS)
    def test_causal_goes_to_the_kernel(self, platform, backend):
        at = _setting("blocked_min_length", backend, platform)
        for length in (at - 1, at, 16384):
            for fields in ({}, {"flash_attention": True},
                           {"flash_attention": False},
                           {"query_mask": np.ones((1, length), bool)},
                           {"attention_mask": np.ones((1, 1, 1, length),
                                                      bool)}):
                assert _path(platform, backend, length, causal=True,
                             **fields) == dispatch.FUSED, (length, fields)

    @pytest.mark.parametrize("backend", KERNEL_BACKENDS)
    def test_windows_below_the_budget(self, platform, backend):
        native = backend == "jax" and platform == GPU
        for window, length, _ in _banded_sides(backend, platform):
            assert _path(platform, backend, length, causal=True,
                         window=window) == (
                dispatch.FUSED_WINDOW if native else dispatch.FUSED
            ), (window, length)
            # With padding, Keras's layer passes the window as a mask.
            assert _path(platform, backend, length, causal=True,
                         window=window, key_mask=np.ones((1, length), bool)
                         ) == dispatch.FUSED

    @pytest.mark.parametrize("backend", KERNEL_BACKENDS)
    def test_windows_on_both_sides_of_the_budget(self, platform, backend):
        budget = _setting("dense_scores_budget", backend, platform)
        length = 1024
        heads = budget // (4 * length * length)  # scores of exactly <= budget
        assert heads >= 1
        native = backend == "jax" and platform == GPU
        assert _path(platform, backend, length, heads=heads, causal=True,
                     window=(127, 0)) == (
            dispatch.FUSED_WINDOW if native else dispatch.FUSED)
        over = dict(heads=heads + 1, causal=True)
        assert _path(platform, backend, length, window=(127, 0), **over) == (
            dispatch.BANDED)
        assert _path(platform, backend, length, window=(127, 127),
                     key_mask=np.ones((1, length), bool), **over) == (
            dispatch.BANDED)
        # No window: the kernel, whatever the size.
        assert _path(platform, backend, length, **over) == dispatch.FUSED
        # A dense mask: no band can serve it.
        assert _path(platform, backend, length, window=(127, 0),
                     attention_mask=np.ones((1, 1, length, length), bool),
                     **over) == dispatch.FUSED

    def test_what_keras_does_not_fuse_takes_the_cpu_rule(self, platform):
        at = {b: _setting("blocked_min_length", b, platform)
              for b in KERNEL_BACKENDS}
        tri = _setting("triangular_min_length", "jax", platform)
        ones = np.ones((1, 4096), "int32")
        for backend, length, fields, expected in (
            ("jax", at["jax"], {"alibi": (0.5,) * 4}, dispatch.BLOCKED),
            ("jax", at["jax"] - 1, {"alibi": (0.5,) * 4}, dispatch.FUSED),
            ("jax", at["jax"], {"sinks": np.zeros(4, "float32")},
             dispatch.BLOCKED),
            ("jax", 4096, {"segment_ids": ones, "key_segment_ids": ones},
             dispatch.BLOCKED),
            ("tensorflow", at["tensorflow"], {"alibi": (0.5,) * 4},
             dispatch.BLOCKED),
            ("tensorflow", at["tensorflow"] - 1, {"alibi": (0.5,) * 4},
             dispatch.FUSED),
            ("torch", at["torch"], {"soft_cap": 2.0}, dispatch.BLOCKED),
            ("torch", at["torch"] - 1, {"soft_cap": 2.0}, dispatch.EXPLICIT),
            ("torch", at["torch"], {"alibi": (0.5,) * 4}, dispatch.FUSED),
            ("jax", tri, {"bias": _bias(tri)}, dispatch.TRIANGULAR),
            ("jax", tri - 1, {"bias": _bias(tri - 1)}, dispatch.FUSED),
            ("jax", 4096, {"return_weights": True}, dispatch.EXPLICIT),
            ("torch", 4096, {"dropout": 0.1}, dispatch.EXPLICIT),
        ):
            assert _path(platform, backend, length, causal=True,
                         **fields) == expected, (backend, length, fields)
        # Head sizes JAX's kernel cannot take: the CPU's rule.
        assert _path(platform, "jax", at["jax"], causal=True,
                     value_dim=8) == dispatch.BLOCKED
        assert _path(platform, "jax", at["jax"] - 1, causal=True,
                     value_dim=8) == dispatch.EXPLICIT
        # A window with sinks: the band where it pays off.
        for window, length, banded in _banded_sides("jax", platform):
            assert _path(platform, "jax", length, causal=True, window=window,
                         sinks=np.zeros(4, "float32")) == (
                dispatch.BANDED if banded else dispatch.FUSED
            ), (window, length)

    def test_native_window_conditions(self, platform):
        def window_path(length=64, s_len=None, backend="jax", **fields):
            return _path(platform, backend, length, s_len,
                         **{"window": (7, 0), "causal": True, **fields})

        native = dispatch.FUSED_WINDOW if platform == GPU else dispatch.FUSED
        assert window_path() == native
        assert window_path(causal=False, window=(7, 7)) == native
        assert window_path(length=24, s_len=16, causal=False,
                           window=(8, 8)) == native  # T = S + left
        for blocker in (
            dict(length=25, s_len=16, causal=False, window=(8, 8)),  # a row
            dict(query_mask=np.ones((1, 64), bool)),  # without keys
            dict(segment_ids=np.ones((1, 64), "int32"),
                 key_segment_ids=np.ones((1, 64), "int32")),
            dict(attention_mask=np.ones((1, 1, 64, 64), bool)),
            dict(query_offset=3),
            dict(flash_attention=True),
            dict(flash_attention=False),
            dict(backend="torch"),
            dict(backend="tensorflow"),
        ):
            assert window_path(**blocker) != dispatch.FUSED_WINDOW, blocker

    def test_the_rule_reads_the_assumed_platform(self, platform):
        spec = AttentionSpec(scale=1.0, causal=True)
        shapes = dispatch.Shapes(4096, 4096, 4, 4)
        with tuning.assume_platform(platform):
            assert dispatch.choose_path(spec, shapes, "jax") == dispatch.FUSED
        with tuning.assume_platform(CPU):
            assert dispatch.choose_path(spec, shapes, "jax") == (
                dispatch.BLOCKED)

    def test_the_layer_asks_the_rule_on_its_platform(self, rng, platform):
        query, value = random_inputs(rng, batch=1, query_length=4)
        layer = make_layer(query, value, num_heads=2, key_dim=4)
        shape = (1, 16384, 8)
        with tuning.assume_platform(platform):
            assert layer.attention_path(shape, shape, use_causal_mask=True) \
                == dispatch.FUSED
        with tuning.assume_platform(CPU):
            assert layer.attention_path(shape, shape, use_causal_mask=True) \
                == dispatch.choose_path(
                    AttentionSpec(scale=0.5, causal=True),
                    dispatch.Shapes(16384, 16384, 4, 4), platform=CPU)


# ----------------------------------------------------- JAX's native window path

jax_only = pytest.mark.skipif(
    BACKEND != "jax", reason="JAX's kernel is the one with a window"
)


def _spy():
    return mock.patch.object(
        attention_lib, "fused_window_attention",
        wraps=attention_lib.fused_window_attention,
    )


@jax_only
class TestFusedWindow:
    @pytest.mark.parametrize(
        "window, causal, key_length",
        [
            (3, True, 12),  # (2, 0)
            (3, False, 12),  # (2, 2)
            ((4, 1), False, 12),
            ((2, 5), False, 16),  # cross-attention, T < S
            ((6, 0), False, 8),  # T = 12 > S: every query keeps a key
        ],
    )
    def test_forced_matches_reference(self, rng, window, causal, key_length):
        query, value = random_inputs(rng, batch=2, query_length=12,
                                     key_length=key_length)
        layer = make_layer(query, value, num_heads=4, key_dim=4,
                           num_key_value_heads=2, sliding_window=window)
        expected, _ = reference(layer, query, value, use_causal_mask=causal)
        with dispatch.force_path(dispatch.FUSED_WINDOW), _spy() as spy:
            assert layer.attention_path(
                query.shape, value.shape, use_causal_mask=causal
            ) == dispatch.FUSED_WINDOW
            output = layer(query, value, use_causal_mask=causal)
        assert spy.called
        assert_close(output, expected)

    def test_a_faked_gpu_runs_it_unforced(self, rng):
        query, value = random_inputs(rng, batch=2, query_length=12)
        layer = make_layer(query, value, num_heads=2, key_dim=4,
                           sliding_window=3)
        expected, _ = reference(layer, query, value, use_causal_mask=True)
        with tuning.assume_platform(GPU), _spy() as spy:
            output = layer(query, value, use_causal_mask=True)
        assert spy.called
        assert_close(output, expected)
        with _spy() as spy:  # the CPU's rule: the fused kernel
            layer(query, value, use_causal_mask=True)
        assert not spy.called

    @pytest.mark.training
    def test_gradients_equal_the_explicit_path(self, rng):
        query, value = random_inputs(rng, batch=2, query_length=12)
        layer = make_layer(query, value, num_heads=4, key_dim=4,
                           num_key_value_heads=2, sliding_window=3)
        grads = {}
        for path in (dispatch.FUSED_WINDOW, dispatch.EXPLICIT):
            with dispatch.force_path(path):
                grads[path] = layer_gradients(layer, query, value,
                                              use_causal_mask=True)
        for got, want in zip(grads[dispatch.FUSED_WINDOW],
                             grads[dispatch.EXPLICIT]):
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

    @pytest.mark.parametrize("platform, dtype, tried", [
        (GPU, "bfloat16", ["cudnn"]),  # then XLA's where cuDNN is absent
        (GPU, "float32", [None]),
        (CPU, "bfloat16", [None]),
    ])
    def test_cudnn_is_tried_first_on_a_gpu(self, rng, platform, dtype,
                                           tried):
        import jax

        q, k, v = (
            keras.ops.cast(rng.normal(size=(2, 8, 2, 8)), dtype)
            for _ in range(3)
        )
        spec = attention_spec(8, 3, True)
        calls = []
        kernel = jax.nn.dot_product_attention

        def recording(*args, **kwargs):
            calls.append(kwargs.get("implementation"))
            return kernel(*args, **kwargs)

        with mock.patch.object(jax.nn, "dot_product_attention", recording), \
                tuning.assume_platform(platform):
            output = fused.fused_window_attention(q, k, v, spec)
        assert calls[:1] == tried
        assert calls[1:] in ([], [None])  # XLA's kernel if cuDNN refused
        assert output.dtype == q.dtype
        expected, _ = explicit.explicit_attention(q, k, v, spec)
        np.testing.assert_allclose(
            to_numpy(keras.ops.cast(output, "float32")),
            to_numpy(keras.ops.cast(expected, "float32")),
            atol=2e-2 if dtype == "bfloat16" else 1e-5,
        )
