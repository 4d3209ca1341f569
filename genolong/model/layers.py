"""Small building blocks shared by the GLM-5.3-Flash layers: RMS norms and the clamped SwiGLU MLP.

Parameter names follow the GLM-5.3-Flash checkpoint format (``weight``, ``gate_proj``, ...), so
checkpoints load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "GatedRMSNorm", "SwiGLU", "clamped_swiglu"]


class RMSNorm(nn.Module):
    """RMS normalisation in fp32, scaled by a learned weight.

    Args:
        dim: size of the last axis.
        eps: added to the mean square (default 1e-6).

    Shapes: ``x [..., dim] -> [..., dim]`` in the input dtype (the weight multiplies after the cast
    back, as the checkpoint's reference implementation does).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMS normalisation then a sigmoid gate, all in fp32 (the KDA output norm).

    Shapes: ``x [..., dim]``, ``gate [..., dim] -> [..., dim]`` in ``x``'s dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``: GLM-5.3-Flash's SwiGLU.

    The clamp keeps rare huge activations of a 300B MoE from overflowing in bf16.
    """
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SwiGLU(nn.Module):
    """The dense feed-forward block (also the MoE's shared expert).

    Args:
        hidden_size: model width H.
        intermediate_size: inner width I.
        limit: SwiGLU clamp (``swiglu_limit``, default 10).

    Shapes: ``x [..., H] -> [..., H]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float = 10.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
