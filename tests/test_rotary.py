"""`keras_mha.RotaryEmbedding` against a float64 complex-number reference,
keras-hub's layer, and its own properties.

Every case uses inputs of shape `(B, L, N, H) = (2, 5, 2, 8)`: JAX compiles
once per shape.
"""

import json
import re
import types

import keras
import numpy as np
import pytest
from conftest import BACKEND
from keras import ops
from util import compiled
from util import make_layer
from util import to_numpy

from keras_mha import RotaryEmbedding
from keras_mha.rope_scaling import RopeScaling
from keras_mha.rotary import rotary_dim_of

SHAPE = (2, 5, 2, 8)  # (B, L, N, H)
POSITIONS = np.array([4, 0, 9, 9, 2])  # (L,): repeats and gaps
BATCH_POSITIONS = np.array([[0, 1, 2, 3, 4], [11, 3, 7, 5, 0]])  # (B, L)


def reference_rotary(x, positions, max_wavelength=10000, scaling_factor=1.0,
                     rotary_dim=None, inv_freq=None, attention_factor=1.0,
                     interleaved=False):
    """Pairs `(x_i, x_{i+d/2})` (or `(x_{2i}, x_{2i+1})` interleaved) as
    `x_i + i x_{i+d/2}`, times `attention_factor · e^{i angle}`.

    `positions`: `(L,)` or `(B, L)`; `inv_freq`: `(d/2,)`, by default
    `max_wavelength ** (-2i/d) / scaling_factor`.
    """
    x = np.asarray(x, "float64")
    d = rotary_dim or x.shape[-1]
    if inv_freq is None:
        inv_freq = max_wavelength ** (-2.0 * np.arange(d // 2) / d)
        inv_freq = inv_freq / scaling_factor
    angle = np.asarray(positions, "float64")[..., None] * inv_freq
    angle = angle[..., None, :]  # (..., L, 1, d/2)
    if interleaved:
        first, second = x[..., 0:d:2], x[..., 1:d:2]
    else:
        first, second = x[..., : d // 2], x[..., d // 2 : d]
    z = (first + 1j * second) * np.exp(1j * angle) * attention_factor
    if interleaved:
        rotated = np.stack([z.real, z.imag], axis=-1).reshape(
            z.shape[:-1] + (d,)
        )
    else:
        rotated = np.concatenate([z.real, z.imag], axis=-1)
    return np.concatenate([rotated, x[..., d:]], axis=-1)


def _x(rng, dtype="float32"):
    return rng.normal(size=SHAPE).astype(dtype)


def _int_tensor(value):
    return ops.convert_to_tensor(np.asarray(value), dtype="int32")


# Rope types: transformers is the oracle of every frequency.

def hugging_face_tables(params, d, max_position_embeddings, largest):
    """`(inv_freq (d/2,), attention_factor)` of transformers'
    `ROPE_INIT_FUNCTIONS[rope_type]` for a call whose largest position is
    `largest` (its models pass `seq_len = max(position_ids) + 1`)."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(params)
    if params["rope_type"] == "default":
        return params["rope_theta"] ** (-np.arange(0, d, 2) / d), 1.0
    config = types.SimpleNamespace(
        rope_parameters=params, head_dim=d, hidden_size=4 * d,
        num_attention_heads=4,
        max_position_embeddings=max_position_embeddings,
        standardize_rope_params=lambda: None,
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](
        config, None, seq_len=torch.tensor(largest + 1)
    )
    return inv_freq.numpy().astype("float64"), factor


_SHORT = [1.0, 1.25, 1.5, 2.0]
_LONG = [2.0, 3.0, 5.0, 9.0]
# name -> (layer arguments, Hugging Face's rope parameters, its
# max_position_embeddings). At `H = 8` every type differs from the default
# at the positions used here (up to 15): Llama 3.1's and gpt-oss's
# published parameters put the 8 features in all of their regimes, and the
# length-dependent types switch at 8 positions.
ROPE_CASES = {
    "default": (dict(rope_type="default", max_wavelength=500),
                dict(rope_type="default", rope_theta=500.0), 64),
    "linear": (dict(scaling_factor=2.5, max_wavelength=500),
               dict(rope_type="linear", rope_theta=500.0, factor=2.5), 64),
    "llama3": (
        dict(rope_type="llama3", max_wavelength=500000, scaling_factor=8.0,
             low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=8192),
        dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
             low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=8192),
        131072,
    ),
    # Llama 4 Scout: equal factors, no smoothed band.
    "llama3_equal_factors": (
        dict(rope_type="llama3", max_wavelength=500000, scaling_factor=16.0,
             low_freq_factor=1.0, high_freq_factor=1.0,
             original_max_position_embeddings=8192),
        dict(rope_type="llama3", rope_theta=500000.0, factor=16.0,
             low_freq_factor=1.0, high_freq_factor=1.0,
             original_max_position_embeddings=8192),
        10485760,
    ),
    "yarn_gpt_oss": (
        dict(rope_type="yarn", max_wavelength=150000, scaling_factor=32.0,
             truncate=False, original_max_position_embeddings=4096),
        dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
             beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=4096),
        131072,
    ),
    "yarn_truncated_attention_factor": (
        dict(rope_type="yarn", max_wavelength=1e6, scaling_factor=4.0,
             original_max_position_embeddings=32768, attention_factor=0.75,
             beta_fast=16, beta_slow=2),
        dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
             original_max_position_embeddings=32768, attention_factor=0.75,
             beta_fast=16, beta_slow=2),
        131072,
    ),
    "dynamic": (
        dict(rope_type="dynamic", max_wavelength=500, scaling_factor=3.0,
             original_max_position_embeddings=8),
        dict(rope_type="dynamic", rope_theta=500.0, factor=3.0),
        8,
    ),
    "longrope": (
        dict(rope_type="longrope", max_wavelength=500, scaling_factor=16.0,
             original_max_position_embeddings=8, short_factor=_SHORT,
             long_factor=_LONG),
        dict(rope_type="longrope", rope_theta=500.0, factor=16.0,
             original_max_position_embeddings=8, short_factor=_SHORT,
             long_factor=_LONG),
        128,
    ),
}


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
    # Arguments that mean the same in both layers: linear, and gpt-oss's
    # YaRN as keras-hub's GptOss model builds it.
    SHARED = {
        "linear": dict(max_wavelength=500, scaling_factor=2.0),
        "yarn": dict(max_wavelength=150000, scaling_factor=32.0,
                     rope_type="yarn", truncate=False,
                     original_max_position_embeddings=4096),
    }

    @pytest.mark.parametrize("rope", list(SHARED))
    @pytest.mark.parametrize("call", ["start_index", "positions"])
    def test_same_outputs(self, rng, call, rope):
        keras_hub = pytest.importorskip("keras_hub")
        kwargs = self.SHARED[rope]
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


    def test_llama3_as_keras_hub_llama(self, rng):
        """keras-hub's Llama 3.1 rotary names the same numbers otherwise."""
        pytest.importorskip("keras_hub")
        from keras_hub.src.models.llama.llama_rotary_embedding import (
            LlamaRotaryEmbedding,
        )

        theirs = LlamaRotaryEmbedding(
            max_wavelength=500000, frequency_adjustment_factor=8.0,
            low_freq_factor=1.0, high_freq_factor=4.0,
            pretraining_sequence_length=8192,
        )
        ours = RotaryEmbedding(**ROPE_CASES["llama3"][0])
        x = _x(rng)
        np.testing.assert_allclose(
            to_numpy(ours(x, start_index=3)),
            to_numpy(theirs(x, start_index=3)), atol=1e-5, rtol=1e-5,
        )


class TestDtypes:
    @pytest.mark.parametrize("rope", ["linear", "yarn_gpt_oss", "dynamic",
                                      "longrope"])
    @pytest.mark.parametrize("dtype,tolerance",
                             [("float16", 2e-3), ("bfloat16", 2e-2)])
    def test_half_precision_in_half_precision_out(self, rng, dtype,
                                                  tolerance, rope):
        x = 30 * _x(rng)
        layer = RotaryEmbedding(**ROPE_CASES[rope][0])
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

    @pytest.mark.parametrize("rope", list(ROPE_CASES))
    def test_rope_types_round_trip_through_json(self, rng, rope):
        layer = RotaryEmbedding(interleaved=True, **ROPE_CASES[rope][0])
        config = layer.get_config()
        clone = RotaryEmbedding.from_config(json.loads(json.dumps(config)))
        assert clone.get_config() == config
        x = _x(rng)
        np.testing.assert_array_equal(to_numpy(clone(x, start_index=6)),
                                      to_numpy(layer(x, start_index=6)))

    def test_config_of_an_earlier_version(self, rng):
        """A config without the rope-type arguments: linear, rotate-half."""
        config = {"name": "rope", "trainable": True, "dtype": "float32",
                  "max_wavelength": 500, "scaling_factor": 2.5,
                  "rotary_dim": 6, "autocast": False}
        layer = RotaryEmbedding.from_config(config)
        assert (layer.rope_type, layer.interleaved) == ("linear", False)
        x = _x(rng)
        np.testing.assert_allclose(
            to_numpy(layer(x, start_index=2)),
            reference_rotary(x, np.arange(5) + 2, 500, 2.5, 6),
            atol=1e-5, rtol=1e-5,
        )

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
        *(("rope_type", v) for v in ("ntk", "Linear", None, 3)),
        *(("beta_fast", v) for v in (0, -1.0, "32", None)),
        *(("beta_slow", v) for v in (0.0, True)),
        *(("original_max_position_embeddings", v)
          for v in (0, -8, 4096.0, True, None)),
        *(("truncate", v) for v in ("yes", 1, None)),
        *(("interleaved", v) for v in ("no", 0, None)),
    ]
    # (arguments, the argument named, its value as shown): arguments that
    # are each fine alone.
    BAD_TOGETHER = {
        "default_scaled": (dict(rope_type="default", scaling_factor=2.0),
                           "scaling_factor", "2.0"),
        "llama3_without_low": (dict(rope_type="llama3",
                                    high_freq_factor=4.0),
                               "low_freq_factor", "None"),
        "llama3_without_high": (dict(rope_type="llama3",
                                     low_freq_factor=1.0),
                                "high_freq_factor", "None"),
        "llama3_high_below_low": (
            dict(rope_type="llama3", low_freq_factor=4.0,
                 high_freq_factor=2.0), "high_freq_factor", "2.0"),
        "llama3_negative_low": (
            dict(rope_type="llama3", low_freq_factor=-1.0,
                 high_freq_factor=4.0), "low_freq_factor", "-1.0"),
        "low_freq_factor_with_yarn": (dict(rope_type="yarn",
                                           low_freq_factor=1.0),
                                      "low_freq_factor", "1.0"),
        "attention_factor_with_linear": (dict(attention_factor=1.2),
                                         "attention_factor", "1.2"),
        "attention_factor_zero": (dict(rope_type="yarn", attention_factor=0),
                                  "attention_factor", "0"),
        "short_factor_with_dynamic": (dict(rope_type="dynamic",
                                           short_factor=[1.0]),
                                      "short_factor", "[1.0]"),
        "longrope_without_long": (dict(rope_type="longrope",
                                       short_factor=[1.0] * 4),
                                  "long_factor", "None"),
        "longrope_negative_factor": (
            dict(rope_type="longrope", short_factor=[1.0, -1.0, 1.0, 1.0],
                 long_factor=[2.0] * 4),
            "short_factor", "[1.0, -1.0, 1.0, 1.0]"),
        "longrope_empty": (dict(rope_type="longrope", short_factor=[],
                                long_factor=[]), "short_factor", "[]"),
        "longrope_not_a_list": (dict(rope_type="longrope", short_factor=2.0,
                                     long_factor=[2.0] * 4),
                                "short_factor", "2.0"),
        "longrope_lengths_differ": (
            dict(rope_type="longrope", short_factor=[1.0] * 4,
                 long_factor=[2.0] * 3), "long_factor", ""),
        "longrope_not_half_the_rotary_dim": (
            dict(rope_type="longrope", short_factor=[1.0] * 3,
                 long_factor=[2.0] * 3, rotary_dim=8), "short_factor", ""),
        "dynamic_two_features": (dict(rope_type="dynamic", rotary_dim=2),
                                 "rotary_dim", "2"),
    }

    @pytest.mark.parametrize(
        "name,value",
        [pytest.param(n, v, id=f"{n}={v!r}") for n, v in BAD],
    )
    def test_bad_constructor_argument(self, name, value):
        with pytest.raises(ValueError, match=received(name, repr(value))):
            RotaryEmbedding(**{name: value})

    @pytest.mark.parametrize("case", list(BAD_TOGETHER))
    def test_bad_combination(self, case):
        kwargs, name, shown = self.BAD_TOGETHER[case]
        with pytest.raises(ValueError, match=received(name, shown)):
            RotaryEmbedding(**kwargs)

    def test_longrope_factors_not_half_the_features_at_call(self, rng):
        """With `rotary_dim=None`, `H` is known at the first call: checked
        then, before any backend op (a symbolic call too)."""
        layer = RotaryEmbedding(rope_type="longrope", short_factor=[1.0] * 3,
                                long_factor=[2.0] * 3)
        match = r"`short_factor`.*Received: short_factor=.*, rotary_dim=8"
        with pytest.raises(ValueError, match=match):
            layer(_x(rng))
        with pytest.raises(ValueError, match=match):
            layer(keras.Input(SHAPE[1:]))

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


class TestRopeTypesAgainstHuggingFace:
    """The layer's rotation = the float64 rotation with transformers'
    frequencies and cos/sin factor for the call's largest position."""

    # start_index -> the largest position of a call of L = 5 rows: 3 is
    # the last call below the switch at 8, 4 the first at or beyond it.
    @pytest.mark.parametrize("start", [0, 3, 4, 11])
    @pytest.mark.parametrize("name", list(ROPE_CASES))
    def test_start_index(self, rng, name, start):
        kwargs, params, max_length = ROPE_CASES[name]
        x = _x(rng)
        positions = np.arange(SHAPE[1]) + start
        inv_freq, factor = hugging_face_tables(
            params, SHAPE[-1], max_length, positions.max()
        )
        got = to_numpy(RotaryEmbedding(**kwargs)(x, start_index=start))
        want = reference_rotary(x, positions, inv_freq=inv_freq,
                                attention_factor=factor)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("name", ["llama3", "yarn_gpt_oss", "dynamic",
                                      "longrope"])
    @pytest.mark.parametrize("interleaved", [False, True],
                             ids=["half", "interleaved"])
    def test_positions(self, rng, name, interleaved):
        """`(B, L)` positions: the largest of the whole tensor counts."""
        kwargs, params, max_length = ROPE_CASES[name]
        x = _x(rng)
        inv_freq, factor = hugging_face_tables(
            params, SHAPE[-1], max_length, BATCH_POSITIONS.max()
        )
        layer = RotaryEmbedding(interleaved=interleaved, **kwargs)
        got = to_numpy(layer(x, positions=_int_tensor(BATCH_POSITIONS)))
        want = reference_rotary(x, BATCH_POSITIONS, inv_freq=inv_freq,
                                attention_factor=factor,
                                interleaved=interleaved)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    def test_partial_rotary(self, rng):
        """`rotary_dim=6`: the tables of 6 features, the rest unchanged."""
        kwargs, params, max_length = ROPE_CASES["yarn_gpt_oss"]
        x = _x(rng)
        inv_freq, factor = hugging_face_tables(params, 6, max_length, 6)
        got = to_numpy(RotaryEmbedding(rotary_dim=6, **kwargs)(
            x, start_index=2))
        want = reference_rotary(x, np.arange(5) + 2, rotary_dim=6,
                                inv_freq=inv_freq, attention_factor=factor)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    # Published configurations at their real head sizes: the float64
    # frequencies against transformers' float32 ones.
    PUBLISHED = {
        "llama3_8b": (ROPE_CASES["llama3"], 128, None),
        "gpt_oss": (ROPE_CASES["yarn_gpt_oss"], 64, None),
        "qwen2.5_yarn": ((
            dict(rope_type="yarn", max_wavelength=1e6, scaling_factor=4.0,
                 original_max_position_embeddings=32768),
            dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                 original_max_position_embeddings=32768),
            131072), 128, None),
        **{f"dynamic_{p}": ((
            dict(rope_type="dynamic", scaling_factor=2.0,
                 original_max_position_embeddings=2048),
            dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
            2048), 64, p) for p in (100, 2047, 2048, 9000)},
        **{f"longrope_{p}": ((
            dict(rope_type="longrope", scaling_factor=32.0,
                 original_max_position_embeddings=4096,
                 short_factor=list(np.linspace(1, 1.2, 48)),
                 long_factor=list(np.linspace(1, 40, 48))),
            dict(rope_type="longrope", rope_theta=10000.0, factor=32.0,
                 original_max_position_embeddings=4096,
                 short_factor=list(np.linspace(1, 1.2, 48)),
                 long_factor=list(np.linspace(1, 40, 48))),
            131072), 96, p) for p in (4095, 4096)},
    }

    @pytest.mark.parametrize("name", list(PUBLISHED))
    def test_published_frequencies(self, name):
        (kwargs, params, max_length), d, largest = self.PUBLISHED[name]
        rope = RopeScaling(**kwargs)
        want, factor = hugging_face_tables(params, d, max_length,
                                           largest or 0)
        tables = rope.tables(d)
        got = np.asarray(tables.frequencies)
        if rope.rope_type == "longrope":
            got = got[int(largest >= rope.original_max_position_embeddings)]
        if rope.rope_type == "dynamic":
            s = max(1.0, 2.0 * (largest + 1) / 2048 - 1.0)
            got = got * s ** np.asarray(tables.exponents)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert rope.cos_sin_factor == pytest.approx(factor, rel=1e-12)


class TestLengthDependent:
    @pytest.mark.parametrize("name", ["dynamic", "longrope"])
    def test_no_hidden_state(self, rng, name):
        """A call's result depends on its positions only, not on the calls
        before it (transformers' dynamic rotary keeps the largest length
        seen until a call falls below the original length)."""
        kwargs, _, _ = ROPE_CASES[name]
        x = _x(rng)
        fresh = to_numpy(RotaryEmbedding(**kwargs)(x, start_index=5))
        layer = RotaryEmbedding(**kwargs)
        layer(x, start_index=20)
        np.testing.assert_array_equal(
            to_numpy(layer(x, start_index=5)), fresh
        )

    @pytest.mark.parametrize("name", ["dynamic", "longrope"])
    def test_traced_start_index_crosses_the_switch(self, rng, name):
        """One trace serves both sides: the switch is arithmetic."""
        kwargs, params, max_length = ROPE_CASES[name]
        layer = RotaryEmbedding(**kwargs)
        traces = []

        def fn(x, start):
            if BACKEND != "torch":  # Dynamo guards on the list: counters
                traces.append(1)
            return layer(x, start_index=start)

        x = _x(rng)
        if BACKEND == "torch":
            from torch._dynamo.utils import counters

            layer(x)  # eager first, as Keras builds a model before it fits
            counters.clear()
        compiled = _compile(fn)
        for start in (0, 3, 4, 11):
            positions = np.arange(SHAPE[1]) + start
            inv_freq, factor = hugging_face_tables(
                params, SHAPE[-1], max_length, positions.max()
            )
            got = to_numpy(compiled(ops.convert_to_tensor(x),
                                    _int_tensor(start)))
            want = reference_rotary(x, positions, inv_freq=inv_freq,
                                    attention_factor=factor)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        if BACKEND in ("jax", "tensorflow"):
            assert len(traces) == 1
        if BACKEND == "torch":
            assert counters["stats"]["unique_graphs"] == 1


class TestInLayer:
    def test_compiled_attention(self, rng):
        """`MultiHeadAttention` with LongRoPE beyond its switch, interleaved,
        grouped heads, compiled (`jax.jit`, XLA; the rotary layer alone
        under `torch.compile` above): the eager result."""
        x = rng.normal(size=(2, 12, 8)).astype("float32")
        rotary = RotaryEmbedding(interleaved=True, **ROPE_CASES["longrope"][0])
        layer = make_layer(x, x, num_heads=2, key_dim=8,
                           num_key_value_heads=1, rotary_embedding=rotary)
        eager = to_numpy(layer(x, x, use_causal_mask=True))
        run = compiled(lambda q: layer(q, q, use_causal_mask=True))
        got = to_numpy(run(ops.convert_to_tensor(x)))
        np.testing.assert_allclose(got, eager, atol=1e-5, rtol=1e-5)


class TestInterleaved:
    @pytest.mark.parametrize("rotary_dim", [None, 6], ids=["full", "partial"])
    def test_matches_reference(self, rng, rotary_dim):
        x = _x(rng)
        layer = RotaryEmbedding(max_wavelength=100, rotary_dim=rotary_dim,
                                interleaved=True)
        got = to_numpy(layer(x, positions=_int_tensor(BATCH_POSITIONS)))
        want = reference_rotary(x, BATCH_POSITIONS, max_wavelength=100,
                                rotary_dim=rotary_dim, interleaved=True)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    def test_is_the_half_layout_of_permuted_features(self, rng):
        """Interleaved = rotate-half after moving features `2i` to `i` and
        `2i + 1` to `i + d/2`."""
        x = _x(rng)
        order = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
        half = RotaryEmbedding(max_wavelength=100)(x[..., order],
                                                   start_index=3)
        pairs = RotaryEmbedding(max_wavelength=100, interleaved=True)(
            x, start_index=3)
        np.testing.assert_allclose(to_numpy(pairs)[..., order],
                                   to_numpy(half), atol=1e-6)

    @pytest.mark.training
    @pytest.mark.parametrize("interleaved", [False, True],
                             ids=["half", "interleaved"])
    def test_gradient_is_the_inverse_rotation(self, rng, interleaved):
        """`d <rope(x), c> / dx = factor · rope_{-angle}(c)` (torch runs
        its in-place kernels here, whose backward autograd derives)."""
        kwargs, params, max_length = ROPE_CASES["yarn_gpt_oss"]
        layer = RotaryEmbedding(interleaved=interleaved, **kwargs)
        x, c = _x(rng), _x(rng)
        got = _input_gradient(lambda t: layer(t, start_index=3), x, c)
        inv_freq, factor = hugging_face_tables(params, 8, max_length, 7)
        want = reference_rotary(c, -(np.arange(5) + 3), inv_freq=inv_freq,
                                attention_factor=factor,
                                interleaved=interleaved)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _compile(fn):
    """`fn` under `jax.jit`, `tf.function(jit_compile=True)` or
    `torch.compile` (without Inductor's code generation, which takes a
    minute here: Dynamo's graph capture is what a layer must survive);
    eager on NumPy."""
    if BACKEND == "torch":
        import torch

        return torch.compile(fn, backend="aot_eager", fullgraph=True)
    return compiled(fn)


def _input_gradient(fn, x, cotangent):
    """`d sum(fn(x) · cotangent) / dx` as NumPy."""
    if BACKEND == "jax":
        import jax

        return to_numpy(jax.grad(lambda t: (fn(t) * cotangent).sum())(x))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        t = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(fn(t) * cotangent)
        return to_numpy(tape.gradient(loss, t))
    import torch

    t = torch.tensor(x, requires_grad=True)
    (fn(t) * torch.as_tensor(cotangent)).sum().backward()
    return t.grad.numpy()
