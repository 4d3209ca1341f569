#!/usr/bin/env python
"""The step-time stall of a checkpoint save, synchronous vs asynchronous (``checkpoint.async_save``).

``genolong finetune`` of the ``small`` preset at 8k tokens on the bundled sample, a checkpoint
after every step, run with ``checkpoint.async_save`` false and true, interleaved (sync, async, sync,
async, ... for ``--repeats`` rounds), each run a fresh process with one torch thread. Per save:

- **stall**: the seconds the training thread spends in the strategy's ``save_checkpoint`` (sync:
  the whole write, manifest and rename; async: waiting for the previous write, then copying the
  state to host memory);
- **step wall**: seconds from one step's end (after its save) to the next's, against the step's
  own compute time (``perf/step_time_s``): what the background write costs the compute on shared
  cores shows here.

Both runs of a round write their checkpoints to the same path (moved aside after each run), and
their last checkpoints are compared: every tensor record byte for byte, the rest equal but for the
recipe (:func:`_same`): the async checkpoint must be the synchronous one.

Example::

    python benchmarks/checkpoint_stall.py                       # small, 8k, 3 steps, 1 round
    python benchmarks/checkpoint_stall.py --preset tiny --context 1024 --steps 4 --repeats 2 --json /tmp/s.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import environment, fresh_python, write_json  # noqa: E402

# one run: times every save_checkpoint call on the training thread, and each step's end
_CHILD = r"""
import json, sys, time
from genolong.config import load_recipe
from genolong.train import finetune
from genolong.train.preemption import RunCheckpoint
stalls, ends = [], []
save, end = finetune.AtomicModelParallelStrategy.save_checkpoint, RunCheckpoint.on_train_batch_end
def timed_save(self, *a, **k):
    t = time.perf_counter(); save(self, *a, **k); stalls.append(time.perf_counter() - t)
def timed_end(self, *a, **k):
    end(self, *a, **k); ends.append(time.perf_counter())
finetune.AtomicModelParallelStrategy.save_checkpoint = timed_save
RunCheckpoint.on_train_batch_end = timed_end
t = time.perf_counter()
finetune.run(load_recipe(sys.argv[1]))
json.dump({"stalls": stalls, "ends": ends, "run_s": time.perf_counter() - t}, open(sys.argv[2], "w"))
"""


def _recipe(folder: Path, store: Path, preset: str, context: int, steps: int, async_save: bool) -> Path:
    recipe = {
        "name": "stall",
        "seed": 3,
        "model": {"preset": preset},
        "data": {"store": str(store), "context": context},
        "train": {"max_steps": steps, "warmup_steps": 0},
        "eval": {"every_n_steps": 0},
        "checkpoint": {
            "dir": str(folder / "runs" / "stall" / "checkpoints"),
            "every_n_steps": 1,
            "keep_last": 2,
            "export_safetensors": False,
            "async_save": async_save,
        },
        "logging": {
            "dir": str(folder / "runs" / "stall" / "logs"),
            "progress_bar": False,
            "tensorboard": False,
            "csv": False,
        },
        "parallel": {"accelerator": "cpu"},
    }
    path = folder / f"stall-{'async' if async_save else 'sync'}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _same(a: Path, b: Path) -> bool:
    """Two runs' checkpoints hold the same state: every tensor record of the zip byte for byte (not
    torch's random ``serialization_id``, nor the pickle, which holds the recipe: ``async_save``
    differs), and the unpickled contents equal but for the recipe."""
    import torch

    from genolong.train.async_checkpoint import first_difference

    def records(path: Path) -> dict[str, bytes]:
        with zipfile.ZipFile(path) as z:
            return {
                n.split("/", 1)[1]: z.read(n) for n in z.namelist() if not n.endswith(("serialization_id", "data.pkl"))
            }

    states = [torch.load(path, weights_only=True) for path in (a, b)]
    for state in states:
        state["genolong"].pop("recipe")
    return records(a) == records(b) and first_difference(*states) is None


def _one(folder: Path, store: Path, args: argparse.Namespace, async_save: bool, keep: Path) -> dict[str, object]:
    recipe = _recipe(folder, store, args.preset, args.context, args.steps, async_save)
    out = folder / "child.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    fresh_python(
        _CHILD.replace("sys.argv[1]", repr(str(recipe))).replace("sys.argv[2]", repr(str(out))), env=env, cwd=folder
    ).check()
    child = json.loads(out.read_text())
    log = [json.loads(line) for line in (folder / "runs" / "stall" / "logs" / "steps.jsonl").read_text().splitlines()]
    compute = [r["perf/step_time_s"] for r in log if "perf/step_time_s" in r]
    ends = child["ends"]
    walls = [b - a for a, b in zip(ends, ends[1:])]
    shutil.move(folder / "runs" / "stall", keep)
    return {
        "mode": "async" if async_save else "sync",
        "stalls_s": child["stalls"],
        "step_wall_s": walls,
        "step_compute_s": compute,
        "run_s": child["run_s"],
        "checkpoint_bytes": (keep / "checkpoints" / f"step{args.steps:07d}.ckpt").stat().st_size,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument(
        "--steps", type=int, default=3, help="optimiser steps per run, a checkpoint after each (default 3)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (sync, async) runs (default 1)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "checkpoint_stall.json")
    args = parser.parse_args(argv)
    from genolong.data.prepare import prepare_genome
    from genolong.quickstart import SAMPLE_EVAL, SAMPLE_TRAIN, sample_fasta

    runs: list[dict[str, object]] = []
    identical: list[bool] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        store = folder / "genome"
        prepare_genome([sample_fasta()], store, train=SAMPLE_TRAIN, eval=SAMPLE_EVAL, progress=False)
        for r in range(args.repeats):
            pair = []
            for async_save in (False, True):
                keep = folder / f"{'async' if async_save else 'sync'}-{r}"
                runs.append({"round": r, **_one(folder, store, args, async_save, keep)})
                pair.append(keep / "checkpoints" / f"step{args.steps:07d}.ckpt")
            identical.append(_same(*pair))

    def med(mode: str, key: str) -> float:
        return statistics.median(x for run in runs if run["mode"] == mode for x in run[key])  # type: ignore[attr-defined]

    rows = [
        {
            "mode": m,
            "stall_s": med(m, "stalls_s"),
            "max_stall_s": max(x for run in runs if run["mode"] == m for x in run["stalls_s"]),  # type: ignore[attr-defined]
            "step_wall_s": med(m, "step_wall_s"),
            "step_compute_s": med(m, "step_compute_s"),
        }
        for m in ("sync", "async")
    ]
    ratio = rows[0]["stall_s"] / max(rows[1]["stall_s"], 1e-9)
    size = runs[0]["checkpoint_bytes"]
    print(
        f"{args.preset} at {args.context} tokens, a checkpoint of {size:,} bytes after each of {args.steps} steps, "
        f"{args.repeats} round(s), interleaved"
    )
    print(f"{'save':>6} {'stall s (median)':>17} {'stall s (max)':>14} {'step wall s':>12} {'step compute s':>15}")
    for row in rows:
        print(
            f"{row['mode']:>6} {row['stall_s']:>17.3f} {row['max_stall_s']:>14.3f} {row['step_wall_s']:>12.2f} "
            f"{row['step_compute_s']:>15.2f}"
        )
    print(
        f"stall sync / async: {ratio:.1f}x (target >= 3x: {'met' if ratio >= 3 else 'NOT met'}); "
        f"last checkpoints the same state: {all(identical)}"
    )
    doc = {
        "benchmark": "checkpoint_stall",
        **environment(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "preset": args.preset,
        "context": args.context,
        "steps": args.steps,
        "repeats": args.repeats,
        "checkpoint_bytes": size,
        "rows": rows,
        "stall_ratio_sync_over_async": ratio,
        "checkpoints_identical": identical,
        "runs": runs,
    }
    print(f"-> {write_json(args.json, doc)}")
    return 0 if all(identical) else 1


if __name__ == "__main__":
    sys.exit(main())
