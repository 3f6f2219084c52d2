"""keras-mha: multi-head attention for Keras 3 on every backend.

The public names load on first use (PEP 562), so that importing a part
that needs no backend, such as the command line's parser
(`keras_mha.cli`), imports neither Keras nor a backend. Reading any public
name loads them all, which registers every layer with Keras's
serialization (`keras.saving.load_model` finds them by name). Where Keras
is already imported when this package is, they load at once, as an eager
package would: `import keras` then `import keras_mha` registers the layers
before any name is read.
"""

import importlib
import sys
import typing

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "BlockMap": "keras_mha.attention.block_maps",
    "Causal": "keras_mha.attention.rules",
    "Chunk": "keras_mha.attention.rules",
    "DenseMask": "keras_mha.attention.rules",
    "Documents": "keras_mha.attention.rules",
    "MaskFunction": "keras_mha.attention.rules",
    "Padding": "keras_mha.attention.rules",
    "PrefixLM": "keras_mha.attention.rules",
    "ScoreFunction": "keras_mha.attention.rules",
    "Window": "keras_mha.attention.rules",
    "CachedMultiHeadAttention": "keras_mha.cached",
    "ContextParallel": "keras_mha.distribution",
    "GroupedQueryAttention": "keras_mha.grouped",
    "HubAttention": "keras_mha.hub_layer",
    "MultiHeadAttention": "keras_mha.layer",
    "MultiHeadLatentAttention": "keras_mha.latent",
    "RotaryEmbedding": "keras_mha.rotary",
    "adopt": "keras_mha.hub",
    "from_keras": "keras_mha.convert",
    "from_torch": "keras_mha.convert",
    "layout_map": "keras_mha.distribution",
}

__all__ = sorted(_EXPORTS)

if typing.TYPE_CHECKING:  # for static readers: type checkers, the API docs
    from keras_mha.attention.block_maps import BlockMap
    from keras_mha.attention.rules import Causal
    from keras_mha.attention.rules import Chunk
    from keras_mha.attention.rules import DenseMask
    from keras_mha.attention.rules import Documents
    from keras_mha.attention.rules import MaskFunction
    from keras_mha.attention.rules import Padding
    from keras_mha.attention.rules import PrefixLM
    from keras_mha.attention.rules import ScoreFunction
    from keras_mha.attention.rules import Window
    from keras_mha.cached import CachedMultiHeadAttention
    from keras_mha.convert import from_keras
    from keras_mha.distribution import ContextParallel
    from keras_mha.convert import from_torch
    from keras_mha.distribution import layout_map
    from keras_mha.grouped import GroupedQueryAttention
    from keras_mha.hub_layer import HubAttention
    from keras_mha.hub import adopt
    from keras_mha.latent import MultiHeadLatentAttention
    from keras_mha.layer import MultiHeadAttention
    from keras_mha.rotary import RotaryEmbedding


def _load():
    """Imports every public name into this module's namespace."""
    names = globals()
    for name, module in _EXPORTS.items():
        names[name] = getattr(importlib.import_module(module), name)


def __getattr__(name):
    if name in _EXPORTS:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


if "keras" in sys.modules:
    _load()
