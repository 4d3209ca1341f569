#!/usr/bin/env python
"""Each attempt's own steps on the spread: fine-tuned vs the base read with the same key budget.

Reads the spread JSONs that ``attempt.sh`` wrote (``experiments/long-recipe/results/NAME.json``, from
``benchmarks/heldout_spread.py --models base-read,tuned``) and prints, per attempt, the pooled change
``tuned - base-read`` in percent with its regions-then-tiles 95% interval and the range across the
four regions, overall and per context bucket, plus the training loss of its steps::

    python experiments/long-recipe/summarize.py [NAME ...]   # default: every results/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parents[1] / "benchmarks"))  # heldout_spread.pooled_from_json
from heldout_spread import pooled_from_json  # noqa: E402

COMPARISON = "tuned - base-read"


def main() -> None:
    """Print the table (markdown) for the attempts named on the command line, or all of them."""
    names = sys.argv[1:] or sorted(p.stem for p in (HERE / "results").glob("*.json"))
    print(f"| attempt | steps' train loss | <1k | 1k-2k | 2k-4k | 4k-8k | all |\n|---|---|---|---|---|---|---|")
    for name in names:
        doc = json.loads((HERE / "results" / f"{name}.json").read_text())
        buckets = [*next(iter(doc["regions"].values()))["buckets"], "all"]
        cells = []
        for b in buckets:
            p = pooled_from_json(doc, COMPARISON, b)
            cells.append(f"{p['change_pct']:+.2f}% [{p['ci'][0]:+.2f}, {p['ci'][1]:+.2f}] "
                         f"({p['range'][0]:+.2f} .. {p['range'][1]:+.2f})")
        steps = HERE / "results" / f"{name}.steps.jsonl"
        losses = [json.loads(line)["train/loss"] for line in steps.read_text().splitlines()] if steps.is_file() else []
        print(f"| {name} | {' '.join(f'{x:.3f}' for x in losses)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
