"""DeepSeek-style mixture of experts as GLM-5.3-Flash uses it, processed in token chunks.

Routing (per token): sigmoid scores of a linear router; the choice adds a per-expert correction
bias (``e_score_correction_bias``, adjusted outside the gradient to balance load) and is
restricted to the ``topk_group`` best of ``n_group`` expert groups (a group scores the sum of its
two best experts); the weights of the ``num_experts_per_tok`` chosen experts are their un-biased
scores, normalised to sum to 1 (``norm_topk_prob``) and multiplied by ``routed_scaling_factor``.
Every token also goes through the shared expert.

Balancing, beyond the bias (all off by default; the trainer switches them on from the recipe):

- ``balance_loss_weight``: DeepSeek-V3's complementary sequence-wise balance loss
  ``alpha * sum_i f_i P_i`` per row of the input (a window, or what one MoE call sees of it),
  with ``f_i = E / (k T) * #{t: i chosen for t}`` and ``P_i = mean_t s_it / sum_j s_jt``. Its
  gradient is added in backward without changing the output (:class:`_WithBalanceLoss`), so it
  reaches the router through every recompute and parallel wrapper that the output goes through.
- ``capacity_factor``: at most ``ceil(capacity_factor * n k / E)`` (token, slot) rows per expert
  per token chunk of ``n`` tokens (a hard bound on the busiest expert's rows); the rows over it,
  lowest routing weight first, are dropped: they add nothing to the output (the token keeps its
  other experts and the shared expert) and are counted in :class:`RoutingStats`. Training only.

Tokens are dispatched ``chunk_tokens`` at a time, so the gathered per-expert inputs never exceed
one chunk (the reference work needed this at 512k tokens, where the busiest GPU got 4x the mean
load). Chunking changes memory, not results.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import SwiGLU, clamped_swiglu
from .lora import experts_forward_weight

__all__ = ["Router", "Experts", "MoE", "RoutingStats", "RoutingTally", "capacity_keep", "moe_layers", "record_routing"]


class Router(nn.Module):
    """Sigmoid top-k router with group restriction and a load-balancing correction bias.

    Shapes: ``x [N, H] -> (logits [N, E] fp32, weights [N, k] fp32, indices [N, k] int64)``;
    the logits are computed in fp32 whatever the autocast state.
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
        # fp32 logits also under autocast, where F.linear would run in bf16: the top-k of 288
        # sigmoid scores is decided by small differences (transformers' router casts both to fp32;
        # Megatron's --moe-router-dtype fp32 does the same for fine-grained MoE)
        with torch.autocast(x.device.type, enabled=False):
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


def capacity_keep(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which (token, slot) rows fit the per-expert capacity: for each expert the ``capacity`` rows
    of highest routing weight (ties: the earlier token), the others dropped.

    Shapes: ``indices [N, k]`` int64, ``weights [N, k]`` -> ``[N, k]`` bool (True: kept).
    """
    flat, w = indices.reshape(-1), weights.detach().reshape(-1)
    by_weight = w.argsort(descending=True, stable=True)
    order = by_weight[flat[by_weight].argsort(stable=True)]  # grouped by expert, heaviest first
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep.view_as(indices)


@dataclass
class RoutingStats:
    """What MoE forwards routed, summed over the tokens they saw (one forward, or a total).

    Attributes:
        load: ``[E]`` int64 (token, slot) rows each expert ran (after any capacity drop).
        dropped: 0-d int64 rows the capacity dropped.
        entropy: 0-d float64 sum over tokens of the router entropy ``-sum_i p_i log p_i``
            (nats) of the normalised scores ``p_i = s_i / sum_j s_j``.
        tokens: tokens routed.
    """

    load: torch.Tensor
    dropped: torch.Tensor
    entropy: torch.Tensor
    tokens: int

    def __add__(self, other: RoutingStats) -> RoutingStats:
        return RoutingStats(self.load + other.load, self.dropped + other.dropped, self.entropy + other.entropy,
                            self.tokens + other.tokens)

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device | str = "cpu") -> RoutingStats:
        """No tokens yet."""
        return cls(torch.zeros(num_experts, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device),
                   torch.zeros((), dtype=torch.float64, device=device), 0)

    def summary(self) -> dict[str, float]:
        """Plain figures: ``load_max_over_mean`` (1.0 balanced, ``E/k`` one expert for all),
        ``dead_fraction`` (experts with no row), ``router_entropy`` (mean nats per token),
        ``top_expert_share`` (the busiest expert's rows over the tokens: over 0.5 means one
        expert takes most tokens), ``dropped_fraction`` (dropped over all rows)."""
        load = self.load.double()
        rows = float(load.sum() + self.dropped)
        return {
            "load_max_over_mean": float(load.max() / load.mean()) if float(load.sum()) > 0 else 0.0,
            "dead_fraction": float((self.load == 0).double().mean()),
            "router_entropy": float(self.entropy) / self.tokens if self.tokens else 0.0,
            "top_expert_share": float(load.max()) / self.tokens if self.tokens else 0.0,
            "dropped_fraction": float(self.dropped) / rows if rows else 0.0,
        }


class _WithBalanceLoss(torch.autograd.Function):
    """``(out, loss) -> out``; backward passes ``out``'s gradient through and gives ``loss`` the
    gradient 1, so ``loss`` is minimised with the model's loss without being added to it."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.loss_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


class RoutingTally:
    """Routes the token chunks of one MoE forward and gathers what they did: the statistics
    (:class:`RoutingStats`), the capacity drop and the sequence-wise balance loss terms.

    Args:
        moe: the layer (its ``gate``, ``capacity_factor``, ``balance_loss_weight``).
        shape: the MoE input's shape ``[..., T, H]``: the balance loss counts each of the
            leading rows of ``T`` tokens as one sequence.
        device: where the counts live.
    """

    def __init__(self, moe: MoE, shape: torch.Size, device: torch.device):
        self.moe = moe
        self.num_experts = moe.gate.num_experts
        self.top_k = moe.gate.top_k
        self.seq_len = shape[-2] if len(shape) > 2 else max(int(math.prod(shape[:-1])), 1)
        self.rows = max(int(math.prod(shape[:-1])) // max(self.seq_len, 1), 1)
        self.stats = RoutingStats.zeros(self.num_experts, device)
        self.capacity = moe.capacity_factor if moe.training else None
        self.balance = moe.balance_loss_weight > 0 and moe.training and torch.is_grad_enabled()
        if self.balance:
            self.chosen = torch.zeros(self.rows, self.num_experts, device=device)   # [rows, E] selections
            self.probs: torch.Tensor = torch.zeros(self.rows, self.num_experts, device=device)  # [rows, E] sum of p

    def route(self, chunk: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``chunk [n, H]`` (rows ``start..start+n`` of the flattened input) -> (weights
        ``[n, k]``, indices ``[n, k]``; a dropped row's index is ``E``, which no expert runs)."""
        logits, weights, indices = self.moe.gate(chunk)
        n, e = chunk.shape[0], self.num_experts
        if self.balance or self.moe.routing_entropy:
            with torch.set_grad_enabled(self.balance):  # the balance loss's gradient flows through probs
                scores = logits.sigmoid()
                probs = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)     # [n, E]
        self.stats.tokens += n
        if self.moe.routing_entropy:
            with torch.no_grad():
                p = probs.detach()
                self.stats.entropy += -(p * p.clamp_min(1e-30).log()).sum().double()
        if self.balance:
            seq = torch.div(torch.arange(start, start + n, device=chunk.device), self.seq_len, rounding_mode="floor")
            self.probs = self.probs.index_add(0, seq, probs)
            self.chosen.index_put_((seq.repeat_interleave(self.top_k), indices.reshape(-1)),
                                   torch.ones((), device=chunk.device), accumulate=True)
        if self.capacity is not None and n > 0:
            keep = capacity_keep(indices, weights, e, max(1, math.ceil(self.capacity * n * self.top_k / e)))
            self.stats.dropped += (~keep).sum()
            indices = indices.masked_fill(~keep, e)
        self.stats.load += torch.bincount(indices.reshape(-1), minlength=e + 1)[:e]
        return weights, indices

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """Record the statistics on the layer (``last_routing``, ``last_balance_loss``) and attach
        the balance loss's gradient to the layer's output ``out``."""
        self.moe.last_routing = self.stats
        if not self.balance:
            self.moe.last_balance_loss = None
            return out
        f = self.chosen * (self.num_experts / (self.top_k * self.seq_len))
        loss = (f * self.probs / self.seq_len).sum(-1).mean()  # sum_i f_i P_i, mean over the rows
        self.moe.last_balance_loss = loss.detach()
        return _WithBalanceLoss.apply(out, self.moe.balance_loss_weight * loss)


class Experts(nn.Module):
    """Routed experts stored as stacked tensors (the checkpoint layout).

    Parameters: ``gate_up_proj [E, 2I, H]`` (gate rows then up rows), ``down_proj [E, H, I]``;
    with LoRA on the routed experts (:class:`genolong.model.lora.ExpertAdapters` as ``.lora``) each
    expert computes with its weight plus its adapter's update.
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
            indices: ``[N, k]`` chosen experts (``E``: a dropped row, not run).
            weights: ``[N, k]`` their weights.

        Returns:
            ``[N, H]`` weighted sum of expert outputs, and ``[E]`` int64 tokens per expert.
        """
        n, k = indices.shape
        num_experts = self.gate_up_proj.shape[0]
        flat = indices.reshape(-1)
        order = flat.argsort(stable=True)  # group (token, slot) pairs by expert; dropped rows last
        counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
        token_of = order // k
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            rows = order[start:start + count]
            tokens = token_of[start:start + count]
            start += count
            gate, up = F.linear(x[tokens], experts_forward_weight(self, "gate_up_proj", expert)).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), experts_forward_weight(self, "down_proj", expert))
            out.index_add_(0, tokens, (y * weights.reshape(-1)[rows, None]).to(out.dtype))
        return out, counts


class MoE(nn.Module):
    """Routed experts + shared expert, over token chunks.

    Args:
        config: the model config.
        chunk_tokens: tokens dispatched at a time (default None: all at once).

    Attributes (set by the trainer; see the module docstring):
        balance_loss_weight: the sequence-wise balance loss's ``alpha`` (default 0: off).
        capacity_factor: per-expert capacity over the mean rows, training only (default None:
            no capacity, nothing dropped).
        routing_entropy: compute the router entropy for the statistics (default True; the
            loads are always counted, the bias balancing needs them).

    Shapes: ``x [B, T, H] -> [B, T, H]``. After each forward, ``last_routing`` holds its
    :class:`RoutingStats` (``last_load`` its ``[E]`` loads, for the bias balancing) and
    ``last_balance_loss`` the balance loss ``sum_i f_i P_i`` without ``alpha`` (None when off).
    """

    def __init__(self, config: ModelConfig, chunk_tokens: int | None = None):
        super().__init__()
        self.experts = Experts(config)
        self.gate = Router(config)
        self.shared_experts = SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit)
        self.chunk_tokens = chunk_tokens
        self.balance_loss_weight = 0.0
        self.capacity_factor: float | None = None
        self.routing_entropy = True
        self.last_routing: RoutingStats | None = None
        self.last_balance_loss: torch.Tensor | None = None
        nn.init.normal_(self.gate.weight, std=config.initializer_range)

    @property
    def last_load(self) -> torch.Tensor | None:
        """``[E]`` int64 rows each expert ran in the last forward (None before one)."""
        return None if self.last_routing is None else self.last_routing.load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        step = self.chunk_tokens or max(flat.shape[0], 1)
        tally = RoutingTally(self, shape, x.device)
        outputs = []
        for start in range(0, flat.shape[0], step):
            chunk = flat[start:start + step]
            weights, indices = tally.route(chunk, start)
            outputs.append(self.experts(chunk, indices, weights)[0])
        routed = torch.cat(outputs) if outputs else torch.zeros_like(flat)
        return tally.finish(routed.view(shape) + self.shared_experts(x))


def moe_layers(model: nn.Module) -> list[tuple[str, int, MoE]]:
    """The MoE modules of ``model`` in model order: (module name, e.g. ``layers.1.mlp``; its
    decoder-layer index, from the name, else its position among the MoE modules; the module)."""
    named = [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]
    return [(name, int(m.group(1)) if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", name)) else j, module)
            for j, (name, module) in enumerate(named)]


@contextmanager
def record_routing(model: nn.Module) -> Iterator[dict[str, RoutingStats]]:
    """Sum the :class:`RoutingStats` of every MoE forward of ``model`` while the block runs.

    Yields ``{module name: RoutingStats}`` (filled in as forwards run), e.g.
    ``{"layers.1.mlp": ...}``, in model order.
    """
    totals: dict[str, RoutingStats] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            def hook(mod: nn.Module, args: Any, output: Any, name: str = name) -> None:
                stats = mod.last_routing
                if stats is not None:
                    totals[name] = stats if name not in totals else totals[name] + stats
            handles.append(module.register_forward_hook(hook))
    try:
        yield totals
    finally:
        for handle in handles:
            handle.remove()
