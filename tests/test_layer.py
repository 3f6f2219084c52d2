"""Correctness of the layer against the float64 reference and Keras's layer."""

import dataclasses
import itertools

import keras
import numpy as np
import pytest
from conftest import BACKEND
from util import assert_close
from util import make_keras_twin
from util import make_layer
from util import random_inputs
from util import reference
from util import to_numpy

import keras_mha
from keras_mha.attention import dispatch
from keras_mha.attention import tuning


def _case_id(params):
    return "-".join(f"{k}={v}" for k, v in params.items())


# Self- and cross-attention x causal x windows {none, 1, small, >= T} x
# padding x scores (which also switches the attention path).
MASK_CASES = [
    dict(attn=attn, causal=causal, window=window, padding=padding, scores=s)
    for attn, causal, window, padding, s in itertools.product(
        ["self", "cross"],
        [False, True],
        [None, 1, 3, 16],
        ["none", "value", "query"],
        [False, True],
    )
]


def _padding(padding, batch, query_length, key_length):
    query_mask = value_mask = None
    if padding == "value":
        value_mask = np.ones((batch, key_length), bool)
        value_mask[0, -2:] = False  # trailing padding in one batch entry
    elif padding == "query":
        query_mask = np.ones((batch, query_length), bool)
        query_mask[1, -1] = False  # a padded query: nothing to attend to
    return query_mask, value_mask


class TestAgainstReference:
    @pytest.mark.parametrize("case", MASK_CASES, ids=_case_id)
    def test_masks_causal_window(self, rng, case):
        key_length = 5 if case["attn"] == "self" else 7
        query, value = random_inputs(rng, query_length=5, key_length=key_length)
        query_mask, value_mask = _padding(case["padding"], 2, 5, key_length)
        layer = make_layer(
            query, value, num_heads=2, key_dim=4, sliding_window=case["window"]
        )
        result = layer(
            query,
            value,
            query_mask=query_mask,
            value_mask=value_mask,
            use_causal_mask=case["causal"],
            return_attention_scores=case["scores"],
        )
        expected, probs = reference(
            layer,
            query,
            value,
            query_mask=query_mask,
            value_mask=value_mask,
            use_causal_mask=case["causal"],
        )
        if case["scores"]:
            output, scores = result
            assert tuple(scores.shape) == (2, 2, 5, key_length)
            assert_close(scores, probs)
        else:
            output = result
        assert_close(output, expected)

    @pytest.mark.parametrize(
        "shape", [(5, 7), (1, 5, 7), (2, 1, 7), (2, 5, 7), (2, 3, 5, 7)]
    )
    @pytest.mark.parametrize("dtype", ["bool", "int32"])
    def test_attention_mask_shapes(self, rng, shape, dtype):
        query, value = random_inputs(rng, query_length=5, key_length=7)
        mask = rng.random(shape) > 0.3
        mask[..., 0] = True  # keep every row attending somewhere
        layer = make_layer(query, value, num_heads=3, key_dim=4)
        expected, _ = reference(layer, query, value, attention_mask=mask)
        for scores in (False, True):
            result = layer(
                query,
                value,
                attention_mask=mask.astype(dtype),
                return_attention_scores=scores,
            )
            assert_close(result[0] if scores else result, expected)

    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(value_dim=3),
            dict(value_dim=6, output_shape=5),
            dict(output_shape=(2, 3)),
            dict(use_bias=False),
            dict(use_gate=True),
            dict(use_gate=True, use_bias=False, value_dim=2),
            dict(use_gate=True, gate_activation="softplus"),
            dict(num_key_value_heads=2),
            dict(num_key_value_heads=1),
        ],
        ids=_case_id,
    )
    @pytest.mark.parametrize("scores", [False, True])
    def test_projection_options(self, rng, kwargs, scores):
        query, value = random_inputs(rng, query_length=4, key_length=6)
        key = rng.normal(size=(2, 6, 5)).astype("float32")
        layer = make_layer(query, value, key, num_heads=4, key_dim=4, **kwargs)
        result = layer(
            query, value, key, use_causal_mask=True,
            return_attention_scores=scores,
        )
        output = result[0] if scores else result
        expected, _ = reference(layer, query, value, key, use_causal_mask=True)
        out_shape = kwargs.get("output_shape", 8)
        out_shape = (out_shape,) if isinstance(out_shape, int) else out_shape
        assert tuple(output.shape) == (2, 4, *out_shape)
        assert_close(output, expected.reshape(output.shape))

    def test_dropout_inference_is_identity(self, rng):
        query, value = random_inputs(rng)
        layer = make_layer(query, value, num_heads=2, key_dim=4, dropout=0.5)
        expected, _ = reference(layer, query, value)
        assert_close(layer(query, value, training=False), expected)
        assert_close(layer(query, value), expected)

    def test_dropout_training_is_seeded(self, rng):
        query, value = random_inputs(rng)
        outputs = []
        for _ in range(2):
            layer = keras_mha.MultiHeadAttention(
                num_heads=2, key_dim=4, dropout=0.5, seed=7,
                kernel_initializer=keras.initializers.GlorotUniform(seed=1),
                bias_initializer=keras.initializers.RandomNormal(seed=2),
            )
            outputs.append(to_numpy(layer(query, value, training=True)))
        np.testing.assert_array_equal(outputs[0], outputs[1])
        expected, _ = reference(layer, query, value)
        assert not np.allclose(outputs[0], expected, atol=1e-3)


class TestAgainstKeras:
    """Same weights as `keras.layers.MultiHeadAttention`, same numbers."""

    # Keras is well defined where every query row has a key to attend to:
    # no padded queries, and no window of 1 over padded keys.
    @pytest.mark.parametrize(
        "case",
        [
            c
            for c in MASK_CASES
            if c["padding"] != "query"
            and not (c["padding"] == "value" and c["window"] == 1)
        ],
        ids=_case_id,
    )
    def test_same_outputs(self, rng, case):
        key_length = 5 if case["attn"] == "self" else 7
        query, value = random_inputs(rng, query_length=5, key_length=key_length)
        _, value_mask = _padding(case["padding"], 2, 5, key_length)
        layer = make_layer(
            query, value, num_heads=2, key_dim=4, sliding_window=case["window"]
        )
        twin = make_keras_twin(layer, query, value)
        kwargs = dict(
            value_mask=value_mask,
            use_causal_mask=case["causal"],
            return_attention_scores=case["scores"],
        )
        ours, theirs = layer(query, value, **kwargs), twin(query, value, **kwargs)
        if case["scores"]:
            assert_close(ours[1], to_numpy(theirs[1]).astype("float64"))
            ours, theirs = ours[0], theirs[0]
        assert_close(ours, to_numpy(theirs).astype("float64"))

    @pytest.mark.parametrize("axes", [(1, 2), (2,), (-2,), 1, (1, 3)])
    @pytest.mark.parametrize("scores", [False, True])
    def test_attention_axes(self, rng, axes, scores):
        shape = (2, 3, 4, 2, 6) if axes == (1, 3) else (2, 3, 4, 6)
        query = rng.normal(size=shape).astype("float32")
        layer = make_layer(query, query, num_heads=2, key_dim=3,
                           attention_axes=axes)
        twin = make_keras_twin(layer, query, query)
        ours = layer(query, query, return_attention_scores=scores)
        theirs = twin(query, query, return_attention_scores=scores)
        if scores:
            assert tuple(ours[1].shape) == tuple(theirs[1].shape)
            assert_close(ours[1], to_numpy(theirs[1]).astype("float64"))
            ours, theirs = ours[0], theirs[0]
        assert_close(ours, to_numpy(theirs).astype("float64"))

    def test_projections_are_einsum_dense(self, rng):
        # Same weights and numbers as Keras's `EinsumDense`; LoRA goes
        # through Keras's own call (torch's `addmm` serves plain ones).
        query, value = random_inputs(rng, query_length=4, key_length=6)
        layer = make_layer(query, value, num_heads=2, key_dim=4)
        dense = layer._query_dense
        assert isinstance(dense, keras.layers.EinsumDense)
        x = keras.ops.convert_to_tensor(query)
        keras_call = keras.layers.EinsumDense.call
        assert_close(to_numpy(dense(x)), to_numpy(keras_call(dense, x)))
        dense.enable_lora(2)
        dense.lora_kernel_b.assign(np.ones(dense.lora_kernel_b.shape))
        assert_close(to_numpy(dense(x)), to_numpy(keras_call(dense, x)))
        assert np.abs(to_numpy(dense(x)) - to_numpy(
            keras.ops.einsum(dense.equation, x, dense._kernel) + dense.bias
        )).max() > 1e-3  # LoRA's term is in

    def test_weights_copy_both_ways(self, rng):
        query, value = random_inputs(rng, query_length=4, key_length=6)
        layer = make_layer(query, value, num_heads=2, key_dim=4, use_gate=True)
        twin = make_keras_twin(layer, query, value)
        assert [w.name for w in layer.weights] == [w.name for w in twin.weights]
        assert [w.path.split("/", 1)[1] for w in layer.weights] == [
            w.path.split("/", 1)[1] for w in twin.weights
        ]
        twin_out = to_numpy(twin(query, value))
        fresh = make_layer(query, value, num_heads=2, key_dim=4, use_gate=True)
        fresh.set_weights(twin.get_weights())
        # torch's projections accumulate the bias in the matmul (`addmm`):
        # float32 rounding apart, the same numbers.
        np.testing.assert_allclose(
            to_numpy(fresh(query, value)), twin_out, atol=1e-5
        )

    @pytest.mark.training
    def test_same_gradient_step(self, rng):
        """One SGD step moves every weight the same as Keras's layer."""
        query, value = random_inputs(rng, query_length=6, key_length=6)
        target = rng.normal(size=(2, 6, 8)).astype("float32")
        mask = np.ones((2, 6), bool)
        mask[0, -2:] = False
        ours = make_layer(query, value, num_heads=2, key_dim=4,
                          sliding_window=3)
        layers = [ours, make_keras_twin(ours, query, value)]
        initial = ours.get_weights()
        models = []
        for layer in layers:
            q_in = keras.Input((6, 8))
            v_in = keras.Input((6, 8))
            m_in = keras.Input((6,), dtype="bool")
            out = layer(q_in, v_in, value_mask=m_in, use_causal_mask=True)
            model = keras.Model([q_in, v_in, m_in], out)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            model.train_on_batch([query, value, mask], target)
            models.append(model)
        for start, moved in zip(initial, ours.get_weights()):
            if start.ndim == 3:  # kernels (the key bias gets no gradient)
                assert not np.allclose(start, moved)
        for ours, theirs in zip(*(m.get_weights() for m in models)):
            np.testing.assert_allclose(ours, theirs, atol=1e-5)


class TestKnownKerasDifferences:
    """Each deliberate difference from Keras, pinned on our side."""

    def test_empty_rows_output_the_bias_on_every_path(self, rng):
        query, value = random_inputs(rng, query_length=4, key_length=4)
        query_mask = np.ones((2, 4), bool)
        query_mask[0, 1] = False
        layer = make_layer(query, value, num_heads=2, key_dim=4)
        bias = to_numpy(layer.output_dense.bias)
        for scores in (False, True):
            result = layer(query, value, query_mask=query_mask,
                           return_attention_scores=scores)
            output = to_numpy(result[0] if scores else result)
            np.testing.assert_allclose(output[0, 1], bias, atol=1e-6)
            if scores:
                np.testing.assert_array_equal(to_numpy(result[1])[0, :, 1], 0)

    def test_explicit_query_mask_is_honoured(self, rng):
        query, value = random_inputs(rng)
        query_mask = np.ones((2, 5), bool)
        query_mask[0, 0] = False
        layer = make_layer(query, value, num_heads=2, key_dim=4)
        expected, _ = reference(layer, query, value, query_mask=query_mask)
        assert_close(layer(query, value, query_mask=query_mask), expected)

    def test_value_dim_differs_from_key_dim(self, rng):
        query, value = random_inputs(rng)
        layer = make_layer(query, value, num_heads=2, key_dim=4, value_dim=3)
        expected, _ = reference(layer, query, value)
        assert_close(layer(query, value), expected)
        if BACKEND == "jax":
            # Keras's fused path rejects H != V on JAX.
            twin = make_keras_twin(layer, query, value)
            with pytest.raises(Exception):
                twin(query, value)

    @pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
    @pytest.mark.parametrize("scores", [False, True])
    def test_half_precision_does_not_overflow(self, policy, scores):
        if BACKEND == "numpy" and policy == "mixed_bfloat16":
            pytest.skip("the NumPy backend has no bfloat16 matmul")
        keras.config.set_dtype_policy(policy)
        query = np.full((1, 4, 16), 30.0, "float32")
        layer = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=16, kernel_initializer="ones"
        )
        result = layer(query, query, return_attention_scores=scores)
        output = to_numpy(result[0] if scores else result).astype("float32")
        assert np.isfinite(output).all()
        # Uniform weights over equal values: each output is 2*16*480 = 15360.
        np.testing.assert_allclose(output, 15360.0, rtol=1e-2)

    def test_symbolic_scores_shape_for_cross_attention(self):
        query = keras.Input((5, 8))
        value = keras.Input((7, 8))
        layer = keras_mha.MultiHeadAttention(num_heads=3, key_dim=4)
        output, scores = layer(query, value, return_attention_scores=True)
        assert tuple(output.shape) == (None, 5, 8)
        assert tuple(scores.shape) == (None, 3, 5, 7)

    def test_flash_attention_false_survives_config(self):
        layer = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=4, flash_attention=False
        )
        clone = keras_mha.MultiHeadAttention.from_config(layer.get_config())
        assert clone.flash_attention is False
        assert clone.get_config() == layer.get_config()


class TestCausalAlongAxis:
    def test_single_axis_on_rank_4(self, rng):
        """Causal and window masks apply along the one attention axis."""
        query = rng.normal(size=(2, 3, 6, 8)).astype("float32")
        layer = make_layer(query, query, num_heads=2, key_dim=4,
                           attention_axes=2, sliding_window=2)
        output = to_numpy(layer(query, query, use_causal_mask=True))
        for a in range(3):
            expected, _ = reference(
                layer, query[:, a], query[:, a], use_causal_mask=True
            )
            np.testing.assert_allclose(output[:, a], expected, atol=1e-5)

    def test_multi_axis_rejects_causal(self, rng):
        query = rng.normal(size=(2, 3, 4, 8)).astype("float32")
        layer = make_layer(query, query, num_heads=2, key_dim=4,
                           attention_axes=(1, 2))
        with pytest.raises(ValueError, match="use_causal_mask"):
            layer(query, query, use_causal_mask=True)
        with pytest.raises(ValueError, match="sliding_window"):
            keras_mha.MultiHeadAttention(
                num_heads=2, key_dim=4, attention_axes=(1, 2), sliding_window=2
            )


class TestBandedPath:
    """The banded path inside the layer, on both sides of its threshold."""

    @pytest.mark.parametrize("window", [1, 17, 128])
    @pytest.mark.parametrize("causal", [False, True])
    def test_every_path_matches_reference(self, rng, window, causal):
        query, value = random_inputs(rng, batch=2, query_length=300)
        value_mask = np.ones((2, 300), bool)
        value_mask[1, -37:] = False  # padding at the end
        layer = make_layer(query, value, num_heads=4, key_dim=4,
                           num_key_value_heads=2, sliding_window=window)
        expected, _ = reference(layer, query, value, value_mask=value_mask,
                                use_causal_mask=causal)
        for path in dispatch.PATHS:
            with dispatch.force_path(path):
                output = layer(query, value, value_mask=value_mask,
                               use_causal_mask=causal)
            assert_close(output, expected, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize(
        "window, key_length",
        [
            (100, tuning.value("banded_min_ratio", platform="cpu") * 100 - 1),
            (100, tuning.value("banded_min_ratio", platform="cpu") * 100),
            (2, tuning.value("banded_min_length", platform="cpu") - 1),
            (2, tuning.value("banded_min_length", platform="cpu")),
        ],
    )
    def test_threshold(self, rng, window, key_length):
        """Either side of each threshold: the rule flips, the numbers don't."""
        query, value = random_inputs(rng, batch=1, query_length=key_length)
        layer = make_layer(query, value, num_heads=2, key_dim=4,
                           sliding_window=window)
        path = layer.attention_path(query.shape, value.shape,
                                    use_causal_mask=True)
        banded = (
            key_length >= tuning.value("banded_min_ratio") * window
            and key_length >= tuning.value("banded_min_length")
        )
        assert path == (dispatch.BANDED if banded else dispatch.FUSED)
        expected, _ = reference(layer, query, value, use_causal_mask=True)
        assert_close(layer(query, value, use_causal_mask=True), expected,
                     rtol=1e-5)

    @pytest.mark.training
    def test_same_gradient_step_as_keras(self, rng):
        query, value = random_inputs(rng, batch=2, query_length=300)
        target = rng.normal(size=(2, 300, 8)).astype("float32")
        ours = make_layer(query, value, num_heads=2, key_dim=4,
                          sliding_window=17)
        twin = make_keras_twin(ours, query, value)
        models = []
        for layer in (ours, twin):
            q_in, v_in = keras.Input((300, 8)), keras.Input((300, 8))
            model = keras.Model(
                [q_in, v_in], layer(q_in, v_in, use_causal_mask=True)
            )
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            model.train_on_batch([query, value], target)
            models.append(model)
        for a, b in zip(*(m.get_weights() for m in models)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


class TestSettings:
    """`layer.settings`: the configuration as one frozen value, which the
    properties, the config and the modules around the layer read."""

    def test_one_frozen_value_resolved(self):
        layer = keras_mha.MultiHeadAttention(
            num_heads=4, key_dim=8, num_key_value_heads=2, sliding_window=5,
            attention_chunk_size=3)
        settings = layer.settings
        assert (settings.value_dim, settings.num_key_value_heads) == (8, 2)
        assert settings.scale == layer.scale == pytest.approx(8 ** -0.5)
        assert settings.given_scale is None
        assert layer.get_config()["scale"] is None
        assert settings.rolling_slots == 3  # the chunk's, fewer than 5
        assert layer.num_key_value_heads == settings.num_key_value_heads
        with pytest.raises(dataclasses.FrozenInstanceError):
            settings.num_heads = 1
        latent = keras_mha.MultiHeadLatentAttention(2, 8, 4, 4, 4)
        assert latent.settings.attention_chunk_size is None
        assert latent.settings.flash_attention is None
        assert latent.settings.rolling_slots is None

    def test_saved_weights_hold_nothing_of_it(self, tmp_path):
        query = np.ones((1, 3, 8), "float32")
        layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4,
                                             use_gate=True)
        inputs = keras.Input((3, 8))
        model = keras.Model(inputs, layer(inputs, inputs))
        model(query)
        model.save_weights(tmp_path / "m.weights.h5")
        import h5py

        with h5py.File(tmp_path / "m.weights.h5") as file:
            paths = []
            file.visit(paths.append)
        assert not [p for p in paths if "settings" in p]
        # Keras's paths, the gate's a private one as in Keras's layer.
        assert "layers/multi_head_attention/_gate_dense/vars/0" in paths

    def test_sublayers_by_name(self):
        query = np.ones((1, 3, 8), "float32")
        layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4,
                                             use_gate=True)
        assert layer.sublayer("query") is None  # not built yet
        layer(query, query)
        assert layer.sublayer("query") is layer.query_dense
        assert layer.sublayer("gate").name == "gate"
        assert layer.sublayer("output") is layer.output_dense
        with pytest.raises(ValueError, match="name='kv_a'"):
            layer.sublayer("kv_a")
