"""Indexer KL loss of DSA (DeepSeek-V3.2) for both training stages, blockwise (no [T, T] matrix).

Target ``p[t, s] = (1 / H) * sum_h softmax_s(attn_scale * q[t, h] . k[s, h // G])`` (main attention
probabilities summed over heads and L1-normalised; each head's row sums to one, so this is the
head mean). The indexer distribution is ``softmax_s(I[t, s])`` with the lightning-indexer score
``I`` of :func:`genolong.kernels.dsa.indexer.indexer_scores`. Per query::

    KL_t = sum_s p[t, s] * (log p[t, s] - log softmax(I)[t, s])

over the causal keys ``s <= t`` (dense warm-up) or over the selected keys only (sparse stage). The
loss is the mean of ``KL_t`` over the ``B * T`` queries. ``p`` is a target: ``q`` and ``k`` are
treated as constants (no gradient); gradients flow into ``q_idx``, ``k_idx`` and ``w_idx``. For the
sparse stage DeepSeek-V3.2 also detaches the indexer's *input* hidden state, so that the KL trains
only the indexer; that detach happens in the model before ``q_idx``/``k_idx``/``w_idx`` are made.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .indexer import indexer_scores

__all__ = ["indexer_kl_loss_dense", "indexer_kl_loss_sparse"]

_NEG = float("-inf")


def _check(q, k, q_idx, k_idx, w_idx, activation):
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q must be [B, T, H, D] and k [B, T, HK, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key heads ({k.shape[2]})")
    B, T = q.shape[:2]
    if q_idx.dim() != 4 or q_idx.shape[:2] != (B, T) or k_idx.shape != (B, T, q_idx.shape[3]):
        raise ValueError(
            f"q_idx must be [B, T, HI, DI] and k_idx [B, T, DI]; got {tuple(q_idx.shape)}, {tuple(k_idx.shape)}"
        )
    if w_idx is not None and w_idx.shape != q_idx.shape[:3]:
        raise ValueError(f"w_idx must be {tuple(q_idx.shape[:3])}; got {tuple(w_idx.shape)}")
    if activation not in ("relu", None):
        raise ValueError(f"activation must be 'relu' or None, got {activation!r}")


def _attn_scores(qb: torch.Tensor, kb: torch.Tensor, scale: float) -> torch.Tensor:
    """qb [B, n, H, D], kb [B, m, HK, D] -> [B, n, H, m] float32."""
    B, n, H, D = qb.shape
    HK = kb.shape[2]
    s = torch.einsum("bnhgd,bmhd->bnhgm", qb.float().reshape(B, n, HK, H // HK, D), kb.float()) * scale
    return s.reshape(B, n, H, -1)


class _DenseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, q, k, attn_scale, idx_scale, activation, qblk, kblk):  # type: ignore[override]
        B, T, H, _ = q.shape
        kl = torch.zeros(B, T, dtype=torch.float32, device=q.device)
        lse_a = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
        lse_i = torch.empty(B, T, dtype=torch.float32, device=q.device)
        for q0 in range(0, T, qblk):
            q1 = min(q0 + qblk, T)
            n = q1 - q0
            qb, qib = q[:, q0:q1], q_idx[:, q0:q1]
            wb = None if w_idx is None else w_idx[:, q0:q1]
            tq = torch.arange(q0, q1, device=q.device)
            # pass 1: log-sum-exp of the main attention (per head) and of the indexer scores
            la = torch.full((B, n, H), _NEG, device=q.device)
            li = torch.full((B, n), _NEG, device=q.device)
            for k0 in range(0, q1, kblk):
                k1 = min(k0 + kblk, q1)
                mask = torch.arange(k0, k1, device=q.device)[None, :] <= tq[:, None]  # [n, m]
                s = _attn_scores(qb, k[:, k0:k1], attn_scale).masked_fill(~mask[None, :, None], _NEG)
                la = torch.logaddexp(la, s.logsumexp(-1))
                i = indexer_scores(qib, k_idx[:, k0:k1], wb, idx_scale, activation).masked_fill(~mask[None], _NEG)
                li = torch.logaddexp(li, i.logsumexp(-1))
            # pass 2: sum_s p log p - sum_s p I
            acc = torch.zeros(B, n, device=q.device)
            for k0 in range(0, q1, kblk):
                k1 = min(k0 + kblk, q1)
                mask = torch.arange(k0, k1, device=q.device)[None, :] <= tq[:, None]
                s = _attn_scores(qb, k[:, k0:k1], attn_scale).masked_fill(~mask[None, :, None], _NEG)
                p = torch.exp(s - la[..., None]).mean(2)  # [B, n, m], 0 where masked
                i = indexer_scores(qib, k_idx[:, k0:k1], wb, idx_scale, activation).masked_fill(~mask[None], 0.0)
                acc += (torch.xlogy(p, p) - p * i).sum(-1)
            kl[:, q0:q1] = acc + li
            lse_a[:, q0:q1], lse_i[:, q0:q1] = la, li
        ctx.save_for_backward(q_idx, k_idx, w_idx, q, k, lse_a, lse_i)
        ctx.cfg = (attn_scale, idx_scale, activation, qblk, kblk)
        return kl.mean()

    @staticmethod
    def backward(ctx, gout):  # type: ignore[override]
        q_idx, k_idx, w_idx, q, k, lse_a, lse_i = ctx.saved_tensors
        attn_scale, idx_scale, activation, qblk, kblk = ctx.cfg
        B, T, HI, DI = q_idx.shape
        c = gout.float() / (B * T)
        dq_idx = torch.zeros(B, T, HI, DI, device=q.device)
        dk_idx = torch.zeros(B, T, DI, device=q.device)
        dw = None if w_idx is None else torch.zeros(B, T, HI, device=q.device)
        for q0 in range(0, T, qblk):
            q1 = min(q0 + qblk, T)
            qb, qib = q[:, q0:q1], q_idx[:, q0:q1].float()
            wb = torch.ones(B, q1 - q0, HI, device=q.device) if w_idx is None else w_idx[:, q0:q1].float()
            tq = torch.arange(q0, q1, device=q.device)
            la, li = lse_a[:, q0:q1], lse_i[:, q0:q1]
            for k0 in range(0, q1, kblk):
                k1 = min(k0 + kblk, q1)
                mask = torch.arange(k0, k1, device=q.device)[None, :] <= tq[:, None]
                s = _attn_scores(qb, k[:, k0:k1], attn_scale).masked_fill(~mask[None, :, None], _NEG)
                p = torch.exp(s - la[..., None]).mean(2)
                kb = k_idx[:, k0:k1].float()
                z = torch.einsum("bnhd,bmd->bnhm", qib, kb) * idx_scale  # [B, n, HI, m]
                a = z.clamp(min=0) if activation == "relu" else z
                i = torch.matmul(wb.unsqueeze(-2), a).squeeze(-2).masked_fill(~mask[None], _NEG)
                g = (torch.exp(i - li[..., None]) - p) * c  # dKL/dI, [B, n, m]
                if dw is not None:
                    dw[:, q0:q1] += torch.einsum("bnm,bnhm->bnh", g, a)
                dz = g[:, :, None, :] * wb[..., None] * idx_scale
                if activation == "relu":
                    dz = dz * (z > 0)
                dq_idx[:, q0:q1] += torch.einsum("bnhm,bmd->bnhd", dz, kb)
                dk_idx[:, k0:k1] += torch.einsum("bnhm,bnhd->bmd", dz, qib)
        return (
            dq_idx.to(q_idx.dtype),
            dk_idx.to(k_idx.dtype),
            None if dw is None else dw.to(w_idx.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def indexer_kl_loss_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor | None,
    attn_scale: float | None = None,
    idx_scale: float | None = None,
    activation: str | None = "relu",
    query_block: int = 128,
    key_block: int = 1024,
) -> torch.Tensor:
    """Dense warm-up indexer loss: mean over queries of ``KL(p || softmax(I))`` over causal keys.

    Two passes over key blocks per query block (log-sum-exps, then the KL terms); the backward
    recomputes the tiles, so memory is ``O(T * H + query_block * key_block * (H + HI))``.

    Args:
        q: main-attention queries ``[B, T, H, D]`` (no gradient taken).
        k: main-attention keys ``[B, T, HK, D]``, ``H % HK == 0`` (no gradient taken).
        q_idx: index queries ``[B, T, HI, DI]``; k_idx: index keys ``[B, T, DI]``;
        w_idx: index weights ``[B, T, HI]`` or None (equal weights).
        attn_scale: main softmax scale, default ``D ** -0.5``.
        idx_scale: indexer scale, default ``DI ** -0.5``.
        activation: ``"relu"`` (default) or None.
        query_block, key_block: tile sizes (defaults 128, 1024).

    Returns:
        scalar float32 loss (mean over the ``B * T`` queries).
    """
    _check(q, k, q_idx, k_idx, w_idx, activation)
    a_sc = q.shape[-1] ** -0.5 if attn_scale is None else float(attn_scale)
    i_sc = q_idx.shape[-1] ** -0.5 if idx_scale is None else float(idx_scale)
    return _DenseKL.apply(q_idx, k_idx, w_idx, q.detach(), k.detach(), a_sc, i_sc, activation, query_block, key_block)


def _sparse_block_kl(q_idx, k_idx, w_idx, q, k, indices, q0, a_sc, i_sc, activation):
    """Sum over the queries of one block of the KL restricted to the selected keys."""
    B, T, HK, D = k.shape
    n = q_idx.shape[1]
    idx = indices.long()  # [B, n, K]
    tq = torch.arange(q0, q0 + n, device=q.device)
    valid = (idx >= 0) & (idx <= tq[None, :, None])
    flat = idx.clamp(min=0) + (torch.arange(B, device=q.device) * T)[:, None, None]
    ki = k_idx.reshape(B * T, -1)[flat]  # [B, n, K, DI]
    z = torch.einsum("bnhd,bnkd->bnhk", q_idx.float(), ki.float()) * i_sc
    if activation == "relu":
        z = torch.relu(z)
    i = z.sum(2) if w_idx is None else torch.matmul(w_idx.float().unsqueeze(-2), z).squeeze(-2)
    logq = i.masked_fill(~valid, _NEG).log_softmax(-1)
    with torch.no_grad():
        ks = k.reshape(B * T, HK, D)[flat].float()  # [B, n, K, HK, D]
        H = q.shape[2]
        s = torch.einsum("bnhgd,bnkhd->bnhgk", q.float().reshape(B, n, HK, H // HK, D), ks) * a_sc
        s = s.reshape(B, n, H, -1).masked_fill(~valid[:, :, None], _NEG)
        p = s.softmax(-1).nan_to_num(0.0).mean(2)  # [B, n, K]
    return (torch.xlogy(p, p) - p * logq.masked_fill(~valid, 0.0)).sum()


def indexer_kl_loss_sparse(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor | None,
    indices: torch.Tensor,
    attn_scale: float | None = None,
    idx_scale: float | None = None,
    activation: str | None = "relu",
    query_block: int = 64,
) -> torch.Tensor:
    """Sparse-stage indexer loss: mean over queries of ``KL(p_S || softmax_S(I))`` on the selected set.

    ``S(t)`` is the set of valid entries of ``indices[b, t]`` (``0 <= s <= t``; ``-1`` ignored);
    both ``p`` (main attention restricted to ``S``, head mean) and ``softmax(I)`` are normalised
    over ``S``. Each query block is wrapped in non-reentrant activation checkpointing, so autograd
    keeps only the inputs and one block is recomputed at a time in backward.

    Args:
        q: ``[B, T, H, D]``, k: ``[B, T, HK, D]`` main attention (no gradient taken).
        q_idx: ``[B, T, HI, DI]``; k_idx: ``[B, T, DI]``; w_idx: ``[B, T, HI]`` or None.
        indices: ``[B, T, K]`` int64/int32 selection (e.g. from :func:`indexer_topk`), ``-1`` padded.
        attn_scale: default ``D ** -0.5``; idx_scale: default ``DI ** -0.5``.
        activation: ``"relu"`` (default) or None.
        query_block: queries per block (default 64).

    Returns:
        scalar float32 loss (mean over the ``B * T`` queries).
    """
    _check(q, k, q_idx, k_idx, w_idx, activation)
    B, T = q.shape[:2]
    if indices.dim() != 3 or indices.shape[:2] != (B, T):
        raise ValueError(f"indices must be [B, T, K] = [{B}, {T}, K]; got {tuple(indices.shape)}")
    a_sc = q.shape[-1] ** -0.5 if attn_scale is None else float(attn_scale)
    i_sc = q_idx.shape[-1] ** -0.5 if idx_scale is None else float(idx_scale)
    q, k = q.detach(), k.detach()
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q_idx, k_idx, w_idx))
    total = q_idx.new_zeros((), dtype=torch.float32)
    for q0 in range(0, T, query_block):
        q1 = min(q0 + query_block, T)
        args = (
            q_idx[:, q0:q1],
            k_idx,
            None if w_idx is None else w_idx[:, q0:q1],
            q[:, q0:q1],
            k,
            indices[:, q0:q1],
            q0,
            a_sc,
            i_sc,
            activation,
        )
        if needs_grad:
            total = total + checkpoint(_sparse_block_kl, *args, use_reentrant=False)
        else:
            total = total + _sparse_block_kl(*args)
    return total / (B * T)
