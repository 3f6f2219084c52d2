"""The caller owns the cache it passes; `init_cache(..., in_place=True)`
hands it to the layer (docs/design.md, "Who owns a cache").

By default a call never deletes, donates or writes into a cache it was
given: keras-hub's tests, beam search and retries compute a prefill from a
cache, then decode again from the same cache. An in-place cache is written
where it lies in eager calls (torch and TensorFlow return the same
tensors, JAX donates the ones given), and the returned cache stays
in-place.
"""

import gc

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
            if BACKEND in ("torch", "tensorflow"):
                assert new is first
            elif BACKEND == "jax":
                assert cache.is_deleted() and cache_lib.is_in_place(new)
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

    @pytest.mark.parametrize("bad", [1, "yes", None])
    def test_in_place_must_be_a_bool(self, rng, bad):
        layer, _ = _mha(rng)
        with pytest.raises(TypeError, match="in_place"):
            layer.init_cache(BATCH, LENGTH, in_place=bad)


@pytest.mark.skipif(BACKEND not in ("torch", "jax"),
                    reason="cache_kernels.copy_slots serves torch and JAX")
class TestRecycledMemory:
    """A functional eager write on the CPU copies the cache into the
    memory of a cache of the same size that nothing refers to any more
    (`cache_kernels._Recycler`), never into one still referred to."""

    SLOTS = 37  # a size of its own: no other test's caches share its lists

    def _loop(self, rng, keep=None):
        if BACKEND == "jax":
            return self._steps(rng, keep)
        import torch

        with torch.no_grad():  # no step's output keeps an old cache alive
            return self._steps(rng, keep)

    def _steps(self, rng, keep):
        layer, x = _mha(rng)
        full = to_numpy(layer(x, x, use_causal_mask=True))
        x = np.concatenate([x] * 2, axis=1)[:, : self.SLOTS]
        cache = layer.init_cache(BATCH, self.SLOTS)
        outputs, pointers = [], []
        for i in range(LENGTH):
            out, cache = layer(x[:, i : i + 1], x[:, i : i + 1],
                               use_causal_mask=True, cache=cache,
                               cache_update_index=i)
            outputs.append(to_numpy(out))
            pointers.append({_pointer(t) for t in cache})
            if keep is not None and i == 1:
                keep(cache)
            # Keras's call flattens its arguments with torch's pytree,
            # whose closures hold them in a reference cycle until the
            # collector runs; here it runs at every step.
            gc.collect()
        assert_close(np.concatenate(outputs, axis=1), full)
        return cache, pointers

    def test_a_dropped_cache_is_reused(self, rng):
        _, pointers = self._loop(rng)
        # Each step's cache lies where that of two steps before did.
        assert pointers[2:] == pointers[:-2]
        assert not pointers[0] & pointers[1]

    def test_a_cache_still_referred_to_is_not_reused(self, rng):
        kept = {}

        def keep(cache):
            # torch: a view of the keys; both: a NumPy array of the values
            if BACKEND == "torch":
                kept["view"] = cache[0][:, :3]
            kept["array"] = np.asarray(cache[1])
            kept["before"] = _snapshot(cache)

        self._loop(rng, keep)
        if BACKEND == "torch":
            np.testing.assert_array_equal(to_numpy(kept["view"]),
                                          kept["before"][0][:, :3])
        np.testing.assert_array_equal(kept["array"], kept["before"][1])

    def test_nothing_is_kept_once_the_caches_are_dropped(self, rng):
        from keras_mha.attention import cache_kernels

        cache, _ = self._loop(rng)
        sizes = {t.size * t.dtype.itemsize if BACKEND == "jax"
                 else t.numel() * t.element_size() for t in cache}
        assert cache_kernels._RECYCLER.free_bytes(sizes) > 0
        del cache
        gc.collect()
        assert cache_kernels._RECYCLER.free_bytes(sizes) == 0

    @pytest.mark.skipif(BACKEND != "torch", reason="torch's autograd")
    def test_gradients_flow_through_a_recycled_write(self, rng):
        """Into the cache's slots that stay and into the new tokens, as
        through `slice_update` (JAX differentiates traced calls, which
        `copy_slots` does not serve)."""
        import torch

        from keras_mha.attention import cache_kernels

        cache = torch.zeros((1, 4, 1, 2), requires_grad=True)
        new = torch.ones((1, 1, 1, 2), requires_grad=True)
        assert cache_kernels.can_copy_slots(cache, new)
        written = cache_lib._write_run(cache, new, 1)
        (written * torch.arange(1.0, 9.0).reshape(1, 4, 1, 2)).sum().backward()
        assert new.grad.flatten().tolist() == [3.0, 4.0]
        assert cache.grad.flatten().tolist() == [1, 2, 0, 0, 5, 6, 7, 8]


def _pointer(tensor):
    if BACKEND == "jax":
        return tensor.unsafe_buffer_pointer()
    return tensor.data_ptr()


def _pointers(cache):
    if BACKEND != "torch":
        return None
    return [t.data_ptr() for t in cache]
