"""Which attention algorithm runs: the one rule, in one place.

Every path computes the same function of the spec (see `explicit.py`);
this module answers which paths can serve a call (`can_serve`) and which
runs it (`choose_path`), from the spec, the static shapes, the backend and
the platform the tensors sit on (`tuning.device_platform`: `cpu`, `gpu`,
`tpu`). A threshold is named below by its setting in `tuning.TABLE`,
which holds its values per backend and platform (docs/paths.md shows the
table); a path named below runs only where `can_serve` says it can.

CPU (the table's numbers are measured there): the fastest path. The first
row that matches decides.

| The call | Path |
|---|---|
| every slot of a decoding cache read whole (`spec.whole_cache`: keras-hub's cache of one block), where `explicit_cached_step` says so (JAX on CPU: inside a compiled decode loop XLA fuses the explicit softmax better than the fused kernel's) | `explicit` |
| a mask object (`spec.mask_mod`), or a score function and any mask; a score function (if any) of each logit and its indices alone, reading no weight that takes a gradient (`sparse.takes_score_function`); keys at their own positions; no bias, weights or dropout; `T, S >= sparse_min_length`; not under `torch.compile` | `sparse` (other calls with a mask or score function: `fused`, or `explicit` for a score function) |
| a window or chunks; keys at their own positions (no cache, a Python-int offset); no dense mask or bias; no weights returned; `S >= banded_min_ratio·w` and `S >= banded_min_length`, `w = max(left, right) + 1` of the spec's `reach` (the window, and chunks of `C` as a window `(C - 1, C - 1)`, right 0 when causal) | `banded` |
| weights returned, or dropout | `explicit` |
| causal self-attention at `T = S >= blocked_min_length`; no window, dense mask, bias, cache, or `flash_attention=True`; on torch only what its kernel cannot take (a soft-cap) | `blocked` |
| the same with a dense bias, `T >= triangular_min_length` | `triangular` |
| anything else | `fused`; `explicit` where the kernel cannot take the call (a soft-cap; `H != V` on JAX) |

GPU and TPU (nothing measured, `follow_keras`): a call that
`keras.layers.MultiHeadAttention` would send to its fused kernel
(`keras_would_fuse`: no weights returned, no dropout, soft-cap, sinks,
ALiBi, segment ids, chunks or bias; head sizes the kernel takes) goes to that
kernel. Never `blocked` or `triangular` for it, and `banded` only where
its dense scores would not fit:

| The call Keras's layer fuses | GPU | TPU |
|---|---|---|
| a window, `(B, N, T, S)` float32 scores over `dense_scores_budget` | `banded` | `banded` |
| a window on JAX: no padding, segment or dense mask; keys at their own positions; `H = V`; `flash_attention=None`; every query with a key (`T <= S + left`) | `fused_window`: `jax.nn.dot_product_attention(local_window_size=(left, right))` (`native_window`) | `fused` |
| any other | `fused` (a window as a mask) | `fused` |

Every other call on a GPU or TPU (a feature Keras's layer lacks, weights,
dropout, `H != V` on JAX) takes the CPU's rule, with the table's values
for that backend and platform.

Under `keras_mha.ContextParallel` (`spec.sharding`), `context_route`
first picks how the sharded tokens are attended: `halo` for a window over
keys at their own positions (self-attention lengths, no dense mask or
bias, no weights or dropout), each shard then taking the rule above for
its own block; `ring` for the other calls without a dense mask, bias,
cache, weights or dropout (causal self-attention in zig-zag order);
anything else runs on the whole sequence (`None`: XLA gathers what the
call needs).

A cache (decoding) takes one of four routes (`cache_route`): `prompt`,
the tokens of a call at the Python index 0 attending to themselves on the
paths above; `slot_write`, the tokens written into their slots first and
the cache read where it lies, up to the last position (`decode.py`),
whoever owns the cache (`cache.is_in_place` decides only whether that
write is into the cache's own tensors); `concatenated`, the old slots and the new
tokens at their positions on `fused` or `explicit`; `whole_cache`,
keras-hub's cache, whose dense mask and weights span its slots, read
whole after the write on the paths above.
"""

import collections
import math
import numbers

import keras_mha.attention.cache_layouts as cache_layouts
import keras_mha.attention.capabilities as capabilities
import keras_mha.attention.fused as fused
import keras_mha.attention.overrides as overrides
import keras_mha.attention.sparse as sparse
import keras_mha.attention.tuning as tuning

FUSED = "fused"
EXPLICIT = "explicit"
BANDED = "banded"
TRIANGULAR = "triangular"
BLOCKED = "blocked"
FUSED_WINDOW = "fused_window"
SPARSE = "sparse"
PATHS = (FUSED, EXPLICIT, BANDED, TRIANGULAR, BLOCKED, FUSED_WINDOW, SPARSE)

HALO = "halo"
RING = "ring"
CONTEXT_ROUTES = (HALO, RING)

PROMPT = "prompt"
SLOT_WRITE = "slot_write"
CONCATENATED = "concatenated"
WHOLE_CACHE = "whole_cache"
CACHE_ROUTES = (PROMPT, SLOT_WRITE, CONCATENATED, WHOLE_CACHE)


class Shapes(
    collections.namedtuple(
        "Shapes",
        ["query_length", "key_length", "key_dim", "value_dim", "batch",
         "num_heads"],
        defaults=(None, None),
    )
):
    """The static sizes dispatch reads: `T`, `S` (`None` if unknown), `H`,
    `V`, and `B` and `N` (`None` if unknown: the size of the dense scores
    counts them as 1)."""

    @classmethod
    def of(cls, query, key, value):
        """From projected heads `(B, T, N, H)`, `(B, S, K, H)`, `(B, S, K, V)`."""
        return cls(query.shape[1], key.shape[1], query.shape[3], value.shape[3],
                   query.shape[0], query.shape[2])

    def dense_score_bytes(self):
        """Bytes of the `(B, N, T, S)` float32 scores, or `None` if `T` or
        `S` is unknown."""
        if self.query_length is None or self.key_length is None:
            return None
        return 4 * math.prod(
            size or 1 for size in (self.batch, self.num_heads,
                                   self.query_length, self.key_length)
        )


# The paths `force_path` blocks hold the calls to (`overrides.held`).
_forced = []


def forced_path():
    """The path `force_path` holds the calls to, or `None`."""
    return _forced[-1] if _forced else None


def force_path(path):
    """Runs every call in the block on `path` where that path can serve it.

    For tests and benchmarks that compare the paths on the same inputs. A
    call that `path` cannot serve (`can_serve`) still follows the rule.
    """
    return overrides.held(_forced, "path", path, PATHS)


def banded_pays_off(window, query_length, key_length, backend=None,
                    platform=None):
    """Whether the band `(left, right)` is small enough against `S` to
    compute it alone (`banded_min_length`, `banded_min_ratio`)."""
    if window is None or query_length is None or key_length is None:
        return False
    ratio, length = (
        tuning.value(name, backend=backend, platform=platform)
        for name in ("banded_min_ratio", "banded_min_length")
    )
    return key_length >= length and key_length >= ratio * (max(window) + 1)


def can_serve(path, spec, shapes, backend=None):
    """Whether `path` computes what `spec` asks for these shapes."""
    static = shapes.query_length is not None and shapes.key_length is not None
    if path == EXPLICIT:
        return True
    if path == FUSED:
        return (
            not spec.return_weights
            and not spec.dropout
            and spec.soft_cap is None
            and spec.score_mod is None
            and fused.supported(shapes.key_dim, shapes.value_dim, backend)
        )
    if path == SPARSE:
        return (
            (spec.mask_mod is not None
             or (spec.score_mod is not None and spec.masked))
            and static
            and spec.keys_at_own_positions
            and spec.bias is None
            and not spec.return_weights
            and not spec.dropout
            # Its loops' trip counts are data: Dynamo would specialize.
            and not capabilities.compiling_one_graph()
            and (spec.score_mod is None or sparse.takes_score_function(
                spec.score_mod, shapes.num_heads or 1))
        )
    if spec.programmed:  # the paths below know only the spec's own masks
        return False
    if path == BANDED:
        return (
            spec.reach is not None
            and static
            and spec.key_positions is None
            and spec.static_offset is not None
            and spec.attention_mask is None
            and spec.bias is None
            and not spec.return_weights
        )
    if path == BLOCKED:
        return _causal_self_blocks(spec, shapes, static) and spec.bias is None
    if path == TRIANGULAR:
        return _causal_self_blocks(spec, shapes, static)
    if path == FUSED_WINDOW:
        return (
            capabilities.fused_takes_window(backend)
            and spec.window is not None
            and spec.chunk is None
            and static
            and spec.keys_at_own_positions
            and not spec.has_token_masks
            and spec.attention_mask is None
            and spec.flash_attention is None
            and keras_would_fuse(spec, shapes, backend)
            and shapes.key_dim == shapes.value_dim
            # Every query has a key: JAX's kernel has no rule for a row
            # without one.
            and 0 < shapes.query_length <= shapes.key_length + spec.window[0]
        )
    raise ValueError(f"`path` must be one of {PATHS}. Received: path={path!r}")


def keras_would_fuse(spec, shapes, backend=None):
    """Whether `keras.layers.MultiHeadAttention` would send this call to
    its fused kernel: no weights returned, no dropout, none of the
    features its layer lacks (soft-cap, sinks, ALiBi, segment ids, a
    bias, chunks), head sizes the kernel takes."""
    return (
        can_serve(FUSED, spec, shapes, backend)
        and not spec.programmed
        and spec.bias is None
        and spec.sinks is None
        and spec.alibi is None
        and spec.segment_ids is None
        and spec.chunk is None
    )


def _causal_self_blocks(spec, shapes, static):
    """What `blocked` and `triangular` both need: causal self-attention
    without a window, dense mask, cache, weights or dropout, at static
    `T = S`, and no demand for the fused kernel's flash attention."""
    return (
        spec.causal
        and spec.window is None
        and static
        and shapes.query_length == shapes.key_length
        and spec.keys_at_own_positions
        and spec.attention_mask is None
        and not spec.return_weights
        and not spec.dropout
        and spec.flash_attention is not True
    )


def choose_path(spec, shapes, backend=None, platform=None):
    """The name of the path that runs `spec` at these shapes.

    Args:
        spec: the call's `AttentionSpec`.
        shapes: its `Shapes`.
        backend: backend name; the active one by default.
        platform: `"cpu"`, `"gpu"` or `"tpu"`; by default
            `tuning.device_platform()` (`attend` passes the queries').
    """
    backend = capabilities.backend_name(backend)
    platform = platform or tuning.device_platform()
    forced = forced_path()
    if forced is not None and can_serve(forced, spec, shapes, backend):
        return forced

    def setting(name):
        return tuning.value(name, backend=backend, platform=platform)

    if spec.whole_cache and setting("explicit_cached_step"):
        return EXPLICIT
    if (
        None not in (shapes.query_length, shapes.key_length)
        and min(shapes.query_length, shapes.key_length)
        >= setting("sparse_min_length")
        and can_serve(SPARSE, spec, shapes, backend)  # may probe `score_mod`
    ):
        return SPARSE
    if setting("follow_keras") and keras_would_fuse(spec, shapes, backend):
        return _as_keras(spec, shapes, backend, setting)
    if can_serve(BANDED, spec, shapes, backend) and banded_pays_off(
        spec.reach, shapes.query_length, shapes.key_length, backend, platform
    ):
        return BANDED
    if spec.return_weights or spec.dropout:
        return EXPLICIT
    if (
        can_serve(BLOCKED, spec, shapes, backend)
        and shapes.query_length >= setting("blocked_min_length")
        and (capabilities.fused_writes_scores(backend)
             or not can_serve(FUSED, spec, shapes, backend))
    ):
        return BLOCKED
    if (
        can_serve(TRIANGULAR, spec, shapes, backend)
        and shapes.query_length >= setting("triangular_min_length")
    ):
        return TRIANGULAR
    return FUSED if can_serve(FUSED, spec, shapes, backend) else EXPLICIT


def _as_keras(spec, shapes, backend, setting):
    """The path of a call Keras's layer fuses, on a platform where nothing
    was measured: its fused kernel, with the backend's own window where it
    has one; the band only where the dense scores would not fit."""
    if spec.window is not None:
        size = shapes.dense_score_bytes()
        if (
            size is not None
            and size > setting("dense_scores_budget")
            and can_serve(BANDED, spec, shapes, backend)
        ):
            return BANDED
        if setting("native_window") and can_serve(
            FUSED_WINDOW, spec, shapes, backend
        ):
            return FUSED_WINDOW
    return FUSED


def cache_route(spec, query_length, index, rolling,
                layout=cache_layouts.FLAGGED, num_slots=None,
                computed=False):
    """Which route a call with a cache takes: one of `CACHE_ROUTES`.

    Args:
        spec: the call's spec, before the cache's positions are added.
        query_length: `T`, the new tokens.
        index: `cache_update_index` (a Python int or a tensor).
        rolling: whether the cache is a rolling buffer.
        layout: the cache's layout (`cache_layouts.LAYOUTS`). keras-hub's
            (`"pair"`) has no `prompt` or `concatenated` route: its dense
            mask and its weights span its slots, so a call that does not
            write and read its slots (`slot_write`) reads them whole after
            the write (`whole_cache`): with weights or dropout, and for a
            cache of `num_slots` within one block (`decode_block`), which
            the step's loop would read whole anyway and keras-hub's layer
            reads with one product.
        num_slots: `L`, read for keras-hub's cache.
        computed: whether the keys are computed from the cache's entries
            (the latent cache, expanded): such a cache is never read where
            it lies (`concatenated`, after a prompt).
    """
    if layout == cache_layouts.PAIR:
        whole = spec.return_weights or spec.dropout or spec.programmed or (
            num_slots <= tuning.value("decode_block"))
        return WHOLE_CACHE if whole else SLOT_WRITE
    if spec.return_weights:  # weights over the old slots and the new tokens
        return CONCATENATED
    if isinstance(index, numbers.Integral) and index == 0:
        return PROMPT
    if spec.dropout or (rolling and query_length != 1) or computed or \
            spec.programmed:
        return CONCATENATED
    return SLOT_WRITE


def context_route(spec, shapes):
    """How a call under `ContextParallel` is attended: one of
    `CONTEXT_ROUTES`, or `None` (the whole sequence, as without one)."""
    if spec.sharding is None:
        return None
    if not (
        spec.keys_at_own_positions
        and not spec.programmed
        and spec.attention_mask is None
        and spec.bias is None
        and not spec.return_weights
        and not spec.dropout
    ):
        return None
    self_attention = shapes.query_length == shapes.key_length
    if spec.chunk is not None:
        # Chunks that no shard boundary cuts (`C` divides `T / P`): each
        # shard attends to its own tokens, a halo of none. Others: whole.
        shard, rest = divmod(shapes.query_length or 0, spec.sharding.size)
        aligned = self_attention and not rest and shard % spec.chunk == 0
        return HALO if aligned else None
    if spec.window is not None and self_attention:
        return HALO
    return RING
