"""Scenarios that tests and the research scripts of ``experiments/bundled-base/`` share.

Two small training set-ups, kept here because product tests run them and nothing outside
``experiments/`` may import from that folder:

- a collapsed MoE router on ``tiny`` (8 experts, top-2; every layer's expert 0 takes every token)
  trained through ``GenoLMModule`` and Lightning as ``genolong finetune`` trains
  (``tests/model/test_moe_balance.py``; every balancing option side by side in
  ``experiments/bundled-base/moe_collapse.py``);
- a small GenoLM trained from scratch on random DNA with planted periodic repeats, then probed by
  ``genolong probe`` (``tests/evaluation/test_probe.py``; the larger runs in
  ``experiments/bundled-base/probe_planted.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

# -- a collapsed MoE router on tiny ------------------------------------------------------------------

WINDOW = 256
STEPS = 50


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
    return [{"tokens": torch.from_numpy(tokens[s : s + WINDOW].astype(np.int64))} for s in starts]


def collapsed_tiny(windows: list[dict[str, Any]], scale: float = 10.0) -> Any:
    """`tiny` with 8 experts, every MoE layer collapsed onto expert 0 (see the module docstring)."""
    import torch

    from genolong.model import PRESETS, GenoLM
    from genolong.model.moe import MoE

    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"].replace(n_routed_experts=8))
    inputs: dict[Any, torch.Tensor] = {}
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    hooks = [
        m.register_forward_hook(lambda mod, args, out: inputs.__setitem__(mod, args[0].reshape(-1, args[0].shape[-1])))
        for m in moes
    ]
    with torch.no_grad():
        model(torch.stack([w["tokens"] for w in windows[:4]]))
        for hook in hooks:
            hook.remove()
        for moe in moes:
            mean = inputs[moe].mean(0)
            moe.gate.weight[0] = scale * mean / mean.square().sum()
    return model


def train_collapsed(
    windows: list[dict[str, Any]], steps: int = STEPS, collapse_steps: int = 5, **optim: Any
) -> list[float]:
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

    module = GenoLMModule(
        lambda: collapsed_tiny(windows),
        OptimSettings(lr=1e-3, min_lr=1e-4, max_steps=steps, **optim),
        moe_collapse_steps=collapse_steps,
    )
    worst = Worst()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=[worst],
    )
    trainer.fit(module, train_dataloaders=DataLoader(windows, batch_size=1))
    return worst.steps


# -- planted repeats in random DNA ------------------------------------------------------------------

#: The small version tests/evaluation/test_probe.py runs: 200 steps of 32 windows of 32 bases, repeats at
#: distances up to 8, 4-base copies (probe distances 8: trained, 16: not).
SMALL = {
    "pattern": "K",
    "train_context": 32,
    "repeat_bases": 4,
    "max_distance": 8,
    "steps": 200,
    "batch": 32,
    "lr": 1e-2,
}


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
    return PRESETS["tiny"].replace(
        num_hidden_layers=n, pattern=pattern, mlp_layer_types=("dense",) * n, indexer_types=("full",) * n
    )


def planted_batch(
    rng: np.random.Generator, batch: int, length: int, repeat_bases: int, max_distance: int
) -> torch.Tensor:
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


def train_planted(
    pattern: str = "K",
    train_context: int = 128,
    repeat_bases: int = 4,
    max_distance: int = 32,
    steps: int = 600,
    batch: int = 8,
    lr: float = 1e-2,
    seed: int = 0,
    log_every: int = 50,
    verbose: bool = False,
) -> tuple[Any, list[dict[str, float]]]:
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

    distances = [d for d in (2**k for k in range(1, 40)) if 2 * repeat_bases <= d <= context - repeat_bases]
    return probe(
        model,
        random_split(context * tiles, seed),
        out,
        context,
        repeat_bases=repeat_bases,
        distances=distances,
        label="planted",
        progress=False,
        figure=False,
    )
