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

tests/test_probe.py runs the small version of this scenario (these functions, :data:`SMALL`).

Example::

    python benchmarks/probe_planted.py --context 64 --max-distance 16 --batch 16 --steps 600

Prints the probe table and writes JSON (default benchmarks/results/probe_planted.json).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402
DEFAULT_JSON = HERE / "results" / "probe_planted.json"
#: The small version tests/test_probe.py runs: 200 steps of 32 windows of 32 bases, repeats at
#: distances up to 8, 4-base copies (probe distances 8: trained, 16: not).
SMALL = {"pattern": "K", "train_context": 32, "repeat_bases": 4, "max_distance": 8, "steps": 200, "batch": 32, "lr": 1e-2}


@dataclass
class RandomSplit:
    """Random DNA held in memory as one segment (the SplitLike protocol of genolong.data.windows)."""

    tokens: np.ndarray
    segments: pd.DataFrame
    name: str = "eval"


def random_split(n_bases: int, seed: int) -> RandomSplit:
    """``n_bases`` uniform A/C/G/T bases (uppercase) on contig chrR, one segment."""
    tokens = np.random.default_rng(seed).integers(1, 5, size=n_bases).astype(np.uint8)
    return RandomSplit(tokens, pd.DataFrame({"contig": ["chrR"], "start": [0], "end": [n_bases], "offset": [0]}))


def planted_config(pattern: str = "KD") -> Any:
    """The `tiny` preset with ``pattern``'s layers (K = KDA, D = DSA), dense FFNs and full indexers."""
    from genolong.model import PRESETS

    n = len(pattern)
    return PRESETS["tiny"].replace(num_hidden_layers=n, pattern=pattern, mlp_layer_types=("dense",) * n,
                                   indexer_types=("full",) * n)


def planted_batch(rng: np.random.Generator, batch: int, length: int, repeat_bases: int, max_distance: int) -> torch.Tensor:
    """``[batch, length]`` random bases, each row periodic from a random point on: ``x[t] = x[t - p]``
    for ``t >= t0``, the period ``p`` uniform in ``[m + 1, max_distance]`` and ``t0`` uniform in
    ``[p, length - m]`` (so at least ``m`` copied bases). Every repeat lies at a distance of at
    most ``max_distance``, inside windows as long as the probe's tiles."""
    x = rng.integers(1, 5, size=(batch, length)).astype(np.uint8)
    for row in x:
        p = int(rng.integers(repeat_bases + 1, max_distance + 1))
        t0 = int(rng.integers(p, length - repeat_bases + 1))
        for t in range(t0, length):  # sequential: the copy of a copy is the copy
            row[t] = row[t - p]
    return torch.from_numpy(x).long()


def train_planted(pattern: str = "K", train_context: int = 128, repeat_bases: int = 4, max_distance: int = 32,
                  steps: int = 600, batch: int = 8, lr: float = 1e-2, seed: int = 0, log_every: int = 50,
                  verbose: bool = False) -> tuple[Any, list[dict[str, float]]]:
    """Train :func:`planted_config` from scratch with AdamW on :func:`planted_batch` windows.

    Returns:
        (the model in eval mode, ``[{"step", "loss", "seconds"}]`` every ``log_every`` steps).
    """
    from genolong.model import GenoLM

    torch.manual_seed(seed)
    model = GenoLM(planted_config(pattern))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    curve: list[dict[str, float]] = []
    began = time.perf_counter()
    for step in range(steps):
        nll, weight = model.loss(planted_batch(rng, batch, train_context, repeat_bases, max_distance))
        loss = nll / weight
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            curve.append({"step": step, "loss": float(loss.detach()), "seconds": time.perf_counter() - began})
            if verbose:
                print(f"  step {step}: loss {float(loss):.4f} ({curve[-1]['seconds']:.0f} s)", flush=True)
    return model.eval(), curve


def planted_probe(model: Any, context: int, repeat_bases: int, tiles: int, out: Path, seed: int = 12345) -> Any:
    """``genolong probe`` of ``model`` on ``tiles`` held-out random-DNA tiles of ``context`` bases at
    the powers of two ``2m <= d <= context - m``; returns the :class:`ProbeResult`."""
    from genolong.evaluation.probe import probe

    distances = [d for d in (2 ** k for k in range(1, 40)) if 2 * repeat_bases <= d <= context - repeat_bases]
    return probe(model, random_split(context * tiles, seed), out, context, repeat_bases=repeat_bases, distances=distances,
                 label="planted", progress=False, figure=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", default="K", help="layers, K = KDA, D = DSA (default: %(default)s)")
    parser.add_argument("--context", type=int, default=128, help="training window = probe tile (default: %(default)s)")
    parser.add_argument("--repeat-bases", type=int, default=4, help="m (default: %(default)s)")
    parser.add_argument("--max-distance", type=int, default=32, help="largest repeat distance trained (default: %(default)s)")
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
    model, curve = train_planted(args.pattern, args.context, args.repeat_bases, args.max_distance, args.steps, args.batch,
                                 args.lr, verbose=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = planted_probe(model, args.context, args.repeat_bases, args.tiles, Path(tmp) / "probe")
    probe_seconds = time.perf_counter() - began
    table = result.table()
    inside = table["distance"] <= args.max_distance
    print(f"probe_planted: `tiny` geometry, layers {args.pattern}, trained {args.steps} steps of {args.batch} x "
          f"{args.context} bases with repeats at distances <= {args.max_distance} (lr {args.lr:g}; "
          f"{curve[-1]['seconds']:.0f} s); probe of {args.tiles} random-DNA tiles of {args.context}, m = "
          f"{args.repeat_bases} ({probe_seconds:.1f} s)")
    print(format_probe_table(table))
    print(f"distances trained (d <= {args.max_distance}): drop CI above 0 at "
          f"{int((table['supported'] & (table['drop'] > 0))[inside].sum())} of {int(inside.sum())}; beyond: CI excludes 0 at "
          f"{int(table['supported'][~inside].sum())} of {int((~inside).sum())}")
    rows = [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
            for r in table.to_dict(orient="records")]
    record = {
        "benchmark": "probe_planted", **environment("date"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s)", "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "training_curve": curve, "probe_seconds": probe_seconds, "table": rows,
    }
    write_json(args.json, record, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
    print(f"written {args.json}")


if __name__ == "__main__":
    main()
