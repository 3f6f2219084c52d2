"""Context parallelism's costs per device, read from compiled programs.

    python benchmarks/context_parallel.py [--devices 8] [--platform cpu]

Runs itself in a subprocess with `--devices` simulated host devices (on
`--platform gpu`, the machine's GPUs) and compiles, for each `P` in 1, 2,
4, 8 up to the devices there are, a `keras_mha.MultiHeadAttention`
forward (and forward+backward) under `keras_mha.ContextParallel` on a
`(1, P)` mesh. Nothing is timed: every number comes from XLA's compiled
program for one device.

- Sliding window `w = 128`, `T = P × 16,384`: the peak memory of one
  device (`memory_analysis`: arguments, outputs and temporaries) and the
  bytes one device sends per layer (the shapes of the program's
  collective-permutes), forward and forward+backward.
- Full causal, `T = P × 4,096`: the keys and values one device holds, its
  peak memory, and the balance of the work: every device runs the same
  program on blocks of the same sizes (a `(T/P)²` block of scores, then
  `P − 1` ring steps of `(T/P)²/2`), and the query-key pairs the causal
  mask lets each device's queries see are counted, in zig-zag order and,
  for comparison, in natural order (max / min over the devices).

Prints a Markdown table per case.
"""

import argparse
import json
import os
import re
import subprocess
import sys

WINDOW = 128
WINDOW_TOKENS = 16_384  # per device
CAUSAL_TOKENS = 4_096  # per device
HEADS, HEAD_DIM, BATCH = 4, 32, 1
_PERMUTE = re.compile(
    r"= \(?(\w+)\[([\d,]*)\][^=]*? collective-permute(?:-start)?\("
)
_OTHER = re.compile(r" (all-gather|all-to-all|all-reduce|reduce-scatter)"
                    r"(?:-start)?\(")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s8": 1, "pred": 1, "s32": 4}
MIB = 2 ** 20


def _sent(text):
    """Bytes of the collective-permutes in a compiled program (one
    device's sends), and the other collectives' names."""
    total = 0
    for dtype, dims in _PERMUTE.findall(text):
        size = _BYTES[dtype]
        for dim in dims.split(","):
            size *= int(dim) if dim else 1
        total += size
    return total, sorted(set(_OTHER.findall(text)))


def _memory(compiled):
    stats = compiled.memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def _compile(size, length, layer_kwargs, causal, backward):
    import jax
    import jax.numpy as jnp
    import keras

    import keras_mha

    devices = jax.devices()[:size]
    mesh = keras.distribution.DeviceMesh((1, size), ("batch", "context"),
                                         devices)
    distribution = keras_mha.ContextParallel(mesh)
    features = HEADS * HEAD_DIM
    layer = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM, **layer_kwargs)
    shape = (BATCH, length, features)
    layer.build(shape, shape)
    x = jax.ShapeDtypeStruct(
        shape, "float32",
        sharding=distribution.get_data_layout(shape).backend_layout,
    )
    weights = [v.value for v in layer.trainable_variables]
    others = [v.value for v in layer.non_trainable_variables]

    def forward(weights, x):
        out, _ = layer.stateless_call(weights, others, x, x,
                                      use_causal_mask=causal)
        return out

    def loss(weights, x):
        return 0.5 * jnp.sum(jnp.square(forward(weights, x)))

    function = jax.grad(loss, argnums=(0, 1)) if backward else forward
    with distribution.scope():
        return jax.jit(function).lower(weights, x).compile()


def _pairs(size, chunk, zigzag):
    """Query-key pairs the causal mask lets each device's queries see."""
    work = []
    for device in range(size):
        if zigzag:
            chunks = (device, 2 * size - 1 - device)
        else:
            chunks = (2 * device, 2 * device + 1)
        work.append(sum(
            (c * chunk) * chunk + chunk * (chunk + 1) // 2 for c in chunks
        ))
    return max(work) / min(work)


def measure(sizes):
    rows = {"window": [], "causal": []}
    for size in sizes:
        length = size * WINDOW_TOKENS
        row = {"P": size, "T": length}
        for backward in (False, True):
            compiled = _compile(size, length, {"sliding_window": WINDOW},
                                True, backward)
            sent, others = _sent(compiled.as_text())
            tag = "fwd_bwd" if backward else "fwd"
            row[f"{tag}_memory"] = _memory(compiled)
            row[f"{tag}_sent"] = sent
            row[f"{tag}_other_collectives"] = others
        rows["window"].append(row)
        length = size * CAUSAL_TOKENS
        compiled = _compile(size, length, {}, True, False)
        rows["causal"].append({
            "P": size, "T": length,
            "kv_bytes": 2 * BATCH * (length // size) * HEADS * HEAD_DIM * 4,
            "memory": _memory(compiled),
            "zigzag_ratio": _pairs(size, length // (2 * size), True),
            "natural_ratio": _pairs(size, length // (2 * size), False),
        })
    return rows


def _table(rows):
    window = rows["window"]
    lines = [
        f"Sliding window w = {WINDOW}, T = P × {WINDOW_TOKENS:,}, B = "
        f"{BATCH}, N = {HEADS}, H = {HEAD_DIM}, float32 (per device)", "",
        "| P | T | forward memory | vs P = 1 | forward sent | "
        "fwd+bwd memory | vs P = 1 | fwd+bwd sent | other collectives |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in window:
        lines.append(
            f"| {row['P']} | {row['T']:,} | {row['fwd_memory'] / MIB:.0f} MiB"
            f" | {row['fwd_memory'] / window[0]['fwd_memory']:.2f}× | "
            f"{row['fwd_sent'] / 1024:.1f} KiB | "
            f"{row['fwd_bwd_memory'] / MIB:.0f} MiB | "
            f"{row['fwd_bwd_memory'] / window[0]['fwd_bwd_memory']:.2f}× | "
            f"{row['fwd_bwd_sent'] / 1024:.1f} KiB | "
            f"{', '.join(row['fwd_bwd_other_collectives']) or 'none'} |"
        )
    lines += [
        "", f"Full causal, T = P × {CAUSAL_TOKENS:,} (per device)", "",
        "| P | T | keys + values | peak memory | visible pairs, "
        "max / min over devices: zig-zag | natural order |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows["causal"]:
        lines.append(
            f"| {row['P']} | {row['T']:,} | {row['kv_bytes'] / MIB:.1f} MiB | "
            f"{row['memory'] / MIB:.0f} MiB | "
            f"{row['zigzag_ratio']:.2f} | {row['natural_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import jax

        count = len(jax.devices())
        sizes = [p for p in (1, 2, 4, 8) if p <= count]
        print("RESULT " + json.dumps(measure(sizes)))
        return
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS=args.platform)
    if args.platform == "cpu":
        env["XLA_FLAGS"] = (
            f"--xla_force_host_platform_device_count={args.devices}"
        )
    result = subprocess.run(
        [sys.executable, __file__, "--child"], env=env,
        capture_output=True, text=True,
    )
    lines = [line for line in result.stdout.splitlines()
             if line.startswith("RESULT ")]
    if result.returncode or not lines:
        sys.exit(result.stderr[-4000:])
    rows = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps(rows, indent=1) if args.json else _table(rows))


if __name__ == "__main__":
    main()
