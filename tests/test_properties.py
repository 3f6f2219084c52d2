"""Property-based parity: every attention path against the float64 reference.

Hypothesis draws the batch, lengths, head counts and sizes, grouped heads,
sliding windows (`w` and `(left, right)`), causality, padding masks (with
rows and whole batch entries that have nothing to attend to), attention
masks, and the features of current models (rotary embeddings, the scale,
soft-capping, sinks, ALiBi, segment ids, attention biases); each path that can serve
the call must match `reference_attention` to 1e-5 in float32, and so each
other.

Profiles: `ci` (the default) is derandomized and small enough for a slow
machine; `thorough` (`KERAS_MHA_HYPOTHESIS_PROFILE=thorough`) runs hundreds
of random examples. Sizes come from small fixed sets because JAX compiles
every op for every new shape in eager mode.
"""

import contextlib
import os
from unittest import mock

import numpy as np
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from conftest import BACKEND
from util import assert_close
from util import make_layer
from util import reference
from util import to_numpy

import keras_mha
from keras_mha import attention as attention_lib
from keras_mha.attention import dispatch

_COMMON = dict(
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # conftest's autouse fixture
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
    print_blob=True,
)
settings.register_profile(
    "ci", max_examples=12, derandomize=True, database=None, **_COMMON
)
settings.register_profile("thorough", max_examples=300, **_COMMON)
PROFILE_NAME = os.environ.get("KERAS_MHA_HYPOTHESIS_PROFILE", "ci")
PROFILE = settings.get_profile(PROFILE_NAME)
THOROUGH = PROFILE_NAME == "thorough"

FEATURES, KEY_FEATURES = 8, 5  # E (query and value), E_k of a separate key

# (B, T, S, N, K, H, V) for the ci profile: two shapes, because JAX compiles
# every op for every new shape (about 8 s a shape here). Together they have
# grouped heads (K < N, K = 1), self- and cross-attention, H != V. The
# thorough profile draws each size on its own, T = 1 and S = 1 included.
CI_GEOMETRIES = ((2, 4, 4, 4, 2, 2, 2), (2, 3, 6, 2, 1, 4, 3))
# Decoding: the cache's slot count (w when rolling) and the prompt length
# set the shapes, so ci draws them from short lists too.
CI_DECODE_WINDOWS = (2,)  # rolling, shorter than the prompt
CI_PROMPT_LENGTHS = (3,)


@st.composite
def geometries(draw, self_attention_only=False, ci_geometries=CI_GEOMETRIES):
    """`(B, T, S, N, K, H, V)`, `N % K == 0`."""
    if not THOROUGH:
        return draw(st.sampled_from([
            g for g in ci_geometries if not self_attention_only or g[1] == g[2]
        ]))
    query_length = draw(st.integers(1, 6))
    key_length = (
        query_length if self_attention_only else draw(st.integers(1, 7))
    )
    num_heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    num_kv_heads = draw(st.sampled_from(
        [k for k in range(1, num_heads + 1) if num_heads % k == 0]
    ))
    # Keras 3.15's TensorFlow `ops.add` takes a bias `(heads, 1)` for a
    # channel bias and adds it along axis 1 when that axis has `heads`
    # entries: `EinsumDense` (so Keras's own layer too) projects wrongly on
    # TensorFlow when a head has size 1 and a sequence (or a decoding chunk)
    # is as long as the heads are many.
    sizes = [2, 4] if BACKEND == "tensorflow" else [1, 2, 4]
    key_dim = draw(st.sampled_from(sizes))
    return (
        draw(st.integers(1, 3)),
        query_length,
        key_length,
        num_heads,
        num_kv_heads,
        key_dim,
        draw(st.sampled_from([key_dim, 3])),
    )


def _bools(draw, shape):
    size = int(np.prod(shape))
    flat = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    return np.array(flat, bool).reshape(shape)


@st.composite
def padding_masks(draw, batch, length):
    """`None` or `(B, L)`: random, left padding, or an entry with no token."""
    kind = draw(st.sampled_from(["none", "random", "left", "empty-entry"]))
    if kind == "none":
        return None
    if kind == "random":
        return _bools(draw, (batch, length))
    mask = np.ones((batch, length), bool)
    if kind == "left":
        mask[0, : draw(st.integers(1, length))] = False
    else:
        mask[draw(st.integers(0, batch - 1))] = False
    return mask


@st.composite
def attention_masks(draw, batch, num_heads, query_length, key_length):
    """`None` or a boolean/integer mask in one of the documented shapes."""
    shape = draw(st.sampled_from([
        None,
        (query_length, key_length),
        (1, query_length, key_length),
        (batch, 1, key_length),
        (batch, query_length, key_length),
        (batch, num_heads, query_length, key_length),
    ]))
    if shape is None:
        return None
    mask = _bools(draw, shape)
    return mask.astype(draw(st.sampled_from(["bool", "int32"])))


@st.composite
def segments(draw, batch, query_length, key_length):
    """`(segment_ids, key_segment_ids)`: `None`s, or ids in {0, 1}."""
    if not draw(st.booleans()):
        return None, None
    ids = lambda length: np.array(  # noqa: E731
        draw(st.lists(st.integers(0, 1), min_size=batch * length,
                      max_size=batch * length)), "int32"
    ).reshape(batch, length)
    query_ids = ids(query_length)
    if query_length == key_length and draw(st.booleans()):
        return query_ids, None  # the keys share the queries' ids
    return query_ids, ids(key_length)


@st.composite
def biases(draw, batch, num_heads, query_length, key_length):
    """`None`, or a float bias in one of the shapes that broadcast."""
    shape = draw(st.sampled_from([
        None, (num_heads, query_length, key_length),
        (batch, 1, 1, key_length),
    ]))
    if shape is None:
        return None
    seed = draw(st.integers(0, 2**16))
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


@st.composite
def attention_cases(draw, self_attention_only=False,
                    ci_geometries=CI_GEOMETRIES):
    """One layer configuration and one call's inputs, as a dict."""
    batch, query_length, key_length, num_heads, num_kv_heads, key_dim, \
        value_dim = draw(geometries(self_attention_only, ci_geometries))
    separate_key = not self_attention_only and draw(st.booleans())
    longest = max(query_length, key_length)
    segment_ids, key_segment_ids = (
        (None, None) if self_attention_only
        else draw(segments(batch, query_length, key_length))
    )
    return dict(
        rotary=key_dim % 2 == 0 and draw(st.booleans()),
        segment_ids=segment_ids,
        key_segment_ids=key_segment_ids,
        attention_bias=None if self_attention_only else draw(
            biases(batch, num_heads, query_length, key_length)
        ),
        layer=dict(
            num_heads=num_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            num_key_value_heads=num_kv_heads,
            sliding_window=draw(
                st.none()
                | st.integers(1, longest + 1)
                | st.tuples(st.integers(0, longest), st.integers(0, longest))
            ),
            use_gate=draw(st.booleans()),
            scale=draw(st.none() | st.sampled_from([0.3, 1.5])),
            attn_logits_soft_cap=draw(st.none() | st.sampled_from([0.5, 4.0])),
            use_sinks=draw(st.booleans()),
            use_alibi=draw(st.booleans()),
        ),
        shapes=(batch, query_length, key_length, separate_key),
        use_causal_mask=draw(st.booleans()),
        query_mask=draw(padding_masks(batch, query_length)),
        value_mask=draw(padding_masks(batch, key_length)),
        key_mask=(
            draw(padding_masks(batch, key_length)) if separate_key else None
        ),
        attention_mask=(
            None
            if self_attention_only
            else draw(
                attention_masks(batch, num_heads, query_length, key_length)
            )
        ),
        seed=draw(st.integers(0, 2**16)),
    )


def _layer_and_inputs(case):
    batch, query_length, key_length, separate_key = case["shapes"]
    rng = np.random.default_rng(case["seed"])
    query = rng.normal(size=(batch, query_length, FEATURES))
    value = rng.normal(size=(batch, key_length, FEATURES))
    key = rng.normal(size=(batch, key_length, KEY_FEATURES))
    inputs = [query.astype("float32"), value.astype("float32")]
    if separate_key:
        inputs.append(key.astype("float32"))
    rotary = {}
    if case["rotary"]:
        rotary["rotary_embedding"] = keras_mha.RotaryEmbedding(
            max_wavelength=10.0
        )
    layer = make_layer(*inputs, seed=case["seed"], **case["layer"], **rotary)
    return layer, inputs


def _build(case):
    """`(layer, inputs, call_kwargs, (expected_output, expected_weights))`."""
    layer, inputs = _layer_and_inputs(case)
    kwargs = {
        name: case[name]
        for name in ("query_mask", "value_mask", "key_mask", "attention_mask",
                     "attention_bias", "segment_ids", "key_segment_ids")
        if case[name] is not None
    }
    kwargs["use_causal_mask"] = case["use_causal_mask"]
    expected = reference(layer, *inputs, **kwargs)
    return layer, inputs, kwargs, expected


def _check(result, expected, scores):
    output, weights = expected
    if scores:
        result, returned_weights = result
        assert_close(returned_weights, weights)
    assert_close(result, output)


@PROFILE
@given(case=attention_cases())
def test_fused_and_explicit_paths_match_reference(case):
    """`return_attention_scores` switches between the fused and explicit
    paths (dispatch.choose_path); both equal the reference."""
    layer, inputs, kwargs, expected = _build(case)
    for scores in (False, True):
        result = layer(*inputs, return_attention_scores=scores, **kwargs)
        _check(result, expected, scores)


def _spy_on_paths(stack):
    """`{path: mock}` recording calls to each path's function (as `attend`
    finds it) until `stack` closes."""
    return {
        path: stack.enter_context(
            mock.patch.object(
                attention_lib,
                f"{path}_attention",
                wraps=getattr(attention_lib, f"{path}_attention"),
            )
        )
        for path in dispatch.PATHS
    }


def _expected_path(layer, inputs, kwargs, scores):
    """The path the layer's rule answers for this call (under any forced
    path in effect)."""
    masks = {name: name in kwargs for name in
             ("query_mask", "value_mask", "key_mask", "attention_mask",
              "attention_bias", "segment_ids")}
    return layer.attention_path(
        *(x.shape for x in inputs),
        use_causal_mask=kwargs["use_causal_mask"],
        return_attention_scores=scores,
        **masks,
    )


# The banded path compiles anew for each window block layout, causality and
# shape: one geometry is enough in ci.
@PROFILE
@given(case=attention_cases(ci_geometries=CI_GEOMETRIES[:1]))
def test_every_forced_path_matches_reference(case):
    """Each path in `dispatch.PATHS`, forced with `dispatch.force_path`: the
    path that runs (checked with spies) is the one the layer's rule answers
    (`attention_path`, which honours the forced path where it can serve the
    call), and it equals the reference."""
    layer, inputs, kwargs, expected = _build(case)
    for scores in (False, True):
        for path in dispatch.PATHS:
            with contextlib.ExitStack() as stack:
                spies = _spy_on_paths(stack)
                stack.enter_context(dispatch.force_path(path))
                result = layer(
                    *inputs, return_attention_scores=scores, **kwargs
                )
                answer = _expected_path(layer, inputs, kwargs, scores)
            ran = {p for p, spy in spies.items() if spy.called}
            assert ran == {answer}
            if path == dispatch.EXPLICIT:  # serves every call
                assert answer == path
            _check(result, expected, scores)


@PROFILE
@given(
    case=attention_cases(self_attention_only=True),
    prompt_length=st.integers(1, 6) if THOROUGH
    else st.sampled_from(CI_PROMPT_LENGTHS),
    window=st.integers(1, 7) | st.none() if THOROUGH
    else st.sampled_from(CI_DECODE_WINDOWS),
)
def test_cached_decoding_matches_reference(case, prompt_length, window):
    """The cached path (a rolling buffer with a window): a prompt, then one
    token at a time, with the same padding as the full causal call."""
    case["layer"]["sliding_window"] = window
    layer, (query, _) = _layer_and_inputs(case)
    batch, length, _, _ = case["shapes"]
    prompt_length = min(prompt_length, length)
    # One token mask for the sequence: the query's and the value's together.
    tokens = np.ones((batch, length), bool)
    for name in ("query_mask", "value_mask"):
        if case[name] is not None:
            tokens &= case[name]
    expected, _ = reference(layer, query, query, query_mask=tokens,
                            value_mask=tokens, use_causal_mask=True)
    cache = layer.init_cache(batch, length)
    start, outputs = 0, []
    while start < length:
        stop = prompt_length if start == 0 else start + 1
        chunk, mask = query[:, start:stop], tokens[:, start:stop]
        output, cache = layer(
            chunk, chunk, query_mask=mask, value_mask=mask,
            use_causal_mask=True, cache=cache, cache_update_index=start,
        )
        outputs.append(output)
        start = stop
    assert_close(np.concatenate([to_numpy(o) for o in outputs], 1), expected)
