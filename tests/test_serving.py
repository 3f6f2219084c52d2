"""Serving (`keras_mha/serving.py`): the page allocator, and continuous
batching over paged caches against decoding each request alone.

`generate` serves requests of different prompt lengths through a running
batch smaller than the number of requests, so requests join as others
leave, prefill chunks run beside decode steps, and one prompt shares a
prefix with another. Its greedy tokens must equal those of each request
decoded alone with the layers' dense caches (`TinyLM.greedy_alone`).
"""

import numpy as np
import pytest

from serving_model import TinyLM
from keras_mha import serving

PROMPTS = ([5, 9, 2], [7, 1, 4, 4, 8, 3, 9, 6, 2], [7, 1, 4, 4, 8, 3, 1],
           [3, 3, 8, 1, 5])
NEW_TOKENS = 3


def _served(model, window=None, max_sequences=2):
    allocator = serving.PageAllocator(num_pages=16, page_size=2,
                                      max_sequences=max_sequences,
                                      max_pages_per_sequence=8)
    model.init_pools(16, 2)
    tokens = serving.generate(model, PROMPTS, allocator, NEW_TOKENS,
                              prefill_chunk=4, window=window)
    return tokens, allocator


def test_continuous_batching_equals_decoding_each_request_alone():
    model = TinyLM(vocabulary=16, heads=2, kv_heads=1, head=8)
    tokens, allocator = _served(model)
    assert tokens == [model.greedy_alone(p, NEW_TOKENS) for p in PROMPTS]
    assert allocator.free_pages == 16 and allocator.free_rows == 2


def test_a_windowed_model_frees_pages_and_equals_decoding_alone():
    model = TinyLM(vocabulary=16, heads=2, kv_heads=1, head=8,
                   sliding_window=3)
    tokens, allocator = _served(model, window=3)
    assert tokens == [model.greedy_alone(p, NEW_TOKENS) for p in PROMPTS]


def _written(allocator, count):
    """A new row of `allocator` holding `count` tokens."""
    row, _ = allocator.add()
    allocator.reserve(row, count)
    allocator.advance(row, range(count))
    return row


@pytest.mark.backend_free
def test_a_prefix_is_shared_by_its_full_pages_and_freed_with_its_last_user():
    allocator = serving.PageAllocator(8, 2, 3, 4)
    first, cached = allocator.add([1, 2, 3, 4, 5])
    assert cached == 0
    allocator.reserve(first, 5)
    allocator.advance(first, [1, 2, 3, 4, 5])
    second, cached = allocator.add([1, 2, 3, 4, 9, 9])
    assert cached == 4  # two full pages; the third differs
    assert allocator.pages(second)[:2] == allocator.pages(first)[:2]
    assert allocator.shared_prefix([1, 2, 3, 4, 5]) == 4
    third, cached = allocator.add([1, 2, 3])
    assert cached == 2  # never the last token
    assert allocator.pages_in_use == 3
    allocator.remove(first)
    allocator.remove(third)
    assert allocator.pages_in_use == 2  # still the second's
    allocator.remove(second)
    assert allocator.pages_in_use == 0
    assert allocator.add([1, 2, 3, 4, 5])[1] == 0  # the prefix is gone


@pytest.mark.backend_free
def test_a_freed_page_number_leads_to_none_of_the_pages_after_it():
    """A window frees a sequence's first page; its number, reused for
    other tokens, must not lead a new prompt to the second page, whose
    keys were computed after the first page's tokens."""
    allocator = serving.PageAllocator(6, 2, 3, 4)
    row, _ = allocator.add([1, 2, 3, 4, 5])
    allocator.reserve(row, 5)
    allocator.advance(row, [1, 2, 3, 4, 5])
    first, second = allocator.pages(row)[:2]
    allocator.release_before(row, 2)  # page 0 freed, its number reusable
    other, _ = allocator.add([9, 9, 3, 4, 7])
    allocator.reserve(other, 5)
    allocator.advance(other, [9, 9, 3, 4, 7])
    assert allocator.pages(other)[0] == first  # the number, reused
    assert allocator.pages(other)[1] != second
    third, cached = allocator.add([9, 9, 3, 4, 8])
    assert cached == 4  # its own chain, not the freed page's
    assert allocator.pages(third)[:2] == allocator.pages(other)[:2]


@pytest.mark.backend_free
def test_a_shared_page_is_copied_before_its_first_write():
    allocator = serving.PageAllocator(6, 4, 2, 3)
    row = _written(allocator, 6)
    other = allocator.fork(row)
    assert allocator.reserve(row, 1) == ([allocator.pages(other)[1]],
                                         [allocator.pages(row)[1]])
    assert allocator.reserve(other, 1) == ([], [])  # now its own
    assert [allocator.references(p) for p in allocator.pages(row)[:2]] == [
        2, 1]


@pytest.mark.backend_free
def test_an_exhausted_pool_changes_nothing():
    allocator = serving.PageAllocator(2, 2, 1, 4)
    row, _ = allocator.add()
    with pytest.raises(serving.PoolExhausted, match="needs 3 pages; 2"):
        allocator.reserve(row, 5)
    with pytest.raises(serving.PoolExhausted, match="would need 5 pages"):
        allocator.reserve(row, 9)
    assert allocator.free_pages == 2 and allocator.pages(row) == [-1] * 4
    with pytest.raises(serving.PoolExhausted, match="rows of the page"):
        allocator.add()
    with pytest.raises(ValueError, match="Received: page_size=0"):
        serving.PageAllocator(2, 0, 1, 4)
    with pytest.raises(ValueError, match=r"Received: prompts\[1\]=\[\]"):
        serving.generate(None, [[1], []], allocator, 2)


@pytest.mark.backend_free
def test_window_release_frees_only_pages_before_the_position():
    allocator = serving.PageAllocator(8, 2, 1, 4)
    row = _written(allocator, 7)
    allocator.release_before(row, 5)  # positions 0..3: pages 0 and 1
    assert [p >= 0 for p in allocator.pages(row)] == [False, False, True,
                                                      True]
    assert allocator.free_pages == 6
    assert np.all(allocator.batch({row: 1}).positions == [7])
