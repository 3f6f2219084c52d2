"""Argument checking for the layers: one validator per kind of argument.

Every check runs before any backend op, from Python values, shapes and
dtypes alone, so bad input fails with a `ValueError` or `TypeError` that
names the argument and the value received (`... Received: name=value`),
also while a Functional model is built from `keras.Input`s. Where Keras's
layer has a message for the same error, its wording is included.

`arguments.py` checks constructor arguments, `inputs.py` a call's
tensors, `cache.py` a decoding call's cache and index, `paged.py` a paged
cache and a ragged call, `sharing.py` a call that reads an earlier
layer's keys and values.
"""

from keras_mha.checks.arguments import positive_int
from keras_mha.checks.arguments import positive_number
from keras_mha.checks.arguments import boolean
from keras_mha.checks.arguments import sliding_window
from keras_mha.checks.arguments import rotary_embedding
from keras_mha.checks.arguments import norm_layer
from keras_mha.checks.arguments import alibi
from keras_mha.checks.arguments import input_norm_features
from keras_mha.checks.arguments import dropout_rate
from keras_mha.checks.arguments import choice
from keras_mha.checks.arguments import head_features
from keras_mha.checks.arguments import key_value_heads
from keras_mha.checks.arguments import single_attention_axis
from keras_mha.checks.arguments import flash_attention
from keras_mha.checks.arguments import output_shape
from keras_mha.checks.arguments import attention_axes
from keras_mha.checks.arguments import shape_and_dtype
from keras_mha.checks.arguments import dims_agree
from keras_mha.checks.arguments import differential
from keras_mha.checks.inputs import argument_kinds
from keras_mha.checks.inputs import mask_argument
from keras_mha.checks.inputs import input_shapes
from keras_mha.checks.inputs import attention_bias
from keras_mha.checks.inputs import segment_ids
from keras_mha.checks.inputs import feature_arguments
from keras_mha.checks.inputs import built_inputs
from keras_mha.checks.inputs import scores_and_flash
from keras_mha.checks.inputs import call_arguments
from keras_mha.checks.inputs import programs
from keras_mha.checks.cache import cache_index
from keras_mha.checks.cache import cache_call
from keras_mha.checks.cache import cache_parts
from keras_mha.checks.cache import cache_slots
from keras_mha.checks.paged import paged_cache
from keras_mha.checks.paged import pool_shapes
from keras_mha.checks.cache import cache_tensor
from keras_mha.checks.sharing import key_value_source
from keras_mha.checks.sharing import shared_key_value
from keras_mha.checks.sharing import value_or_query

__all__ = [
    "alibi",
    "argument_kinds",
    "attention_axes",
    "attention_bias",
    "boolean",
    "built_inputs",
    "cache_call",
    "cache_index",
    "cache_parts",
    "cache_slots",
    "cache_tensor",
    "call_arguments",
    "choice",
    "differential",
    "dims_agree",
    "dropout_rate",
    "feature_arguments",
    "head_features",
    "key_value_heads",
    "key_value_source",
    "flash_attention",
    "input_norm_features",
    "input_shapes",
    "mask_argument",
    "norm_layer",
    "output_shape",
    "positive_int",
    "programs",
    "positive_number",
    "rotary_embedding",
    "scores_and_flash",
    "segment_ids",
    "shape_and_dtype",
    "shared_key_value",
    "single_attention_axis",
    "sliding_window",
    "value_or_query",
]
