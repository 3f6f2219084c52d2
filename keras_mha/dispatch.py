"""Which attention algorithm runs: the one rule, in one place.

The paths compute the same function (see `attention.py` and `banded.py`);
this module only decides which is cheapest for what the call asks for.

1. `explicit` when the weights are returned (`return_attention_scores=True`)
   or dropped out in training without a band that pays off (rule 2). Also
   when `H != V` on JAX, whose fused kernel requires equal head sizes.
2. `banded` when a `sliding_window` is set, no dense `attention_mask` is
   given, no scores are returned (dropout is fine: the band drops its own
   weights), and the keys are long compared with the window:
   `S >= BANDED_MIN_RATIO * w` (and `S >= BANDED_MIN_LENGTH`). Below that
   the band covers most of the `T x S` matrix and the fused kernel wins.
3. `triangular` on JAX for causal self-attention without a window (nor a
   dense `attention_mask`) once `T = S >= TRIANGULAR_MIN_LENGTH`: blocks
   of queries over the keys up to their position skip the upper triangle,
   and beat JAX's CPU kernel, which computes the whole `T x T` matrix
   (`attention.triangular_attention`). Not when `flash_attention=True`.
4. `fused` (`keras.ops.dot_product_attention`) otherwise.

A cache (decoding) runs the fused or explicit path over the cached slots.
"""

import contextlib
import contextvars

import keras

FUSED = "fused"
EXPLICIT = "explicit"
BANDED = "banded"
TRIANGULAR = "triangular"
PATHS = (FUSED, EXPLICIT, BANDED, TRIANGULAR)

# Measured on a 2-core CPU (see the README's benchmark): the banded path
# wins once the keys span a few windows.
BANDED_MIN_RATIO = 4
BANDED_MIN_LENGTH = 256
# Measured on a 2-core CPU (JAX, N = 8, H = 64): at T = 1024 the triangle
# took a third of the fused kernel's time, at T = 512 they were even.
TRIANGULAR_MIN_LENGTH = 1024
TRIANGULAR_BACKENDS = ("jax",)


def fused_supported(key_dim, value_dim, backend=None):
    """Whether `keras.ops.dot_product_attention` takes these head sizes."""
    backend = backend or keras.backend.backend()
    return key_dim == value_dim or backend != "jax"


_forced = contextvars.ContextVar("keras_mha_forced_path", default=None)


@contextlib.contextmanager
def force_path(path):
    """Runs every call in the block on `path` where that path can serve it.

    For tests and benchmarks that compare the paths on the same inputs. A
    path that cannot serve a call (fused with scores, banded without a
    window or with a dense mask, triangular unless causal self-attention
    without a window) still falls back to the rule.
    """
    if path not in PATHS:
        raise ValueError(f"`path` must be one of {PATHS}. Received: path={path!r}")
    token = _forced.set(path)
    try:
        yield
    finally:
        _forced.reset(token)


def banded_pays_off(sliding_window, query_length, key_length):
    """Whether the band is small enough against `S` to compute it alone."""
    return (
        sliding_window is not None
        and query_length is not None
        and key_length is not None
        and key_length >= BANDED_MIN_LENGTH
        and key_length >= BANDED_MIN_RATIO * sliding_window
    )


def choose_path(
    *,
    return_attention_scores,
    dropout_active,
    key_dim,
    value_dim,
    sliding_window=None,
    query_length=None,
    key_length=None,
    has_attention_mask=False,
    causal=False,
    flash_attention=None,
    backend=None,
):
    """Returns the name of the attention path for one call.

    Args:
        return_attention_scores: whether the caller wants the weights.
        dropout_active: whether dropout is applied to the weights.
        key_dim: `H`.
        value_dim: `V`.
        sliding_window: `w` or `None`.
        query_length: `T`, if known statically.
        key_length: `S`, if known statically.
        has_attention_mask: whether a dense `attention_mask` is given.
        causal: whether `use_causal_mask=True`.
        flash_attention: the layer's `flash_attention` (`True` = only the
            fused kernel will do).
        backend: backend name; the active one by default.
    """
    needs_weights = return_attention_scores or dropout_active
    banded_possible = (
        not return_attention_scores
        and not has_attention_mask
        and sliding_window is not None
        and query_length is not None
        and key_length is not None
    )
    fused_possible = not needs_weights and fused_supported(
        key_dim, value_dim, backend
    )
    triangular_possible = (
        not needs_weights
        and not has_attention_mask
        and causal
        and sliding_window is None
        and flash_attention is not True
        and query_length is not None
        and query_length == key_length
    )
    forced = _forced.get()
    if (
        forced == EXPLICIT
        or (forced == BANDED and banded_possible)
        or (forced == TRIANGULAR and triangular_possible)
    ):
        return forced
    if forced == FUSED and fused_possible:
        return FUSED
    if banded_possible and banded_pays_off(
        sliding_window, query_length, key_length
    ):
        return BANDED
    if needs_weights:
        return EXPLICIT
    if (
        triangular_possible
        and (backend or keras.backend.backend()) in TRIANGULAR_BACKENDS
        and query_length >= TRIANGULAR_MIN_LENGTH
    ):
        return TRIANGULAR
    return FUSED if fused_possible else EXPLICIT
