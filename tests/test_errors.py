"""A catalogue of bad inputs and the error each one gets.

Every bad argument raises a `ValueError` or `TypeError` that names the
argument and what was received (Keras style: `... Received: name=value`),
before any backend op runs: in eager calls, and while a Functional model is
built from `keras.Input`s.

Not repeated here: `test_behaviour.py::TestValidation`,
`test_layer.py::TestCausalAlongAxis`, `test_decoding.py::TestCacheErrors`.
"""

import re
from typing import NamedTuple

import keras
import numpy as np
import pytest
from util import assert_close
from util import make_layer
from util import reference
from util import to_numpy

import keras_mha

MHA = keras_mha.MultiHeadAttention
GQA = keras_mha.GroupedQueryAttention

def received(name, shown):
    """Regex: the message reports `name=shown` after `Received:`."""
    return rf"Received: (.*\W)?{re.escape(name)}={re.escape(shown)}"


# ------------------------------------------------------------ constructors


_BASE = {MHA: dict(num_heads=2, key_dim=4),
         GQA: dict(head_dim=4, num_query_heads=4, num_key_value_heads=2)}


def bad_argument(cls, name, value, error=ValueError, match=None,
                 **others):
    """`cls(**base, **others, name=value)` raises `error` naming `name`."""
    kwargs = {**_BASE[cls], **others, name: value}
    shown = ", ".join(f"{k}={v!r}" for k, v in {**others, name: value}.items())
    return pytest.param(
        cls, kwargs, error, match or received(name, repr(value)),
        id=f"{cls.__name__}({shown})",
    )


CONSTRUCTOR_CASES = [
    # Sizes: positive Python (or NumPy) integers, never bool, float, str.
    *(bad_argument(MHA, "num_heads", v) for v in (-1, True, 2.0, "2", None)),
    *(bad_argument(MHA, "key_dim", v) for v in (0, -3, 4.0, "4", None)),
    *(bad_argument(MHA, "value_dim", v) for v in (0, -1, True, 2.5, "4")),
    *(bad_argument(MHA, "num_key_value_heads", v)
      for v in (0, -2, True, 2.0, "2")),
    bad_argument(MHA, "num_key_value_heads", 8, num_heads=4),  # K > N
    bad_argument(MHA, "num_key_value_heads", 4, num_heads=6),
    # output_shape: a positive int or a tuple of them.
    bad_argument(MHA, "output_shape", 0),
    bad_argument(MHA, "output_shape", -1),
    *(bad_argument(MHA, "output_shape", v)
      for v in ((2, 0), 2.5, True, (2, "3"), {"a": 1}, (4.0,))),
    # dropout: a real number in [0, 1).
    *(bad_argument(MHA, "dropout", v)
      for v in (1.5, -1e-9, "0.1", None, True, float("nan"), float("inf"),
                [0.1])),
    # sliding_window: None or a positive int.
    *(bad_argument(MHA, "sliding_window", v) for v in (-1, 2.5, "3", [3])),
    # attention_axes: an int or a non-empty tuple of ints.
    *(bad_argument(MHA, "attention_axes", v)
      for v in ("1", 1.5, True, (), (1, "2"), [True], {1})),
    # flash_attention: None, True or False, nothing that merely equals them.
    *(bad_argument(MHA, "flash_attention", v) for v in ("yes", "auto")),
    *(bad_argument(MHA, "flash_attention", v)
      for v in (1, 0)),
    # Keras's own checks of the arguments it resolves.
    bad_argument(MHA, "kernel_initializer", "nope",
                 match=r"initializer.*nope"),
    bad_argument(MHA, "bogus", 1, match=r"bogus"),
    # GroupedQueryAttention, under its own argument names.
    *(bad_argument(GQA, "head_dim", v) for v in (0, "4", None)),
    *(bad_argument(GQA, "num_query_heads", v) for v in (0, 2.5)),
    *(bad_argument(GQA, "num_key_value_heads", v) for v in (0, None, True)),
    bad_argument(GQA, "num_key_value_heads", 4, num_query_heads=6,
                 match=received("num_query_heads", "6")),
    bad_argument(GQA, "dropout", 2),
    bad_argument(GQA, "sliding_window", "3"),
    bad_argument(GQA, "flash_attention", "yes"),
    # MultiHeadAttention's arguments, which GQA's config would drop.
    *(bad_argument(GQA, name, value)
      for name, value in (("value_dim", 3), ("output_shape", 3),
                          ("attention_axes", (1,)), ("num_heads", 4),
                          ("key_dim", 4))),
]


class TestConstructor:
    @pytest.mark.parametrize("cls, kwargs, error, match", CONSTRUCTOR_CASES)
    def test_bad_argument(self, cls, kwargs, error, match):
        with pytest.raises(error, match=match):
            cls(**kwargs)

    @pytest.mark.parametrize(
        "cls, kwargs, name",
        [(MHA, dict(key_dim=4), "num_heads"),
         (MHA, dict(num_heads=2), "key_dim"),
         (GQA, dict(head_dim=4, num_query_heads=4), "num_key_value_heads")],
        ids=["MHA-no-num_heads", "MHA-no-key_dim", "GQA-no-kv-heads"],
    )
    def test_missing_argument(self, cls, kwargs, name):
        with pytest.raises(TypeError, match=name):
            cls(**kwargs)

    def test_numpy_scalars_are_accepted(self):
        layer = MHA(num_heads=np.int64(4), key_dim=np.int32(8),
                    value_dim=np.int64(6), num_key_value_heads=np.int64(2),
                    sliding_window=np.int64(3), output_shape=np.int64(5),
                    dropout=np.float32(0.25))
        config = layer.get_config()
        for name, value in dict(num_heads=4, key_dim=8, value_dim=6,
                                num_key_value_heads=2, sliding_window=3,
                                output_shape=(5,)).items():
            assert config[name] == value
            assert type(config[name]) is type(value)  # JSON-friendly
        assert config["dropout"] == pytest.approx(0.25)


# ------------------------------------------------------------------- calls


class Spec(NamedTuple):
    """A tensor argument: eager as a NumPy array, symbolic as keras.Input."""

    shape: tuple
    dtype: str = "float32"


class CallCase(NamedTuple):
    id: str
    args: dict  # call arguments: `Spec`s or plain values
    error: type
    match: str
    layer: dict = {}  # constructor arguments beyond num_heads and key_dim
    built_for: tuple = None  # (query, value, key) shapes to build first
    eager: bool = True  # False: covered elsewhere
    symbolic: bool = True  # False: eager only


Q, V, K = (2, 5, 8), (2, 7, 8), (2, 7, 6)  # B=2, T=5, S=7; E_k != E_v
R4 = (2, 3, 4, 8)  # rank 4 for attention_axes
# init_cache(2, 8) of num_heads=2, key_dim=4: (keys, values, valid)
CACHE = (Spec((2, 8, 2, 4)), Spec((2, 8, 2, 4)), Spec((2, 8), "bool"))
X = (2, 3, 8)  # new tokens for the cache


def _qvk(query=Q, value=V, key=K, **args):
    return dict(query=Spec(query), value=Spec(value),
                **({} if key is None else {"key": Spec(key)}), **args)


def _mask(shape, dtype="bool"):
    return Spec(shape, dtype)


def _cache_args(cache=CACHE, index=0, causal=True, **args):
    return {"query": Spec(X), "value": Spec(X), "cache": cache,
            "cache_update_index": index, "use_causal_mask": causal, **args}


CALL_CASES = [
    # Ranks: (batch, sequence..., features), the same for all three.
    CallCase("query-rank-2", _qvk(query=(5, 8)), ValueError,
             received("query.shape", "(5, 8)")),
    CallCase("query-rank-1", _qvk(query=(8,)), ValueError,
             received("query.shape", "(8,)")),
    CallCase("value-rank-2", _qvk(value=(7, 8), key=None), ValueError,
             received("value.shape", "(7, 8)")),
    CallCase("key-rank-2", _qvk(key=(7, 6)), ValueError,
             received("key.shape", "(7, 6)")),
    CallCase("query-rank-4-value-rank-3", _qvk(query=R4), ValueError,
             received("query.shape", str(R4))),
    CallCase("query-features-undefined", _qvk(query=(2, 5, None)),
             ValueError, received("query.shape", "(2, 5, None)"),
             eager=False),
    # Lengths and batch sizes (feature sizes may differ: see TestAccepted).
    CallCase("key-value-lengths", _qvk(key=(2, 6, 6)), ValueError,
             received("key.shape", "(2, 6, 6)"), eager=False),
    CallCase("key-value-batch", _qvk(key=(3, 7, 6)), ValueError,
             received("key.shape", "(3, 7, 6)")),
    CallCase("query-value-batch", _qvk(value=(3, 7, 8), key=None),
             ValueError, received("value.shape", "(3, 7, 8)")),
    CallCase("query-key-batch", _qvk(value=(3, 7, 8), key=(3, 7, 6)),
             ValueError, received("query.shape", str(Q))),
    CallCase("value-length-0", _qvk(value=(2, 0, 8), key=None), ValueError,
             received("value.shape", "(2, 0, 8)")),
    # A built layer's weights fix the rank and the feature sizes.
    *(CallCase(f"built-{name}-features", _qvk(**{name: shape}), ValueError,
               received(f"{name}.shape", str(shape)), built_for=(Q, V, K))
      for name, shape in (("query", (2, 5, 6)), ("value", (2, 7, 5)),
                          ("key", (2, 7, 8)))),
    CallCase("built-rank", _qvk(query=R4, value=R4, key=R4[:-1] + (6,)),
             ValueError, received("query.shape", str(R4)),
             built_for=(Q, V, K)),
    # Padding masks: (B, T) for the query, (B, S) for value and key.
    *(CallCase(f"{name}-{'x'.join(map(str, shape))}",
               _qvk(**{name: _mask(shape)}), ValueError,
               received(f"{name}.shape", str(shape)))
      for name, shape in (("query_mask", (2, 7)), ("query_mask", (3, 5)),
                          ("query_mask", (5,)), ("query_mask", (2, 5, 1)),
                          ("value_mask", (2, 5)), ("value_mask", (3, 7)),
                          ("key_mask", (2, 5)), ("key_mask", (2, 7, 7)))),
    # attention_mask: (T, S), (B, T, S) or (B, N, T, S), broadcasting.
    *(CallCase(f"attention_mask-{'x'.join(map(str, shape))}",
               _qvk(attention_mask=_mask(shape)), ValueError,
               received("attention_mask.shape", str(shape)))
      for shape in ((3, 5, 7), (7, 5), (2, 3, 5, 7), (7,), (1, 1, 1, 5, 7))),
    # Several attention axes: the mask is (B, <other>, <T axes>, <S axes>).
    CallCase("multi-axis-attention_mask-rank",
             dict(query=Spec(R4), value=Spec(R4),
                  attention_mask=_mask((2, 3, 4, 3))),
             ValueError, received("attention_mask.shape", "(2, 3, 4, 3)"),
             layer=dict(attention_axes=(1, 2))),
    CallCase("multi-axis-attention_mask-sizes",
             dict(query=Spec(R4), value=Spec(R4),
                  attention_mask=_mask((2, 3, 4, 3, 5))),
             ValueError, received("attention_mask.shape", "(2, 3, 4, 3, 5)"),
             layer=dict(attention_axes=(1, 2))),
    CallCase("multi-axis-causal", dict(query=Spec(R4), value=Spec(R4),
                                       use_causal_mask=True),
             ValueError, received("attention_axes", "(1, 2)"),
             layer=dict(attention_axes=(1, 2)), eager=False),
    # attention_axes that are not axes of these inputs.
    *(CallCase(f"attention_axes={axes}", dict(query=Spec(shape),
                                              value=Spec(shape)),
               ValueError, received("attention_axes", str(axes)),
               layer=dict(attention_axes=axes))
      for axes, shape in (((0,), Q), ((-1,), Q), ((3,), R4), ((1, 1), R4),
                          ((1, -3), R4))),
    CallCase("scores-with-flash-required",
             _qvk(return_attention_scores=True), ValueError,
             received("flash_attention", "True"),
             layer=dict(flash_attention=True), eager=False),
    # Cache misuse beyond test_decoding.py::TestCacheErrors.
    CallCase("cache-rank-4-inputs",
             dict(query=Spec(R4), value=Spec(R4), cache=CACHE,
                  cache_update_index=0, use_causal_mask=True),
             ValueError, received("query.shape", str(R4)),
             layer=dict(attention_axes=(2,))),
    CallCase("cache-without-causal", _cache_args(causal=False), ValueError,
             received("use_causal_mask", "False"), eager=False),
    CallCase("cache-without-index", _cache_args(index=None), ValueError,
             received("cache_update_index", "None"), eager=False),
    CallCase("cache-shape",
             _cache_args(cache=(Spec((2, 8, 2, 8)),) + CACHE[1:]),
             ValueError, received("cache[0].shape", "(2, 8, 2, 8)"),
             eager=False),
    CallCase("cache-int32", _cache_args(cache=(Spec((2, 8, 2, 4), "int32"),)
                                        + CACHE[1:]),
             TypeError, received("cache[0].dtype", "int32")),
    CallCase("cache-valid-float", _cache_args(cache=CACHE[:2]
                                              + (Spec((2, 8)),)),
             TypeError, received("cache[2].dtype", "float32")),
    CallCase("cache-one-tensor", _cache_args(cache=Spec((2, 8, 2, 9))),
             TypeError, received("cache.shape", "(2, 8, 2, 9)")),
    CallCase("cache-list", _cache_args(cache=np.zeros((2, 8, 2, 9)).tolist()),
             TypeError, r"Received: cache of type list", symbolic=False),
    CallCase("cache-index-float", _cache_args(index=2.5), ValueError,
             received("cache_update_index", "2.5")),
    CallCase("cache-index-str", _cache_args(index="0"), ValueError,
             received("cache_update_index", "'0'")),
    CallCase("cache-value-length", _cache_args(value=Spec((2, 4, 8))),
             ValueError, received("value.shape", "(2, 4, 8)")),
    CallCase("cache-query_mask-shape", _cache_args(query_mask=_mask((2, 4))),
             ValueError, received("query_mask.shape", "(2, 4)")),
    # Arrays of the wrong kind, named before Keras converts them (which
    # would say `Invalid dtype: str32`); eager only, as an Input cannot be.
    *(CallCase(f"{name}-{kind}", _qvk(**{name: value}), TypeError,
               received(f"{name}.dtype", shown), symbolic=False)
      for name in ("attention_mask", "query_mask", "attention_bias")
      for kind, value, shown in (
          ("str-array", np.full((2, 5, 7), "a"), "<U1"),
          ("str-list", [["a"] * 7] * 5, "<U1"),
          ("object-array", np.full((2, 5, 7), None), "object"))),
    *(CallCase(f"{name}-{type(value).__name__}", {**_qvk(), name: value},
               TypeError, received(name, repr(value)) + " of type "
               + type(value).__name__, symbolic=False)
      for name, value in (("attention_mask", "causal"),
                          ("attention_mask", {"mask": 1}),
                          ("segment_ids", {"ids": 1}),
                          ("query", "hello"), ("value", {"a": 1}),
                          ("key", [1.0, 2.0]))),
    CallCase("query-str-array", {**_qvk(), "query": np.full(Q, "a")},
             TypeError, received("query.dtype", "<U1"), symbolic=False),
    CallCase("value-object-array", {**_qvk(), "value": np.full(V, None)},
             TypeError, received("value.dtype", "object"), symbolic=False),
    CallCase("attention_mask-ragged", _qvk(attention_mask=[[1, 0], [1]]),
             ValueError, r"`attention_mask` must be .* one shape",
             symbolic=False),
    CallCase("cache-index-str-array", _cache_args(index=np.array("1")),
             TypeError, received("cache_update_index.dtype", "<U1"),
             symbolic=False),
    CallCase("cache-str-array",
             _cache_args(cache=(np.full((2, 8, 2, 4), "a"),) + CACHE[1:]),
             TypeError, received("cache[0].dtype", "<U1"), symbolic=False),
]


def _params(mode):
    """The cases checked in `mode` ("eager" or "symbolic")."""
    return [pytest.param(case, id=case.id)
            for case in CALL_CASES if getattr(case, mode)]


def _layer(built_for=None, **kwargs):
    layer = MHA(num_heads=2, key_dim=4, kernel_initializer="zeros", **kwargs)
    if built_for is not None:
        layer.build(*built_for)
    return layer


def _eager(value):
    if isinstance(value, Spec):
        return np.ones(value.shape, value.dtype)
    if isinstance(value, tuple):  # a cache
        return tuple(_eager(part) for part in value)
    return value


def _symbolic(value):
    if isinstance(value, Spec):
        return keras.Input(batch_shape=value.shape, dtype=value.dtype)
    if isinstance(value, tuple):
        return tuple(_symbolic(part) for part in value)
    return value


class TestCall:
    @pytest.mark.parametrize("case", _params("eager"))
    def test_eager(self, case):
        layer = _layer(case.built_for, **case.layer)
        args = {name: _eager(value) for name, value in case.args.items()}
        with pytest.raises(case.error, match=case.match):
            layer(**args)

    @pytest.mark.parametrize("case", _params("symbolic"))
    def test_functional(self, case):
        """Building a Functional model fails, before anything runs."""
        layer = _layer(case.built_for, **case.layer)
        args = {name: _symbolic(value) for name, value in case.args.items()}
        with pytest.raises(case.error, match=case.match):
            layer(**args)

    @pytest.mark.parametrize("cls", [GQA, keras_mha.CachedMultiHeadAttention])
    def test_wrong_kind_on_every_layer(self, cls):
        """The layers built on `MultiHeadAttention` check kinds too, the
        inputs positional or not."""
        kwargs = _BASE.get(cls, _BASE[MHA])
        layer = cls(**kwargs)
        x = np.ones(Q, "float32")
        with pytest.raises(TypeError, match=received("attention_mask.dtype",
                                                     "<U1")):
            layer(x, x, attention_mask=np.full((2, 5, 5), "a"))
        with pytest.raises(TypeError, match=received("value", "'x'")):
            layer(x, "x")

    def test_cache_index_float_tensor(self):
        layer = _layer()
        x = np.ones(X, "float32")
        with pytest.raises(ValueError, match=r"cache_update_index"):
            layer(x, x, use_causal_mask=True, cache=layer.init_cache(2, 8),
                  cache_update_index=keras.ops.convert_to_tensor(1.0))


# ----------------------------------------------- what is not an error


class TestAccepted:
    """Inputs that look odd but are valid, pinned so checks stay precise."""

    def test_key_value_and_query_feature_sizes_may_differ(self, rng):
        # Keras semantics: only the lengths and batch of key and value agree.
        query = rng.normal(size=Q).astype("float32")
        value = rng.normal(size=(2, 7, 3)).astype("float32")
        key = rng.normal(size=K).astype("float32")
        layer = make_layer(query, value, key, num_heads=2, key_dim=4)
        expected, _ = reference(layer, query, value, key)
        assert_close(layer(query, value, key), expected)
        symbolic = MHA(num_heads=2, key_dim=4)(
            keras.Input((5, 8)), keras.Input((7, 3)), keras.Input((7, 6))
        )
        assert tuple(symbolic.shape) == (None, 5, 8)

    def test_integer_and_broadcast_padding_masks(self, rng):
        query = rng.normal(size=Q).astype("float32")
        value = rng.normal(size=V).astype("float32")
        layer = make_layer(query, value, num_heads=2, key_dim=4)
        value_mask = np.ones((1, 7), bool)
        value_mask[0, 5:] = False
        query_mask = np.ones((2, 5), bool)
        query_mask[1, 0] = False
        expected, _ = reference(
            layer, query, value, query_mask=query_mask,
            value_mask=np.broadcast_to(value_mask, (2, 7)),
        )
        output = layer(query, value, query_mask=query_mask.astype("int32"),
                       value_mask=value_mask.astype("int32"))
        assert_close(output, expected)

    def test_numpy_integer_cache_index(self, rng):
        x = rng.normal(size=Q).astype("float32")
        layer = make_layer(x, x, num_heads=2, key_dim=4)
        cache = layer.init_cache(2, 5)
        _, cache = layer(x[:, :3], x[:, :3], use_causal_mask=True,
                         cache=cache, cache_update_index=np.int64(0))
        last, _ = layer(x[:, 3:], x[:, 3:], use_causal_mask=True,
                        cache=cache, cache_update_index=np.int64(3))
        expected, _ = reference(layer, x, x, use_causal_mask=True)
        assert_close(last, expected[:, 3:])

    def test_key_mask_without_key_is_honoured(self, rng):
        # Keras applies `key_mask` when `key` is None; dropping it silently
        # gives a different answer.
        query = rng.normal(size=Q).astype("float32")
        value = rng.normal(size=V).astype("float32")
        key_mask = np.ones((2, 7), bool)
        key_mask[0, :4] = False
        layer = make_layer(query, value, num_heads=2, key_dim=4)
        expected, _ = reference(layer, query, value, key_mask=key_mask)
        assert_close(layer(query, value, key_mask=key_mask), expected)

    def test_valid_functional_model_runs(self, rng):
        """The symbolic checks let a correct model with every mask through."""
        inputs = [keras.Input((5, 8)), keras.Input((7, 8)),
                  keras.Input((7, 6)), keras.Input((5,), dtype="bool"),
                  keras.Input((7,), dtype="bool"),
                  keras.Input((5, 7), dtype="bool")]
        query, value, key, query_mask, value_mask, attention_mask = inputs
        output, scores = MHA(num_heads=2, key_dim=4, sliding_window=3)(
            query, value, key, query_mask=query_mask, value_mask=value_mask,
            key_mask=value_mask, attention_mask=attention_mask,
            use_causal_mask=True, return_attention_scores=True,
        )
        model = keras.Model(inputs, [output, scores])
        data = [rng.normal(size=(2, *x.shape[1:])).astype(x.dtype)
                if x.dtype != "bool" else np.ones((2, *x.shape[1:]), bool)
                for x in inputs]
        output, scores = (to_numpy(t) for t in model.predict(data, verbose=0))
        assert output.shape == (2, 5, 8) and scores.shape == (2, 2, 5, 7)
        assert np.isfinite(output).all()
