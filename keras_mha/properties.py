"""The layers' settings as Keras's layers expose theirs: read-only
properties (`layer.num_heads`), and the config, with the rotary embedding,
a layer, in and out of it."""

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


def with_read_only(*names, attribute="_{}", **renamed):
    """A class decorator: a `read_only` property per setting.

    Args:
        *names: the properties; each returns the attribute
            `attribute.format(name)`, `self._<name>` by default.
        attribute: the attributes' pattern.
        **renamed: `name=attribute`, for a setting kept under another
            name.
    """

    def decorate(cls):
        attributes = {name: attribute.format(name) for name in names}
        for name, source in {**attributes, **renamed}.items():
            setattr(cls, name, read_only(source))
        return cls

    return decorate


class Configured:
    """`get_config` and `from_config` of an attention layer.

    The config holds the class's `_config_names` (each kept as
    `self._<name>`), the initializers, regularizers and constraints the
    layer has (serialized), and what every attention layer takes (`seed`,
    `rotary_embedding`, `scale` as given, `attn_logits_soft_cap`);
    `from_config` deserializes the rotary embedding.
    """

    _config_names = ()

    def get_config(self):
        config = {
            name: getattr(self, f"_{name}") for name in self._config_names
        }
        for kind, module in (
            ("initializer", keras.initializers),
            ("regularizer", keras.regularizers),
            ("constraint", keras.constraints),
        ):
            for name in ("kernel", "bias", "activity"):
                if hasattr(self, f"_{name}_{kind}"):
                    config[f"{name}_{kind}"] = module.serialize(
                        getattr(self, f"_{name}_{kind}")
                    )
        config.update(
            seed=self.seed,
            rotary_embedding=serialized(self._rotary_embedding),
            scale=self._given_scale,
            attn_logits_soft_cap=self._soft_cap,
        )
        return {**super().get_config(), **config}

    @classmethod
    def from_config(cls, config):
        return cls(**with_layers(config))


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
