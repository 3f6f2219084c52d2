"""The layers' settings as Keras's layers expose theirs: read-only
properties (`layer.num_heads`), and the rotary embedding, a layer, in and
out of a config."""

import keras


def read_only(attribute, doc=None):
    """A property that returns `self.<attribute>`."""
    return property(lambda self: getattr(self, attribute), doc=doc)


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
