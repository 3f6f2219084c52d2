"""Test set-up of the development benchmarks' tests.

Two kinds of test live here. `test_on_backend.py` runs benchmark workers
and times layers on the backend the suite runs on (`KERAS_BACKEND`), so it
runs on every backend but NumPy, which is not benchmarked (no compiler,
no autodiff). `test_backend_free.py` (marked
`backend_free`) reads no backend: the configuration, the planner, the caps,
the reports and targets built from made-up results, the runner with a
stand-in worker. Its outcome is the same on every backend, so where
`keras-mha test` runs several (it names them in `KERAS_MHA_TEST_BACKENDS`),
it is collected on one of them only: NumPy's run where NumPy is one of
them (the shortest run: no training tests), else the first. A plain
`pytest` run, without that variable, collects everything.
"""

import importlib.util
import os
import pathlib

# torch must be imported before tensorflow (the other order can crash).
if importlib.util.find_spec("torch") is not None:
    importlib.import_module("torch")

import keras  # noqa: E402

BACKEND = keras.backend.backend()
HERE = pathlib.Path(__file__).resolve().parent


def backend_free_backend():
    """The backend whose run collects the `backend_free` tests, or `None`
    for every backend (no `keras-mha test` run named them)."""
    names = [name for name in
             os.environ.get("KERAS_MHA_TEST_BACKENDS", "").split(",") if name]
    if not names:
        return None
    return "numpy" if "numpy" in names else names[0]


def pytest_collection_modifyitems(config, items):
    chosen = backend_free_backend()
    if chosen in (None, BACKEND):
        return
    deselected = [item for item in items
                  if "backend_free" in item.keywords
                  and HERE in pathlib.Path(item.path).resolve().parents]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]
