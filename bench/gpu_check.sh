#!/usr/bin/env bash
# The GPU check, for a lent machine with only its own packages (torch with its triton, transformers, pytest and
# sortedcontainers, all in the H200 image; nothing else of kvserve's is imported), sized to finish inside 8 minutes
# there (not yet run on one): the Triton kernels against float64 on the device, the CUDA-marked tests (the engine
# on the Triton backend with CUDA graphs against HF, sessions through pinned memory, deterministic mode), then
# bench/gpu_check.py on a random-weight Llama-3.2-1B-shaped model (no download).
# Without CUDA it runs the same on a small shape, so CI proves the script on a CPU (the kernels' tests run in
# the suite there, in triton's interpreter).
#   bench/gpu_check.sh                 (extra arguments go to bench/gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    shape=1b
    extra=()
else
    shape=small
    extra=(--prompt-tokens 32 --max-tokens 16 --history-tokens 256 --kv-gib 1)
fi
if [ "$shape" = 1b ]; then
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/kv/test_triton_attention.py
fi
"$PYTHON" -m pytest -q -s -p no:cacheprovider -m cuda tests/engine/test_cuda.py  # -s: what deterministic mode says
"$PYTHON" bench/gpu_check.py --shape "$shape" "${extra[@]}" "$@"
