#!/usr/bin/env python
"""Each attempt's own steps on the spread: fine-tuned vs the base read with the same key budget.

Reads the spread JSONs that ``attempt.sh`` wrote (``experiments/long-recipe/results/NAME.json``, from
``benchmarks/heldout_spread.py --models base-read,tuned``) and prints, per attempt, the pooled change
``tuned - base-read`` in percent with its regions-then-tiles 95% interval and the range across the
four regions, overall and per context bucket, plus the training loss of its steps::

    python experiments/long-recipe/summarize.py [NAME ...]   # default: quickstart-default and every results/*.json

``quickstart-default`` (the default recipe's 6 steps) reads benchmarks/results/heldout_spread.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parents[1] / "benchmarks"))  # heldout_spread.pooled_from_json
from heldout_spread import pooled_from_json  # noqa: E402

COMPARISON = "tuned - base-read"
SPREAD_JSON = HERE.parents[1] / "benchmarks" / "results" / "heldout_spread.json"


def main() -> None:
    """Print the table (markdown) for the attempts named on the command line, or all of them."""
    found = {p.name.split(".")[0] for p in (HERE / "results").glob("*.json*")}  # NAME.json, NAME.steps.jsonl
    names = sys.argv[1:] or ["quickstart-default", *sorted(found - {"quickstart-default"})]
    print("| attempt | steps' train loss | <1k | 1k-2k | 2k-4k | 4k-8k | all |\n|---|---|---|---|---|---|---|")
    for name in names:
        path = HERE / "results" / f"{name}.json"
        if name == "quickstart-default" and not path.is_file():  # the default recipe: the product's own spread JSON
            path = SPREAD_JSON
        steps = HERE / "results" / f"{name}.steps.jsonl"
        records = [json.loads(line) for line in steps.read_text().splitlines()] if steps.is_file() else []
        losses = " ".join(
            f"{r['train/loss']:.3f}" for r in records if "train/loss" in r
        )  # the end-of-run eval line has none
        if not path.is_file():
            print(f"| {name} | {losses} | not scored on the spread | | | | |")
            continue
        doc = json.loads(path.read_text())
        buckets = [*next(iter(doc["regions"].values()))["buckets"], "all"]
        cells = []
        for b in buckets:
            p = pooled_from_json(doc, COMPARISON, b)
            cells.append(
                f"{p['change_pct']:+.2f}% [{p['ci'][0]:+.2f}, {p['ci'][1]:+.2f}] "
                f"({p['range'][0]:+.2f} .. {p['range'][1]:+.2f})"
            )
        print(f"| {name} | {losses} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
