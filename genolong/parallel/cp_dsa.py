"""Context parallelism for the DSA layer: one contiguous slice of the sequence per rank.

Each rank of the CP process group holds ``x [B, T_local, H]``, the tokens at global positions
``[start, end)`` with ``start = rank * T_local`` and ``end = start + T_local`` (equal slices, in
rank order). :func:`cp_dsa_forward` runs a :class:`~genolong.model.dsa.DSAMixer` on that slice so
that the outputs, concatenated over ranks, and every gradient (parameter gradients summed over
ranks) equal the single-process layer on the whole sequence:

1. Local projections: queries ``q``, the MLA latent ``c = RMSNorm(kv_a_proj_with_mqa(x))``
   ``[B, T_local, C]`` and, on "full" indexer layers, the KPool pooled index keys of the slice's
   ``T_local / P`` pools.
2. One all-gather over the CP group of the latent and the pooled keys, packed into one buffer, with
   the differentiable :func:`torch.distributed.nn.functional.all_gather` (its backward sums each
   slice's gradient over the ranks whose queries used it; one collective per layer call keeps the
   backward collectives in the same order on every rank). Each rank keeps the pieces of ranks
   ``0..rank``: positions ``[0, end)``, all its queries can see.
3. Selection over global positions: the local queries score the gathered pools through the same
   blockwise top-k engine as the single-process indexer
   (:func:`genolong.kernels.dsa.indexer.causal_topk`, 256-pool tiles, ties to the lowest pool)
   with the causal limit ``(start + t + 1) // P - 1``; the winners expand to global token
   positions and the query's own incomplete pool (the tail) is appended, as
   :func:`~genolong.kernels.dsa.kpool_topk` does. A "shared" layer takes the previous layer's
   (global) indices instead.
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

The indexer KL (``mixer.indexer_kl``) runs :func:`~genolong.kernels.dsa.kpool_indexer_kl_loss`
on the local queries front-padded with ``start`` empty rows (the kernel has no query offset), so
the last rank scores ``O(end)`` query rows of which ``start`` are empty; each rank's
``last_indexer_kl`` is its share (the shares sum to the single-process loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from ..kernels.dsa import indexer_scores, kpool_expand, kpool_pool_ids
from ..kernels.dsa.indexer import causal_topk
from ..model.config import ModelConfig
from ..model.dsa import DSAMixer

__all__ = ["cp_dsa_comm_bytes", "cp_dsa_forward"]

# pools and queries per scoring tile: kpool_topk's defaults, so CP scores the same tiles' keys
_POOL_BLOCK = 256
_QUERY_BLOCK = 256


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
        out.append(chunk.reshape(b, (rank + 1) * x.shape[1], *x.shape[2:]))
    return out


# ----------------------------------------------------------------------------- the layer


def _cp_select(mixer: DSAMixer, q_idx: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor, start: int) -> torch.Tensor:
    """The KPool selection of the local queries (``q_idx [B, T_local, HI, DI]``, ``w [B, T_local, HI]``)
    over the pooled keys of positions ``[0, end)`` (``pooled [B, end // P, DI]``): ``[B, T_local,
    index_topk + P - 1]`` global token positions in the layout of :func:`~genolong.kernels.dsa.kpool_topk`."""
    ix = mixer.indexer
    assert ix is not None
    b, t = q_idx.shape[:2]
    p = ix.index_kpool
    with torch.no_grad():
        q_idx, w, pooled = q_idx.detach(), w.detach(), pooled.detach()

        def score_fn(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
            return indexer_scores(q_idx[:, q0:q1], pooled[:, k0:k1], w[:, q0:q1], ix.softmax_scale, "relu")

        limit = (torch.arange(start, start + t, device=q_idx.device) + 1) // p - 1  # last visible pool
        pools = causal_topk(score_fn, limit, pooled.shape[1], ix.index_topk // p, _POOL_BLOCK, _QUERY_BLOCK, b,
                            q_idx.device)
        indices = kpool_expand(pools, p, ix.always_select_tail)  # the tail of local position t
        if ix.always_select_tail and p > 1:
            # start % p == 0, so the local tail t + 1 - r .. t shifts by start to the global one
            tail = indices[..., -(p - 1):]
            indices[..., -(p - 1):] = torch.where(tail >= 0, tail + start, tail)
    return indices


def _cp_indexer_kl(mixer: DSAMixer, q_idx: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor, attn_q: torch.Tensor,
                   attn_k: torch.Tensor, indices: torch.Tensor, group: dist.ProcessGroup, start: int) -> torch.Tensor:
    """This rank's share of the sparse-stage indexer KL: ``sum of KL_t over local queries / number of
    queries with a selected pool on all ranks`` (so the shares sum to the single-process loss).

    The kernel has no query offset, so the local queries are front-padded with ``start`` empty rows
    (no selected pool: they add nothing and are not counted); this costs ``O(end)`` instead of
    ``O(T_local)`` query rows on the last rank (a ``q_offset`` argument in the kernel removes it).
    """
    ix = mixer.indexer
    assert ix is not None
    p = ix.index_kpool
    b, t = q_idx.shape[:2]
    pools = kpool_pool_ids(indices, p, tail=ix.always_select_tail)  # [B, T_local, KP], global pool ids

    def pad(x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        return torch.cat([x.new_full((b, start, *x.shape[2:]), value), x], dim=1)

    loss = ix.kernels.kpool_indexer_kl_loss(
        pad(attn_q.detach()), attn_k.detach(), pad(q_idx), pooled, pad(w), pad(pools, -1), p,
        attn_scale=mixer.scaling, idx_scale=ix.softmax_scale, tail=ix.always_select_tail,
    )
    with torch.no_grad():  # the kernel's count of queries with a selected pool, locally and over the group
        tq = torch.arange(start, start + t, device=pools.device)
        local = ((pools >= 0) & ((pools + 1) * p - 1 <= tq[None, :, None])).any(-1).sum().to(torch.float64)
        total = local.clone()
        dist.all_reduce(total, group=group)
    return loss * (local / total.clamp(min=1)).to(loss.dtype)


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
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    start = rank * t

    q_resid = mixer.q_a_layernorm(mixer.q_a_proj(x))
    q = mixer.q_b_proj(q_resid).view(b, t, mixer.num_heads, mixer.qk_head_dim)
    latent = mixer.kv_a_layernorm(mixer.kv_a_proj_with_mqa(x)[..., : mixer.kv_lora_rank])  # [B, T_local, C]
    kl = ix is not None and mixer.indexer_kl and torch.is_grad_enabled()
    if ix is not None:
        if kl:  # as DSAMixer._indexer_kl: the KL trains the indexer only, on detached inputs
            q_idx, k_pool, w = ix.project(x.detach(), q_resid.detach())
        else:
            with torch.no_grad():
                q_idx, k_pool, w = ix.project(x, q_resid)
        # k_pool: this slice's T_local / P complete pools (global ids start / P ..); latent and pooled
        # keys travel in one collective
        latent_all, pooled = _gather_prefix([latent, k_pool], group, rank)  # [B, end, C], [B, end / P, DI]
        indices = _cp_select(mixer, q_idx, w, pooled, start)
    else:
        assert prev_indices is not None
        (latent_all,) = _gather_prefix([latent], group, rank)
        indices = prev_indices
    if mixer.absorb:
        # as DSAMixer.forward: attention over the latent, kv_b_proj folded into q and the output
        wkv = mixer.kv_b_proj.weight.view(mixer.num_heads, mixer.qk_nope_head_dim + mixer.v_head_dim, mixer.kv_lora_rank)
        w_k, w_v = wkv.split([mixer.qk_nope_head_dim, mixer.v_head_dim], dim=1)  # [H, D, C], [H, DV, C]
        attn_q = torch.einsum("bthd,hdc->bthc", q, w_k)  # [B, T_local, H, C]
        attn_k = latent_all.unsqueeze(2)  # [B, end, 1, C]
        o_latent = mixer.kernels.sparse_attention(attn_q, attn_k, attn_k, indices, q_offset=start, scale=mixer.scaling,
                                           query_block=mixer.query_block)
        o = torch.einsum("bthc,hvc->bthv", o_latent, w_v)
    else:
        # expanded keys and values of every gathered position (the latent is what travels)
        kv = mixer.kv_b_proj(latent_all).view(b, latent_all.shape[1], mixer.num_heads, -1)
        k, v = kv.split([mixer.qk_nope_head_dim, mixer.v_head_dim], dim=-1)
        attn_q, attn_k = q, k.contiguous()
        o = mixer.kernels.sparse_attention(q, attn_k, v.contiguous(), indices, q_offset=start, scale=mixer.scaling,
                                    query_block=mixer.query_block)
    if kl:
        mixer.last_indexer_kl = _cp_indexer_kl(mixer, q_idx, w, pooled, attn_q, attn_k, indices, group, start)
    out = mixer.o_proj(o.reshape(b, t, mixer.num_heads * mixer.v_head_dim))
    return out, (indices if mixer.returns_indices else None)


def cp_dsa_comm_bytes(
    config: ModelConfig, batch: int, t_local: int, cp: int, full_indexer: bool, dtype_bytes: int = 4
) -> dict[str, int]:
    """Bytes one rank receives through the collectives of one :func:`cp_dsa_forward` call.

    Args:
        config: the model config (``kv_lora_rank``, ``index_head_dim``, ``index_kpool``).
        batch: ``B``; t_local: ``T_local``; cp: the CP group size ``W``.
        full_indexer: the layer has its own indexer (its pooled keys travel too).
        dtype_bytes: bytes per element of the model dtype (default 4, fp32).

    Returns:
        ``{"forward": n, "backward": n}`` with ``n = (W - 1) * B * T_local * (C + DI / P) * s``
        (``DI / P`` only with ``full_indexer``): the all-gather of the latent and pooled keys, and
        in backward the reduce-scatter of their gradient (gloo emulates it with scatters of the
        same volume). The indexer KL's scalar all-reduce is not counted.
    """
    latent = t_local * config.kv_lora_rank
    pooled = (t_local // config.index_kpool) * config.index_head_dim if full_indexer else 0
    n = (cp - 1) * batch * (latent + pooled) * dtype_bytes
    return {"forward": n, "backward": n}
