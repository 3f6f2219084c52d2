"""Read-only properties of a layer's settings, as Keras's layers expose
theirs (`layer.num_heads`)."""


def read_only(attribute, doc=None):
    """A property that returns `self.<attribute>`."""
    return property(lambda self: getattr(self, attribute), doc=doc)
