"""Chunked linear + cross-entropy: the LM loss without a ``[N, vocab]`` logits tensor.

At 1M tokens and GLM-5.3-Flash's 154,880-entry vocabulary, full logits would take 620 GB in fp32.
:func:`chunked_cross_entropy` computes the head projection, log-sum-exp and the weighted NLL
``chunk_size`` rows at a time, keeps only the ``[N]`` log-sum-exp for backward, and recomputes each
chunk's logits there. :func:`reference_cross_entropy` is the plain torch version it is tested
against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunked_cross_entropy", "reference_cross_entropy"]


def reference_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, token_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: full fp32 logits, ``F.cross_entropy``; the oracle for the chunked version.

    Args:
        hidden: ``[N, H]`` final hidden states.
        weight: ``[V, H]`` LM head.
        targets: ``[N]`` int64 target ids.
        token_weights: ``[N]`` loss weight per token (0 masks it); default all 1.

    Returns:
        (weighted NLL sum in nats, weight sum), fp32 scalars.
    """
    logits = (hidden @ weight.t()).float()
    nll = F.cross_entropy(logits, targets, reduction="none")
    w = torch.ones_like(nll) if token_weights is None else token_weights.float()
    return (nll * w).sum(), w.sum()


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, token_weights, chunk_size):  # type: ignore[override]
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows] @ weight.t()).float()  # [c, V]
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, targets[rows, None]).squeeze(1)
            lse[rows] = chunk_lse
            total += ((chunk_lse - target_logit) * token_weights[rows]).sum()
        ctx.save_for_backward(hidden, weight, targets, token_weights, lse)
        ctx.chunk_size = chunk_size
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        hidden, weight, targets, token_weights, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            logits = (hidden[rows] @ weight.t()).float()
            # d(lse - logit_target)/d logits = softmax - onehot(target), scaled by the token weight
            grad_logits = torch.exp(logits - lse[rows, None])
            grad_logits[torch.arange(grad_logits.shape[0], device=grad_logits.device), targets[rows]] -= 1
            grad_logits *= (token_weights[rows] * grad_total)[:, None]
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ hidden[rows]).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_weights: torch.Tensor | None = None,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted NLL of ``targets`` under ``softmax(hidden @ weight.T)``, ``chunk_size`` rows at a time.

    Args:
        hidden: ``[N, H]`` final hidden states (any float dtype; logits accumulate in fp32).
        weight: ``[V, H]`` LM head.
        targets: ``[N]`` int64 target ids (any value where the token weight is 0).
        token_weights: ``[N]`` loss weight per token (0 masks it, e.g. N bases; 0.1 down-weights
            soft-masked repeats); default all 1.
        chunk_size: rows per chunk (default 4096): peak extra memory is ``chunk_size * V`` floats.

    Returns:
        (weighted NLL sum in nats, weight sum), fp32 scalars; divide for the mean. Differentiable
        with respect to ``hidden`` and ``weight``.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_cross_entropy: hidden {tuple(hidden.shape)} must be [N, H], weight {tuple(weight.shape)} "
            f"[V, H] and targets {tuple(targets.shape)} [N]"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    w = (
        torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        if token_weights is None
        else token_weights.float()
    )
    safe_targets = torch.where(w > 0, targets, torch.zeros_like(targets))  # masked rows may hold any id
    total = _ChunkedCrossEntropy.apply(hidden, weight, safe_targets, w, chunk_size)
    return total, w.sum()
