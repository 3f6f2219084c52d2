"""The parent side: one worker process per backend, fed one unit at a time.

The parent runs no backend code. For each unit it sends the unit and the
results of the same series at shorter T (for the caps, see `plan.py`),
then waits for the result while watching two limits:

- wall clock, in two phases: the set-up and first call of a unit
  (compilation included) get the time cap plus `compile_allowance_s`, the
  timed calls twice the time cap plus a minute (a worker's start-up gets
  `STARTUP_TIMEOUT`); past it the worker is killed and the unit is `timed
  out`. Where the first call that overran had a fallback compiler
  (TensorFlow: XLA, then plain `tf.function`; a `fit` step:
  `jit_compile=True`, then `False`), the unit is run again
  without it, and the rest of its series skips it too: XLA can take hours
  to constant-fold Keras's (T, T) sliding-window mask;
- memory: the worker's resident memory may grow by the memory cap (or by
  what the machine has available, less 1 GiB, if that is smaller) over what
  it held when the unit started; past it the worker is killed and the unit
  is `out of memory`, before the machine starts swapping or the kernel's
  OOM killer picks a process. A worker killed by SIGKILL that we did not
  kill is also reported `out of memory`.

A worker that died is replaced by a fresh one for the next unit.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import memory
from benchmarks import plan
from keras_mha.cli.common import backend_env

# The checkout that holds `benchmarks/`: its `keras_mha` is the one measured.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT = 300.0
_POLL = 0.2
_MARGIN = 2**30  # left to the rest of the machine


def available_bytes():
    """`MemAvailable` of the machine, or `None` if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _Worker:
    """One worker process and a thread that reads its protocol lines."""

    def __init__(self, backend, config_path, log_path):
        # The log keeps the backends' warnings and errors (a worker's last
        # line says why it died).
        env = backend_env(backend, quiet=False)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
        # No pool of compile processes: their memory would escape the
        # meter, and the machine's cores are the benchmark's.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        self.stderr = open(log_path, "a+", encoding="utf-8",
                           errors="replace")
        self._log_start = self.stderr.tell()
        self.process = subprocess.Popen(
            worker_command(config_path),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
            env=env, text=True, encoding="utf-8", start_new_session=True,
        )
        self.messages = queue.Queue()
        self.killed_for = None
        self.hello = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self.messages.put(record)
        self.messages.put(None)

    @property
    def alive(self):
        return self.process.poll() is None

    def send(self, message):
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def kill(self, reason=None):
        self.killed_for = reason
        if self.alive:
            try:
                # Its own session: this reaches any compiler child too.
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.process.kill()
        self.process.wait()

    def close(self):
        if self.alive:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.stderr.close()

    def last_error(self):
        self.stderr.flush()
        self.stderr.seek(self._log_start)
        lines = [l.strip() for l in self.stderr.read().splitlines()
                 if l.strip()]
        return (lines or ["no output"])[-1][:300]

    def wait(self, events, timeout, rss_limit=None):
        """The next message whose event is in `events`, or, if the worker
        died, outlived `timeout` or outgrew `rss_limit` bytes, `{"result":
        failure}` (the worker then killed, `killed_for` saying why)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.messages.get(timeout=_POLL)
            except queue.Empty:
                message = False
            if message is None:  # the worker's stdout closed: it died
                return self._death()
            if message and message.get("event") in events:
                return message
            if rss_limit is not None:
                rss = memory.process_rss(self.process.pid)
                if rss > rss_limit:
                    self.kill("memory")
                    return {"result": {
                        "status": plan.OUT_OF_MEMORY,
                        "reason": f"worker passed the memory limit "
                        f"({rss / 2**30:.1f} GiB resident) and was killed",
                    }}
            if time.monotonic() > deadline:
                self.kill("time")
                return {"result": {"status": plan.TIMED_OUT}}

    def _death(self):
        code = self.process.wait()
        if code == -signal.SIGKILL and self.killed_for is None:
            status = plan.OUT_OF_MEMORY
            reason = "worker killed by SIGKILL (the kernel's OOM killer?)"
        else:
            status = plan.ERROR
            reason = f"worker exited with code {code}: {self.last_error()}"
        return {"result": {"status": status, "reason": reason}}


class Runner:
    """Runs every unit of every backend; `results[id]` is each outcome."""

    def __init__(self, config, log_folder, progress=None, on_result=None):
        self.config = config
        self.log_folder = log_folder
        self.progress = progress
        self.on_result = on_result  # called with (unit, result)
        self.results = {}
        self.backends = {}
        self._done = []  # attention units with a result, in order
        # Compilers abandoned per series (`_compiler_key`) -> {compiler:
        # why}
        self._abandoned = {}
        self._folder = tempfile.TemporaryDirectory(prefix="keras-mha-bench-")
        self.config_path = os.path.join(self._folder.name, "config.json")
        with open(self.config_path, "w", encoding="utf-8") as file:
            json.dump(config, file)

    def close(self):
        self._folder.cleanup()

    def run(self, units_by_backend, tasks=None):
        """Runs everything; on Ctrl-C the units left are `not run`."""
        try:
            for backend, units in units_by_backend.items():
                task = None if tasks is None else tasks.get(backend)
                self._run_backend(backend, units, task)
        except KeyboardInterrupt:
            for units in units_by_backend.values():
                for unit in units:
                    self.results.setdefault(unit["id"], {
                        "status": plan.NOT_RUN, "reason": "interrupted"})
            raise
        return self.results

    def _run_backend(self, backend, units, task):
        info = self.backends.setdefault(
            backend, {"workers_started": 0, "failures": []}
        )
        worker = None
        try:
            for number, unit in enumerate(units):
                if self.progress is not None and task is not None:
                    self.progress.update(task, description=describe(unit))
                if worker is None or not worker.alive:
                    if worker is not None:
                        worker.close()
                    worker, failure = self._start(backend, info)
                    if failure is not None:
                        # Nothing can run on this backend: say so per unit.
                        for rest in units[number:]:
                            self._record(rest, dict(failure), task)
                        return
                result = self._run_unit(worker, unit)
                while result is None:  # a compiler was abandoned: again
                    worker.close()
                    worker, failure = self._start(backend, info)
                    result = failure or self._run_unit(worker, unit)
                self._record(unit, result, task)
        except KeyboardInterrupt:
            if worker is not None:
                worker.kill("interrupted")
            raise
        finally:
            if worker is not None:
                worker.close()

    def _record(self, unit, result, task):
        self.results[unit["id"]] = result
        if self.on_result is not None:
            self.on_result(unit, result)
        if unit["kind"] == "attention":
            self._done.append(unit)
        if self.progress is not None and task is not None:
            self.progress.advance(task)

    def _start(self, backend, info):
        log = os.path.join(self.log_folder, f"worker-{backend}.log")
        worker = _Worker(backend, self.config_path, log)
        info["workers_started"] += 1
        hello = worker.wait(("hello",), STARTUP_TIMEOUT)
        if "result" in hello:
            reason = "worker did not start: " + hello["result"].get(
                "reason", f"no answer in {STARTUP_TIMEOUT:.0f} s")
            info["failures"].append(reason)
            worker.close()
            return None, {"status": plan.ERROR, "reason": reason}
        worker.hello = hello
        for field in ("version", "keras", "memory_method"):
            info[field] = hello.get(field)
        return worker, None

    def _run_unit(self, worker, unit):
        """Sends `unit`, watches it, returns its result.

        Returns `None` when the worker was killed because a compiler with a
        fallback (TensorFlow's XLA) did not finish its first call in time:
        the caller starts a new worker and sends the unit again, and that
        compiler is skipped for the rest of the unit's series.
        """
        rss = memory.process_rss(worker.process.pid)
        allowed = self.config["memory_cap_gib"] * 2**30
        available = available_bytes()
        if available is not None:
            allowed = min(allowed, max(available - _MARGIN, 0))
        abandoned = self._abandoned.setdefault(_compiler_key(unit), {})
        worker.send({"unit": unit, "history": self._history(unit),
                     "memory_cap_bytes": allowed,
                     "skip_compilers": abandoned})
        first_call, timed = first_call_timeout(self.config), \
            timed_timeout(self.config)
        phase, timeout, trying = "set-up and first call", first_call, None
        while True:
            message = worker.wait(("trying", "warm", "result"), timeout,
                                  rss_limit=rss + allowed)
            event = message.get("event")
            if event == "trying":
                phase, timeout, trying = "first call", first_call, message
            elif event == "warm":
                phase, timeout = "timed calls", timed
            elif event == "result":
                return message["result"]
            else:  # the worker is dead
                result = message["result"]
                if result["status"] != plan.TIMED_OUT:
                    return result
                if phase == "first call" and trying.get("fallback"):
                    abandoned[trying["compiler"]] = (
                        f"abandoned: first call (compilation included) took "
                        f"over {timeout:.0f} s")
                    return None
                result["reason"] = (
                    f"{phase} (compilation included)" if phase != "timed calls"
                    else phase) + f" took over {timeout:.0f} s; worker killed"
                return result

    def _history(self, unit):
        """Results of `unit`'s series at shorter T (for the caps)."""
        if unit["kind"] != "attention":
            return []
        key = plan.series_key(unit)
        history = []
        for other in self._done:
            if plan.series_key(other) == key and other["T"] < unit["T"]:
                result = self.results[other["id"]]
                history.append({
                    "T": other["T"],
                    **{k: result.get(k) for k in ("status", "time_s",
                                                  "peak_bytes", "reason")},
                })
        return history


def worker_command(config_path):
    """The command line of a worker process."""
    return [sys.executable, "-m", "benchmarks.worker", config_path]


def first_call_timeout(config):
    """Seconds for a unit's set-up and first call, compilation included
    (XLA, torch.compile of flex_attention and of its block mask)."""
    return config["time_cap_s"] + config["compile_allowance_s"]


def timed_timeout(config):
    """Seconds for the timed calls: they stop once past the time cap."""
    return 2 * config["time_cap_s"] + 60.0


def _compiler_key(unit):
    """Units that share a compiled program's fate (both modes of a cell
    and the same cell at every T)."""
    if unit["kind"] == "attention":
        return (unit["backend"], unit["B"], unit["impl"], unit["w"],
                unit["causal"])
    if unit["kind"] == "feature":
        return (unit["backend"], unit["kind"], unit["feature"])
    # A fit step: its model; the decode section: a layer, cache and mode at
    # every position.
    return (unit["backend"], unit["kind"]) + tuple(
        unit.get(name) for name in ("impl", "cache", "slots", "w", "mode"))


def describe(unit):
    if unit["kind"] == "matmul":
        return f"{unit['backend']} matmul {unit['size']}"
    if unit["kind"] == "projection":
        rows, inner, columns = unit["shape"]
        return (f"{unit['backend']} projection matmul ({rows}, {inner}) @ "
                f"({inner}, {columns})")
    if unit["kind"] == "fit":
        return (f"{unit['backend']} fit step, {plan.LABELS[unit['impl']]} "
                f"attention, T={unit['T']} w={_w(unit['w'])}")
    if unit["kind"] == "decode":
        return (f"{unit['backend']} decode {plan.DECODE_LABELS[unit['impl']]} "
                f"{unit['cache']} L={unit['slots']} p={unit['position']} "
                f"{unit['mode']}")
    if unit["kind"] == "floor":
        return (f"{unit['backend']} floor {unit['cache']} L={unit['slots']} "
                f"{unit['reads']} slots {unit['mode']}")
    if unit["kind"] == "generate":
        return (f"{unit['backend']} GPT-2 generate, "
                f"{plan.DECODE_LABELS[unit['impl']]} attention")
    if unit["kind"] == "prefill":
        return (f"{unit['backend']} prefill T={unit['T']} w={_w(unit['w'])} "
                f"{unit['cache']} cache {unit['mode']}")
    window = _w(unit["w"])
    if unit["kind"] == "feature":
        return (f"{unit['backend']} T={unit['T']} w={window} ours, "
                f"{plan.FEATURE_LABELS[unit['feature']]} "
                f"{unit['mode'].replace('_', '+')}")
    return (f"{unit['backend']} B={unit['B']} T={unit['T']} w={window} "
            f"{plan.LABELS[unit['impl']]} {unit['mode'].replace('_', '+')}")


def _w(window):
    return "none" if window is None else window
