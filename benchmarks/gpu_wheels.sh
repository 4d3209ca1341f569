#!/usr/bin/env bash
# Download the wheels benchmarks/gpu_check.sh needs on a GPU node that has torch, triton and
# numpy but nothing else of genolong's dependencies, and no network (issue 43): fla-core (the KDA
# part's kernels; pure Python) and einops (fla-core's one dependency; pure Python, skipped by
# gpu_check.sh where the node has it). Nothing else is needed: the check imports genolong's model,
# kernels and parallel code only, which need no pydantic, zarr, pysam or pyBigWig.
#
# Run it on a machine with network, in the checkout; the folder (git-ignored) then travels with
# the tree (for the device tool: carry .gpu-wheels). gpu_check.sh unpacks the wheels into a
# temporary folder (wheels are zip files: no pip on the node).
#
# Usage: bash benchmarks/gpu_wheels.sh [DEST]        (default .gpu-wheels)
# Env: FLA_CORE_VERSION (default 0.6.0, the version the test suite runs), GPU_PYTHON_VERSION
#      (default 3.12: only matters for wheels with compiled code), PIP (default: python3 -m pip).
set -euo pipefail

cd "$(dirname "$0")/.."
dest="${1:-.gpu-wheels}"
fla="${FLA_CORE_VERSION:-0.6.0}"
pyver="${GPU_PYTHON_VERSION:-3.12}"
read -r -a pip <<< "${PIP:-python3 -m pip}"
limit_bytes=$((10 * 1024 * 1024))   # what travels with the tree stays small

mkdir -p "$dest"
# --no-deps: the node's torch and triton must stay as they are (fla-core's extras would pull others)
"${pip[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$pyver" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    --dest "$dest" "fla-core==$fla" einops
total=$(du -cb "$dest"/*.whl | tail -n 1 | cut -f 1)
ls -l "$dest"/*.whl
echo "$dest: $total bytes in $(find "$dest" -name '*.whl' | wc -l) wheels"
if (( total > limit_bytes )); then
    echo "gpu_wheels.sh: $dest holds $total bytes, over the $limit_bytes carried with the tree; remove the wheels not listed above" >&2
    exit 1
fi
