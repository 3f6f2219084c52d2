"""The development benchmarks: speed and memory of our layer, Keras's and
native peers, against the project's acceptance targets.

Run from the repository root: `python -m benchmarks [--quick] ...` (`--help`
for the flags). This folder is not part of the package: the wheel ships
`keras_mha` only, the library and its command line never import it, and it
imports them. Users time their own shapes with `keras-mha bench`. Its tests
are in `tests/` here, run by `keras-mha test` with the project's.

For each installed backend (tensorflow, jax, torch; NumPy has no compiler
and no autodiff and is not benchmarked), T, window w and causal setting of
the matrix (`--config FILE`, by default `benchmarks/bench.json`), with B=1, N=8, H=64 (E=512), and for the small-model cells
of its `small` section (B=8, T in {128, 256, 512}, w in {none, 64};
keras, ours and ours_core; Keras's layer and ours timed alternately, call
for call, so that their ratio is measured over the same seconds), it times
the forward and forward+backward (gradient of 0.5*sum(y^2) w.r.t. the
inputs and the weights) of:

- `keras` - `keras.layers.MultiHeadAttention(sliding_window=w)`, whole layer;
- `ours` - `keras_mha.MultiHeadAttention(sliding_window=w)`, whole layer;
- `ours_core` - our attention core on projected q, k, v `(B, T, N, H)`:
  `banded_attention` with a window, what `keras_mha.attention.attend`
  picks without (blocked, triangular or fused, as the dispatch rule says);
- `native` - torch `flex_attention` under `torch.compile` with a sliding-
  window block mask (forward only: no CPU backward; the block-mask build is
  timed separately), jax `jax.nn.dot_product_attention(is_causal=True,
  local_window_size=(w-1, 0))`; attention core only.

The yardstick of the "% matmul" column and of the roofline is the float32
rate of the layer's own projection matmul, `(B*T, E) @ (E, N*H)`, timed
in the same worker at each B and T of the cells (and, for our layer and
core, after each of their timed calls, the rate they read against): the
roofline is the layer's useful FLOPs at that rate, what it would cost if
attention ran as fast as its projections (a square matmul's rate is
reported beside it, for information).

Unless `--no-fit`, it times one `train_on_batch` step (the config's `fit`
section: a 2-layer causal transformer, B=1, T=4096, w=128, E=512, mse,
Adam) compiled with `jit_compile=True` where Keras compiles it, with our
layer (w=128) and with `keras.layers.MultiHeadAttention` (causal, no
window) in its blocks; target: ours faster on every backend where Keras's
compiles.

Unless `--no-features`, it times the feature cells: our whole layer at
T=16384, w=128, causal, forward and forward+backward, with one feature of
current models or of real checkpoints on (RoPE, soft-cap 50, sinks,
ALiBi, 4 equal segments of `segment_ids`, `qk_norm="rms"`, chunks of 128
in place of the window, gpt-oss's YaRN RoPE, Llama 4's query temperature)
against the same layer with none (`plain`), each as a ratio to plain
(target: at most 1.3x).

Unless `--no-decode`, it measures decoding (the config's `decode`
section), each cell eager and, on jax and tensorflow, compiled (`jax.jit`
with the cache donated, `tf.function(jit_compile=True)`):

- the time per token of one step of our layer with a full cache of
  65,536 slots at p = 1, 1024, 16384 and 65535, with one of 2,048 slots at
  p = 1024 and with a rolling cache of w = 512 slots at the same positions
  as the first, and of keras-hub's `CachedMultiHeadAttention` (its cache
  `(B, 2, S, N, H)`, a causal `attention_mask` `(B, 1, S)`) with the same
  full caches at the same positions but 1;
- the floor: reading the valid cached bytes once (the sums of the `p + 1`
  first slots of keys and values shaped as our full cache's, of the `w` of
  a rolling one; compiled, torch eager), and the fixed cost of a step: ours
  at p = 1 in the same cache;
- the tokens per second of a tiny keras-hub GPT-2's greedy `generate`
  (2 layers, 2 heads, E=64; a prompt of 8 tokens, `max_length` 128) with
  keras-hub's attention and with `keras_mha.CachedMultiHeadAttention` in
  its decoders, the same weights;
- a prefill of T=8192 through our layer's cache at `cache_update_index=0`
  (a rolling cache of w=128, a full one of 8192 slots) against the same
  forward without a cache.

`--features` runs only the feature cells (`OUT/bench-features.json`,
`OUT/report-features.md`), `--decode` only the decode cells
(`OUT/bench-decode.json`, `OUT/report-decode.md`), `--long` only the
long-sequence case (T=262144, w=128, ours and ours_core, forward; no
small-model cells, no fit step).

The command (`command.py`) runs each backend in its own worker process
(`worker.py`, `backends.py`) fed one unit at a time by the parent
(`runner.py`), which enforces the wall-clock and memory limits; units
predicted to pass the time or memory cap are skipped (`plan.py`; our
layer's forward only for the memory: it must complete); peak
memory is the largest growth of the worker's resident memory during the
timed calls (`memory.py`); on a GPU, every timed call waits for its kernels
(`Backend.block`). Results are reported, never dropped: a unit that did not
produce a time says why.

Outputs: a table and the targets of the issues on the terminal, and
`OUT/bench.json` (every unit), `OUT/report.md` (the terminal's tables and
targets), `OUT/bench.png` (`OUT/bench-long.json` and `OUT/report-long.md`
for `--long`) and each worker's stderr in `OUT/worker-<backend>.log`. Exit
code 1 if a unit ended in an error (a traceback is in the log), 130 if
interrupted (what was measured is still written).
"""
