"""One process of the two-process check of `keras_mha.ContextParallel`.

    python tests/context_two_processes.py PORT PROCESS_ID

`tests/test_context_parallel.py` starts two of these on localhost, each
with 2 host devices, so the context axis of the `(1, 4)` mesh spans both
processes. Each builds the same model (a causal window, then full causal
attention: the halo and the ring cross the processes), computes its
outputs and gradients under the distribution and, on its own device,
without one, and prints the largest relative difference (`REPORT`).
"""

import json
import sys

import numpy as np

LENGTH, FEATURES, BATCH = 64, 8, 2


def main(port, process_id):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras

    keras.distribution.initialize(
        job_addresses=f"localhost:{port}", num_processes=2,
        process_id=process_id,
    )
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    import keras_mha

    assert jax.process_count() == 2 and len(jax.devices()) == 4

    def build():
        x = keras.Input((LENGTH, FEATURES))
        h = x + keras_mha.MultiHeadAttention(2, 4, sliding_window=24)(
            x, x, use_causal_mask=True
        )
        h = h + keras_mha.MultiHeadAttention(2, 4)(h, h, use_causal_mask=True)
        model = keras.Model(x, h)
        rng = np.random.default_rng(0)
        model.set_weights([rng.normal(scale=0.3, size=w.shape)
                           .astype("float32") for w in model.get_weights()])
        return model

    data = np.random.default_rng(1).normal(size=(BATCH, LENGTH, FEATURES))
    data = data.astype("float32")

    def results(model, x):
        trainable = [v.value for v in model.trainable_variables]
        others = [v.value for v in model.non_trainable_variables]

        def loss(trainable, x):
            out, _ = model.stateless_call(trainable, others, x)
            return jnp.mean(jnp.square(out)), out

        return jax.jit(jax.grad(loss, has_aux=True))(trainable, x)

    local = jax.local_devices()[0]
    with jax.default_device(local):
        single_grads, single_out = results(build(), jnp.asarray(data))
        single = [np.asarray(single_out)] + [np.asarray(g)
                                             for g in single_grads]
    mesh = keras.distribution.DeviceMesh((1, 4), ("batch", "context"),
                                         jax.devices())
    distribution = keras_mha.ContextParallel(mesh)
    with distribution.scope():
        model = build()
        sharding = distribution.get_data_layout(data.shape).backend_layout
        x = jax.make_array_from_callback(data.shape, sharding,
                                         lambda index: data[index])
        grads, out = results(model, x)
        sharded = [out] + list(grads)
        gathered = [np.asarray(multihost_utils.process_allgather(a,
                                                                 tiled=True))
                    for a in sharded]
    difference = max(
        float(np.max(np.abs(a - b) / (1 + np.abs(b))))
        for a, b in zip(gathered, single)
    )
    print("REPORT " + json.dumps({"process": process_id,
                                  "difference": difference,
                                  "devices": len(jax.devices())}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
