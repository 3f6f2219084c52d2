"""`keras_mha.RotaryEmbedding` against a float64 complex-number reference,
keras-hub's layer, and its own properties.

Every case uses inputs of shape `(B, L, N, H) = (2, 5, 2, 8)`: JAX compiles
once per shape.
"""

import re

import keras
import numpy as np
import pytest
from conftest import BACKEND
from keras import ops
from util import to_numpy

from keras_mha import RotaryEmbedding
from keras_mha.rotary import rotary_dim_of

SHAPE = (2, 5, 2, 8)  # (B, L, N, H)
POSITIONS = np.array([4, 0, 9, 9, 2])  # (L,): repeats and gaps
BATCH_POSITIONS = np.array([[0, 1, 2, 3, 4], [11, 3, 7, 5, 0]])  # (B, L)


def reference_rotary(x, positions, max_wavelength=10000, scaling_factor=1.0,
                     rotary_dim=None):
    """Pairs `(x_i, x_{i+d/2})` as `x_i + i x_{i+d/2}`, times `e^{i angle}`.

    `positions`: `(L,)` or `(B, L)`.
    """
    x = np.asarray(x, "float64")
    d = rotary_dim or x.shape[-1]
    inv_freq = max_wavelength ** (-2.0 * np.arange(d // 2) / d)
    angle = (np.asarray(positions, "float64") / scaling_factor)[..., None]
    angle = (angle * inv_freq)[..., None, :]  # (..., L, 1, d/2)
    z = (x[..., : d // 2] + 1j * x[..., d // 2 : d]) * np.exp(1j * angle)
    return np.concatenate([z.real, z.imag, x[..., d:]], axis=-1)


def _x(rng, dtype="float32"):
    return rng.normal(size=SHAPE).astype(dtype)


def _int_tensor(value):
    return ops.convert_to_tensor(np.asarray(value), dtype="int32")


class TestAgainstReference:
    # (layer arguments, start_index, positions): positions override.
    CASES = {
        "full": (dict(), 0, None),
        "partial": (dict(rotary_dim=4), 0, None),
        "partial_scaled": (dict(rotary_dim=6, scaling_factor=2.5), 2, None),
        "scaled": (dict(scaling_factor=4.0, max_wavelength=500), 0, None),
        "start_int": (dict(), 3, None),
        "start_tensor": (dict(), "tensor", None),
        "positions_L": (dict(), 0, POSITIONS),
        "positions_BL": (dict(rotary_dim=4), 0, BATCH_POSITIONS),
        "positions_override_start": (dict(), 6, BATCH_POSITIONS),
    }

    @pytest.mark.parametrize("name", list(CASES))
    def test_matches_reference(self, rng, name):
        kwargs, start, positions = self.CASES[name]
        x = _x(rng)
        call = {}
        if start == "tensor":
            start = 3
            call["start_index"] = _int_tensor(start)
        elif start:
            call["start_index"] = start
        if positions is not None:
            call["positions"] = _int_tensor(positions)
        want_positions = (
            np.arange(SHAPE[1]) + start if positions is None else positions
        )
        got = to_numpy(RotaryEmbedding(**kwargs)(x, **call))
        want = reference_rotary(x, want_positions, **kwargs)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    def test_partial_passes_the_rest_unchanged(self, rng):
        x = _x(rng)
        got = to_numpy(RotaryEmbedding(rotary_dim=4)(x, start_index=5))
        np.testing.assert_array_equal(got[..., 4:], x[..., 4:])

    def test_position_zero_is_identity(self, rng):
        x = _x(rng)
        got = to_numpy(RotaryEmbedding()(x, positions=_int_tensor([0] * 5)))
        np.testing.assert_array_equal(got, x)


class TestProperties:
    @staticmethod
    def _scores(q, k):
        return np.einsum("btnh,bsnh->bnts", to_numpy(q), to_numpy(k))

    @pytest.mark.parametrize("rotary_dim", [None, 4], ids=["full", "partial"])
    def test_scores_depend_on_relative_position_only(self, rng, rotary_dim):
        layer = RotaryEmbedding(rotary_dim=rotary_dim)
        q, k = _x(rng), _x(rng)
        p, j = BATCH_POSITIONS, BATCH_POSITIONS[:, ::-1]
        base = self._scores(layer(q, positions=_int_tensor(p)),
                            layer(k, positions=_int_tensor(j)))
        shifted = self._scores(layer(q, positions=_int_tensor(p + 7)),
                               layer(k, positions=_int_tensor(j + 7)))
        np.testing.assert_allclose(shifted, base, atol=1e-4, rtol=1e-4)

    def test_norm_of_each_pair_is_kept(self, rng):
        x = _x(rng)
        got = to_numpy(RotaryEmbedding()(x, start_index=100))
        norm = lambda y: np.hypot(y[..., :4], y[..., 4:])  # noqa: E731
        np.testing.assert_allclose(norm(got), norm(x), rtol=1e-5)


class TestAgainstKerasHub:
    @pytest.mark.parametrize("call", ["start_index", "positions"])
    def test_same_outputs(self, rng, call):
        keras_hub = pytest.importorskip("keras_hub")
        kwargs = dict(max_wavelength=500, scaling_factor=2.0)
        theirs = keras_hub.layers.RotaryEmbedding(**kwargs)
        ours = RotaryEmbedding(**kwargs)
        x = _x(rng)
        arguments = (
            dict(start_index=3) if call == "start_index"
            else dict(positions=_int_tensor(BATCH_POSITIONS))
        )
        np.testing.assert_allclose(
            to_numpy(ours(x, **arguments)),
            to_numpy(theirs(x, **arguments)),
            atol=1e-5, rtol=1e-5,
        )


class TestDtypes:
    @pytest.mark.parametrize("dtype,tolerance",
                             [("float16", 2e-3), ("bfloat16", 2e-2)])
    def test_half_precision_in_half_precision_out(self, rng, dtype,
                                                  tolerance):
        x = 30 * _x(rng)
        layer = RotaryEmbedding()
        half = layer(ops.cast(x, dtype), start_index=1000)
        assert keras.backend.standardize_dtype(half.dtype) == dtype
        half = to_numpy(ops.cast(half, "float32"))
        assert np.isfinite(half).all()
        full = to_numpy(layer(x, start_index=1000))
        np.testing.assert_allclose(half, full, atol=30 * tolerance,
                                   rtol=tolerance)

    def test_dtype_policy_does_not_cast_the_input(self, rng):
        x = _x(rng)
        got = RotaryEmbedding(dtype="mixed_float16")(x)
        assert keras.backend.standardize_dtype(got.dtype) == "float32"


class TestConfigAndSaving:
    def test_registered_name(self):
        name = keras.saving.get_registered_name(RotaryEmbedding)
        assert name == "keras_mha>RotaryEmbedding"

    def test_config_round_trip(self):
        layer = RotaryEmbedding(max_wavelength=500, scaling_factor=2.5,
                                rotary_dim=4, name="rope")
        config = layer.get_config()
        clone = RotaryEmbedding.from_config(config)
        assert clone.get_config() == config
        assert (clone.max_wavelength, clone.scaling_factor,
                clone.rotary_dim) == (500, 2.5, 4)
        assert layer.weights == []

    def test_serialize_deserialize(self, rng):
        layer = RotaryEmbedding(max_wavelength=500, rotary_dim=6)
        serialized = keras.saving.serialize_keras_object(layer)
        clone = keras.saving.deserialize_keras_object(serialized)
        assert isinstance(clone, RotaryEmbedding)
        assert clone.get_config() == layer.get_config()
        x = _x(rng)
        np.testing.assert_array_equal(to_numpy(clone(x, start_index=2)),
                                      to_numpy(layer(x, start_index=2)))

    def test_functional_model(self, rng):
        inputs = keras.Input(SHAPE[1:])
        outputs = RotaryEmbedding(rotary_dim=4)(inputs, start_index=2)
        assert tuple(outputs.shape) == (None, *SHAPE[1:])
        x = _x(rng)
        got = to_numpy(keras.Model(inputs, outputs).predict(x, verbose=0))
        want = reference_rotary(x, np.arange(5) + 2, rotary_dim=4)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    BACKEND not in ("jax", "tensorflow"), reason="traces on jax and tf"
)
class TestCompiled:
    def test_traced_start_index(self, rng):
        layer = RotaryEmbedding(rotary_dim=6)

        def fn(x, start):
            return layer(x, start_index=start)

        if BACKEND == "jax":
            import jax

            compiled = jax.jit(fn)
        else:
            import tensorflow as tf

            compiled = tf.function(fn, jit_compile=True, input_signature=[
                tf.TensorSpec((None, *SHAPE[1:]), "float32"),
                tf.TensorSpec((), "int32"),
            ])
        x = _x(rng)
        for start in (0, 7):  # one trace, two cache indices
            got = to_numpy(compiled(x, _int_tensor(start)))
            want = reference_rotary(x, np.arange(5) + start, rotary_dim=6)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def received(name, shown):
    """Regex: the message names `name` and reports `name=shown` after
    `Received:`."""
    return rf"`{re.escape(name)}`.*Received: (.*\W)?{re.escape(name)}=" + (
        re.escape(shown)
    )


class TestErrors:
    BAD = [
        *(("max_wavelength", v) for v in (0, -1, True, "1e4", None,
                                          float("inf"))),
        *(("scaling_factor", v) for v in (0.0, -2.0, False, "2", None)),
        *(("rotary_dim", v) for v in (3, 0, -2, 4.0, True, "4")),
    ]

    @pytest.mark.parametrize(
        "name,value",
        [pytest.param(n, v, id=f"{n}={v!r}") for n, v in BAD],
    )
    def test_bad_constructor_argument(self, name, value):
        with pytest.raises(ValueError, match=received(name, repr(value))):
            RotaryEmbedding(**{name: value})

    def test_rotary_dim_wider_than_the_features(self, rng):
        with pytest.raises(
            ValueError,
            match=re.escape(
                "Received: rotary_dim=10, inputs.shape=(2, 5, 2, 8)"
            ),
        ):
            RotaryEmbedding(rotary_dim=10)(_x(rng))

    def test_odd_feature_size(self):
        with pytest.raises(
            ValueError,
            match=r"feature size .* even.*Received: inputs\.shape=\(2, 5, 7\)",
        ):
            RotaryEmbedding()(np.zeros((2, 5, 7), "float32"))

    def test_odd_feature_size_with_even_rotary_dim_is_fine(self):
        assert rotary_dim_of((2, 5, 2, 7), 4) == 4

    def test_positions_of_rank_three(self, rng):
        with pytest.raises(
            ValueError, match=r"`positions`.*Received: positions\.shape="
        ):
            RotaryEmbedding()(_x(rng), positions=_int_tensor([[[0] * 5]]))
