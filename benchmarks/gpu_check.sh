#!/usr/bin/env bash
# One-shot GPU check (issue 7) for a lent H200: kernel correctness at 32k, the DSA layer against
# dense causal SDPA at 32k/128k, and the 1b preset's tokens/s and peak memory at 32k/128k with and
# without offload. Runs in under 8 minutes and writes $OUT/gpu_check.json (see
# benchmarks/gpu_check.py for the fields) plus $OUT/nvidia-smi.txt and $OUT/gpu_check.log.
#
# The device machine has no network: nothing is downloaded. It uses $PYTHON, else the repository's
# .venv, else python3; if genolong is not importable it is installed editable from the local files
# only (pip --no-index --no-deps). torch (CUDA build), triton and fla-core must already be there.
#
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]     (default: $OUT, else benchmarks/results)
# Extra arguments for gpu_check.py can go in $GPU_CHECK_ARGS (e.g. "--parts correctness").
set -euo pipefail

cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-benchmarks/results}}"
mkdir -p "$out_dir"
limit_s="${GPU_CHECK_TIMEOUT_S:-470}"   # hard limit for the python run (the script's own budget is lower)

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi

echo "== $(date -u +%FT%TZ) gpu_check on $(hostname)"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi | tee "$out_dir/nvidia-smi.txt"
else
    echo "nvidia-smi not found" | tee "$out_dir/nvidia-smi.txt"
fi

"$py" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
EOF

if ! "$py" -c "import genolong.kernels" >/dev/null 2>&1; then
    echo "genolong not importable: installing it from the local checkout (no network, no deps)"
    "$py" -m pip install --no-index --no-deps --no-build-isolation -q -e .
fi

rc=0
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of words on purpose
timeout --signal=TERM --kill-after=15 "$limit_s" \
    "$py" benchmarks/gpu_check.py --out "$out_dir/gpu_check.json" --budget-s "$((limit_s - 90))" ${GPU_CHECK_ARGS:-} \
    2>&1 | tee "$out_dir/gpu_check.log" || rc=$?
if [[ $rc -ne 0 ]]; then
    echo "gpu_check.py exited with $rc (124: timed out after ${limit_s}s); the JSON keeps what it had measured"
fi
if [[ -f "$out_dir/gpu_check.json" ]]; then
    echo "== $out_dir/gpu_check.json"
    cat "$out_dir/gpu_check.json"
fi
exit "$rc"
