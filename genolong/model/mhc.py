"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams instead of one.

Each block reads a token-dependent mixture of the streams (``pre``), and writes back
``post * block_out + comb^T @ streams``, where ``comb`` is made doubly stochastic by Sinkhorn
iterations so that repeated mixing cannot blow the residual up. All three weights come from one
small projection of the (RMS-normalised, flattened) streams. The residual activation is
``hc_mult`` times larger than a plain transformer's: the memory planner counts it.

The weight computation (normalisation, projection, Sinkhorn) is rebuilt in backward rather than
saved (:attr:`HyperConnection.recompute_weights`, on by default): it would keep per token the
normalised fp32 streams (``4 m H`` bytes; plus the fp32 copy of the streams, another ``4 m H``,
when they are not fp32) and two ``[m, m]`` matrices and their ``[m]`` sums per Sinkhorn
iteration, about 13 times the ``m H``-byte fp32 streams at GLM-5.3-Flash size, for the cost of
redoing that small computation (a ``[T, m H] x [m H, (2+m) m]`` matmul and elementwise work)
once more in backward. Results are bit for bit the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig

__all__ = ["HyperConnection", "merge_streams", "expand_streams", "collapse_streams"]


class HyperConnection(nn.Module):
    """Computes the mixing weights of one block and collapses the streams into its input.

    Parameters (checkpoint names): ``fn [(2+m)m, mH]``, ``base [(2+m)m]`` and ``scale [3]``
    (fp32), for ``m = hc_mult`` streams of width ``H``.

    Shapes: ``streams [B, T, m, H] -> (post [B, T, m], comb [B, T, m, m], collapsed [B, T, H])``.

    Attributes:
        recompute_weights: while autograd records, compute ``pre``, ``post`` and ``comb`` under
            a non-reentrant checkpoint, so backward rebuilds the normalisation, projection and
            Sinkhorn iterations instead of keeping them (default True; same results bit for bit).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        m, h = config.hc_mult, config.hidden_size
        self.hc_mult = m
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.recompute_weights = True
        self.fn = nn.Parameter(torch.empty((2 + m) * m, m * h))
        self.base = nn.Parameter(torch.zeros((2 + m) * m, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        nn.init.normal_(self.fn, std=0.02)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.recompute_weights and torch.is_grad_enabled():
            # the checkpoint keeps only its input, the streams (saved anyway by the collapse below
            # and by merge_streams); the model has no randomness, so no RNG state to stash
            pre, post, comb = checkpoint(self.weights, streams, use_reentrant=False, preserve_rng_state=False)
        else:
            pre, post, comb = self.weights(streams)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mixing weights (fp32): ``streams [B, T, m, H] -> (pre [B, T, m], post [B, T, m],
        comb [B, T, m, m])``, ``comb`` doubly stochastic after the Sinkhorn iterations."""
        b, t, m, _ = streams.shape
        flat = streams.reshape(b, t, -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixed.split([m, m, m * m], dim=-1)
        pre_b, post_b, comb_b = self.base.split([m, m, m * m])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(b, t, m, m) * comb_s + comb_b.view(m, m), dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: alternate column and row normalisation towards a doubly stochastic matrix
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb


def merge_streams(
    post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor
) -> torch.Tensor:
    """New streams after a block: ``post * block_out + comb^T @ streams``.

    Shapes: ``post [B, T, m]``, ``comb [B, T, m, m]``, ``block_out [B, T, H]``,
    ``streams [B, T, m, H] -> [B, T, m, H]`` in ``block_out``'s dtype.
    """
    dtype = block_out.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def expand_streams(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The embedding copied into ``hc_mult`` streams: ``[B, T, H] -> [B, T, m, H]``."""
    return x.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()


def collapse_streams(streams: torch.Tensor) -> torch.Tensor:
    """The final hyper head: the unweighted mean of the streams, ``[B, T, m, H] -> [B, T, H]``."""
    return streams.mean(dim=2)
