"""`keras-mha test`: the project's tests on each backend, one process each.

Each run is `python -m pytest tests benchmarks/tests -q -p no:cacheprovider
ARGS` in the current folder, which must be a source checkout (`tests/` and
`pyproject.toml`; an installed package has no tests), without the folders
when ARGS name test files, with `KERAS_BACKEND=<backend>`, where the folder
exists, `KERAS_HOME=configs/<backend>`, and `KERAS_MHA_TEST_BACKENDS`, the
backends of the whole run (`benchmarks/tests` collects its tests that touch
no backend on one of them only), `KERAS_MHA_TEST_SHARED`, a folder the
runs share (removed at the end: `tests/test_checkpoints.py` saves each
backend's files there once); JAX's and TensorFlow's runs add
`XLA_TEST_FLAGS` to `XLA_FLAGS`. With one job the output streams as
it comes; with more, each backend's output is printed whole when it
finishes. A summary line per backend closes the run; any failure (tests
failing, no tests collected, backend not installed) makes the exit code 1.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from keras_mha.cli.common import CLIError
from keras_mha.cli.common import backend_env
from keras_mha.cli.common import backend_installed

DEFAULT_BACKENDS = ("tensorflow", "jax", "torch", "numpy")
# The library's tests, then the development benchmarks' (where the checkout
# has them).
TEST_FOLDERS = ("tests", os.path.join("benchmarks", "tests"))

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# pytest's last line: "3 failed, 409 passed, 20 skipped in 61.02s (0:01:01)".
_COUNTS = re.compile(
    r"((\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|"
    r"warnings?|rerun))|no tests ran).* in [\d.]+s( \([\d:]+\))?$"
)
_NO_TESTS_COLLECTED = 5


class _Run:
    """One backend's pytest process and what it said."""

    def __init__(self, backend):
        self.backend = backend
        self.process = None
        self.returncode = None
        self.counts = None
        self.lines = []
        self.started = None
        self.seconds = 0.0
        self.problem = None  # set when pytest never ran

    def read(self, stream_to=None):
        """Reads the output to the end; echoes it to `stream_to` if given."""
        for line in self.process.stdout:
            if stream_to is not None:
                stream_to.write(line)
                stream_to.flush()
            else:
                self.lines.append(line)
            plain = _ANSI.sub("", line).strip().strip("=").strip()
            if _COUNTS.search(plain):
                self.counts = plain
        self.returncode = self.process.wait()

    @property
    def passed(self):
        return self.problem is None and self.returncode == 0

    def summary(self):
        if self.problem is not None:
            return f"{self.backend}: {self.problem} FAIL"
        counts = self.counts or f"pytest exit code {self.returncode}"
        if self.returncode == _NO_TESTS_COLLECTED:
            counts += " (no tests collected)"
        verdict = "PASS" if self.passed else "FAIL"
        return f"{self.backend}: {counts} [{self.seconds:.0f}s wall] {verdict}"


def _command(pytest_args, color):
    # Paths given (`tests/test_cli.py::test_x`) replace the default folders.
    paths = [a for a in pytest_args
             if not a.startswith("-") and os.path.exists(a.split("::")[0])]
    folders = [] if paths else [f for f in TEST_FOLDERS if os.path.isdir(f)]
    command = [sys.executable, "-m", "pytest", *folders,
               "-q", "-p", "no:cacheprovider"]
    if color and not any(a.startswith("--color") for a in pytest_args):
        command.append("--color=yes")
    return command + list(pytest_args)


# How XLA compiles for the tests: its element-wise CPU emitters compile an op
# in about 60% of the time its fusion emitters take, and LLVM's optimization
# level 0 halves what is left. Compiling the ops of eager calls for every
# shape they meet is most of JAX's run, and the tests' shapes are too small
# for the optimizer's code to matter. The sessions that compile with XLA use
# these, and so do the JAX child processes of the multi-device tests
# (`tests/conftest.py`, `jax_child_env`). A flag the caller sets stays.
XLA_TEST_FLAGS = (
    ("xla_cpu_use_fusion_emitters", "false"),
    ("xla_backend_optimization_level", "0"),
)
XLA_TEST_BACKENDS = ("jax", "tensorflow")


def xla_test_flags(flags=""):
    """`flags` (an `XLA_FLAGS` value) with the tests' `XLA_TEST_FLAGS` added,
    those it sets already kept as they are."""
    added = [f"--{name}={value}" for name, value in XLA_TEST_FLAGS
             if f"--{name}=" not in flags]
    return " ".join([flags.strip(), *added]).strip()


def _env(backend, root, backends, shared=None):
    env = backend_env(backend, quiet=False)
    env["PYTHONUNBUFFERED"] = "1"  # stream lines as pytest prints them
    if shared is not None:
        env["KERAS_MHA_TEST_SHARED"] = shared
    if backend in XLA_TEST_BACKENDS:
        env["XLA_FLAGS"] = xla_test_flags(env.get("XLA_FLAGS", ""))
    env["KERAS_MHA_TEST_BACKENDS"] = ",".join(backends)
    home = os.path.join(root, "configs", backend)
    if os.path.isdir(home):
        env["KERAS_HOME"] = home
    return env


def _start(job, pytest_args, root, color, backends, shared):
    job.started = time.perf_counter()
    job.process = subprocess.Popen(
        _command(pytest_args, color),
        cwd=root,
        env=_env(job.backend, root, backends, shared),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
    )


def _finish(job):
    job.seconds = time.perf_counter() - job.started


def run(backends=None, jobs=1, pytest_args=()):
    """`keras-mha test`: returns the exit code."""
    root = os.getcwd()
    if not (os.path.isdir(os.path.join(root, "tests"))
            and os.path.isfile(os.path.join(root, "pyproject.toml"))):
        # An installed package has no tests: they live in the repository.
        raise CLIError("keras-mha test runs the project's test suite and "
                       "needs a source checkout (a folder with tests/ and "
                       "pyproject.toml); run it from the repository root. "
                       f"Received: cwd={root}")
    if importlib.util.find_spec("pytest") is None:
        raise CLIError('pytest is not installed (pip install "keras-mha[dev]")')
    backends = list(backends or DEFAULT_BACKENDS)
    runs = [_Run(backend) for backend in backends]
    runnable = []
    for each in runs:
        if backend_installed(each.backend):
            runnable.append(each)
        else:
            each.problem = (f"not installed (pip install "
                            f'"keras-mha[{each.backend}]")')
    color = sys.stdout.isatty()
    names = [each.backend for each in runnable]  # the backends that run
    shared = tempfile.mkdtemp(prefix="keras-mha-test-")
    try:
        if jobs <= 1:
            for each in runnable:
                _banner(each.backend)
                _start(each, pytest_args, root, color, names, shared)
                each.read(stream_to=sys.stdout)
                _finish(each)
        else:
            _run_parallel(runnable, jobs, pytest_args, root, color, names,
                          shared)
    finally:
        for each in runnable:
            if each.process is not None and each.process.poll() is None:
                each.process.kill()
                each.process.wait()
        shutil.rmtree(shared, ignore_errors=True)

    print()
    for each in runs:
        print(each.summary())
    sys.stdout.flush()
    return 0 if all(each.passed for each in runs) else 1


def _run_parallel(runs, jobs, pytest_args, root, color, backends, shared):
    """Runs up to `jobs` backends at once; prints each one's output whole."""
    pending = list(runs)
    printing = threading.Lock()
    slots = threading.Semaphore(jobs)

    def work(each):
        try:
            each.read()
            _finish(each)
            with printing:
                _banner(each.backend)
                sys.stdout.writelines(each.lines)
                sys.stdout.flush()
        finally:
            slots.release()

    threads = []
    for each in pending:
        slots.acquire()
        _start(each, pytest_args, root, color, backends, shared)
        thread = threading.Thread(target=work, args=(each,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


def _banner(backend):
    print(f"===== {backend} =====", flush=True)
