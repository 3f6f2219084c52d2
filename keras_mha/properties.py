"""The layers' settings as Keras's layers expose theirs: read-only
properties (`layer.num_heads`), and the config, with the rotary embedding,
a layer, in and out of it.

An attention layer keeps its settings as one frozen value,
`layer.settings` (`keras_mha.settings`); its properties and its config
are read from it here.
"""

import keras


def read_only(attribute, doc=None):
    """A property that returns `self.<attribute>` (a dotted path reads
    through: `"_rope.truncate"`)."""
    path = attribute.split(".")

    def get(self):
        value = self
        for name in path:
            value = getattr(value, name)
        return value

    return property(get, doc=doc)


def with_read_only(*names, attribute="_{}", name="{}", **renamed):
    """A class decorator: a `read_only` property per setting.

    Args:
        *names: the settings; the property `name.format(setting)` returns
            the attribute `attribute.format(setting)`, `self._<setting>`
            by default.
        attribute: the attributes' pattern (`"settings.{}"`: the fields of
            `layer.settings`).
        name: the properties' pattern (`"_{}"`: Keras's private names).
        **renamed: `property=attribute`, for a setting kept under another
            name.
    """
    attributes = {name.format(setting): attribute.format(setting)
                  for setting in names}

    def decorate(cls):
        for prop, source in {**attributes, **renamed}.items():
            setattr(cls, prop, read_only(source))
        return cls

    return decorate


class Configured:
    """`get_config` and `from_config` of an attention layer, and its
    sublayers by name (`sublayer`).

    The config holds the class's `_config_names`, and serialized its
    `_config_objects` and `_config_layers` (the rotary embedding, the
    norms), each a field of `self.settings`, and what every attention
    layer takes (`seed`, `scale` as given, `attn_logits_soft_cap`);
    `from_config` deserializes the layers.
    """

    _config_names = ()
    # The initializers, regularizers and constraints, in Keras's order.
    _config_objects = (
        "kernel_initializer", "bias_initializer", "kernel_regularizer",
        "bias_regularizer", "activity_regularizer", "kernel_constraint",
        "bias_constraint",
    )
    _sublayers = {}  # `sublayer`'s names -> the attributes that hold them
    # The settings that are layers, serialized in the config.
    _config_layers = ("rotary_embedding",)

    def get_config(self):
        settings = self.settings
        config = {name: getattr(settings, name) for name in self._config_names}
        modules = dict(initializer=keras.initializers,
                       regularizer=keras.regularizers,
                       constraint=keras.constraints)
        for name in self._config_objects:
            module = modules[name.rpartition("_")[2]]
            config[name] = module.serialize(getattr(settings, name))
        config.update(
            {name: serialized(getattr(settings, name))
             for name in self._config_layers},
            seed=self.seed,
            scale=settings.given_scale,
            attn_logits_soft_cap=settings.attn_logits_soft_cap,
        )
        return {**super().get_config(), **config}

    @classmethod
    def from_config(cls, config):
        return cls(**with_layers(config, cls._config_layers))

    def sublayer(self, name):
        """The built sublayer `name`, or `None` where the layer has none
        (not built yet, or not configured with it).

        `MultiHeadAttention`: `"query"`, `"key"`, `"value"`, `"gate"`,
        `"output"`. `MultiHeadLatentAttention`: `"query"` (or `"query_a"`,
        `"query_norm"`, `"query_b"`), `"kv_a"`, `"kv_norm"`, `"kv_b"`,
        `"gate"`, `"output"`. A method rather than properties: Keras saves a
        sublayer under the first public attribute that holds it, and the
        saved paths stay those of Keras's layers (`_gate_dense`).
        """
        if name not in self._sublayers:
            raise ValueError(
                f"`sublayer` takes one of {', '.join(self._sublayers)}. "
                f"Received: name={name!r}"
            )
        return getattr(self, self._sublayers[name], None)


def serialized(layer):
    """A config's entry for a sublayer argument (`rotary_embedding`):
    `None`, or the layer serialized."""
    return None if layer is None else keras.saving.serialize_keras_object(
        layer)


def with_layers(config, names=("rotary_embedding",)):
    """A copy of `config` with the serialized sublayers among `names`
    deserialized, for `from_config`."""
    config = dict(config)
    for name in names:
        if isinstance(config.get(name), dict):
            config[name] = keras.saving.deserialize_keras_object(config[name])
    return config
