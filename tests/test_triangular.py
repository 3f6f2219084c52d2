"""`triangular_attention` (causal self-attention a block of queries at a
time) against the explicit path and the float64 reference, and the layer
on that path against Keras's layer."""

import numpy as np
import pytest
from test_banded import _gradients
from test_banded import _heads
from test_banded import _jit
from test_banded import _padding
from test_banded import _reference
from util import assert_causal_path_matches
from util import attention_spec
from util import to_numpy

from keras_mha.attention import AttentionSpec
from keras_mha.attention import dispatch
from keras_mha.attention import explicit
from keras_mha.attention import triangular
from keras_mha.attention import tuning

TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def _dense(q, k, v, query_mask, key_mask):
    return _jit(_dense_eager)(q, k, v, query_mask, key_mask)


def _spec(q, query_mask, key_mask):
    return attention_spec(
        q.shape[-1], causal=True, query_mask=query_mask, key_mask=key_mask
    )


def _dense_eager(q, k, v, query_mask, key_mask):
    spec = _spec(q, query_mask, key_mask)
    return explicit.explicit_attention(q, k, v, spec)[0]


def _triangular(q, k, v, query_mask, key_mask, block_size):
    def attend(q, k, v, query_mask, key_mask):
        spec = _spec(q, query_mask, key_mask)
        return triangular.triangular_attention(
            q, k, v, spec, block_size=block_size
        )

    return _jit(attend)(q, k, v, query_mask, key_mask)


class TestTriangular:
    # 1037 = 16 blocks of 64 and a short one; 300 < one block of 512.
    @pytest.mark.parametrize("length, block_size", [(1037, 64), (300, 512)])
    def test_matches_reference(self, rng, length, block_size):
        q, k, v = (_heads(rng, length, n) for n in (4, 2, 2))
        padding = _padding(length, [length, length - 150])
        out = to_numpy(_triangular(q, k, v, padding, padding, block_size))
        expected = _reference(q, k, v, None, True, padding, padding, 0)
        np.testing.assert_allclose(out, expected, **TOLERANCE)
        # Padded queries have no key: exactly 0.
        np.testing.assert_array_equal(out[1, length - 150:], 0.0)

    def test_needs_equal_static_lengths(self, rng):
        q = _heads(rng, 8, 2)
        with pytest.raises(ValueError, match="key.shape"):
            _triangular(q, q[:, :4], q[:, :4], None, None, 4)

    @pytest.mark.training
    def test_same_gradients_as_dense(self, rng):
        length = 300
        q, k, v = (_heads(rng, length, n) for n in (4, 2, 2))
        cotangent = _heads(rng, length, 4)
        padding = _padding(length, [length, 250])

        def triangular_fn(q, k, v):
            return _triangular(q, k, v, padding, padding, 64)

        def dense_fn(q, k, v):
            return _dense(q, k, v, padding, padding)

        got = _gradients(triangular_fn, q, k, v, cotangent)
        want = _gradients(dense_fn, q, k, v, cotangent)
        for name, g, w in zip("qkv", got, want):
            g = to_numpy(g)
            assert np.isfinite(g).all(), name
            np.testing.assert_allclose(g, to_numpy(w), err_msg=name,
                                       **TOLERANCE)


class TestLayerOnTheTriangle:
    def test_rule(self):
        at = tuning.value("triangular_min_length", backend="jax",
                          platform="cpu")

        # With a dense bias, which the blocked path does not take.
        bias = np.zeros((1, 1, 1, at), "float32")

        def path(t_len=at, s_len=at, backend="jax", **fields):
            spec = AttentionSpec(
                scale=1.0, **{"causal": True, "bias": bias, **fields}
            )
            shapes = dispatch.Shapes(t_len, s_len, 4, 4)
            return dispatch.choose_path(spec, shapes, backend=backend)

        for backend, length, expected in (
            ("jax", at, dispatch.TRIANGULAR),
            ("jax", at - 1, dispatch.FUSED),
            ("torch", at, dispatch.FUSED),
            ("tensorflow", at, dispatch.FUSED),
        ):
            assert path(length, length, backend) == expected, (backend, length)
        for blocker in (dict(causal=False), dict(flash_attention=True),
                        dict(attention_mask=np.ones((1, 1, at, at), bool)),
                        dict(window=(at // 8 - 1, 0)),
                        dict(return_weights=True),
                        dict(query_offset=3)):
            assert path(**blocker) != dispatch.TRIANGULAR, blocker
        assert path(s_len=at + 1) == dispatch.FUSED  # cross-attention

    def test_layer_matches_reference_and_keras(self, rng):
        length = 600
        x = rng.normal(size=(2, length, 8)).astype("float32")
        assert_causal_path_matches(
            dispatch.TRIANGULAR, x, _padding(length, [length, 500])
        )
