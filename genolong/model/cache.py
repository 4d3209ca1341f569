"""What inference carries from one call to the next: the KDA layer state and growable row buffers.

Shared by the two paths that run a sequence in pieces: the step-by-step decode
(:mod:`genolong.model.decode`, one token per step) and the chunked prefill
(:mod:`genolong.model.stream`, one segment per call). Both start a KDA layer from
:func:`kda_init_state` and grow their DSA caches with :func:`_grow`; keeping these here, below
both, lets ``stream`` run without importing ``decode`` (which imports the whole model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kda import KDAMixer

__all__ = ["KDAState", "kda_init_state"]


@dataclass
class KDAState:
    """Decoding state of one KDA layer.

    Attributes:
        recurrent: delta-rule state ``[B, heads, dk, dv]`` float32.
        conv: the last ``linear_conv_kernel_dim - 1`` short-conv inputs ``[B, kernel - 1, 3 * heads * dk]``
            float32, oldest first (zeros before the start of the sequence).
    """

    recurrent: torch.Tensor
    conv: torch.Tensor


def _grow(buf: torch.Tensor, needed: int) -> torch.Tensor:
    """``buf [B, capacity, ...]`` with at least ``needed`` rows (doubling, contents kept)."""
    cap = buf.shape[1]
    if needed <= cap:
        return buf
    new = buf.new_zeros(buf.shape[0], max(needed, 2 * cap), *buf.shape[2:])
    new[:, :cap] = buf
    return new


def kda_init_state(mixer: KDAMixer, batch_size: int, device: torch.device) -> KDAState:
    """Zero state of ``mixer`` for ``batch_size`` sequences (the state before token 0)."""
    h, d = mixer.num_heads, mixer.head_dim
    kernel = mixer.conv1d.weight.shape[-1]
    return KDAState(
        recurrent=torch.zeros(batch_size, h, d, d, dtype=torch.float32, device=device),
        conv=torch.zeros(batch_size, kernel - 1, 3 * h * d, dtype=torch.float32, device=device),
    )
