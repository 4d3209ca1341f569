"""The language-model loss on DNA tokens: next-base NLL, masked on N and specials, soft-mask weight.

Store tokens keep case (``genolong.data.alphabet``): the model reads ``token & BASE_MASK`` and
predicts the next base; a target that is N, padding or a special token never counts, and a
soft-masked (lowercase) target counts with ``softmask_weight`` (Evo 2 uses 0.1; default 1.0).
"""

from __future__ import annotations

import math

import torch

from ..data.alphabet import BASE_MASK, SOFTMASK, A, T
from ..kernels.ce import chunked_cross_entropy
from .vocab import VocabMap

__all__ = ["model_inputs", "target_weights", "next_token_loss", "next_token_nll", "bits_per_base"]


def model_inputs(tokens: torch.Tensor) -> torch.Tensor:
    """Store tokens ``[..., T]`` -> model ids ``[..., T]`` (case dropped), int64."""
    return (tokens & BASE_MASK).long()


def target_weights(tokens: torch.Tensor, softmask_weight: float = 1.0) -> torch.Tensor:
    """Loss weight per target token ``[..., T]`` (fp32).

    A, C, G, T count 1 (``softmask_weight`` when lowercase); N, padding and specials count 0.
    """
    base = tokens & BASE_MASK
    counted = (base >= A) & (base <= T)
    soft = (tokens & SOFTMASK) > 0
    weights = counted.float()
    return torch.where(soft, weights * softmask_weight, weights)


def next_token_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    tokens: torch.Tensor,
    softmask_weight: float = 1.0,
    chunk_size: int = 4096,
    vocab: VocabMap | None = None,
    next_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted next-base NLL: position ``t`` predicts the base at ``t + 1``.

    Args:
        hidden: ``[B, T, H]`` final hidden states.
        head_weight: ``[V, H]`` LM head (nucleotide vocabulary: V = 8; a text LLM's otherwise).
        tokens: ``[B, T]`` store tokens of the same window.
        softmask_weight: weight of soft-masked targets (default 1.0).
        chunk_size: rows per cross-entropy chunk.
        vocab: the checkpoint's ids of the bases (a text LLM); default None: the nucleotide ids.
        next_tokens: ``[B, 1]`` the store token after the last of ``tokens``, which the last
            position then predicts (context parallelism: the first token of the next rank's
            slice); default None: the last position predicts nothing.

    Returns:
        (NLL sum in nats, weight sum), fp32 scalars; their ratio is the mean loss.
    """
    if next_tokens is None:
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        targets = tokens[:, 1:]
    else:
        h = hidden.reshape(-1, hidden.shape[-1])
        targets = torch.cat([tokens[:, 1:], next_tokens], dim=1)
    weights = target_weights(targets, softmask_weight)
    if vocab is None:
        ids = model_inputs(targets)
    else:
        # uncounted targets (N, padding, specials) may have no id in the map: any id will do
        ids = vocab.to_model(torch.where(weights > 0, targets, A))
    return chunked_cross_entropy(h, head_weight, ids.reshape(-1), weights.reshape(-1), chunk_size)


@torch.no_grad()
def next_token_nll(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    tokens: torch.Tensor,
    chunk_size: int = 4096,
    vocab: VocabMap | None = None,
) -> torch.Tensor:
    """Per-target NLL (nats) of the next base, for evaluation: no weighting, no reduction.

    Logits are formed ``chunk_size`` rows at a time in fp32, so a text LLM's vocabulary never
    needs a ``[T, V]`` tensor.

    Args:
        hidden: ``[B, T, H]`` final hidden states.
        head_weight: ``[V, H]`` LM head.
        tokens: ``[B, T]`` store tokens of the same window.
        chunk_size: rows per chunk (default 4096).
        vocab: the checkpoint's ids of the bases (a text LLM); default None: the nucleotide ids.

    Returns:
        ``[B, T - 1]`` float32: entry ``t`` is ``-log p(tokens[:, t + 1] | tokens[:, :t + 1])``;
        NaN where the target does not count (N, padding, specials: ``target_weights`` is 0).
    """
    b, t, h = hidden.shape
    targets = tokens[:, 1:]
    counted = target_weights(targets) > 0
    safe = torch.where(counted, targets, A)
    ids = (model_inputs(safe) if vocab is None else vocab.to_model(safe)).reshape(-1)
    rows = hidden[:, :-1].reshape(-1, h)
    nll = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, rows.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        logits = (rows[part] @ head_weight.t()).float()  # [c, V]
        nll[part] = torch.logsumexp(logits, dim=-1) - logits.gather(1, ids[part, None]).squeeze(1)
    return torch.where(counted, nll.view(b, t - 1), torch.nan)


def bits_per_base(nats: float) -> float:
    """Convert a mean NLL in nats to bits per base."""
    return nats / math.log(2)
