"""Data and model parallelism give the single-device results (JAX).

One subprocess with 8 host devices runs every case under each strategy
(`python tests/test_distribution.py` prints the results as JSON); the tests
read its report. Sharding must not change the function: outputs before
and weights after one SGD step match one device's.
"""

import json
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import jax_child_env
from conftest import skip_unless_jax_children_here

import keras_mha
from keras_mha.attention import dispatch
from keras_mha.attention.spec import window_sides

# name -> (layer kwargs, query length T, features E); the heads divide by 4
# shards. "banded" is long enough against its window for the banded path.
CASES = {
    "dense": (dict(num_heads=4, key_dim=4, use_causal_mask=False), 16, 16),
    "banded": (
        dict(num_heads=4, key_dim=4, sliding_window=16, use_causal_mask=True),
        256,
        8,
    ),
    "grouped": (
        dict(num_heads=8, key_dim=4, num_key_value_heads=4,
             use_causal_mask=True),
        16,
        16,
    ),
}
STRATEGIES = ("data_parallel", "model_parallel")
BATCH = 8
DEVICES = 8


def _build_model():
    """One model with an attention branch per case; weights from NumPy."""
    inputs, outputs = {}, {}
    for name, (kwargs, length, features) in CASES.items():
        kwargs = dict(kwargs)
        causal = kwargs.pop("use_causal_mask")
        x = keras.Input((length, features), name=name)
        layer = keras_mha.MultiHeadAttention(
            **kwargs,
            kernel_initializer="zeros",
            bias_initializer="zeros",
            name=f"attention_{name}",
        )
        inputs[name] = x
        outputs[name] = layer(x, x, use_causal_mask=causal)
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(0)
    model.set_weights(
        [
            rng.normal(scale=0.5, size=w.shape).astype("float32")
            for w in model.get_weights()
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(1)
    x, y = {}, {}
    for name, (_, length, features) in CASES.items():
        shape = (BATCH, length, features)
        x[name] = rng.normal(size=shape).astype("float32")
        y[name] = rng.normal(size=shape).astype("float32")
    return x, y


def _run(distribution):
    """Outputs, weights after one step, and the head-axis shard sizes."""
    x, y = _data()
    if distribution is None:
        model = _build_model()
    else:
        with distribution.scope():
            model = _build_model()
    before = {
        name: model.get_layer(f"attention_{name}").get_weights()
        for name in CASES
    }
    outputs = model.predict_on_batch(x)
    model.train_on_batch(x, y)
    shards = {}
    for name in CASES:
        layer = model.get_layer(f"attention_{name}")
        kernel = layer.query_dense.kernel.value  # (E, N, H)
        shards[name] = kernel.sharding.shard_shape(kernel.shape)[1]
    weights = {
        name: [
            np.asarray(w)
            for w in model.get_layer(f"attention_{name}").get_weights()
        ]
        for name in CASES
    }
    outputs = {name: np.asarray(outputs[name]) for name in CASES}
    return outputs, before, weights, shards


def main():
    import jax

    devices = jax.devices()
    assert len(devices) == DEVICES, devices
    distribution = keras.distribution
    mesh = distribution.DeviceMesh(
        (2, 4), ("batch", "model"), devices=devices
    )
    strategies = {
        "data_parallel": distribution.DataParallel(devices=devices),
        "model_parallel": distribution.ModelParallel(
            layout_map=keras_mha.layout_map(mesh, "model"),
            batch_dim_name="batch",
        ),
    }
    single_outputs, initial, single_weights, _ = _run(None)
    report = {}
    for strategy, dist in strategies.items():
        outputs, _, weights, shards = _run(dist)
        for name in CASES:
            pairs = list(zip(weights[name], single_weights[name]))
            report[f"{strategy}-{name}"] = {
                "outputs_close": _close(outputs[name], single_outputs[name]),
                "weights_close": all(_close(a, b) for a, b in pairs),
                "output_diff": _diff(outputs[name], single_outputs[name]),
                "weight_diff": max(_diff(a, b) for a, b in pairs),
                # Else the comparison after the step proves nothing.
                "weights_changed": any(
                    bool(np.max(np.abs(a - b)) > 1e-4)
                    for a, b in zip(single_weights[name], initial[name])
                ),
                "heads_per_shard": shards[name],
                "num_heads": CASES[name][0]["num_heads"],
            }
    report["two_devices_decode"] = _decode_on_two_devices(devices[:2])
    print("REPORT " + json.dumps(report))


def _decode_on_two_devices(devices):
    """Eager steps of one layer over two caches, each on its own device,
    taken in turn: the default mode's writes land on each cache's own
    device. The largest difference from the full pass."""
    import gc

    import jax

    layer = keras_mha.MultiHeadAttention(2, 4)
    x = np.random.default_rng(5).normal(size=(1, 6, 8)).astype("float32")
    full = np.asarray(layer(x, x, use_causal_mask=True))
    caches = [jax.device_put(layer.init_cache(1, 6), d) for d in devices]
    outputs = [[], []]
    for i in range(6):
        for d, device in enumerate(devices):
            token = jax.device_put(x[:, i:i + 1], device)
            out, caches[d] = layer(token, token, use_causal_mask=True,
                                   cache=caches[d], cache_update_index=i)
            outputs[d].append(np.asarray(out))
            gc.collect()
    return max(_diff(np.concatenate(o, axis=1), full) for o in outputs)


def _close(actual, expected):
    return bool(np.allclose(actual, expected, rtol=1e-5, atol=1e-5))


def _diff(actual, expected):
    return float(np.max(np.abs(actual - expected)))


@pytest.fixture(scope="module")
def report():
    skip_unless_jax_children_here()
    env = jax_child_env(DEVICES)
    result = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).resolve())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [
        line for line in result.stdout.splitlines()
        if line.startswith("REPORT ")
    ]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_as_one_device(report, strategy, case):
    result = report[f"{strategy}-{case}"]
    assert result["weights_changed"]
    assert result["outputs_close"], result
    assert result["weights_close"], result


@pytest.mark.parametrize("case", list(CASES))
def test_model_parallel_shards_heads(report, case):
    result = report[f"model_parallel-{case}"]
    assert result["heads_per_shard"] == result["num_heads"] // 4
    assert report[f"data_parallel-{case}"]["heads_per_shard"] == (
        result["num_heads"]
    )


def test_eager_decoding_on_two_devices(report):
    """Caches on two devices decode in turn, each written on its own
    device."""
    assert report["two_devices_decode"] < 1e-5


def test_banded_case_takes_the_banded_path():
    kwargs, length, _ = CASES["banded"]
    assert dispatch.banded_pays_off(
        window_sides(kwargs["sliding_window"]), length, length
    )


def _mesh(shape=(2, 4), axes=("batch", "model")):
    # Device names only: the layouts are looked up, not applied.
    devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
    return keras.distribution.DeviceMesh(shape, axes, devices=devices)


def _layouts(layout_map, layer):
    return {
        v.path.split("/", 1)[1]: (
            None if layout_map[v.path] is None
            else tuple(layout_map[v.path].axes)
        )
        for v in layer.weights
    }


EXPECTED_LAYOUTS = {
    "query/kernel": (None, "model"),
    "query/bias": ("model",),
    "key/kernel": (None, "model"),
    "key/bias": ("model",),
    "value/kernel": (None, "model"),
    "value/bias": ("model",),
    "attention_output/kernel": ("model",),
    "attention_output/bias": None,  # replicated
}


class TestLayoutMapKeys:
    """The keys match the real variable paths; no devices needed."""

    @pytest.mark.parametrize(
        "make, gate",
        [
            (
                lambda: keras_mha.MultiHeadAttention(4, 2, use_gate=True),
                True,
            ),
            (lambda: keras.layers.MultiHeadAttention(4, 2), False),
            (
                lambda: keras.layers.GroupQueryAttention(
                    head_dim=2, num_query_heads=4, num_key_value_heads=2
                ),
                False,
            ),
        ],
        ids=["ours_with_gate", "keras_mha", "keras_gqa"],
    )
    def test_every_weight(self, make, gate):
        layer = make()
        layer.build((1, 3, 8), (1, 3, 8))
        expected = dict(EXPECTED_LAYOUTS)
        if gate:
            expected["gate/kernel"] = (None, "model")
            expected["gate/bias"] = ("model",)
        layout_map = keras_mha.layout_map(_mesh())
        assert _layouts(layout_map, layer) == expected

    def test_nested_in_a_model_and_named(self):
        class Block(keras.Model):
            def __init__(self):
                super().__init__(name="block")
                self.attention = keras_mha.MultiHeadAttention(
                    2, 4, name="self_attention"
                )
                self.query = keras.layers.Dense(4, name="query")

            def call(self, x):
                return self.query(self.attention(x, x))

        block = Block()
        block(np.zeros((1, 3, 8), "float32"))
        paths = [v.path for v in block.weights]
        assert "block/self_attention/query/kernel" in paths
        layout_map = keras_mha.layout_map(
            _mesh(), layer_name="self_attention"
        )
        layouts = {p: layout_map[p] for p in paths}
        assert layouts["block/self_attention/query/kernel"].axes == (
            None, "model"
        )
        # The Dense named `query` is left alone.
        assert layouts["block/query/kernel"] is None

    def test_adds_to_an_existing_map(self):
        mesh = _mesh()
        existing = keras.distribution.LayoutMap(mesh)
        existing["dense/kernel"] = (None, "model")
        layout_map = keras_mha.layout_map(mesh, into=existing)
        assert layout_map is existing
        assert existing["dense/kernel"].axes == (None, "model")
        assert existing["attn/value/bias"].axes == ("model",)

    def test_other_axis_name(self):
        layout_map = keras_mha.layout_map(
            _mesh((8,), ("heads",)), model_axis="heads"
        )
        assert layout_map["attn/key/kernel"].axes == (None, "heads")

    def test_unknown_axis(self):
        with pytest.raises(ValueError, match="Received: model_axis='mp'"):
            keras_mha.layout_map(_mesh(), model_axis="mp")

    def test_map_on_another_mesh(self):
        other = keras.distribution.LayoutMap(_mesh())
        with pytest.raises(ValueError, match="into.device_mesh"):
            keras_mha.layout_map(_mesh(), into=other)


if __name__ == "__main__":
    main()
