"""Attention over many devices: the heads sharded (`layout_map`), or the
tokens of one sequence (`ContextParallel`).

`layout_map` is a `keras.distribution.LayoutMap` for the attention heads.
Heads are independent until the output projection, so sharding the head
axis of every projection keeps each head's work on one shard: queries, keys
and values are computed, attended and mixed locally, and only the output
projection sums over the shards. This is the Megatron split of attention,
used with `keras.distribution.ModelParallel`.

`ContextParallel` is a distribution that shards the tokens of one sequence
over a context axis; the layers read it (`context_plan`) and attend on the
routes of `keras_mha/attention/sharded.py`.

Both run on the JAX backend, and neither changes the function: the outputs
and the gradients are those of one device.
"""

import keras

import keras_mha.attention.capabilities as capabilities

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
    _check_axis(device_mesh, "model_axis", model_axis)
    into = _layout_map_on(device_mesh, "into", into)
    # `LayoutMap` full-matches its keys; the layer sits under any parents.
    prefix = f"(?:.*/)?(?:{layer_name or '[^/]+'})/"
    head_projections = f"(?:{'|'.join(_HEAD_PROJECTIONS)})"
    # Layouts name the leading axes only; the rest are replicated, so the
    # output kernel `(N, V, *output_shape)` needs no rank.
    # (E, N|K, H|V)
    into[f"{prefix}{head_projections}/kernel"] = (None, model_axis)
    into[f"{prefix}{head_projections}/bias"] = (model_axis,)  # (N|K, H|V)
    into[f"{prefix}attention_output/kernel"] = (model_axis,)  # (N, V, E)
    return into


def _check_axis(device_mesh, argument, name):
    """A `ValueError` unless `name` (the argument `argument`) is an axis of
    `device_mesh`."""
    names = list(device_mesh.axis_names)
    if name not in names:
        raise ValueError(
            f"`{argument}` must be an axis of `device_mesh`. Received: "
            f"{argument}={name!r}, device_mesh.axis_names={names}"
        )


def _layout_map_on(device_mesh, argument, layout_map):
    """`layout_map` (the argument `argument`), a `LayoutMap` on
    `device_mesh`, or a new one for `None`."""
    if layout_map is None:
        return keras.distribution.LayoutMap(device_mesh)
    if layout_map.device_mesh is not device_mesh:
        raise ValueError(
            f"`{argument}` must be a `LayoutMap` on `device_mesh`. Received: "
            f"{argument}.device_mesh={layout_map.device_mesh}, "
            f"device_mesh={device_mesh}"
        )
    return layout_map


class ContextParallel(keras.distribution.ModelParallel):
    """Context parallelism: one sequence sharded over devices (JAX).

    The data layout shards inputs `(B, T, ...)` over `batch_dim_name` on
    axis 0 and `context_dim_name` on axis 1, so each device holds `T / P`
    tokens of every activation (`P`, the size of the context axis).
    Token-wise layers (dense, norms, embeddings) need no communication;
    our attention layers read the active distribution and exchange only
    what attention needs (see the docs' "Scaling out"):

    - a sliding window `(left, right)` receives the `left` keys and values
      before each shard and the `right` after it from its neighbours (a
      halo, O(w) per device whatever `T` is), then attends locally;
    - other calls without a dense mask or bias pass key/value blocks
      around a ring with an online softmax; causal self-attention is laid
      out in zig-zag order inside the layer, so every device does the same
      work (the caller still sees tokens in their natural order);
    - a decoding cache from `init_cache` under the distribution has its
      slots sharded over the context axis (a full or rolling cache, or a
      latent cache, whose slots `P` divides), and each step merges the
      devices' partial results by their log-sum-exps;
    - chunked attention whose chunks `T / P` holds whole attends on each
      device alone: no chunk crosses a shard;
    - calls none of these serve (returned weights, dropout, a dense mask
      or bias, chunks that shard boundaries cut) run on the whole
      sequence, which XLA gathers.

    Positions stay global: masks, windows, rotary angles and ALiBi use each
    token's absolute position, whichever device holds it. Outputs and
    gradients are those of one device. Variables follow `layout_map`
    (`keras_mha.layout_map` shards heads over a third mesh axis) and are
    replicated otherwise.

    Keras's distribution API runs on JAX only: a layer called under this
    distribution on another backend raises `NotImplementedError`.

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` with the axes
            `batch_dim_name` and `context_dim_name` (and any others the
            `layout_map` uses).
        context_dim_name: the mesh axis the sequence is sharded over.
        batch_dim_name: the mesh axis the batch is sharded over.
        layout_map: a `keras.distribution.LayoutMap` on `device_mesh` for
            the variables; every variable is replicated if `None`.

    Raises:
        ValueError: if an axis name is not in `device_mesh`, the two names
            are the same, or `layout_map` is on another mesh; when called,
            if `P` does not divide a sequence length (`2P` for causal
            self-attention, which runs in zig-zag order).
    """

    def __init__(self, device_mesh, context_dim_name="context",
                 batch_dim_name="batch", layout_map=None):
        _check_axis(device_mesh, "context_dim_name", context_dim_name)
        _check_axis(device_mesh, "batch_dim_name", batch_dim_name)
        if context_dim_name == batch_dim_name:
            raise ValueError(
                "`context_dim_name` and `batch_dim_name` must differ. "
                f"Received: context_dim_name={context_dim_name!r}, "
                f"batch_dim_name={batch_dim_name!r}"
            )
        layout_map = _layout_map_on(device_mesh, "layout_map", layout_map)
        super().__init__(layout_map=layout_map, batch_dim_name=batch_dim_name)
        self._context_dim_name = context_dim_name

    @property
    def context_dim_name(self):
        """The mesh axis the sequence is sharded over."""
        return self._context_dim_name

    @property
    def context_size(self):
        """`P`, the number of shards of the sequence."""
        mesh = self.device_mesh
        return mesh.shape[list(mesh.axis_names).index(self._context_dim_name)]

    def get_data_layout(self, data_shape):
        """Axis 0 over the batch axis; axis 1 over the context axis when
        the data has one that the context axis divides."""
        axes = [None] * len(data_shape)
        axes[0] = self.batch_dim_name
        if len(data_shape) >= 2 and data_shape[1] is not None and (
            data_shape[1] % self.context_size == 0
        ):
            axes[1] = self._context_dim_name
        return keras.distribution.TensorLayout(axes, self.device_mesh)


def context_plan():
    """The active `ContextParallel`'s plan for attention, or `None`.

    Raises:
        NotImplementedError: under a `ContextParallel` on a backend other
            than JAX.
    """
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, ContextParallel):
        return None
    if not capabilities.has_distribution_api():
        raise NotImplementedError(
            "`keras_mha.ContextParallel` runs on the JAX backend only: "
            "Keras's distribution API is JAX-only. Received: "
            f"backend={capabilities.backend_name()!r}"
        )
    from keras_mha.attention.sharded import ContextPlan

    return ContextPlan(
        mesh=distribution.device_mesh.backend_mesh,
        batch_axis=distribution.batch_dim_name,
        context_axis=distribution.context_dim_name,
        size=distribution.context_size,
    )


def shard_cache(cache):
    """A new decoding cache laid out for the active distribution.

    Under a `ContextParallel`, a cache (full or rolling, of keys and values
    or of latents) whose slots the context axis divides is sharded like
    the tokens: `(B, L, ...)` over the batch and context axes, so each
    device holds `L / P` slots. Otherwise `cache` itself.
    """
    distribution = keras.distribution.distribution()
    if (
        not isinstance(distribution, ContextParallel)
        or not capabilities.has_distribution_api()
        or cache[0].shape[1] % distribution.context_size
    ):
        return cache
    return tuple(
        keras.distribution.distribute_tensor(
            part, distribution.get_data_layout(part.shape)
        )
        for part in cache
    )
