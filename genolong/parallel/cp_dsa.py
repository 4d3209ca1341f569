"""Context parallelism for the DSA layer: one contiguous slice of the sequence per rank.

Each rank of the CP process group holds ``x [B, T_local, H]``, the tokens at global positions
``[start, end)`` with ``start = rank * T_local`` and ``end = start + T_local`` (equal slices, in
rank order). :func:`cp_dsa_forward` runs a :class:`~genolong.model.dsa.DSAMixer` on that slice so
that the outputs, concatenated over ranks, and every gradient (parameter gradients summed over
ranks) equal the single-process layer on the whole sequence:

1. Local projections (``DSAMixer.project_keys``): the MLA latent ``c = RMSNorm(kv_a_proj_with_mqa(x))``
   ``[B, T_local, C]`` and, on "full" indexer layers, the KPool pooled index keys of the slice's
   ``T_local / P`` pools.
2. One all-gather over the CP group of the latent and the pooled keys, packed into one buffer, with
   the differentiable :func:`torch.distributed.nn.functional.all_gather` (its backward sums each
   slice's gradient over the ranks whose queries used it; one collective per layer call keeps the
   backward collectives in the same order on every rank). Each rank keeps the pieces of ranks
   ``0..rank``: positions ``[0, end)``, all its queries can see.
3. Selection over global positions: the local queries score the gathered pools through the
   backend's ``kpool_topk`` with ``q_offset=start`` (the kernel the single process runs: the
   Triton one on the ``triton`` backend, the torch reference otherwise; ties to the lowest pool),
   the causal limit ``(start + t + 1) // P - 1``; the winners expand to global token positions and
   the query's own incomplete pool (the tail) is appended. A "shared" layer takes the previous
   layer's (global) indices instead.
4. Sparse attention of the local queries over the gathered latent (``kv_b_proj`` absorbed, or
   expanded when ``mixer.absorb`` is False), with the query offset ``start``:
   :func:`genolong.kernels.dsa.sparse_attention` with ``q_offset=start``.

Constraints: ``T_local`` must be a multiple of ``index_kpool`` on layers with an indexer, so that
pools never straddle two ranks: each rank pools exactly its own complete pools and the gathered
pools are the single-process ones (a query's incomplete tail pool then always lies in its own
slice). All ranks must pass the same ``B`` and ``T_local`` (all-gather needs equal sizes; a
mismatch cannot be detected without an extra collective).

Communication per rank per layer call (``W`` ranks, ``s`` bytes per element of the model dtype,
``C = kv_lora_rank``, ``DI = index_head_dim``, ``P = index_kpool``), bytes received
(:func:`cp_dsa_comm_bytes`; the term ``DI / P`` only on layers with an indexer)::

    forward   (W - 1) * B * T_local * (C + DI / P) * s      (all-gather)
    backward  (W - 1) * B * T_local * (C + DI / P) * s      (reduce-scatter of the gradient)

plus, with the indexer KL on, one scalar all-reduce (the number of counted queries).

The indexer KL (``mixer.indexer_kl``) runs the backend's ``kpool_indexer_kl_loss`` on the local
queries with ``q_offset=start`` (the Triton kernels on the ``triton`` backend); each rank's
``last_indexer_kl`` is its share (the shares sum to the single-process loss).

The layer is :class:`~genolong.model.dsa.DSAMixer`'s own two phases (``project_keys`` of the
slice, :func:`gather_keys`, ``attend`` with ``q_offset=start``):
:func:`genolong.parallel.context.apply_context_parallel` installs :func:`cp_dsa_forward` as the
mixer's forward, so the model imports nothing from here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from ..kernels.comm_bytes import cp_dsa_comm_bytes  # the arithmetic, torch-free (genolong plan)
from ..model.dsa import DSAKeys, DSAMixer, indexer_kl_count

__all__ = ["check_cp_input", "cp_dsa_comm_bytes", "cp_dsa_forward", "gather_keys", "kl_share"]


# ----------------------------------------------------------------------------- collectives


class _AllGather(torch.autograd.Function):
    """Differentiable all-gather over a (sub)group: ``x [*S]`` -> ``[W, *S]`` in group-rank order;
    backward reduce-scatters, so each rank receives the sum over ranks of its piece's gradients.

    torch's ``torch.distributed.nn.functional.all_gather`` is deprecated, and its gloo backward
    passes group ranks where global ranks are expected, which fails on any group that is not the
    whole world (e.g. the CP groups of a dp x cp mesh). gloo has no reduce-scatter: there the
    backward is one scatter per source rank (each rank receives ``(W - 1)`` pieces, the same
    volume as a reduce-scatter).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x, group=group)
        ctx.group = group
        return torch.stack(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        group = ctx.group
        pieces = list(grad.contiguous().unbind(0))
        out = torch.empty_like(pieces[0])
        if dist.get_backend(group) != dist.Backend.GLOO:
            dist.reduce_scatter(out, pieces, group=group)
            return out, None
        rank = dist.get_rank(group)
        received = []
        for src in range(len(pieces)):
            buffer = torch.empty_like(out)
            dist.scatter(buffer, pieces if src == rank else None, src=dist.get_global_rank(group, src), group=group)
            received.append(buffer)
        return torch.stack(received).sum(0), None


def _gather_prefix(parts: list[torch.Tensor], group: dist.ProcessGroup, rank: int) -> list[torch.Tensor]:
    """One differentiable all-gather of several sequence tensors ``[B, n_i, ...]`` (same dtype),
    packed into one buffer; returns each one's pieces of ranks ``0..rank`` concatenated along dim 1
    (``[B, (rank + 1) * n_i, ...]``). In backward each rank's piece receives the sum of its
    gradients over all ranks (reduce-scatter; the pieces after ``rank`` contribute zeros here).
    A single collective per call keeps the backward collectives in the same order on every rank.
    """
    b = parts[0].shape[0]
    sizes = [x[0].numel() for x in parts]
    packed = torch.cat([x.reshape(b, -1) for x in parts], dim=1)  # [B, sum(sizes)]
    gathered = _AllGather.apply(packed, group)[: rank + 1].transpose(0, 1)  # [B, rank + 1, n]
    out = []
    for x, chunk in zip(parts, gathered.split(sizes, dim=2)):
        y = chunk.reshape(b, (rank + 1) * x.shape[1], *x.shape[2:])
        if y.untyped_storage().nbytes() != y.numel() * y.element_size():
            # a view (rank 0, or B = 1): it would keep the whole [W, B, n] buffer alive wherever it
            # is saved for backward (W times the keys rank 0 reads); own copy instead
            y = y.clone(memory_format=torch.contiguous_format)
        out.append(y)
    return out


# ----------------------------------------------------------------------------- the layer


def gather_keys(mixer: DSAMixer, keys: DSAKeys, group: dist.ProcessGroup, rank: int) -> DSAKeys:
    """This rank's keys (:meth:`DSAMixer.project_keys` of its slice) -> the keys of positions
    ``[0, end)`` (ranks ``0..rank``), in one differentiable all-gather (latent and pooled keys
    packed together); backward reduce-scatters their gradient."""
    if keys.pooled is None:
        (latent,) = _gather_prefix([keys.latent], group, rank)
        return DSAKeys(latent, None)
    latent, pooled = _gather_prefix([keys.latent, keys.pooled], group, rank)  # [B, end, C], [B, end / P, DI]
    return DSAKeys(latent, pooled)


def kl_share(mixer: DSAMixer, kl: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A rank's share of the indexer KL from the mean ``kl`` over its ``local`` counted queries
    (:func:`~genolong.model.dsa.indexer_kl_count`): ``kl * local / total`` with ``total`` the
    count over the group (one scalar all-reduce), so the shares sum to the single-process KL."""
    with torch.no_grad():
        total = local.clone()
        dist.all_reduce(total, group=group)
    return kl * (local / total.clamp(min=1)).to(kl.dtype)


def check_cp_input(mixer: DSAMixer, x: torch.Tensor, prev_indices: torch.Tensor | None) -> None:
    """The input checks of :func:`cp_dsa_forward` (shapes, slice length, process group).

    Raises:
        InputError: see :func:`cp_dsa_forward`.
    """
    if x.dim() != 3:
        raise InputError(f"x must be [B, T_local, hidden]; got shape {tuple(x.shape)}")
    b, t, _ = x.shape
    ix = mixer.indexer
    if ix is not None:
        if t % ix.index_kpool != 0:
            raise InputError(
                f"the CP slice length ({t}) must be a multiple of index_kpool ({ix.index_kpool}) so that no KPool "
                "pool straddles two ranks; choose a sequence length divisible by cp * index_kpool"
            )
    else:
        mixer.check_prev_indices(prev_indices, b, t)  # the indices the full layer before it returned on this rank
    if not dist.is_initialized():
        raise InputError("cp_dsa_forward needs an initialised torch.distributed process group (the CP group)")


def cp_dsa_forward(
    mixer: DSAMixer,
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    prev_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``mixer`` on this rank's slice of the sequence under context parallelism.

    Every rank of ``group`` must call it (collectives), with equal slices: rank ``r`` holds
    global positions ``[r * T_local, (r + 1) * T_local)``. The result equals the rows
    ``[start, end)`` of ``mixer(x_full, prev_indices_full)``; parameter gradients are this rank's
    share (sum them over the group, as data parallelism does, to get the full ones).

    With ``mixer.indexer_kl`` set, a forward that records gradients leaves this rank's share of the
    sparse-stage indexer KL in ``mixer.last_indexer_kl`` (local KL sum over the global number of
    counted queries: the shares sum over the group to the single-process value, and so do the
    indexer gradients once summed).

    Args:
        mixer: the DSA layer (full or shared indexer; ``absorb`` True or False).
        x: ``[B, T_local, H]``, this rank's slice. ``T_local`` must be a multiple of
            ``index_kpool`` when the layer has an indexer.
        group: the CP process group (default: the default group).
        prev_indices: ``[B, T_local, K]`` global key positions, ``-1`` padded: the indices the
            preceding full layer returned on this rank (shared layers only).

    Returns:
        ``(out [B, T_local, H], indices)``: ``indices [B, T_local, index_topk + index_kpool - 1]``
        int64 global positions when ``mixer.returns_indices`` (as :class:`DSAMixer`), else None.

    Raises:
        InputError: bad shapes, a slice length that splits a pool, a shared layer without
            ``prev_indices``, or no initialised process group.
    """
    check_cp_input(mixer, x, prev_indices)
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    start = rank * x.shape[1]
    # the two phases of DSAMixer.forward, with the keys all-gathered in between and the queries at
    # their global positions
    kl = mixer.wants_indexer_kl()
    keys = gather_keys(mixer, mixer.project_keys(x, index_grad=kl), group, rank)
    res = mixer.attend(x, keys, prev_indices, q_offset=start, kl=kl)
    if res.kl is not None:
        assert mixer.indexer is not None
        local = indexer_kl_count(res.indices, mixer.indexer.index_kpool, mixer.always_select_tail, start)
        mixer.last_indexer_kl = kl_share(mixer, res.kl, local, group)
    return res.out, (res.indices if mixer.returns_indices else None)
