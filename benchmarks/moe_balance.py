#!/usr/bin/env python
"""What the MoE routing statistics, the balance loss and the capacity drop cost per training step, on CPU.

For the ``small`` preset (fp32, batch 1, its 7 MoE layers of 8 experts top-2) at T tokens (default
8,192) of real human DNA from the bundled sample, one forward + backward of ``GenoLM.loss`` per
configuration, in one process, one torch thread:

- ``baseline``: loads counted (the bias balancing needs them), no router entropy, no balance
  loss, no capacity;
- ``stats``: + the router entropy of every token (``MoE.routing_entropy``, what the per-layer
  statistics add in the model);
- ``stats+loss``: + the sequence-wise balance loss (``MoE.balance_loss_weight``);
- ``stats+capacity``: + a capacity factor of 1.25 (``MoE.capacity_factor``);
- ``all``: the three together.

The configurations alternate within each round (forward order, then reversed), and each one's
best round (least step time) is compared with ``baseline``'s: the ratio is the cost (1.00 = free).
Also timed: the trainer's per-step reduction of the statistics (``GenoLMModule._reduce_moe_loads``
and the per-layer summaries it logs), against the step.

Example::

    python benchmarks/moe_balance.py                  # T = 8192, 5 rounds
    python benchmarks/moe_balance.py --tokens 2048 --rounds 3

Prints a table and writes JSON (default benchmarks/results/moe_balance.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "moe_balance.json"
CONFIGS: dict[str, dict[str, Any]] = {
    "baseline": {"routing_entropy": False, "balance_loss_weight": 0.0, "capacity_factor": None},
    "stats": {"routing_entropy": True, "balance_loss_weight": 0.0, "capacity_factor": None},
    "stats+loss": {"routing_entropy": True, "balance_loss_weight": 0.03, "capacity_factor": None},
    "stats+capacity": {"routing_entropy": True, "balance_loss_weight": 0.0, "capacity_factor": 1.25},
    "all": {"routing_entropy": True, "balance_loss_weight": 0.03, "capacity_factor": 1.25},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all configurations (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="output JSON (default: %(default)s)")
    args = parser.parse_args()

    import numpy as np
    import pysam
    import torch

    from genolong.data.alphabet import encode
    from genolong.model import GenoLM, ModelConfig
    from genolong.model.moe import MoE
    from genolong.quickstart import sample_fasta
    from genolong.train.module import GenoLMModule, OptimSettings

    torch.set_num_threads(1)
    with pysam.FastaFile(str(sample_fasta())) as fasta:
        tokens = torch.from_numpy(encode(fasta.fetch("chr4:103000000-105000000", 0, args.tokens)).astype(np.int64))[
            None
        ]
    torch.manual_seed(0)
    model = GenoLM(ModelConfig.from_preset("small"))
    moes = [m for m in model.modules() if isinstance(m, MoE)]

    def step(config: dict[str, Any]) -> float:
        for moe in moes:
            moe.routing_entropy = config["routing_entropy"]
            moe.balance_loss_weight = config["balance_loss_weight"]
            moe.capacity_factor = config["capacity_factor"]
        model.zero_grad(set_to_none=True)
        began = time.perf_counter()
        nll, weight = model.loss(tokens)
        (nll / weight).backward()
        return time.perf_counter() - began

    step(CONFIGS["all"])  # warm-up: first-call allocations and dispatch
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            times[name].append(step(CONFIGS[name]))
    # the trainer's reduction and summaries of this step's statistics (one process: no collective)
    module = GenoLMModule(lambda: model, OptimSettings())
    module.configure_model()
    step(CONFIGS["all"])
    began = time.perf_counter()
    for _ in range(20):
        module._reduce_moe_loads()
        [s.summary() for s in module._step_routing]
    reduce_s = (time.perf_counter() - began) / 20

    best = {name: min(values) for name, values in times.items()}
    rows = [
        {
            "config": name,
            "best_step_s": best[name],
            "median_step_s": float(np.median(times[name])),
            "ratio_vs_baseline": best[name] / best["baseline"],
        }
        for name in CONFIGS
    ]
    print(f"small, T = {args.tokens:,}, fp32, 1 thread, {args.rounds} rounds (best round per configuration)\n")
    print(f"| {'configuration':16s} | best step (s) | median (s) | vs baseline |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['config']:16s} | {row['best_step_s']:.3f} | {row['median_step_s']:.3f} | {row['ratio_vs_baseline']:.3f}x |"
        )
    print(
        f"\ntrainer's reduction + summaries of the statistics: {reduce_s * 1e3:.2f} ms per step "
        f"({reduce_s / best['all']:.2%} of the step)"
    )
    out = {
        "benchmark": "moe_balance",
        **environment("date", "machine", "python", "torch"),
        "preset": "small",
        "tokens": args.tokens,
        "rounds": args.rounds,
        "configs": CONFIGS,
        "rows": rows,
        "times_s": times,
        "trainer_reduce_s": reduce_s,
    }
    write_json(args.json, out)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
