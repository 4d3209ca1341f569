"""Mean held-out loss of a model over the first tiles of an eval split.

The summary number (nats and bits per counted base); the per-position tables bucketed by
preceding-context length build on the same tiles (issue 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.store import Split
from ..data.windows import EvalTiles
from ..model.lm import GenoLM
from ..model.loss import bits_per_base
from ..model.vocab import VocabMap

__all__ = ["HeldoutLoss", "heldout_loss"]


@dataclass(frozen=True)
class HeldoutLoss:
    """Mean next-base loss over ``tokens`` counted targets of ``tiles`` tiles."""

    nats: float
    tokens: float
    tiles: int

    @property
    def bits_per_base(self) -> float:
        return bits_per_base(self.nats)


@torch.no_grad()
def heldout_loss(model: GenoLM, split: Split, context: int, max_tiles: int | None = None,
                 softmask_weight: float = 1.0, vocab: VocabMap | None = None) -> HeldoutLoss:
    """Mean loss of ``model`` on the first ``max_tiles`` tiles of ``context`` tokens of ``split``.

    Each tile is one forward pass ``[1, L]``; a segment's short last tile is used as it is (no
    padding). N and soft-masked targets are handled as in training.

    Args:
        model: the model (put in eval mode for the call).
        split: e.g. ``GenomeStore.open(path).split("eval")``.
        context: tile length in tokens.
        max_tiles: tiles to use in order (default None: all).
        softmask_weight: loss weight of soft-masked bases (default 1.0).
        vocab: base ids -> model ids (default None: nucleotide ids).
    """
    tiles = EvalTiles(split, context)
    count = len(tiles) if max_tiles is None else min(max_tiles, len(tiles))
    was_training = model.training
    model.eval()
    nll, weight = 0.0, 0.0
    try:
        for i in range(count):
            tokens = torch.from_numpy(tiles[i].tokens).long()[None]
            total, counted = model.loss(tokens, softmask_weight=softmask_weight, vocab=vocab)
            nll += float(total)
            weight += float(counted)
    finally:
        model.train(was_training)
    return HeldoutLoss(nats=nll / max(weight, 1.0), tokens=weight, tiles=count)
