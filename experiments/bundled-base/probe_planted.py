#!/usr/bin/env python
"""`genolong probe` on a model trained on planted repeats: recall at the distances it was trained on, none beyond?

A small GenoLM (the `tiny` preset's geometry with ``--pattern`` layers and dense FFNs; default
"K": one KDA layer, whose delta rule with its short convolution can learn to copy) is trained from
scratch on random DNA (A/C/G/T uniform) in windows of ``--context`` bases in which every window
turns periodic at a random point: ``x[t] = x[t - p]`` from there on, the period ``p`` uniform in
``[m + 1, --max-distance]``. So the model sees repeats at every distance up to ``--max-distance``
and at none beyond. Then ``genolong probe`` (:func:`genolong.evaluation.probe.probe`) runs on
held-out random DNA (another seed) in tiles of the same ``--context`` (the model is never asked
for positions it was not trained at) at the distances ``2m .. context - m``: the drop (cut - full)
should be clearly above zero at the trained distances and is measured beyond them.

Random DNA has no structure but the planted copy: any drop is recall of the source and nothing
else, and the loss outside the copy is ln 4 = 1.386 nats.

tests/evaluation/test_probe.py runs the small version of this scenario (tests/scenarios.py, :data:`SMALL`).

Example::

    python experiments/bundled-base/probe_planted.py --context 64 --max-distance 16 --batch 16 --steps 600

Prints the probe table and writes JSON (default experiments/bundled-base/results/probe_planted.json).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "benchmarks"
sys.path.append(str(BENCH))  # benchmarks/_bench.py (and benchmarks/quickstart_heldout.py)
sys.path.append(str(HERE))  # the other scripts of experiments/bundled-base/
from _bench import environment, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "probe_planted.json"
sys.path.append(str(HERE.parents[1]))  # the repository root: tests/scenarios.py
from tests.scenarios import (  # noqa: E402,F401
    SMALL,
    RandomSplit,
    planted_batch,
    planted_config,
    planted_probe,
    random_split,
    train_planted,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", default="K", help="layers, K = KDA, D = DSA (default: %(default)s)")
    parser.add_argument("--context", type=int, default=128, help="training window = probe tile (default: %(default)s)")
    parser.add_argument("--repeat-bases", type=int, default=4, help="m (default: %(default)s)")
    parser.add_argument(
        "--max-distance", type=int, default=32, help="largest repeat distance trained (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=600, help="optimiser steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="windows per step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--tiles", type=int, default=32, help="probe tiles (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="output JSON (default: %(default)s)")
    args = parser.parse_args()

    import tempfile

    from genolong.evaluation.report import format_probe_table

    torch.set_num_threads(args.threads)
    model, curve = train_planted(
        args.pattern, args.context, args.repeat_bases, args.max_distance, args.steps, args.batch, args.lr, verbose=True
    )
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = planted_probe(model, args.context, args.repeat_bases, args.tiles, Path(tmp) / "probe")
    probe_seconds = time.perf_counter() - began
    table = result.table()
    inside = table["distance"] <= args.max_distance
    print(
        f"probe_planted: `tiny` geometry, layers {args.pattern}, trained {args.steps} steps of {args.batch} x "
        f"{args.context} bases with repeats at distances <= {args.max_distance} (lr {args.lr:g}; "
        f"{curve[-1]['seconds']:.0f} s); probe of {args.tiles} random-DNA tiles of {args.context}, m = "
        f"{args.repeat_bases} ({probe_seconds:.1f} s)"
    )
    print(format_probe_table(table))
    print(
        f"distances trained (d <= {args.max_distance}): drop CI above 0 at "
        f"{int((table['supported'] & (table['drop'] > 0))[inside].sum())} of {int(inside.sum())}; beyond: CI excludes 0 at "
        f"{int(table['supported'][~inside].sum())} of {int((~inside).sum())}"
    )
    rows = [
        {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
        for r in table.to_dict(orient="records")
    ]
    record = {
        "benchmark": "probe_planted",
        **environment("date"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s)",
        "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "training_curve": curve,
        "probe_seconds": probe_seconds,
        "table": rows,
    }
    write_json(args.json, record, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
    print(f"written {args.json}")


if __name__ == "__main__":
    main()
