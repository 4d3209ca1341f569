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

Host syncs: all chunks are routed first; the experts then run as one grouped matmul per
projection where torch has one for the device (``torch._grouped_mm``: CUDA, bf16, compute
capability 9.0+; :func:`grouped_mm_supported`), which needs no row count on the host, else as the
per-expert loop (the reference), whose row counts for every chunk are read back in one transfer
per layer call. Rows per expert are counted with a sort (:func:`expert_counts`), not
``torch.bincount``, which reads the largest id back on CUDA. So a MoE call makes at most one
device-to-host sync, whatever the number of chunks (``genolong.memory.host_syncs``).
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

__all__ = [
    "Router",
    "Experts",
    "MoE",
    "RoutingStats",
    "RoutingTally",
    "capacity_keep",
    "expert_counts",
    "experts_grouped",
    "experts_loop",
    "grouped_mm_supported",
    "moe_layers",
    "record_routing",
]


def expert_counts(flat: torch.Tensor, n: int) -> torch.Tensor:
    """Rows per id: ``flat [R]`` int64 ids in ``[0, n)`` -> ``[n]`` int64 counts.

    A sort and a binary search (deterministic, sizes known in advance): ``torch.bincount`` gives
    the same counts but reads the largest id back to the host on CUDA (a sync per call).
    """
    ordered = torch.sort(flat).values
    edges = torch.searchsorted(ordered, torch.arange(n + 1, device=flat.device, dtype=flat.dtype))
    return edges[1:] - edges[:-1]


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the experts run as a grouped matmul for these operands: ``torch._grouped_mm`` exists,
    ``x`` is on CUDA with compute capability 9.0 or newer, the operands compute in bf16 (their
    dtype, or the CUDA autocast dtype) and every weight dimension is a multiple of 8 (16-byte rows).
    Elsewhere (CPU, older GPUs, fp32) the per-expert loop runs (:func:`experts_loop`)."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda":
        return False
    if torch.is_autocast_enabled("cuda"):  # bf16-mixed: fp32 master weights, cast like F.linear's
        if torch.get_autocast_dtype("cuda") != torch.bfloat16:
            return False
    elif any(t.dtype != torch.bfloat16 for t in (x, *weights)):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(d % 8 == 0 for w in weights for d in w.shape[1:])


def experts_grouped(
    rows: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float
) -> torch.Tensor:
    """The routed experts on rows grouped by expert, as two grouped matmuls (no host sync).

    Args:
        rows: ``[R, H]``, expert ``e``'s rows after those of experts ``< e``; rows past
            ``counts.sum()`` (dropped by the capacity) give 0.
        counts: ``[E]`` int64 rows per expert (on the rows' device).
        gate_up: ``[E, 2I, H]``; down: ``[E, H, I]`` (the experts' stacked weights).
        limit: the SwiGLU clamp.

    Returns:
        ``[R, H]`` the unweighted expert outputs, in the compute dtype (the operands', or the
        autocast dtype).
    """
    dtype = torch.get_autocast_dtype(rows.device.type) if torch.is_autocast_enabled(rows.device.type) else rows.dtype
    offs = torch.cumsum(counts, 0).to(torch.int32)
    # rows past the last group are neither read nor written by the grouped matmul (its backward
    # leaves their input gradient unwritten): masked both ways, so they give 0 and get 0
    kept = torch.arange(rows.shape[0], device=rows.device) < offs[-1:].long()
    zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
    rows = torch.where(kept[:, None], rows, zero)
    with torch.autocast(rows.device.type, enabled=False):
        h = torch._grouped_mm(rows.to(dtype), gate_up.to(dtype).transpose(-2, -1), offs=offs)  # [R, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(clamped_swiglu(gate, up, limit).contiguous(), down.to(dtype).transpose(-2, -1), offs=offs)
    return torch.where(kept[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))


def experts_loop(rows: torch.Tensor, counts: list[int], weight: Any, limit: float) -> torch.Tensor:
    """The reference of :func:`experts_grouped`: each expert's clamped SwiGLU on its rows in turn.

    Args:
        rows: ``[R, H]`` grouped by expert (rows past ``sum(counts)`` give 0).
        counts: rows per expert, on the host.
        weight: ``weight(name, e)`` -> expert ``e``'s ``gate_up_proj`` ``[2I, H]`` or ``down_proj``
            ``[H, I]`` (with its LoRA update when the experts carry adapters).
        limit: the SwiGLU clamp.

    Returns:
        ``[R, H]`` unweighted expert outputs. Every expert runs, on zero rows too, so the result
        always depends on ``rows`` and on every expert's weights (under expert parallelism every
        rank must run the backward of the all-to-all that brought ``rows``, and FSDP2 needs a
        gradient for every weight on every rank).
    """
    outs, start = [], 0
    for e, count in enumerate(counts):
        gate, up = F.linear(rows[start : start + count], weight("gate_up_proj", e)).chunk(2, dim=-1)
        outs.append(F.linear(clamped_swiglu(gate, up, limit), weight("down_proj", e)))
        start += count
    if start < rows.shape[0]:  # rows the capacity dropped (sorted last): zeros
        outs.append(outs[-1].new_zeros(rows.shape[0] - start, outs[-1].shape[1]))
    return torch.cat(outs)


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
    counts = expert_counts(flat, num_experts)
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
        return RoutingStats(
            self.load + other.load,
            self.dropped + other.dropped,
            self.entropy + other.entropy,
            self.tokens + other.tokens,
        )

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device | str = "cpu") -> RoutingStats:
        """No tokens yet."""
        return cls(
            torch.zeros(num_experts, dtype=torch.int64, device=device),
            torch.zeros((), dtype=torch.int64, device=device),
            torch.zeros((), dtype=torch.float64, device=device),
            0,
        )

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
            self.chosen = torch.zeros(self.rows, self.num_experts, device=device)  # [rows, E] selections
            self.probs: torch.Tensor = torch.zeros(self.rows, self.num_experts, device=device)  # [rows, E] sum of p

    def route(self, chunk: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``chunk [n, H]`` (rows ``start..start+n`` of the flattened input) -> (weights
        ``[n, k]``, indices ``[n, k]``; a dropped row's index is ``E``, which no expert runs)."""
        logits, weights, indices = self.moe.gate(chunk)
        n, e = chunk.shape[0], self.num_experts
        if self.balance or self.moe.routing_entropy:
            with torch.set_grad_enabled(self.balance):  # the balance loss's gradient flows through probs
                scores = logits.sigmoid()
                probs = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)  # [n, E]
        self.stats.tokens += n
        if self.moe.routing_entropy:
            with torch.no_grad():
                p = probs.detach()
                self.stats.entropy += -(p * p.clamp_min(1e-30).log()).sum().double()
        if self.balance:
            seq = torch.div(torch.arange(start, start + n, device=chunk.device), self.seq_len, rounding_mode="floor")
            self.probs = self.probs.index_add(0, seq, probs)
            self.chosen.index_put_(
                (seq.repeat_interleave(self.top_k), indices.reshape(-1)),
                torch.ones((), device=chunk.device),
                accumulate=True,
            )
        if self.capacity is not None and n > 0:
            keep = capacity_keep(indices, weights, e, max(1, math.ceil(self.capacity * n * self.top_k / e)))
            self.stats.dropped += (~keep).sum()
            indices = indices.masked_fill(~keep, e)
        self.stats.load += expert_counts(indices.reshape(-1), e + 1)[:e]
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

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs the grouped matmul for ``x`` (:func:`grouped_mm_supported`;
        never with LoRA adapters on the experts, whose per-expert weights the loop builds)."""
        return getattr(self, "lora", None) is None and grouped_mm_supported(x, self.gate_up_proj, self.down_proj)

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, host_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply each token's chosen experts.

        Args:
            x: ``[N, H]`` tokens.
            indices: ``[N, k]`` chosen experts (``E``: a dropped row, not run).
            weights: ``[N, k]`` their weights.
            host_counts: the per-expert row counts on the host for the loop (default None: read
                back here, one sync; :class:`MoE` reads every chunk's at once); unused by the
                grouped matmul.

        Returns:
            ``[N, H]`` weighted sum of expert outputs, and ``[E]`` int64 tokens per expert.
        """
        n, k = indices.shape
        num_experts = self.gate_up_proj.shape[0]
        flat = indices.reshape(-1)
        order = flat.argsort(stable=True)  # group (token, slot) pairs by expert; dropped rows last
        counts = expert_counts(flat, num_experts + 1)[:num_experts]
        token_of = order // k
        rows = x[token_of]
        if self.grouped(x):
            y = experts_grouped(rows, counts, self.gate_up_proj, self.down_proj, self.limit)
        else:
            host = counts.tolist() if host_counts is None else host_counts
            y = experts_loop(rows, host, lambda name, e: experts_forward_weight(self, name, e), self.limit)
        out = torch.zeros_like(x)
        # dropped rows (index E, sorted last) have weight 0 here and an output of 0
        w = weights.reshape(-1)[order].masked_fill(flat[order] >= num_experts, 0)
        out.index_add_(0, token_of, (y * w[:, None]).to(out.dtype))
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
        self.shared_experts = SwiGLU(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit
        )
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
        starts = range(0, flat.shape[0], step)
        routes = [tally.route(flat[start : start + step], start) for start in starts]  # every chunk first
        host: list[list[int] | None] = [None] * len(routes)
        if routes and not self.experts.grouped(flat):
            # the loop's row counts of every chunk in one read (one sync per call, not per chunk)
            e = self.gate.num_experts
            host = torch.stack([expert_counts(indices.reshape(-1), e + 1)[:e] for _, indices in routes]).tolist()
        outputs = [
            self.experts(flat[start : start + step], indices, weights, counts)[0]
            for start, (weights, indices), counts in zip(starts, routes, host)
        ]
        routed = torch.cat(outputs) if outputs else torch.zeros_like(flat)
        return tally.finish(routed.view(shape) + self.shared_experts(x))


def moe_layers(model: nn.Module) -> list[tuple[str, int, MoE]]:
    """The MoE modules of ``model`` in model order: (module name, e.g. ``layers.1.mlp``; its
    decoder-layer index, from the name, else its position among the MoE modules; the module)."""
    named = [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]
    return [
        (name, int(m.group(1)) if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", name)) else j, module)
        for j, (name, module) in enumerate(named)
    ]


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
