"""The tuning table: every number that picks a path or sizes a block.

Each setting maps `(backend, platform)` to an `Entry`: the value, a
one-line reason, and the development benchmark that measures it (the
top-level `benchmarks/` suite, `python -m benchmarks`). A key's backend or
platform may be `ANY`; a lookup takes the first of `(backend, platform)`,
`(backend, ANY)`, `(ANY, platform)`, `(ANY, ANY)` that the setting has.

The platform is the kind of device the backend computes on: `cpu`, `gpu`
(any accelerator other than a TPU: CUDA, ROCm, Metal...) or `tpu`
(`device_platform`). The paths' thresholds were measured on CPUs. On the
other platforms nothing was measured, and the dispatch rule follows Keras's
own layer there (`follow_keras`, see `dispatch.py`); our algorithms' block
sizes keep the CPU's values for the calls that still reach them.

Overrides, for tests and benchmark sweeps: a value in `OVERRIDES` (name ->
value) wins over the table on every backend and platform, and the
environment variable `KERAS_MHA_TUNING="name=value,name=value"` fills
`OVERRIDES` when this module is imported (values: integers, floats, `inf`,
`true`, `false`, `none`). A benchmark written `name=a|b|c` is one run per
value, e.g. `KERAS_MHA_TUNING=blocked_block=256 python -m benchmarks ...`.
`assume_platform` makes `device_platform` answer a given platform.
"""

import collections
import functools
import math
import os

import keras_mha.attention.capabilities as capabilities
import keras_mha.attention.overrides as overrides
from keras_mha.attention.capabilities import JAX, TENSORFLOW, TORCH

CPU = "cpu"
GPU = "gpu"
TPU = "tpu"
PLATFORMS = (CPU, GPU, TPU)
ANY = "*"

Entry = collections.namedtuple("Entry", ["value", "reason", "benchmark"])

_BENCH = "python -m benchmarks"
_SWEEP = "KERAS_MHA_TUNING={} " + _BENCH


_PROGRAMMABLE = ("KERAS_BACKEND={} python -m benchmarks.programmable "
                 "--dense --lengths {}")


def _causal(backend, lengths):
    """The command that times the causal paths on one backend."""
    return f"{_BENCH} --backends {backend} --lengths {lengths} --windows none"
_MiB = 1 << 20
_SERVING = ("KERAS_MHA_TUNING=paged_row_sequence=true|false KERAS_BACKEND={} "
            "python -m benchmarks.serving --medium --train-steps 0")

TABLE = {
    # ---------------------------------------------------------------- rule
    "follow_keras": {
        (ANY, CPU): Entry(
            False,
            "the thresholds below are measured on CPUs: the rule picks the "
            "fastest path there",
            _BENCH + " --backends tensorflow,jax,torch",
        ),
        (ANY, ANY): Entry(
            True,
            "nothing is measured here: a call Keras's layer sends to its "
            "fused kernel goes to that kernel",
            _BENCH + " --backends tensorflow,jax,torch  # on a GPU or TPU",
        ),
    },
    "banded_recompute_bytes": {
        (JAX, ANY): Entry(
            64 << 20,
            "a Gemma-3-shaped step at T = 8192 (5 layers of window 512, "
            "83 MiB of weights each): recomputing the chunks' weights in "
            "the backward lowers the peak from 3.71 to 2.85 GiB for 3% "
            "more time; at 4096 (45 MiB a layer) it would cost 14% for "
            "0.47 GiB",
            "KERAS_MHA_TUNING=banded_recompute_bytes=0|inf "
            "KERAS_BACKEND=jax python -m benchmarks.hub --length 8192 "
            "--steps 2",
        ),
        (ANY, ANY): Entry(
            math.inf,
            "not measured: autodiff keeps the weights",
            "none",
        ),
    },
    "dense_scores_budget": {
        (ANY, ANY): Entry(
            1 << 30,
            "(B, N, T, S) float32 scores above 1 GiB leave a 16 GiB "
            "accelerator too little for the backward's copies: a window "
            "that large runs banded, in O(T·w)",
            _BENCH + " --backends jax --lengths 4096,16384 --windows 128  "
            "# peak memory, on a GPU",
        ),
    },
    "native_window": {
        (JAX, GPU): Entry(
            True,
            "`jax.nn.dot_product_attention(local_window_size=...)` runs "
            "cuDNN's flash kernel on half precision, skipping the keys "
            "outside a one-sided window",
            _BENCH + " --backends jax --lengths 4096,16384 --windows 128,512"
            "  # on a GPU",
        ),
        (ANY, ANY): Entry(
            False,
            "no kernel of the backend skips a window's keys here (JAX's "
            "off GPUs is XLA's dense softmax with the window as a mask)",
            _BENCH + " --backends jax --lengths 4096,16384 --windows 128,512",
        ),
    },
    # ---------------------------------------------------------- thresholds
    "banded_min_ratio": {
        (ANY, ANY): Entry(
            4,
            "the band wins once the keys span a few windows; below S = 4·w "
            "it covers most of the T x S scores",
            _BENCH + " --lengths 1024,4096 --windows 128,512",
        ),
    },
    "banded_min_length": {
        (ANY, ANY): Entry(
            256,
            "short keys stay on the fused kernel, where the band's "
            "per-block work outweighs the scores it skips",
            _BENCH + " --lengths 128,256,512 --windows 64 --no-decode "
            "--no-features --no-fit",
        ),
    },
    "blocked_min_length": {
        (JAX, ANY): Entry(
            512,
            "from T = 512 the blocks beat XLA's kernel, which writes the "
            "T x T scores, and the triangle",
            _causal(JAX, "256,512,1024"),
        ),
        (TENSORFLOW, ANY): Entry(
            2048,
            "without XLA the fused kernel is as fast as the blocks up to "
            "T = 1024 and slower from T = 2048",
            _causal(TENSORFLOW, "1024,2048,4096"),
        ),
        (TORCH, ANY): Entry(
            1024,
            "from T = 1024, only what torch's kernel cannot do (a soft-cap)",
            _causal(TORCH, "512,1024,2048"),
        ),
        (ANY, ANY): Entry(
            math.inf,
            "NumPy runs inference for checks, not for speed: never",
            "none",
        ),
    },
    "sparse_min_length": {
        (JAX, ANY): Entry(
            512,
            "from T = 512 the kept blocks beat the dense mask on XLA's "
            "kernel, forward and backward, for prefix-LM and 16 documents "
            "(a window of 512 is even there, 0.54x at 1024)",
            _PROGRAMMABLE.format(JAX, "512,1024,2048"),
        ),
        (TENSORFLOW, ANY): Entry(
            1024,
            "from T = 1024 the kept blocks beat the dense mask (0.28x for "
            "16 documents, 0.76x prefix-LM); at 512 they are even",
            _PROGRAMMABLE.format(TENSORFLOW, "512,1024,2048"),
        ),
        (TORCH, ANY): Entry(
            4096,
            "at T = 4096 16 documents and a window of 512 take 0.10x and "
            "0.25x of the dense mask on torch's kernel, prefix-LM (which "
            "keeps 0.63) 1.01x; at 2048 prefix-LM pays 1.22x, the others "
            "0.20x and 0.48x",
            _PROGRAMMABLE.format(TORCH, "2048,4096"),
        ),
        (ANY, ANY): Entry(
            math.inf,
            "NumPy runs inference for checks, not for speed: never",
            "none",
        ),
    },
    "sparse_block": {
        (TORCH, ANY): Entry(
            128,
            "torch's fused kernel takes a group of query blocks with their "
            "kept key blocks gathered: at T = 16384 128 gives a random mask "
            "of 128-blocks 0.37x of causal against 1.37x at 256, 16 "
            "documents and a window the same (0.16x); prefix-LM 2.89x "
            "against 2.35x",
            _SWEEP.format("sparse_block=128|256|512").replace(
                _BENCH, "python -m benchmarks.programmable"),
        ),
        (ANY, ANY): Entry(
            128,
            "positions per block on the compilers: at T = 4096 on JAX 128 "
            "beats 256 and 512 for prefix-LM and a random mask of "
            "128-blocks (1.82x and 0.38x of causal against 2.07x and "
            "0.81x); 256 is a little faster for 16 documents and a window "
            "(0.16x, 0.40x against 0.17x, 0.48x)",
            _SWEEP.format("sparse_block=128|256|512").replace(
                _BENCH, "python -m benchmarks.programmable --lengths 4096"),
        ),
    },
    "triangular_min_length": {
        (JAX, ANY): Entry(
            1024,
            "from T = 1024 the triangle beats XLA's kernel for the causal "
            "calls the blocks do not take (a bias); at 512 they are even",
            _SWEEP.format("blocked_min_length=inf")
            + " --backends jax --lengths 512,1024,2048 --windows none",
        ),
        (ANY, ANY): Entry(
            math.inf,
            "the other backends' fused kernels are as fast: never",
            _SWEEP.format("blocked_min_length=inf,triangular_min_length=0")
            + " --lengths 1024,4096 --windows none",
        ),
    },
    # --------------------------------------------------------- block sizes
    "triangular_block": {
        (ANY, ANY): Entry(
            512,
            "queries per block: 512 beats 128 and 256 at T = 1024 and 4096",
            _SWEEP.format("blocked_min_length=inf,triangular_block=128|256|512")
            + " --backends jax --lengths 1024,4096 --windows none",
        ),
    },
    "blocked_block": {
        (ANY, ANY): Entry(
            256,
            "positions per block below `blocked_large_from`: as fast as 512 "
            "or faster at T = 1024 and 2048",
            _SWEEP.format("blocked_block=128|256|512")
            + " --backends jax,tensorflow --lengths 1024,2048 --windows none",
        ),
    },
    "blocked_large_block": {
        (ANY, ANY): Entry(
            512,
            "positions per block from `blocked_large_from`: faster than 256 "
            "and 1024 at T = 4096 and 16384",
            _SWEEP.format("blocked_large_block=256|512|1024")
            + " --backends jax,tensorflow --lengths 4096,16384 --windows none",
        ),
    },
    "blocked_large_from": {
        (ANY, ANY): Entry(
            4096,
            "the length from which the larger blocks are faster",
            _SWEEP.format("blocked_block=512")
            + " --backends jax,tensorflow --lengths 2048,4096 --windows none",
        ),
    },
    "banded_block_min": {
        (ANY, ANY): Entry(
            32,
            "the smallest query block: below 32 the per-block overhead "
            "dominates",
            _SWEEP.format("banded_block_max=16|32")
            + " --lengths 16384 --windows 16,32 --no-decode --no-features",
        ),
    },
    "banded_block_max": {
        (ANY, ANY): Entry(
            128,
            "the largest query block: a block of b reads b + ceil(left/b)·b "
            "keys for w useful ones, and 128 beats 256 and 512 at w = 512",
            _SWEEP.format("banded_block_max=128|256|512")
            + " --lengths 16384 --windows 128,512 --no-decode --no-features",
        ),
    },
    "banded_native_inference_block": {
        (TORCH, ANY): Entry(
            32,
            "torch's flash kernel never writes a block's scores: without a "
            "gradient the smallest block wastes least of the span",
            _SWEEP.format("banded_native_inference_block=16|32|64|128")
            + " --backends torch --lengths 16384 --windows 64,128,512",
        ),
    },
    "banded_chunk_bytes": {
        (ANY, ANY): Entry(
            8 * _MiB,
            "one loop step's scores in the portable band: they stay in "
            "cache and their memory is reused; 8 MiB beats 2 and 4 MiB on "
            "TensorFlow, JAX is even",
            _SWEEP.format("banded_chunk_bytes=2097152|4194304|8388608")
            + " --backends tensorflow,jax --lengths 16384 --windows 128",
        ),
    },
    "decode_block": {
        (TORCH, ANY): Entry(
            4096,
            "keys per block of a full cache in traced and portable steps: "
            "4,096 beats 1,024 late in a large cache, even early",
            _SWEEP.format("decode_block=1024|4096") + " --backends torch "
            "--decode",
        ),
        (ANY, ANY): Entry(
            1024,
            "keys per block of a full cache: larger blocks slow the early "
            "positions, smaller ones the late",
            _SWEEP.format("decode_block=512|1024|2048|4096")
            + " --backends jax,tensorflow --decode",
        ),
    },
    "decode_whole_from": {
        (JAX, ANY): Entry(
            0.4,
            "a traced one-token step past this fraction of a large full "
            "cache reads every slot in one pass: XLA copies each block the "
            "loop slices",
            _SWEEP.format("decode_whole_from=0.25|0.4|0.6")
            + " --backends jax --decode",
        ),
        (ANY, ANY): Entry(
            None,
            "never: under XLA on TensorFlow the one pass is slower than the "
            "loop",
            _SWEEP.format("decode_whole_from=0.4")
            + " --backends tensorflow --decode",
        ),
    },
    "decode_whole_runs": {
        (ANY, ANY): Entry(
            64,
            "the one pass sums its weighted values over at most this many "
            "runs of slots, which XLA fuses into the products",
            _SWEEP.format("decode_whole_runs=16|64|256")
            + " --backends jax --decode",
        ),
    },
    "decode_native_bias_limit": {
        (TORCH, ANY): Entry(
            1 << 24,
            "the native step's additive bias (K|1, G·T, S) per batch row, "
            "64 MiB at most; a larger one reads the cache in blocks",
            _BENCH + " --backends torch --decode",
        ),
    },
    "decode_chunk": {
        (TORCH, ANY): Entry(
            256,
            "slots per chunk of a long eager step (each chunk one batch row "
            "of the flash kernel): faster than 1,024 and 4,096",
            _SWEEP.format("decode_chunk=256|1024|4096")
            + " --backends torch --decode",
        ),
    },
    "decode_chunked_from": {
        (TORCH, ANY): Entry(
            32768,
            "from 32,768 slots the chunks beat one call of the kernel; at "
            "16k they are even",
            _SWEEP.format("decode_chunked_from=16384|32768")
            + " --backends torch --decode",
        ),
    },
    "capped_step_bytes": {
        (TORCH, ANY): Entry(
            2 * _MiB,
            "scores of one step of the soft-capped band without a gradient: "
            "2 MiB beats 256 KiB to 1 MiB and 4 MiB",
            _SWEEP.format("capped_step_bytes=1048576|2097152|4194304")
            + " --backends torch --features",
        ),
    },
    "capped_chunk": {
        (TORCH, ANY): Entry(
            4,
            "query blocks per step of the soft-capped band with a gradient: "
            "forward and backward, 2 and 4 beat 8",
            _SWEEP.format("capped_chunk=2|4|8") + " --backends torch --features",
        ),
    },
    "paged_row_sequence": {
        (JAX, ANY): Entry(
            False,
            "eager JAX would run each chunk's new shapes op by op, where the "
            "work items run as one compiled graph: continuous batching "
            "0.92x of the static loop with the items, 0.49x without",
            _SERVING.format(JAX),
        ),
        (ANY, ANY): Entry(
            True,
            "a one-row prefill chunk reads each key once, not its queries "
            "once per page: continuous batching 0.60x -> 0.80x of the "
            "static loop on torch, 0.60x, 0.63x -> 0.63x, 0.66x on "
            "TensorFlow",
            _SERVING.format(f"{TORCH}|{TENSORFLOW}"),
        ),
    },
    "explicit_cached_step": {
        (JAX, CPU): Entry(
            True,
            "a decoding step over a cache of one block: in a compiled loop "
            "XLA fuses the explicit softmax better than the fused kernel's",
            _SWEEP.format("explicit_cached_step=true|false")
            + " --backends jax --decode",
        ),
        (ANY, ANY): Entry(
            False,
            "the fused kernel, as keras-hub's layer runs it",
            _BENCH + " --backends tensorflow,jax,torch --decode",
        ),
    },
}

OVERRIDES = {}


def entry(name, backend=None, platform=None):
    """The table's `Entry` of setting `name` for `backend` (the active one)
    on `platform` (`device_platform()`); `OVERRIDES` is not read."""
    if name not in TABLE:
        raise ValueError(
            f"Unknown tuning setting. Expected one of {sorted(TABLE)}. "
            f"Received: name={name!r}"
        )
    backend = capabilities.backend_name(backend)
    platform = platform or device_platform()
    entries = TABLE[name]
    for key in ((backend, platform), (backend, ANY), (ANY, platform),
                (ANY, ANY)):
        if key in entries:
            return entries[key]
    raise ValueError(
        f"The tuning setting {name!r} has no value for this backend and "
        f"platform. Received: backend={backend!r}, platform={platform!r}"
    )


def value(name, like=None, backend=None, platform=None):
    """The value of setting `name`: `OVERRIDES[name]` if set, else the
    table's for `backend` (the active one) on `platform` (the one `like`,
    a tensor or `None`, sits on)."""
    if name in OVERRIDES:
        return OVERRIDES[name]
    if platform is None:
        entries = TABLE.get(name, {})
        if all(key[1] == ANY for key in entries):
            platform = ANY  # the same on every platform: no need to ask
        else:
            platform = device_platform(*(() if like is None else (like,)))
    return entry(name, backend, platform).value


def rows():
    """Every entry as `(name, backend, platform, value, reason,
    benchmark)`, in the table's order (for the docs)."""
    return [
        (name, backend, platform) + tuple(item)
        for name, entries in TABLE.items()
        for (backend, platform), item in entries.items()
    ]


# ------------------------------------------------------------------ platform

# The platforms `assume_platform` blocks assume (`overrides.held`).
_assumed = []


def assume_platform(platform):
    """Makes `device_platform` answer `platform` inside the block.

    For tests of the dispatch rule on platforms the machine lacks. It is
    read when a path is chosen: a function compiled outside the block keeps
    the path it was traced with.
    """
    return overrides.held(_assumed, "platform", platform, PLATFORMS)


# Whether this call is being traced by `torch.compile` (Dynamo): the old
# name of `capabilities.compiling_one_graph`.
torch_compiling = capabilities.compiling_one_graph


def device_platform(*tensors):
    """The platform the active backend computes on: `cpu`, `gpu` or `tpu`.

    The first of `tensors` whose device is known decides (a torch tensor's
    device, a concrete JAX array's, an eager TensorFlow tensor's); without
    one, the backend's default device (JAX's default backend, torch's
    CUDA or MPS when available, TensorFlow's visible TPUs or GPUs), cached
    per backend. `assume_platform` overrides both.
    """
    if _assumed:
        return _assumed[-1]
    backend = capabilities.backend_name()
    for x in tensors:
        found = _tensor_platform(backend, x)
        if found is not None:
            return found
    return _default_platform(backend)


def _named(device_kind):
    """A device kind as the backends name it -> one of `PLATFORMS`."""
    kind = str(device_kind).lower()
    if kind == CPU:
        return CPU
    if kind in (TPU, "xla"):
        return TPU
    return GPU


def _tensor_platform(backend, x):
    """The platform tensor `x` lives on, or `None` where it does not say."""
    kind = capabilities.device_kind(x, backend)
    return None if kind is None else _named(kind)


@functools.lru_cache(maxsize=None)
def _default_platform(backend):
    """The platform of the backend's default device, once per backend."""
    return _named(capabilities.default_device_kind(backend))


# --------------------------------------------------------------- environment


def _parse(text):
    """One value of `KERAS_MHA_TUNING`."""
    word = text.strip().lower()
    words = {"true": True, "false": False, "none": None}
    if word in words:
        return words[word]
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            pass
    raise ValueError(
        "A value of `KERAS_MHA_TUNING` must be an integer, a float, `inf`, "
        f"`true`, `false` or `none`. Received: {text!r}"
    )


def _from_environment(text):
    """`KERAS_MHA_TUNING`'s `name=value,...` as a dict, checked."""
    found = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, raw = item.partition("=")
        name = name.strip()
        if not equals or name not in TABLE:
            raise ValueError(
                "`KERAS_MHA_TUNING` takes `name=value` pairs separated by "
                f"commas, with names from {sorted(TABLE)}. "
                f"Received: KERAS_MHA_TUNING={text!r}"
            )
        found[name] = _parse(raw)
    return found


OVERRIDES.update(_from_environment(os.environ.get("KERAS_MHA_TUNING", "")))
