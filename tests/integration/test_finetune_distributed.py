"""`genolong finetune` as a two-process job on CPU (gloo): context parallelism with expert
parallelism (cp = 2, ``--set parallel.ep=2``: each rank holds 2 of the 4 experts of every MoE
layer; processes started by Lightning from the recipe's ``parallel`` section) and data parallelism
(dp = 2, started by torchrun), both under FSDP2.

- cp = 2, ep = 2: every step's training loss and every held-out evaluation equal the
  single-process run of the same recipe (relative 1e-5: another summation order); the exported
  models agree. Resuming from the sharded (DCP) step-2 checkpoint gives steps 3-4 identical to
  the uninterrupted two-process run, and the same export; the checkpoint loads for evaluation in
  one process (the experts whole, in the one-process layout). Every step logs the rows each EP
  rank received and the busiest/mean ratio.
- dp = 2 with one window per rank equals one process with two windows per batch: the ranks read
  the two halves of the same window stream, the loss is the global token mean, and the three
  eval tiles are dealt out (2 + 1, the short share padded with an empty tile).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from genolong.evaluation.score import load_eval_model, recipe_context
from genolong.model import PRESETS, GenoLM
from genolong.train import read_step_log

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_STEPS = 4
_WRITE_AUDIT = Path(__file__).resolve().parents[1] / "write_audit"
# what a run writes (run directory paths): each must be seen by the write audit
_OUTPUTS = {
    "recipe.yaml",
    "logs/steps.jsonl",
    "logs/csv/metrics.csv",
    "logs/tensorboard/",
    "checkpoints/step",
    "export",
}


def _recipe(
    tmp_path: Path,
    store: Path,
    name: str,
    parallel: dict,
    batch_size: int = 1,
    tensorboard: bool = False,
    keep_last: int = 2,
) -> Path:
    recipe = {
        "name": name,
        "seed": 3,
        "model": {"preset": "tiny"},
        "data": {"store": str(store), "context": 256, "batch_size": batch_size},
        "train": {"max_steps": _STEPS, "lr": 2.0e-3, "warmup_steps": 2},
        "eval": {"every_n_steps": 2, "max_tiles": 3},
        "checkpoint": {
            "dir": str(tmp_path / "runs" / name / "checkpoints"),
            "every_n_steps": 2,
            "keep_last": keep_last,
        },
        "logging": {"dir": str(tmp_path / "runs" / name / "logs"), "progress_bar": False, "tensorboard": tensorboard},
        "parallel": {"accelerator": "cpu", **parallel},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _finetune(recipe: Path, *args: str, torchrun: int = 0, audit: Path | None = None) -> str:
    """``genolong finetune RECIPE ARGS``; with ``torchrun=N``, under ``torchrun --standalone
    --nproc-per-node N`` (Lightning then joins the processes torchrun started). With ``audit``, every
    process runs under tests/write_audit (its writes into the run directory recorded there, ranks
    released together at every rename: see :func:`_assert_one_writer`)."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    if audit is not None:
        name = yaml.safe_load(recipe.read_text())["name"]
        env.update(
            GENOLONG_WRITE_AUDIT=str(audit),
            GENOLONG_WRITE_AUDIT_ROOT=str(recipe.parent / "runs" / name),
            GENOLONG_WRITE_AUDIT_WORLD="2",
            PYTHONPATH=os.pathsep.join(filter(None, [str(_WRITE_AUDIT), env.get("PYTHONPATH")])),
        )
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
        if torchrun
        else [sys.executable]
    )
    run = subprocess.run(
        [*launcher, "-m", "genolong.cli", "finetune", str(recipe), *args],
        cwd=recipe.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    # rank 0 alone prints, and none of Lightning's banners (genolong.console)
    name = yaml.safe_load(recipe.read_text())["name"]
    assert run.stdout.count(f"genolong finetune: {name}:") == 1, run.stdout
    printed = run.stdout + run.stderr
    assert not [
        s for s in ("Initializing distributed", "distributed_backend", "GPU available", "Tip:") if s in printed
    ], printed
    return run.stdout


def _assert_one_writer(audit: Path, outputs: set[str]) -> None:
    """Every path of the run directory that any process wrote, renamed or removed was touched by one
    rank only, and the audit saw each kind of output in ``outputs`` (path prefixes: the recipe, the
    step log, the CSV and TensorBoard logs, the checkpoints, the export), so it covered them all."""
    touched: dict[str, set[int]] = {}
    for log in audit.glob("rank*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            for path in (record["path"], record.get("source")):
                if path is not None:
                    touched.setdefault(path, set()).add(record["rank"])
    shared = {path: sorted(ranks) for path, ranks in touched.items() if len(ranks) > 1}
    assert not shared, f"outputs written by more than one rank: {shared}"
    missing = {prefix for prefix in outputs if not any(path.startswith(prefix) for path in touched)}
    assert not missing, f"the audit saw no write of {sorted(missing)}: {sorted(touched)}"


def _losses(tmp_path: Path, name: str) -> dict[str, list[float]]:
    records = read_step_log(tmp_path / "runs" / name / "logs" / "steps.jsonl")
    train = [records[s]["train/loss"] for s in range(1, _STEPS + 1)]
    lines = (tmp_path / "runs" / name / "logs" / "steps.jsonl").read_text().splitlines()
    evals = [json.loads(line)["eval/loss"] for line in lines if "eval/loss" in line]
    return {"train": train, "eval": evals}


def _export(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    return GenoLM.from_pretrained(tmp_path / "runs" / name / "export").state_dict()


def _close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(x) for x, y in zip(a, b))


def _moves_agree(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = 1e-3) -> bool:
    """Two exports of runs that started from the seed-3 `tiny` weights made the same moves: per
    tensor, RMS(a - b) <= rel * RMS(a - start). Measured on the weights' change, not their value,
    because some start at zero (the mHC bases); AdamW normalises each step, so entries with a
    near-zero gradient can differ more than the losses do (seen: worst tensor 2.8e-4)."""
    torch.manual_seed(3)
    start = GenoLM(PRESETS["tiny"]).state_dict()

    def rms(x: torch.Tensor) -> float:
        return float(x.double().pow(2).mean().sqrt())

    return a.keys() == b.keys() == start.keys() and all(
        rms(a[k].double() - b[k].double()) <= rel * rms(a[k].double() - start[k].double()) for k in a
    )


def test_two_process_context_and_expert_parallel_run_equals_one_process_and_resumes(
    sample_store: Path, tmp_path: Path
) -> None:
    _finetune(_recipe(tmp_path, sample_store, "one", {"devices": 1}))
    cp = _recipe(tmp_path, sample_store, "cp2", {"devices": 2, "cp": 2}, tensorboard=True)
    out = _finetune(cp, "--set", "parallel.ep=2", audit=tmp_path / "audit-first")
    _assert_one_writer(tmp_path / "audit-first", _OUTPUTS)
    assert "cp2: 4 steps" in out and "model exported" in out
    one, two = _losses(tmp_path, "one"), _losses(tmp_path, "cp2")
    assert len(two["eval"]) == 2
    assert _close(one["train"], two["train"]) and _close(one["eval"], two["eval"]), (one, two)
    steps = read_step_log(tmp_path / "runs" / "cp2" / "logs" / "steps.jsonl")
    k, moe_layers = PRESETS["tiny"].num_experts_per_tok, 7
    for record in steps.values():
        # every (token, slot) row of a step went to one of the two ranks: 256 tokens x k x 7 layers
        assert (
            record["train/ep_rows/rank0"] + record["train/ep_rows/rank1"] == 256 * k * moe_layers
        )  # exact: row counts
        assert 1.0 <= record["train/ep_load_max_over_mean"] <= 2.0
        assert record["perf/ep_alltoall_bytes_forward"] > 0 and record["perf/ep_alltoall_bytes_backward"] > 0
    assert _moves_agree(_export(tmp_path, "one"), _export(tmp_path, "cp2"))
    checkpoints = tmp_path / "runs" / "cp2" / "checkpoints"
    # sharded checkpoints: one DCP directory per step, a shard file per rank
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step0000002.ckpt", "step0000004.ckpt"]
    assert sorted(p.name for p in (checkpoints / "step0000002.ckpt").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    # resume from step 2: the two processes load their shards, the optimiser, schedule and window stream
    first_export = _export(tmp_path, "cp2")
    shutil.rmtree(checkpoints / "step0000004.ckpt")
    log = tmp_path / "runs" / "cp2" / "logs" / "steps.jsonl"
    log.rename(log.with_name("first.jsonl"))
    _finetune(cp, "--set", "parallel.ep=2", "--resume", audit=tmp_path / "audit-resume")
    _assert_one_writer(tmp_path / "audit-resume", _OUTPUTS)
    resumed = read_step_log(log)
    assert sorted(resumed) == [3, 4]
    # bit for bit: both runs are OMP_NUM_THREADS=1 children on the same shapes (losses as logged)
    assert [resumed[s]["train/loss"] for s in (3, 4)] == two["train"][2:]
    second_export = _export(tmp_path, "cp2")
    # exact: both exports were trained in OMP_NUM_THREADS=1 children from the same checkpoint, read back
    assert all(torch.equal(first_export[k], second_export[k]) for k in first_export)
    # a sharded checkpoint loads for evaluation in one process, as the same model as the export
    last = checkpoints / "step0000004.ckpt"
    assert recipe_context(last) == 256
    model, _ = load_eval_model(last)
    # exact: the checkpoint and the export hold the same weights (copies, no arithmetic)
    assert all(torch.equal(v, second_export[k]) for k, v in model.state_dict().items())


def test_two_process_data_parallel_run_equals_one_process_with_both_windows(sample_store: Path, tmp_path: Path) -> None:
    _finetune(_recipe(tmp_path, sample_store, "one", {"devices": 1}, batch_size=2))
    # torchrun starts both ranks at the same instant, as a cluster does; the write audit releases
    # them together at every rename (the race of issue 13: both ranks renaming one
    # .recipe.yaml.tmp killed the job) and checks that each output has one writer; keep_last=1
    # makes rank 0 remove the step-2 checkpoint
    dp = _recipe(tmp_path, sample_store, "dp2", {"devices": 2, "cp": 1}, batch_size=1, tensorboard=True, keep_last=1)
    out = _finetune(dp, torchrun=2, audit=tmp_path / "audit")
    _assert_one_writer(tmp_path / "audit", _OUTPUTS | {"checkpoints/step0000004.ckpt"})
    assert sorted(p.name for p in (tmp_path / "runs" / "dp2" / "checkpoints").iterdir()) == ["step0000004.ckpt"]
    assert out.count("dp2: 4 steps") == 1  # one line for the job, from rank 0
    one, two = _losses(tmp_path, "one"), _losses(tmp_path, "dp2")
    assert _close(one["train"], two["train"]) and _close(one["eval"], two["eval"]), (one, two)
    assert _moves_agree(_export(tmp_path, "one"), _export(tmp_path, "dp2"))
