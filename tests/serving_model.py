"""A small decoder of our layers, served three ways: a full pass, dense
caches (one request at a time, or a static batch padded to its longest
prompt), and one paged cache per layer with ragged steps
(`keras_mha.serving.generate`). The tests hold the paged tokens to the
dense ones; `benchmarks/serving.py` times them.
"""

import keras
import numpy as np
from keras import ops

import keras_mha
from keras_mha.attention import paged


class TinyLM(keras.Model):
    """Embedding, `layers` pre-norm blocks (our attention, an MLP), a head;
    as a Keras model, the full pass (`fit` trains it).

    `attention`: more arguments of `keras_mha.MultiHeadAttention` (a
    window, chunks, soft-cap, sinks, ALiBi); RoPE unless `rotary=False`.
    """

    def __init__(self, vocabulary=64, layers=2, heads=4, kv_heads=2,
                 head=16, seed=0, rotary=True, **attention):
        super().__init__()
        keras.utils.set_random_seed(seed)
        width = heads * head
        self.vocabulary = vocabulary
        self.embedding = keras.layers.Embedding(vocabulary, width)
        self.blocks = []
        for _ in range(layers):
            self.blocks.append([
                keras.layers.LayerNormalization(),
                keras_mha.MultiHeadAttention(
                    num_heads=heads, key_dim=head,
                    num_key_value_heads=kv_heads,
                    rotary_embedding=keras_mha.RotaryEmbedding()
                    if rotary else None, **attention),
                keras.layers.LayerNormalization(),
                keras.layers.Dense(2 * width, activation="gelu"),
                keras.layers.Dense(width),
            ])
        self.norm = keras.layers.LayerNormalization()
        self.head = keras.layers.Dense(vocabulary)
        self.pools = None
        self.logits(np.zeros((1, 2), "int32"))  # builds every layer

    @property
    def attention_layers(self):
        return [block[1] for block in self.blocks]

    def _run(self, tokens, attend):
        """The logits `(B, T, vocabulary)` with `attend(i, layer, h)` the
        attention of block `i`."""
        x = self.embedding(ops.convert_to_tensor(tokens, "int32"))
        for i, (norm, layer, mlp_norm, up, down) in enumerate(self.blocks):
            x = x + attend(i, layer, norm(x))
            x = x + down(up(mlp_norm(x)))
        return self.head(self.norm(x))

    def call(self, tokens):
        return self.logits(tokens)

    def logits(self, tokens):
        """A full causal pass over `tokens` `(B, T)`."""
        return self._run(tokens, lambda i, layer, h: layer(
            h, h, use_causal_mask=True))

    # ----------------------------------------------------- dense caches

    def greedy_alone(self, prompt, new_tokens, max_length=32):
        """Greedy tokens of one prompt, decoded alone with dense caches of
        `max_length` slots, a token a call (one shape for every prompt: a
        backend that compiles per shape compiles once)."""
        caches = [layer.init_cache(1, max_length)
                  for layer in self.attention_layers]
        fed, generated = list(prompt), []
        for index in range(len(prompt) + new_tokens - 1):
            def attend(i, layer, h):
                out, caches[i] = layer(h, h, use_causal_mask=True,
                                       cache=caches[i],
                                       cache_update_index=index)
                return out

            logits = self._run(np.asarray([[fed[index]]], "int32"), attend)
            if index >= len(prompt) - 1:
                generated.append(int(np.argmax(ops.convert_to_numpy(
                    logits[0, -1]))))
                fed.append(generated[-1])
        return generated

    # ------------------------------------------------------ paged caches

    def init_pools(self, num_pages, page_size, quantize=None,
                   in_place=True):
        self.pools = [layer.init_paged_cache(num_pages, page_size,
                                             quantize=quantize,
                                             in_place=in_place)
                      for layer in self.attention_layers]

    def ragged_logits(self, tokens, batch, pools):
        """`(logits at each row's last new token (R, vocabulary), pools)`:
        a pure function of the pools, for compiled steps."""
        pools = list(pools)

        def attend(i, layer, h):
            out, pools[i] = layer(h, h, use_causal_mask=True,
                                  cache=pools[i], cache_update_index=batch)
            return out

        logits = self._run(tokens, attend)  # (R, T, vocabulary)
        last = ops.maximum(ops.convert_to_tensor(batch.lengths, "int32")
                           - 1, 0)
        picked = ops.take_along_axis(logits, last[:, None, None], axis=1)
        return picked[:, 0], pools

    def step(self, tokens, batch):
        """`keras_mha.serving.generate`'s step: the pools updated."""
        logits, self.pools = self.ragged_logits(tokens, batch, self.pools)
        return ops.convert_to_numpy(logits)

    def copy_pages(self, sources, targets):
        self.pools = [paged.copy_pages(pool, sources, targets)
                      for pool in self.pools]
