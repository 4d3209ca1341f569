"""Sparse attention over selected keys (DSA) as Triton kernels: forward and backward.

Same op as the torch reference :func:`genolong.kernels.dsa.attention.sparse_attention` (same
signature, shapes, validation and result): query ``t`` attends to the keys listed in
``indices[b, t]``, ``-1`` slots and positions ``> q_offset + t`` ignored, GQA/MQA head sharing
``h // G``, ``DV`` may differ from ``D`` (the MLA latent shapes of the DSA layer), a row with no
valid key gives 0.

Layout of the work. Forward and dQ are query-major: one program handles one (batch, query, KV
head): the ``G = H // HK`` query heads that share the KV head form the ``M`` side of the tile
(FlashMLA's sparse layout; in the absorbed DSA layer ``HK = 1`` and all ``H`` heads share one
gathered latent row), and the selected keys are walked in tiles of ``BLOCK_K`` slots of the top-k
dimension, each tile's K/V rows gathered by index straight from global memory. dK/dV are
key-major: one program per key tile walks the queries that selected it (below). Nothing of size
``T * topk * D`` is ever materialised, so ``query_block`` (the reference's memory knob for its
gathered chunks) has no role here: it is validated like the reference's and otherwise ignored.
When ``v is k`` (the absorbed layer passes the latent as both) each key tile is gathered once and
one accumulator holds ``dK + dV``.

Forward: online softmax over the key tiles (running max ``m``, running sum ``l``, rescaled
accumulator), output ``o = acc / l`` and the log-sum-exp ``lse = m + log l`` saved ``[B, T, H]``
(``-inf`` for rows with no valid key, as in the reference).

Backward (recompute, the FlashAttention recipe): ``P = exp(S - lse)`` from ``q``, ``k`` and the
saved lse; ``dP = dO V^T``; ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)`` (the softmax
Jacobian: ``dS_j = P_j (dP_j - sum_i P_i dP_i)`` and ``sum_i P_i dP_i = dO . O``). Two kernels,
no atomics, so the gradients are bitwise identical run to run:

- dQ (query-major, like the forward): writes ``delta [B, T, H]`` and ``dQ = scale * dS K``,
  accumulated in registers over the key tiles. A head group whose float32 dQ accumulator would
  pass 16K elements is split over programs (GLM-5.3-Flash: two programs of 32 heads per query,
  neighbours in the launch order so the second gather of each key tile hits L2).
- dK/dV (key-major): the wrapper inverts the indices once with torch ops: every valid
  (query, key) pair gets the code ``(b * NT + key // 16) * T + t``, ``torch.unique`` sorts the
  codes into per-key-tile query lists (CSR offsets from ``bincount``) and a scatter-add of
  ``1 << key % 16`` gives each (tile, query) entry the mask of the tile's keys it selected. One
  program per key tile of 16 (GLM-5.3-Flash's KPool size: a selected pool is one full tile)
  loads its K/V rows once, walks its queries in steps of (query, head) rows, recomputes ``P`` and
  ``dS`` for the selected keys and accumulates ``dK = scale * dS^T Q`` and ``dV = P^T dO`` in
  registers, stored once. A tile selected by more than ``_DKV_SEGMENT`` queries (an attention
  sink) is split into segments whose float32 partials a small kernel sums in segment order.
  The price of key-major order is bandwidth: each (query, key tile) entry reads the query's Q and
  dO rows (GLM-5.3-Flash: 2 x 64 KB for 16 keys), where the query-major kernels read 16 KB of K.

Precision: every ``tl.dot`` takes operands of one "dot dtype" and accumulates in float32. It is
16-bit whenever any of ``q, k, v`` is (tensor-core dots: bf16-mixed training passes bf16 queries
with a float32 latent out of an RMSNorm; the float32 side is rounded to the 16-bit dtype as it is
loaded, inside the kernels, without a copy), float32 otherwise, in IEEE float32 (not TF32: the
float32 path is the accuracy and CPU-test path). ``P`` and ``dS`` are cast to the dot dtype before
their products (as FlashAttention does: one extra rounding for 16-bit, none for float32).
Softmax statistics, ``delta`` and the accumulators are float32; ``dQ``/``dK``/``dV`` are stored
in their input's dtype. float64 inputs are computed in float32 like the reference.

Launch shapes: ``num_warps`` per shape (at most 64 float32 accumulator registers per thread, 4
to 8 warps), ``num_stages`` 2 only where the second buffer fits, the key-major step's rows
chosen so that its Q/dO operand copies stay under 160 KB. Compiled for sm_90 and sm_100 at the
GLM-5.3-Flash (64 heads x 512 latent, top-k 2,063) and ``1b`` shapes, every kernel fits the
232,448 B of shared memory per block (see ``benchmarks/gpu_compile.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attention import check_sparse_attention_args
from .triton_common import KERNEL_DTYPES, check_runnable

__all__ = ["sparse_attention_triton"]


@triton.jit
def _sparse_attn_fwd_kernel(
    Q,
    K,
    V,
    IDX,
    O,
    LSE,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ib,
    stride_it,
    stride_ik,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lt,
    stride_lh,
    T,
    TOPK,
    q_offset,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SHARED_KV: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
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
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(DOT)  # [BLOCK_G, BLOCK_D]
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
        kt = tl.load(k_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0).to(DOT)  # [BLOCK_K, BLOCK_D]
        if SHARED_KV:
            vt = kt  # k is v (the absorbed MLA latent): one gather serves both
        else:
            v_ptrs = V + b * stride_vb + row[:, None] * stride_vt + hk * stride_vh + offs_dv[None, :] * stride_vd
            vt = tl.load(v_ptrs, mask=valid[:, None] & mask_dv[None, :], other=0.0).to(DOT)  # [BLOCK_K, BLOCK_DV]

        # S = scale * q k^T over this tile; empty / future slots get -inf (weight 0)
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_K]
        s = tl.where(valid[None, :], s, float("-inf"))
        # online softmax: m' = max(m, rowmax S); acc, l rescaled by exp(m - m').
        # While a row has seen no valid key m' = -inf: use 0 as the shift so exp gives 0, not nan.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vt, input_precision=PRECISION)
        m_i = m_new

    has_key = l_i > 0.0
    o = tl.where(has_key[:, None], acc / tl.where(has_key, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_key, m_i + tl.log(tl.where(has_key, l_i, 1.0)), float("-inf"))
    o_ptrs = O + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=mask_g[:, None] & mask_dv[None, :])
    tl.store(LSE + b * stride_lb + t * stride_lt + heads * stride_lh, lse, mask=mask_g)


@triton.jit
def _sparse_attn_bwd_dq_kernel(
    Q,
    K,
    V,
    IDX,
    O,
    DO,
    LSE,
    DQ,
    DELTA,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ib,
    stride_it,
    stride_ik,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    stride_dob,
    stride_dot,
    stride_doh,
    stride_dod,
    stride_lb,
    stride_lt,
    stride_lh,
    stride_dqb,
    stride_dqt,
    stride_dqh,
    stride_dqd,
    T,
    TOPK,
    q_offset,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SHARED_KV: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    N_SPLIT: tl.constexpr,
):
    """One program: query ``t`` of batch ``b``, ``BLOCK_G`` heads of KV head ``hk`` (its group in ``N_SPLIT``
    programs): writes their dQ rows and ``delta``.

    ``DELTA`` (``[B, T, H]`` float32, the layout of ``LSE``) is written for the key-major kernel.
    """
    # the N_SPLIT programs of one query are neighbours in the launch order: they gather the same
    # key rows, so the second gather hits L2
    pid = tl.program_id(0) // N_SPLIT
    g0 = (tl.program_id(0) % N_SPLIT) * BLOCK_G  # first head of this program within the group
    hk = tl.program_id(1)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)

    offs_g = g0 + tl.arange(0, BLOCK_G)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_g = offs_g < G
    mask_d = offs_d < D
    mask_dv = offs_dv < DV
    mask_qd = mask_g[:, None] & mask_d[None, :]
    mask_qdv = mask_g[:, None] & mask_dv[None, :]
    heads = hk * G + offs_g

    do = tl.load(
        DO + b * stride_dob + t * stride_dot + heads[:, None] * stride_doh + offs_dv[None, :] * stride_dod,
        mask=mask_qdv,
        other=0.0,
    )  # [BLOCK_G, BLOCK_DV]
    o = tl.load(
        O + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od,
        mask=mask_qdv,
        other=0.0,
    )
    # delta = rowsum(dO * O) = sum_j P_j dP_j: the softmax-Jacobian term shared by the row
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)  # [BLOCK_G]
    tl.store(DELTA + b * stride_lb + t * stride_lt + heads * stride_lh, delta, mask=mask_g)
    do = do.to(DOT)
    q = tl.load(
        Q + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_qd,
        other=0.0,
    ).to(DOT)  # [BLOCK_G, BLOCK_D]
    lse = tl.load(LSE + b * stride_lb + t * stride_lt + heads * stride_lh, mask=mask_g, other=float("inf"))
    # rows with no valid key (lse = -inf) and padded head rows: lse = +inf makes every P exactly 0
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    limit = q_offset + t

    dq = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, TOPK, BLOCK_K):
        slot = k0 + offs_k
        idx = tl.load(IDX + b * stride_ib + t * stride_it + slot * stride_ik, mask=slot < TOPK, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx <= limit)
        row = tl.where(valid, idx, 0)
        kt = tl.load(
            K + b * stride_kb + row[:, None] * stride_kt + hk * stride_kh + offs_d[None, :] * stride_kd,
            mask=valid[:, None] & mask_d[None, :],
            other=0.0,
        ).to(DOT)  # [BLOCK_K, BLOCK_D]
        if SHARED_KV:
            vt = kt
        else:
            vt = tl.load(
                V + b * stride_vb + row[:, None] * stride_vt + hk * stride_vh + offs_dv[None, :] * stride_vd,
                mask=valid[:, None] & mask_dv[None, :],
                other=0.0,
            ).to(DOT)  # [BLOCK_K, BLOCK_DV]
        # recompute P = exp(S - lse) exactly as the forward normalised it
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_K]
        s = tl.where(valid[None, :], s, float("-inf"))
        p = tl.exp(s - lse[:, None])
        # dP = dO V^T; softmax backward dS = P * (dP - delta); dQ += dS K (scale applied at the end)
        dp = tl.dot(do, tl.trans(vt), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(DOT), kt, input_precision=PRECISION)

    dq_ptrs = DQ + b * stride_dqb + t * stride_dqt + heads[:, None] * stride_dqh + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=mask_qd)


@triton.jit
def _sparse_attn_bwd_dkv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV_,
    PART_K,
    PART_V,
    SEG_TILE,
    SEG_START,
    SEG_END,
    SEG_SLOT,
    ENT_T,
    ENT_BITS,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_dob,
    stride_dot,
    stride_doh,
    stride_dod,
    stride_lb,
    stride_lt,
    stride_lh,
    stride_dkb,
    stride_dkt,
    stride_dkh,
    stride_dkd,
    stride_dvb,
    stride_dvt,
    stride_dvh,
    stride_dvd,
    TK,
    NT,
    HK,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    GP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SHARED_KV: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: one segment of the query list of one key tile (``BLOCK_K`` keys), KV head ``hk``.

    The segment's entries ``ENT_T[e]`` (query positions, ascending) with ``ENT_BITS[e]`` (bit ``j``:
    the query selected key ``tile * BLOCK_K + j``) are walked as rows ``r`` = (entry ``r // GP``, head
    ``hk * G + r % GP``), ``ROWS`` at a time (several queries per step when ``GP < ROWS``, part of
    one query's heads when ``GP > ROWS``: the same loads either way). dK/dV of the tile build up
    in registers and are stored once: into ``DK``/``DV_`` when the segment is its tile's only one
    (``SEG_SLOT = -1``), else into the float32 partial buffers at the segment's slot.
    """
    seg = tl.program_id(0)
    hk = tl.program_id(1)
    tile_g = tl.load(SEG_TILE + seg).to(tl.int64)  # b * NT + tile
    e0 = tl.load(SEG_START + seg).to(tl.int64)
    e1 = tl.load(SEG_END + seg).to(tl.int64)
    slot = tl.load(SEG_SLOT + seg).to(tl.int64)
    b = tile_g // NT
    key0 = (tile_g % NT) * BLOCK_K

    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, ROWS)
    mask_d = offs_d < D
    mask_dv = offs_dv < DV
    keys = key0 + offs_k
    mask_key = keys < TK

    kt = tl.load(
        K + b * stride_kb + keys[:, None] * stride_kt + hk * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask_key[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT)  # [BLOCK_K, BLOCK_D]
    if SHARED_KV:
        vt = kt
    else:
        vt = tl.load(
            V + b * stride_vb + keys[:, None] * stride_vt + hk * stride_vh + offs_dv[None, :] * stride_vd,
            mask=mask_key[:, None] & mask_dv[None, :],
            other=0.0,
        ).to(DOT)  # [BLOCK_K, BLOCK_DV]

    dk = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_DV], dtype=tl.float32)
    for r0 in range(e0 * GP, e1 * GP, ROWS):
        r = r0 + offs_r  # [ROWS]
        ent = r // GP
        r_g = r % GP  # head within the KV head's group
        in_seg = ent < e1
        row_ok = in_seg & (r_g < G)
        t = tl.load(ENT_T + ent, mask=in_seg, other=0).to(tl.int64)
        bits = tl.load(ENT_BITS + ent, mask=row_ok, other=0)  # rows not in use select nothing
        heads = hk * G + r_g
        qm = tl.load(
            Q + b * stride_qb + t[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & mask_d[None, :],
            other=0.0,
        ).to(DOT)  # [ROWS, BLOCK_D]
        dom = tl.load(
            DO + b * stride_dob + t[:, None] * stride_dot + heads[:, None] * stride_doh + offs_dv[None, :] * stride_dod,
            mask=row_ok[:, None] & mask_dv[None, :],
            other=0.0,
        ).to(DOT)
        lse = tl.load(LSE + b * stride_lb + t * stride_lt + heads * stride_lh, mask=row_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # cannot happen for a listed query; kept safe
        delta = tl.load(DELTA + b * stride_lb + t * stride_lt + heads * stride_lh, mask=row_ok, other=0.0)
        sel = ((bits[:, None] >> offs_k[None, :]) & 1) != 0  # [ROWS, BLOCK_K]: the keys this query selected
        # recompute P and dS of these (query, key) pairs exactly as the dQ kernel does
        s = tl.dot(qm, tl.trans(kt), input_precision=PRECISION) * scale  # [ROWS, BLOCK_K]
        s = tl.where(sel, s, float("-inf"))
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(dom, tl.trans(vt), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        # dK += scale * dS^T Q, dV += P^T dO (the scale goes into dS so that with k is v one
        # accumulator takes both products)
        dk += tl.dot(tl.trans((ds * scale).to(DOT)), qm, input_precision=PRECISION)
        if SHARED_KV:
            dk += tl.dot(tl.trans(p.to(DOT)), dom, input_precision=PRECISION)
        else:
            dv += tl.dot(tl.trans(p.to(DOT)), dom, input_precision=PRECISION)

    mk = mask_key[:, None] & mask_d[None, :]
    if slot < 0:  # the tile's only segment: its final gradient rows
        tl.store(
            DK + b * stride_dkb + keys[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :] * stride_dkd,
            dk.to(DK.dtype.element_ty),
            mask=mk,
        )
        if not SHARED_KV:
            tl.store(
                DV_ + b * stride_dvb + keys[:, None] * stride_dvt + hk * stride_dvh + offs_dv[None, :] * stride_dvd,
                dv.to(DV_.dtype.element_ty),
                mask=mask_key[:, None] & mask_dv[None, :],
            )
    else:  # one of several: a float32 partial, summed in segment order by _sparse_attn_dkv_reduce_kernel
        part = (slot * HK + hk) * BLOCK_K + offs_k
        tl.store(PART_K + part[:, None] * BLOCK_D + offs_d[None, :], dk)
        if not SHARED_KV:
            tl.store(PART_V + part[:, None] * BLOCK_DV + offs_dv[None, :], dv)


@triton.jit
def _sparse_attn_dkv_reduce_kernel(
    PART,
    DK,
    TILE,
    SLOT0,
    NSLOT,
    stride_dkb,
    stride_dkt,
    stride_dkh,
    stride_dkd,
    TK,
    NT,
    HK,
    D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DC: tl.constexpr,
):
    """One program: a key tile split into ``NSLOT`` segments, KV head ``hk``, columns
    ``[c * BLOCK_DC, (c + 1) * BLOCK_DC)`` of the partials' ``BLOCK_D``: sums the segments' float32
    partials ``PART [slots, HK, BLOCK_K, BLOCK_D]`` in segment order (deterministic) and stores the
    tile's rows of ``DK``. The columns are split over programs so that the accumulator stays small:
    a whole [16, 256] fp32 row block at 4 warps spilled 16 B per thread on sm_100 with triton 3.6."""
    i = tl.program_id(0)
    hk = tl.program_id(1)
    c = tl.program_id(2)
    tile_g = tl.load(TILE + i).to(tl.int64)
    s0 = tl.load(SLOT0 + i).to(tl.int64)
    n = tl.load(NSLOT + i)
    b = tile_g // NT
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = c * BLOCK_DC + tl.arange(0, BLOCK_DC)
    keys = (tile_g % NT) * BLOCK_K + offs_k
    acc = tl.zeros([BLOCK_K, BLOCK_DC], dtype=tl.float32)
    for j in range(0, n):
        part = ((s0 + j) * HK + hk) * BLOCK_K + offs_k
        acc += tl.load(PART + part[:, None] * BLOCK_D + offs_d[None, :])
    tl.store(
        DK + b * stride_dkb + keys[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :] * stride_dkd,
        acc.to(DK.dtype.element_ty),
        mask=(keys < TK)[:, None] & (offs_d < D)[None, :],
    )


#: Largest float32 dQ accumulator of one dQ program (elements): 64 registers per thread at 8 warps.
_DQ_ACC_ELEMS = 16384
#: Keys per tile of the key-major backward: 16, GLM-5.3-Flash's KPool size (pools are aligned at 0,
#: so a query that selected a pool selected all 16 keys of one tile and no slot of the tile's dots
#: is wasted), and the smallest ``tl.dot`` operand. At most 31 (the selection bits are an int32).
_DKV_BLOCK_K = 16
#: Rows (selecting query x head pairs) per step of the key-major backward, at most; halved (down to
#: 16) by :func:`_key_major_config` until the step's operands fit shared memory.
_DKV_ROWS = 64
#: Columns of the float32 partials one reduction program sums (a power of two; the partials'
#: ``BLOCK_D`` is a multiple): [16, 64] fp32 is 8 values per thread at 4 warps.
_DKV_REDUCE_COLS = 64
#: Longest query list one key-major program walks; a key tile selected by more queries (an
#: attention sink: every query selects pool 0) is split into segments whose float32 partials are
#: summed in order by a second kernel, so a hot key tile does not serialise the whole backward.
_DKV_SEGMENT = 4096


class _Config(NamedTuple):
    """Tile sizes and launch options of one kernel (powers of two; every ``tl.dot`` dimension >= 16)."""

    block_g: int
    block_k: int
    block_d: int
    block_dv: int
    num_warps: int
    num_stages: int


def _warps(acc_elems: int) -> int:
    """``num_warps`` for a program whose largest float32 accumulator has ``acc_elems`` elements:
    at most 64 accumulator registers per thread (GLM-5.3-Flash's [64, 512] forward accumulator
    spilled 3 KB per thread with 4 warps), between 4 and 8 warps."""
    return max(4, min(8, triton.next_power_of_2(triton.cdiv(acc_elems, 32 * 64))))


def _query_major_config(G: int, K: int, D: int, DV: int, itemsize: int, resident: int) -> _Config:
    """Tiles of the forward and dQ kernels (one program per query and KV head, or part of its heads).

    Args:
        G, K, D, DV: heads of the program, top-k, key and value widths.
        itemsize: bytes per dot operand element.
        resident: bytes of the operands a program keeps in shared memory across its key loop (the
            forward's Q tile; the dQ kernel's Q and dO tiles).

    The top-k dimension is walked in tiles of 32 slots with software pipelining (``num_stages`` 2),
    or of 16 slots without it when the resident operands exceed 96 KB: then a second 32-row
    K (+ V) buffer would crowd the 227 KB of shared memory per block.
    """
    p2 = triton.next_power_of_2
    bg, bd, bdv = max(16, p2(G)), max(16, p2(D)), max(16, p2(DV))
    big = resident > 96 * 1024
    bk = min(16 if big else 32, max(16, p2(K)))
    return _Config(bg, bk, bd, bdv, _warps(bg * max(bd, bdv)), 1 if big else 2)


def _dq_config(G: int, K: int, D: int, DV: int, itemsize: int) -> tuple[int, _Config]:
    """``(N_SPLIT, config)`` of the dQ kernel: the head group is split over ``N_SPLIT`` programs when
    its float32 dQ accumulator would exceed ``_DQ_ACC_ELEMS`` (16K: 64 registers per thread at 8 warps).

    GLM-5.3-Flash (64 heads x 512): one program per query held a [64, 512] dQ accumulator beside the
    resident Q and dO tiles and spilled 1.5 KB per thread at 8 warps (255 registers, sm_90, bf16); two
    programs of 32 heads compile to 174 registers, no spill (mma.sync instead of wgmma, whose M is 64).
    """
    p2 = triton.next_power_of_2
    bg = max(16, p2(G))
    n_split = 1
    while bg > 16 and bg * max(16, p2(D)) > _DQ_ACC_ELEMS:
        bg //= 2
        n_split *= 2
    cfg = _query_major_config(bg, K, D, DV, itemsize, bg * (max(16, p2(D)) + max(16, p2(DV))) * itemsize)
    return n_split, cfg


def _key_major_config(G: int, D: int, DV: int, itemsize: int) -> tuple[int, int, _Config]:
    """``(GP, ROWS, config)`` of the key-major dK/dV kernel: ``GP`` the padded head group, ``ROWS``
    (query, head) rows per step.

    A step's Q and dO rows are dot operands twice (``S = Q K^T`` and ``dK += dS^T Q``, likewise dO),
    and Triton keeps a shared-memory copy per use: ``ROWS`` is the largest of 64, 32, 16 whose four
    copies stay within 160 KB (GLM-5.3-Flash, 512 + 512 bf16 columns: 32 rows, half a query's heads;
    64 rows took 278,528 B). One stage: the row gathers are not pipelined through shared memory.
    """
    p2 = triton.next_power_of_2
    gp = p2(G)
    bd, bdv = max(16, p2(D)), max(16, p2(DV))
    rows = _DKV_ROWS
    while rows > 16 and 2 * rows * (bd + bdv) * itemsize > 160 * 1024:
        rows //= 2
    acc = _DKV_BLOCK_K * (bd + bdv)  # dK and dV accumulators (one, D wide, when v is k)
    return gp, rows, _Config(gp, _DKV_BLOCK_K, bd, bdv, _warps(acc + rows * bd), 1)


def _dot_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype of the kernels' ``tl.dot`` operands for inputs of these dtypes.

    Any 16-bit input makes the dots 16-bit (tensor cores): the first 16-bit dtype among
    ``q, k, v`` (bf16-mixed training passes bf16 queries with a float32 latent out of an RMSNorm;
    the float32 side is rounded to bf16 as it is loaded). float32 (and float64, computed in
    float32 like the reference) otherwise.
    """
    for dt in dtypes:
        if dt in (torch.float16, torch.bfloat16):
            return dt
    return torch.float32


def _tl_dtype(dt: torch.dtype) -> tl.dtype:
    """The Triton dtype of a dot dtype."""
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dt]


#: ``input_precision`` of every ``tl.dot``: float32 dots stay IEEE (the CPU/test path and float32
#: runs, which ask for float32 accuracy: TF32 would round the operands to 10 mantissa bits and miss
#: the tests' 1e-5); 16-bit dots ignore it.
_PRECISION = "ieee"


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float, q_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel (``v is k``: one gather).

    Args:
        q, k, v: kernel dtypes (float16, bfloat16, float32), possibly mixed (see :func:`_dot_dtype`).
        indices, scale, q_offset: validated, as in :func:`sparse_attention_triton`.

    Returns:
        ``o [B, T, H, DV]`` in ``q.dtype`` and ``lse [B, T, H]`` float32 (``-inf`` for rows with no
        valid key).
    """
    B, T, H, D = q.shape
    HK, DV = k.shape[2], v.shape[3]
    G = H // HK
    topk = indices.shape[2]
    dot = _dot_dtype(q.dtype, k.dtype, v.dtype)
    o = torch.empty(B, T, H, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    bg, bd = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    cfg = _query_major_config(G, topk, D, DV, dot.itemsize, bg * bd * dot.itemsize)
    if B * T > 0:
        _sparse_attn_fwd_kernel[(B * T, HK)](
            q,
            k,
            v,
            indices,
            o,
            lse,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *indices.stride(),
            *o.stride(),
            *lse.stride(),
            T,
            topk,
            q_offset,
            scale,
            G=G,
            D=D,
            DV=DV,
            BLOCK_G=cfg.block_g,
            BLOCK_K=cfg.block_k,
            BLOCK_D=cfg.block_d,
            BLOCK_DV=cfg.block_dv,
            SHARED_KV=k is v,
            DOT=_tl_dtype(dot),
            PRECISION=_PRECISION,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return o, lse


class _KeyLists(NamedTuple):
    """The inverse of ``indices`` per key tile: which queries selected which keys of each tile.

    ``ent_t [E]`` query positions and ``ent_bits [E]`` int32 masks (bit ``j``: key
    ``tile * block_k + j`` selected, validly) of the ``E`` distinct (batch, key tile, query) triples,
    sorted by (batch, tile, query); ``counts [B * NT]`` entries per (batch, tile).
    """

    ent_t: torch.Tensor
    ent_bits: torch.Tensor
    counts: torch.Tensor


def _key_lists(indices: torch.Tensor, TK: int, q_offset: int, block_k: int) -> _KeyLists:
    """Sort the valid selected (query, key) pairs by key tile once (torch ops, on the indices' device).

    Args:
        indices: ``[B, T, K]`` selected positions (``-1`` and future positions are dropped).
        TK: number of keys; q_offset: position of query row 0; block_k: keys per tile (<= 31).
    """
    assert 1 <= block_k <= 31
    B, T, _ = indices.shape
    NT = triton.cdiv(TK, block_k)
    dev = indices.device
    # one sortable code per valid pair, ((b * NT + key // block_k) * T + t), computed in int32 when
    # it fits (half the temporaries of [B, T, K] and a faster sort)
    code_dt = torch.int32 if B * NT * T < 2**31 else torch.int64
    # validity on the indices as given (a cast first could wrap a huge int64 into a valid position)
    valid = (indices >= 0) & (indices <= (q_offset + torch.arange(T, device=dev))[None, :, None])
    idx = indices.to(code_dt)
    t = torch.arange(T, device=dev, dtype=code_dt)
    b_tiles = torch.arange(B, device=dev, dtype=code_dt)[:, None, None] * NT
    codes = ((b_tiles + idx.div(block_k, rounding_mode="floor")) * T + t[None, :, None])[valid]
    bits = torch.bitwise_left_shift(
        torch.ones((), dtype=torch.int32, device=dev), (idx[valid] % block_k).to(torch.int32)
    )
    uniq, inverse = torch.unique(codes, sorted=True, return_inverse=True)
    # integer sums of distinct powers of two (indices are distinct within a row): exact, any order
    ent_bits = torch.zeros(uniq.numel(), dtype=torch.int32, device=dev).scatter_add_(0, inverse, bits)
    uniq = uniq.long()
    counts = torch.bincount(uniq // T, minlength=B * NT)
    return _KeyLists((uniq % T).to(torch.int32), ent_bits, counts)


class _Segments(NamedTuple):
    """Programs of the key-major kernel: segment ``i`` walks entries ``start[i]:end[i]`` of the global
    tile ``tile[i]`` (``b * NT + tile``); ``slot[i]`` is its partial-buffer slot (``-1``: the tile's only
    segment, stored directly). ``red_*``: the split tiles, their first slot and segment count."""

    tile: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    slot: torch.Tensor
    n_slots: int
    red_tile: torch.Tensor
    red_slot0: torch.Tensor
    red_n: torch.Tensor


def _segments(counts: torch.Tensor, segment: int) -> _Segments:
    """Split each non-empty tile's entry list into runs of at most ``segment`` entries."""
    dev = counts.device
    n_seg = (counts + segment - 1) // segment  # [B * NT], 0 for tiles nobody selected
    tiles = torch.arange(counts.numel(), device=dev)
    tile = torch.repeat_interleave(tiles, n_seg)
    first_seg = torch.cumsum(n_seg, 0) - n_seg
    j = torch.arange(tile.numel(), device=dev) - first_seg[tile]
    tile_start = torch.cumsum(counts, 0) - counts
    start = tile_start[tile] + j * segment
    end = torch.minimum(start + segment, (tile_start + counts)[tile])
    split = n_seg[tile] > 1
    slot = torch.where(split, torch.cumsum(split, 0) - 1, -1)
    red = n_seg > 1
    return _Segments(tile, start, end, slot, int(split.sum()), tiles[red], slot[first_seg[red]], n_seg[red])


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    q_offset: int,
    segment: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward: the query-major dQ kernel (it also writes ``delta``), then the key-major
    dK/dV kernel over the inverse index lists (and the reduction of split key tiles). Deterministic:
    no atomics; every sum runs in a fixed order.

    Args:
        q, k, v, indices, o: as given to and returned by :func:`_forward`.
        do: ``[B, T, H, DV]`` output gradient (any strides and float dtype; loaded as the dot dtype).
        lse: ``[B, T, H]`` float32 log-sum-exp of the forward.
        scale, q_offset: as in the forward.
        segment: longest query list of one key-major program (default: the module's
            ``_DKV_SEGMENT``, read at call time).

    Returns:
        ``dq [B, T, H, D]`` in ``q.dtype``, ``dk [B, TK, HK, D]`` in ``k.dtype``, ``dv [B, TK, HK, DV]``
        in ``v.dtype``; for ``v is k`` one tensor, returned as both, holds ``dK + dV``.
    """
    B, T, H, D = q.shape
    TK, HK, DV = k.shape[1], k.shape[2], v.shape[3]
    G = H // HK
    topk = indices.shape[2]
    shared = k is v
    dot = _dot_dtype(q.dtype, k.dtype, v.dtype)
    if not do.is_floating_point() or do.dtype not in KERNEL_DTYPES:
        do = do.to(q.dtype)
    dev = q.device
    dq = torch.empty(B, T, H, D, dtype=q.dtype, device=dev)
    delta = torch.empty(B, T, H, dtype=torch.float32, device=dev)
    # keys nobody selected get no gradient: the key-major programs store only the tiles they own
    dk = torch.zeros(B, TK, HK, D, dtype=k.dtype, device=dev)
    dv = dk if shared else torch.zeros(B, TK, HK, DV, dtype=v.dtype, device=dev)
    if B * T == 0:
        return dq, dk, dv
    n_split, cfg = _dq_config(G, topk, D, DV, dot.itemsize)
    tl_dot, prec = _tl_dtype(dot), _PRECISION
    _sparse_attn_bwd_dq_kernel[(B * T * n_split, HK)](
        q,
        k,
        v,
        indices,
        o,
        do,
        lse,
        dq,
        delta,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *indices.stride(),
        *o.stride(),
        *do.stride(),
        *lse.stride(),
        *dq.stride(),
        T,
        topk,
        q_offset,
        scale,
        G=G,
        D=D,
        DV=DV,
        BLOCK_G=cfg.block_g,
        BLOCK_K=cfg.block_k,
        BLOCK_D=cfg.block_d,
        BLOCK_DV=cfg.block_dv,
        SHARED_KV=shared,
        DOT=tl_dot,
        PRECISION=prec,
        N_SPLIT=n_split,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    assert delta.stride() == lse.stride()  # the kernels index both with lse's strides

    gp, rows, kcfg = _key_major_config(G, D, DV, dot.itemsize)
    lists = _key_lists(indices, TK, q_offset, kcfg.block_k)
    segs = _segments(lists.counts, _DKV_SEGMENT if segment is None else segment)
    NT = triton.cdiv(TK, kcfg.block_k)
    n_part = max(1, segs.n_slots)  # a valid pointer even when no tile is split
    part_k = torch.empty(n_part, HK, kcfg.block_k, kcfg.block_d, dtype=torch.float32, device=dev)
    part_v = part_k if shared else torch.empty(n_part, HK, kcfg.block_k, kcfg.block_dv, dtype=torch.float32, device=dev)
    if segs.tile.numel() > 0:
        _sparse_attn_bwd_dkv_kernel[(segs.tile.numel(), HK)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            part_k,
            part_v,
            segs.tile,
            segs.start,
            segs.end,
            segs.slot,
            lists.ent_t,
            lists.ent_bits,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *do.stride(),
            *lse.stride(),
            *dk.stride(),
            *dv.stride(),
            TK,
            NT,
            HK,
            scale,
            G=G,
            D=D,
            DV=DV,
            GP=gp,
            ROWS=rows,
            BLOCK_K=kcfg.block_k,
            BLOCK_D=kcfg.block_d,
            BLOCK_DV=kcfg.block_dv,
            SHARED_KV=shared,
            DOT=tl_dot,
            PRECISION=prec,
            num_warps=kcfg.num_warps,
            num_stages=kcfg.num_stages,
        )
    if segs.red_tile.numel() > 0:
        for part, grad, width, bw in ((part_k, dk, D, kcfg.block_d),) + (
            () if shared else ((part_v, dv, DV, kcfg.block_dv),)
        ):
            bc = min(bw, _DKV_REDUCE_COLS)
            _sparse_attn_dkv_reduce_kernel[(segs.red_tile.numel(), HK, bw // bc)](
                part,
                grad,
                segs.red_tile,
                segs.red_slot0,
                segs.red_n,
                *grad.stride(),
                TK,
                NT,
                HK,
                D=width,
                BLOCK_K=kcfg.block_k,
                BLOCK_D=bw,
                BLOCK_DC=bc,
                num_warps=4,
                num_stages=1,
            )
    return dq, dk, dv


def _kernel_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tensors the kernels load: inputs of a kernel dtype as they are (mixed dtypes are cast to
    the dot dtype inside the kernels, no copy), anything else (float64) as float32; ``v is k`` kept."""
    qc = q if q.dtype in KERNEL_DTYPES else q.float()
    kc = k if k.dtype in KERNEL_DTYPES else k.float()
    vc = kc if v is k else (v if v.dtype in KERNEL_DTYPES else v.float())
    return qc, kc, vc


class _SparseAttentionTriton(torch.autograd.Function):
    """Autograd wrapper: Triton forward (saves the lse) and Triton recomputing backward."""

    @staticmethod
    def forward(ctx, q, k, v, indices, scale, q_offset):  # type: ignore[override]
        qc, kc, vc = _kernel_inputs(q, k, v)
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
    and accumulations are float32; the dots take 16-bit operands when any of ``q, k, v`` is 16-bit
    (the others are rounded to it as they are loaded), IEEE float32 ones otherwise; the result is
    returned in ``q.dtype`` and each gradient in its input's dtype. The backward is deterministic
    (no atomics): repeated calls give bitwise equal gradients.

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
    check_runnable(
        _sparse_attn_fwd_kernel,
        "genolong.kernels.dsa.triton_attention",
        "sparse_attention_triton",
        "q, k, v and indices",
        q,
        k,
        v,
        indices,
    )
    sc = D**-0.5 if scale is None else float(scale)
    return _SparseAttentionTriton.apply(q, k, v, indices, sc, int(q_offset))
