#!/usr/bin/env python
"""What training on planted repeats buys in recall: the bundled base trained on, with and without `data.plant_repeats`.

Two ``genolong finetune`` runs of ``recipes/sample-base.yaml`` start from the same checkpoint (by
default the bundled base, ``data/sample/base``) and see the same windows of the bundled sample's
training split, in the same order, for the same steps: one with the windows as stored, one with
diverged copies planted into them (``--plant KEY=VALUE`` sets ``data.plant_repeats.KEY``). The two
run side by side, one torch thread each. Then ``genolong probe`` scores the starting checkpoint and
both results on the same held-out tiles (chr22 of the sample): per distance ``d``, the drop (loss of
a 100-base copy with its source ``d`` bases back cut away minus with it in view, nats per base,
paired 95% block-bootstrap interval over tiles). A model that recalls at ``d`` shows a drop of
the order of the loss itself (~1.3 nats per base on DNA); one that does not shows ~0. The
held-out loss each run logs at its last step (``eval.max_tiles`` tiles of ``--context``) shows what
planting costs at short range.

Usage (the defaults take about 15-20 minutes on 2 cores)::

    python experiments/bundled-base/planted_recall.py
    python experiments/bundled-base/planted_recall.py --steps 400 --context 512 --plant copies=2 --plant max_length=150

Prints a table and writes JSON (default experiments/bundled-base/results/planted_recall.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "benchmarks"
sys.path.append(str(BENCH))  # benchmarks/_bench.py (and benchmarks/quickstart_heldout.py)
sys.path.append(str(HERE))  # the other scripts of experiments/bundled-base/
from _bench import Fresh, environment, genolong_command, run_fresh, sample_store, wait_any, write_json  # noqa: E402

ROOT = HERE.parents[1]
DEFAULT_JSON = HERE / "results" / "planted_recall.json"
DEFAULT_PLANT = ("share=1.0", "copies=3", "min_length=50", "max_length=200", "max_divergence=0.1", "inverted=0.0")


#: ``recipes/sample-base.yaml`` is the routers-only last stage of the bundled base's chain; these
#: keys put back a plain run (every weight trained, windows as stored, the default routing balance)
#: before the benchmark's own keys, so that the two runs differ in ``data.plant_repeats`` only.
PLAIN_RUN = (
    "model.freeze=[]",
    "data.batch_size=1",
    "data.plant_repeats=null",
    "train.min_lr=1.0e-4",
    "train.moe_bias_update_rate=0.01",
    "train.moe_balance_loss_weight=0.01",
)


def finetune_cmd(name: str, args: argparse.Namespace, store: Path, plant: list[str]) -> list[str]:
    """The ``genolong finetune`` command of one run: ``recipes/sample-base.yaml`` made a plain run
    (:data:`PLAIN_RUN`), then ``plant`` as ``data.plant_repeats`` keys (empty: windows as stored)."""
    sets = [
        *PLAIN_RUN,
        f"name={name}",
        f"model.checkpoint={args.base}",
        f"data.store={store}",
        f"data.context={args.context}",
        f"train.max_steps={args.steps}",
        f"train.lr={args.lr}",
        f"train.warmup_steps={max(1, args.steps // 10)}",
        f"checkpoint.dir=runs/{name}/checkpoints",
        f"checkpoint.every_n_steps={args.steps}",
        f"logging.dir=runs/{name}/logs",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"eval.every_n_steps={args.steps}",
        f"seed={args.seed}",
    ]
    sets += [f"data.plant_repeats.{kv}" for kv in plant]
    cmd = genolong_command("finetune", ROOT / "recipes" / "sample-base.yaml")
    for s in sets:
        cmd += ["--set", s]
    return cmd


def last_eval_loss(run: Path) -> float | None:
    """The held-out loss the run logged last (metrics.csv's ``eval/loss``), or None."""
    for path in sorted(run.glob("logs/**/metrics.csv")):
        frame = pd.read_csv(path)
        if "eval/loss" in frame.columns and frame["eval/loss"].notna().any():
            return float(frame["eval/loss"].dropna().iloc[-1])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--base",
        type=Path,
        default=ROOT / "data" / "sample" / "base",
        help="starting checkpoint (default: the bundled base)",
    )
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="the sample store (default: prepare the bundled sample in a temporary directory)",
    )
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--context", type=int, default=1024, help="training window (default 1024, the base's)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--plant",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help=f"data.plant_repeats keys (default: {' '.join(DEFAULT_PLANT)})",
    )
    p.add_argument("--probe-context", type=int, default=4096)
    p.add_argument("--probe-tiles", type=int, default=8)
    p.add_argument("--distances", default="128,256,512,1024,2048")
    p.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()
    plant = args.plant or list(DEFAULT_PLANT)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        store = sample_store(args.store, work)
        runs = {"stored": [], "planted": plant}
        started = [
            Fresh.start(finetune_cmd(f"recall-{label}", args, store, kv), env=env, cwd=work, log=work / f"{label}.log")
            for label, kv in runs.items()
        ]
        for child, label in zip(started, runs):
            child.extra["label"] = label
        train: dict[str, Any] = {}
        for child, figures in wait_any(started):
            figures.check()
            label = child.extra["label"]
            train[label] = {
                "wall_s": figures.wall_s,
                "cpu_s": figures.user_s + figures.system_s,
                "heldout_loss": last_eval_loss(work / "runs" / f"recall-{label}"),
            }
        models = {"start": args.base, **{label: work / "runs" / f"recall-{label}" / "export" for label in runs}}
        rows = []
        for label, model in models.items():
            out = work / f"probe-{label}"
            run_fresh(
                genolong_command(
                    "probe",
                    model,
                    "--store",
                    store,
                    "--context",
                    args.probe_context,
                    "--max-tiles",
                    args.probe_tiles,
                    "--distances",
                    args.distances,
                    "--out",
                    out,
                    "--force",
                    "--quiet",
                ),
                env=env,
            ).check()
            table = json.loads((out / "probe.json").read_text())
            for row in table["rows"] if isinstance(table, dict) and "rows" in table else table:
                rows.append({"model": label, **row})
    frame = pd.DataFrame(rows)
    print(f"{args.steps} steps of {args.context} bases from {args.base}; planted: {' '.join(plant)}")
    for label, t in train.items():
        print(
            f"  {label}: {t['wall_s']:.0f} s wall, {t['cpu_s']:.0f} CPU s, held-out loss at the end {t['heldout_loss']}"
        )
    shown = frame[["model", "distance", "tiles", "full_nats", "cut_nats", "drop", "drop_ci_lo", "drop_ci_hi"]]
    print(shown.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    write_json(
        args.json,
        {
            "environment": environment(),
            "steps": args.steps,
            "context": args.context,
            "lr": args.lr,
            "seed": args.seed,
            "plant": plant,
            "base": str(args.base),
            "train": train,
            "probe": rows,
        },
    )


if __name__ == "__main__":
    main()
