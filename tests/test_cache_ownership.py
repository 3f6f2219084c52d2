"""The caller owns the cache it passes; `init_cache(..., in_place=True)`
hands it to the layer (docs/design.md, "Who owns a cache").

By default a call never deletes, donates or writes into a cache it was
given: keras-hub's tests, beam search and retries compute a prefill from a
cache, then decode again from the same cache. An in-place cache says so
itself (`cache.InPlaceCache`, a named tuple): it is written where it lies
in eager calls (torch and TensorFlow return the same tensors, JAX donates
the ones given), the returned cache is in-place too, eager or compiled,
and the same tensors in a plain tuple are the caller's.
"""

import ast
import gc
import pathlib

import keras
import numpy as np
import pytest
from conftest import BACKEND
from test_cached import _causal
from test_cached import _decoder_pair
from test_cached import _inputs
from test_cached import _pair
from test_cached import _small_blocks
from util import assert_close
from util import compiled
from util import make_layer
from util import to_numpy

from keras_mha.attention import cache as cache_lib

BATCH, LENGTH, PROMPT = 2, 6, 3
MODES = ["eager", "compiled"]
# Backends with an in-place write (`cache_kernels.write_slots`).
IN_PLACE_BACKENDS = ("torch", "tensorflow", "jax")


def _tensors(cache):
    return tuple(cache) if isinstance(cache, tuple) else (cache,)


def _snapshot(cache):
    return [np.array(to_numpy(t)) for t in _tensors(cache)]


def _assert_unchanged(cache, snapshot):
    """`cache` still holds what it held (readable: not deleted on JAX)."""
    for tensor, before in zip(_tensors(cache), snapshot):
        if BACKEND == "jax":
            assert not tensor.is_deleted()
        np.testing.assert_array_equal(to_numpy(tensor), before)


def _mha(rng, **kwargs):
    x = rng.normal(size=(BATCH, LENGTH, 8)).astype("float32")
    layer = make_layer(x, x, num_heads=2, key_dim=4, num_key_value_heads=1,
                       **kwargs)
    return layer, x


def _mha_step(layer, mode):
    def step(tokens, cache, index):
        return layer(tokens, tokens, use_causal_mask=True, cache=cache,
                     cache_update_index=index)

    return compiled(step) if mode == "compiled" else step


def _index(i, mode):
    if mode == "compiled":
        return keras.ops.convert_to_tensor(i, dtype="int32")
    return i


def _decode_from(step, x, cache, start, mode):
    """One token at a time from `start`: the outputs and the last cache."""
    outputs = []
    for i in range(start, LENGTH):
        out, cache = step(x[:, i : i + 1], cache, _index(i, mode))
        outputs.append(to_numpy(out))
    return np.concatenate(outputs, axis=1), cache


class TestDefaultMode:
    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("window", [None, 4], ids=["full", "rolling"])
    def test_prefill_then_decode_from_the_same_cache(self, rng, mode, window):
        """keras-hub's test pattern: a prefill from `start`, then a decode
        loop from the same `start`; and two branches from one prefill (a
        beam, a retry). Every run agrees with the full pass."""
        layer, x = _mha(rng, sliding_window=window)
        full = to_numpy(layer(x, x, use_causal_mask=True))
        step = _mha_step(layer, mode)
        start = layer.init_cache(BATCH, LENGTH)
        assert not cache_lib.is_in_place(start)
        before = _snapshot(start)
        prefill, prefilled = step(x[:, :PROMPT], start, _index(0, mode))
        _assert_unchanged(start, before)
        looped, _ = _decode_from(step, x, start, 0, mode)
        _assert_unchanged(start, before)
        assert_close(looped, full)
        assert_close(prefill, full[:, :PROMPT])
        kept = _snapshot(prefilled)
        for _ in range(2):  # two branches from one prefill
            branch, _ = _decode_from(step, x, prefilled, PROMPT, mode)
            assert_close(branch, full[:, PROMPT:])
            _assert_unchanged(prefilled, kept)

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
    def test_keras_hub_cache(self, rng, mode, blocks, monkeypatch):
        """`CachedMultiHeadAttention` with a zero `input_cache`, as
        keras-hub's test: the cached call of the whole sequence, then a
        one-token loop from the same `input_cache`, equal keras-hub's."""
        if blocks:  # the step that reads the slots below its position
            _small_blocks(monkeypatch)
        theirs, ours = _pair(query_length=LENGTH)
        x = _inputs(rng, LENGTH)
        input_cache = keras.ops.zeros((BATCH, 2, LENGTH, 2, 4))

        def step(tokens, cache, index, mask):
            return ours(tokens, tokens, attention_mask=mask, cache=cache,
                        cache_update_index=index)

        if mode == "compiled":
            step = compiled(step)
        whole, whole_cache = step(x, input_cache, _index(0, mode),
                                  _causal(LENGTH, LENGTH))
        expected = theirs(x, x, attention_mask=_causal(LENGTH, LENGTH),
                          cache=keras.ops.zeros((BATCH, 2, LENGTH, 2, 4)),
                          cache_update_index=0)
        assert_close(whole, to_numpy(expected[0]).astype("float64"))
        cache, outputs = input_cache, []
        for i in range(LENGTH):
            out, cache = step(x[:, i : i + 1], cache, _index(i, mode),
                              _causal(1, LENGTH, i))
            outputs.append(to_numpy(out))
        _assert_unchanged(input_cache, [np.zeros(input_cache.shape)])
        assert_close(np.concatenate(outputs, axis=1), to_numpy(whole))
        assert_close(cache, to_numpy(whole_cache).astype("float64"))

    def test_decoder_twice_from_one_cache(self, rng):
        """keras-hub's `TransformerDecoder` with our attention: a cached
        loop, then another from the same zero cache."""
        _, ours = _decoder_pair(LENGTH)
        x = _inputs(rng, LENGTH)
        full = to_numpy(ours(x))
        input_cache = keras.ops.zeros((BATCH, 2, LENGTH, 2, 4))
        for _ in range(2):
            cache, outputs = input_cache, []
            for i in range(LENGTH):
                out, cache = ours(x[:, i : i + 1], self_attention_cache=cache,
                                  self_attention_cache_update_index=i)
                outputs.append(to_numpy(out))
            assert_close(np.concatenate(outputs, axis=1), full)
        _assert_unchanged(input_cache, [np.zeros(input_cache.shape)])


class TestInPlaceMode:
    @pytest.mark.parametrize("window", [None, 4], ids=["full", "rolling"])
    def test_eager_steps_write_where_the_cache_lies(self, rng, window):
        """Each eager write lands in the tensors given (torch: the same
        storage; TensorFlow: the same tensors; JAX: the ones given are
        donated; a rolling cache's prompt is a select over the ring, into
        new tensors), the cache stays in-place from call to call, and
        decoding agrees with the full pass. NumPy has no in-place write:
        its cache stays the caller's."""
        layer, x = _mha(rng, sliding_window=window)
        full = to_numpy(layer(x, x, use_causal_mask=True))
        step = _mha_step(layer, "eager")
        cache = layer.init_cache(BATCH, LENGTH, in_place=True)
        in_place = BACKEND in IN_PLACE_BACKENDS
        assert cache_lib.is_in_place(cache) == in_place
        outputs = []
        for i in [0] + list(range(PROMPT, LENGTH)):
            tokens = x[:, i : i + (PROMPT if i == 0 else 1)]
            pointers = _pointers(cache)
            out, new = step(tokens, cache, i)
            outputs.append(to_numpy(out))
            assert cache_lib.is_in_place(new) == in_place
            if window is not None and i == 0:
                cache = new  # several tokens in a ring: a select, new tensors
                continue
            for old_tensor, new_tensor in zip(cache, new):
                if BACKEND in ("torch", "tensorflow"):
                    assert new_tensor is old_tensor
                elif BACKEND == "jax":
                    assert old_tensor.is_deleted()
                else:
                    assert new_tensor is not old_tensor
            if BACKEND == "torch":
                assert _pointers(new) == pointers
            cache = new
        assert_close(np.concatenate(outputs, axis=1), full)

    def test_keras_hub_cache_in_place(self, rng, monkeypatch):
        _small_blocks(monkeypatch)
        _, ours = _pair(query_length=LENGTH)
        x = _inputs(rng, LENGTH)
        cache = ours.init_cache(BATCH, LENGTH, in_place=True)
        first = cache
        for i in range(LENGTH):
            _, new = ours(x[:, i : i + 1], x[:, i : i + 1],
                          attention_mask=_causal(1, LENGTH, i), cache=cache,
                          cache_update_index=i)
            assert cache_lib.is_in_place(new) == (BACKEND != "numpy")
            if BACKEND in ("torch", "tensorflow"):
                assert new.keys_and_values is first.keys_and_values
            elif BACKEND == "jax":
                assert cache.keys_and_values.is_deleted()
            cache = new
        if BACKEND == "numpy":
            _assert_unchanged(first, [np.zeros(first.shape)])

    def test_a_rebuilt_cache_is_the_callers(self, rng):
        """A cache made from an in-place cache's tensors (a copy) is
        written functionally again."""
        layer, x = _mha(rng)
        cache = layer.init_cache(BATCH, LENGTH, in_place=True)
        copy = tuple(keras.ops.copy(t) for t in cache)
        assert not cache_lib.is_in_place(copy)
        before = _snapshot(copy)
        layer(x[:, :1], x[:, :1], use_causal_mask=True, cache=copy,
              cache_update_index=0)
        _assert_unchanged(copy, before)

    def test_a_plain_tuple_of_its_tensors_is_the_callers(self, rng):
        """Ownership is the value's, not its tensors': the tensors of an
        in-place cache in a plain tuple are written functionally, and the
        caches returned are plain tuples."""
        layer, x = _mha(rng)
        cache = tuple(layer.init_cache(BATCH, LENGTH, in_place=True))
        assert not cache_lib.is_in_place(cache)
        for i in (0, 1):  # the prompt's route, then a step's
            before = _snapshot(cache)
            _, new = layer(x[:, i : i + 1], x[:, i : i + 1],
                           use_causal_mask=True, cache=cache,
                           cache_update_index=i)
            _assert_unchanged(cache, before)
            assert type(new) is tuple
            cache = new

    @pytest.mark.parametrize("mode", MODES)
    def test_the_returned_cache_is_in_place(self, rng, mode):
        """A compiled step (`jax.jit`, `tf.function` with XLA,
        `torch.compile`) writes functionally, leaving the in-place cache
        it is given as it was, and returns an in-place cache, which the
        next eager step writes where it lies."""
        if BACKEND == "numpy":
            pytest.skip("NumPy has no in-place write: no in-place cache")
        layer, x = _mha(rng)
        step = _mha_step(layer, mode)
        if mode == "compiled" and BACKEND == "torch":
            step = _torch_compiled(step)
        cache = layer.init_cache(BATCH, LENGTH, in_place=True)
        _, cache = _mha_step(layer, "eager")(x[:, :PROMPT], cache, 0)
        before = _snapshot(cache)
        _, new = step(x[:, PROMPT : PROMPT + 1], cache, _index(PROMPT, mode))
        assert type(new) is cache_lib.InPlaceCache
        if mode == "compiled":
            _assert_unchanged(cache, before)
        _, last = _mha_step(layer, "eager")(
            x[:, PROMPT + 1 : PROMPT + 2], new, PROMPT + 1)
        assert type(last) is cache_lib.InPlaceCache
        for old_tensor, new_tensor in zip(new, last):
            if BACKEND == "jax":
                assert old_tensor.is_deleted()
            else:
                assert new_tensor is old_tensor

    @pytest.mark.parametrize("bad", [1, "yes", None])
    def test_in_place_must_be_a_bool(self, rng, bad):
        layer, _ = _mha(rng)
        with pytest.raises(TypeError, match="in_place"):
            layer.init_cache(BATCH, LENGTH, in_place=bad)


class TestDefaultModeMemory:
    """A functional eager write takes its new tensors from the backend's
    allocator: the library keeps no memory pool, and no state keyed by
    tensors (docs/performance.md says how to let the allocator reuse a
    dropped cache's memory)."""

    def test_an_old_cache_keeps_its_values(self, rng):
        """A view and a NumPy array of an old cache hold its values while
        later steps write new caches, the collector running at every
        step."""
        layer, x = _mha(rng)
        full = to_numpy(layer(x, x, use_causal_mask=True))
        cache, outputs, kept = layer.init_cache(BATCH, LENGTH), [], {}
        for i in range(LENGTH):
            out, cache = layer(x[:, i : i + 1], x[:, i : i + 1],
                               use_causal_mask=True, cache=cache,
                               cache_update_index=i)
            outputs.append(to_numpy(out))
            if i == 1:
                kept = {"view": cache[0][:, :3],
                        "array": np.asarray(to_numpy(cache[1])),
                        "before": _snapshot(cache)}
            gc.collect()
        assert_close(np.concatenate(outputs, axis=1), full)
        np.testing.assert_array_equal(to_numpy(kept["view"]),
                                      kept["before"][0][:, :3])
        np.testing.assert_array_equal(kept["array"], kept["before"][1])

    def test_no_state_keyed_by_tensors(self):
        """No module of the library imports `weakref`, and the attention
        modules call no `id()`: what a cache is travels with its value."""
        root = pathlib.Path(cache_lib.__file__).resolve().parents[1]
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = ([a.name for a in node.names]
                         if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom)
                         else [])
                assert "weakref" not in names, path
                if path.parent.name == "attention":
                    assert not (isinstance(node, ast.Call)
                                and isinstance(node.func, ast.Name)
                                and node.func.id == "id"), path

    @pytest.mark.skipif(BACKEND != "torch", reason="torch's autograd")
    def test_gradients_flow_through_a_functional_write(self, rng):
        """Into the cache's slots that stay and into the new tokens (JAX
        and TensorFlow differentiate traced calls)."""
        import torch

        cache = torch.zeros((1, 4, 1, 2), requires_grad=True)
        new = torch.ones((1, 1, 1, 2), requires_grad=True)
        written = cache_lib._write_run(cache, new, 1)
        (written * torch.arange(1.0, 9.0).reshape(1, 4, 1, 2)).sum().backward()
        assert new.grad.flatten().tolist() == [3.0, 4.0]
        assert cache.grad.flatten().tolist() == [1, 2, 0, 0, 5, 6, 7, 8]


def _torch_compiled(step):
    """`step` under `torch.compile`, called without gradients (decoding)."""
    import torch

    compiled_step = torch.compile(step, backend="aot_eager")

    def run(*args):
        with torch.no_grad():
            return compiled_step(*args)

    return run


def _pointers(cache):
    if BACKEND != "torch":
        return None
    return [t.data_ptr() for t in cache]
