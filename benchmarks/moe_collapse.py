#!/usr/bin/env python
"""A collapsed MoE router on `tiny` (8 experts, top-2) and the balancing options that bring it back, on CPU.

Every MoE layer of `tiny` (with 8 routed experts instead of 4) starts collapsed: expert 0's gate
row is set to 10x the layer's mean input over its squared norm, a logit of about 10 on every
token, so expert 0 takes every token (load max/mean 4.0, the most top-2 of 8 allows). Then 50
optimiser steps (AdamW, lr 1e-3, one 256-token window of real human DNA per step, chr3 of the
bundled sample) with each balancing configuration, through ``GenoLMModule`` and Lightning as
``genolong finetune`` trains; the table is the worst MoE layer's load max/mean every 10 steps and
at step 50. One torch thread; deterministic (the same figures on every run on one machine).

tests/test_moe_balance.py runs the same scenario (these functions) for two of the configurations.

Example::

    python benchmarks/moe_collapse.py                 # every configuration (about 15 s each)

Prints a table and writes JSON (default benchmarks/results/moe_collapse.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402
DEFAULT_JSON = HERE / "results" / "moe_collapse.json"
WINDOW = 256
STEPS = 50
#: name -> OptimSettings fields
CONFIGS: dict[str, dict[str, Any]] = {
    "sign 0.001 (DeepSeek-V3)": {"moe_bias_rate": 0.001},
    "proportional 0.01": {"moe_bias_rate": 0.01, "moe_bias_update": "proportional"},
    "proportional 0.03": {"moe_bias_rate": 0.03, "moe_bias_update": "proportional"},
    "proportional 0.1": {"moe_bias_rate": 0.1, "moe_bias_update": "proportional"},
    "loss 0.01": {"moe_bias_rate": 0.0, "moe_balance_loss_weight": 0.01},
    "loss 0.03": {"moe_bias_rate": 0.0, "moe_balance_loss_weight": 0.03},
    "loss 0.1": {"moe_bias_rate": 0.0, "moe_balance_loss_weight": 0.1},
    "loss 0.01 + proportional 0.01": {"moe_bias_rate": 0.01, "moe_bias_update": "proportional", "moe_balance_loss_weight": 0.01},
    "loss 0.1 + proportional 0.01": {"moe_bias_rate": 0.01, "moe_bias_update": "proportional", "moe_balance_loss_weight": 0.1},
    "loss 0.1 + sign 0.001": {"moe_bias_rate": 0.001, "moe_balance_loss_weight": 0.1},
}


def sample_windows(n: int = 60) -> list[dict[str, Any]]:
    """``n`` training windows ``{"tokens": [WINDOW] int64}`` of real human DNA (the bundled
    sample's chr3 slice, random starts, seed 0)."""
    import numpy as np
    import pysam
    import torch

    from genolong.data.alphabet import encode
    from genolong.quickstart import sample_fasta

    with pysam.FastaFile(str(sample_fasta())) as fasta:
        tokens = encode(fasta.fetch("chr3:42000000-44000000", 0, 300_000))
    starts = np.random.default_rng(0).integers(0, len(tokens) - WINDOW, n)
    return [{"tokens": torch.from_numpy(tokens[s:s + WINDOW].astype(np.int64))} for s in starts]


def collapsed_tiny(windows: list[dict[str, Any]], scale: float = 10.0) -> Any:
    """`tiny` with 8 experts, every MoE layer collapsed onto expert 0 (see the module docstring)."""
    import torch

    from genolong.model import PRESETS, GenoLM
    from genolong.model.moe import MoE

    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"].replace(n_routed_experts=8))
    inputs: dict[Any, torch.Tensor] = {}
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    hooks = [m.register_forward_hook(lambda mod, args, out: inputs.__setitem__(mod, args[0].reshape(-1, args[0].shape[-1])))
             for m in moes]
    with torch.no_grad():
        model(torch.stack([w["tokens"] for w in windows[:4]]))
        for hook in hooks:
            hook.remove()
        for moe in moes:
            mean = inputs[moe].mean(0)
            moe.gate.weight[0] = scale * mean / mean.square().sum()
    return model


def train_collapsed(windows: list[dict[str, Any]], steps: int = STEPS, collapse_steps: int = 5, **optim: Any) -> list[float]:
    """Train :func:`collapsed_tiny` for ``steps`` steps with ``OptimSettings(**optim)``; returns
    the worst MoE layer's load max/mean (``train/moe_load_max_over_mean``) of every step."""
    import lightning as L
    from torch.utils.data import DataLoader

    from genolong.train.module import GenoLMModule, OptimSettings

    class Worst(L.Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            self.steps.append(float(trainer.callback_metrics["train/moe_load_max_over_mean"]))

    module = GenoLMModule(lambda: collapsed_tiny(windows), OptimSettings(lr=1e-3, min_lr=1e-4, max_steps=steps, **optim),
                          moe_collapse_steps=collapse_steps)
    worst = Worst()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0, callbacks=[worst])
    trainer.fit(module, train_dataloaders=DataLoader(windows, batch_size=1))
    return worst.steps


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
    out = {"benchmark": "moe_collapse", **environment("date", "machine", "torch"), "window": WINDOW, "steps": STEPS,
           "rows": rows}
    write_json(args.json, out)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
