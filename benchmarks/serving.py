"""Serving's cells on the active backend (`KERAS_BACKEND`):

    python -m benchmarks.serving            # the issue's workload
    python -m benchmarks.serving --large    # 32 requests, prompts 16..1024
    python -m benchmarks.serving --medium   # 16 requests, prompts 16..512
    python -m benchmarks.serving --small    # a quick run of the same cells

The model is `tests/serving_model.py`'s `TinyLM` of our layers (the issue:
4 layers, GQA 8/2 heads of 64). Cells, measured side by side in one run:

- throughput: the same requests (prompts of random lengths, the same new
  tokens each) by continuous batching over paged caches
  (`keras_mha.serving.generate`, `rows` at a time), against a static-batch
  loop that takes `rows` requests at a time, left-pads them to the
  longest prompt and decodes with dense caches of `longest + new` slots;
  tokens per second of each, eager;
- memory: the pages held at the fullest point of the paged run against
  the tokens cached then (a shared page counted once), and the dense
  caches' slots against the same tokens;
- int8: the pool's bytes, scales included, against float32's; one decode
  step of one layer at position `p` over int8 pages against float32
  pages, eager and compiled where the backend compiles (`jax.jit`,
  `tf.function(jit_compile=True)`);
- a ragged decode step of 16 rows at 16 different positions against 16
  one-row steps of the same rows;
- a char-level `TinyLM` trained on this repository's README and docs
  (`--train-steps`): its logits over 65 decode steps with an int8 cache
  against a float cache, fed the same text.

Prints one table row per cell; the numbers of a shared machine are
indicative.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISSUE = dict(layers=4, heads=8, kv_heads=2, head=64, requests=64,
             shortest=16, longest=2048, new=128, rows=16, page=16,
             chunk=256, position=16384)
MEDIUM = dict(ISSUE, requests=16, longest=512, new=32, rows=8)
LARGE = dict(ISSUE, requests=32, longest=1024, new=64, rows=8)
SMALL = dict(layers=2, heads=4, kv_heads=2, head=16, requests=6,
             shortest=4, longest=40, new=4, rows=3, page=4, chunk=16,
             position=256)


def _model(sizes):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from serving_model import TinyLM

    return TinyLM(vocabulary=256, layers=sizes["layers"],
                  heads=sizes["heads"], kv_heads=sizes["kv_heads"],
                  head=sizes["head"])


def _prompts(sizes):
    rng = np.random.default_rng(0)
    lengths = rng.integers(sizes["shortest"], sizes["longest"] + 1,
                           sizes["requests"])
    return [list(rng.integers(1, 256, n)) for n in lengths]


def _static(model, prompts, sizes):
    """The static-batch loop: `rows` requests at a time, left-padded to
    the longest, dense caches. Returns the dense caches' largest slots."""
    from keras import ops

    rows, new, largest = sizes["rows"], sizes["new"], 0
    for start in range(0, len(prompts), rows):
        group = prompts[start:start + rows]
        longest = max(len(p) for p in group)
        tokens = np.zeros((len(group), longest), "int32")
        mask = np.zeros((len(group), longest), bool)
        for i, prompt in enumerate(group):
            tokens[i, longest - len(prompt):] = prompt
            mask[i, longest - len(prompt):] = True
        caches = [layer.init_cache(len(group), longest + new)
                  for layer in model.attention_layers]
        largest += len(group) * (longest + new)
        index = 0
        for _ in range(new):
            def attend(i, layer, h, index=index, mask=mask):
                out, caches[i] = layer(h, h, use_causal_mask=True,
                                       cache=caches[i],
                                       cache_update_index=index,
                                       query_mask=mask, value_mask=mask)
                return out

            logits = model._run(tokens, attend)
            index += tokens.shape[1]
            tokens = np.argmax(ops.convert_to_numpy(logits[:, -1]), -1)[
                :, None].astype("int32")
            mask = np.ones((len(group), 1), bool)
    return largest


class _Peak:
    """Wraps a model's step to record the fullest point of the pool."""

    def __init__(self, model, allocator):
        self.model, self.allocator = model, allocator
        self.held, self.cached = 0, 0

    def step(self, tokens, batch):
        allocator = self.allocator
        if allocator.pages_in_use > self.held:
            self.held = allocator.pages_in_use
            self.cached = _distinct_tokens(allocator)
        return self.model.step(tokens, batch)

    def copy_pages(self, sources, targets):
        self.model.copy_pages(sources, targets)


def _distinct_tokens(allocator):
    """The tokens the pool holds, a shared page's counted once."""
    filled = {}
    for row in range(len(allocator.lengths)):
        for index, page in enumerate(allocator.pages(row)):
            if page >= 0:
                slots = min(max(int(allocator.lengths[row]) - index
                                * allocator.page_size, 0),
                            allocator.page_size)
                filled[page] = max(filled.get(page, 0), slots)
    return sum(filled.values())


def _continuous(model, prompts, sizes):
    from keras_mha import serving

    page = sizes["page"]
    width = -(-(sizes["longest"] + sizes["new"]) // page)
    pages = sizes["rows"] * width
    allocator = serving.PageAllocator(pages, page, sizes["rows"], width)
    model.init_pools(pages, page)
    peak = _Peak(model, allocator)
    serving.generate(peak, prompts, allocator, sizes["new"],
                     prefill_chunk=sizes["chunk"])
    return peak


def _throughput(sizes, rows):
    model = _model(sizes)
    prompts = _prompts(sizes)
    tokens = len(prompts) * sizes["new"]
    start = time.perf_counter()
    peak = _continuous(model, prompts, sizes)
    paged_s = time.perf_counter() - start
    start = time.perf_counter()
    dense_slots = _static(model, prompts, sizes)
    static_s = time.perf_counter() - start
    rows.append(("tokens/s, continuous batching (paged)",
                 f"{tokens / paged_s:.1f}", f"{paged_s:.1f} s"))
    rows.append(("tokens/s, static batches (dense, padded)",
                 f"{tokens / static_s:.1f}", f"{static_s:.1f} s"))
    rows.append(("throughput, continuous / static",
                 f"{static_s / paged_s:.2f}x", "target >= 3x"))
    held = peak.held * sizes["page"]
    rows.append(("memory at the fullest point: slots held / tokens cached",
                 f"{held:,} / {peak.cached:,} = {held / peak.cached:.3f}",
                 "target <= 1.1"))
    rows.append(("dense caches: slots / tokens they will hold",
                 f"{dense_slots:,} / "
                 f"{sum(len(p) for p in prompts) + tokens:,}", ""))


def _median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _layer(sizes):
    """`(layer, width, page size)`: one attention layer of the model's
    heads, built."""
    import keras_mha

    heads, head = sizes["heads"], sizes["head"]
    width = heads * head
    layer = keras_mha.MultiHeadAttention(
        num_heads=heads, key_dim=head, num_key_value_heads=sizes["kv_heads"],
        rotary_embedding=keras_mha.RotaryEmbedding())
    layer.build((1, 1, width), (1, 1, width))
    return layer, width, sizes["page"]


def _decode_step(sizes, quantize, compiled, repeats):
    """ms of one decode step of one layer at position `p` over pages."""
    import keras

    from keras_mha.attention import paged

    layer, width, page = _layer(sizes)
    pages = sizes["position"] // page + 1
    pool = layer.init_paged_cache(pages, page, quantize=quantize)
    table = np.arange(pages, dtype="int32")[None]
    batch = paged.RaggedBatch(table, np.array([sizes["position"]], "int32"),
                              np.ones(1, "int32"))
    x = np.random.default_rng(0).normal(size=(1, 1, width)).astype(
        "float32")

    def step(x, pool, batch):
        return layer(x, x, use_causal_mask=True, cache=pool,
                     cache_update_index=batch)[0]

    if compiled:
        step = _compiled(keras.backend.backend(), step)
        batch = paged.RaggedBatch(*(keras.ops.convert_to_tensor(a)
                                    for a in batch))
    x = keras.ops.convert_to_tensor(x)
    return _median_ms(lambda: keras.ops.convert_to_numpy(step(x, pool,
                                                              batch)),
                      repeats)


def _compiled(backend, fn):
    if backend == "jax":
        import jax

        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn, jit_compile=True)


def _int8(sizes, rows, repeats):
    import keras

    from keras_mha.attention import paged

    def size(pool):
        return sum(keras.ops.convert_to_numpy(t).nbytes for t in pool
                   if t is not None)

    shape = (64, sizes["page"], sizes["kv_heads"], sizes["head"],
             sizes["head"])
    ratio = size(paged.zeros(*shape, "float32", quantize="int8")) / size(
        paged.zeros(*shape, "float32"))
    rows.append(("cache bytes, int8 (scales included) / float32",
                 f"{ratio:.3f}", "target <= 0.27"))
    modes = [False] + ([True] if keras.backend.backend() in (
        "jax", "tensorflow") else [])
    for compiled in modes:
        name = "compiled" if compiled else "eager"
        f32 = _decode_step(sizes, None, compiled, repeats)
        i8 = _decode_step(sizes, "int8", compiled, repeats)
        rows.append((f"decode step at p = {sizes['position']:,}, {name}: "
                     "int8 / float32 ms", f"{i8:.2f} / {f32:.2f} = "
                     f"{i8 / f32:.2f}", "target <= 0.6"))


def _ragged(sizes, rows, repeats):
    """One ragged decode step of 16 rows against 16 one-row steps."""
    import keras

    from keras_mha.attention import paged

    layer, width, page = _layer(sizes)
    positions = np.linspace(16, sizes["longest"], 16).astype("int32")
    widths = -(-(positions + 1) // page)
    table = np.full((16, widths.max()), -1, "int32")
    start = 0
    for r, count in enumerate(widths):
        table[r, :count] = np.arange(start, start + count)
        start += count
    pool = layer.init_paged_cache(start, page)
    x = np.random.default_rng(0).normal(size=(16, 1, width)).astype(
        "float32")

    def one_call():
        batch = paged.RaggedBatch(table, positions, np.ones(16, "int32"))
        return keras.ops.convert_to_numpy(layer(
            x, x, use_causal_mask=True, cache=pool,
            cache_update_index=batch)[0])

    def sixteen_calls():
        for r in range(16):
            batch = paged.RaggedBatch(table[r:r + 1], positions[r:r + 1],
                                      np.ones(1, "int32"))
            keras.ops.convert_to_numpy(layer(
                x[r:r + 1], x[r:r + 1], use_causal_mask=True, cache=pool,
                cache_update_index=batch)[0])

    together = _median_ms(one_call, repeats)
    apart = _median_ms(sixteen_calls, repeats)
    rows.append(("16 rows at 16 positions: 16 one-row steps / one ragged "
                 "step, eager", f"{apart:.1f} / {together:.1f} ms = "
                 f"{apart / together:.1f}x", "target >= 8x"))


def _text():
    """Real text: this repository's README and docs, as bytes."""
    import glob

    names = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(
        os.path.join(ROOT, "docs", "*.md")))]
    return np.frombuffer(b"".join(open(n, "rb").read() for n in names),
                         "uint8").astype("int32")


def _trained_logits(sizes, rows, steps):
    """A char-level model of `TinyLM` trained on `_text()` for `steps`;
    the logits of 64 decode steps over a dense float cache against an
    int8 cache, fed the same tokens."""
    import keras
    from keras import ops

    model = _model(sizes)
    text = _text()
    rng = np.random.default_rng(0)
    length, batch = 64, 16
    starts = rng.integers(0, len(text) - length - 1, (steps, batch))
    x = np.stack([text[s:s + length] for s in starts.reshape(-1)])
    y = np.stack([text[s + 1:s + length + 1] for s in starts.reshape(-1)])
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    prompt = text[1000:1128][None]
    logits = {}
    for quantize in (None, "int8"):
        caches = [layer.init_cache(1, 256, quantize=quantize)
                  for layer in model.attention_layers]
        tokens, index, steps_logits = prompt, 0, []
        for t in range(65):
            def attend(i, layer, h, index=index):
                out, caches[i] = layer(h, h, use_causal_mask=True,
                                       cache=caches[i],
                                       cache_update_index=index)
                return out

            out = ops.convert_to_numpy(model._run(tokens, attend))[0, -1]
            steps_logits.append(out)
            index += tokens.shape[1]
            tokens = text[1128 + t:1129 + t][None]  # the text's own next
        logits[quantize] = np.stack(steps_logits)
    error = np.abs(logits["int8"] - logits[None]).max() / np.abs(
        logits[None]).max()
    loss = history.history["loss"][-1]
    rows.append((f"trained char-level LM (loss {loss:.2f} after {steps} "
                 "steps): max |logits int8 - float| / max |logits|",
                 f"{error:.4f}", "target <= 2e-2"))


def run(sizes, repeats=5, throughput=True, train_steps=0):
    """`[(cell, value, note)]` on the active backend."""
    rows = []
    if throughput:
        _throughput(sizes, rows)
    _int8(sizes, rows, repeats)
    _ragged(sizes, rows, repeats)
    if train_steps:
        _trained_logits(sizes, rows, train_steps)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true")
    size.add_argument("--medium", action="store_true")
    size.add_argument("--large", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-throughput", action="store_true",
                        help="leave the generate loops out")
    parser.add_argument("--train-steps", type=int, default=300,
                        help="training steps of the char-level model "
                        "whose int8 logits are compared (0: none)")
    args = parser.parse_args(argv)
    import keras

    sizes = (SMALL if args.small else MEDIUM if args.medium else LARGE
             if args.large else ISSUE)
    rows = run(sizes, args.repeats, throughput=not args.no_throughput,
               train_steps=args.train_steps)
    print(f"| {keras.backend.backend()} | | |")
    print("|---|---|---|")
    for cell, value, note in rows:
        print(f"| {cell} | {value} | {note} |")


if __name__ == "__main__":
    sys.exit(main())
