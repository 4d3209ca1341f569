"""Sparse attention over selected keys (DSA), chunked over queries, with a recomputing backward.

Each query ``t`` attends only to the keys listed in ``indices[b, t]`` (``-1`` = empty slot; a listed
position ``> t`` is ignored too, as in fla's ``naive_dsa``). Forward and backward walk over query
blocks and gather the selected K/V of one block at a time, so the gathered tensors never exceed
``B * query_block * topk * HK * (D + DV)`` elements; the backward recomputes them from the saved
``q, k, v, indices, o`` and the per-row log-sum-exp (the FlashAttention recipe), so autograd keeps
nothing of size ``T * topk * D``.
"""

from __future__ import annotations

import torch

__all__ = ["sparse_attention"]


def _gather_block(
    k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, q0: int, q1: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Selected K/V of queries [q0, q1): ks [B, n, K, HK, D], vs [B, n, K, HK, DV], flat [B, n, K], valid."""
    B, T, HK, D = k.shape
    idx = indices[:, q0:q1].long()  # [B, n, K]
    pos_q = torch.arange(q0, q1, device=k.device)
    valid = (idx >= 0) & (idx <= pos_q[None, :, None])
    flat = idx.clamp(min=0) + (torch.arange(B, device=k.device) * T)[:, None, None]
    ks = k.reshape(B * T, HK, -1)[flat].float()
    vs = v.reshape(B * T, HK, -1)[flat].float()
    return ks, vs, flat, valid


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, query_block):  # type: ignore[override]
        B, T, H, D = q.shape
        HK, DV = k.shape[2], v.shape[3]
        G = H // HK
        o = torch.empty(B, T, H, DV, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
        for q0 in range(0, T, query_block):
            q1 = min(q0 + query_block, T)
            n = q1 - q0
            ks, vs, _, valid = _gather_block(k, v, indices, q0, q1)
            qb = q[:, q0:q1].float().reshape(B, n, HK, G, D)
            # s: [B, n, HK, G, K]
            s = torch.einsum("bnhgd,bnkhd->bnhgk", qb, ks) * scale
            s = s.masked_fill(~valid[:, :, None, None, :], float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with no key
            p = torch.exp(s - m)
            l = p.sum(-1, keepdim=True)
            ob = torch.einsum("bnhgk,bnkhd->bnhgd", p, vs) / l.clamp(min=torch.finfo(torch.float32).tiny)
            o[:, q0:q1] = ob.reshape(B, n, H, DV).to(q.dtype)
            lse[:, q0:q1] = (m + torch.log(l)).reshape(B, n, H)  # -inf for rows with no key
        ctx.save_for_backward(q, k, v, indices, o, lse)
        ctx.scale, ctx.query_block = scale, query_block
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, indices, o, lse = ctx.saved_tensors
        scale, query_block = ctx.scale, ctx.query_block
        B, T, H, D = q.shape
        HK, DV = k.shape[2], v.shape[3]
        G = H // HK
        dq = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device)
        dk = torch.zeros(B * T, HK, D, dtype=torch.float32, device=q.device)
        dv = torch.zeros(B * T, HK, DV, dtype=torch.float32, device=q.device)
        # delta_t = sum_d dO * O  ([B, T, H])
        delta = (do.float() * o.float()).sum(-1)
        for q0 in range(0, T, query_block):
            q1 = min(q0 + query_block, T)
            n = q1 - q0
            ks, vs, flat, valid = _gather_block(k, v, indices, q0, q1)
            qb = q[:, q0:q1].float().reshape(B, n, HK, G, D)
            dob = do[:, q0:q1].float().reshape(B, n, HK, G, DV)
            lb = lse[:, q0:q1].reshape(B, n, HK, G, 1)
            lb = torch.where(torch.isfinite(lb), lb, torch.full_like(lb, float("inf")))
            s = torch.einsum("bnhgd,bnkhd->bnhgk", qb, ks) * scale
            s = s.masked_fill(~valid[:, :, None, None, :], float("-inf"))
            p = torch.exp(s - lb)  # [B, n, HK, G, K]
            dp = torch.einsum("bnhgd,bnkhd->bnhgk", dob, vs)
            ds = p * (dp - delta[:, q0:q1].reshape(B, n, HK, G, 1))
            dq[:, q0:q1] = (torch.einsum("bnhgk,bnkhd->bnhgd", ds, ks) * scale).reshape(B, n, H, D)
            flat1 = flat.reshape(-1)
            dv.index_add_(0, flat1, torch.einsum("bnhgk,bnhgd->bnkhd", p, dob).reshape(-1, HK, DV))
            dk.index_add_(0, flat1, (torch.einsum("bnhgk,bnhgd->bnkhd", ds, qb) * scale).reshape(-1, HK, D))
        return (
            dq.to(q.dtype),
            dk.reshape(B, T, HK, D).to(k.dtype),
            dv.reshape(B, T, HK, DV).to(v.dtype),
            None,
            None,
            None,
        )


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    query_block: int = 64,
) -> torch.Tensor:
    """Attention of each query over its selected keys only; differentiable w.r.t. q, k, v.

    ``o[b, t, h] = sum_{s in S(b, t)} softmax_s(scale * q[b, t, h] . k[b, s, h // G]) v[b, s, h // G]``
    with ``S(b, t) = {indices[b, t, i] : 0 <= indices[b, t, i] <= t}`` (``-1`` slots and positions
    after ``t`` are ignored) and ``G = H // HK`` (GQA/MQA; query head ``h`` uses KV head
    ``h // G``, as fla's ``repeat(k, 'b t h d -> b t (h g) d')``). A row with no valid key gives 0.
    Indices are assumed distinct within a row (a repeated index would be counted twice); the
    indexer and KPool expansion guarantee it. Computed in float32, returned in ``q.dtype``.

    Args:
        q: queries ``[B, T, H, D]``.
        k: keys ``[B, T, HK, D]`` with ``H % HK == 0``.
        v: values ``[B, T, HK, DV]`` (``DV`` may differ from ``D``, as in MLA).
        indices: ``[B, T, K]`` int64 or int32 selected key positions, ``-1`` padded.
        scale: softmax scale, default ``D ** -0.5``.
        query_block: queries per chunk (default 64); the gathered K/V of a chunk hold
            ``B * query_block * K * HK * (D + DV)`` float32 values.

    Returns:
        o: ``[B, T, H, DV]`` in ``q.dtype``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or indices.dim() != 3:
        raise ValueError("expected q [B, T, H, D], k [B, T, HK, D], v [B, T, HK, DV], indices [B, T, K]")
    B, T, H, D = q.shape
    if k.shape[:2] != (B, T) or v.shape[:3] != k.shape[:3] or k.shape[3] != D or indices.shape[:2] != (B, T):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, indices {tuple(indices.shape)}"
        )
    HK = k.shape[2]
    if HK == 0 or H % HK != 0:
        raise ValueError(f"the number of query heads ({H}) must be a multiple of the KV heads ({HK})")
    if indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"indices must be int64 or int32, got {indices.dtype}")
    if query_block < 1:
        raise ValueError(f"query_block must be positive, got {query_block}")
    sc = D ** -0.5 if scale is None else float(scale)
    return _SparseAttention.apply(q, k, v, indices, sc, query_block)
