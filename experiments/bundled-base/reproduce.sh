#!/usr/bin/env bash
# Reproduce the bundled base model (data/sample/base/) from the bundled sample, by one command:
#
#   bash experiments/bundled-base/reproduce.sh [OUT]      # OUT defaults to data/sample/base
#
# Runs from the repository root (the recipes' paths are relative to it): prepares the sample store
# (genolong-quickstart/genome), then the five stages of the chain in order, each starting from the
# one before's export (runs/sample-base-*/export), then writes the last export in bfloat16 to OUT.
# About 80 minutes on one CPU core (78:44 measured beside another run); LOG.md has the figures.
# DRY_RUN=1 prints the commands without running them.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${1:-data/sample/base}"
cd "$ROOT"

STAGES=(
  "$HERE/recipes/sample-base-1-copy.yaml"      # 800 x 16 x 64:  one exact copy 32 bases back in every window
  "$HERE/recipes/sample-base-2-match.yaml"     # 400 x 8 x 128:  copies 32-96 back (match on content, not place)
  "$HERE/recipes/sample-base-3-far.yaml"       # 300 x 1 x 1024: six copies up to 960 back
  "$HERE/recipes/sample-base-4-diverged.yaml"  # 300 x 1 x 1024: half the windows as stored, half with diverged copies
  "$ROOT/recipes/sample-base.yaml"             # 100 x 2 x 1024: the MoE routers alone (shipped: the quickstart reads it)
)

run() {
  echo "+ $*"
  if [[ "${DRY_RUN:-0}" != 1 ]]; then "$@"; fi
}

run genolong quickstart --prepare-only
for recipe in "${STAGES[@]}"; do
  run genolong finetune "$recipe"
done
run python -c "import sys, torch; from genolong.model import GenoLM; \
GenoLM.from_pretrained('runs/sample-base/export').save_pretrained(sys.argv[1], dtype=torch.bfloat16)" "$OUT"
