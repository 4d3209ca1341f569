#!/usr/bin/env bash
# benchmarks/heldout_spread.py with its scoring split into one-thread processes, one per region,
# then the combining run (every run cached in WORK: it only compares and writes JSON). The figures are
# those of one sequential run; only the wall time differs (for a deadline on a shared machine).
#
#   bash experiments/long-recipe/score_parallel.sh QS WORK JSON "RUNS TO SCORE" [--models M]
#
# RUNS TO SCORE: comma-separated runs missing from WORK, e.g. "tuned,tuned cut".
set -euo pipefail
qs=$1; work=$2; json=$3; runs=$4; shift 4
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
pids=()
for region in chr22 HLA chr16 chrM; do
  python benchmarks/heldout_spread.py --quickstart "$qs" --tiles 4 --threads 1 --work "$work" --regions "$region" \
    --only "$runs" "$@" > "$work/score-$region.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
python benchmarks/heldout_spread.py --quickstart "$qs" --tiles 4 --threads 1 --work "$work" --json "$json" "$@"
