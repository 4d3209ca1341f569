#!/usr/bin/env python
"""`genolong probe` on a model trained on planted repeats: recall inside its training context, none beyond?

A small GenoLM (the `tiny` preset's geometry with ``--pattern`` layers, dense FFNs; default "KD":
one KDA then one DSA layer) is trained from scratch on random DNA (A/C/G/T uniform) in windows of
``--train-context`` bases where every window is periodic from some point on: the bases from
position ``p`` on repeat those ``p`` bases earlier, ``p`` drawn uniformly in ``[m + 1,
train_context - m]`` (so every distance a probe of ``m``-base copies can ask inside the training
context occurs in training). Then ``genolong probe`` (:func:`genolong.evaluation.probe.probe`) runs
on held-out random DNA (another seed) in tiles of ``--context`` bases (4x the training context by
default) at distances ``2m .. context - m``: the drop (cut - full) is expected clearly above zero at
distances inside the training context (the model has learnt to copy) and is measured beyond it.

Random DNA has no structure but the planted copy: any drop is recall of the source and nothing else
(a natural sequence's long-range statistics cannot leak in), and the full view's loss outside the
copy is ln 4 = 1.386 nats.

tests/test_probe.py runs the small version of this scenario (these functions).

Example::

    python benchmarks/probe_planted.py                    # defaults: 128-base training windows, 600 steps
    python benchmarks/probe_planted.py --steps 200 --tiles 8

Prints the probe table and writes JSON (default benchmarks/results/probe_planted.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "probe_planted.json"


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


def planted_batch(rng: np.random.Generator, batch: int, length: int, repeat_bases: int) -> torch.Tensor:
    """``[batch, length]`` random bases, each row periodic from a random point ``p`` on
    (``x[t] = x[t - p]`` for ``t >= p``, ``p`` uniform in ``[m + 1, length - m]``)."""
    x = rng.integers(1, 5, size=(batch, length)).astype(np.uint8)
    for row in x:
        p = int(rng.integers(repeat_bases + 1, length - repeat_bases + 1))
        for t in range(p, length):  # sequential: the copy of a copy is the copy
            row[t] = row[t - p]
    return torch.from_numpy(x).long()


def train_planted(pattern: str = "KD", train_context: int = 128, repeat_bases: int = 16, steps: int = 600,
                  batch: int = 16, lr: float = 1e-2, seed: int = 0, log_every: int = 50,
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
        nll, weight = model.loss(planted_batch(rng, batch, train_context, repeat_bases))
        loss = nll / weight
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            curve.append({"step": step, "loss": float(loss), "seconds": time.perf_counter() - began})
            if verbose:
                print(f"  step {step}: loss {float(loss):.4f} ({curve[-1]['seconds']:.0f} s)", flush=True)
    return model.eval(), curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", default="KD", help="layers, K = KDA, D = DSA (default: %(default)s)")
    parser.add_argument("--train-context", type=int, default=128, help="training window (default: %(default)s)")
    parser.add_argument("--repeat-bases", type=int, default=16, help="m (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=600, help="optimiser steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="windows per step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--context", type=int, default=None, help="probe tile length (default: 4x --train-context)")
    parser.add_argument("--tiles", type=int, default=16, help="probe tiles (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="output JSON (default: %(default)s)")
    args = parser.parse_args()

    import tempfile

    from genolong.evaluation.probe import probe
    from genolong.evaluation.report import format_probe_table

    torch.set_num_threads(args.threads)
    context = args.context or 4 * args.train_context
    model, curve = train_planted(args.pattern, args.train_context, args.repeat_bases, args.steps, args.batch, args.lr,
                                 verbose=True)
    split = random_split(context * args.tiles, seed=12345)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = probe(model, split, Path(tmp) / "probe", context, repeat_bases=args.repeat_bases,
                       distances=[d for d in (2 ** k for k in range(1, 40)) if 2 * args.repeat_bases <= d <= context - args.repeat_bases],
                       label=f"planted {args.pattern}", progress=False, figure=False)
    probe_seconds = time.perf_counter() - began
    table = result.table()
    inside = table["distance"] <= args.train_context - args.repeat_bases
    print(f"probe_planted: `tiny` geometry, layers {args.pattern}, trained {args.steps} steps of {args.batch} x "
          f"{args.train_context} bases (lr {args.lr:g}; {curve[-1]['seconds']:.0f} s, final loss {curve[-1]['loss']:.3f}); "
          f"probe of {args.tiles} random-DNA tiles of {context} bases, m = {args.repeat_bases} ({probe_seconds:.1f} s)")
    print(format_probe_table(table))
    print(f"inside the training context (d <= {args.train_context - args.repeat_bases}): drop CI excludes 0 at "
          f"{int((table['supported'] & (table['drop'] > 0))[inside].sum())} of {int(inside.sum())} distances; beyond: "
          f"{int(table['supported'][~inside].sum())} of {int((~inside).sum())}")
    rows = [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
            for r in table.to_dict(orient="records")]
    record = {
        "benchmark": "probe_planted", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s)", "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()} | {"context": context},
        "training_curve": curve, "probe_seconds": probe_seconds, "table": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1, default=lambda v: v.item() if isinstance(v, np.generic) else str(v)) + "\n")
    print(f"written {args.json}")


if __name__ == "__main__":
    main()
