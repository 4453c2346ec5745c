#!/usr/bin/env bash
# Fill bench/wheels/ (git-ignored, about 4.5 MB) with the wheels of bench/gpu_wheels.txt for the GPU machine's
# Python (3.12 on x86-64 Linux; WHEELS_PYTHON=3.11 for another), so that bench/gpu_check.sh can install them there
# without a network. Run it here, on a machine with one, before sending the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
rm -rf bench/wheels
$PIP download --quiet --no-deps --only-binary=:all: --python-version "${WHEELS_PYTHON:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --dest bench/wheels --requirement bench/gpu_wheels.txt
ls bench/wheels
du -sh bench/wheels
