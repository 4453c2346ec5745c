#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (an H200, no network), about ten minutes in all.
#
#   bench/gpu_check.sh                   OUT=DIR for the logs (default: a new folder under /tmp); PYTHON=python3
#
# It first prints what the machine has (nvidia-smi; python, torch, triton, transformers and numpy; a C compiler
# and Python.h, without which triton cannot build its launcher and the engine serves by SDPA instead), installs
# bench/wheels/ (bench/gpu_wheels.sh fills it on a machine with a network: the web stack the server needs beyond
# the machine's own packages) into a folder of its own when the server's packages are missing, then runs the
# parts, each under its own time limit, and goes on after one fails or runs out of time:
#
#   cuda-tests  tests/engine/test_cuda.py: the engine on the Triton backend with CUDA graphs against HF
#   engine      bench/gpu_check.py on a random Llama-3.2-1B shape in bf16 (load, agreement with HF, prefill,
#               decode at 1-64 rows with graphs on and off, a 16k context, a session's turn 2, memory)
#   session     bench/gpu_session.py: `python -m server serve` on that model saved to disk, two streamed chat
#               turns on one session over HTTP (the second must find the first's K/V cached)
#   kernels     tests/kv/test_triton_attention.py: the Triton kernels on the device against float64
#   sm90        tests/kv/triton_sm90.py: every kernel variant compiled to an sm_90 cubin
#
# Each part's output is a log of its own under the output folder (check.log: what this script prints, the
# summary at its end; engine.json: the engine's figures); a part that fails prints its log's last lines. The
# parts share one budget (GPU_CHECK_BUDGET_S, 540 s): a part's limit is its own (GPU_CHECK_LIMIT_<PART>, in
# seconds) or what is left of the budget, whichever is less, and a part with under 20 s left is skipped.
# Without CUDA (CI proves the script on a CPU) the model is the small shape and the two kernel parts are skipped:
# the suite runs them there, in triton's interpreter. Exit status: 0 when no part failed or ran out of time.

# part NAME LIMIT_S COMMAND...: run it under its own limit (or what is left of the budget), its output in NAME.log
part() {
    local name=$1 own=$2 var limit left rc began status counts
    shift 2
    var=GPU_CHECK_LIMIT_$(echo "$name" | tr '[:lower:]-' '[:upper:]_')
    own=${!var:-$own}
    left=$((BUDGET_S - (SECONDS - START_S)))
    if ((left < 20)); then
        echo "== $name: skipped ($left s of the budget left)"
        SUMMARY+=("$(printf '%-12s skipped: %s s of the budget left' "$name" "$left")")
        return
    fi
    limit=$((own < left ? own : left))
    echo "== $name (limit $limit s): $*"
    began=$SECONDS
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=passed ;;
        124 | 137) status="timed out after $limit s" ;;
        *) status="failed (exit status $rc)" ;;
    esac
    if [ "${SHOW_LOG:-}" = "$name" ]; then  # the figures: all of them
        cat "$OUT/$name.log"
    elif [ "$rc" -ne 0 ]; then
        tail -n 40 "$OUT/$name.log"
    fi
    # pytest's count (a CPU skips the CUDA tests: "passed" alone would hide that)
    counts=$(grep -E "^=*[ ]*[0-9]+ (passed|failed|skipped|errors?|deselected)" "$OUT/$name.log" | tail -n 1 | sed -E 's/^=+ *| *=+$//g')
    SUMMARY+=("$(printf '%-12s %s in %d s%s' "$name" "$status" $((SECONDS - began)) "${counts:+: $counts}")")
    echo "-- $name: $status"
}

# summary: print each part's line; exit status 1 when a part failed or ran out of time, or the machine lacks what
# the kernels need
summary() {
    local line failed=0
    echo "== summary ($((SECONDS - START_S)) s; logs in $OUT)"
    for line in "${SUMMARY[@]}"; do
        echo "$line"
        case $line in *failed* | *"timed out"* | "machine "*) failed=1 ;; esac
    done
    return $failed
}

OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")}
mkdir -p "$OUT"
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
START_S=$SECONDS
declare -a SUMMARY=()
[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0  # sourced (tests/test_gpu_check.py): the functions only

set -uo pipefail  # no -e: a failed part is reported and the next one runs
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-scratch.XXXXXX")  # wheels, Triton's cache: nothing to keep
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$SCRATCH/triton}
exec > >(tee "$OUT/check.log") 2>&1

echo "== the machine ($(date -u +%FT%TZ); logs in $OUT)"
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv
else
    echo "nvidia-smi: not found"
fi
"$PYTHON" - << 'EOF'
import importlib.metadata as metadata
import sys

print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers", "numpy", "fastapi", "uvicorn", "pydantic", "pytest"):
    try:
        print(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name}: not installed")
try:
    import torch

    print("torch cuda", torch.version.cuda, "available:", torch.cuda.is_available(), end="")
    if torch.cuda.is_available():
        print(f", {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    else:
        print()
except Exception as exc:  # the finding: print it and go on
    print("torch does not import:", exc)
EOF
if command -v cc > /dev/null; then
    echo "C compiler: $(cc --version | head -1)"
else
    echo "cc: not found: triton cannot build its launcher, and the engine will attend by SDPA"
    SUMMARY+=("machine      no C compiler (cc)")
fi
include=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if test -f "$include/Python.h"; then
    echo "Python.h: $include/Python.h"
else
    echo "Python.h: not in $include: triton cannot build its launcher, and the engine will attend by SDPA"
    SUMMARY+=("machine      no Python.h in $include")
fi
if ! "$PYTHON" -c "import fastapi, uvicorn, pydantic_settings, sse_starlette, fastapi_offline, jiter" 2> /dev/null; then
    if compgen -G "bench/wheels/*.whl" > /dev/null; then
        echo "the server's packages are missing: installing bench/wheels/ into $SCRATCH/site"
        if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SCRATCH/site" bench/wheels/*.whl; then
            export PYTHONPATH=$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
        else
            SUMMARY+=("machine      bench/wheels/ did not install")
        fi
    else
        echo "the server's packages are missing and bench/wheels/ is empty (bench/gpu_wheels.sh fills it)"
    fi
fi

if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null; then
    shape=1b
else
    shape=small
fi

PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider)
part cuda-tests 120 "${PYTEST[@]}" -s -m cuda tests/engine/test_cuda.py
SHOW_LOG=engine part engine 240 "$PYTHON" bench/gpu_check.py --shape "$shape" --json "$OUT/engine.json"
SHOW_LOG=session part session 120 "$PYTHON" bench/gpu_session.py --shape "$shape"
if [ "$shape" = 1b ]; then
    # the sm_90 compile has a part of its own (below), so the file's test of it is left out here
    part kernels 150 "${PYTEST[@]}" tests/kv/test_triton_attention.py -k "not compiles_for_sm_90"
    part sm90 200 "$PYTHON" tests/kv/triton_sm90.py
else
    SUMMARY+=("kernels      skipped: no CUDA (the suite runs them in triton's interpreter)")
    SUMMARY+=("sm90         skipped: no CUDA (the suite compiles them: test_every_kernel_compiles_for_sm_90)")
fi

rm -rf "$SCRATCH"
summary
