"""`keras_mha.GroupedQueryAttention`: `MultiHeadAttention` under the
constructor and config of `keras.layers.GroupQueryAttention`."""

import keras

from keras_mha import checks
from keras_mha import properties
from keras_mha.layer import MultiHeadAttention

_MHA_ONLY_ARGUMENTS = (
    "num_heads",
    "key_dim",
    "value_dim",
    "output_shape",
    "attention_axes",
)


@keras.saving.register_keras_serializable(package="keras_mha")
class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention, a drop-in for `keras.layers.GroupQueryAttention`.

    `MultiHeadAttention` with `num_key_value_heads` under the constructor and
    config of Keras's layer, whose weights copy both ways
    (`set_weights(keras_layer.get_weights())`). Registered as
    `keras_mha>GroupedQueryAttention`. `num_heads`, `key_dim`, `value_dim`,
    `output_shape` and `attention_axes` are refused (`ValueError`): Keras's
    config has no place for them. The properties `head_dim` and
    `num_query_heads` come with it; the call, its results, `init_cache` and
    `attention_path` are `MultiHeadAttention`'s, for rank-3 inputs.

    Args:
        head_dim: `H = V`, the size of each head.
        num_query_heads: `N`.
        num_key_value_heads: `K`; must divide `num_query_heads`.
        dropout, use_bias, sliding_window, flash_attention: as for
            `MultiHeadAttention`, and so are the initializers, the
            regularizers, the constraints, `use_gate` and `seed`.
        **kwargs: base layer arguments, and the features of current
            models (`rotary_embedding`, `scale`, `attn_logits_soft_cap`,
            `use_sinks`, `use_alibi`, `qk_norm`, `qk_norm_scope`,
            `qk_norm_epsilon`, `query_temperature`), as for
            `MultiHeadAttention`.
    """

    def __init__(
        self,
        head_dim,
        num_query_heads,
        num_key_value_heads,
        dropout=0.0,
        use_bias=True,
        sliding_window=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate=False,
        seed=None,
        **kwargs,
    ):
        head_dim = checks.positive_int("head_dim", head_dim)
        num_query_heads = checks.positive_int(
            "num_query_heads", num_query_heads
        )
        num_key_value_heads = checks.positive_int(
            "num_key_value_heads", num_key_value_heads
        )
        if num_query_heads % num_key_value_heads:
            raise ValueError(
                "`num_key_value_heads` must divide `num_query_heads`. "
                f"Received: num_query_heads={num_query_heads}, "
                f"num_key_value_heads={num_key_value_heads}"
            )
        # `MultiHeadAttention`'s own arguments would be lost by `get_config`.
        foreign = {k: kwargs[k] for k in _MHA_ONLY_ARGUMENTS if k in kwargs}
        if foreign:
            received = ", ".join(f"{k}={v!r}" for k, v in foreign.items())
            raise ValueError(
                "`GroupedQueryAttention` does not take "
                f"{', '.join(f'`{k}`' for k in foreign)} (use "
                f"`MultiHeadAttention`). Received: {received}"
            )
        super().__init__(
            num_heads=num_query_heads,
            key_dim=head_dim,
            num_key_value_heads=num_key_value_heads,
            dropout=dropout,
            use_bias=use_bias,
            sliding_window=sliding_window,
            flash_attention=flash_attention,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            use_gate=use_gate,
            seed=seed,
            **kwargs,
        )

    head_dim = properties.read_only("settings.key_dim")
    num_query_heads = properties.read_only("settings.num_heads")

    # Keras's `GroupQueryAttention` spells its equations with the queries
    # first and the key/value heads repeated to `N` (`u`); its scale is
    # `_inverse_sqrt_head_dim`. Same meaning here (rank-3 inputs).
    _dot_product_equation = "bquh,bkuh->buqk"
    _combine_equation = "buqk,bkuh->bquh"

    @property
    def _inverse_sqrt_head_dim(self):
        """Keras's logit scale: here `scale` (`1 / sqrt(head_dim)` if
        unset)."""
        return self.settings.scale

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        """As Keras's `GroupQueryAttention`: the query's shape; the query's
        and the value's feature sizes must be equal, and so must every
        other axis of `value` and `key` but the last."""
        if query_shape[-1] != value_shape[-1]:
            raise ValueError(
                "The last dimension of `query_shape` and `value_shape` "
                f"must be equal, but are {query_shape[-1]}, "
                f"{value_shape[-1]}. Received: query_shape={query_shape}, "
                f"value_shape={value_shape}"
            )
        return super().compute_output_shape(query_shape, value_shape, key_shape)

    def get_config(self):
        config = super().get_config()
        for name in _MHA_ONLY_ARGUMENTS:
            config.pop(name)
        config.update(head_dim=self.settings.key_dim,
                      num_query_heads=self.settings.num_heads)
        return config
