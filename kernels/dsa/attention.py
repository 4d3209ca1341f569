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


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, HK, D] -> [HK, B * T, D]`` float32, contiguous: one key/value row per (head, token)."""
    B, T, HK, D = x.shape
    return x.float().permute(2, 0, 1, 3).reshape(HK, B * T, D).contiguous()


def _block_indices(
    indices: torch.Tensor, TK: int, q0: int, q1: int, q_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat key rows ``[B * n * K]`` (``b * TK + position``, invalid slots sent to row 0) and
    ``valid [B, n, K]`` for query rows ``q0:q1`` (global positions ``q_offset + q0 ..``)."""
    B = indices.shape[0]
    idx = indices[:, q0:q1].long()  # [B, n, K]
    pos_q = torch.arange(q_offset + q0, q_offset + q1, device=indices.device)
    valid = (idx >= 0) & (idx <= pos_q[None, :, None])
    # invalid slots (empty, or future positions that a context-parallel rank may not hold) read row 0
    flat = torch.where(valid, idx, 0) + (torch.arange(B, device=indices.device) * TK)[:, None, None]
    return flat.reshape(-1), valid


class _Buffers:
    """Scratch tensors reused across query blocks (float32, contiguous views of flat storage).

    Fresh multi-megabyte tensors per block come from ``mmap`` and are first touched page by page
    (on CPU that page-fault cost exceeded the gathers themselves); one allocation per call avoids it.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.store: dict[str, torch.Tensor] = {}

    def get(self, name: str, *shape: int) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        buf = self.store.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float32, device=self.device)
            self.store[name] = buf
        return buf[:numel].view(*shape)


def _gather(x_hf: torch.Tensor, flat: torch.Tensor, rows: int, K: int, out: torch.Tensor) -> torch.Tensor:
    """Selected rows of ``x_hf [HK, B*T, D]`` for one query block, into ``out``: ``[HK * rows, K, D]``."""
    HK, _, D = x_hf.shape
    torch.index_select(x_hf, 1, flat, out=out.view(HK, rows * K, D))
    return out


def _query_block(x: torch.Tensor, q0: int, q1: int, HK: int) -> torch.Tensor:
    """``x[:, q0:q1] [B, n, H, D] -> [HK * B * n, G, D]`` float32 (KV head major, as :func:`_gather`)."""
    B, _, H, D = x.shape
    n = q1 - q0
    xb = x[:, q0:q1].float().reshape(B, n, HK, H // HK, D)
    return xb.permute(2, 0, 1, 3, 4).reshape(HK * B * n, H // HK, D)


def _unblock(x: torch.Tensor, B: int, n: int, HK: int) -> torch.Tensor:
    """``[HK * B * n, G, D] -> [B, n, HK * G, D]`` (inverse of :func:`_query_block`)."""
    G, D = x.shape[-2:]
    return x.view(HK, B, n, G, D).permute(1, 2, 0, 3, 4).reshape(B, n, HK * G, D)


class _SparseAttention(torch.autograd.Function):
    # Layout: K and V are re-laid out once per call as [HK, B*T, D] so that the gathered rows of a
    # query block land directly in the [HK * B * n, K, D] layout that batched matmuls take (the
    # transposes become BLAS flags, not copies); on CPU the permute copies of a [n, K, HK, D]
    # gather otherwise cost more than the arithmetic. Block-sized scratch tensors are reused.
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, query_block, q_offset):  # type: ignore[override]
        B, T, H, D = q.shape
        TK, HK, DV = k.shape[1], k.shape[2], v.shape[3]
        G = H // HK
        K = indices.shape[2]
        k_hf, v_hf = _heads_first(k), _heads_first(v)
        o = torch.empty(B, T, H, DV, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
        buf = _Buffers(q.device)
        for q0 in range(0, T, query_block):
            q1 = min(q0 + query_block, T)
            n = q1 - q0
            rows = HK * B * n
            flat, valid = _block_indices(indices, TK, q0, q1, q_offset)
            ks = _gather(k_hf, flat, B * n, K, buf.get("ks", rows, K, D))  # [HK*B*n, K, D]
            vs = _gather(v_hf, flat, B * n, K, buf.get("vs", rows, K, DV))  # [HK*B*n, K, DV]
            qb = _query_block(q, q0, q1, HK)  # [HK*B*n, G, D]
            s = torch.bmm(qb, ks.transpose(1, 2), out=buf.get("s", rows, G, K)).mul_(scale)  # [HK*B*n, G, K]
            mask = ~valid.reshape(1, B * n, 1, K)
            s.view(HK, B * n, G, K).masked_fill_(mask, float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with no key
            p = s.sub_(m).exp_()
            l = p.sum(-1, keepdim=True)
            ob = torch.bmm(p, vs, out=buf.get("ob", rows, G, DV)).div_(l.clamp(min=torch.finfo(torch.float32).tiny))
            o[:, q0:q1] = _unblock(ob, B, n, HK).to(q.dtype)
            lse[:, q0:q1] = _unblock(m + torch.log(l), B, n, HK).squeeze(-1)  # -inf for rows with no key
        ctx.save_for_backward(q, k, v, indices, o, lse)
        ctx.scale, ctx.query_block, ctx.q_offset = scale, query_block, q_offset
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, indices, o, lse = ctx.saved_tensors
        scale, query_block, q_offset = ctx.scale, ctx.query_block, ctx.q_offset
        B, T, H, D = q.shape
        TK, HK, DV = k.shape[1], k.shape[2], v.shape[3]
        G = H // HK
        K = indices.shape[2]
        k_hf, v_hf = _heads_first(k), _heads_first(v)
        dq = torch.empty(B, T, H, D, dtype=torch.float32, device=q.device)
        dk_hf = torch.zeros_like(k_hf)  # [HK, B*T, D]
        dv_hf = torch.zeros_like(v_hf)
        # delta_t = sum_d dO * O  ([B, T, H, 1])
        delta = (do.float() * o.float()).sum(-1, keepdim=True)
        lse_f = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf"))).unsqueeze(-1)
        buf = _Buffers(q.device)
        for q0 in range(0, T, query_block):
            q1 = min(q0 + query_block, T)
            n = q1 - q0
            rows = HK * B * n
            flat, valid = _block_indices(indices, TK, q0, q1, q_offset)
            ks = _gather(k_hf, flat, B * n, K, buf.get("ks", rows, K, D))
            vs = _gather(v_hf, flat, B * n, K, buf.get("vs", rows, K, DV))
            qb = _query_block(q, q0, q1, HK)  # [HK*B*n, G, D]
            dob = _query_block(do, q0, q1, HK)  # [HK*B*n, G, DV]
            lb = _query_block(lse_f, q0, q1, HK)  # [HK*B*n, G, 1]
            db = _query_block(delta, q0, q1, HK)  # [HK*B*n, G, 1]
            s = torch.bmm(qb, ks.transpose(1, 2), out=buf.get("s", rows, G, K)).mul_(scale)
            mask = ~valid.reshape(1, B * n, 1, K)
            s.view(HK, B * n, G, K).masked_fill_(mask, float("-inf"))
            p = s.sub_(lb).exp_()  # [HK*B*n, G, K]
            dp = torch.bmm(dob, vs.transpose(1, 2), out=buf.get("dp", rows, G, K))  # [HK*B*n, G, K]
            ds = dp.sub_(db).mul_(p)
            dq[:, q0:q1] = _unblock(torch.bmm(ds, ks, out=buf.get("dqb", rows, G, D)).mul_(scale), B, n, HK)
            # dV and dK rows of this block reuse the gather buffers (ks, vs are no longer needed)
            dvs = torch.bmm(p.transpose(1, 2), dob, out=vs).view(HK, -1, DV)  # [HK, B*n*K, DV]
            dks = torch.bmm(ds.transpose(1, 2), qb, out=ks).mul_(scale).view(HK, -1, D)
            for h in range(HK):  # index_add_ along dim 0 of a contiguous 2-D tensor is the fast path
                dv_hf[h].index_add_(0, flat, dvs[h])
                dk_hf[h].index_add_(0, flat, dks[h])
        return (
            dq.to(q.dtype),
            dk_hf.view(HK, B, TK, D).permute(1, 2, 0, 3).to(k.dtype).contiguous(),
            dv_hf.view(HK, B, TK, DV).permute(1, 2, 0, 3).to(v.dtype).contiguous(),
            None,
            None,
            None,
            None,
        )


def check_sparse_attention_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, q_offset: int = 0, query_block: int = 64
) -> None:
    """The argument checks of :func:`sparse_attention` (shared with the Triton kernel's entry point,
    so both reject the same inputs with the same messages).

    Raises:
        ValueError: ranks, shapes, heads, index dtype, ``q_offset`` or ``query_block``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or indices.dim() != 3:
        raise ValueError("expected q [B, T, H, D], k [B, T, HK, D], v [B, T, HK, DV], indices [B, T, K]")
    B, T, H, D = q.shape
    if (
        k.shape[0] != B
        or k.shape[1] < q_offset + T
        or v.shape[:3] != k.shape[:3]
        or k.shape[3] != D
        or indices.shape[:2] != (B, T)
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, indices {tuple(indices.shape)}, "
            f"q_offset {q_offset} (keys must cover positions 0 .. q_offset + T - 1)"
        )
    if q_offset < 0:
        raise ValueError(f"q_offset must be >= 0, got {q_offset}")
    HK = k.shape[2]
    if HK == 0 or H % HK != 0:
        raise ValueError(f"the number of query heads ({H}) must be a multiple of the KV heads ({HK})")
    if indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"indices must be int64 or int32, got {indices.dtype}")
    if query_block < 1:
        raise ValueError(f"query_block must be positive, got {query_block}")


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    query_block: int = 64,
    q_offset: int = 0,
) -> torch.Tensor:
    """Attention of each query over its selected keys only; differentiable w.r.t. q, k, v.

    ``o[b, t, h] = sum_{s in S(b, t)} softmax_s(scale * q[b, t, h] . k[b, s, h // G]) v[b, s, h // G]``
    with ``S(b, t) = {indices[b, t, i] : 0 <= indices[b, t, i] <= q_offset + t}`` (``-1`` slots and
    positions after the query's are ignored) and ``G = H // HK`` (GQA/MQA; query head ``h`` uses KV head
    ``h // G``, as fla's ``repeat(k, 'b t h d -> b t (h g) d')``). A row with no valid key gives 0.
    Indices are assumed distinct within a row (a repeated index would be counted twice); the
    indexer and KPool expansion guarantee it. Computed in float32, returned in ``q.dtype``.

    Args:
        q: queries ``[B, T, H, D]`` at positions ``q_offset .. q_offset + T - 1``.
        k: keys ``[B, TK, HK, D]`` of positions ``0 .. TK - 1`` with ``H % HK == 0`` and
            ``TK >= q_offset + T`` (``TK = T`` without an offset).
        v: values ``[B, TK, HK, DV]`` (``DV`` may differ from ``D``, as in MLA).
        indices: ``[B, T, K]`` int64 or int32 selected key positions, ``-1`` padded.
        scale: softmax scale, default ``D ** -0.5``.
        query_block: queries per chunk (default 64); the gathered K/V of a chunk hold
            ``B * query_block * K * HK * (D + DV)`` float32 values.
        q_offset: position of the first query (default 0): a context-parallel rank's queries
            attend over keys gathered from the ranks before it.

    Returns:
        o: ``[B, T, H, DV]`` in ``q.dtype``.
    """
    check_sparse_attention_args(q, k, v, indices, q_offset, query_block)
    D = q.shape[3]
    sc = D**-0.5 if scale is None else float(scale)
    return _SparseAttention.apply(q, k, v, indices, sc, query_block, int(q_offset))
