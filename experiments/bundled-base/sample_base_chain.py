#!/usr/bin/env python
"""A bundled base that reads far back (issue 29): staged ``genolong finetune`` chains, scored on held-out chr22.

Every stage is ``recipes/sample-base.yaml`` with the keys of :data:`STAGES` set (``--set``), started
from the export of the stage before it (the first from fresh weights). The stages teach the
``small`` preset to find and copy earlier material: windows of 64 to 4,096 bases with planted
copies of their own bases (``data.plant_repeats``), the KDA mixers frozen at their initial weights
throughout (LOG.md, "A copier that matches content"), and a last stage that trains the MoE
routers (and layer 0's dense FFN, which its freeze list does not name) to balance the experts.
The chains differ in how they keep the routing balanced (:data:`CHAINS`):

- ``P``: routers trained in every stage, routing-bias step 0.001 (proportional), balance loss 0.1;
- ``G``: as ``P`` in stage 1, then the routers frozen at stage 1's weights in stages 2-4 (the bias
  still moves);
- ``F``: as ``G``, with stage 4 at 4,096 bases and copies up to 4,000 back;
- ``Fa``, ``Fb``: ``F`` with a stronger last stage (bias step 0.01; balance loss 1.0);
- ``I``: as ``G`` with the routers frozen from the first step (at their initial weights);
- ``B``: as ``I`` but started from the bundled base (``recipes/sample-base.yaml`` as it is: its
  routers already tell tokens apart), instead of fresh weights.

A stage whose export exists is reused, so chains that share stages train them once; a killed
stage resumes when rerun (its checkpoint). After a chain: per stage the training log's MoE load
(the busiest expert over the mean per layer, mean of the last 50 steps); for the last stage
``genolong evaluate`` (8 held-out chr22 tiles of 8,192, the quickstart's) and ``genolong probe``
(the drop for a 100-base copy d bases back, ``--probe-context`` tiles), and how much its routers
tell tokens apart (:func:`router_token_spread`; also for the bundled base and stage 1).

Usage (about 75 minutes for chain F on one core; stage times in LOG.md)::

    python experiments/bundled-base/sample_base_chain.py --chain F --work runs/chains
    python experiments/bundled-base/sample_base_chain.py --chain P --chain G --work runs/chains --json /tmp/pg.json

Prints a table and writes JSON (default experiments/bundled-base/results/sample_base_chain.json).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "benchmarks"
sys.path.append(str(BENCH))  # benchmarks/_bench.py (and benchmarks/quickstart_heldout.py)
sys.path.append(str(HERE))  # the other scripts of experiments/bundled-base/
from _bench import environment, genolong_command, sample_store, write_json  # noqa: E402

ROOT = HERE.parents[1]
DEFAULT_JSON = HERE / "results" / "sample_base_chain.json"

#: The KDA mixers of the ``small`` preset (layers 0, 1, 4, 5, 6 of KKDDKKKD).
KDA = "layers.[01456].self_attn.*"
#: Every weight but the MoE routers (and layer 0's dense FFN: ``mlp.*_proj`` is not named).
ROUTERS_ONLY = [
    "embed_tokens.*",
    "lm_head.*",
    "norm.*",
    "layers.*.self_attn.*",
    "layers.*.mlp.experts.*",
    "layers.*.mlp.shared_experts.*",
    "layers.*.attn_hc.*",
    "layers.*.ffn_hc.*",
    "layers.*.input_layernorm.*",
    "layers.*.post_attention_layernorm.*",
]


def _plant(
    share: float, copies: int, length: tuple[int, int], distance: tuple[int, int], divergence: float
) -> dict[str, Any]:
    """A ``data.plant_repeats`` mapping: copies on the same strand, 10% of a diverged copy's edits indels."""
    return {
        "share": share,
        "copies": copies,
        "min_length": length[0],
        "max_length": length[1],
        "min_distance": distance[0],
        "max_distance": distance[1],
        "max_divergence": divergence,
        "indel_share": 0.1 if divergence else 0.0,
        "inverted": 0.0,
    }


def _stage(
    freeze: list[str],
    context: int,
    batch: int,
    plant: dict[str, Any],
    lr: float,
    min_lr: float,
    warmup: int,
    steps: int,
    bias: float = 0.001,
    balance: float = 0.1,
) -> dict[str, Any]:
    """The recipe keys one stage sets over ``recipes/sample-base.yaml``."""
    return {
        "model.freeze": freeze,
        "data.context": context,
        "data.batch_size": batch,
        "data.plant_repeats": plant,
        "train.lr": lr,
        "train.min_lr": min_lr,
        "train.warmup_steps": warmup,
        "train.max_steps": steps,
        "train.moe_bias_update": "proportional",
        "train.moe_bias_update_rate": bias,
        "train.moe_balance_loss_weight": balance,
    }


#: A chain's first entry: start from the bundled base (``recipes/sample-base.yaml`` as it is) instead of fresh weights.
BUNDLED = "bundled"
FROZEN_ROUTERS = [KDA, "layers.*.mlp.gate.weight"]
DIVERGED = _plant(0.5, 3, (24, 200), (32, 960), 0.1)
#: name -> the keys it sets. Stage 1 starts from fresh weights; the rest from the stage before.
STAGES: dict[str, dict[str, Any]] = {
    "1-copy": _stage([KDA], 64, 16, _plant(1.0, 1, (31, 31), (32, 32), 0.0), 3e-3, 3e-3, 20, 800),
    "2-match": _stage([KDA], 128, 8, _plant(1.0, 1, (24, 40), (32, 96), 0.0), 3e-3, 3e-3, 20, 400),
    "3-far": _stage([KDA], 1024, 1, _plant(1.0, 6, (24, 64), (32, 960), 0.0), 3e-3, 3e-3, 20, 300),
    "4-diverged": _stage([KDA], 1024, 1, DIVERGED, 1e-3, 1e-4, 10, 300),
    "1-copy-fr": _stage(FROZEN_ROUTERS, 64, 16, _plant(1.0, 1, (31, 31), (32, 32), 0.0), 3e-3, 3e-3, 20, 800),
    "2-match-fr": _stage(FROZEN_ROUTERS, 128, 8, _plant(1.0, 1, (24, 40), (32, 96), 0.0), 3e-3, 3e-3, 20, 400),
    "3-far-fr": _stage(FROZEN_ROUTERS, 1024, 1, _plant(1.0, 6, (24, 64), (32, 960), 0.0), 3e-3, 3e-3, 20, 300),
    "4-diverged-fr": _stage(FROZEN_ROUTERS, 1024, 1, DIVERGED, 1e-3, 1e-4, 10, 300),
    "4-far4k-fr": _stage(FROZEN_ROUTERS, 4096, 1, _plant(0.5, 4, (24, 200), (64, 4000), 0.1), 1e-3, 1e-4, 5, 60),
    "routers": _stage(ROUTERS_ONLY, 1024, 2, DIVERGED, 1e-3, 1e-3, 5, 100),
    "routers-bias01": _stage(ROUTERS_ONLY, 1024, 2, DIVERGED, 1e-3, 1e-3, 5, 100, bias=0.01),
    "routers-balance1": _stage(ROUTERS_ONLY, 1024, 2, DIVERGED, 1e-3, 1e-3, 5, 100, balance=1.0),
}
CHAINS: dict[str, list[str]] = {
    "P": ["1-copy", "2-match", "3-far", "4-diverged", "routers"],
    "G": ["1-copy", "2-match-fr", "3-far-fr", "4-diverged-fr", "routers"],
    "F": ["1-copy", "2-match-fr", "3-far-fr", "4-far4k-fr", "routers"],
    "Fa": ["1-copy", "2-match-fr", "3-far-fr", "4-far4k-fr", "routers-bias01"],
    "Fb": ["1-copy", "2-match-fr", "3-far-fr", "4-far4k-fr", "routers-balance1"],
    "I": ["1-copy-fr", "2-match-fr", "3-far-fr", "4-diverged-fr", "routers"],
    "B": [BUNDLED, "1-copy-fr", "2-match-fr", "3-far-fr", "4-diverged-fr", "routers"],
}


def _yaml(value: Any) -> str:
    """A ``--set`` value: YAML flow style (lists and mappings on one line)."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def stage_command(name: str, out: Path, start: Path | None, store: Path) -> list[str]:
    """``genolong finetune recipes/sample-base.yaml`` with stage ``name``'s keys, writing into ``out``."""
    keys = {
        **STAGES[name],
        "name": name,
        "model.checkpoint": start,
        "data.store": store,
        "eval.every_n_steps": 0,
        "checkpoint.dir": out / "checkpoints",
        "checkpoint.every_n_steps": 100,
        "logging.dir": out / "logs",
        "logging.progress_bar": False,
        "logging.tensorboard": False,
    }
    cmd = genolong_command("finetune", ROOT / "recipes" / "sample-base.yaml")
    for key, value in keys.items():
        cmd += ["--set", f"{key}={_yaml(str(value) if isinstance(value, Path) else value)}"]  # None: null
    return cmd


def train_routing(out: Path, last: int = 50) -> list[float]:
    """Per MoE layer, the busiest expert's load over the mean in the training log, mean of the last ``last`` steps."""
    frame = pd.read_csv(next(out.glob("logs/**/metrics.csv"))).dropna(subset=["train/loss"]).tail(last)
    columns = sorted(
        (c for c in frame.columns if c.endswith("/load_max_over_mean") and c.startswith("moe/")),
        key=lambda c: int(c.split("/")[1].removeprefix("layer")),
    )
    return [round(float(frame[c].mean()), 3) for c in columns]


def router_token_spread(checkpoint: Path, store: Path, bases: int = 2048) -> list[dict[str, Any]]:
    """How much each MoE layer's routing depends on the token, on the first ``bases`` held-out bases:
    ``score_token_std`` (the std over tokens of each expert's sigmoid score, mean over experts),
    ``choice_gap`` (the mean gap between a token's 2nd and 3rd highest score + bias: below one
    routing-bias step, the bias and not the token picks the experts) and ``bias_std``."""
    import numpy as np
    import torch

    from genolong.data.store import GenomeStore
    from genolong.model import GenoLM

    model = GenoLM.from_pretrained(checkpoint).eval()
    tokens = torch.as_tensor(
        np.asarray(GenomeStore.open(store, verify=False).split("eval").tokens[:bases]).astype(np.int64)
    )[None]
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [
        module.register_forward_hook(
            lambda mod, args, out, name=name: seen.__setitem__(name, (out[0], mod.e_score_correction_bias.clone()))
        )
        for name, module in model.named_modules()
        if name.endswith("mlp.gate")
    ]
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    rows = []
    for name, (logits, bias) in seen.items():
        scores = logits.sigmoid()
        choice = (scores + bias).sort(-1, descending=True).values
        rows.append(
            {
                "layer": int(name.split(".")[1]),
                "score_token_std": round(float(scores.std(0).mean()), 5),
                "choice_gap": round(float((choice[:, 1] - choice[:, 2]).mean()), 5),
                "bias_std": round(float(bias.std()), 5),
            }
        )
    return rows


def run(cmd: list[str], log: Path, env: dict[str, str]) -> float:
    """Run ``cmd`` with its output in ``log``; the wall-clock seconds. A failure names the log."""
    began = time.perf_counter()
    with log.open("w") as handle:
        if subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode:
            raise SystemExit(f"{' '.join(map(str, cmd[:4]))} ... failed; see {log}")
    return time.perf_counter() - began


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chain", action="append", choices=sorted(CHAINS), default=None, help="chains to run (default: F)")
    p.add_argument(
        "--work", type=Path, required=True, help="stage outputs: WORK/<stage>/<stage>/... (reused when rerun)"
    )
    p.add_argument("--store", type=Path, default=None, help="the sample store (default: prepare it in WORK/genome)")
    p.add_argument("--eval-tiles", type=int, default=8)
    p.add_argument("--probe-context", type=int, default=8192)
    p.add_argument("--distances", default="128,512,1024,2048,4096,6144")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    args.work.mkdir(parents=True, exist_ok=True)
    store = sample_store(args.store, args.work)
    from genolong.evaluation.probe_result import ProbeResult
    from genolong.evaluation.results import EvalResult
    from genolong.quickstart import bundled_base

    doc: dict[str, Any] = {"environment": environment(), "command": " ".join(sys.argv), "stages": STAGES, "chains": {}}
    for chain in args.chain or ["F"]:
        out, start, stages, first_export = args.work, None, [], None
        for name in CHAINS[chain]:
            out = out / name
            if name == BUNDLED:
                start = bundled_base()
                continue
            seconds = None
            if not (out / "export" / "config.json").exists():
                out.mkdir(parents=True, exist_ok=True)
                seconds = round(run(stage_command(name, out, start, store), out / "finetune.log", env), 1)
            stages.append({"stage": name, "train_routing_last50": train_routing(out), "wall_s": seconds})
            first_export = first_export or out / "export"
            start = out / "export"
        run(
            genolong_command(
                "evaluate",
                start,
                "--store",
                store,
                "--context",
                8192,
                "--max-tiles",
                args.eval_tiles,
                "--out",
                out / "eval",
                "--quiet",
                "--force",
            ),
            out / "evaluate.log",
            env,
        )
        run(
            genolong_command(
                "probe",
                start,
                "--store",
                store,
                "--context",
                args.probe_context,
                "--distances",
                args.distances,
                "--max-tiles",
                args.eval_tiles,
                "--out",
                out / "probe",
                "--label",
                chain,
                "--quiet",
                "--force",
            ),
            out / "probe.log",
            env,
        )
        held = EvalResult.load(out / "eval")
        buckets = held.bucket_table()
        probe = ProbeResult.load(out / "probe").table()
        doc["chains"][chain] = {
            "stages": stages,
            "heldout_chr22_8x8192": {b: round(float(n), 4) for b, n in zip(buckets["bucket"], buckets["nats"])},
            "routing": [
                {
                    "layer": r["layer"],
                    "load_max_over_mean": round(r["load_max_over_mean"], 3),
                    "dead_experts": r["dead_experts"],
                }
                for r in held.meta["routing"]
            ],
            "probe": [
                {
                    "distance": int(r.distance),
                    "drop": round(float(r.drop), 4),
                    "ci": [round(float(r.drop_ci_lo), 4), round(float(r.drop_ci_hi), 4)],
                }
                for r in probe.itertuples()
            ],
            "router_token_spread": router_token_spread(start, store),
            "stage1_router_token_spread": router_token_spread(first_export, store),
        }
        res = doc["chains"][chain]
        print(f"{chain}: held-out " + " ".join(f"{k} {v:.4f}" for k, v in res["heldout_chr22_8x8192"].items()))
        print(
            "  routing (busiest/mean, dead): "
            + " ".join(f"{r['load_max_over_mean']:.2f} ({r['dead_experts']})" for r in res["routing"])
        )
        print(
            "  probe drop: "
            + " ".join(f"d={r['distance']} {r['drop']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" for r in res["probe"])
        )
        print(
            "  router score std over tokens: "
            + " ".join(f"{r['score_token_std']:.4f}" for r in res["router_token_spread"])
        )
    doc["bundled_base_router_token_spread"] = router_token_spread(bundled_base(), store)
    write_json(args.json, doc)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
