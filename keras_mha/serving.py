"""Serving many sequences from one paged cache: the page allocator and a
continuous-batching generate loop (docs/serving.md).

The traced step only reads and writes the pages it is given
(`keras_mha.attention.paged`); which pages those are is decided here, in
plain Python and NumPy, between steps:

- `PageAllocator` hands out rows of the page table and pages of the pool,
  counts each page's references, shares the full pages of a common prompt
  prefix, copies a shared page before its first write (copy-on-write) and
  frees a page when nothing refers to it.
- `generate` serves requests greedily: they join the running batch as
  rows free up, prefill in chunks beside the others' decode steps, and
  leave when done.
"""

import collections

import numpy as np

from keras_mha import checks
from keras_mha.attention import paged
from keras_mha.attention.paged import RaggedBatch


def paged_cache(layer, num_pages, page_size, quantize, in_place):
    """`init_paged_cache` of either attention layer: its arguments
    checked, its pages (`checks.pool_shapes`)."""
    checks.paged_cache(layer, num_pages, page_size, quantize, in_place)
    (heads, key_size), values = checks.pool_shapes(layer)
    return paged.zeros(
        num_pages, page_size, heads, key_size,
        None if values is None else values[1], layer.compute_dtype,
        quantize=quantize, in_place=in_place,
    )


class PoolExhausted(RuntimeError):
    """The pool has too few free pages (or the table too few rows) for
    what was asked; nothing was changed."""


class PageAllocator:
    """Pages of one pool and the page table of the sequences using them.

    Rows of the page table are the running sequences; row `r`'s entry `i`
    is the page holding its positions `[i·Z, (i + 1)·Z)`, or `-1`. Every
    layer of a model has its own pool with the same page numbers, so one
    allocator serves them all.

    A full page of a prompt is registered under its tokens and those
    before it: a later prompt with the same prefix takes the same pages
    (`add`) instead of computing them. A page shared by several rows is
    read-only: `reserve` gives a row a private copy before it writes into
    one (the caller copies the page in every layer's pool with
    `keras_mha.attention.paged.copy_pages`).

    Args:
        num_pages: `P`, the pool's pages.
        page_size: `Z`, the slots of a page.
        max_sequences: `R`, rows of the page table.
        max_pages_per_sequence: `M`, its width.
    """

    def __init__(self, num_pages, page_size, max_sequences,
                 max_pages_per_sequence):
        for name, value in (("num_pages", num_pages),
                            ("page_size", page_size),
                            ("max_sequences", max_sequences),
                            ("max_pages_per_sequence",
                             max_pages_per_sequence)):
            checks.positive_int(name, value)
        self.page_size = page_size
        self.num_pages = num_pages
        self.page_table = np.full((max_sequences, max_pages_per_sequence),
                                  -1, "int32")
        self.lengths = np.zeros(max_sequences, "int32")  # tokens cached
        self._references = np.zeros(num_pages, "int64")
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_rows = list(range(max_sequences - 1, -1, -1))
        self._prefixes = {}  # (previous page, tokens) -> page
        self._prefix_of = {}  # page -> its key in `_prefixes`
        self._next = {}  # page -> the keys that follow it
        self._tokens = {}  # row -> the tokens written so far

    # ----------------------------------------------------------- reading

    @property
    def free_pages(self):
        """Pages no row refers to."""
        return len(self._free_pages)

    @property
    def pages_in_use(self):
        """Pages some row refers to (a shared page counted once)."""
        return self.num_pages - len(self._free_pages)

    @property
    def free_rows(self):
        """Rows of the page table no sequence holds."""
        return len(self._free_rows)

    def references(self, page):
        """How many rows refer to `page`."""
        return int(self._references[page])

    def pages(self, row):
        """The pages of `row`, in order (`-1`: none)."""
        return self.page_table[row].tolist()

    def shared_prefix(self, tokens):
        """How many leading tokens of `tokens` are held in registered
        pages: whole pages, and never the last token (whose logits a
        caller needs)."""
        return len(self._registered(tokens)) * self.page_size

    def batch(self, counts, rows=None):
        """The `RaggedBatch` of a call that writes `counts[row]` new tokens
        for each row given, at the rows' lengths. Its rows are the page
        table's (`rows=None`), or those of `rows` in order, `None` an idle
        row (a smaller call over some of the sequences)."""
        rows = range(len(self.lengths)) if rows is None else rows
        table = np.full((len(rows), self.page_table.shape[1]), -1, "int32")
        positions = np.zeros(len(rows), "int32")
        lengths = np.zeros(len(rows), "int32")
        for index, row in enumerate(rows):
            if row is not None and counts.get(row):
                table[index] = self.page_table[row]
                positions[index] = self.lengths[row]
                lengths[index] = counts[row]
        return RaggedBatch(table, positions, lengths)

    # --------------------------------------------------------- changing

    def add(self, tokens=()):
        """A new row for a sequence whose prompt is `tokens`: the pages of
        its longest registered prefix are shared with it. Returns `(row,
        cached)`, `cached` the tokens already in the cache (its length)."""
        if not self._free_rows:
            raise PoolExhausted(
                f"All {len(self.lengths)} rows of the page table are in "
                "use; `remove` one first."
            )
        row = self._free_rows.pop()
        shared = self._registered(tokens)
        for index, page in enumerate(shared):
            self.page_table[row, index] = page
            self._references[page] += 1
        cached = len(shared) * self.page_size
        self.lengths[row] = cached
        self._tokens[row] = list(tokens[:cached])
        return row, cached

    def fork(self, row):
        """A new row holding the same tokens as `row`, every page shared
        (parallel sampling, beams). Returns the new row."""
        if not self._free_rows:
            raise PoolExhausted(
                f"All {len(self.lengths)} rows of the page table are in "
                "use; `remove` one first."
            )
        new = self._free_rows.pop()
        self.page_table[new] = self.page_table[row]
        for page in self.page_table[row]:
            if page >= 0:
                self._references[page] += 1
        self.lengths[new] = self.lengths[row]
        self._tokens[new] = list(self._tokens[row])
        return new

    def pages_needed(self, row, count):
        """The free pages `reserve(row, count)` would take."""
        size, start = self.page_size, int(self.lengths[row])
        needed = 0
        for index in range(start // size, -(-(start + count) // size)):
            page = self.page_table[row, index] if index < \
                self.page_table.shape[1] else -1
            if page < 0 or self._references[page] > 1:
                needed += 1
        return needed

    def reserve(self, row, count):
        """Makes the pages of `row`'s next `count` positions its own:
        missing ones taken from the pool, shared ones copied. Returns
        `(sources, targets)`, the pages to copy in every pool before the
        step writes (empty lists when none)."""
        size, start = self.page_size, int(self.lengths[row])
        last = -(-(start + count) // size)
        if last > self.page_table.shape[1]:
            raise PoolExhausted(
                f"Row {row} would need {last} pages; the page table holds "
                f"{self.page_table.shape[1]}. Received: count={count}"
            )
        if self.pages_needed(row, count) > len(self._free_pages):
            raise PoolExhausted(
                f"Row {row} needs {self.pages_needed(row, count)} pages; "
                f"{len(self._free_pages)} are free."
            )
        sources, targets = [], []
        for index in range(start // size, last):
            page = int(self.page_table[row, index])
            if page >= 0 and self._references[page] == 1:
                continue
            new = self._free_pages.pop()
            self._references[new] = 1
            if page >= 0:  # shared: copied, then the copy is written
                sources.append(page)
                targets.append(new)
                self._release(page)
            self.page_table[row, index] = new
        return sources, targets

    def advance(self, row, tokens):
        """Records that a step wrote `tokens` (their ids) for `row`; its
        pages that fill up are registered as a prefix others may share."""
        size = self.page_size
        written = self._tokens[row]
        before = len(written)
        written.extend(int(t) for t in tokens)
        self.lengths[row] = len(written)
        for index in range(before // size, len(written) // size):
            page = int(self.page_table[row, index])
            previous = -1 if index == 0 else int(
                self.page_table[row, index - 1])
            key = (previous, tuple(written[index * size:(index + 1) * size]))
            if page >= 0 and key not in self._prefixes and (
                    page not in self._prefix_of):
                self._prefixes[key] = page
                self._prefix_of[page] = key
                self._next.setdefault(previous, []).append(key)

    def release_before(self, row, position):
        """Frees `row`'s pages that hold only positions before `position`
        (a window's keys it will never read again)."""
        for index in range(max(position, 0) // self.page_size):
            page = int(self.page_table[row, index])
            if page >= 0:
                self.page_table[row, index] = -1
                self._release(page)

    def remove(self, row):
        """Frees `row` and each of its pages nothing else refers to."""
        for page in self.page_table[row].tolist():
            if page >= 0:
                self._release(page)
        self.page_table[row] = -1
        self.lengths[row] = 0
        self._tokens.pop(row, None)
        self._free_rows.append(row)

    def _release(self, page):
        self._references[page] -= 1
        if self._references[page] == 0:
            self._free_pages.append(page)
            key = self._prefix_of.pop(page, None)
            if key is not None:
                del self._prefixes[key]
            # A reused number must not lead to the pages that followed it
            # (a window frees a sequence's first pages before the rest).
            for later in self._next.pop(page, ()):
                later_page = self._prefixes.pop(later, None)
                if later_page is not None:
                    del self._prefix_of[later_page]

    def _registered(self, tokens):
        """The registered pages holding `tokens`' leading whole pages (the
        last token left out)."""
        size, pages, previous = self.page_size, [], -1
        for index in range((len(tokens) - 1) // size):
            key = (previous, tuple(int(t) for t in
                                   tokens[index * size:(index + 1) * size]))
            previous = self._prefixes.get(key, -1)
            if previous < 0:
                break
            pages.append(previous)
        return pages


_Request = collections.namedtuple("_Request",
                                  "index prompt fed generated logits")


def generate(model, prompts, allocator, max_new_tokens, prefill_chunk=64,
             prefill_rows=1, window=None):
    """Greedy decoding of every prompt by continuous batching.

    Requests join the running batch while the allocator has a row and the
    pages their prompt and new tokens need, and leave once they have
    `max_new_tokens`. Each round makes two ragged calls: one prefills up
    to `prefill_chunk` prompt tokens of each of up to `prefill_rows`
    joining requests, `(prefill_rows, prefill_chunk)`; the other decodes
    one token of every other request, `(R, 1)` over the page table's `R`
    rows. Two shapes, so a compiled step compiles twice, and no decoding
    row carries a prefill chunk's padding.

    Args:
        model: has `step(tokens, batch)`, the next-token logits `(rows,
            vocabulary)` at each row's last new token for `(rows, T)`
            int32 tokens and a `RaggedBatch`, and `copy_pages(sources,
            targets)`, which copies pages in each of its pools
            (`paged.copy_pages`).
        prompts: sequences of token ids.
        allocator: the `PageAllocator` of the model's pools.
        max_new_tokens: the tokens generated for each request.
        prefill_chunk: the most prompt tokens a row takes in one call.
        prefill_rows: the most requests prefilled in one call.
        window: `None`, or the keys the model's widest window reaches back
            (`w` of `sliding_window=w`): older pages are freed.

    Returns:
        The generated token ids of each prompt, a list of lists, in order.
    """
    for name, value in (("max_new_tokens", max_new_tokens),
                        ("prefill_chunk", prefill_chunk),
                        ("prefill_rows", prefill_rows)):
        checks.positive_int(name, value)
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(
                "Each prompt needs at least one token, whose logits give "
                f"the first new one. Received: prompts[{index}]={prompt!r}"
            )
    waiting = collections.deque(enumerate(prompts))
    running, results = {}, [None] * len(prompts)
    while waiting or running:
        _admit(waiting, running, allocator, max_new_tokens, window)
        if not running:
            raise PoolExhausted(
                "The pool cannot hold the next request alone: "
                f"{len(waiting[0][1])} prompt tokens and {max_new_tokens} "
                "new ones."
            )
        joining = [row for row, request in running.items()
                   if request.fed[0] < len(request.prompt)][:prefill_rows]
        decoding = [row for row, request in running.items()
                    if request.fed[0] >= len(request.prompt)]
        calls = [(joining + [None] * (prefill_rows - len(joining)),
                  prefill_chunk), (list(range(len(allocator.lengths))), 1)]
        for rows, length in calls:
            ready = joining if length == prefill_chunk else decoding
            if ready:
                _call(model, allocator, running, rows, ready, length)
        for row in joining + decoding:
            _after_call(running, results, allocator, row, max_new_tokens,
                        window)
    return results


def _call(model, allocator, running, rows, ready, length):
    """One ragged call: the next tokens of the `ready` rows among `rows`
    (the call's rows, `None` idle), at most `length` each; the logits of
    each row's last token are kept on its request."""
    counts = {row: min(len(_feed(running[row])), length) for row in ready}
    tokens = np.zeros((len(rows), length), "int32")
    for index, row in enumerate(rows):
        if row in counts:
            tokens[index, :counts[row]] = _feed(running[row])[:counts[row]]
            sources, targets = allocator.reserve(row, counts[row])
            if sources:
                model.copy_pages(sources, targets)
    logits = np.asarray(model.step(tokens, allocator.batch(counts, rows)))
    for index, row in enumerate(rows):
        if row in counts:
            allocator.advance(row, tokens[index, :counts[row]])
            running[row].fed[0] += counts[row]
            running[row].logits[0] = logits[index]


def _feed(request):
    """The tokens `request` has not fed yet."""
    return (list(request.prompt) + request.generated)[request.fed[0]:]


def _admit(waiting, running, allocator, max_new_tokens, window):
    """Moves waiting requests into `running` while rows and pages last
    (pages for the whole request, so a running one never waits)."""
    promised = sum(_pages_left(allocator, row, request, max_new_tokens,
                               window) for row, request in running.items())
    while waiting and allocator.free_rows:
        index, prompt = waiting[0]
        shared = allocator.shared_prefix(prompt)
        need = _pages_for(len(prompt) + max_new_tokens, window,
                          allocator.page_size) - shared // allocator.page_size
        if promised + need > allocator.free_pages:
            return
        waiting.popleft()
        row, cached = allocator.add(prompt)
        running[row] = _Request(index, list(prompt), [cached], [], [None])
        promised += need


def _pages_for(tokens, window, size):
    """Pages a sequence of `tokens` holds at most at once."""
    if window is not None:
        tokens = min(tokens, window + size)
    return -(-tokens // size) + (window is not None)


def _pages_left(allocator, row, request, max_new_tokens, window):
    total = len(request.prompt) + max_new_tokens
    held = sum(1 for page in allocator.pages(row) if page >= 0 and
               allocator.references(page) == 1)
    return max(_pages_for(total, window, allocator.page_size) - held, 0)


def _after_call(running, results, allocator, row, max_new_tokens, window):
    request = running[row]
    if request.fed[0] < len(request.prompt):
        return  # still prefilling: the logits are not a new token's
    request.generated.append(int(np.argmax(request.logits[0])))
    if window is not None:
        allocator.release_before(row, int(allocator.lengths[row]) - window)
    if len(request.generated) == max_new_tokens:
        results[request.index] = request.generated
        allocator.remove(row)
        del running[row]
