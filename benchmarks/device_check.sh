#!/usr/bin/env bash
# The check of keras-mha on a machine with a GPU; CI never runs it.
#
#   bash benchmarks/device_check.sh      # from anywhere; PYTHON=python3 by default
#
# 1. nvidia-smi;
# 2. `keras-mha bench` (Keras's layer against ours) on a few shapes, forward
#    and forward+backward, on each installed backend;
# 3. the quick development benchmarks, `python -m benchmarks --quick`, on
#    every installed backend that is benchmarked;
# 4. the test suite on JAX, `keras-mha test --backends jax -j 1` (with
#    pytest-xdist's workers where it is installed).
#
# It needs Keras and at least one backend importable; keras-mha itself runs
# from this checkout, installed or not. The whole check fits in about eight
# minutes (DEVICE_CHECK_SECONDS, default 480): each step stops at its own
# deadline with SIGINT, so what it measured is still written, and the test
# suite gets the time that is left. Its files go to $OUT if set, else
# ./device-out: check.log (nvidia-smi and one line per step), bench-user.log,
# bench-quick.log with the quick run's report-quick.md, bench-quick.json,
# bench-quick.png and workers-quick.log, and test-jax.log.
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${OUT:-./device-out}" && cd "${OUT:-./device-out}" && pwd)"
python="${PYTHON:-python3}"
budget="${DEVICE_CHECK_SECONDS:-480}"
cd "$root" || exit 1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# JAX takes memory as it needs it: the test workers share one GPU.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
started=$SECONDS
summary="$out/check.log"
: >"$summary"

note() { echo "$*" | tee -a "$summary"; }

# step SECONDS LOG COMMAND...: COMMAND under a deadline, its output appended
# to LOG; one line in the summary.
step() {
    local limit=$1 log=$2 begun=$SECONDS code
    shift 2
    echo "\$ $*" >>"$log"
    timeout -s INT -k 20 "$limit" "$@" >>"$log" 2>&1
    code=$?
    note "$(printf '%-70s exit %3d, %4d s' "$*" "$code" $((SECONDS - begun)))"
}

left() { echo $((budget - (SECONDS - started))); }

{ nvidia-smi || echo "nvidia-smi: not available"; } >>"$summary" 2>&1
note "keras-mha $(git -C "$root" rev-parse --short HEAD 2>/dev/null) on" \
    "$(uname -n), budget ${budget} s"
if ! "$python" -c "import keras" 2>>"$summary"; then
    note "keras is not importable with $python: nothing to check"
    exit 1
fi
backends=$("$python" - <<'EOF'
import importlib.util
print(" ".join(name for name in ("jax", "torch", "tensorflow")
               if importlib.util.find_spec(name)) + " numpy")
EOF
)
note "backends: $backends"

# 2. Keras's layer against ours: 40 s a backend at most.
log="$out/bench-user.log"
: >"$log"
for backend in $backends; do
    if [ "$backend" = numpy ]; then  # the CPU, forward only (no autodiff)
        step 20 "$log" "$python" -m keras_mha bench --backend numpy \
            --lengths 1k,2k --window none,128 --causal --repeats 5
        continue
    fi
    step 20 "$log" "$python" -m keras_mha bench --backend "$backend" \
        --lengths 4k,16k --window none,128 --causal --repeats 10
    step 20 "$log" "$python" -m keras_mha bench --backend "$backend" \
        --lengths 4k --window none,128 --causal --backward --repeats 10
done
# The children's output must hold no backend log line (absl's format).
note "backend log lines in bench-user.log: $(grep -cE \
    '^(WARNING: All log messages before absl|[IWEF][0-9]{4} )' "$log")"

# 3. The quick development benchmarks: at most 120 s.
benchmarked=$(echo "$backends" | tr ' ' '\n' | grep -v numpy | paste -sd,)
if [ -n "$benchmarked" ]; then
    quick=$(mktemp -d)
    step 120 "$out/bench-quick.log" "$python" -m benchmarks --quick \
        --backends "$benchmarked" --out "$quick"
    for name in report bench; do
        for file in "$quick/$name".*; do
            [ -f "$file" ] && cp "$file" "$out/$name-quick.${file##*.}"
        done
    done
    cat "$quick"/worker-*.log >"$out/workers-quick.log" 2>/dev/null
    rm -rf "$quick"
fi

# 4. The suite on JAX, with what is left (30 s kept for the summary).
workers=()
if "$python" -c "import xdist" 2>/dev/null; then
    workers=(-- -n 4)
fi
limit=$(($(left) - 30))
if [ "$limit" -gt 60 ]; then
    step "$limit" "$out/test-jax.log" "$python" -m keras_mha test \
        --backends jax -j 1 "${workers[@]}"
    tail -n 3 "$out/test-jax.log" | tee -a "$summary"
else
    note "no time left for the test suite ($limit s)"
fi
note "total $((SECONDS - started)) s"
