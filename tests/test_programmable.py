"""Programmable attention: mask objects and score functions
(`keras_mha.attention.rules`), their block maps, and the block-sparse path
(`sparse.py`) that visits only kept blocks, against the float64 reference
given the same mask as a dense tensor (written here in NumPy), and against
the explicit path, forward and backward, with caches, under compilers."""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from util import attention_spec
from util import compiled
from util import layer_gradients
from util import make_layer
from util import reference
from util import to_numpy

import keras_mha
from keras_mha.attention import dispatch
from keras_mha.attention import explicit
from keras_mha.attention import rules
from keras_mha.attention import sparse
from keras_mha.attention import tuning

# 75 = 4 blocks of 16 and a short one: whole, partial and skipped blocks,
# and padding in the last.
LENGTH, BLOCK = 75, 16
ops = keras.ops


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setitem(tuning.OVERRIDES, "sparse_block", BLOCK)


def _ids():
    """Two sequences of documents with boundaries off the blocks."""
    ids = np.zeros((2, LENGTH), "int32")
    for row, bounds in enumerate(([10, 40, 41], [30])):
        for bound in bounds:
            ids[row, bound:] += 1
    return ids


def _positions():
    q = np.arange(LENGTH)[:, None]
    k = np.arange(LENGTH)[None, :]
    return q, k


def _case(name):
    """`(mask object, dense (B, 1|N, T, S) NumPy mask)` of one case."""
    q, k = _positions()
    causal = q >= k
    ids = _ids()
    same = ids[:, None, :, None] == ids[:, None, None, :]
    if name == "documents":
        return keras_mha.Causal() & keras_mha.Documents(ids), same & causal
    if name == "prefix_lm":
        prefix = np.array([20, 47])
        dense = causal | (k < prefix[:, None, None, None])
        return keras_mha.PrefixLM(prefix), dense
    if name == "window_function":
        fn = keras_mha.MaskFunction(
            lambda b, h, qp, kp: ops.logical_and(qp >= kp, qp - kp < 20),
            monotone=True)
        return fn, (causal & (q - k < 20))[None, None]
    if name == "block_sparse":
        rng = np.random.default_rng(3)
        blocks = rng.random((5, 5)) < 0.3
        dense = np.kron(blocks, np.ones((BLOCK, BLOCK), bool))
        dense = dense[:LENGTH, :LENGTH] & (rng.random((LENGTH, LENGTH)) < 0.7)
        return keras_mha.DenseMask(dense[None, None]), dense[None, None]
    if name == "heads":  # a function of the head: each its own window
        fn = lambda b, h, qp, kp: ops.logical_and(  # noqa: E731
            qp >= kp, qp - kp <= 8 * (h + 1))
        heads = np.arange(4)[None, :, None, None]
        return fn, causal & (q - k <= 8 * (heads + 1))
    if name == "composed":  # ~, | and & together, with empty rows
        mask = (~keras_mha.Window(3, 3) | keras_mha.Chunk(25)) & \
            keras_mha.Causal() & keras_mha.Padding(
                query_mask=np.arange(LENGTH)[None] < np.array([[60], [75]]))
        real = np.arange(LENGTH)[None, :] < np.array([[60], [75]])
        dense = ((np.abs(q - k) > 3) | (q // 25 == k // 25)) & causal
        return mask, dense[None, None] & real[:, None, :, None]
    raise ValueError(name)


CASES = ["documents", "prefix_lm", "window_function", "block_sparse",
         "heads", "composed"]


def _layer(x, **kwargs):
    return make_layer(x, x, num_heads=4, key_dim=8, num_key_value_heads=2,
                      **kwargs)


def _inputs(rng):
    return rng.normal(size=(2, LENGTH, 16)).astype("float32")


class TestMasks:
    @pytest.mark.parametrize("name", CASES)
    @pytest.mark.parametrize("path", [dispatch.SPARSE, dispatch.EXPLICIT,
                                      dispatch.FUSED])
    def test_matches_reference_with_the_dense_mask(self, rng, name, path):
        x = _inputs(rng)
        layer = _layer(x)
        mask, dense = _case(name)
        with dispatch.force_path(path):
            got = to_numpy(layer(x, x, mask_mod=mask))
        want, _ = reference(layer, x, x, attention_mask=dense)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

    def test_empty_rows_are_zero(self, rng):
        x = _inputs(rng)
        layer = _layer(x, output_shape=None, use_bias=False)
        mask = keras_mha.MaskFunction(lambda b, h, q, k: q < 0)
        with dispatch.force_path(dispatch.SPARSE):
            got = to_numpy(layer(x, x, mask_mod=mask))
        np.testing.assert_array_equal(got, 0.0)

    def test_composes_with_the_layer_arguments(self, rng):
        """`mask_mod` is ANDed with causal, the window and padding."""
        x = _inputs(rng)
        layer = _layer(x, sliding_window=30)
        mask, dense = _case("documents")
        q, k = _positions()
        key_mask = np.arange(LENGTH)[None] < np.array([[70], [50]])
        for path in (dispatch.SPARSE, dispatch.EXPLICIT):
            with dispatch.force_path(path):
                got = to_numpy(layer(x, x, mask_mod=keras_mha.Documents(
                    _ids()), use_causal_mask=True, key_mask=key_mask))
            want, _ = reference(layer, x, x, attention_mask=dense
                                & key_mask[:, None, None, :],
                                use_causal_mask=True)
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

    def test_a_reused_mask_reads_each_calls_tensors(self, rng):
        """The block-sparse function kept by a mask for its signature
        takes the call's padding as arguments: a second call with other
        padding gets its own answer, from the same function."""
        x = _inputs(rng)
        layer = _layer(x)
        mask = keras_mha.Causal()
        for length in (70, 40):
            key_mask = np.arange(LENGTH)[None].repeat(2, 0) < length
            with dispatch.force_path(dispatch.SPARSE):
                got = to_numpy(layer(x, x, mask_mod=mask, key_mask=key_mask))
            want, _ = reference(layer, x, x, use_causal_mask=True,
                                key_mask=key_mask)
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
        # The portable route keeps one function for the mask's signature;
        # torch's native route builds none (it calls the fused kernel).
        kept = getattr(mask, "_sparse_functions", {})
        assert len(kept) == (0 if sparse.native_available() else 1)

    def test_the_rule_takes_sparse_for_long_sequences_only(self):
        layer = _layer(np.zeros((1, 4, 16), "float32"))
        mask = keras_mha.Causal() & keras_mha.Window(100)
        spec = layer._describe(np.zeros((1, 4, 16)), np.zeros((1, 4, 16)),
                               None, mask_mod=mask)
        threshold = tuning.value("sparse_min_length")
        long = 4096 if threshold == float("inf") else int(threshold)
        shapes = dispatch.Shapes(long, long, 8, 8, 1, 4)
        assert (dispatch.choose_path(spec, shapes) == dispatch.SPARSE) == (
            threshold <= long)
        short = dispatch.Shapes(256, 256, 8, 8, 1, 4)
        assert dispatch.choose_path(spec, short) in (dispatch.FUSED,
                                                     dispatch.EXPLICIT)
        # A function of each logit and its indices takes the sparse path;
        # one that reads a whole (T, S) tensor, the explicit path.
        scored = spec.replace(score_mod=keras_mha.ScoreFunction(
            lambda s, b, h, q, k: s * 0.5))
        assert (dispatch.choose_path(scored, shapes) == dispatch.SPARSE) == (
            threshold <= long)
        table = ops.zeros((1, 1, long, long))
        dense = spec.replace(score_mod=keras_mha.ScoreFunction(
            lambda s, b, h, q, k: s + table))
        assert dispatch.choose_path(dense, shapes) == dispatch.EXPLICIT


@pytest.mark.skipif(not sparse.native_available(),
                    reason="only torch has a native block-sparse route")
class TestNativeRoute:
    """torch's fused kernel a group of query blocks at a time against the
    portable pairs of blocks and the explicit path, forward and backward;
    the layer's calls above take it by default on torch, against the
    float64 reference."""

    @pytest.mark.parametrize("name", CASES + ["everything"])
    def test_native_equals_portable_and_explicit(self, rng, name):
        import torch

        # "everything": whole blocks only, the last one with padding.
        mask = keras_mha.MaskFunction(lambda b, h, q, k: k >= 0) \
            if name == "everything" else rules.as_mask(_case(name)[0])
        heads = [torch.tensor(rng.normal(size=(2, LENGTH, n, 8)).astype(
            "float32"), requires_grad=True) for n in (4, 2, 2)]
        spec = attention_spec(8, mask_mod=mask)
        cotangent = torch.tensor(rng.normal(size=(2, LENGTH, 4, 8)).astype(
            "float32"))
        results = {}
        for implementation in sparse.IMPLEMENTATIONS + ("explicit",):
            if implementation == "explicit":
                out = explicit.explicit_attention(*heads, spec)[0]
            else:
                out = sparse.sparse_attention(
                    *heads, spec, implementation=implementation)
            grads = torch.autograd.grad((out * cotangent).sum(), heads)
            results[implementation] = [to_numpy(x) for x in (out, *grads)]
        for want in (results[sparse.PORTABLE], results["explicit"]):
            for got, expected in zip(results[sparse.NATIVE], want):
                assert np.isfinite(got).all()
                np.testing.assert_allclose(got, expected, atol=3e-5,
                                           rtol=3e-5)

    def test_what_the_kernel_cannot_take_is_named(self, rng):
        heads = [rng.normal(size=(1, LENGTH, 2, 8)).astype("float32")
                 for _ in range(3)]
        capped = attention_spec(8, mask_mod=keras_mha.Causal(), soft_cap=4.0)
        with pytest.raises(ValueError, match="takes no soft-cap"):
            sparse.sparse_attention(*heads, capped, implementation="native")
        with pytest.raises(ValueError, match="Received: implementation='x'"):
            sparse.sparse_attention(*heads, capped, implementation="x")
        # Without a choice, the portable pairs take what the kernel cannot.
        got = to_numpy(sparse.sparse_attention(*heads, capped))
        want = to_numpy(explicit.explicit_attention(*heads, capped)[0])
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


class TestBlockMaps:
    @pytest.mark.parametrize("name", CASES)
    def test_bounds_hold_and_skip(self, name):
        mask, dense = _case(name)
        mask = rules.as_mask(mask)
        kinds = mask.block_map(LENGTH, LENGTH, BLOCK, batch_size=2,
                               num_heads=4).kinds
        dense = np.broadcast_to(dense, (2, 4, LENGTH, LENGTH))
        for i in range(kinds.shape[0]):
            for j in range(kinds.shape[1]):
                block = dense[:, :, i * BLOCK:(i + 1) * BLOCK,
                              j * BLOCK:(j + 1) * BLOCK]
                if kinds[i, j] == 0:
                    assert not block.any(), (i, j)
                if kinds[i, j] == 2:
                    assert block.all(), (i, j)
                if not block.any():  # exact where the objects know
                    assert kinds[i, j] == 0 or name in ("composed",), (i, j)

    def test_density_and_repr(self):
        block_map = keras_mha.Causal().block_map(64, 64, 16)
        np.testing.assert_array_equal(
            block_map.kinds, np.tril(np.full((4, 4), 2)) - np.eye(4, dtype=int))
        assert block_map.density == pytest.approx(10 / 16)
        assert "6 full, 4 partial, 6 skipped" in repr(block_map)

    def test_a_static_map_is_computed_once(self):
        calls = []

        def fn(b, h, q, k):
            calls.append(1)
            return q >= k

        mask = keras_mha.MaskFunction(fn)
        first = mask.block_map(64, 64, 16)
        count = len(calls)
        mask.block_map(64, 64, 16)
        assert len(calls) == count
        np.testing.assert_array_equal(
            first.kinds, keras_mha.Causal().block_map(64, 64, 16).kinds)


def _alibi_and_cap(score, b, h, q, k):
    """The soft-cap of 3 and ALiBi's slopes for 4 heads, as a score
    function; the slopes indexed by the head tensor, as any layout takes."""
    slopes = ops.convert_to_tensor(
        [2.0 ** (-2 * (head + 1)) for head in range(4)], score.dtype)
    capped = 3.0 * ops.tanh(score / 3.0)
    distance = ops.cast(ops.abs(q - k), score.dtype)
    return capped - ops.take(slopes, h) * distance


def _kept(mask):
    """The block-sparse functions `mask` keeps: one per signature once
    the portable sparse path has run for it."""
    return getattr(mask, "_sparse_functions", {})


class TestScoreFunctions:
    def test_alibi_and_soft_cap_as_score_functions(self, rng):
        x = _inputs(rng)
        layer = _layer(x)
        slopes = np.array([2.0 ** (-2 * (h + 1)) for h in range(4)],
                          "float32").reshape(1, 4, 1, 1)

        def alibi_and_cap(score, b, h, q, k):
            capped = 3.0 * ops.tanh(score / 3.0)
            distance = ops.cast(ops.abs(q - k), score.dtype)
            return capped - ops.convert_to_tensor(slopes) * distance

        want, _ = reference(layer, x, x, use_causal_mask=True, soft_cap=3.0,
                            alibi=True)
        # The sparse path shows the function (B, N, b, b) blocks, so
        # slopes shaped (1, N, 1, 1) broadcast there too.
        for path in (dispatch.SPARSE, dispatch.EXPLICIT):
            with dispatch.force_path(path):
                got = to_numpy(layer(x, x, use_causal_mask=True,
                                     score_mod=alibi_and_cap))
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

    @pytest.mark.parametrize("name", ["documents", "composed",
                                      "block_sparse"])
    def test_the_sparse_path_applies_it_block_by_block(self, rng, name):
        x = _inputs(rng)
        layer = _layer(x)
        mask, dense = _case(name)
        with dispatch.force_path(dispatch.SPARSE):
            got = to_numpy(layer(x, x, mask_mod=mask,
                                 score_mod=_alibi_and_cap))
        assert len(_kept(mask)) == 1  # the portable sparse path ran
        want, _ = reference(layer, x, x, attention_mask=dense, soft_cap=3.0,
                            alibi=True)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.training
class TestGradients:
    @pytest.mark.parametrize("name", ["documents", "prefix_lm",
                                      "block_sparse", "composed"])
    def test_same_gradients_as_explicit(self, rng, name):
        x = _inputs(rng)
        layer = _layer(x, use_sinks=True, attn_logits_soft_cap=4.0)
        layer.sinks.assign(np.linspace(-1.0, 1.0, 4).astype("float32"))
        mask, _ = _case(name)
        grads = {}
        for path in (dispatch.SPARSE, dispatch.EXPLICIT):
            with dispatch.force_path(path):
                grads[path] = layer_gradients(layer, x, x, mask_mod=mask)
        for got, want in zip(grads[dispatch.SPARSE],
                             grads[dispatch.EXPLICIT]):
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)


@pytest.mark.training
class TestScoreFunctionGradients:
    @pytest.mark.parametrize("name", ["documents", "composed"])
    def test_same_gradients_as_explicit(self, rng, name):
        x = _inputs(rng)
        layer = _layer(x, use_sinks=True)
        layer.sinks.assign(np.linspace(-1.0, 1.0, 4).astype("float32"))
        mask, _ = _case(name)
        grads = {}
        for path in (dispatch.SPARSE, dispatch.EXPLICIT):
            with dispatch.force_path(path):
                grads[path] = layer_gradients(layer, x, x, mask_mod=mask,
                                              score_mod=_alibi_and_cap)
        assert len(_kept(mask)) == 1
        for got, want in zip(grads[dispatch.SPARSE],
                             grads[dispatch.EXPLICIT]):
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)

    def test_a_function_over_a_weight_keeps_the_weights_gradient(self, rng):
        """A score function that closes over a trained weight runs on the
        explicit path, which differentiates the weight too; one over a
        constant stays on the sparse path."""
        x = _inputs(rng)
        layer = _layer(x, use_sinks=True)
        layer.sinks.assign(np.linspace(-1.0, 1.0, 4).astype("float32"))

        def biased(score, b, h, q, k):  # the sinks, read as a head bias too
            return score + ops.take(layer.sinks, h)

        mask, _ = _case("documents")
        grads = {}
        for path in (dispatch.SPARSE, dispatch.EXPLICIT):
            with dispatch.force_path(path):
                grads[path] = layer_gradients(layer, x, x, mask_mod=mask,
                                              score_mod=biased)
        # Had the sparse path differentiated it, the sinks' gradient would
        # lack the bias's part (JAX would refuse the closure).
        for got, want in zip(grads[dispatch.SPARSE],
                             grads[dispatch.EXPLICIT]):
            np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)
        kept = len(_kept(mask))
        constant = ops.convert_to_tensor(np.linspace(-1.0, 1.0, 4),
                                         "float32")
        with dispatch.force_path(dispatch.SPARSE):
            layer_gradients(layer, x, x, mask_mod=mask,
                            score_mod=lambda s, b, h, q, k: s + ops.take(
                                constant, h))
        assert len(_kept(mask)) == kept + 1


    def test_fit_takes_the_same_step_on_either_path(self, rng):
        """A `fit` step (compiled on JAX and TensorFlow) through a mask and
        a score function: the same weights after it on both paths."""
        x = _inputs(rng)
        target = rng.normal(size=x.shape).astype("float32")
        layer = _layer(x, use_sinks=True)
        mask, _ = _case("documents")
        model = _Scored(layer, mask)
        model(x)
        start = model.get_weights()
        after = {}
        for path in (dispatch.SPARSE, dispatch.EXPLICIT):
            model.set_weights(start)
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
            with dispatch.force_path(path):
                model.fit(x, target, batch_size=2, epochs=1, verbose=0,
                          shuffle=False)  # the mask is per row
            after[path] = model.get_weights()
        assert len(_kept(mask)) >= 1
        moved = max(np.abs(a - b).max() for a, b in zip(
            after[dispatch.SPARSE], start))
        assert moved > 1e-3
        for got, want in zip(after[dispatch.SPARSE],
                             after[dispatch.EXPLICIT]):
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


class _Scored(keras.Model):
    """One attention layer called with a mask and `_alibi_and_cap`."""

    def __init__(self, attention, mask):
        super().__init__(name="scored")
        self.attention = attention
        self.mask_mod = mask

    def call(self, x):
        return self.attention(x, x, mask_mod=self.mask_mod,
                              score_mod=_alibi_and_cap)


def _assert_decodes_as_whole(layer, x, mask):
    """A prompt of 50 tokens, then 5 at a time through the layer's own
    cache, with `mask`, equal the whole sequence's call, which the mask
    changes."""
    whole = to_numpy(layer(x, x, use_causal_mask=True, mask_mod=mask))
    cache = layer.init_cache(2, LENGTH)
    out, cache = layer(x[:, :50], x[:, :50], use_causal_mask=True,
                       cache=cache, cache_update_index=0, mask_mod=mask)
    steps = [to_numpy(out)]
    for t in range(50, LENGTH, 5):
        out, cache = layer(x[:, t:t + 5], x[:, t:t + 5],
                           use_causal_mask=True, cache=cache,
                           cache_update_index=t, mask_mod=mask)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, 1), whole,
                               atol=2e-5, rtol=2e-5)
    unmasked = to_numpy(layer(x, x, use_causal_mask=True))
    assert np.abs(unmasked - whole).max() > 1e-3  # the mask is read


class TestCaches:
    def test_decode_steps_see_the_mask_at_absolute_positions(self, rng):
        """A prompt then five tokens at a time, with a dense and a rolling
        cache, equal the whole sequence's call."""
        x = _inputs(rng)
        mask, _ = _case("documents")
        for window in (None, 40):
            _assert_decodes_as_whole(_layer(x, sliding_window=window), x,
                                     mask)

    def test_the_latent_layer_decodes_with_a_mask(self, rng):
        x = _inputs(rng)
        layer = keras_mha.MultiHeadLatentAttention(
            num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
            qk_rope_head_dim=4, v_head_dim=4,
            rotary_embedding=keras_mha.RotaryEmbedding())
        _assert_decodes_as_whole(layer, x, _case("documents")[0])

    def test_ragged_steps_over_pages_see_the_mask(self, rng):
        """A paged cache: both rows' prompts in one ragged call, then one
        token per row per step, with a mask (the batch index is the row)
        and a score function, equal the whole sequence's call."""
        from keras_mha.attention.paged import RaggedBatch

        x = _inputs(rng)
        layer = _layer(x)
        mask, _ = _case("documents")
        kwargs = dict(use_causal_mask=True, mask_mod=mask,
                      score_mod=lambda s, b, h, q, k: s * 0.5)
        whole = to_numpy(layer(x, x, **kwargs))
        pool = layer.init_paged_cache(12, 16)
        table = np.arange(12, dtype="int32").reshape(2, 6)[:, ::-1].copy()
        out, pool = layer(x[:, :60], x[:, :60], cache=pool,
                          cache_update_index=RaggedBatch(
                              table, np.zeros(2, "int32"),
                              np.full(2, 60, "int32")), **kwargs)
        steps = [to_numpy(out)]
        for t in range(60, LENGTH):
            out, pool = layer(x[:, t:t + 1], x[:, t:t + 1], cache=pool,
                              cache_update_index=RaggedBatch(
                                  table, np.full(2, t, "int32"),
                                  np.ones(2, "int32")), **kwargs)
            steps.append(to_numpy(out))
        np.testing.assert_allclose(np.concatenate(steps, 1), whole,
                                   atol=2e-5, rtol=2e-5)

    def test_an_int8_cache_sees_the_mask(self, rng):
        """A dense cache kept in int8 pages, a prompt then steps: close to
        the whole call with the mask, far from the one without."""
        x = _inputs(rng)
        layer = _layer(x)
        mask, _ = _case("documents")
        whole = to_numpy(layer(x, x, use_causal_mask=True, mask_mod=mask))
        cache = layer.init_cache(2, LENGTH, quantize="int8")
        out, cache = layer(x[:, :64], x[:, :64], use_causal_mask=True,
                           cache=cache, cache_update_index=0, mask_mod=mask)
        steps = [to_numpy(out)]
        out, cache = layer(x[:, 64:], x[:, 64:], use_causal_mask=True,
                           cache=cache, cache_update_index=64, mask_mod=mask)
        steps.append(to_numpy(out))
        got = np.concatenate(steps, 1)
        unmasked = to_numpy(layer(x, x, use_causal_mask=True))
        # int8's rounding, against what the mask changes.
        error = np.abs(got - whole).mean()
        assert error < 0.1 * np.abs(unmasked - whole).mean(), error


class TestBadInput:
    def test_a_mask_function_must_return_booleans(self, rng):
        x = _inputs(rng)
        layer = _layer(x)
        with pytest.raises(ValueError, match="must return a boolean"):
            layer(x, x, mask_mod=lambda b, h, q, k: q - k)

    def test_a_mask_function_must_broadcast(self, rng):
        x = _inputs(rng)
        layer = _layer(x)
        with pytest.raises(ValueError, match="must broadcast"):
            layer(x, x, mask_mod=lambda b, h, q, k: ops.ones((3, 5), "bool"))

    def test_a_score_function_keeps_shape_and_dtype(self, rng):
        x = _inputs(rng)
        layer = _layer(x)
        with pytest.raises(ValueError, match="shape and dtype"):
            layer(x, x, score_mod=lambda s, b, h, q, k: s[..., :1])
        with pytest.raises(ValueError, match="shape and dtype"):
            layer(x, x, score_mod=lambda s, b, h, q, k: ops.cast(s,
                                                                 "int32"))

    def test_types_are_named(self, rng):
        x = _inputs(rng)
        layer = _layer(x)
        with pytest.raises(TypeError, match="Received: mask_mod=3"):
            layer(x, x, mask_mod=3)
        with pytest.raises(TypeError, match="Received: score_mod='x'"):
            layer(x, x, score_mod="x")
        with pytest.raises(ValueError, match="Received: left=-1"):
            keras_mha.Window(-1)
        with pytest.raises(ValueError, match="rank 2"):
            keras_mha.Documents(np.zeros((3,), "int32"))

    @pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"),
                        reason="traces a call: jax.jit, tf.function")
    def test_a_static_promise_over_traced_data_is_refused(self, rng):
        x = _inputs(rng)
        layer = _layer(x)

        def call(x, ids):
            mask = keras_mha.MaskFunction(
                lambda b, h, q, k: ops.take(ids[0], q) == ops.take(ids[0], k))
            with dispatch.force_path(dispatch.SPARSE):
                return layer(x, x, mask_mod=mask)

        with pytest.raises(ValueError, match="promised static"):
            compiled(call)(x, _ids())


class TestKerasHubsCachedLayer:
    """`CachedMultiHeadAttention` takes masks and score functions too, at
    its cache's positions."""

    def test_prompt_then_steps_see_the_mask_and_scores(self, rng):
        x = _inputs(rng)
        twin = _layer(x)
        layer = keras_mha.CachedMultiHeadAttention(
            num_heads=4, key_dim=8, num_key_value_heads=2)
        layer.build(x.shape, x.shape)
        layer.set_weights(twin.get_weights())
        mask, _ = _case("documents")
        scores = rules.ScoreFunction(lambda s, b, h, q, k: s * 0.5)
        whole = to_numpy(twin(x, x, use_causal_mask=True, mask_mod=mask,
                              score_mod=scores))
        causal = np.tril(np.ones((LENGTH, LENGTH), bool))
        cache = layer.init_cache(2, LENGTH)
        steps = []
        for start, stop in ((0, 50), (50, 51), (51, LENGTH)):
            out, cache = layer(x[:, start:stop], x[:, start:stop],
                               attention_mask=causal[start:stop],
                               cache=cache, cache_update_index=start,
                               mask_mod=mask, score_mod=scores)
            steps.append(to_numpy(out))
        np.testing.assert_allclose(np.concatenate(steps, 1), whole,
                                   atol=2e-5, rtol=2e-5)
        plain = to_numpy(twin(x, x, use_causal_mask=True))
        assert np.abs(plain - whole).max() > 1e-3

    def test_not_a_function(self, rng):
        x = _inputs(rng)
        layer = keras_mha.CachedMultiHeadAttention(num_heads=4, key_dim=8)
        with pytest.raises(TypeError, match="mask_mod"):
            layer(x, x, mask_mod=3)
