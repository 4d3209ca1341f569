#!/usr/bin/env bash
# One-shot GPU check (issues 7 and 43): kernel correctness at 32k, the DSA layer against dense
# causal SDPA at 32k/128k, the 1b preset's tokens/s and peak memory at 32k/128k with and without
# offload, and fla-core's KDA last, each part in a process of its own with its own time budget
# (benchmarks/gpu_check.py says what each records). Ends within 8 minutes on an H100/H200 and
# writes $OUT_DIR/gpu_check.json (rewritten after every part), gpu_check.log and nvidia-smi.txt.
#
# Made for a GPU node as it comes: a locked image with a CUDA build of torch and its triton, no
# network, no pip, and none of genolong's other dependencies. Nothing is downloaded or installed,
# and nothing is written outside OUT_DIR and one temporary folder (removed at the end):
# - the interpreter is $PYTHON (e.g. an image's /opt/torch/.venv/bin/python3), else the first of
#   the checkout's .venv/bin/python and every python3 on PATH that imports torch with CUDA, else
#   (CPU mode: --small, Triton's interpreter) the first of them that imports torch; it says which;
# - genolong is imported straight from this checkout: the temporary folder holds a `genolong`
#   package made of symlinks (genolong/*, kernels/ as genolong/kernels, evaluation/ as
#   genolong/evaluation, as pyproject's package-dir maps them) and goes first on PYTHONPATH; the
#   checkout's root is never on sys.path, so its kernels/ folder is never a top-level `kernels`;
# - the wheels in $GPU_WHEELS (default .gpu-wheels, filled by benchmarks/gpu_wheels.sh: fla-core
#   and einops, ~1.1 MB; git-ignored, so carry it with the tree) are unzipped into the temporary
#   folder and put on PYTHONPATH, except those whose distribution the interpreter already has;
# - byte-code, Triton's and other caches and HOME point into the temporary folder.
#
# Usage: [PYTHON=/path/to/python3] bash benchmarks/gpu_check.sh [OUT_DIR]
#        (OUT_DIR default: $OUT, else benchmarks/results)
# Extra arguments for gpu_check.py go in $GPU_CHECK_ARGS (e.g. "--parts dsa,model"); GPU_CHECK_SMALL=1
# forces the CPU-sized run; GPU_CHECK_TIMEOUT_S (default 470) is the hard limit of the Python run.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
out_dir="${1:-${OUT:-$root/benchmarks/results}}"
mkdir -p "$out_dir"
out_dir="$(cd "$out_dir" && pwd)"
cd "$root"
limit_s="${GPU_CHECK_TIMEOUT_S:-470}"   # hard limit for the python run; its parts' budgets total 420 s
wheels="${GPU_WHEELS:-$root/.gpu-wheels}"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

echo "== $(date -u +%FT%TZ) gpu_check on $(hostname)"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi | tee "$out_dir/nvidia-smi.txt" || true
else
    echo "nvidia-smi not found" | tee "$out_dir/nvidia-smi.txt"
fi

# -- the interpreter --------------------------------------------------------------------------
probe='import torch; print("cuda" if torch.cuda.is_available() else "cpu")'
mode=""
if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
    mode="$("$py" -c "$probe" 2>/dev/null | tail -n 1)" || {
        echo "gpu_check.sh: \$PYTHON=$PYTHON cannot import torch; set PYTHON to the interpreter that holds torch" >&2
        exit 2
    }
    why="\$PYTHON"
else
    candidates=()
    [[ -x .venv/bin/python ]] && candidates+=("$root/.venv/bin/python")
    while IFS= read -r found; do candidates+=("$found"); done < <(type -ap python3 || true)
    py="" ; cpu_py=""
    for cand in "${candidates[@]}"; do
        m="$("$cand" -c "$probe" 2>/dev/null | tail -n 1)" || continue
        if [[ "$m" == cuda ]]; then py="$cand"; mode=cuda; break; fi
        [[ -z "$cpu_py" && "$m" == cpu ]] && cpu_py="$cand"
    done
    if [[ -z "$py" && -n "$cpu_py" ]]; then py="$cpu_py"; mode=cpu; fi
    if [[ -z "$py" ]]; then
        echo "gpu_check.sh: no python3 here imports torch (tried: ${candidates[*]:-none}); set PYTHON=/path/to/python3" >&2
        exit 2
    fi
    if [[ "$mode" == cuda ]]; then
        why="the first of [${candidates[*]}] that imports torch with CUDA"
    else
        why="none of [${candidates[*]}] imports torch with CUDA: the first that imports torch"
    fi
fi
echo "python: $py ($why; torch sees ${mode^^})"

small=()
if [[ "$mode" != cuda || "${GPU_CHECK_SMALL:-0}" == 1 ]]; then
    small=(--small)
    export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"   # the Triton op runs in Triton's CPU interpreter
    echo "no CUDA (or GPU_CHECK_SMALL=1): CPU mode, --small (checks the script, not the kernels)"
fi

# -- genolong from the checkout, wheels from $wheels, caches in $tmp ----------------------------
src="$tmp/src"
mkdir -p "$src/genolong" "$tmp/wheels" "$tmp/home"
for entry in genolong/*; do
    [[ "$(basename "$entry")" == __pycache__ ]] && continue
    ln -s "$root/$entry" "$src/genolong/"
done
# pyproject.toml's [tool.setuptools.package-dir]
ln -s "$root/kernels" "$src/genolong/kernels"
ln -s "$root/evaluation" "$src/genolong/evaluation"
ln -s "$root/data" "$src/genolong/bundled"
ln -s "$root/recipes" "$src/genolong/recipes"

shopt -s nullglob
for whl in "$wheels"/*.whl; do
    dist="$(basename "$whl" | cut -d- -f1)"
    if have="$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist" 2>/dev/null)"; then
        echo "wheel $(basename "$whl"): skipped, $dist $have is installed"
        continue
    fi
    "$py" -m zipfile -e "$whl" "$tmp/wheels"
    echo "wheel $(basename "$whl"): unpacked"
done
shopt -u nullglob

export PYTHONPATH="$src:$tmp/wheels${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPYCACHEPREFIX="$tmp/pycache" PYTHONNOUSERSITE=1
export HOME="$tmp/home" XDG_CACHE_HOME="$tmp/cache" TRITON_CACHE_DIR="$tmp/triton" \
    TORCHINDUCTOR_CACHE_DIR="$tmp/inductor" CUDA_CACHE_PATH="$tmp/nv" MPLCONFIGDIR="$tmp/mpl"

# (from $tmp: `python -` puts its working directory first on sys.path, and the checkout's root
# holds genolong/ without kernels/ in it)
(cd "$tmp" && "$py" - <<'EOF'
import importlib.metadata as md, importlib.util, platform, sys
import torch
import genolong.kernels.backends

def dist(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

top = importlib.util.find_spec("kernels")
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "triton", dist("triton"), "fla-core", dist("fla-core"),
      "numpy", dist("numpy"))
print("genolong from", genolong.kernels.backends.__file__.rsplit("/kernels/", 1)[0],
      "; top-level kernels:", top.origin if top else None)
EOF
)

rc=0
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of words on purpose
timeout --signal=TERM --kill-after=15 "$limit_s" \
    "$py" benchmarks/gpu_check.py --out "$out_dir/gpu_check.json" --budget-s "$((limit_s - 50))" \
    "${small[@]}" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$out_dir/gpu_check.log" || rc=$?
if [[ $rc -ne 0 ]]; then
    echo "gpu_check.py exited with $rc (124: timed out after ${limit_s}s); the JSON keeps what it had measured"
fi
if [[ -f "$out_dir/gpu_check.json" ]]; then
    echo "== $out_dir/gpu_check.json"
    cat "$out_dir/gpu_check.json"
fi
exit "$rc"
