"""Peak memory of one measured unit, from the worker's own /proc entry.

Method (`PeakMeter`): just before the timed calls the worker runs the
garbage collector, hands the allocator's free memory back to the system
(glibc's `malloc_trim(0)`), resets its resident-set high-water mark by
writing "5" to `/proc/self/clear_refs` (Linux >= 4.0) and reads `VmRSS` as
the baseline; after the calls, the peak is `VmHWM - baseline`. So the
number is the largest increase of resident memory during the timed calls
over what was live before them: inputs, weights and compiled code are
excluded; every temporary, output and gradient of a call is included.

Without the trim, the heap that the warm-up call freed (glibc keeps freed
blocks under 32 MiB, per thread arena) would serve the timed calls without
growing the RSS, and the peak would read far too low. The trim makes the
first timed call fault its memory in again, which the default allocator
does anyway for every block of 32 MiB or more; the median over the repeats
is barely touched.

Where `clear_refs` cannot be written, a thread samples `VmRSS` every
millisecond instead (the backends release the GIL while they compute),
which can miss spikes shorter than that. Without glibc there is no trim.
"""

import ctypes
import ctypes.util
import gc
import threading
import time

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def read_status(fields=("VmRSS", "VmHWM")):
    """`{"VmRSS": bytes, "VmHWM": bytes}` of this process (0 if unknown)."""
    values = dict.fromkeys(fields, 0)
    try:
        with open(_STATUS, encoding="ascii") as file:
            for line in file:
                name, _, rest = line.partition(":")
                if name in values:
                    values[name] = int(rest.split()[0]) * 1024  # kB
    except OSError:
        pass
    return values


def process_rss(pid):
    """Resident bytes of process `pid`, or 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as file:
            for line in file:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _malloc_trim():
    """glibc's `malloc_trim`, or a no-op where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


def _can_reset_high_water_mark():
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as file:
            file.write("5")
    except OSError:
        return False
    return read_status()["VmHWM"] > 0


class PeakMeter:
    """`start()` before the calls, `stop()` after: peak increase in bytes."""

    def __init__(self):
        self.method = (
            "VmHWM after reset via /proc/self/clear_refs"
            if _can_reset_high_water_mark()
            else "VmRSS sampled every 1 ms"
        )
        self._sampling = not self.method.startswith("VmHWM")
        self._trim = _malloc_trim()
        self._baseline = 0
        self._peak = 0
        self._thread = None
        self._stop = threading.Event()

    def start(self):
        gc.collect()
        self._trim()
        if not self._sampling:
            with open(_CLEAR_REFS, "w", encoding="ascii") as file:
                file.write("5")
            self._baseline = read_status()["VmRSS"]
            return
        self._baseline = self._peak = read_status()["VmRSS"]
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, read_status()["VmRSS"])
            time.sleep(0.001)

    def stop(self):
        """`(increase, absolute peak)` in bytes since `start()`."""
        if self._sampling:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, read_status()["VmRSS"])
        else:
            peak = read_status()["VmHWM"]
        return max(peak - self._baseline, 0), peak
