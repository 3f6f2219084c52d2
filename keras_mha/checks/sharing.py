"""Checks of a call that shares keys and values between layers (KV
sharing, `keras_mha.sharing`): the layer built with
`shared_key_value=True` and the call arguments `shared_key_value` and
`return_key_value`."""


import keras

from keras_mha import sharing
from keras_mha.checks.arguments import boolean
from keras_mha.checks.arguments import dims_agree
from keras_mha.checks.arguments import shape_and_dtype


def shared_key_value(layer, value):
    """The constructor's `shared_key_value`: a bool, `True` only for a
    layer whose call takes the shared keys and values."""
    value = boolean("shared_key_value", value)
    if value and not type(layer).takes_shared_key_value:
        raise ValueError(
            f"`{type(layer).__name__}` keeps keras-hub's call, which takes "
            "no shared keys and values; build a "
            "`keras_mha.MultiHeadAttention` with `shared_key_value=True`. "
            "Received: shared_key_value=True")
    return value


def key_value_source(value, shared_key_value):
    """The constructor's `key_value_source`: `None`, an index `>= 0` or a
    name, given only with `shared_key_value=True`."""
    if value is None:
        return None
    if isinstance(value, bool) or not (
            (isinstance(value, int) and value >= 0)
            or (isinstance(value, str) and value)):
        raise TypeError(
            "`key_value_source` must be `None`, a layer index >= 0 or a "
            f"layer name. Received: key_value_source={value!r}")
    if not shared_key_value:
        raise ValueError(
            "`key_value_source` names the earlier layer whose keys and "
            "values a layer built with `shared_key_value=True` reads. "
            f"Received: key_value_source={value!r}, shared_key_value="
            f"{shared_key_value!r}")
    return value


def _received(name, value):
    """How argument `name`'s `value` is named in a message: `name.shape=`
    a tensor's shape, else `name=` the value (a tuple or list by its
    length)."""
    if hasattr(value, "shape"):
        return f"{name}.shape={shape_and_dtype(value)[0]}"
    if isinstance(value, (tuple, list)):
        return f"{name}=a {type(value).__name__} of {len(value)}"
    return f"{name}={value!r}"


def shared_call(layer, *, query, value, cache, cache_update_index,
                shared_key_value, return_key_value, value_mask, key_mask,
                paged):
    """Checks the sharing arguments of a call of `layer` from shapes.

    Returns the `(B, S, E)` stand-in for the inputs a shared layer does
    not take (`value` and `key`), which the other checks read: `S` the
    shared keys' length (the new tokens' with a cache), `E` the query's
    features. `None` for a layer that projects its own.

    The cache form's shapes and index are checked by `cache_call` as a
    cache of the layer's own.
    """
    shares = layer.settings.shared_key_value
    return_key_value = boolean("return_key_value", return_key_value)
    if not shares:
        if shared_key_value is not None:
            raise ValueError(
                "`shared_key_value` is read only by a layer built with "
                "`shared_key_value=True`; this one projects its own keys "
                "and values. Received: "
                f"{_received('shared_key_value', shared_key_value)}")
        if return_key_value and (len(query.shape) != 3 or paged):
            raise ValueError(
                "`return_key_value=True` needs inputs of rank 3 (batch, "
                "sequence, features) and no paged cache. Received: "
                f"query.shape={tuple(query.shape)}, paged cache={paged}")
        return None
    if return_key_value:
        raise ValueError(
            "A layer built with `shared_key_value=True` has no keys or "
            "values of its own to return. Received: return_key_value=True")
    for name, given in (("value", value), ("cache", cache)):
        if given is not None:
            raise ValueError(
                "A layer built with `shared_key_value=True` takes no "
                f"`{name}`: it attends over `shared_key_value`, an earlier "
                "layer's keys and values (its `return_key_value=True` "
                "pair, or the cache its call returned). Received: "
                f"{_received(name, given)}")
    if len(query.shape) != 3:
        raise ValueError(
            "A layer built with `shared_key_value=True` needs a query of "
            "rank 3 (batch, sequence, features). Received: "
            f"query.shape={tuple(query.shape)}")
    if sharing.is_cache(shared_key_value):
        return _shared_cache(layer, query, shared_key_value,
                             cache_update_index, value_mask, key_mask)
    return _shared_pair(layer, query, shared_key_value, cache_update_index)


def _shared_pair(layer, query, pair, index):
    """The pair form: keys `(B, S, K, H)` and values `(B, S, K, V)` at
    positions `0 .. S - 1`."""
    settings = layer.settings
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(hasattr(part, "shape") for part in pair)):
        raise ValueError(
            "`shared_key_value` must be an earlier layer's `(keys, values)` "
            "(its call with `return_key_value=True`) or `(keys, values, "
            "valid)`, the cache its call returned. Received: "
            f"{_received('shared_key_value', pair)}")
    if index is not None:
        raise ValueError(
            "`shared_key_value=(keys, values)` holds positions 0 .. S - 1 "
            "and takes no `cache_update_index`; to decode, pass the earlier "
            "layer's cache. Received: cache_update_index="
            f"{index!r}")
    keys, values = pair
    expected = ((query.shape[0], None, settings.num_key_value_heads,
                 settings.key_dim),
                (query.shape[0], keys.shape[1], settings.num_key_value_heads,
                 settings.value_dim))
    for i, (part, want) in enumerate(zip(pair, expected)):
        shape = tuple(part.shape)
        if len(shape) != 4 or not dims_agree(shape, want):
            raise ValueError(
                "`shared_key_value` must be `(keys, values)` of shapes "
                f"(B, S, K, H) and (B, S, K, V) = {expected}. Received: "
                f"shared_key_value[{i}].shape={shape}")
    return sharing.stand_in(query, pair)


def _shared_cache(layer, query, cache, index, value_mask, key_mask):
    """The cache form: an earlier layer's cache after its call at the same
    `cache_update_index`, read and never written (`cache_call` checks it
    as a cache of the layer's own)."""
    for name, mask in (("value_mask", value_mask), ("key_mask", key_mask)):
        if mask is not None:
            raise ValueError(
                f"`{name}` is not read with a shared cache: its flags say "
                "which slots hold real tokens, as the layer that wrote it "
                f"was told. Received: {name} with shape "
                f"{shape_and_dtype(mask)[0]}")
    length = query.shape[1]
    keys = cache[0]
    num_slots = keys.shape[1] if hasattr(keys, "shape") and len(
        keys.shape) > 1 else None
    prompt = isinstance(index, int) and index == 0 and length is not None \
        and num_slots is not None and length <= num_slots
    if layer.rolling_cache and length != 1 and not prompt:
        raise ValueError(
            "A rolling cache holds the last keys only: a layer that shares "
            "it reads it one token at a time (or a first prompt within its "
            "slots). For a longer prompt pass the earlier layer's "
            "`(keys, values)` (its call with `return_key_value=True`). "
            f"Received: query.shape={tuple(query.shape)}, "
            f"cache_update_index={index!r}, {num_slots} slots")
    return keras.KerasTensor((query.shape[0], length, query.shape[-1]),
                             dtype=query.dtype)


def value_or_query(settings, query, value):
    """What stands for `value` (a tensor or a shape): `value`, or `query`
    for a layer built with `shared_key_value=True`, which takes none. A
    missing `value` of any other layer is a `ValueError`."""
    if settings.shared_key_value:
        return query
    if value is None:
        raise ValueError("`value` is required, except by a layer built with "
                         "`shared_key_value=True`. Received: value=None")
    return value
