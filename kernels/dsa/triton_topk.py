"""KPool indexer selection as a Triton kernel: pooled-key scores with a blockwise running top-k.

Same op as the torch reference :func:`genolong.kernels.dsa.kpool_topk` (same signature, checks and
result): pool ``j`` is scored for query ``t`` as

    I[t, j] = sum_h w_idx[t, h] * act(scale * q_idx[t, h] . k_pool[j])

and is eligible iff ``(j + 1) * P - 1 <= t``; the best ``KP = topk // P`` eligible pools per query
are kept (ties: the lowest pool wins), best first, then expanded into token positions plus the
query's incomplete tail pool by the torch :func:`~genolong.kernels.dsa.kpool_expand`.

Layout of the work. One program handles one (block of ``BLOCK_Q`` queries, batch row). It walks
the pools ``0 .. (q_last + 1) // P - 1`` its queries can see in tiles of ``BLOCK_N`` pools; per tile
and index head ``h`` one ``tl.dot`` gives ``q_idx[t, h] . k_pool[j]`` for the whole
``[BLOCK_Q, BLOCK_N]`` tile (the head loop keeps the dot's M side at ``BLOCK_Q`` whatever ``HI``
is), the activation and the head weight are applied and the heads summed in registers. No score
matrix ever reaches memory: the state of a program is the tile and a running buffer of
``BLOCK_K = next_power_of_2(KP)`` keys per query, i.e. ``O(BLOCK_Q * (BLOCK_N + BLOCK_K))``.

Exact running top-k in registers. Every candidate ``(score, pool j)`` is packed into one int64 key,
as the reference's ``_encode`` does: the high 32 bits hold an order-preserving image of the float32
score (``bits ^ 0x7FFFFFFF`` for negative floats; ``-0.0`` folded into ``+0.0`` first), the low 32
bits ``0x7FFFFFFF - j`` (here a non-negative int32, so ``j < 2**31``). Keys are unique per query and
their int64 order is "higher score first, then lower pool", so any exact top-k over them has one
answer. Ineligible pools (and padded slots) get ``INT64_MIN``, below every real key. Per tile the
kernel takes ``tl.topk(tile, BLOCK_K)`` (bitonic, sorted descending), interleaves it with the
running buffer (``tl.join``) and keeps ``tl.topk(.., BLOCK_K)`` of the ``2 * BLOCK_K`` candidates:
the buffer holds the exact top-``BLOCK_K`` of all pools seen so far, so its first ``KP`` keys are
the exact top-``KP`` (``BLOCK_K >= KP``; the extra slots only pad ``KP`` to a power of two).

Index mapping. The kernel decodes the final buffer in registers and writes int32 pool ids
``j = 0x7FFFFFFF - low32(key)`` into ``[B, T, KP]`` (``-1`` for the ``INT64_MIN`` key: fewer than
``KP`` eligible pools), best first; pool ``j`` is tokens ``[j * P, (j + 1) * P)``. The wrapper widens
them to int64 (torch indexing wants int64) and calls :func:`kpool_expand`, so the result is the
reference's ``[B, T, topk + P - 1]`` (``[B, T, topk]`` without tail) int64 token layout.

Scores and exactness. Tiles are loaded in one operand dtype (``triton_common.dot_dtype``): the
inputs' own (fp16/bf16/fp32; float64 is computed in float32 like the reference), or with a 16-bit
``q_idx`` and fp32 ``k_pool`` (the ``bf16-mixed`` autocast of a model with fp32 master weights:
the pooled keys come out of a LayerNorm in fp32) the 16-bit one, ``k_pool`` rounded to it as
autocast's matmul would round it, so that the dots run on tensor cores (fp32 operands would make
them IEEE FMA dots). The dot accumulates in float32 (IEEE, not TF32, for fp32 inputs); ``scale`` multiplies the float32 dot, the activation, the weights and the head sum run in
float32. The reference computes ``(scale * q) . k`` with ``torch.matmul`` and sums the heads with
another matmul: the two scores are both float32 roundings of the same sum, so the selections are
identical unless two candidates at the selection boundary lie within float32 rounding of each
other (then either may win); inputs whose scores are exact in float32 (the tests' dyadic grids)
give identical scores and therefore bitwise-identical selections, ties included.
Activations: ``"relu"`` (DSA's) and ``None`` (identity) are computed in the kernel; other names
are refused (use the torch backend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import InputError
from .kpool import check_key_range, kpool_expand
from .triton_common import check_runnable, dot_dtype

__all__ = ["kpool_topk_triton"]

# Tile bounds (powers of two). 16 is the smallest tl.dot operand side on GPUs. The pool tile is
# also at least BLOCK_K wide (the per-tile top-k must produce a full buffer's worth of keys).
_MIN_BLOCK = 16
_MAX_BLOCK_Q = 32  # the running buffer is [BLOCK_Q, BLOCK_K] int64 in registers
_MAX_BLOCK_N = 128
_ACTIVATIONS = ("relu", None)


@triton.jit
def _kpool_topk_kernel(
    Q,
    KPOOL,
    W,
    OUT,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kn,
    stride_kd,
    stride_wb,
    stride_wt,
    stride_wh,
    stride_ob,
    stride_ot,
    stride_ok,
    T,
    NP,
    Q_OFF,
    scale,
    HI: tl.constexpr,
    DI: tl.constexpr,
    P: tl.constexpr,
    KSEL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_W: tl.constexpr,
    RELU: tl.constexpr,
):
    """One program: query rows ``[q0, q0 + BLOCK_Q)`` of batch row ``b`` (global positions ``Q_OFF +
    row``); writes their int32 pool ids."""
    pid_q = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    q0 = pid_q * BLOCK_Q

    offs_q = q0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    offs_kk = tl.arange(0, BLOCK_K)
    mask_q = offs_q < T
    mask_d = offs_d < DI
    n_vis = (Q_OFF + offs_q + 1) // P  # pools j < n_vis[t] are eligible for the query of row t
    n_end = (Q_OFF + tl.minimum(q0 + BLOCK_Q, T)) // P  # pools this block needs (the last query sees most)

    # INT64_MIN: the key of "no pool", below every real key (the high half of a real key is the
    # image of a float32, at least -2**31 + 2**23 for any non-NaN score)
    invalid = tl.full([BLOCK_Q, BLOCK_K], -(2**63), tl.int64)
    run = invalid  # running exact top-BLOCK_K keys per query (any order until the first merge)

    q_rows = Q + b * stride_qb + offs_q[:, None].to(tl.int64) * stride_qt + offs_d[None, :] * stride_qd
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_ptrs = KPOOL + b * stride_kb + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd
        k = tl.load(k_ptrs, mask=(offs_n < NP)[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        kt = tl.trans(k)
        s = tl.zeros([BLOCK_Q, BLOCK_N], dtype=tl.float32)
        for h in range(HI):
            q = tl.load(q_rows + h * stride_qh, mask=mask_q[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_Q, BLOCK_D]
            z = tl.dot(q, kt, input_precision="ieee") * scale  # [BLOCK_Q, BLOCK_N] float32
            if RELU:
                z = tl.maximum(z, 0.0)
            if HAS_W:
                w = tl.load(W + b * stride_wb + offs_q.to(tl.int64) * stride_wt + h * stride_wh, mask=mask_q, other=0.0)
                z = z * w.to(tl.float32)[:, None]
            s += z
        # -0.0 -> +0.0 (an equal score must give an equal key); the +0.0 accumulator already does
        # it (+0 + -0 = +0), this keeps it true if the sum is ever reassociated
        s = tl.where(s == 0.0, 0.0, s)

        # pack (score, pool) into one int64 key: order-preserving float bits high, 0x7FFFFFFF - j low
        bits = s.to(tl.int32, bitcast=True)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        low = (0x7FFFFFFF - offs_n).to(tl.int64)
        key = (bits.to(tl.int64) << 32) | low[None, :]
        eligible = (offs_n[None, :] < n_vis[:, None]) & mask_q[:, None]
        key = tl.where(eligible, key, tl.full([BLOCK_Q, BLOCK_N], -(2**63), tl.int64))

        if BLOCK_N > BLOCK_K:
            tile_top = tl.topk(key, BLOCK_K)  # [BLOCK_Q, BLOCK_K], sorted descending
        else:
            tile_top = key  # BLOCK_N == BLOCK_K
        cand = tl.reshape(tl.join(run, tile_top), [BLOCK_Q, 2 * BLOCK_K])
        run = tl.topk(cand, BLOCK_K)  # exact: keys are unique per query

    # decode: low 32 bits (a non-negative int32) -> pool id; "no pool" -> -1. run is sorted
    # descending (best first) after any merge; without one it is all INT64_MIN.
    pool = 0x7FFFFFFF - run.to(tl.int32)
    pool = tl.where(run == invalid, -1, pool)
    out_ptrs = OUT + b * stride_ob + offs_q[:, None].to(tl.int64) * stride_ot + offs_kk[None, :] * stride_ok
    tl.store(out_ptrs, pool, mask=mask_q[:, None] & (offs_kk < KSEL)[None, :])


def _prev_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _blocks(ksel: int, di: int, block_size: int, query_block: int) -> tuple[int, int, int, int]:
    """Tile sizes ``(BLOCK_Q, BLOCK_N, BLOCK_D, BLOCK_K)``, all powers of two.

    ``BLOCK_K = next_power_of_2(ksel)``; the query and pool tiles are the largest powers of two not
    above ``query_block`` / ``block_size``, clamped to ``[16, 32]`` and ``[16, 128]`` (and the pool
    tile at least ``BLOCK_K``); ``BLOCK_D = max(16, next_power_of_2(DI))``, the padding masked.
    """
    p2 = triton.next_power_of_2
    bk = p2(ksel)
    bq = min(_MAX_BLOCK_Q, max(_MIN_BLOCK, _prev_pow2(query_block)))
    bn = max(bk, min(_MAX_BLOCK_N, max(_MIN_BLOCK, _prev_pow2(block_size))))
    return bq, bn, max(_MIN_BLOCK, p2(di)), bk


def _num_warps(bq: int, bn: int, bk: int) -> int:
    """Warps of a program: the merge holds ``[BLOCK_Q, 2 * BLOCK_K]`` int64 candidates next to the
    ``[BLOCK_Q, BLOCK_N]`` score tile; past 4,096 candidates (GLM-5.3-Flash and ``1b``: 32 queries x
    2 x 128 pools) 4 warps spill (255 registers, 650-720 B per thread on sm_90), 8 do not."""
    return 4 if bq * (2 * bk + bn) <= 4096 else 8


def _select_pools(
    q_idx: torch.Tensor,
    k_pool: torch.Tensor,
    w_idx: torch.Tensor | None,
    ksel: int,
    pool_size: int,
    block_size: int,
    query_block: int,
    scale: float,
    activation: str | None,
    q_offset: int = 0,
) -> torch.Tensor:
    """Launch the kernel on validated inputs: the selected pools as int32 ids.

    Args:
        q_idx: ``[B, T, HI, DI]`` (queries at positions ``q_offset ..``); k_pool: ``[B, NP, DI]``
            (``NP >= (q_offset + T) // P``); w_idx: ``[B, T, HI]`` or None.
        ksel: pools kept per query (``topk // P``, ``>= 1``).
        pool_size: ``P``; block_size, query_block: tile hints (see :func:`_blocks`).
        scale: multiplies ``q . k`` before the activation; activation: ``"relu"`` or None.
        q_offset: the first query's global position.

    Returns:
        ``[B, T, ksel]`` int32 pool ids, best first (ties: lowest pool), ``-1`` padded.
    """
    B, T, HI, DI = q_idx.shape
    NP = k_pool.shape[1]
    cdt = dot_dtype(q_idx, k_pool)  # bf16-mixed (bf16 q_idx, fp32 k_pool): the 16-bit side
    qc, kc = q_idx.to(cdt), k_pool.to(cdt)
    out = torch.empty(B, T, ksel, dtype=torch.int32, device=q_idx.device)
    bq, bn, bd, bk = _blocks(ksel, DI, block_size, query_block)
    w = w_idx if w_idx is not None else qc  # a placeholder pointer, never read (HAS_W=False)
    w_strides = w_idx.stride() if w_idx is not None else (0, 0, 0)
    if B * T > 0:
        _kpool_topk_kernel[(triton.cdiv(T, bq), B)](
            qc,
            kc,
            w,
            out,
            *qc.stride(),
            *kc.stride(),
            *w_strides,
            *out.stride(),
            T,
            NP,
            int(q_offset),
            float(scale),
            HI=HI,
            DI=DI,
            P=pool_size,
            KSEL=ksel,
            BLOCK_Q=bq,
            BLOCK_N=bn,
            BLOCK_D=bd,
            BLOCK_K=bk,
            HAS_W=w_idx is not None,
            RELU=activation == "relu",
            num_warps=_num_warps(bq, bn, bk),
        )
    return out


def kpool_topk_triton(
    q_idx: torch.Tensor,
    k_pool: torch.Tensor,
    w_idx: torch.Tensor | None,
    topk: int,
    pool_size: int,
    tail: bool = True,
    block_size: int = 256,
    query_block: int = 256,
    scale: float | None = None,
    activation: str | None = "relu",
    q_offset: int = 0,
) -> torch.Tensor:
    """GLM-5.3-Flash KPool selection as a Triton kernel: causal top-(topk // P) pools, expanded, plus the tail.

    The op of :func:`genolong.kernels.dsa.kpool_topk` (same arguments, checks and result):
    ``I[t, j] = sum_h w_idx[t, h] * act(scale * q_idx[t, h] . k_pool[j])`` over the pools with
    ``(j + 1) * P - 1 <= t``, the best ``topk // P`` kept (ties: the lowest pool wins), best first,
    expanded to their ``P`` token positions each, then the query's incomplete tail pool.
    Never materialises a ``[T, T / P]`` score matrix (see the module docstring).

    A range of queries at global positions ``q_offset .. q_offset + T - 1`` (a context-parallel
    slice, a recompute segment) selects over the pooled keys of positions ``0 .. TK - 1``
    (``TK >= q_offset + T``), as the reference does: row ``i`` is the whole sequence's row
    ``q_offset + i``.

    Args:
        q_idx: ``[B, T, HI, DI]`` index queries.
        k_pool: ``[B, NP, DI]`` pooled keys (:func:`~genolong.kernels.dsa.kpool_keys`),
            ``NP >= (q_offset + T) // P`` (``T // P`` for the whole sequence).
        w_idx: ``[B, T, HI]`` head weights or None (weight 1). glm5_next folds ``HI ** -0.5`` in.
        topk: token budget (glm5_next ``index_topk``, 2048); divisible by ``pool_size``.
        pool_size: ``P`` (glm5_next ``index_kpool``, 16).
        tail: append the query's incomplete pool (default True, as glm5_next).
        block_size: pools per tile (default 256): the kernel uses the largest power of two not above
            it, clamped to ``[16, 128]`` and at least ``next_power_of_2(topk // P)``.
        query_block: queries per program (default 256): the largest power of two not above it,
            clamped to ``[16, 32]`` (the running buffer lives in registers).
        scale: default ``DI ** -0.5``.
        activation: ``"relu"`` (default) or None (identity); others raise (use the torch backend).
        q_offset: the first query's global position (default 0).

    Returns:
        token indices ``[B, T, topk + P - 1]`` (``[B, T, topk]`` without tail) int64 global
        positions, ``-1`` padded;
        selected pools best first, then the tail. Computed without autograd.

    Raises:
        ValueError: the reference's checks (budget not divisible by ``P``, ``k_pool`` shape), same
            messages.
        InputError: checks the reference leaves to its matmuls or ``range`` (``q_idx`` rank, ``w_idx``
            shape, non-positive tiles), an activation the kernel lacks, tensors on several devices,
            or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if q_idx.dim() != 4:
        raise InputError(f"q_idx must be [B, T, HI, DI]; got {tuple(q_idx.shape)}")
    B, T, HI, DI = q_idx.shape
    P = pool_size
    # the reference's two checks, message for message (kernels/dsa/kpool.py::kpool_topk)
    if P < 1 or topk % P != 0:
        raise ValueError(f"topk ({topk}) must be divisible by the pool size ({P}), as in glm5_next")
    check_key_range(k_pool, B, T, DI, P, q_offset)
    if w_idx is not None and w_idx.shape != (B, T, HI):
        raise InputError(f"w_idx must be [B, T, HI] = {(B, T, HI)}; got {tuple(w_idx.shape)}")
    if topk < 0 or block_size < 1 or query_block < 1:
        raise InputError(
            f"topk must be >= 0 and block_size, query_block positive; got {topk}, {block_size}, {query_block}"
        )
    if activation not in _ACTIVATIONS:
        raise InputError(
            f"activation {activation!r} has no Triton kernel; use 'relu' or None, or kernel_backend 'torch'"
        )
    if k_pool.shape[1] >= 2**31 - 1 or q_offset + T >= 2**31 - 1:
        raise InputError(
            f"{k_pool.shape[1]} pools (positions up to {q_offset + T}) do not fit the kernel's 31-bit fields"
        )
    tensors = (q_idx, k_pool) if w_idx is None else (q_idx, k_pool, w_idx)
    check_runnable(
        _kpool_topk_kernel, "genolong.kernels.dsa.triton_topk", "kpool_topk_triton", "q_idx, k_pool and w_idx", *tensors
    )
    sc = DI**-0.5 if scale is None else scale
    ksel = topk // P
    with torch.no_grad():
        if ksel == 0:
            pools = torch.full((B, T, 0), -1, dtype=torch.int64, device=q_idx.device)
        else:
            pools = _select_pools(q_idx, k_pool, w_idx, ksel, P, block_size, query_block, sc, activation, q_offset)
        return kpool_expand(pools.long(), P, tail, q_offset)
