#!/usr/bin/env python
"""A collapsed MoE router on `tiny` (8 experts, top-2) and the balancing options that bring it back, on CPU.

Every MoE layer of `tiny` (with 8 routed experts instead of 4) starts collapsed: expert 0's gate
row is set to 10x the layer's mean input over its squared norm, a logit of about 10 on every
token, so expert 0 takes every token (load max/mean 4.0, the most top-2 of 8 allows). Then 50
optimiser steps (AdamW, lr 1e-3, one 256-token window of real human DNA per step, chr3 of the
bundled sample) with each balancing configuration, through ``GenoLMModule`` and Lightning as
``genolong finetune`` trains; the table is the worst MoE layer's load max/mean every 10 steps and
at step 50. One torch thread; deterministic (the same figures on every run on one machine).

tests/model/test_moe_balance.py runs the same scenario (tests/scenarios.py) for two of the configurations.

Example::

    python experiments/bundled-base/moe_collapse.py                 # every configuration (about 15 s each)

Prints a table and writes JSON (default experiments/bundled-base/results/moe_collapse.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "benchmarks"
sys.path.append(str(BENCH))  # benchmarks/_bench.py (and benchmarks/quickstart_heldout.py)
sys.path.append(str(HERE))  # the other scripts of experiments/bundled-base/
from _bench import environment, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "moe_collapse.json"
sys.path.append(str(HERE.parents[1]))  # the repository root: tests/scenarios.py
from tests.scenarios import STEPS, WINDOW, collapsed_tiny, sample_windows, train_collapsed  # noqa: E402,F401

#: name -> OptimSettings fields
CONFIGS: dict[str, dict[str, Any]] = {
    "sign 0.001 (DeepSeek-V3)": {"moe_bias_rate": 0.001},
    "proportional 0.01": {"moe_bias_rate": 0.01, "moe_bias_update": "proportional"},
    "proportional 0.03": {"moe_bias_rate": 0.03, "moe_bias_update": "proportional"},
    "proportional 0.1": {"moe_bias_rate": 0.1, "moe_bias_update": "proportional"},
    "loss 0.01": {"moe_bias_rate": 0.0, "moe_balance_loss_weight": 0.01},
    "loss 0.03": {"moe_bias_rate": 0.0, "moe_balance_loss_weight": 0.03},
    "loss 0.1": {"moe_bias_rate": 0.0, "moe_balance_loss_weight": 0.1},
    "loss 0.01 + proportional 0.01": {
        "moe_bias_rate": 0.01,
        "moe_bias_update": "proportional",
        "moe_balance_loss_weight": 0.01,
    },
    "loss 0.1 + proportional 0.01": {
        "moe_bias_rate": 0.01,
        "moe_bias_update": "proportional",
        "moe_balance_loss_weight": 0.1,
    },
    "loss 0.1 + sign 0.001": {"moe_bias_rate": 0.001, "moe_balance_loss_weight": 0.1},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="output JSON (default: %(default)s)")
    args = parser.parse_args()
    import logging
    import warnings

    import lightning  # noqa: F401  (configures its loggers on import: quieted below, after it)
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("genolong").setLevel(logging.ERROR)  # the collapse warning, once per run
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    windows = sample_windows()
    rows = []
    print("tiny, 8 experts top-2, collapsed onto expert 0; worst MoE layer's load max/mean (4.0: collapsed)\n")
    print("| configuration | step 1 | 10 | 20 | 30 | 40 | 50 | mean of 46-50 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, optim in CONFIGS.items():
        worst = train_collapsed(windows, **optim)
        rows.append({"config": name, "optim": optim, "worst_by_step": worst})
        picks = [worst[0]] + [worst[i - 1] for i in (10, 20, 30, 40, 50)]
        tail = sum(worst[-5:]) / 5
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in picks) + f" | {tail:.2f} |", flush=True)
    out = {
        "benchmark": "moe_collapse",
        **environment("date", "machine", "torch"),
        "window": WINDOW,
        "steps": STEPS,
        "rows": rows,
    }
    write_json(args.json, out)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
