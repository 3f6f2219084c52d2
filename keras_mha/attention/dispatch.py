"""Which attention algorithm runs: the one rule, in one place.

Every path computes the same function of the spec (see `explicit.py`);
this module answers which paths can serve a call (`can_serve`) and which
is cheapest (`choose_path`). The numbers are entries of the tuning table
(`tuning.py`), looked up for the backend and the platform:

1. `banded` when a window is set, the keys sit at their own positions (no
   cache; the queries' offset is a Python int), no dense `attention_mask`
   or `attention_bias` is given, no weights are returned (dropout,
   soft-cap, sinks, ALiBi and segment ids are fine: the band computes them
   block by block), and the keys are long
   compared with the window: `S >= banded_min_ratio * w` and
   `S >= banded_min_length`, `w = max(left, right) + 1`. Below that the
   band covers most of the `T x S` matrix and the fused kernel wins.
2. `explicit` when the weights are returned or dropped out.
3. `blocked` for causal self-attention without a window, dense mask or
   bias, or cache once `T = S` reaches the backend's
   `blocked_min_length`: an online softmax over the key blocks up to each
   query block, in O(T) memory forward and backward, where the backends'
   CPU kernels (JAX, TensorFlow) write the whole `T x T` scores. On torch,
   whose CPU kernel never writes the scores, only for what that kernel
   cannot take (a soft-cap). Not when `flash_attention=True`.
4. `triangular` on JAX for what `blocked` does not take (a dense bias)
   once `T = S >= triangular_min_length`: blocks of queries over the keys
   up to their position skip the upper triangle.
5. `fused` (`keras.ops.dot_product_attention`) otherwise, or `explicit`
   where the fused kernel does not take the head sizes (`H != V` on JAX)
   or the call has a soft-cap (the kernels have it only on TPUs).

A cache (decoding) takes one of three routes (`cache_route`): `prompt`,
the tokens of a call at the Python index 0 attending to themselves on the
paths above; `in_place`, the tokens written first and the cache read up to
the last position (`decode.py`); `concatenated`, the old slots and the new
tokens at their positions on `fused` or `explicit`.
"""

import collections
import contextlib
import contextvars
import numbers

import keras

import keras_mha.attention.fused as fused
import keras_mha.attention.tuning as tuning

FUSED = "fused"
EXPLICIT = "explicit"
BANDED = "banded"
TRIANGULAR = "triangular"
BLOCKED = "blocked"
PATHS = (FUSED, EXPLICIT, BANDED, TRIANGULAR, BLOCKED)

PROMPT = "prompt"
IN_PLACE = "in_place"
CONCATENATED = "concatenated"
CACHE_ROUTES = (PROMPT, IN_PLACE, CONCATENATED)


class Shapes(
    collections.namedtuple(
        "Shapes", ["query_length", "key_length", "key_dim", "value_dim"]
    )
):
    """The static sizes dispatch reads: `T`, `S` (`None` if unknown), `H`,
    `V`."""

    @classmethod
    def of(cls, query, key, value):
        """From projected heads `(B, T, N, H)`, `(B, S, K, H)`, `(B, S, K, V)`."""
        return cls(query.shape[1], key.shape[1], query.shape[3], value.shape[3])


_forced = contextvars.ContextVar("keras_mha_forced_path", default=None)


def forced_path():
    """The path `force_path` holds the calls to, or `None`."""
    return _forced.get()


@contextlib.contextmanager
def force_path(path):
    """Runs every call in the block on `path` where that path can serve it.

    For tests and benchmarks that compare the paths on the same inputs. A
    call that `path` cannot serve (`can_serve`) still follows the rule.
    """
    if path not in PATHS:
        raise ValueError(f"`path` must be one of {PATHS}. Received: path={path!r}")
    token = _forced.set(path)
    try:
        yield
    finally:
        _forced.reset(token)


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
            and fused.supported(shapes.key_dim, shapes.value_dim, backend)
        )
    if path == BANDED:
        return (
            spec.window is not None
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
    raise ValueError(f"`path` must be one of {PATHS}. Received: path={path!r}")


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
    backend = backend or keras.backend.backend()
    platform = platform or tuning.device_platform()
    forced = _forced.get()
    if forced is not None and can_serve(forced, spec, shapes, backend):
        return forced

    def setting(name):
        return tuning.value(name, backend=backend, platform=platform)

    if can_serve(BANDED, spec, shapes, backend) and banded_pays_off(
        spec.window, shapes.query_length, shapes.key_length, backend, platform
    ):
        return BANDED
    if spec.return_weights or spec.dropout:
        return EXPLICIT
    if (
        can_serve(BLOCKED, spec, shapes, backend)
        and shapes.query_length >= setting("blocked_min_length")
        and (backend != "torch" or not can_serve(FUSED, spec, shapes, backend))
    ):
        return BLOCKED
    if (
        can_serve(TRIANGULAR, spec, shapes, backend)
        and shapes.query_length >= setting("triangular_min_length")
    ):
        return TRIANGULAR
    return FUSED if can_serve(FUSED, spec, shapes, backend) else EXPLICIT


def cache_route(spec, query_length, index, rolling):
    """Which route a call with a cache takes: one of `CACHE_ROUTES`.

    Args:
        spec: the call's spec, before the cache's positions are added.
        query_length: `T`, the new tokens.
        index: `cache_update_index` (a Python int or a tensor).
        rolling: whether the cache is a rolling buffer.
    """
    if spec.return_weights:  # weights over the old slots and the new tokens
        return CONCATENATED
    if isinstance(index, numbers.Integral) and index == 0:
        return PROMPT
    if spec.dropout or (rolling and query_length != 1):
        return CONCATENATED
    return IN_PLACE
