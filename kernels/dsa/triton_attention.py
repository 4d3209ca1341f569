"""Sparse attention over selected keys (DSA) as Triton kernels: forward and backward.

Same op as the torch reference :func:`genolong.kernels.dsa.attention.sparse_attention` (same
signature, shapes, validation and result): query ``t`` attends to the keys listed in
``indices[b, t]``, ``-1`` slots and positions ``> q_offset + t`` ignored, GQA/MQA head sharing
``h // G``, ``DV`` may differ from ``D`` (the MLA latent shapes of the DSA layer), a row with no
valid key gives 0.

Layout of the work. One program handles one (batch, query, KV head): the ``G = H // HK`` query
heads that share the KV head form the ``M`` side of the tile (FlashMLA's sparse layout; in the
absorbed DSA layer ``HK = 1`` and all ``H`` heads share one gathered latent row), and the
selected keys are walked in tiles of ``BLOCK_K`` slots of the top-k dimension, each tile's K/V
rows gathered by index straight from global memory. Nothing of size ``T * topk`` is ever
materialised, so ``query_block`` (the reference's memory knob for its gathered chunks) has no
role here: it is validated like the reference's and otherwise ignored.
When ``v is k`` (the absorbed layer passes the latent as both) each key tile is gathered once and
the backward scatters ``dK + dV`` into one buffer: half the gather traffic and half the atomics.

Forward: online softmax over the key tiles (running max ``m``, running sum ``l``, rescaled
accumulator), output ``o = acc / l`` and the log-sum-exp ``lse = m + log l`` saved ``[B, T, H]``
(``-inf`` for rows with no valid key, as in the reference).

Backward (recompute, the FlashAttention recipe): per key tile, ``P = exp(S - lse)`` from ``q``,
``k`` and the saved lse; ``dP = dO V^T``; ``dS = P * (dP - delta)`` with
``delta = rowsum(dO * O)`` (the softmax Jacobian: ``dS_j = P_j (dP_j - sum_i P_i dP_i)`` and
``sum_i P_i dP_i = dO . sum_i P_i V_i = dO . O``); then ``dQ = scale * dS K`` accumulates in
registers over the tiles, while ``dK[idx] += scale * dS^T Q`` and ``dV[idx] += P^T dO`` are
scattered with float32 atomic adds (a key row is selected by many queries; the adds commute, so
the result is exact up to float32 summation order, which on a GPU may vary between runs; a
deterministic variant would need the inverse index lists, key -> queries, i.e. a sort of the
indices: left for when a run needs bitwise reproducibility).

Precision: tiles are loaded in the inputs' dtype and every ``tl.dot`` accumulates in float32;
``P`` and ``dS`` are cast to the input dtype before their products with ``V``/``K``/``dO``/``Q``
(as FlashAttention does: one extra rounding for 16-bit inputs, none for float32, where the dots
run in IEEE float32, not TF32). Softmax statistics, ``delta``, ``dQ`` and the ``dK``/``dV``
buffers are float32. float64 inputs are computed in float32 like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import check_sparse_attention_args
from .triton_common import KERNEL_DTYPES, check_runnable

__all__ = ["sparse_attention_triton"]



@triton.jit
def _sparse_attn_fwd_kernel(
    Q, K, V, IDX, O, LSE,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ib, stride_it, stride_ik,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    T, TOPK, q_offset, scale,
    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHARED_KV: tl.constexpr,
):
    """One program: query ``t`` of batch ``b``, the ``G`` query heads of KV head ``hk``."""
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_g = offs_g < G
    mask_d = offs_d < D
    mask_dv = offs_dv < DV
    heads = hk * G + offs_g  # query heads of this KV head (padded rows g >= G are masked)

    q_ptrs = Q + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    limit = q_offset + t  # causal limit: a selected position must be <= the query's own

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running row max of S
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp(S - m)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)  # running sum of exp(S - m) V

    for k0 in range(0, TOPK, BLOCK_K):
        slot = k0 + offs_k
        idx = tl.load(IDX + b * stride_ib + t * stride_it + slot * stride_ik, mask=slot < TOPK, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx <= limit)
        row = tl.where(valid, idx, 0)  # invalid slots are never read (masked loads)
        k_ptrs = K + b * stride_kb + row[:, None] * stride_kt + hk * stride_kh + offs_d[None, :] * stride_kd
        kt = tl.load(k_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
        if SHARED_KV:
            vt = kt  # k is v (the absorbed MLA latent): one gather serves both
        else:
            v_ptrs = V + b * stride_vb + row[:, None] * stride_vt + hk * stride_vh + offs_dv[None, :] * stride_vd
            vt = tl.load(v_ptrs, mask=valid[:, None] & mask_dv[None, :], other=0.0)  # [BLOCK_K, BLOCK_DV]

        # S = scale * q k^T over this tile; empty / future slots get -inf (weight 0)
        s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_K]
        s = tl.where(valid[None, :], s, float("-inf"))
        # online softmax: m' = max(m, rowmax S); acc, l rescaled by exp(m - m').
        # While a row has seen no valid key m' = -inf: use 0 as the shift so exp gives 0, not nan.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        m_i = m_new

    has_key = l_i > 0.0
    o = tl.where(has_key[:, None], acc / tl.where(has_key, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_key, m_i + tl.log(tl.where(has_key, l_i, 1.0)), float("-inf"))
    o_ptrs = O + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=mask_g[:, None] & mask_dv[None, :])
    tl.store(LSE + b * stride_lb + t * stride_lt + heads * stride_lh, lse, mask=mask_g)


@triton.jit
def _sparse_attn_bwd_kernel(
    Q, K, V, IDX, O, DO, LSE, DQ, DK, DV_,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ib, stride_it, stride_ik,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_dob, stride_dot, stride_doh, stride_dod,
    stride_lb, stride_lt, stride_lh,
    stride_dqb, stride_dqt, stride_dqh, stride_dqd,
    stride_dkb, stride_dkt, stride_dkh, stride_dkd,
    stride_dvb, stride_dvt, stride_dvh, stride_dvd,
    T, TOPK, q_offset, scale,
    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHARED_KV: tl.constexpr,
):
    """One program: query ``t`` of batch ``b``, KV head ``hk``: writes dQ rows, scatters dK/dV."""
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_g = offs_g < G
    mask_d = offs_d < D
    mask_dv = offs_dv < DV
    mask_qd = mask_g[:, None] & mask_d[None, :]
    mask_qdv = mask_g[:, None] & mask_dv[None, :]
    heads = hk * G + offs_g

    q = tl.load(Q + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_qd, other=0.0)  # [BLOCK_G, BLOCK_D]
    do = tl.load(DO + b * stride_dob + t * stride_dot + heads[:, None] * stride_doh + offs_dv[None, :] * stride_dod,
                 mask=mask_qdv, other=0.0)  # [BLOCK_G, BLOCK_DV]
    o = tl.load(O + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od,
                mask=mask_qdv, other=0.0)
    # delta = rowsum(dO * O) = sum_j P_j dP_j: the softmax-Jacobian term shared by the row
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)  # [BLOCK_G]
    lse = tl.load(LSE + b * stride_lb + t * stride_lt + heads * stride_lh, mask=mask_g, other=float("inf"))
    # rows with no valid key (lse = -inf) and padded head rows: lse = +inf makes every P exactly 0
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    do = do.to(Q.dtype.element_ty)
    limit = q_offset + t

    dq = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, TOPK, BLOCK_K):
        slot = k0 + offs_k
        idx = tl.load(IDX + b * stride_ib + t * stride_it + slot * stride_ik, mask=slot < TOPK, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx <= limit)
        row = tl.where(valid, idx, 0)
        kt = tl.load(K + b * stride_kb + row[:, None] * stride_kt + hk * stride_kh + offs_d[None, :] * stride_kd,
                     mask=valid[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
        if SHARED_KV:
            vt = kt
        else:
            vt = tl.load(V + b * stride_vb + row[:, None] * stride_vt + hk * stride_vh + offs_dv[None, :] * stride_vd,
                         mask=valid[:, None] & mask_dv[None, :], other=0.0)  # [BLOCK_K, BLOCK_DV]

        # recompute P = exp(S - lse) exactly as the forward normalised it
        s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_K]
        s = tl.where(valid[None, :], s, float("-inf"))
        p = tl.exp(s - lse[:, None])
        # dP = dO V^T; softmax backward dS = P * (dP - delta)
        dp = tl.dot(do, tl.trans(vt), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        # dQ += dS K (scale applied once at the end)
        dq += tl.dot(ds.to(kt.dtype), kt, input_precision="ieee")
        # dK[idx] += scale * dS^T Q and dV[idx] += P^T dO, scattered to the selected rows
        dk_tile = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee") * scale  # [BLOCK_K, BLOCK_D]
        dv_tile = tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")  # [BLOCK_K, BLOCK_DV]
        dk_ptrs = DK + b * stride_dkb + row[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :] * stride_dkd
        if SHARED_KV:
            # k is v: both gradients go to the one tensor, so one scatter of their sum
            tl.atomic_add(dk_ptrs, dk_tile + dv_tile, mask=valid[:, None] & mask_d[None, :], sem="relaxed")
        else:
            tl.atomic_add(dk_ptrs, dk_tile, mask=valid[:, None] & mask_d[None, :], sem="relaxed")
            dv_ptrs = DV_ + b * stride_dvb + row[:, None] * stride_dvt + hk * stride_dvh + offs_dv[None, :] * stride_dvd
            tl.atomic_add(dv_ptrs, dv_tile, mask=valid[:, None] & mask_dv[None, :], sem="relaxed")

    dq_ptrs = DQ + b * stride_dqb + t * stride_dqt + heads[:, None] * stride_dqh + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=mask_qd)


def _blocks(G: int, K: int, D: int, DV: int) -> tuple[int, int, int, int]:
    """Tile sizes ``(BLOCK_G, BLOCK_K, BLOCK_D, BLOCK_DV)``: powers of two, at least 16 (the smallest
    ``tl.dot`` operand on GPUs); the top-k dimension is walked in tiles of at most 32 slots."""
    p2 = triton.next_power_of_2
    return max(16, p2(G)), min(32, max(16, p2(K))), max(16, p2(D)), max(16, p2(DV))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float,
             q_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs of one kernel dtype (``v is k``: one gather).

    Returns:
        ``o [B, T, H, DV]`` in ``q.dtype`` and ``lse [B, T, H]`` float32 (``-inf`` for rows with no
        valid key).
    """
    B, T, H, D = q.shape
    HK, DV = k.shape[2], v.shape[3]
    G = H // HK
    topk = indices.shape[2]
    o = torch.empty(B, T, H, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    BG, BK, BD, BDV = _blocks(G, topk, D, DV)
    if B * T > 0:
        _sparse_attn_fwd_kernel[(B * T, HK)](
            q, k, v, indices, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *o.stride(), *lse.stride(),
            T, topk, q_offset, scale,
            G=G, D=D, DV=DV, BLOCK_G=BG, BLOCK_K=BK, BLOCK_D=BD, BLOCK_DV=BDV, SHARED_KV=k is v,
        )
    return o, lse


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, o: torch.Tensor,
              do: torch.Tensor, lse: torch.Tensor, scale: float,
              q_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernel: ``P`` is recomputed from ``q``, ``k`` and the given ``lse``.

    Args:
        q, k, v, indices, o: as saved by :func:`_forward` (one kernel dtype).
        do: ``[B, T, H, DV]`` output gradient (any strides; cast to ``q.dtype``).
        lse: ``[B, T, H]`` float32 log-sum-exp of the forward.
        scale, q_offset: as in the forward.

    Returns:
        ``dq [B, T, H, D]``, ``dk [B, TK, HK, D]``, ``dv [B, TK, HK, DV]``, all float32; for
        ``v is k`` one tensor, returned as both ``dk`` and ``dv``, holds the sum of the two.
    """
    B, T, H, D = q.shape
    TK, HK, DV = k.shape[1], k.shape[2], v.shape[3]
    G = H // HK
    topk = indices.shape[2]
    do = do.to(q.dtype)
    dq = torch.empty(B, T, H, D, dtype=torch.float32, device=q.device)
    # float32 scatter targets of the atomic adds (zeros: keys nobody selected get no gradient)
    dk = torch.zeros(B, TK, HK, D, dtype=torch.float32, device=q.device)
    dv = dk if k is v else torch.zeros(B, TK, HK, DV, dtype=torch.float32, device=q.device)
    BG, BK, BD, BDV = _blocks(G, topk, D, DV)
    if B * T > 0:
        _sparse_attn_bwd_kernel[(B * T, HK)](
            q, k, v, indices, o, do, lse, dq, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *o.stride(), *do.stride(),
            *lse.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
            T, topk, q_offset, scale,
            G=G, D=D, DV=DV, BLOCK_G=BG, BLOCK_K=BK, BLOCK_D=BD, BLOCK_DV=BDV, SHARED_KV=k is v,
        )
    return dq, dk, dv


class _SparseAttentionTriton(torch.autograd.Function):
    """Autograd wrapper: Triton forward (saves the lse) and Triton recomputing backward."""

    @staticmethod
    def forward(ctx, q, k, v, indices, scale, q_offset):  # type: ignore[override]
        # one dtype for the dot operands: the inputs' own if shared and supported, else float32
        cdt = q.dtype if (q.dtype == k.dtype == v.dtype and q.dtype in KERNEL_DTYPES) else torch.float32
        qc, kc = q.to(cdt), k.to(cdt)
        vc = kc if v is k else v.to(cdt)  # keep the identity: the kernels then gather k once
        o, lse = _forward(qc, kc, vc, indices, scale, q_offset)
        ctx.save_for_backward(qc, kc, vc, indices, o, lse)
        ctx.scale, ctx.q_offset, ctx.shared_kv = scale, q_offset, vc is kc
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, indices, o, lse = ctx.saved_tensors
        if ctx.shared_kv:
            v = k  # unpacking need not keep the identity that selects the shared-gather kernels
        dq, dk, dv = _backward(q, k, v, indices, o, do, lse, ctx.scale, ctx.q_offset)
        q_dt, k_dt, v_dt = ctx.dtypes
        if ctx.shared_kv:  # dk holds dK + dV; the v slot adds nothing more to the shared tensor
            return dq.to(q_dt), dk.to(k_dt), None, None, None, None
        return dq.to(q_dt), dk.to(k_dt), dv.to(v_dt), None, None, None


def sparse_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    query_block: int = 64,
    q_offset: int = 0,
) -> torch.Tensor:
    """Attention of each query over its selected keys only, as Triton kernels; differentiable w.r.t. q, k, v.

    The op of :func:`genolong.kernels.dsa.sparse_attention` (same arguments, shapes, checks and
    result): ``o[b, t, h] = sum_{s in S(b, t)} softmax_s(scale * q[b, t, h] . k[b, s, h // G]) v[b, s, h // G]``
    with ``S(b, t) = {indices[b, t, i] : 0 <= indices[b, t, i] <= q_offset + t}`` and ``G = H // HK``.
    A row with no valid key gives 0. Indices are assumed distinct within a row. Softmax statistics
    and accumulations are float32; the result is returned in ``q.dtype``.

    Args:
        q: queries ``[B, T, H, D]`` at positions ``q_offset .. q_offset + T - 1``.
        k: keys ``[B, TK, HK, D]`` with ``H % HK == 0`` and ``TK >= q_offset + T``.
        v: values ``[B, TK, HK, DV]`` (``DV`` may differ from ``D``; ``k`` and ``v`` may be the same
            tensor, as the absorbed MLA form of the DSA layer passes the latent twice).
        indices: ``[B, T, K]`` int64 or int32 selected key positions, ``-1`` padded.
        scale: softmax scale, default ``D ** -0.5``.
        query_block: validated (``>= 1``) like the reference's and otherwise ignored: the kernels
            gather key tiles per query in registers, so there is no per-chunk buffer to size.
        q_offset: position of the first query (default 0; context parallelism).

    Returns:
        o: ``[B, T, H, DV]`` in ``q.dtype``.

    Raises:
        ValueError: shapes, heads, index dtype, ``q_offset`` or ``query_block`` as in the reference.
        InputError: tensors on different devices, or on CPU without ``TRITON_INTERPRET=1``.
    """
    check_sparse_attention_args(q, k, v, indices, q_offset, query_block)
    D = q.shape[3]
    check_runnable(_sparse_attn_fwd_kernel, "genolong.kernels.dsa.triton_attention",
                   "sparse_attention_triton", "q, k, v and indices", q, k, v, indices)
    sc = D ** -0.5 if scale is None else float(scale)
    return _SparseAttentionTriton.apply(q, k, v, indices, sc, int(q_offset))
