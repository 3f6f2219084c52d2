"""The cache methods of `keras_mha.MultiHeadAttention`: `init_cache`,
`init_paged_cache` and `rolling_cache`, read from `layer.settings`."""

from keras_mha import checks
from keras_mha import distribution as distribution_lib
from keras_mha import serving
from keras_mha.attention import cache as cache_lib
from keras_mha.attention import paged as paged_lib


class CacheMethods:
    """The caches a `MultiHeadAttention` (or a subclass) makes."""

    @property
    def rolling_cache(self):
        """Whether `init_cache` makes a rolling buffer (a window, chunks)."""
        return self.settings.rolling_slots is not None

    def init_cache(self, batch_size, max_length, in_place=False,
                   quantize=None):
        """A zero key/value cache for decoding up to `max_length` tokens.

        Args:
            batch_size: `B`.
            max_length: the longest sequence to decode. With a
                `sliding_window` or chunks the cache is a rolling buffer of
                `w` (or `C`) slots whatever `max_length` is.
            in_place: whether calls may write into this cache's own
                tensors (see below). `False` (the default): the caller
                owns the cache.
            quantize: `None`, or `"int8"` / `"float8_e4m3fn"`: keys and
                values stored quantized with one float32 scale per token
                and key/value head, in pages (a
                `keras_mha.attention.paged.PagedRows`, docs/serving.md).
                Such a cache takes no token masks.

        Returns:
            `(keys, values, valid)` (see `keras_mha.attention.cache`):
            `keys` `(B, L, K, H)` and `values` `(B, L, K, V)` in the
            layer's compute dtype, `valid` `(B, L)` boolean, true in the
            slots where a real (unpadded) token was written. `L` is
            `max_length`, or when rolling `left + 1` (`w`) or `C`, the
            fewer. A call returns a cache of the same structure (sharded
            under `ContextParallel`).

        By default a call never deletes, donates or writes into the cache
        it is given: it returns a new one, as Keras and keras-hub do. With
        `in_place=True` an eager call writes into the cache's own tensors,
        O(T) instead of O(L) (torch, TensorFlow: the same tensors come
        back; JAX: the ones passed in are donated), and returns an
        in-place cache. Such a cache says so itself: it is a
        `keras_mha.attention.cache.InPlaceCache`, a named tuple of the same
        three tensors, and so is every cache a call on it returns; a plain
        tuple of them is the caller's. Traced (`jax.jit`, `tf.function`,
        `torch.compile`), writes are functional in both modes and XLA
        reuses donated buffers.
        """
        slots = checks.cache_slots(self, batch_size, max_length, in_place)
        settings = self.settings
        if quantize is not None:
            checks.paged_cache(self, 1, 1, quantize, in_place)
            return paged_lib.rows(
                batch_size, max_length, slots, self.rolling_cache,
                settings.num_key_value_heads, settings.key_dim,
                settings.value_dim, self.compute_dtype, quantize, in_place)
        return distribution_lib.shard_cache(cache_lib.zeros(
            batch_size, slots, settings.num_key_value_heads, settings.key_dim,
            settings.value_dim, self.compute_dtype, in_place=in_place,
        ))

    def init_paged_cache(self, num_pages, page_size, quantize=None,
                         in_place=False):
        """An empty paged key/value cache: one pool of `num_pages` pages
        of `page_size` slots for every sequence this layer serves
        (docs/serving.md).

        Args:
            num_pages: the pool's pages.
            page_size: the slots of a page.
            quantize: `None` (the compute dtype), `"int8"` or
                `"float8_e4m3fn"`: values stored with one float32 scale
                per token and key/value head.
            in_place: whether eager calls write the new slots into the
                pool's own tensors (torch, TensorFlow).

        Returns:
            A `keras_mha.attention.paged.PagedCache` (`InPlacePagedCache`)
            that a call takes as `cache`, with a `RaggedBatch` as
            `cache_update_index`; it returns `(output, cache)`.
        """
        return serving.paged_cache(self, num_pages, page_size, quantize,
                                   in_place)
