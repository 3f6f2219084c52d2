"""`banded_attention` against `explicit_attention` and the float64 reference.

Each implementation the backend has runs (`portable` everywhere, `native`
on torch). The matrix of lengths, windows and causality checks the banded
output against the explicit path with the same spec and that one against the float64 NumPy reference of
`reference.py` (with identity projections, so it sees the heads directly);
the other cases check against the reference, and against the explicit path
where the alignment of the two paths is the point. All to 1e-5."""

import math

import keras
import numpy as np
import pytest
from conftest import BACKEND
from reference import reference_attention
from util import attention_spec
from util import make_layer
from util import to_numpy

import keras_mha
from keras_mha.attention import banded
from keras_mha.attention import explicit
from keras_mha.attention import tuning

IMPLEMENTATIONS = [banded.PORTABLE] + (
    [banded.NATIVE] if banded.native_available() else []
)
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
BATCH, HEAD = 2, 8  # B, H = V


def _heads(rng, length, heads, batch=BATCH, size=HEAD, dtype="float32"):
    return rng.normal(size=(batch, length, heads, size)).astype(dtype)


def _padding(length, valid_lengths):
    """`(B, length)`: `True` for the first `valid_lengths[b]` positions."""
    return np.arange(length)[None, :] < np.asarray(valid_lengths)[:, None]


def _spec(q, window, causal, query_mask, key_mask, query_offset, **fields):
    return attention_spec(
        q.shape[-1], window, causal, query_mask=query_mask, key_mask=key_mask,
        query_offset=query_offset, **fields,
    )


def _dense(q, k, v, window, causal, query_mask, key_mask, query_offset):
    """The explicit path with the same spec."""

    def attend(q, k, v, query_mask, key_mask):
        spec = _spec(q, window, causal, query_mask, key_mask, query_offset)
        return explicit.explicit_attention(q, k, v, spec)[0]

    return _jit(attend)(q, k, v, query_mask, key_mask)


def _reference(q, k, v, window, causal, query_mask, key_mask, query_offset):
    """The float64 reference of the layer, with identity projections."""
    batch, t_len, num_heads, head = q.shape
    num_kv, value_head = k.shape[2], v.shape[3]

    def identity(heads, size):  # (heads·size, heads, size)
        return np.eye(heads * size).reshape(heads * size, heads, size)

    weights = {
        "query": identity(num_heads, head),
        "key": identity(num_kv, head),
        "value": identity(num_kv, value_head),
        "output": identity(num_heads, value_head).reshape(
            num_heads, value_head, num_heads * value_head
        ),
    }
    weights.update({name + "_bias": None for name in list(weights)})
    flat = lambda x: x.reshape(x.shape[0], x.shape[1], -1)  # noqa: E731
    out, _ = reference_attention(
        weights,
        flat(q),
        flat(v),
        key=flat(k),
        query_mask=query_mask,
        key_mask=key_mask,
        use_causal_mask=causal,
        sliding_window=window,
        query_offset=query_offset,
    )
    return out.reshape(batch, t_len, num_heads, value_head)


def _banded(q, k, v, window, causal, query_mask=None, key_mask=None,
            query_offset=0, **kwargs):
    def attend(q, k, v, query_mask, key_mask):
        spec = _spec(q, window, causal, query_mask, key_mask, query_offset)
        return banded.banded_attention(q, k, v, spec, **kwargs)

    return _jit(attend)(q, k, v, query_mask, key_mask)


def _jit(fn):
    """`jax.jit` on JAX: one compilation instead of one per op and shape."""
    if BACKEND != "jax":
        return fn
    import jax

    return jax.jit(fn)


def _check(q, k, v, window, causal, query_mask=None, key_mask=None,
           query_offset=0, dense=False, **kwargs):
    """banded == float64 reference (== dense, if asked) to 1e-5.

    Returns the banded output. The explicit path is compared in the matrix
    and where the alignment of the paths is the point; elsewhere the
    reference alone keeps JAX from compiling a second function per case.
    """
    args = (window, causal, query_mask, key_mask, query_offset)
    out = to_numpy(_banded(q, k, v, *args, **kwargs))
    assert out.shape == q.shape[:3] + v.shape[3:]
    np.testing.assert_allclose(out, _reference(q, k, v, *args), **TOLERANCE)
    if dense:
        np.testing.assert_allclose(out, to_numpy(_dense(q, k, v, *args)),
                                   **TOLERANCE)
    return out


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request):
    return request.param


class TestAgainstDense:
    """The matrix of lengths, windows and causality, with end padding."""

    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "sym"])
    @pytest.mark.parametrize("window", [1, 17, 128], ids=lambda w: f"w{w}")
    @pytest.mark.parametrize("length", [1000, 1037], ids=lambda t: f"T{t}")
    def test_self_attention(self, rng, length, window, causal):
        # N = 2 query heads read K = 1 key head. Batch 0 is unpadded;
        # batch 1 ends with padding on both sides.
        q, k, v = (_heads(rng, length, n) for n in (2, 1, 1))
        padding = _padding(length, [length, length - 150])
        args = (window, causal, padding, padding, 0)
        dense = to_numpy(_dense(q, k, v, *args))
        np.testing.assert_allclose(dense, _reference(q, k, v, *args),
                                   **TOLERANCE)
        for implementation in IMPLEMENTATIONS:
            out = _banded(q, k, v, *args, implementation=implementation)
            np.testing.assert_allclose(to_numpy(out), dense,
                                       err_msg=implementation, **TOLERANCE)


class TestGeometry:
    @pytest.mark.parametrize(
        "t_len, s_len", [(300, 1037), (1037, 300)], ids=["T<S", "T>S"]
    )
    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "sym"])
    def test_cross_attention_aligns_top_left(self, rng, implementation,
                                             t_len, s_len, causal):
        q = _heads(rng, t_len, 4)
        k, v = _heads(rng, s_len, 2), _heads(rng, s_len, 2)
        _check(q, k, v, 100, causal, key_mask=_padding(s_len, [s_len, 250]),
               dense=True, implementation=implementation)

    @pytest.mark.parametrize("num_kv", [1, 2, 4], ids=lambda k: f"K{k}")
    def test_grouped_heads(self, rng, implementation, num_kv):
        q = _heads(rng, 517, 4)
        k, v = _heads(rng, 517, num_kv), _heads(rng, 517, num_kv)
        _check(q, k, v, 40, True, implementation=implementation)

    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "sym"])
    @pytest.mark.parametrize("query_offset", [130, 700])
    def test_query_offset(self, rng, implementation, query_offset, causal):
        # Queries at positions offset .. offset + T - 1 over S = 600 keys:
        # the last offset puts every query past the keys.
        q = _heads(rng, 200, 2)
        k, v = _heads(rng, 600, 2), _heads(rng, 600, 2)
        _check(q, k, v, 64, causal, query_offset=query_offset,
               implementation=implementation)

    @pytest.mark.parametrize("block_size", [1, 7, 64, 300])
    def test_block_sizes(self, rng, implementation, block_size):
        # T = 261 is a multiple of none of the blocks.
        q, k, v = (_heads(rng, 261, 2) for _ in range(3))
        _check(q, k, v, 9, False, block_size=block_size,
               implementation=implementation)

    def test_window_larger_than_everything(self, rng, implementation):
        q, k, v = (_heads(rng, 90, 2) for _ in range(3))
        _check(q, k, v, 10**9, True, implementation=implementation)

    def test_value_size_differs_from_key_size(self, rng, implementation):
        q, k = _heads(rng, 300, 4), _heads(rng, 300, 2)
        v = _heads(rng, 300, 2, size=5)
        _check(q, k, v, 33, False, implementation=implementation)

    def test_many_chunks(self, rng, implementation, monkeypatch):
        # Small chunks: the portable path maps over many of them.
        monkeypatch.setitem(tuning.OVERRIDES, "banded_chunk_bytes", 1)
        q, k, v = (_heads(rng, 333, 2) for _ in range(3))
        _check(q, k, v, 20, True, block_size=16,
               implementation=implementation)


class TestEmptyRows:
    def test_rows_with_nothing_to_attend_to_are_zero(self, rng,
                                                     implementation):
        # Batch 0: every key is padding. Batch 1: queries 250.. are
        # padding, and with w = 1 the queries 200.. at padded keys see
        # nothing either.
        q, k, v = (_heads(rng, 300, 2) for _ in range(3))
        key_mask = _padding(300, [0, 200])
        query_mask = _padding(300, [300, 250])
        out = _check(q, k, v, 1, True, query_mask=query_mask,
                     key_mask=key_mask, implementation=implementation)
        np.testing.assert_array_equal(out[0], 0.0)
        np.testing.assert_array_equal(out[1, 200:], 0.0)
        assert np.abs(out[1, :200]).min() > 0.0

    def test_queries_past_a_window_of_keys_are_zero(self, rng,
                                                    implementation):
        q = _heads(rng, 50, 2)
        k, v = _heads(rng, 20, 2), _heads(rng, 20, 2)
        out = _check(q, k, v, 8, False, implementation=implementation)
        np.testing.assert_array_equal(out[:, 27:], 0.0)


# ---------------------------------------------------------------- gradients


def _gradients(fn, q, k, v, cotangent):
    """d sum(fn(q, k, v) * cotangent) / d(q, k, v) with the backend's
    autodiff."""
    if BACKEND == "jax":
        import jax

        def loss(q, k, v):
            return keras.ops.sum(fn(q, k, v) * cotangent)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        tensors = [tf.convert_to_tensor(x) for x in (q, k, v)]
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            loss = tf.reduce_sum(fn(*tensors) * cotangent)
        return tape.gradient(loss, tensors)
    if BACKEND == "torch":
        import torch

        tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        loss = torch.sum(fn(*tensors) * torch.tensor(cotangent))
        return torch.autograd.grad(loss, tensors)
    raise AssertionError(f"no autodiff on {BACKEND}")


@pytest.mark.training
class TestGradients:
    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "sym"])
    def test_same_gradients_as_dense(self, rng, implementation, causal):
        length, window = 1037, 17
        q, k, v = (_heads(rng, length, n) for n in (4, 2, 2))
        cotangent = _heads(rng, length, 4)
        padding = _padding(length, [length, 900])
        # Batch 1: queries 900.. are padding and have no key.
        args = (window, causal, padding, padding, 0)

        def banded_fn(q, k, v):
            return _banded(q, k, v, *args, implementation=implementation)

        def dense_fn(q, k, v):
            return _dense(q, k, v, *args)

        grads = [to_numpy(g) for g in _gradients(banded_fn, q, k, v,
                                                   cotangent)]
        want = _gradients(dense_fn, q, k, v, cotangent)
        for name, got, expected in zip("qkv", grads, want):
            assert np.isfinite(got).all(), name
            np.testing.assert_allclose(got, to_numpy(expected),
                                       err_msg=name, **TOLERANCE)
            # Nothing flows through padded queries or into padded keys.
            np.testing.assert_array_equal(got[1, 900:], 0.0, err_msg=name)


    def test_recomputed_chunks_give_the_same_gradients(self, rng,
                                                       monkeypatch):
        """Past `banded_recompute_bytes` each chunk's weights are
        recomputed in the backward (`jax.checkpoint` on JAX, where it is
        measured; kept elsewhere): the same gradients as the dense path."""
        monkeypatch.setitem(tuning.OVERRIDES, "banded_recompute_bytes", 0)
        length, window = 1037, 17
        q, k, v = (_heads(rng, length, n) for n in (4, 2, 2))
        cotangent = _heads(rng, length, 4)
        args = (window, True, None, None, 0)

        def banded_fn(q, k, v):
            return _banded(q, k, v, *args, implementation=banded.PORTABLE)

        grads = _gradients(banded_fn, q, k, v, cotangent)
        want = _gradients(lambda q, k, v: _dense(q, k, v, *args), q, k, v,
                          cotangent)
        for name, got, expected in zip("qkv", grads, want):
            np.testing.assert_allclose(to_numpy(got), to_numpy(expected),
                                       err_msg=name, **TOLERANCE)
        if BACKEND == "jax":
            import jax

            program = str(jax.make_jaxpr(jax.grad(
                lambda q: keras.ops.sum(banded_fn(q, k, v))))(q))
            assert "checkpoint" in program or "remat" in program


# ----------------------------------------------------------------- compiled


@pytest.mark.skipif(
    BACKEND not in ("jax", "tensorflow"), reason="traces on jax and tf"
)
class TestCompiled:
    """Under `jax.jit` / `tf.function(jit_compile=True)`, any batch size."""

    def _compiled(self, fn, t_len, s_len):
        if BACKEND == "jax":
            import jax

            return jax.jit(fn)
        import tensorflow as tf

        spec = lambda length, heads: tf.TensorSpec(  # noqa: E731
            (None, length, heads, HEAD), "float32"
        )
        return tf.function(
            fn,
            jit_compile=True,
            input_signature=[
                spec(t_len, 4),
                spec(s_len, 2),
                spec(s_len, 2),
                tf.TensorSpec((None, s_len), "bool"),
            ],
        )

    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "sym"])
    def test_compiled_matches_dense(self, rng, causal, monkeypatch):
        monkeypatch.setitem(tuning.OVERRIDES, "banded_chunk_bytes", 1 << 16)  # a few chunks
        t_len, s_len, window = 333, 350, 30
        q = _heads(rng, t_len, 4)
        k, v = _heads(rng, s_len, 2), _heads(rng, s_len, 2)
        key_mask = _padding(s_len, [s_len, 300])

        def fn(q, k, v, key_mask):
            spec = _spec(q, window, causal, None, key_mask, 0)
            return banded.banded_attention(q, k, v, spec)

        compiled = self._compiled(fn, t_len, s_len)
        want = to_numpy(_dense(q, k, v, window, causal, None, key_mask, 0))
        np.testing.assert_allclose(
            to_numpy(compiled(q, k, v, key_mask)), want, **TOLERANCE
        )
        # Another batch size, same function.
        np.testing.assert_allclose(
            to_numpy(compiled(q[:1], k[:1], v[:1], key_mask[:1])),
            want[:1],
            **TOLERANCE,
        )

    @pytest.mark.training
    def test_compiled_gradients(self, rng, monkeypatch):
        monkeypatch.setitem(tuning.OVERRIDES, "banded_chunk_bytes", 1 << 16)
        q, k, v = (_heads(rng, 300, n) for n in (4, 2, 2))
        cotangent = _heads(rng, 300, 4)

        spec = attention_spec(HEAD, 25, True)

        def fn(q, k, v):
            return banded.banded_attention(q, k, v, spec)

        def dense_fn(q, k, v):
            return explicit.explicit_attention(q, k, v, spec)[0]

        if BACKEND == "jax":
            got = _gradients(fn, q, k, v, cotangent)  # jitted there
        else:
            import tensorflow as tf

            got = tf.function(
                lambda q, k, v: _gradients(fn, q, k, v, cotangent),
                jit_compile=True,
            )(q, k, v)
        want = _gradients(dense_fn, q, k, v, cotangent)
        for name, a, b in zip("qkv", got, want):
            np.testing.assert_allclose(to_numpy(a), to_numpy(b),
                                       err_msg=name, **TOLERANCE)


# ------------------------------------------------------------------- dtypes


class TestDtypes:
    def test_float16_is_finite_and_close(self, rng, implementation):
        # Logits up to ~ 40^2 / sqrt(8) overflow float16 if computed there.
        q, k, v = (40 * _heads(rng, 400, 2) for _ in range(3))
        half = [x.astype("float16") for x in (q, k, v)]
        out = _banded(*half, 64, True, implementation=implementation)
        assert keras.backend.standardize_dtype(out.dtype) == "float16"
        out = to_numpy(out).astype("float32")
        assert np.isfinite(out).all()
        want = to_numpy(_dense(*(x.astype("float32") for x in half), 64,
                               True, None, None, 0))
        np.testing.assert_allclose(out, want, atol=0.05 * 40, rtol=1e-2)


# --------------------------------------------------------------- arguments


class TestArguments:
    def test_default_block_size(self):
        assert [
            banded.default_block_size((w - 1, 0)) for w in (1, 17, 128, 129, 512)
        ] == [32, 32, 128, 128, 128]
        assert banded.default_block_size((16, 100)) == 128  # the wider side

    @pytest.mark.skipif(not banded.native_available(),
                        reason="only torch has a native path")
    def test_native_block_follows_differentiation(self, rng, monkeypatch):
        # Nothing to differentiate: the smallest block; a gradient to
        # come: `default_block_size`. The same numbers either way.
        import torch

        blocks = []
        band = banded._band

        def spy(*args):
            geometry = band(*args)
            blocks.append(geometry.block)
            return geometry

        monkeypatch.setattr(banded, "_band", spy)
        q, k, v = (torch.tensor(_heads(rng, 300, 2)) for _ in range(3))
        spec = attention_spec(HEAD, 128, True)
        plain = banded.banded_attention(q, k, v, spec)
        q.requires_grad_(True)
        traced = banded.banded_attention(q, k, v, spec)
        with torch.no_grad():
            banded.banded_attention(q, k, v, spec)
        inference = tuning.value("banded_native_inference_block")
        assert blocks == [inference, banded.default_block_size((127, 0)),
                          inference]
        np.testing.assert_allclose(to_numpy(plain), to_numpy(traced.detach()),
                                   **TOLERANCE)

    @pytest.mark.skipif(not banded.native_available(),
                        reason="only torch has a native path")
    @pytest.mark.parametrize(
        "case", ["causal", "sym-gqa-alibi", "padded", "gqa-alibi-cap"]
    )
    def test_native_inference_layout(self, rng, case, monkeypatch):
        # Without a gradient the native kernel reads the projections in
        # place (`kernels._inference_band`): blocks at either end of the
        # keys get padded copies, grouped heads the kernel's own grouping,
        # per-row masks one bias per block; a soft-cap runs torch products
        # a head and a few blocks at a time (here 5 blocks of 16 rows by 64
        # keys, the last step shorter). Same numbers as the layout that a
        # gradient takes.
        import torch

        from keras_mha.attention import kernels

        monkeypatch.setitem(tuning.OVERRIDES, "capped_step_bytes",
                            5 * 16 * 64 * 4)

        calls = []
        inference = kernels._inference_band

        def spy(*args):
            calls.append(inference(*args))
            return calls[-1]

        monkeypatch.setattr(kernels, "_inference_band", spy)
        num_kv = 1 if "gqa" in case else 2
        q = torch.tensor(_heads(rng, 304, 2))  # 19 blocks of 16
        if case == "causal":  # heads before positions in memory
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k, v = (torch.tensor(_heads(rng, 304, num_kv)) for _ in range(2))
        fields = {}
        if "alibi" in case:
            fields["alibi"] = (0.5, 0.25)
        if case == "padded":
            fields["key_mask"] = _padding(304, [304, 211])
        if case.endswith("cap"):
            fields["soft_cap"] = 1.5
        spec = attention_spec(HEAD, 40, not case.startswith("sym"), **fields)
        plain = banded.banded_attention(q, k, v, spec, block_size=16)
        q.requires_grad_(True)
        traced = banded.banded_attention(q, k, v, spec, block_size=16)
        assert len(calls) == 1 and calls[0] is not None
        np.testing.assert_allclose(to_numpy(plain), to_numpy(traced.detach()),
                                   **TOLERANCE)

    def test_invalid_implementation(self, rng):
        q = _heads(rng, 10, 2)
        with pytest.raises(ValueError, match="Received: implementation="):
            _banded(q, q, q, 4, True, implementation="fast")

    @pytest.mark.skipif(BACKEND == "torch", reason="torch has one")
    def test_native_needs_torch(self, rng):
        q = _heads(rng, 10, 2)
        with pytest.raises(ValueError, match="torch"):
            _banded(q, q, q, 4, True, implementation=banded.NATIVE)


# ------------------------------------------------------------------ dropout


def _dense_keep(keep, q_len, s_len, num_heads, band):
    """The portable core's dropout draws `(c, B, K, C, b, G, span)` laid out
    densely as `(B, N, T, S)`; keys outside `[0, S)` are dropped."""
    keep = np.asarray(keep)
    c, batch, num_kv, chunk, b, groups, span = keep.shape
    blocks = keep.transpose(1, 2, 5, 0, 3, 4, 6)  # (B, K, G, c, C, b, span)
    blocks = blocks.reshape(batch, num_heads, c * chunk, b, span)
    dense = np.zeros((batch, num_heads, q_len, s_len), bool)
    for t in range(q_len):
        block, row = divmod(t, b)
        first = band.frame_start + block * b  # key position of span slot 0
        lo, hi = max(first, 0), min(first + span, s_len)
        dense[:, :, t, lo:hi] = blocks[:, :, block, row, lo - first:hi - first]
    return dense


class TestDropout:
    """Dropout in the band: the kept weights are those of the reference,
    scaled by `1 / (1 - rate)`, dropped ones are 0."""

    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "sym"])
    def test_matches_reference_with_the_same_draws(self, rng, causal):
        length, window, rate, seed = 300, 17, 0.3, 1234
        q, k, v = (_heads(rng, length, n) for n in (4, 2, 2))
        padding = _padding(length, [length, 250])
        scale = 1.0 / math.sqrt(HEAD)
        spec = attention_spec(HEAD, window, causal, query_mask=padding,
                              key_mask=padding, dropout=rate, seed=seed)
        out = banded.banded_attention(
            q, k, v, spec, implementation=banded.PORTABLE
        )
        band = banded._band(length, length, spec, None,
                            banded._score_bytes(keras.ops.convert_to_tensor(q)))
        query = keras.ops.convert_to_tensor(q)
        keep = to_numpy(banded._keep_mask(query, k, band, rate, seed))
        keep = _dense_keep(keep, length, length, 4, band)  # (B, N, T, S)

        positions = np.arange(length)
        allowed = np.abs(positions[:, None] - positions[None, :]) < window
        if causal:
            allowed &= positions[None, :] <= positions[:, None]
        allowed = allowed[None, None] & padding[:, None, :, None]
        allowed &= padding[:, None, None, :]  # (B, 1, T, S)
        q64, k64, v64 = (x.astype("float64") for x in (q, k, v))
        k64, v64 = (np.repeat(x, 2, axis=2) for x in (k64, v64))  # K -> N
        logits = np.einsum("btnh,bsnh->bnts", q64, k64) * scale
        logits = np.where(allowed, logits, -np.inf)
        has_key = allowed.any(-1, keepdims=True)
        logits = np.where(has_key, logits, 0.0)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights = np.where(allowed, weights, 0.0)
        weights /= np.where(has_key, weights.sum(-1, keepdims=True), 1.0)
        weights = weights * keep / (1.0 - rate)
        expected = np.einsum("bnts,bsnv->btnv", weights, v64)
        np.testing.assert_allclose(to_numpy(out), expected, **TOLERANCE)
        # Some weights were dropped, so the draws mattered.
        assert 0.2 < 1.0 - keep[allowed.repeat(4, axis=1)].mean() < 0.4

    @pytest.mark.skipif(not banded.native_available(),
                        reason="only torch has a native path")
    def test_native_refuses_dropout(self, rng):
        q = _heads(rng, 64, 2)
        spec = attention_spec(HEAD, 4, True, dropout=0.1)
        with pytest.raises(ValueError, match="dropout"):
            banded.banded_attention(q, q, q, spec,
                                    implementation=banded.NATIVE)


class TestLayerDropout:
    """`keras_mha.MultiHeadAttention` with dropout and a window that pays
    off: the band drops its own weights (it does not fall back to the
    explicit T x S path), seeded like the explicit path."""

    LENGTH, WINDOW = 256, 8

    def _layer(self, rng, seed):
        x = rng.normal(size=(2, self.LENGTH, 8)).astype("float32")
        template = make_layer(x, x, num_heads=2, key_dim=4, dropout=0.5,
                              sliding_window=self.WINDOW)
        layer = keras_mha.MultiHeadAttention.from_config(
            {**template.get_config(), "seed": seed}
        )
        layer.build(x.shape, x.shape)
        layer.set_weights(template.get_weights())
        return x, layer

    def test_banded_path_is_chosen(self, rng):
        x, layer = self._layer(rng, seed=11)
        assert layer.attention_path(
            x.shape, x.shape, use_causal_mask=True, training=True
        ) == "banded"

    def test_same_seed_same_dropout(self, rng):
        x, first = self._layer(np.random.default_rng(0), seed=11)
        _, second = self._layer(np.random.default_rng(0), seed=11)
        _, other = self._layer(np.random.default_rng(0), seed=12)
        outputs = [to_numpy(layer(x, x, use_causal_mask=True, training=True))
                   for layer in (first, second, other)]
        inference = to_numpy(first(x, x, use_causal_mask=True))
        assert np.isfinite(outputs[0]).all()
        np.testing.assert_array_equal(outputs[0], outputs[1])
        assert not np.allclose(outputs[0], outputs[2])
        assert not np.allclose(outputs[0], inference, atol=1e-3)

    @pytest.mark.training
    def test_fit_moves_every_weight(self, rng):
        inputs = keras.Input((self.LENGTH, 8))
        x = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=4, dropout=0.1, sliding_window=self.WINDOW
        )(inputs, inputs, use_causal_mask=True)
        model = keras.Model(inputs, keras.layers.Dense(1)(x))
        model.compile(optimizer="sgd", loss="mse")
        before = [w.copy() for w in model.get_weights()]
        data = rng.normal(size=(4, self.LENGTH, 8)).astype("float32")
        target = rng.normal(size=(4, self.LENGTH, 1)).astype("float32")
        history = model.fit(data, target, batch_size=4, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"]).all()
        changed = [not np.allclose(a, b)
                   for a, b in zip(before, model.get_weights())]
        assert sum(changed) >= len(changed) - 1  # all but the key bias
