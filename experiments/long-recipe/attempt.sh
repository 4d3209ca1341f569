#!/usr/bin/env bash
# One attempt at a fine-tune whose own steps read further (issue 49 item 3): fine-tune the bundled base
# with recipes/quickstart.yaml plus the --set overrides given, then score the export on the spread
# (benchmarks/heldout_spread.py, 4 tiles per region, scored region by region in parallel) against the base read with the same 2,048 keys.
#
#   bash experiments/long-recipe/attempt.sh NAME QS BASE_WORK [--set KEY=VALUE ...]
#
# NAME: the attempt (outputs in $OUT/NAME, default OUT=/tmp/long-recipe); QS: a `genolong quickstart`
# directory (its genome store trains and scores chr22); BASE_WORK: a heldout_spread.py --work directory
# holding the base-read runs at --tiles 4 (copied, so they are not scored again). One torch thread.
# Writes experiments/long-recipe/results/NAME.json (the spread JSON) and NAME.steps.jsonl (the steps).
set -euo pipefail
name=$1; qs=$(realpath "$2"); base_work=$(realpath "$3"); shift 3
out=${OUT:-/tmp/long-recipe}/$name
here=$(dirname "$0")
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$out" "$here/results"
if [ ! -f "$out/run/export/config.json" ]; then
  start=$(date +%s)
  genolong finetune recipes/quickstart.yaml --set name="$name" --set data.store="$qs/genome" \
    --set checkpoint.dir="$out/run/checkpoints" --set logging.dir="$out/run/logs" --set eval.every_n_steps=0 \
    --set checkpoint.every_n_steps=0 --set logging.tensorboard=false --set logging.progress_bar=false "$@"
  echo "finetune seconds: $(( $(date +%s) - start ))" | tee "$out/finetune_seconds.txt"
fi
cp "$out/run/logs/steps.jsonl" "$here/results/$name.steps.jsonl"
# a quickstart-shaped directory: the store and this attempt's export where heldout_spread.py looks
mkdir -p "$out/qs/runs/quickstart"
ln -sfn "$qs/genome" "$out/qs/genome"
ln -sfn "$out/run/export" "$out/qs/runs/quickstart/export"
mkdir -p "$out/work"
for d in "$base_work"/store-* "$base_work"/*-8192-4-base-read; do
  [ -e "$out/work/$(basename "$d")" ] || cp -r "$d" "$out/work/"
done
# one process per region (score_parallel.sh), then the combining run: the figures of one sequential run
bash "$here/score_parallel.sh" "$out/qs" "$out/work" "$here/results/$name.json" tuned --models "base-read,tuned"
