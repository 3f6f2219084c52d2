"""`blocked_attention` (causal self-attention in O(T) memory, with an
online softmax and a custom gradient) against the float64 reference and
the explicit path, the dispatch rule that picks it, and the layer on it
against Keras's layer."""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from test_banded import _gradients
from test_banded import _heads
from test_banded import _jit
from test_banded import _padding
from test_banded import _reference
from util import assert_causal_path_matches
from util import attention_spec
from util import layer_gradients
from util import make_layer
from util import to_numpy

import keras_mha
from keras_mha.attention import AttentionSpec
from keras_mha.attention import blocked
from keras_mha.attention import dispatch
from keras_mha.attention import explicit
from keras_mha.attention import tuning
from keras_mha.attention.logits import alibi_slopes

TOLERANCE = dict(atol=1e-5, rtol=1e-5)
# 75 = 4 blocks of 16 and a short one: the diagonal blocks, the loop over
# the blocks before them, and padding in the last block.
LENGTH, BLOCK = 75, 16


def _spec(q, query_mask=None, key_mask=None, **fields):
    return attention_spec(q.shape[-1], causal=True, query_mask=query_mask,
                          key_mask=key_mask, **fields)


def _blocked(fields, block_size=BLOCK):
    def attend(q, k, v):
        return blocked.blocked_attention(q, k, v, _spec(q, **fields),
                                         block_size=block_size)

    return _jit(attend)


def _explicit(fields):
    def attend(q, k, v):
        return explicit.explicit_attention(q, k, v, _spec(q, **fields))[0]

    return _jit(attend)


def _segments():
    ids = np.zeros((2, LENGTH), "int32")
    ids[0, 30:] = 1  # two sequences packed in row 0
    ids[1, 10:50], ids[1, 50:] = 1, 2  # three in row 1
    return ids


# Each feature alone and all together, with padding that leaves rows with
# no key (the first keys of row 1 are padding).
FEATURES = {
    "padding": {},
    "soft_cap": {"soft_cap": 1.5},
    "alibi": {"alibi": alibi_slopes(4)},
    "sinks": {"sinks": np.linspace(-1.0, 2.0, 4).astype("float32")},
    "segments": {"segment_ids": _segments(), "key_segment_ids": _segments()},
}
FEATURES["all"] = {k: v for f in FEATURES.values() for k, v in f.items()}


def _masks():
    query_mask = _padding(LENGTH, [LENGTH, 60])
    key_mask = query_mask.copy()
    key_mask[1, :5] = False
    return dict(query_mask=query_mask, key_mask=key_mask)


class TestBlocked:
    def test_matches_reference(self, rng):
        q, k, v = (_heads(rng, LENGTH, n) for n in (4, 2, 2))
        masks = _masks()
        out = to_numpy(_blocked(masks)(q, k, v))
        expected = _reference(q, k, v, None, True, masks["query_mask"],
                              masks["key_mask"], 0)
        np.testing.assert_allclose(out, expected, **TOLERANCE)
        # Padded queries, and queries before the first real key, have no
        # key: exactly 0.
        np.testing.assert_array_equal(out[1, 60:], 0.0)
        np.testing.assert_array_equal(out[1, :5], 0.0)

    @pytest.mark.parametrize("name", list(FEATURES))
    def test_features_match_explicit(self, rng, name):
        q, k, v = (_heads(rng, LENGTH, n) for n in (4, 2, 2))
        fields = {**_masks(), **FEATURES[name]}
        out = to_numpy(_blocked(fields)(q, k, v))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, to_numpy(_explicit(fields)(q, k, v)),
                                   **TOLERANCE)

    def test_one_block_and_half_precision(self, rng):
        q, k, v = (_heads(rng, 40, n, dtype="float16") for n in (4, 2, 2))
        for block_size in (BLOCK, 64):  # several blocks; one block
            out = _blocked({}, block_size)(q, k, v)
            assert keras.ops.dtype(out) == "float16"
            np.testing.assert_allclose(
                to_numpy(out).astype("float32"),
                to_numpy(_explicit({})(q, k, v)).astype("float32"),
                atol=2e-3, rtol=2e-3,
            )

    def test_needs_equal_static_lengths(self, rng):
        q = _heads(rng, 8, 2)
        with pytest.raises(ValueError, match="key.shape"):
            _blocked({}, 4)(q, q[:, :4], q[:, :4])

    @pytest.mark.training
    @pytest.mark.parametrize("name", ["padding", "all"])
    def test_same_gradients_as_explicit(self, rng, name):
        q, k, v = (_heads(rng, LENGTH, n) for n in (4, 2, 2))
        cotangent = _heads(rng, LENGTH, 4)
        fields = {**_masks(), **FEATURES[name]}
        got = _gradients(_blocked(fields), q, k, v, cotangent)
        want = _gradients(_explicit(fields), q, k, v, cotangent)
        for label, g, w in zip("qkv", got, want):
            g = to_numpy(g)
            assert np.isfinite(g).all(), label
            np.testing.assert_allclose(g, to_numpy(w), err_msg=label,
                                       **TOLERANCE)

    @pytest.mark.skipif(BACKEND != "jax", reason="reads JAX's jaxpr")
    def test_never_materializes_the_scores(self, rng):
        """No array of the forward or backward pass has `T × T` entries
        per head: the largest are the `(b, b)` blocks and `(T, H)`."""
        import jax

        length, block = 1024, 128
        q, k, v = (_heads(rng, length, n, batch=1) for n in (4, 4, 4))

        def loss(q, k, v):
            spec = _spec(q, alibi=alibi_slopes(4), soft_cap=2.0)
            out = blocked.blocked_attention(q, k, v, spec, block_size=block)
            return (out ** 2).sum()

        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        largest = max(_sizes(jaxpr.jaxpr))
        assert largest < 4 * length * length / 16, largest  # T²·N/16


def _sizes(jaxpr):
    """The element counts of every value a jaxpr and its sub-jaxprs make."""
    import jax.extend

    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield int(np.prod(var.aval.shape)) if var.aval.shape else 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _sizes(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _sizes(sub)


class TestLayerOnTheBlocks:
    def test_rule(self):
        def path(length=4096, backend="jax", s_len=None, **fields):
            spec = AttentionSpec(scale=1.0, **{"causal": True, **fields})
            shapes = dispatch.Shapes(length, s_len or length, 4, 4)
            return dispatch.choose_path(spec, shapes, backend=backend)

        at = {backend: tuning.value("blocked_min_length", backend=backend,
                                    platform="cpu")
              for backend in ("jax", "tensorflow", "torch")}
        for backend, length, fields, expected in (
            ("jax", at["jax"], {}, dispatch.BLOCKED),
            ("jax", at["jax"] - 1, {}, dispatch.FUSED),
            ("tensorflow", at["tensorflow"], {}, dispatch.BLOCKED),
            ("tensorflow", at["tensorflow"] - 1, {}, dispatch.FUSED),
            # torch's kernel never writes the scores, but has no soft-cap.
            ("torch", at["torch"], {}, dispatch.FUSED),
            ("torch", at["torch"], {"soft_cap": 2.0}, dispatch.BLOCKED),
            ("torch", at["torch"] - 1, {"soft_cap": 2.0}, dispatch.EXPLICIT),
            # A dense bias goes to the triangle on JAX.
            ("jax", 4096, {"bias": np.zeros((1, 1, 1, 4096), "float32")},
             dispatch.TRIANGULAR),
        ):
            assert path(length, backend, **fields) == expected, (
                backend, length, fields)
        for blocker in (dict(causal=False), dict(flash_attention=True),
                        dict(attention_mask=np.ones((1, 1, 1, 4096), bool)),
                        dict(window=(511, 0)), dict(return_weights=True),
                        dict(dropout=0.1), dict(query_offset=3)):
            assert path(**blocker) != dispatch.BLOCKED, blocker
        assert path(s_len=4097) == dispatch.FUSED  # cross-attention

    def test_layer_matches_reference_and_keras(self, rng, monkeypatch):
        monkeypatch.setitem(tuning.OVERRIDES, "blocked_block", BLOCK)
        x = rng.normal(size=(2, LENGTH, 8)).astype("float32")
        assert_causal_path_matches(
            dispatch.BLOCKED, x, _padding(LENGTH, [LENGTH, 60])
        )

    @pytest.mark.training
    def test_layer_gradients_with_every_feature(self, rng, monkeypatch):
        """The weights' gradients, the sinks' included, equal the explicit
        path's."""
        monkeypatch.setitem(tuning.OVERRIDES, "blocked_block", BLOCK)
        x = rng.normal(size=(2, LENGTH, 8)).astype("float32")
        layer = make_layer(
            x, x, num_heads=4, key_dim=4, num_key_value_heads=2,
            use_sinks=True, use_alibi=True, attn_logits_soft_cap=2.0,
            rotary_embedding=keras_mha.RotaryEmbedding(100),
        )
        layer.sinks.assign(np.linspace(-1.0, 1.0, 4).astype("float32"))
        kwargs = dict(use_causal_mask=True, segment_ids=_segments())
        grads = {}
        for path in (dispatch.BLOCKED, dispatch.EXPLICIT):
            with dispatch.force_path(path):
                grads[path] = layer_gradients(layer, x, x, **kwargs)
        for got, want in zip(grads[dispatch.BLOCKED],
                             grads[dispatch.EXPLICIT]):
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
