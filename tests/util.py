"""Helpers shared by the test files (not tests themselves)."""

import keras
from conftest import BACKEND
import numpy as np

import keras_mha
from keras_mha.attention import AttentionSpec
from keras_mha.attention.spec import default_scale
from keras_mha.attention.spec import window_sides
from keras_mha.rope_scaling import LENGTH_DEPENDENT
from keras_mha.rope_scaling import RopeScaling
from reference import layer_weights
from reference import reference_attention

# Arguments that only keras_mha's layer takes.
OURS_ONLY = (
    "num_key_value_heads",
    "rotary_embedding",
    "scale",
    "attn_logits_soft_cap",
    "use_sinks",
    "use_alibi",
    "qk_norm",
    "qk_norm_scope",
    "qk_norm_epsilon",
    "query_temperature",
    "attention_chunk_size",
    "qk_norm_after_rope",
    "value_norm",
    "qkv_clip",
    "gate_activation",
    "alibi_before_scale",
    "shared_key_value",
    "key_value_source",
    "input_norm",
    "input_norm_scope",
    "output_norm",
    "differential",
    "differential_epsilon",
    "use_query_scale",
)


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def random_inputs(rng, batch=2, query_length=5, key_length=None, features=8):
    key_length = query_length if key_length is None else key_length
    query = rng.normal(size=(batch, query_length, features)).astype("float32")
    value = rng.normal(size=(batch, key_length, features)).astype("float32")
    return query, value


def compiled(fn):
    """`fn` under `jax.jit` on JAX and `tf.function(jit_compile=True)` on
    TensorFlow; `fn` itself elsewhere (eager)."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True)
    return fn


def make_layer(query, value, key=None, seed=0, **kwargs):
    """Our layer, built for these inputs, with random weights and biases.

    The weights come from NumPy: random initializers would compile a new
    JAX random kernel for every shape, which dominates the suite's time.
    """
    randomize = "kernel_initializer" not in kwargs
    if randomize:
        kwargs.update(kernel_initializer="zeros", bias_initializer="zeros")
    layer = keras_mha.MultiHeadAttention(**kwargs)
    key = value if key is None else key
    layer.build(query.shape, value.shape, key.shape)
    if randomize:
        rng = np.random.default_rng(seed)
        layer.set_weights(
            [
                rng.normal(scale=0.5, size=w.shape).astype("float32")
                for w in layer.get_weights()
            ]
        )
    return layer


def make_keras_twin(layer, query, value, key=None):
    """`keras.layers.MultiHeadAttention` with the same config and weights."""
    config = layer.get_config()
    for name in OURS_ONLY + ("flash_attention",):
        config.pop(name, None)
    twin = keras.layers.MultiHeadAttention.from_config(config)
    key = value if key is None else key
    twin.build(query.shape, value.shape, key.shape)
    twin.set_weights(layer.get_weights())
    return twin


def reference(layer, query, value, key=None, **kwargs):
    """The float64 reference with the layer's weights, window and features
    of current models."""
    kwargs.setdefault("sliding_window", layer.sliding_window)
    kwargs.setdefault("scale", layer.scale)
    kwargs.setdefault("soft_cap", layer.attn_logits_soft_cap)
    kwargs.setdefault("alibi", layer.use_alibi and (
        layer.scale if layer.alibi_before_scale else 1.0))
    if layer.sinks is not None:
        kwargs.setdefault("sinks", to_numpy(layer.sinks).astype("float64"))
    if layer.qk_norm is not None:
        norms = (layer.query_norm, layer.key_norm)
        weights = [
            None if norm is None else to_numpy(norm.scale).astype("float64")
            for norm in norms
        ]
        if layer.qk_norm == "layer":
            weights += [to_numpy(norm.bias).astype("float64")
                        for norm in norms]
        kwargs.setdefault(
            "qk_norm", (layer.qk_norm_scope, layer.qk_norm_epsilon, *weights)
        )
    if layer.value_norm:
        kwargs.setdefault("value_norm", layer.qk_norm_epsilon)
    kwargs.setdefault("qkv_clip", layer.qkv_clip)
    kwargs.setdefault("gate_activation", layer.gate_activation)
    kwargs.setdefault("query_temperature", layer.query_temperature)
    kwargs.setdefault("qk_norm_after_rope", layer.qk_norm_after_rope)
    kwargs.setdefault("chunk_size", layer.attention_chunk_size)
    if layer.rotary_embedding is not None:
        kwargs.setdefault(
            "rotary", rotary_reference_arguments(layer.rotary_embedding,
                                                 layer.key_dim)
        )
    if layer.input_norm is not None:
        memory_too = layer.input_norm_scope == "all"
        kwargs.setdefault("input_norm", (*norm_arguments(layer.input_norm),
                                         memory_too))
    if layer.output_norm is not None:
        kwargs.setdefault("output_norm", norm_arguments(layer.output_norm))
    if layer.query_scale is not None:
        kwargs.setdefault("query_factors",
                          to_numpy(layer.query_scale).astype("float64"))
    pairs = layer.differential_layer
    if pairs is not None:
        kwargs.setdefault("differential", (
            layer.differential, layer.differential_epsilon,
            tuple(to_numpy(getattr(pairs, name)).astype("float64")
                  for name in ("lambda_q1", "lambda_k1", "lambda_q2",
                               "lambda_k2"))))
    return reference_attention(
        layer_weights(layer), query, value, key=key, **kwargs
    )


def norm_arguments(norm):
    """`(epsilon, scale, bias)` in float64 of a Keras
    `LayerNormalization` (centered: a bias) or `RMSNormalization`."""
    f64 = lambda w: None if w is None else to_numpy(w).astype("float64")
    if isinstance(norm, keras.layers.LayerNormalization):
        bias = f64(norm.beta) if norm.center else np.zeros(norm.gamma.shape)
        return norm.epsilon, f64(norm.gamma), bias
    return norm.epsilon, f64(norm.scale), None


def rotary_reference_arguments(rotary, head_dim):
    """`reference.rotate`'s arguments for a `keras_mha.RotaryEmbedding` of
    a static rope type (the length-dependent ones have no single table):
    its float64 frequencies, which `test_rotary.py` checks against
    transformers', and cos/sin factor."""
    config = rotary.get_config()
    if config["rope_type"] in LENGTH_DEPENDENT:
        raise ValueError(
            "The reference has one table per call: it cannot follow "
            f"rope_type={config['rope_type']!r}."
        )
    d = config["rotary_dim"] or head_dim
    scaling = RopeScaling(**{
        name: config[name] for name in RopeScaling.__dataclass_fields__
    })
    return dict(
        rotary_dim=d,
        inv_freq=np.asarray(scaling.frequencies(d)),
        attention_factor=scaling.cos_sin_factor,
        interleaved=config["interleaved"],
    )


def assert_steps_equal_full_pass(layer, x, bounds):
    """`x`'s tokens `[start, stop)` for each pair of `bounds`, in order,
    through the layer's own cache, equal the full causal pass over `x`;
    returns the last cache."""
    full = to_numpy(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(x.shape[0], x.shape[1])
    outputs = []
    for start, stop in bounds:
        token = x[:, start:stop]
        out, cache = layer(token, token, use_causal_mask=True,
                           cache=cache, cache_update_index=start)
        outputs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outputs, 1), full,
                               atol=2e-5, rtol=2e-5)
    return cache


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(
        to_numpy(actual).astype("float64"), expected, atol=atol, rtol=rtol
    )


def assert_causal_path_matches(path, x, mask):
    """A causal self-attention layer forced onto `path`: with grouped heads
    and the padding `mask` `(B, T)`, the float64 reference; plain, Keras's
    layer with the same weights."""
    from keras_mha.attention import dispatch

    layer = make_layer(x, x, num_heads=4, key_dim=4, num_key_value_heads=2)
    expected, _ = reference(layer, x, x, use_causal_mask=True,
                            query_mask=mask, value_mask=mask)
    with dispatch.force_path(path):
        assert layer.attention_path(
            x.shape, x.shape, use_causal_mask=True, query_mask=True,
            value_mask=True) == path
        out = layer(x, x, use_causal_mask=True, query_mask=mask,
                    value_mask=mask)
    assert_close(out, expected)
    plain = make_layer(x, x, num_heads=2, key_dim=4)
    with dispatch.force_path(path):
        ours = plain(x, x, use_causal_mask=True)
    keras_out = make_keras_twin(plain, x, x)(x, x, use_causal_mask=True)
    assert_close(ours, to_numpy(keras_out))


def attention_spec(head, window=None, causal=False, **fields):
    """The `AttentionSpec` a layer with `key_dim=head` and
    `sliding_window=window` describes; `fields` fill the rest."""
    return AttentionSpec(
        scale=default_scale(head),
        causal=causal,
        window=window_sides(window, causal),
        **fields,
    )


def layer_gradients(layer, query, value, **kwargs):
    """`d sum(output * c) / d(query, value, *weights)`, as NumPy arrays.

    `c` is a fixed random cotangent, so no output is left out of the loss.
    """
    scores = kwargs.get("return_attention_scores", False)
    first = lambda result: result[0] if scores else result  # noqa: E731
    shape = tuple(first(layer(query, value, **kwargs)).shape)
    cotangent = np.random.default_rng(1).normal(size=shape).astype("float32")
    if BACKEND == "tensorflow":
        import tensorflow as tf

        q, v = tf.constant(query), tf.constant(value)
        weights = [w.value for w in layer.trainable_variables]
        with tf.GradientTape() as tape:
            tape.watch([q, v])
            loss = tf.reduce_sum(first(layer(q, v, **kwargs)) * cotangent)
        grads = tape.gradient(loss, [q, v, *weights])
    elif BACKEND == "torch":
        import torch

        q, v = (keras.ops.convert_to_tensor(x).requires_grad_(True)
                for x in (query, value))
        weights = [w.value for w in layer.trainable_variables]
        output = first(layer(q, v, **kwargs))
        loss = torch.sum(output * torch.as_tensor(cotangent,
                                                  device=output.device))
        grads = torch.autograd.grad(loss, [q, v, *weights])
    elif BACKEND == "jax":
        import jax

        trainable = [w.value for w in layer.trainable_variables]
        non_trainable = [w.value for w in layer.non_trainable_variables]

        def loss(trainable, q, v):
            result, _ = layer.stateless_call(
                trainable, non_trainable, q, v, **kwargs
            )
            return (first(result) * cotangent).sum()

        # One XLA compile for the whole backward pass: op by op, JAX would
        # compile every primitive of it for these shapes (minutes here).
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        grad_weights, grad_q, grad_v = grad(trainable, query, value)
        grads = [grad_q, grad_v, *grad_weights]
    else:
        raise AssertionError(f"no gradients on {BACKEND}")
    return [to_numpy(g) for g in grads]
