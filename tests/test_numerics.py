"""Numerics under stress.

Half precision with activations whose logits overflow float16, gradients
through rows with nothing to attend to, NaN containment, extreme sizes
(`T = 1`, `S = 1`, heads of size 1, many heads), and the determinism of
dropout. Every path runs: the fused one (`return_attention_scores=False`),
the explicit one (`True`) and, where noted, each path forced with
`dispatch.force_path`.
"""

import contextlib
import warnings

import keras
import numpy as np
import pytest
from reference import layer_weights
from util import assert_close
from util import layer_gradients
from util import make_layer
from util import reference
from util import to_numpy

import keras_mha
from keras_mha.attention import dispatch

HALF_POLICIES = ["mixed_float16", "mixed_bfloat16"]
FLOAT16_MAX = float(np.finfo("float16").max)

# One geometry for every test that does not vary sizes on purpose: JAX
# compiles each op for each new shape. B = 2, T = S = 6, E = 8; N = 4 query
# heads in K = 2 groups of size H = V = 4.
BATCH, LENGTH, FEATURES = 2, 6, 8
HEADS = dict(num_heads=4, key_dim=4, num_key_value_heads=2)


def _inputs(rng, scale=1.0):
    """`(query, value)`, distinct arrays of shape `(B, T, E)`."""
    return tuple(
        (scale * rng.normal(size=(BATCH, LENGTH, FEATURES))).astype("float32")
        for _ in range(2)
    )


def _output(result, scores):
    return to_numpy(result[0] if scores else result).astype("float64")


def _max_logit(layer, query, value):
    """The largest `|q . k| / sqrt(H)` the layer computes, in float64."""
    w = layer_weights(layer)
    q = np.einsum("bte,enh->btnh", query, w["query"]) + w["query_bias"]
    k = np.einsum("bse,enh->bsnh", value, w["key"]) + w["key_bias"]
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    return np.abs(np.einsum("btnh,bsnh->bnts", q, k)).max() / np.sqrt(
        q.shape[-1]
    )


def _padding(batch=BATCH, length=LENGTH, empty_entry=None, left=0):
    mask = np.ones((batch, length), bool)
    mask[0, :left] = False
    if empty_entry is not None:
        mask[empty_entry] = False
    return mask


# Masks and positions that stress the softmax: causal with a window (also
# on the banded path), padded queries (rows with nothing to attend to), a
# whole batch entry with no keys.
STRESS_CASES = {
    "plain": dict(),
    "causal-window-2": dict(use_causal_mask=True, window=2),
    "banded-causal-window-2": dict(
        use_causal_mask=True, window=2, path=dispatch.BANDED
    ),
    "padded-queries": dict(query_mask=_padding(left=2)),
    "entry-without-keys": dict(value_mask=_padding(empty_entry=1)),
}


def _forcing(path):
    """`dispatch.force_path(path)`, or no forcing for `None`."""
    if path is None:
        return contextlib.nullcontext()
    return dispatch.force_path(path)


def _stress_call(rng, case, scale):
    """`(layer, query, value, call_kwargs, path)` for one of STRESS_CASES;
    `path` is the one to force, or `None`."""
    case = dict(STRESS_CASES[case])
    window = case.pop("window", None)
    path = case.pop("path", None)
    query, value = _inputs(rng, scale)
    layer = make_layer(query, value, sliding_window=window, **HEADS)
    return layer, query, value, case, path


class TestHalfPrecision:
    @pytest.mark.parametrize("case", list(STRESS_CASES))
    @pytest.mark.parametrize("scores", [False, True])
    @pytest.mark.parametrize("policy", HALF_POLICIES)
    def test_large_activations_stay_finite(self, rng, policy, scores, case):
        """Logits far beyond float16's range: finite wherever the float32
        computation is, and rows with nothing to attend to give the bias."""
        keras.config.set_dtype_policy(policy)
        layer, query, value, kwargs, path = _stress_call(
            rng, case, scale=300.0
        )
        assert _max_logit(layer, query, value) > 2 * FLOAT16_MAX
        expected, probs = reference(layer, query, value, **kwargs)
        assert np.isfinite(expected).all()
        with _forcing(path):
            result = layer(query, value, return_attention_scores=scores,
                           **kwargs)
        output = _output(result, scores)
        assert np.isfinite(output).all()
        if scores:
            assert np.isfinite(to_numpy(result[1]).astype("float32")).all()
        empty = ~probs.any(axis=-1).any(axis=1)  # (B, T): no key at all
        bias = to_numpy(layer.output_dense.bias)
        np.testing.assert_allclose(
            output[empty], np.broadcast_to(bias, output[empty].shape),
            rtol=1e-2, atol=1e-2,
        )

    @pytest.mark.parametrize("case", list(STRESS_CASES))
    @pytest.mark.parametrize("policy", HALF_POLICIES)
    def test_moderate_activations_match_reference(self, rng, policy, case):
        keras.config.set_dtype_policy(policy)
        layer, query, value, kwargs, path = _stress_call(
            rng, case, scale=1.0
        )
        expected, _ = reference(layer, query, value, **kwargs)
        # float16 keeps 11 bits, bfloat16 8, through a few roundings.
        tolerance = 1e-2 if policy == "mixed_float16" else 5e-2
        for scores in (False, True):
            with _forcing(path):
                result = layer(query, value, return_attention_scores=scores,
                               **kwargs)
            np.testing.assert_allclose(
                _output(result, scores), expected, rtol=tolerance,
                atol=tolerance * np.abs(expected).max(),
            )


# ---------------------------------------------------------------- gradients




# Padding that leaves queries with nothing to attend to, alone or next to a
# window that only reaches padded keys.
GRADIENT_CASES = {
    "padded-queries-and-an-entry-without-keys": dict(
        query_mask=_padding(left=2), value_mask=_padding(empty_entry=1)
    ),
    "window-1-left-padding": dict(
        window=1, use_causal_mask=True, value_mask=_padding(left=3)
    ),
    "window-2-both-sides": dict(
        window=2, value_mask=np.array([[0, 0, 1, 1, 0, 0],
                                       [1, 1, 1, 1, 1, 0]], bool),
    ),
}


@pytest.mark.training
class TestGradients:
    @pytest.mark.parametrize("case", list(GRADIENT_CASES))
    @pytest.mark.parametrize(
        "path, scores",
        [(path, False) for path in dispatch.PATHS]
        + [(dispatch.EXPLICIT, True)],
    )
    def test_finite_and_zero_where_masked(self, rng, case, path, scores):
        """Finite everywhere; exactly zero for padded keys and values (never
        read) and for queries with nothing to attend to (their output is the
        bias)."""
        kwargs = dict(GRADIENT_CASES[case])
        window = kwargs.pop("window", None)
        query, value = _inputs(rng)
        layer = make_layer(query, value, sliding_window=window, **HEADS)
        with dispatch.force_path(path):
            grads = layer_gradients(layer, query, value,
                               return_attention_scores=scores, **kwargs)
        for grad in grads:
            assert np.isfinite(grad).all()
        grad_query, grad_value = grads[:2]
        _, probs = reference(layer, query, value, **kwargs)
        padded_keys = ~kwargs.get("value_mask", _padding())
        np.testing.assert_array_equal(grad_value[padded_keys], 0.0)
        empty_rows = ~probs.any(axis=-1).any(axis=1)  # (B, T)
        assert empty_rows.any()
        np.testing.assert_array_equal(grad_query[empty_rows], 0.0)


# ---------------------------------------------------------- NaN containment


# NumPy warns on the NaN arithmetic the test asks for.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
class TestNaN:
    @pytest.mark.parametrize("window", [None, 2])
    @pytest.mark.parametrize("padding", [False, True])
    @pytest.mark.parametrize(
        "path, scores",
        [(path, False) for path in dispatch.PATHS]
        + [(dispatch.EXPLICIT, True)],
    )
    def test_nan_stays_in_its_batch_entry(self, rng, path, scores, padding,
                                          window):
        x, _ = _inputs(rng)
        mask = _padding()
        mask[1, 4:] = False
        kwargs = dict(query_mask=mask, value_mask=mask) if padding else {}
        layer = make_layer(x, x, sliding_window=window, **HEADS)
        poisoned = x.copy()
        poisoned[0, 2, 3] = np.nan
        with dispatch.force_path(path):
            result = layer(poisoned, poisoned,
                           return_attention_scores=scores, **kwargs)
        output = _output(result, scores)
        if window is None:
            assert np.isnan(output[0]).all()  # every query reads key 2
        else:
            assert np.isnan(output[0, 1:4]).all()  # |p - 2| < 2
        rest = {k: v[1:] for k, v in kwargs.items()}
        expected, _ = reference(layer, x[1:], x[1:], **rest)
        assert np.isfinite(output[1:]).all()
        assert_close(output[1:], expected)

    @pytest.mark.parametrize("scores", [False, True])
    def test_nan_at_a_padded_position_is_never_read(self, rng, scores):
        """Padding is never attended to, so garbage there (a NaN from a log
        of 0, uninitialized frames) must not reach real tokens."""
        x, _ = _inputs(rng)
        mask = _padding()
        mask[0, 4:] = False
        layer = make_layer(x, x, **HEADS)
        poisoned = x.copy()
        poisoned[0, 4:] = np.nan
        output = _output(
            layer(poisoned, poisoned, query_mask=mask, value_mask=mask,
                  return_attention_scores=scores),
            scores,
        )
        expected, _ = reference(layer, x, x, query_mask=mask, value_mask=mask)
        assert_close(output, expected)


# ------------------------------------------------------------ extreme sizes


class TestExtremeSizes:
    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("lengths", [(1, 1), (1, LENGTH), (LENGTH, 1)],
                             ids=lambda p: f"T={p[0]}-S={p[1]}")
    def test_length_one(self, rng, lengths, causal):
        query_length, key_length = lengths
        query = rng.normal(size=(BATCH, query_length, FEATURES))
        value = rng.normal(size=(BATCH, key_length, FEATURES))
        query, value = query.astype("float32"), value.astype("float32")
        layer = make_layer(query, value, sliding_window=1, **HEADS)
        expected, probs = reference(layer, query, value,
                                    use_causal_mask=causal)
        for path in dispatch.PATHS:
            with dispatch.force_path(path):
                assert_close(layer(query, value, use_causal_mask=causal),
                             expected)
        output, scores = layer(query, value, use_causal_mask=causal,
                               return_attention_scores=True)
        assert_close(output, expected)
        assert_close(scores, probs)

    def test_one_key_warns_nothing(self, rng):
        """`S = 1` is a valid key length (one memory slot, the first decode
        step of a rolling cache), and so is a band of one key (`w = 1`);
        Keras's "softmax over an axis of size 1" warning is noise here."""
        query, value = _inputs(rng)
        one_key = make_layer(query, value[:, :1], **HEADS)
        window_one = make_layer(query[:, :1], value, sliding_window=1,
                                **HEADS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for scores in (False, True):
                one_key(query, value[:, :1], return_attention_scores=scores)
            with dispatch.force_path(dispatch.BANDED):
                window_one(query[:, :1], value)
        assert not [w for w in caught if "softmax" in str(w.message)]

    @pytest.mark.parametrize(
        "num_heads, key_dim, num_kv_heads",
        [(2, 1, 2), (64, 1, 64), (64, 1, 8)],
        ids=["key_dim=1", "64-heads-of-1", "64-heads-8-groups"],
    )
    def test_tiny_and_many_heads(self, rng, num_heads, key_dim,
                                 num_kv_heads):
        query, value = _inputs(rng)
        layer = make_layer(query, value, num_heads=num_heads,
                           key_dim=key_dim, num_key_value_heads=num_kv_heads)
        kwargs = dict(value_mask=_padding(left=2), use_causal_mask=True)
        expected, probs = reference(layer, query, value, **kwargs)
        assert_close(layer(query, value, **kwargs), expected)  # fused
        output, scores = layer(query, value, return_attention_scores=True,
                               **kwargs)  # explicit
        assert_close(output, expected)
        assert_close(scores, probs)


# -------------------------------------------------------------- determinism


def _seeded_twin(template, query, value, seed, dropout):
    """A layer with `template`'s config and weights and its own seed."""
    config = {**template.get_config(), "seed": seed, "dropout": dropout}
    layer = keras_mha.MultiHeadAttention.from_config(config)
    layer.build(query.shape, value.shape)
    layer.set_weights(template.get_weights())
    return layer


class TestDeterminism:
    @pytest.mark.parametrize("scores", [False, True])
    def test_same_seed_same_dropout(self, rng, scores):
        """Two layers with the same seed and weights drop the same weights
        call after call; another seed drops others."""
        query, value = _inputs(rng)
        template = make_layer(query, value, **HEADS)
        first, second, other = (
            _seeded_twin(template, query, value, seed, dropout=0.5)
            for seed in (11, 11, 12)
        )
        calls = []
        for _ in range(3):
            outputs = [
                _output(layer(query, value, training=True,
                              use_causal_mask=True,
                              return_attention_scores=scores), scores)
                for layer in (first, second, other)
            ]
            np.testing.assert_array_equal(outputs[0], outputs[1])
            assert not np.allclose(outputs[0], outputs[2])
            calls.append(outputs[0])
        assert not np.allclose(calls[0], calls[1])  # fresh masks each call
        expected, _ = reference(template, query, value, use_causal_mask=True)
        assert not np.allclose(calls[0], expected, atol=1e-3)

    @pytest.mark.parametrize("scores", [False, True])
    def test_dropout_zero_training_equals_inference(self, rng, scores):
        query, value = _inputs(rng)
        layer = make_layer(query, value, dropout=0.0, sliding_window=3,
                           **HEADS)
        kwargs = dict(value_mask=_padding(left=2), use_causal_mask=True,
                      return_attention_scores=scores)
        trained = layer(query, value, training=True, **kwargs)
        inferred = layer(query, value, training=False, **kwargs)
        if scores:
            np.testing.assert_array_equal(to_numpy(trained[1]),
                                          to_numpy(inferred[1]))
        np.testing.assert_array_equal(_output(trained, scores),
                                      _output(inferred, scores))
