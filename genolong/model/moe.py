"""DeepSeek-style mixture of experts as GLM-5.3-Flash uses it, processed in token chunks.

Routing (per token): sigmoid scores of a linear router; the choice adds a per-expert correction
bias (``e_score_correction_bias``, adjusted outside the gradient to balance load, so no auxiliary
loss is needed) and is restricted to the ``topk_group`` best of ``n_group`` expert groups (a
group scores the sum of its two best experts); the weights of the ``num_experts_per_tok`` chosen
experts are their un-biased scores, normalised to sum to 1 (``norm_topk_prob``) and multiplied by
``routed_scaling_factor``. Every token also goes through the shared expert.

Tokens are dispatched ``chunk_tokens`` at a time, so the gathered per-expert inputs never exceed
one chunk (the reference work needed this at 512k tokens, where the busiest GPU got 4x the mean
load). Chunking changes memory, not results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import SwiGLU, clamped_swiglu

__all__ = ["Router", "Experts", "MoE"]


class Router(nn.Module):
    """Sigmoid top-k router with group restriction and a load-balancing correction bias.

    Shapes: ``x [N, H] -> (logits [N, E] fp32, weights [N, k] fp32, indices [N, k] int64)``.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1), float("-inf"))
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.scaling, indices


class Experts(nn.Module):
    """Routed experts stored as stacked tensors (the checkpoint layout).

    Parameters: ``gate_up_proj [E, 2I, H]`` (gate rows then up rows), ``down_proj [E, H, I]``.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.limit = config.swiglu_limit
        nn.init.normal_(self.gate_up_proj, std=config.initializer_range)
        nn.init.normal_(self.down_proj, std=config.initializer_range)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply each token's chosen experts.

        Args:
            x: ``[N, H]`` tokens.
            indices: ``[N, k]`` chosen experts.
            weights: ``[N, k]`` their weights.

        Returns:
            ``[N, H]`` weighted sum of expert outputs, and ``[E]`` int64 tokens per expert.
        """
        n, k = indices.shape
        flat = indices.reshape(-1)
        order = flat.argsort(stable=True)  # group (token, slot) pairs by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0])
        token_of = order // k
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            rows = order[start:start + count]
            tokens = token_of[start:start + count]
            start += count
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[expert])
            out.index_add_(0, tokens, (y * weights.reshape(-1)[rows, None]).to(out.dtype))
        return out, counts


class MoE(nn.Module):
    """Routed experts + shared expert, over token chunks.

    Args:
        config: the model config.
        chunk_tokens: tokens dispatched at a time (default None: all at once).

    Shapes: ``x [B, T, H] -> [B, T, H]``. After each forward, ``last_load`` holds the ``[E]``
    tokens routed to each expert (for load statistics and bias balancing).
    """

    def __init__(self, config: ModelConfig, chunk_tokens: int | None = None):
        super().__init__()
        self.experts = Experts(config)
        self.gate = Router(config)
        self.shared_experts = SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit)
        self.chunk_tokens = chunk_tokens
        self.last_load: torch.Tensor | None = None
        nn.init.normal_(self.gate.weight, std=config.initializer_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        step = self.chunk_tokens or flat.shape[0]
        outputs = []
        load = torch.zeros(self.gate.num_experts, dtype=torch.int64, device=x.device)
        for chunk in flat.split(step):
            _, weights, indices = self.gate(chunk)
            routed, counts = self.experts(chunk, indices, weights)
            load += counts
            outputs.append(routed)
        self.last_load = load
        return torch.cat(outputs).view(shape) + self.shared_experts(x)
