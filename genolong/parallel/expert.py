"""Expert parallelism over the plain :class:`~genolong.model.moe.MoE` modules of a GenoLM.

Each rank of an expert-parallel (EP) group of ``ep`` ranks keeps ``n_routed_experts / ep`` of
every MoE layer's routed experts: ``experts.gate_up_proj`` and ``experts.down_proj`` (and, under
LoRA on the routed experts, their adapters' factors ``experts.lora.lora_A/B[name].weight``, stacked
by expert as well: :class:`genolong.model.lora.ExpertAdapters`) become DTensors ``Shard(0)`` over
the EP mesh, so ``state_dict`` keys and global shapes
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) stay the one-process model's and the
checkpoint format is unchanged (FSDP2 may shard them further over the ranks left,
:func:`genolong.parallel.parallelize.apply_fsdp`).

Per MoE token chunk (``MoE.chunk_tokens``, or all the rank's tokens) the installed forward:

1. routes the rank's own tokens (router and shared expert as in one process);
2. sorts the ``(token, slot)`` rows by expert, which also groups them by destination rank
   (rank ``j`` holds experts ``[j E/ep, (j+1) E/ep)``);
3. exchanges the per-expert row counts (an all-to-all of ``E/ep`` int64 per destination) and
   sends each row, ``H`` values, to its expert's rank (the *dispatch* all-to-all, variable
   splits; the rows a rank keeps do not travel);
4. runs the local experts on the received rows grouped by expert (inside ``Experts.__call__``,
   so FSDP2's unshard hooks of the experts unit wrap it);
5. sends the expert outputs back, unweighted (the *combine* all-to-all), and multiplies by the
   routing weights at the source, so the weights' gradient stays local.

Backward runs the two payload all-to-alls again, reversed (autograd functions over
``torch.distributed.all_to_all_single``; gloo on CPU and NCCL both have it). Under recompute the
forward exchanges run again. Results equal the one-process model up to float summation order.

Every rank of an EP group must call each MoE the same number of times (true of genolong's
training: equal CP slices and batch shapes); within one call the ranks agree on the number of
token chunks through the count exchange itself (the high bits of the counts carry each rank's
chunk count; a rank with fewer chunks takes part with empty ones), so unequal token counts per
call are fine.

Measured per process (:class:`AllToAllCounter`, one per model, :func:`ep_comm_counter`): the
bytes each all-to-all sent to *other* ranks, split into the forward pass (``forward``), forward
exchanges run again inside backward by recompute (``recompute``), the backward pass
(``backward``) and the count exchanges (``splits``); plus per MoE layer the rows (token, slot
pairs) this rank received, ``MoE.last_received`` (its own rows included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..errors import InputError
from ..model.layers import clamped_swiglu
from ..model.moe import MoE, RoutingTally

__all__ = ["AllToAllCounter", "apply_expert_parallel", "ep_comm_counter", "expert_parallel_size", "is_expert_parallel"]

# the count exchange carries each rank's number of token chunks of the call in these high bits
# (a chunk has far fewer than 2**40 rows)
_CHUNK_SHIFT = 40
_COUNT_MASK = (1 << _CHUNK_SHIFT) - 1


@dataclass
class AllToAllCounter:
    """Bytes the expert-parallel all-to-alls of one process sent to other ranks, since the last
    :meth:`reset`.

    Attributes:
        forward: dispatch + combine payload bytes of forward passes.
        recompute: the same, of forward exchanges run again during backward (recompute).
        backward: payload bytes of the backward all-to-alls (the reversed dispatch and combine).
        splits: bytes of the per-expert count exchanges (``(ep - 1) * E/ep * 8`` per dispatch,
            forward and recompute; backward reuses the forward's counts).
        dispatches: dispatch all-to-alls run (forward and recompute).
    """

    forward: int = 0
    recompute: int = 0
    backward: int = 0
    splits: int = 0
    dispatches: int = 0

    def reset(self) -> None:
        """Zero every count."""
        self.forward = self.recompute = self.backward = self.splits = self.dispatches = 0

    def as_dict(self) -> dict[str, int]:
        """``{"forward", "recompute", "backward", "splits", "dispatches"}`` as ints."""
        return {"forward": self.forward, "recompute": self.recompute, "backward": self.backward,
                "splits": self.splits, "dispatches": self.dispatches}


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


class _AllToAll(torch.autograd.Function):
    """Differentiable variable-split all-to-all of rows: ``x [sum(send), H] -> [sum(recv), H]``;
    backward sends the gradient rows back with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup,
                rank: int, counter: AllToAllCounter) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.rank, ctx.counter = send, recv, group, rank, counter
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        sent = (sum(send) - send[rank]) * math.prod(x.shape[1:]) * x.element_size()
        if _in_backward():
            counter.recompute += sent
        else:
            counter.forward += sent
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group)
        ctx.counter.backward += (sum(ctx.recv) - ctx.recv[ctx.rank]) * math.prod(grad.shape[1:]) * grad.element_size()
        return out, None, None, None, None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _LocalExperts:
    """``Experts.forward`` under EP: ``(rows [R, H] grouped by local expert, counts) -> [R, H]``,
    each local expert's clamped SwiGLU on its rows (unweighted). Every local expert runs, even on
    zero rows, so that every rank produces a gradient for all its expert weights (FSDP2's
    reduce-scatter needs the same parameters on every rank)."""

    def __init__(self, experts: nn.Module):
        self.experts = experts

    def __call__(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        gate_up, down = _local(self.experts.gate_up_proj), _local(self.experts.down_proj)
        adapters = getattr(self.experts, "lora", None)  # LoRA: the local experts' factors, sharded with them
        outs, start = [], 0
        for e, count in enumerate(counts):
            x = rows[start:start + count]
            start += count
            w_gate_up = gate_up[e] if adapters is None else adapters.expert_weight(gate_up, "gate_up_proj", e)
            w_down = down[e] if adapters is None else adapters.expert_weight(down, "down_proj", e)
            gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
            outs.append(F.linear(clamped_swiglu(gate, up, self.experts.limit), w_down))
        return torch.cat(outs)


class _ExpertParallelForward:
    """``MoE.forward`` under EP (see the module docstring); ``x [B, T, H] -> [B, T, H]``. Sets
    ``module.last_routing`` (its ``load``: ``[E]`` rows this rank routed to each expert, its own
    tokens only, so a sum over all ranks is the global load; the balance loss and the capacity
    drop act on the rank's own tokens, as in one process) and ``module.last_received`` (rows this
    rank's experts received, summed over chunks)."""

    def __init__(self, module: MoE, group: dist.ProcessGroup, counter: AllToAllCounter):
        self.module, self.group, self.counter = module, group, counter
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_experts = module.gate.num_experts // self.ep

    def _counts(self, counts: torch.Tensor, n_chunks: int) -> torch.Tensor:
        """All-to-all of the per-expert counts ``[ep, E/ep]`` (row j to rank j) with this rank's
        chunk count in the high bits -> ``[ep, E/ep]`` received (row s from rank s)."""
        send = (counts.view(self.ep, self.local_experts) + (n_chunks << _CHUNK_SHIFT)).reshape(-1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        self.counter.splits += (self.ep - 1) * self.local_experts * send.element_size()
        self.counter.dispatches += 1
        return recv.view(self.ep, self.local_experts)

    def _chunk(self, chunk: torch.Tensor, start: int, n_chunks: int, tally: RoutingTally) -> tuple[torch.Tensor, int, int]:
        """One token chunk ``[n, H]`` (rows from ``start`` of the rank's flattened input) ->
        (routed output ``[n, H]``, rows received, the group's largest chunk count)."""
        m = self.module
        weights, indices = tally.route(chunk, start)
        k = indices.shape[1]
        flat = indices.reshape(-1)
        counts = torch.bincount(flat, minlength=m.gate.num_experts + 1)[:m.gate.num_experts]
        # (token, slot) rows grouped by expert; rows the capacity dropped (index E) sort last, unsent
        order = flat.argsort(stable=True)[:int(counts.sum())]
        header = self._counts(counts, n_chunks).cpu()
        recv_counts = header & _COUNT_MASK                 # [ep sources, E/ep local experts]
        group_chunks = int((header >> _CHUNK_SHIFT).max())
        send_splits = counts.view(self.ep, self.local_experts).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        token_of = order // k
        rows = _AllToAll.apply(chunk[token_of], send_splits, recv_splits, self.group, self.rank, self.counter)
        # received rows: source-major, expert-minor; the local experts want them expert-major
        lengths = recv_counts.reshape(-1)
        starts = torch.cumsum(lengths, 0) - lengths        # start of each (source, expert) block
        seg_len = recv_counts.t().reshape(-1)              # blocks in expert-major order
        seg_start = starts.view(self.ep, self.local_experts).t().reshape(-1)
        seg_out = torch.cumsum(seg_len, 0) - seg_len
        total = int(seg_len.sum())
        perm = (torch.repeat_interleave(seg_start - seg_out, seg_len) + torch.arange(total)).to(chunk.device)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(total, device=chunk.device)
        y = m.experts(rows.index_select(0, perm), recv_counts.sum(0).tolist())
        back = _AllToAll.apply(y.index_select(0, inverse), recv_splits, send_splits, self.group, self.rank, self.counter)
        out = torch.zeros_like(chunk)
        out.index_add_(0, token_of, (back * weights.reshape(-1)[order, None]).to(out.dtype))
        return out, total, group_chunks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        step = m.chunk_tokens or max(flat.shape[0], 1)
        chunks = list(flat.split(step)) if flat.shape[0] else []
        tally = RoutingTally(m, shape, x.device)
        outputs, received, i, group_chunks = [], 0, 0, 1
        while i < group_chunks:
            chunk = chunks[i] if i < len(chunks) else flat[:0]   # empty: another rank has more chunks
            routed, got, chunks_seen = self._chunk(chunk, i * step, len(chunks), tally)
            group_chunks = chunks_seen if i == 0 else group_chunks
            received += got
            # kept even when empty (no rows): its exchanges must be in the autograd graph, so that
            # every rank of the group runs the same backward all-to-alls in the same order
            outputs.append(routed)
            i += 1
        m.last_received = received
        return tally.finish(torch.cat(outputs).view(shape) + m.shared_experts(x))


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether :func:`apply_expert_parallel` was applied to this MoE module."""
    return isinstance(module.__dict__.get("forward"), _ExpertParallelForward)


def expert_parallel_size(model: nn.Module) -> int:
    """The EP group size of ``model``'s MoE layers (1 when expert parallelism is not applied)."""
    for module in model.modules():
        if is_expert_parallel(module):
            return module.forward.ep  # type: ignore[union-attr]
    return 1


def ep_comm_counter(model: nn.Module) -> AllToAllCounter | None:
    """The all-to-all byte counter shared by ``model``'s expert-parallel MoE layers (None when
    expert parallelism is not applied)."""
    for module in model.modules():
        if is_expert_parallel(module):
            return module.forward.counter  # type: ignore[union-attr]
    return None


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh | None) -> int:
    """Spread the routed experts of every MoE of ``model`` over the 1-D EP mesh ``ep_mesh`` and
    route tokens to them by all-to-all (see the module docstring); in place.

    Args:
        model: a GenoLM (or any module holding :class:`~genolong.model.moe.MoE` modules), with the
            same weights on every rank of the mesh (as FSDP2 also assumes).
        ep_mesh: the ``"ep"`` dimension of :func:`genolong.parallel.mesh.expert_mesh` (``ep``
            consecutive ranks); None or a mesh of size 1: nothing changes.

    Returns:
        The number of MoE modules changed.

    Raises:
        InputError: the EP size does not divide a layer's ``n_routed_experts``, or expert
            parallelism is already applied.
    """
    if ep_mesh is None or ep_mesh.size() == 1:
        return 0
    if ep_mesh.ndim != 1:
        raise InputError(f"apply_expert_parallel needs the 1-D \"ep\" mesh, got a {ep_mesh.ndim}-D one")
    ep = ep_mesh.size()
    group = ep_mesh.get_group()
    coordinate = ep_mesh.get_local_rank()
    counter = AllToAllCounter()
    count = 0
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        if is_expert_parallel(module):
            raise InputError("expert parallelism is already applied to this model; apply it once")
        experts = module.gate.num_experts
        if experts % ep:
            raise InputError(f"parallel.ep = {ep} does not divide the model's n_routed_experts = {experts}; "
                             f"choose ep among the divisors of {experts}")
        local = experts // ep
        # the experts' weights, and their LoRA factors (ExpertAdapters, stacked by expert too)
        owners = [(module.experts, name) for name in ("gate_up_proj", "down_proj")]
        adapters = getattr(module.experts, "lora", None)
        if adapters is not None:
            owners += [(factors[name], "weight") for factors in (adapters.lora_A, adapters.lora_B) for name in factors]
        for owner, name in owners:
            full = getattr(owner, name)
            # this rank's experts, no communication: every rank holds the same full weights
            piece = full.detach()[coordinate * local:(coordinate + 1) * local].clone()
            dtensor = DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False,
                                         shape=full.shape, stride=full.stride())
            setattr(owner, name, nn.Parameter(dtensor, requires_grad=full.requires_grad))
        module.experts.forward = _LocalExperts(module.experts)  # type: ignore[method-assign]
        module.forward = _ExpertParallelForward(module, group, counter)  # type: ignore[method-assign]
        module.last_received = 0
        count += 1
    return count
