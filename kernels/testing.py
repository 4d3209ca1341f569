"""Comparison helpers for checking a fast path against its reference."""

from __future__ import annotations

import torch

__all__ = ["rms_ratio"]


def rms_ratio(ref: torch.Tensor, x: torch.Tensor) -> float:
    """``RMS(ref - x) / RMS(ref)`` in float64: the criterion fla's tests and genolong's use.

    Args:
        ref: the reference result (any shape and float dtype; detached here).
        x: the result under test, same shape.

    Returns:
        The ratio (0.0 for identical tensors; a zero ``ref`` is clamped to avoid dividing by 0).
    """
    ref, x = ref.detach().double(), x.detach().double()
    return float((ref - x).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300))
