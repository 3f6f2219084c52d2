"""The layer inside Keras: config, saving, training, masks, paths, shapes."""

import keras
import numpy as np
import pytest
from keras.src.backend.common.masking import get_keras_mask
from util import assert_close
from util import make_layer
from util import random_inputs
from util import reference
from util import to_numpy

import keras_mha
from keras_mha.attention import AttentionSpec
from keras_mha.attention import dispatch
from keras_mha.attention.explicit import explicit_attention
from keras_mha.attention.fused import fused_attention


class TestConfigAndSaving:
    def test_registered_name(self):
        name = keras.saving.get_registered_name(keras_mha.MultiHeadAttention)
        assert name == "keras_mha>MultiHeadAttention"

    def test_config_round_trip(self):
        layer = keras_mha.MultiHeadAttention(
            num_heads=4, key_dim=8, value_dim=6, dropout=0.1, use_bias=False,
            output_shape=(3, 2), attention_axes=(1,), sliding_window=5,
            flash_attention=False, use_gate=True, seed=3,
            num_key_value_heads=2, kernel_regularizer="l2", name="mha",
        )
        config = layer.get_config()
        clone = keras_mha.MultiHeadAttention.from_config(config)
        assert clone.get_config() == config
        assert (clone.num_heads, clone.key_dim, clone.value_dim) == (4, 8, 6)
        assert clone.sliding_window == 5
        assert clone.num_key_value_heads == 2

    def test_accepts_keras_layer_config(self):
        config = keras.layers.MultiHeadAttention(
            num_heads=2, key_dim=4, sliding_window=3
        ).get_config()
        layer = keras_mha.MultiHeadAttention.from_config(config)
        assert layer.sliding_window == 3 and layer.num_heads == 2

    def test_functional_model_saves_and_loads(self, rng, tmp_path):
        tokens = keras.Input((6,), dtype="int32")
        x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
        x = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=4, sliding_window=3, name="mha"
        )(x, x, use_causal_mask=True)
        model = keras.Model(tokens, x)
        data = rng.integers(1, 20, size=(3, 6)).astype("int32")
        data[0, -2:] = 0
        expected = to_numpy(model.predict(data, verbose=0))
        for name in ("model.keras", "model.weights.h5"):
            path = str(tmp_path / name)
            if name.endswith(".keras"):
                model.save(path)
                loaded = keras.saving.load_model(path)
                assert isinstance(
                    loaded.get_layer("mha"), keras_mha.MultiHeadAttention
                )
            else:
                model.save_weights(path)
                loaded = keras.models.clone_model(model)
                loaded.load_weights(path)
            np.testing.assert_array_equal(
                to_numpy(loaded.predict(data, verbose=0)), expected
            )


class TestTraining:
    # `fit` with jit_compile=True and every feature: test_compile.py.
    @pytest.mark.training
    @pytest.mark.parametrize("window", [None, 2])
    def test_fit_one_epoch(self, rng, window):
        inputs = keras.Input((8, 6))
        x = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=4, dropout=0.1, sliding_window=window,
        )(inputs, inputs, use_causal_mask=True)
        outputs = keras.layers.Dense(1)(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="adam", loss="mse", jit_compile=False)
        before = [w.copy() for w in model.get_weights()]
        data = rng.normal(size=(16, 8, 6)).astype("float32")
        target = rng.normal(size=(16, 8, 1)).astype("float32")
        history = model.fit(data, target, batch_size=8, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"]).all()
        changed = [
            not np.allclose(a, b) for a, b in zip(before, model.get_weights())
        ]
        assert sum(changed) >= len(changed) - 1  # all but the key bias

    @pytest.mark.training
    def test_gradients_finite_with_empty_rows(self, rng):
        query, value = random_inputs(rng)
        query_mask = np.ones((2, 5), bool)
        query_mask[0, 2:] = False
        value_mask = np.ones((2, 5), bool)
        value_mask[1, :] = False  # a whole batch entry with no keys
        for scores in (False, True):
            q_in, v_in = keras.Input((5, 8)), keras.Input((5, 8))
            qm, vm = keras.Input((5,), dtype="bool"), keras.Input((5,), dtype="bool")
            out = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)(
                q_in, v_in, query_mask=qm, value_mask=vm,
                return_attention_scores=scores,
            )
            model = keras.Model([q_in, v_in, qm, vm], out[0] if scores else out)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            loss = model.train_on_batch(
                [query, value, query_mask, value_mask], np.ones((2, 5, 8))
            )
            assert np.isfinite(loss)
            for weight in model.get_weights():
                assert np.isfinite(weight).all()


class TestKerasMasks:
    def _embedded(self):
        tokens = np.array([[3, 4, 5, 0, 0], [6, 7, 8, 9, 1]], "int32")
        embed = keras.layers.Embedding(10, 8, mask_zero=True)
        return embed(tokens), tokens != 0

    def test_input_masks_survive_and_output_carries_query_mask(self):
        x, expected = self._embedded()
        layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
        output = layer(x, x)
        np.testing.assert_array_equal(to_numpy(get_keras_mask(x)), expected)
        np.testing.assert_array_equal(
            to_numpy(get_keras_mask(output)), expected
        )

    def test_keras_masks_are_applied(self, rng):
        x, token_mask = self._embedded()
        x_np = to_numpy(x)
        layer = make_layer(x_np, x_np, num_heads=2, key_dim=4)
        expected, _ = reference(
            layer, x_np, x_np, query_mask=token_mask, value_mask=token_mask
        )
        assert_close(layer(x, x), expected)

    def test_mask_reaches_downstream_layers_in_a_model(self, rng):
        tokens = keras.Input((5,), dtype="int32")
        x = keras.layers.Embedding(10, 8, mask_zero=True)(tokens)
        x = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)
        pooled = keras.layers.GlobalAveragePooling1D()(x)
        model = keras.Model(tokens, [x, pooled])
        data = np.array([[3, 4, 0, 0, 0]], "int32")
        seq, mean = (to_numpy(t) for t in model.predict(data, verbose=0))
        np.testing.assert_allclose(mean[0], seq[0, :2].mean(0), atol=1e-6)


class TestPaths:
    """The fused and explicit paths agree, and the rule picks as documented."""

    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
    def test_fused_equals_explicit(self, rng, causal, num_kv_heads):
        q = rng.normal(size=(2, 5, 4, 3)).astype("float32")
        k = rng.normal(size=(2, 7, num_kv_heads, 3)).astype("float32")
        v = rng.normal(size=(2, 7, num_kv_heads, 3)).astype("float32")
        mask = rng.random((2, 1, 5, 7)) > 0.4
        mask[0, 0, 2] = False  # a row with nothing to attend to
        spec = AttentionSpec(scale=0.5, causal=causal, attention_mask=mask)
        fused = fused_attention(q, k, v, spec)
        explicit, weights = explicit_attention(q, k, v, spec)
        np.testing.assert_allclose(
            to_numpy(fused), to_numpy(explicit), atol=1e-6
        )
        np.testing.assert_array_equal(to_numpy(fused)[0, 2], 0.0)
        np.testing.assert_array_equal(to_numpy(weights)[0, :, 2], 0.0)

    def test_native_causal_equals_mask(self, rng):
        q = rng.normal(size=(1, 4, 2, 3)).astype("float32")
        kv = rng.normal(size=(1, 6, 2, 3)).astype("float32")
        spec = AttentionSpec(scale=0.5, causal=True)
        assert spec.plain_causal  # the backend's own causal kernel
        native = fused_attention(q, kv, kv, spec)
        causal = np.tril(np.ones((4, 6), bool))[None, None]
        masked = fused_attention(
            q, kv, kv, AttentionSpec(scale=0.5, attention_mask=causal)
        )
        np.testing.assert_allclose(
            to_numpy(native), to_numpy(masked), atol=1e-6
        )

    def test_rule(self):
        def path(t_len=None, s_len=None, value_dim=4, backend=None, **spec):
            return dispatch.choose_path(
                AttentionSpec(scale=1.0, **spec),
                dispatch.Shapes(t_len, s_len, 4, value_dim),
                backend=backend,
            )

        assert path() == dispatch.FUSED
        assert path(return_weights=True) == dispatch.EXPLICIT
        assert path(dropout=0.1) == dispatch.EXPLICIT
        band = dict(window=(7, 7), t_len=512, s_len=512)
        assert path(**band) == dispatch.BANDED
        assert path(attention_mask=np.ones((1, 1, 512, 512), bool),
                    **band) == dispatch.FUSED
        assert path(return_weights=True, **band) == dispatch.EXPLICIT
        assert path(dropout=0.1, **band) == dispatch.BANDED
        # Below the band's threshold.
        assert path(dropout=0.1, **dict(band, s_len=16)) == dispatch.EXPLICIT
        # The band needs a static T.
        assert path(**dict(band, t_len=None)) == dispatch.FUSED
        # Keys at a cache's slots: only fused and explicit serve them.
        assert path(key_positions=np.arange(512), **band) == dispatch.FUSED
        for backend, expected in (("jax", dispatch.EXPLICIT),
                                  ("torch", dispatch.FUSED)):
            assert path(value_dim=3, backend=backend) == expected

    def test_flash_attention_required_rejects_scores(self, rng):
        query, value = random_inputs(rng)
        layer = make_layer(query, value, num_heads=2, key_dim=4,
                           flash_attention=True)
        with pytest.raises(ValueError, match="flash_attention=True"):
            layer(query, value, return_attention_scores=True)


class TestShapes:
    @pytest.mark.parametrize(
        "kwargs, expected",
        [
            (dict(), (None, 5, 8)),
            (dict(output_shape=3), (None, 5, 3)),
            (dict(output_shape=(2, 3)), (None, 5, 2, 3)),
        ],
    )
    def test_symbolic_output_shape(self, kwargs, expected):
        layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, **kwargs)
        output = layer(keras.Input((5, 8)), keras.Input((7, 6)))
        assert tuple(output.shape) == expected
        assert layer.compute_output_shape(
            (None, 5, 8), (None, 7, 6)
        ) == expected

    def test_symbolic_multi_axis_scores(self):
        layer = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=4, attention_axes=(2, 3)
        )
        query = keras.Input((3, 4, 5, 8))
        _, scores = layer(query, query, return_attention_scores=True)
        assert tuple(scores.shape) == (None, 3, 2, 4, 5, 4, 5)

    def test_dynamic_lengths_in_a_model(self, rng):
        inputs = keras.Input((None, 8))
        outputs = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=4, sliding_window=2
        )(inputs, inputs, use_causal_mask=True)
        model = keras.Model(inputs, outputs)
        for length in (3, 6):
            data = rng.normal(size=(2, length, 8)).astype("float32")
            assert model.predict(data, verbose=0).shape == (2, length, 8)


class TestValidation:
    @pytest.mark.parametrize(
        "kwargs, name",
        [
            (dict(num_heads=0, key_dim=4), "num_heads"),
            (dict(num_heads=2, key_dim=True), "key_dim"),
            (dict(num_heads=2, key_dim=4, value_dim=2.0), "value_dim"),
            (dict(num_heads=2, key_dim=4, dropout=1.0), "dropout"),
            (dict(num_heads=2, key_dim=4, dropout=-0.1), "dropout"),
            (dict(num_heads=2, key_dim=4, sliding_window=0), "sliding_window"),
            (dict(num_heads=2, key_dim=4, sliding_window=2.0), "sliding_window"),
            (dict(num_heads=2, key_dim=4, sliding_window=True), "sliding_window"),
            (dict(num_heads=2, key_dim=4, output_shape="8"), "output_shape"),
            (dict(num_heads=4, key_dim=4, num_key_value_heads=3),
             "num_key_value_heads"),
            (dict(num_heads=2, key_dim=4, flash_attention=True, dropout=0.1),
             "dropout"),
        ],
    )
    def test_constructor(self, kwargs, name):
        with pytest.raises(ValueError, match=f"Received: .*{name}="):
            keras_mha.MultiHeadAttention(**kwargs)

    def test_key_and_value_lengths_disagree(self, rng):
        query, value = random_inputs(rng)
        key = np.zeros((2, 4, 8), "float32")
        layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)
        with pytest.raises(ValueError, match="key.shape"):
            layer(query, value, key)

    def test_attention_axes_out_of_range(self, rng):
        query, value = random_inputs(rng)
        layer = keras_mha.MultiHeadAttention(
            num_heads=2, key_dim=4, attention_axes=(2,)
        )
        with pytest.raises(ValueError, match="attention_axes"):
            layer(query, value)

    def test_float_masks_mean_nonzero_may_attend(self, rng):
        # As Keras takes them (its own tests pass `ops.tril(ops.ones(...))`).
        query, value = random_inputs(rng)
        layer = make_layer(query, value, num_heads=2, key_dim=4)
        allowed = rng.random((2, 5, 5)) > 0.3
        tokens = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
        expected = to_numpy(layer(query, value, attention_mask=allowed,
                                  value_mask=tokens))
        weights = np.where(allowed, rng.uniform(0.5, 2.0, allowed.shape), 0)
        got = layer(query, value, attention_mask=weights.astype("float32"),
                    value_mask=tokens.astype("float32"))
        np.testing.assert_allclose(to_numpy(got), expected, atol=1e-6)

    def test_attention_mask_that_does_not_broadcast(self, rng):
        query, value = random_inputs(rng)
        layer = make_layer(query, value, num_heads=2, key_dim=4)
        with pytest.raises(ValueError, match="attention_mask"):
            layer(query, value, attention_mask=np.ones((2, 4, 5), bool))
