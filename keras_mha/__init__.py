"""keras-mha: multi-head attention for Keras 3 on every backend."""

from keras_mha.cached import CachedMultiHeadAttention
from keras_mha.convert import from_keras
from keras_mha.convert import from_torch
from keras_mha.distribution import layout_map
from keras_mha.grouped import GroupedQueryAttention
from keras_mha.layer import MultiHeadAttention
from keras_mha.rotary import RotaryEmbedding

__version__ = "0.1.0"

__all__ = [
    "CachedMultiHeadAttention",
    "GroupedQueryAttention",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "from_keras",
    "from_torch",
    "layout_map",
]
