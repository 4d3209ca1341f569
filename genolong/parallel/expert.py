"""Expert parallelism over the plain :class:`~genolong.model.moe.MoE` modules of a GenoLM.

Each rank of an expert-parallel (EP) group of ``ep`` ranks keeps ``n_routed_experts / ep`` of
every MoE layer's routed experts: ``experts.gate_up_proj`` and ``experts.down_proj`` (and, under
LoRA on the routed experts, their adapters' factors ``experts.lora.lora_A/B[name].weight``, stacked
by expert as well: :class:`genolong.model.lora.ExpertAdapters`) become DTensors ``Shard(0)`` over
the EP mesh, so ``state_dict`` keys and global shapes
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) stay the one-process model's and the
checkpoint format is unchanged (FSDP2 may shard them further over the ranks left,
:func:`genolong.parallel.parallelize.apply_fsdp`).

The installed forward routes every token chunk (``MoE.chunk_tokens``, or all the rank's tokens)
of the rank's own tokens first (router and shared expert as in one process), then exchanges the
per-expert row counts of all chunks at once: an all-to-all of the first chunk's ``E/ep`` int64
counts per destination, with the rank's chunk count in their high bits, and, when a rank of the
group has more than one chunk, one more all-to-all of the other chunks' counts. Both are read back
to the host in one transfer each, so the split sizes cost at most two device-to-host syncs per
layer call, whatever the number of chunks. Then per chunk:

1. sorts the ``(token, slot)`` rows by expert, which also groups them by destination rank
   (rank ``j`` holds experts ``[j E/ep, (j+1) E/ep)``);
2. sends each row, ``H`` values, to its expert's rank (the *dispatch* all-to-all, variable
   splits from the host counts; the rows a rank keeps do not travel);
3. runs the local experts on the received rows grouped by expert (inside ``Experts.__call__``,
   so FSDP2's unshard hooks of the experts unit wrap it): one grouped matmul per projection where
   torch has one for the device (:func:`genolong.model.moe.grouped_mm_supported`), else the
   per-expert loop (the reference);
4. sends the expert outputs back, unweighted (the *combine* all-to-all), and multiplies by the
   routing weights at the source, so the weights' gradient stays local.

Backward runs the two payload all-to-alls again, reversed (autograd functions over
``torch.distributed.all_to_all_single``; gloo on CPU and NCCL both have it). Under recompute the
forward exchanges run again. Results equal the one-process model up to float summation order.

Every rank of an EP group must call each MoE the same number of times (true of genolong's
training: equal CP slices and batch shapes); within one call the ranks agree on the number of
token chunks through the count exchange itself (the high bits of the first chunk's counts carry
each rank's chunk count; a rank with fewer chunks takes part with empty ones), so unequal token
counts per call are fine.

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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..errors import InputError
from ..model.moe import MoE, RoutingTally, expert_counts, experts_grouped, experts_loop, grouped_mm_supported

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
            forward and recompute, sent in one or two all-to-alls per layer call; backward reuses
            the forward's counts).
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
        return {
            "forward": self.forward,
            "recompute": self.recompute,
            "backward": self.backward,
            "splits": self.splits,
            "dispatches": self.dispatches,
        }


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


class _AllToAll(torch.autograd.Function):
    """Differentiable variable-split all-to-all of rows: ``x [sum(send), H] -> [sum(recv), H]``;
    backward sends the gradient rows back with the splits swapped."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send: list[int],
        recv: list[int],
        group: dist.ProcessGroup,
        rank: int,
        counter: AllToAllCounter,
    ) -> torch.Tensor:
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
        dist.all_to_all_single(
            out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        ctx.counter.backward += (sum(ctx.recv) - ctx.recv[ctx.rank]) * math.prod(grad.shape[1:]) * grad.element_size()
        return out, None, None, None, None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _LocalExperts:
    """``Experts.forward`` under EP: ``(rows [R, H] grouped by local expert, counts) -> [R, H]``,
    each local expert's clamped SwiGLU on its rows (unweighted): one grouped matmul per projection
    where torch has one for the device (:func:`~genolong.model.moe.experts_grouped`), else the
    per-expert loop (:func:`~genolong.model.moe.experts_loop`, the reference; also with LoRA on
    the experts). Every local expert takes part, even on zero rows, so that every rank produces a
    gradient for all its expert weights (FSDP2's reduce-scatter needs the same parameters on every
    rank)."""

    def __init__(self, experts: nn.Module):
        self.experts = experts

    def grouped(self, rows: torch.Tensor) -> bool:
        """Whether :meth:`__call__` runs the grouped matmul on ``rows``."""
        gate_up, down = _local(self.experts.gate_up_proj), _local(self.experts.down_proj)
        return getattr(self.experts, "lora", None) is None and grouped_mm_supported(rows, gate_up, down)

    def __call__(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        gate_up, down = _local(self.experts.gate_up_proj), _local(self.experts.down_proj)
        limit = self.experts.limit
        if rows.shape[0] and self.grouped(rows):
            device_counts = torch.tensor(list(counts), dtype=torch.int64).to(rows.device, non_blocking=True)
            return experts_grouped(rows, device_counts, gate_up, down, limit)
        adapters = getattr(self.experts, "lora", None)  # LoRA: the local experts' factors, sharded with them

        def weight(name: str, e: int) -> torch.Tensor:
            base = gate_up if name == "gate_up_proj" else down
            return base[e] if adapters is None else adapters.expert_weight(base, name, e)

        return experts_loop(rows, list(counts), weight, limit)


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

    def _exchange(self, counts: torch.Tensor) -> torch.Tensor:
        """All-to-all of per-expert counts ``[ep, c, E/ep]`` (block j to rank j) -> ``[ep, c, E/ep]``
        received (block s from rank s); counted as ``c`` count exchanges."""
        send = counts.contiguous().reshape(-1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        self.counter.splits += (self.ep - 1) * counts.shape[1] * self.local_experts * send.element_size()
        return recv.view(self.ep, counts.shape[1], self.local_experts)

    def _split_sizes(self, counts: list[torch.Tensor]) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Every chunk's split sizes on the host, in at most two reads.

        Args:
            counts: per local chunk, ``[E]`` rows this rank routed to each expert (on the device).

        Returns:
            ``(sent, received)`` for the group's ``n`` chunks (the most any rank has; this rank's
            missing ones are empty): ``sent[i]`` the ``E`` counts of chunk ``i`` by expert,
            ``received[i][s]`` the ``E/ep`` counts rank ``s`` sends this rank's experts.
        """
        e, n_local = self.module.gate.num_experts, len(counts)
        dev = counts[0].device if counts else self.module.gate.weight.device
        local = torch.stack(counts) if counts else torch.zeros(0, e, dtype=torch.int64, device=dev)
        first = local[:1] if n_local else torch.zeros(1, e, dtype=torch.int64, device=dev)
        # the first chunk's counts carry this rank's chunk count in their high bits
        header = self._exchange(
            (first + (n_local << _CHUNK_SHIFT)).view(1, self.ep, self.local_experts).transpose(0, 1)
        )
        host = torch.cat([header.reshape(-1), local.reshape(-1)]).tolist()  # one read
        head, sent = host[: header.numel()], host[header.numel() :]
        n = max(v >> _CHUNK_SHIFT for v in head)
        received = [
            [
                [v & _COUNT_MASK for v in head[s * self.local_experts : (s + 1) * self.local_experts]]
                for s in range(self.ep)
            ]
        ]
        sent_rows = [sent[i * e : (i + 1) * e] for i in range(n_local)] + [[0] * e] * (n - n_local)
        if n > 1:  # the other chunks' counts in one more exchange (padded to the group's n chunks)
            rest = torch.zeros(n - 1, e, dtype=torch.int64, device=dev)
            rest[: max(n_local - 1, 0)] = local[1:]
            more = self._exchange(
                rest.view(n - 1, self.ep, self.local_experts).transpose(0, 1)
            ).tolist()  # [ep, n-1, E/ep]
            received += [[more[s][i] for s in range(self.ep)] for i in range(n - 1)]
        return sent_rows, received

    def _chunk(
        self,
        chunk: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        sent: list[int],
        received: list[list[int]],
    ) -> tuple[torch.Tensor, int]:
        """One routed token chunk ``[n, H]`` with its split sizes (host lists) -> (routed output
        ``[n, H]``, rows received)."""
        m = self.module
        k = indices.shape[1]
        flat = indices.reshape(-1)
        self.counter.dispatches += 1
        # (token, slot) rows grouped by expert; rows the capacity dropped (index E) sort last, unsent
        order = flat.argsort(stable=True)[: sum(sent)]
        send_splits = [sum(sent[j * self.local_experts : (j + 1) * self.local_experts]) for j in range(self.ep)]
        recv_splits = [sum(row) for row in received]
        token_of = order // k
        rows = _AllToAll.apply(chunk[token_of], send_splits, recv_splits, self.group, self.rank, self.counter)
        # received rows: source-major, expert-minor; the local experts want them expert-major
        seg_len = [received[s][e] for e in range(self.local_experts) for s in range(self.ep)]
        block_start, start = [], 0
        for s in range(self.ep):
            for e in range(self.local_experts):
                block_start.append(start)
                start += received[s][e]
        seg_start = [block_start[s * self.local_experts + e] for e in range(self.local_experts) for s in range(self.ep)]
        total = sum(seg_len)
        seg_out, acc = [], 0
        for n_rows in seg_len:
            seg_out.append(acc)
            acc += n_rows
        lengths = torch.tensor(seg_len, dtype=torch.int64)
        shift = torch.tensor([a - b for a, b in zip(seg_start, seg_out)], dtype=torch.int64)
        perm = (torch.repeat_interleave(shift, lengths, output_size=total) + torch.arange(total)).to(chunk.device)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(total, device=chunk.device)
        per_expert = [sum(received[s][e] for s in range(self.ep)) for e in range(self.local_experts)]
        y = m.experts(rows.index_select(0, perm), per_expert)
        back = _AllToAll.apply(
            y.index_select(0, inverse), recv_splits, send_splits, self.group, self.rank, self.counter
        )
        out = torch.zeros_like(chunk)
        out.index_add_(0, token_of, (back * weights.reshape(-1)[order, None]).to(out.dtype))
        return out, total

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        step = m.chunk_tokens or max(flat.shape[0], 1)
        chunks = list(flat.split(step)) if flat.shape[0] else []
        tally = RoutingTally(m, shape, x.device)
        e = m.gate.num_experts
        routes = [tally.route(chunk, i * step) for i, chunk in enumerate(chunks)]  # every chunk first
        counts = [expert_counts(indices.reshape(-1), e + 1)[:e] for _, indices in routes]
        sent, received = self._split_sizes(counts)
        outputs, total = [], 0
        for i in range(len(sent)):
            if i < len(chunks):
                chunk, (weights, indices) = chunks[i], routes[i]
            else:  # empty: another rank has more chunks
                chunk = flat[:0]
                weights = flat.new_zeros(0, m.gate.top_k)
                indices = torch.zeros(0, m.gate.top_k, dtype=torch.int64, device=flat.device)
            routed, got = self._chunk(chunk, weights, indices, sent[i], received[i])
            total += got
            # kept even when empty (no rows): its exchanges must be in the autograd graph, so that
            # every rank of the group runs the same backward all-to-alls in the same order
            outputs.append(routed)
        m.last_received = total
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
        raise InputError(f'apply_expert_parallel needs the 1-D "ep" mesh, got a {ep_mesh.ndim}-D one')
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
            raise InputError(
                f"parallel.ep = {ep} does not divide the model's n_routed_experts = {experts}; "
                f"choose ep among the divisors of {experts}"
            )
        local = experts // ep
        # the experts' weights, and their LoRA factors (ExpertAdapters, stacked by expert too)
        owners = [(module.experts, name) for name in ("gate_up_proj", "down_proj")]
        adapters = getattr(module.experts, "lora", None)
        if adapters is not None:
            owners += [(factors[name], "weight") for factors in (adapters.lora_A, adapters.lora_B) for name in factors]
        for owner, name in owners:
            full = getattr(owner, name)
            # this rank's experts, no communication: every rank holds the same full weights
            piece = full.detach()[coordinate * local : (coordinate + 1) * local].clone()
            dtensor = DTensor.from_local(
                piece, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
            setattr(owner, name, nn.Parameter(dtensor, requires_grad=full.requires_grad))
        module.experts.forward = _LocalExperts(module.experts)  # type: ignore[method-assign]
        module.forward = _ExpertParallelForward(module, group, counter)  # type: ignore[method-assign]
        module.last_received = 0
        count += 1
    return count
