"""Model parallelism: a `keras.distribution.LayoutMap` for the attention heads.

Heads are independent until the output projection, so sharding the head
axis of every projection keeps each head's work on one shard: queries, keys
and values are computed, attended and mixed locally, and only the output
projection sums over the shards. This is the Megatron split of attention.

Used with `keras.distribution.ModelParallel` (JAX backend). Sharding does
not change the function: the outputs and the gradients are those of one
device.
"""

import keras

# Sublayers whose kernel is `(E, N|K, H|V)` and bias `(N|K, H|V)`: the head
# axis is the kernel's second axis and the bias's first.
_HEAD_PROJECTIONS = ("query", "key", "value", "gate")


def layout_map(device_mesh, model_axis="model", layer_name=None, into=None):
    """Layouts that shard our attention layers' heads over `model_axis`.

    The kernels of the query, key, value (and gate) projections, `(E, N, H)`
    and `(E, K, H)`, and their biases `(N, H)`, `(K, H)` are split along the
    head axis; so is the output kernel `(N, V, E)`, along its first axis. The
    output bias `(E,)` is left to the distribution's default: replicated.

    `N` and `K` must be divisible by the size of `model_axis`. The keys are
    regexes over `variable.path` and match `<layer>/query/kernel` and the
    like under any parent, so they also match `keras.layers.MultiHeadAttention`
    and `keras.layers.GroupQueryAttention`, which have the same weights. Give
    `layer_name` when other layers have sublayers named `query`, `key`,
    `value`, `gate` or `attention_output`: a variable that matches two keys of
    a `LayoutMap` is an error.

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` with an axis named
            `model_axis`.
        model_axis: the mesh axis the heads are split over.
        layer_name: a regex for the attention layers' names (the path
            component before `/query`); any name if `None`.
        into: an existing `LayoutMap` on `device_mesh` to add the layouts to;
            a new one if `None`.

    Returns:
        The `LayoutMap` (`into` if given), for
        `keras.distribution.ModelParallel(layout_map=...)`.

    Raises:
        ValueError: if `model_axis` is not an axis of `device_mesh`, or
            `into` is on another mesh.
    """
    if model_axis not in device_mesh.axis_names:
        raise ValueError(
            "`model_axis` must be an axis of `device_mesh`. Received: "
            f"model_axis={model_axis!r}, "
            f"device_mesh.axis_names={list(device_mesh.axis_names)}"
        )
    if into is None:
        into = keras.distribution.LayoutMap(device_mesh)
    elif into.device_mesh is not device_mesh:
        raise ValueError(
            "`into` must be a `LayoutMap` on `device_mesh`. Received: "
            f"into.device_mesh={into.device_mesh}, device_mesh={device_mesh}"
        )
    # `LayoutMap` full-matches its keys; the layer sits under any parents.
    prefix = f"(?:.*/)?(?:{layer_name or '[^/]+'})/"
    heads = f"(?:{'|'.join(_HEAD_PROJECTIONS)})"
    # Layouts name the leading axes only; the rest are replicated, so the
    # output kernel `(N, V, *output_shape)` needs no rank.
    into[f"{prefix}{heads}/kernel"] = (None, model_axis)  # (E, N|K, H|V)
    into[f"{prefix}{heads}/bias"] = (model_axis,)  # (N|K, H|V)
    into[f"{prefix}attention_output/kernel"] = (model_axis,)  # (N, V, E)
    return into
