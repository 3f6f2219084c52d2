"""The default-mode decode step's new memory, under the allocator's
settings, on the active backend (`KERAS_BACKEND`):

    python -m benchmarks.default_step            # 65,536 slots, p = 1k
    python -m benchmarks.default_step --small    # a quick run

A step with a cache the caller owns (the default of `init_cache`) returns
a new cache: its tensors come from the backend's allocator, and on the CPU
each page of fresh memory faults on its first write. The library keeps no
memory pool (docs/performance.md says why); the allocator keeps freed
memory where its settings say so. Each setting runs in a process of its
own (they are read at start-up): none; glibc's `GLIBC_TUNABLES` with
`mmap_max=0` and a 4 GiB `trim_threshold` (large tensors from the heap,
kept there once freed); on torch, `THP_MEM_ALLOC_ENABLE=1` (transparent
huge pages). Each with Python's collector running when it will (`auto`)
and only before every fourth step (`every 4`): a step's time should not
depend on when it last ran.

A row: the median page faults of a step (`ru_minflt`), the steps that
took over a thousand, and the median ms of a step, each the median over
`--runs` runs taken in turn. The faults do not depend on the machine's
load; the times of a shared machine are indicative.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

FULL = dict(batch=1, heads=8, head=64, slots=65536, position=1024, steps=16)
SMALL = dict(batch=1, heads=2, head=8, slots=512, position=64, steps=4)
GLIBC = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296"
SETTINGS = {"none": {}, "GLIBC_TUNABLES": {"GLIBC_TUNABLES": GLIBC},
            "THP_MEM_ALLOC_ENABLE=1": {"THP_MEM_ALLOC_ENABLE": "1"}}
COLLECTOR = {"auto": 0, "every 4": 4}
FAULTED = 1000  # page faults: a step that took fresh memory
# The checkout: the children import its `benchmarks` and `keras_mha`.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steps(shape, every):
    """`[(ms, page faults)]` of `shape["steps"]` eager default-mode steps,
    the collector run only before every `every`-th step when `every`."""
    import gc
    import resource
    import time

    import numpy as np
    from keras import ops

    import keras_mha
    from keras_mha.attention import cache as cache_lib

    batch, heads, head = shape["batch"], shape["heads"], shape["head"]
    layer = keras_mha.MultiHeadAttention(num_heads=heads, key_dim=head)
    layer.build((batch, 1, heads * head), (batch, 1, heads * head))
    rng = np.random.default_rng(0)
    kv = [ops.convert_to_tensor(rng.normal(
        size=(batch, shape["slots"], heads, head)).astype("float32"))
        for _ in range(2)]  # (B, L, K, H)
    cache = cache_lib.write(layer.init_cache(batch, shape["slots"]), *kv,
                            None, 0, False)
    token = ops.convert_to_tensor(
        rng.normal(size=(batch, 1, heads * head)).astype("float32"))
    collecting = gc.isenabled()
    if every:
        gc.disable()
    results = []
    try:
        with _no_grad():
            for i in range(shape["steps"] + 3):  # 3 to warm up
                if every and i % every == 0:
                    gc.collect()
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                out, cache = layer(token, token, use_causal_mask=True,
                                   cache=cache,
                                   cache_update_index=shape["position"])
                ops.convert_to_numpy(out)  # waits for the result
                results.append((
                    (time.perf_counter() - start) * 1e3,
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    - faults,
                ))
    finally:
        if collecting:
            gc.enable()
    return results[3:]


def _no_grad():
    """Decoding: no step's output keeps an old cache in an autograd graph
    (torch)."""
    import keras

    if keras.backend.backend() != "torch":
        return contextlib.nullcontext()
    import torch

    return torch.no_grad()


def run(shape, runs, backend):
    """`[(setting, collector, faults, faulted steps, ms)]`, medians over
    `runs` rounds, each setting and collector once a round."""
    settings = [s for s in SETTINGS
                if backend == "torch" or not s.startswith("THP")]
    found = {}
    for _ in range(runs):
        for setting in settings:
            for collector, every in COLLECTOR.items():
                env = dict(os.environ, **SETTINGS[setting])
                child = subprocess.run(
                    [sys.executable, "-m", "benchmarks.default_step",
                     "--child", json.dumps([shape, every])],
                    env=env, cwd=ROOT, capture_output=True, text=True,
                    check=True)
                found.setdefault((setting, collector), []).append(
                    json.loads(child.stdout.splitlines()[-1]))
    rows = []
    for (setting, collector), results in found.items():
        faults = [statistics.median(f for _, f in r) for r in results]
        faulted = [sum(f > FAULTED for _, f in r) for r in results]
        times = [statistics.median(t for t, _ in r) for r in results]
        rows.append((setting, collector, statistics.median(faults),
                     statistics.median(faulted), statistics.median(times)))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        shape, every = json.loads(args.child)
        print(json.dumps(steps(shape, every)))
        return 0
    import keras

    backend = keras.backend.backend()
    shape = SMALL if args.small else FULL
    print(f"{backend}: default-mode step, B={shape['batch']}, "
          f"{shape['heads']} heads of {shape['head']}, L={shape['slots']}, "
          f"p={shape['position']}, {shape['steps']} steps, medians of "
          f"{args.runs} runs")
    print("setting | collector | faults a step | steps faulted | ms a step")
    for setting, collector, faults, faulted, ms in run(shape, args.runs,
                                                       backend):
        print(f"{setting} | {collector} | {faults:,.0f} | {faulted:g} of "
              f"{shape['steps']} | {ms:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
