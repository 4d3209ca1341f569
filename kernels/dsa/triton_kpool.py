"""KPool (GLM-5.3-Flash's pooled indexer keys) as Triton kernels: key pooling and the indexer KL loss.

- :func:`kpool_keys_triton`: the op of :func:`genolong.kernels.dsa.kpool_keys`, forward and
  backward (this docstring).
- :func:`kpool_indexer_kl_loss_triton`: the op of :func:`genolong.kernels.dsa.kpool_indexer_kl_loss`
  (the target, the KL rows and their backward; see the comment above its kernels).

Key pooling: same op as the torch reference :func:`genolong.kernels.dsa.kpool.kpool_keys` (same signature,
shapes, validation and result): per complete pool ``j`` of ``P = ape.shape[0]`` tokens and per
channel ``c``::

    a[j, i, c]    = softmax_i( gate[j * P + i, c] + ape[i, c] )      # float32, i = 0..P-1
    k_pool[j, c]  = sum_i a[j, i, c] * k_idx[j * P + i, c]

The incomplete tail pool (``T % P`` tokens) is neither pooled nor differentiated (zero gradient).

Layout of the work. Forward: one program per (batch, pool, channel tile): the ``[P, BLOCK_C]``
tiles of ``gate``, ``ape`` and ``k_idx`` are loaded, the softmax runs over the ``P`` axis in
registers, the pooled row is stored. Nothing is saved but the inputs (``a`` is recomputed).

Backward (per pool, channel by channel; ``g = dout[j, c]``)::

    dk[j * P + i, c]    = a_i * g
    dgate[j * P + i, c] = a_i * (k_i * g - sum_i' a_i' * k_i' * g)   # the softmax Jacobian
    dape[i, c]          = sum over batch and pools of dgate[j * P + i, c]

``dape`` is a reduction over all ``B * T // P`` pools into one ``[P, DI]`` tensor. Float32 atomic
adds would make every program of the grid hit the same ``P * DI`` addresses (at T = 1M, P = 16,
65 536 pools per sequence serialised on 16 * DI words) and give a summation order that varies
between runs. Instead each backward program walks a chunk of ``_POOLS_PER_PROGRAM`` consecutive
pools, accumulates its ``[P, BLOCK_C]`` partial ``dape`` in float32 registers and stores it in its
own slot of a ``[B * n_chunks, P, DI]`` float32 buffer (``1 / _POOLS_PER_PROGRAM`` of the ``dgate``
traffic); a second reduction (``torch.sum`` over the slots) gives ``dape``. The result is
deterministic (fixed order) and contention-free.

Precision: every input is loaded in its own dtype and converted to float32 in registers (the
reference also computes the logits and softmax in float32); products and sums are float32 and
each result is rounded once to its output dtype. The reference rounds ``a`` to ``k_idx.dtype``
before the product, so for 16-bit inputs this kernel is at least as accurate. float64 inputs are
computed in float32 like the reference's softmax and returned in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kpool_loss import _check, _compute_dtype
from .triton_common import KERNEL_DTYPES, check_runnable, dot_dtype

__all__ = ["kpool_keys_triton", "kpool_indexer_kl_loss_triton"]

# Pools one backward program reduces into its partial dape (see the module doc).
_POOLS_PER_PROGRAM = 32


@triton.jit
def _kpool_fwd_kernel(
    K,
    G,
    A,
    O,
    stride_kb,
    stride_kt,
    stride_kc,
    stride_gb,
    stride_gt,
    stride_gc,
    stride_ap,
    stride_ac,
    stride_ob,
    stride_oj,
    stride_oc,
    NP,
    DI,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program: pool ``j`` of batch ``b``, channels ``[c0, c0 + BLOCK_C)``."""
    pid = tl.program_id(0)
    b = (pid // NP).to(tl.int64)
    j = (pid % NP).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_i = offs_i < P
    mask = mask_i[:, None] & (offs_c < DI)[None, :]
    tok = j * P + offs_i  # token rows of the pool

    g = tl.load(G + b * stride_gb + tok[:, None] * stride_gt + offs_c[None, :] * stride_gc, mask=mask, other=0.0)
    ap = tl.load(A + offs_i[:, None] * stride_ap + offs_c[None, :] * stride_ac, mask=mask, other=0.0)
    k = tl.load(K + b * stride_kb + tok[:, None] * stride_kt + offs_c[None, :] * stride_kc, mask=mask, other=0.0)
    # padded rows i >= P get -inf (weight 0); padded channels stay finite (all-0 logits, never stored)
    logit = tl.where(mask_i[:, None], g.to(tl.float32) + ap.to(tl.float32), float("-inf"))
    e = tl.exp(logit - tl.max(logit, axis=0)[None, :])
    a = e / tl.sum(e, axis=0)[None, :]
    out = tl.sum(a * k.to(tl.float32), axis=0)  # [BLOCK_C]
    tl.store(O + b * stride_ob + j * stride_oj + offs_c * stride_oc, out.to(O.dtype.element_ty), mask=offs_c < DI)


@triton.jit
def _kpool_bwd_kernel(
    K,
    G,
    A,
    DO,
    DK,
    DG,
    DA_PART,
    stride_kb,
    stride_kt,
    stride_kc,
    stride_gb,
    stride_gt,
    stride_gc,
    stride_ap,
    stride_ac,
    stride_dob,
    stride_doj,
    stride_doc,
    stride_dkb,
    stride_dkt,
    stride_dkc,
    stride_dgb,
    stride_dgt,
    stride_dgc,
    stride_pn,
    stride_pp,
    stride_pc,
    NP,
    DI,
    N_CHUNKS,
    POOLS_PER_PROGRAM,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program: pools ``[chunk * PPP, (chunk + 1) * PPP)`` of batch ``b``, one channel tile.

    Writes the dk and dgate rows of those pools and its partial dape to slot ``b * N_CHUNKS + chunk``.
    """
    pid = tl.program_id(0)
    b = (pid // N_CHUNKS).to(tl.int64)
    chunk = (pid % N_CHUNKS).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_i = offs_i < P
    mask_c = offs_c < DI
    mask_ic = mask_i[:, None] & mask_c[None, :]

    ap = tl.load(A + offs_i[:, None] * stride_ap + offs_c[None, :] * stride_ac, mask=mask_ic, other=0.0).to(tl.float32)
    dape = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for jj in range(0, POOLS_PER_PROGRAM):
        j = chunk * POOLS_PER_PROGRAM + jj
        tok = j * P + offs_i
        # the last chunk may run past the last pool (with i < P, tok < NP * P iff j < NP)
        mask = mask_ic & (tok < NP * P)[:, None]
        mask_do = mask_c & ((offs_c * 0 + j) < NP)
        g = tl.load(G + b * stride_gb + tok[:, None] * stride_gt + offs_c[None, :] * stride_gc, mask=mask, other=0.0)
        k = tl.load(
            K + b * stride_kb + tok[:, None] * stride_kt + offs_c[None, :] * stride_kc, mask=mask, other=0.0
        ).to(tl.float32)
        do = tl.load(DO + b * stride_dob + j * stride_doj + offs_c * stride_doc, mask=mask_do, other=0.0).to(
            tl.float32
        )  # [BLOCK_C]
        # recompute a exactly as the forward did
        logit = tl.where(mask_i[:, None], g.to(tl.float32) + ap, float("-inf"))
        e = tl.exp(logit - tl.max(logit, axis=0)[None, :])
        a = e / tl.sum(e, axis=0)[None, :]
        dk = a * do[None, :]
        # softmax backward: dlogit_i = a_i (x_i - sum_i' a_i' x_i') with x_i = k_i * dout
        x = k * do[None, :]
        dlogit = a * (x - tl.sum(a * x, axis=0)[None, :])
        dlogit = tl.where(mask, dlogit, 0.0)
        tl.store(
            DK + b * stride_dkb + tok[:, None] * stride_dkt + offs_c[None, :] * stride_dkc,
            dk.to(DK.dtype.element_ty),
            mask=mask,
        )
        tl.store(
            DG + b * stride_dgb + tok[:, None] * stride_dgt + offs_c[None, :] * stride_dgc,
            dlogit.to(DG.dtype.element_ty),
            mask=mask,
        )
        dape += dlogit
    slot = b * N_CHUNKS + chunk
    tl.store(DA_PART + slot * stride_pn + offs_i[:, None] * stride_pp + offs_c[None, :] * stride_pc, dape, mask=mask_ic)


def _blocks(P: int, DI: int) -> tuple[int, int]:
    """Tile sizes ``(BLOCK_P, BLOCK_C)``: powers of two; channels in tiles of at most 64."""
    p2 = triton.next_power_of_2
    return p2(P), min(64, p2(DI))


def _kernel_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if the kernels load its dtype, else a float32 copy."""
    return x if x.dtype in KERNEL_DTYPES else x.float()


def _forward(k_idx: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel on validated inputs (kernel dtypes, any strides).

    Returns:
        ``[B, T // P, DI]`` in ``k_idx.dtype``.
    """
    B, T, DI = k_idx.shape
    P = ape.shape[0]
    NP = T // P
    out = torch.empty(B, NP, DI, dtype=k_idx.dtype, device=k_idx.device)
    BP, BC = _blocks(P, DI)
    if B * NP * DI > 0:
        _kpool_fwd_kernel[(B * NP, triton.cdiv(DI, BC))](
            k_idx,
            gate,
            ape,
            out,
            *k_idx.stride(),
            *gate.stride(),
            *ape.stride(),
            *out.stride(),
            NP,
            DI,
            P=P,
            BLOCK_P=BP,
            BLOCK_C=BC,
        )
    return out


def _backward(
    k_idx: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernel (``a`` recomputed) and reduce the partial ``dape``.

    Args:
        k_idx, gate, ape: as given to :func:`_forward`.
        dout: ``[B, T // P, DI]`` gradient of the pooled keys (any strides, e.g. stride 0 of a sum).

    Returns:
        ``dk [B, T, DI]`` in ``k_idx.dtype``, ``dgate [B, T, DI]`` in ``gate.dtype`` (both 0 on the
        tail rows) and ``dape [P, DI]`` float32.
    """
    B, T, DI = k_idx.shape
    P = ape.shape[0]
    NP = T // P
    dk = torch.empty(B, T, DI, dtype=k_idx.dtype, device=k_idx.device)
    dgate = torch.empty(B, T, DI, dtype=gate.dtype, device=gate.device)
    # the tail pool takes no part in the output: its gradient is 0 (the kernel writes the rest)
    dk[:, NP * P :].zero_()
    dgate[:, NP * P :].zero_()
    ppp = _POOLS_PER_PROGRAM
    n_chunks = triton.cdiv(NP, ppp)
    part = torch.empty(B * n_chunks, P, DI, dtype=torch.float32, device=k_idx.device)
    BP, BC = _blocks(P, DI)
    if B * NP * DI > 0:
        _kpool_bwd_kernel[(B * n_chunks, triton.cdiv(DI, BC))](
            k_idx,
            gate,
            ape,
            dout,
            dk,
            dgate,
            part,
            *k_idx.stride(),
            *gate.stride(),
            *ape.stride(),
            *dout.stride(),
            *dk.stride(),
            *dgate.stride(),
            *part.stride(),
            NP,
            DI,
            n_chunks,
            ppp,
            P=P,
            BLOCK_P=BP,
            BLOCK_C=BC,
        )
    # the second reduction: one partial per (batch, chunk), summed in a fixed order
    dape = part.sum(0) if part.shape[0] > 0 else torch.zeros(P, DI, dtype=torch.float32, device=k_idx.device)
    return dk, dgate, dape


class _KPoolKeysTriton(torch.autograd.Function):
    """Autograd wrapper: Triton forward (saves only the inputs) and Triton recomputing backward."""

    @staticmethod
    def forward(ctx, k_idx, gate, ape):  # type: ignore[override]
        kc, gc, ac = _kernel_dtype(k_idx), _kernel_dtype(gate), _kernel_dtype(ape)
        out = _forward(kc, gc, ac)
        ctx.save_for_backward(kc, gc, ac)
        ctx.dtypes = (k_idx.dtype, gate.dtype, ape.dtype)
        return out.to(k_idx.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        kc, gc, ac = ctx.saved_tensors
        dk, dgate, dape = _backward(kc, gc, ac, dout)
        k_dt, g_dt, a_dt = ctx.dtypes
        return dk.to(k_dt), dgate.to(g_dt), dape.to(a_dt)


def kpool_keys_triton(k_idx: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pooled index keys of the complete pools as Triton kernels (differentiable w.r.t. all inputs).

    The op of :func:`genolong.kernels.dsa.kpool_keys` (same arguments, shapes, checks and result):
    ``k_pool[b, j, c] = sum_i softmax_i(gate[b, j * P + i, c] + ape[i, c]) * k_idx[b, j * P + i, c]``
    over the ``P`` tokens of pool ``j``, softmax in float32, complete pools only.

    Args:
        k_idx: index keys ``[B, T, DI]`` (glm5_next: ``LayerNorm(wk(hidden))``).
        gate: gate logits ``[B, T, DI]`` (glm5_next: ``F.linear(hidden, index_kpool_compress_gate)``).
        ape: pool-position embedding ``[P, DI]`` added to the gate logits (``index_kpool_compress_ape``).

    Returns:
        ``[B, T // P, DI]`` pooled keys in ``k_idx.dtype``; the incomplete tail pool (``T % P``
        tokens) is not pooled and gets zero gradient. Gradients come back in each input's dtype.

    Raises:
        ValueError: shapes as in the reference (same messages).
        InputError: tensors on different devices, or on CPU without ``TRITON_INTERPRET=1``.
    """
    # validation mirrors kernels/dsa/kpool.py::kpool_keys line for line (same exceptions)
    B, T, DI = k_idx.shape
    P = ape.shape[0]
    if gate.shape != k_idx.shape or ape.shape != (P, DI):
        raise ValueError(
            f"gate must be {tuple(k_idx.shape)} and ape [P, {DI}]; got {tuple(gate.shape)}, {tuple(ape.shape)}"
        )
    check_runnable(
        _kpool_fwd_kernel,
        "genolong.kernels.dsa.triton_kpool",
        "kpool_keys_triton",
        "k_idx, gate and ape",
        k_idx,
        gate,
        ape,
    )
    return _KPoolKeysTriton.apply(k_idx, gate, ape)


# ============================================================================ indexer KL loss
#
# The KPool indexer KL loss of kernels/dsa/kpool_loss.py::kpool_indexer_kl_loss in two kernels, one
# program per (batch, query) each.
#
# 1. Target (no gradient, ``q`` and ``k`` are constants): ``log p[t, j]`` over the selected
#    eligible pools ``J(t)``. For each key head the query's ``G`` heads score the selected pools'
#    tokens, ``BLOCK_J`` pools (``BLOCK_J * BLOCK_P`` gathered key rows) per tile, ``BLOCK_D``
#    channels at a time (a latent ``D`` of 512 never sits in registers whole). Pass 1 gives each
#    head's sparse-softmax denominator ``lse_h`` over all of ``S(t)`` (selected pools and the tail);
#    pass 2 re-scores the pools and takes ``log m[j] = logsumexp_{h, s in pool j} (S[h, s] - lse_h)``
#    (the 1 / H cancels); finally ``log p = log m - logsumexp_j log m``. Everything stays in log
#    space, as in the reference, so a pool's mass never underflows. Scores are recomputed in pass 2
#    rather than kept: per head and pool they would be ``[B, T, H, KP]`` floats. (Sparse attention's
#    saved lse is this ``lse_h``; passing it in would skip pass 1: left for when profiling asks.)
#    The dots run in one operand dtype with float32 accumulation (``dot_dtype``: the inputs' own,
#    or the 16-bit one when bf16-mixed autocast hands over bf16 queries and an fp32 latent, the
#    latent then rounded to it as autocast's matmul would): for 16-bit operands every product is
#    exact in float32 and the dots run on tensor cores; fp32 operands use IEEE dots.
# 2. KL rows (``BACKWARD`` constexpr: forward, or backward recomputing the scores). With
#    ``pre = idx_scale * q_idx[t] . k_pool[j]`` ``[HI, KP]``, ``z = relu(pre)``,
#    ``I = sum_h w[h] z[h]``, ``log q = log_softmax_{J(t)} I``::
#
#        KL_t          = sum_{j in J(t)} p_j (log p_j - log q_j)
#        dKL/dI_j      = q_j * sum_j' p_j' - p_j
#        dw[h]         = sum_j dI_j z[h, j]
#        dpre[h, j]    = idx_scale * w[h] * dI_j * [pre > 0]
#        dq_idx[t, h]  = sum_j dpre[h, j] k_pool[j]
#        dk_pool[j]   += sum_h dpre[h, j] q_idx[t, h]        (float32 atomic adds)
#
#    Only the ``[B, T, KP]`` float32 target is saved. ``dk_pool`` is scattered with atomics like
#    sparse attention's ``dK`` (a pool is selected by up to ``T`` queries; the adds commute, exact
#    up to float32 summation order, which on a GPU may vary between runs); a deterministic variant
#    needs the inverse lists pool -> queries. The scores' dot takes ``q_idx`` and ``k_pool`` in
#    one operand dtype (``dot_dtype``, as the target); the backward's two dots multiply the float32
#    ``dpre`` (a gradient, meant in float32 as in the reference) by the inputs widened to float32.
#    Float32 dots use ``tf32x3`` (three TF32 tensor-core products, the small x small term
#    dropped: float32-level error, ~1.6e-7 RMS relative at K = 64..512 against 1.4e-7 for IEEE
#    FMA and 2.9e-4 for one TF32 product, emulated in float64), not ``ieee``: FMA dots of these
#    tiles spilled 13-21 KB per thread at the 1b and GLM-5.3-Flash shapes.
#    ``num_warps`` and the backward's channel tile follow the ``[BLOCK_H, BLOCK_KP]`` score tile
#    (see ``_kl_rows_config``), so that nothing spills (benchmarks/gpu_compile.py checks it).
#
# float64 inputs are computed in float32 (the reference then computes in float64: agreement ~1e-7
# relative, not bitwise); the loss is returned in the reference's dtype. Helper device functions
# are avoided on purpose: under the interpreter each nested ``@triton.jit`` call re-patches
# triton.language (milliseconds a call).


@triton.jit
def _kl_target_kernel(
    Q,
    K,
    PID,
    LOGP,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_pb,
    stride_pt,
    stride_pk,
    stride_lb,
    stride_lt,
    stride_lk,
    T,
    KP,
    HK,
    D,
    Q_OFF,
    a_sc,
    G: tl.constexpr,
    P: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_KP: tl.constexpr,
):
    """One program: query ``t`` of batch ``b``; writes ``log p [KP]`` (``-inf`` off the selection)."""
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)  # the query's row; its global position is Q_OFF + t
    pos = Q_OFF + t
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_kp = tl.arange(0, BLOCK_KP)
    offs_u = tl.arange(0, BLOCK_J * BLOCK_P)  # the token rows of a tile of BLOCK_J pools
    u_j = offs_u // BLOCK_P  # pool slot within the tile
    u_i = offs_u % BLOCK_P  # token within the pool
    offs_jt = tl.arange(0, BLOCK_J)
    offs_tail = tl.arange(0, BLOCK_TAIL)
    mask_g = offs_g < G
    pid_row = PID + b * stride_pb + t * stride_pt
    pools = tl.load(pid_row + offs_kp * stride_pk, mask=offs_kp < KP, other=-1).to(tl.int64)
    valid = (pools >= 0) & ((pools + 1) * P - 1 <= pos)  # [BLOCK_KP]: selected and eligible
    if TAIL:
        n_tail = (pos + 1) % P  # tokens of the query's incomplete pool: pos + 1 - n_tail .. pos
    else:
        n_tail = (pos + 1) * 0
    tail_mask = offs_tail < n_tail
    tail_row = tl.where(tail_mask, pos + 1 - n_tail + offs_tail, 0)

    # Each loop below has its own variables: a name carried by a loop keeps one type and shape on
    # every iteration in compiled Triton (the interpreter does not check it), and the tail's
    # [BLOCK_G, BLOCK_TAIL] scores, a tile's [BLOCK_G, BLOCK_J * BLOCK_P] and the per-pool
    # [BLOCK_J] / per-row [BLOCK_KP] statistics all differ.
    logm = tl.full([BLOCK_KP], float("-inf"), dtype=tl.float32)
    for hk in range(0, HK):
        q_row = Q + b * stride_qb + t * stride_qt + (hk * G + offs_g)[:, None] * stride_qh
        k_head = K + b * stride_kb + hk * stride_kh
        # pass 1: lse_h over S(t); the tail first (masked rows are never read)
        s_tail = tl.zeros([BLOCK_G, BLOCK_TAIL], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            q = tl.load(q_row + dd[None, :] * stride_qd, mask=mask_g[:, None] & (dd < D)[None, :], other=0.0)
            kt_tail = tl.load(
                k_head + tail_row[:, None] * stride_kt + dd[None, :] * stride_kd,
                mask=tail_mask[:, None] & (dd < D)[None, :],
                other=0.0,
            )
            s_tail += tl.dot(q, tl.trans(kt_tail), input_precision="ieee")
        s_tail = tl.where(tail_mask[None, :], s_tail * a_sc, float("-inf"))
        mx_tail = tl.max(s_tail, axis=1)
        mxs_tail = tl.where(mx_tail == float("-inf"), 0.0, mx_tail)
        sum_tail = tl.sum(tl.exp(s_tail - mxs_tail[:, None]), axis=1)
        lse = tl.where(sum_tail > 0.0, mxs_tail + tl.log(tl.where(sum_tail > 0.0, sum_tail, 1.0)), float("-inf"))
        for j0 in range(0, KP, BLOCK_J):
            slot1 = j0 + u_j
            j1 = tl.load(pid_row + slot1 * stride_pk, mask=slot1 < KP, other=-1).to(tl.int64)
            tmask1 = (u_i < P) & (j1 >= 0) & ((j1 + 1) * P - 1 <= pos)
            row1 = tl.where(tmask1, j1 * P + u_i, 0)
            s1 = tl.zeros([BLOCK_G, BLOCK_J * BLOCK_P], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + offs_d
                q = tl.load(q_row + dd[None, :] * stride_qd, mask=mask_g[:, None] & (dd < D)[None, :], other=0.0)
                kt1 = tl.load(
                    k_head + row1[:, None] * stride_kt + dd[None, :] * stride_kd,
                    mask=tmask1[:, None] & (dd < D)[None, :],
                    other=0.0,
                )
                s1 += tl.dot(q, tl.trans(kt1), input_precision="ieee")
            s1 = tl.where(tmask1[None, :], s1 * a_sc, float("-inf"))
            # lse = logaddexp(lse, logsumexp_row(s1)), with -inf kept exact (no nan)
            mx1 = tl.maximum(lse, tl.max(s1, axis=1))
            mxs1 = tl.where(mx1 == float("-inf"), 0.0, mx1)
            sum1 = tl.exp(lse - mxs1) + tl.sum(tl.exp(s1 - mxs1[:, None]), axis=1)
            lse = tl.where(sum1 > 0.0, mxs1 + tl.log(tl.where(sum1 > 0.0, sum1, 1.0)), float("-inf"))
        lses = tl.where(lse == float("-inf"), 0.0, lse)
        # pass 2: per pool, logsumexp over the G heads and the P tokens of S - lse_h
        for j0 in range(0, KP, BLOCK_J):
            slot2 = j0 + u_j
            j2 = tl.load(pid_row + slot2 * stride_pk, mask=slot2 < KP, other=-1).to(tl.int64)
            tmask2 = (u_i < P) & (j2 >= 0) & ((j2 + 1) * P - 1 <= pos)
            row2 = tl.where(tmask2, j2 * P + u_i, 0)
            s2 = tl.zeros([BLOCK_G, BLOCK_J * BLOCK_P], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + offs_d
                q = tl.load(q_row + dd[None, :] * stride_qd, mask=mask_g[:, None] & (dd < D)[None, :], other=0.0)
                kt2 = tl.load(
                    k_head + row2[:, None] * stride_kt + dd[None, :] * stride_kd,
                    mask=tmask2[:, None] & (dd < D)[None, :],
                    other=0.0,
                )
                s2 += tl.dot(q, tl.trans(kt2), input_precision="ieee")
            la = tl.where(mask_g[:, None] & tmask2[None, :], s2 * a_sc - lses[:, None], float("-inf"))
            # [G, J * P] -> [J, G * P] (row-major reshape: token u = j * BLOCK_P + i): one reduction
            la = tl.reshape(
                tl.permute(tl.reshape(la, [BLOCK_G, BLOCK_J, BLOCK_P]), (1, 0, 2)), [BLOCK_J, BLOCK_G * BLOCK_P]
            )
            mx_j = tl.max(la, axis=1)  # [BLOCK_J]
            mxs_j = tl.where(mx_j == float("-inf"), 0.0, mx_j)
            sum_j = tl.sum(tl.exp(la - mxs_j[:, None]), axis=1)
            lm = tl.where(sum_j > 0.0, mxs_j + tl.log(tl.where(sum_j > 0.0, sum_j, 1.0)), float("-inf"))
            # place the tile's BLOCK_J values at slots j0 .. j0 + BLOCK_J - 1 of the row
            hit = (j0 + offs_jt)[:, None] == offs_kp[None, :]  # [BLOCK_J, BLOCK_KP]
            new = tl.max(tl.where(hit, lm[:, None], float("-inf")), axis=0)
            mx_kp = tl.maximum(logm, new)
            mxs_kp = tl.where(mx_kp == float("-inf"), 0.0, mx_kp)
            sum_kp = tl.exp(logm - mxs_kp) + tl.exp(new - mxs_kp)
            logm = tl.where(sum_kp > 0.0, mxs_kp + tl.log(tl.where(sum_kp > 0.0, sum_kp, 1.0)), float("-inf"))
    logm = tl.where(valid, logm, float("-inf"))
    mx_row = tl.max(logm, axis=0)
    mxs_row = tl.where(mx_row == float("-inf"), 0.0, mx_row)
    sum_row = tl.sum(tl.exp(logm - mxs_row), axis=0)  # 0 on rows with no pool (then unused)
    norm = mxs_row + tl.log(tl.where(sum_row > 0.0, sum_row, 1.0))
    logp = tl.where(valid, logm - norm, float("-inf"))
    tl.store(LOGP + b * stride_lb + t * stride_lt + offs_kp * stride_lk, logp, mask=offs_kp < KP)


@triton.jit
def _kl_rows_kernel(
    QI,
    KPOOL,
    W,
    PID,
    LOGP,
    KL,
    DKL,
    DQI,
    DKPOOL,
    DW,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kj,
    stride_kd,
    stride_wb,
    stride_wt,
    stride_wh,
    stride_pb,
    stride_pt,
    stride_pk,
    stride_lb,
    stride_lt,
    stride_lk,
    stride_gb,
    stride_gt,
    stride_dqb,
    stride_dqt,
    stride_dqh,
    stride_dqd,
    stride_dkb,
    stride_dkj,
    stride_dkd,
    stride_dwb,
    stride_dwt,
    stride_dwh,
    T,
    KP,
    HI,
    DI,
    P,
    Q_OFF,
    i_sc,
    HAS_W: tl.constexpr,
    RELU: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    BLOCK_DI: tl.constexpr,
):
    """One program: query ``t`` of batch ``b``. Forward: writes ``KL_t`` (0 without a selected pool)
    to ``KL [B, T]``. Backward: reads ``DKL``, writes the dq_idx and dw rows, scatters dk_pool."""
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)  # the query's row; its global position is Q_OFF + t
    offs_kp = tl.arange(0, BLOCK_KP)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_DI)
    mask_h = offs_h < HI
    pools = tl.load(PID + b * stride_pb + t * stride_pt + offs_kp * stride_pk, mask=offs_kp < KP, other=-1).to(tl.int64)
    valid = (pools >= 0) & ((pools + 1) * P - 1 <= Q_OFF + t)
    row = tl.where(valid, pools, 0)  # invalid slots are never read
    q_row = QI + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh
    kp_rows = KPOOL + b * stride_kb + row[:, None] * stride_kj

    # indexer scores of the selected pools
    pre = tl.zeros([BLOCK_H, BLOCK_KP], dtype=tl.float32)
    for d0 in range(0, DI, BLOCK_DI):
        dd = d0 + offs_d
        q = tl.load(q_row + dd[None, :] * stride_qd, mask=mask_h[:, None] & (dd < DI)[None, :], other=0.0)
        kp = tl.load(kp_rows + dd[None, :] * stride_kd, mask=valid[:, None] & (dd < DI)[None, :], other=0.0)
        # operands in the one dot dtype of the wrapper: 16-bit ones run on tensor cores as they
        # are; fp32 ones as 3xTF32 (tensor cores, float32-level error; see the comment above)
        pre += tl.dot(q, tl.trans(kp), input_precision="tf32x3")
    pre = pre * i_sc
    if RELU:
        z = tl.maximum(pre, 0.0)
    else:
        z = pre
    if HAS_W:
        w = tl.load(W + b * stride_wb + t * stride_wt + offs_h * stride_wh, mask=mask_h, other=0.0).to(tl.float32)
    else:
        w = tl.where(mask_h, 1.0, 0.0)
    i = tl.where(valid, tl.sum(w[:, None] * z, axis=0), float("-inf"))  # [BLOCK_KP]
    mx = tl.max(i, axis=0)
    mxs = tl.where(mx == float("-inf"), 0.0, mx)
    ssum = tl.sum(tl.exp(i - mxs), axis=0)  # 0 on rows with no pool (then unused)
    lse = mxs + tl.log(tl.where(ssum > 0.0, ssum, 1.0))
    logq = tl.where(valid, i - lse, 0.0)
    logp = tl.load(LOGP + b * stride_lb + t * stride_lt + offs_kp * stride_lk, mask=valid, other=0.0)
    logp = tl.where(valid, logp, 0.0)
    p = tl.where(valid, tl.exp(logp), 0.0)

    if not BACKWARD:
        tl.store(KL + b * T + t, tl.sum(p * (logp - logq), axis=0))
    else:
        g = tl.load(DKL + b * stride_gb + t * stride_gt)
        # d/dI of -sum_j p_j log q_j (a row without pools has p = 0 and gets no gradient)
        di = g * tl.where(valid, tl.exp(logq) * tl.sum(p, axis=0) - p, 0.0)  # [BLOCK_KP]
        if HAS_W:
            tl.store(
                DW + b * stride_dwb + t * stride_dwt + offs_h * stride_dwh, tl.sum(z * di[None, :], axis=1), mask=mask_h
            )
        dpre = w[:, None] * di[None, :]
        if RELU:
            dpre = tl.where(pre > 0.0, dpre, 0.0)
        dpre = dpre * i_sc  # [BLOCK_H, BLOCK_KP]
        for d0 in range(0, DI, BLOCK_DI):
            dd = d0 + offs_d
            mask_hd = mask_h[:, None] & (dd < DI)[None, :]
            mask_kd = valid[:, None] & (dd < DI)[None, :]
            q = tl.load(q_row + dd[None, :] * stride_qd, mask=mask_hd, other=0.0).to(tl.float32)
            kp = tl.load(kp_rows + dd[None, :] * stride_kd, mask=mask_kd, other=0.0).to(tl.float32)
            dq = tl.dot(dpre, kp, input_precision="tf32x3")  # [BLOCK_H, BLOCK_DI]
            tl.store(
                DQI + b * stride_dqb + t * stride_dqt + offs_h[:, None] * stride_dqh + dd[None, :] * stride_dqd,
                dq,
                mask=mask_hd,
            )
            dkp = tl.dot(tl.trans(dpre), q, input_precision="tf32x3")  # [BLOCK_KP, BLOCK_DI]
            tl.atomic_add(
                DKPOOL + b * stride_dkb + row[:, None] * stride_dkj + dd[None, :] * stride_dkd,
                dkp,
                mask=mask_kd,
                sem="relaxed",
            )


def _pow2_16(n: int) -> int:
    """The next power of two, at least 16 (the smallest ``tl.dot`` operand on GPUs)."""
    return max(16, triton.next_power_of_2(n))


def _kl_target(
    q: torch.Tensor, k: torch.Tensor, pools: torch.Tensor, P: int, tail: bool, a_sc: float, q_offset: int = 0
) -> torch.Tensor:
    """Launch the target kernel: ``log p`` ``[B, T, KP]`` float32, ``-inf`` off the selection.

    Args:
        q: ``[B, T, H, D]`` queries at positions ``q_offset ..``; k: ``[B, q_offset + T, HK, D]``
            (one kernel dtype, the dots' operand dtype).
        pools: ``[B, T, KP]`` int32/int64 global pool ids; P: pool size; tail: the tail enters the
            denominators; a_sc: the main softmax scale; q_offset: the first query's position.
    """
    B, T, H, D = q.shape
    HK = k.shape[2]
    G = H // HK
    KP = pools.shape[2]
    logp = torch.empty(B, T, KP, dtype=torch.float32, device=q.device)
    if B * T * KP == 0:
        return logp
    BP = triton.next_power_of_2(P)
    BJ = min(triton.next_power_of_2(KP), max(1, 64 // BP))  # <= 64 gathered key rows a tile ...
    BJ = max(BJ, 16 // BP)  # ... and >= 16 (tl.dot)
    _kl_target_kernel[(B * T,)](
        q,
        k,
        pools,
        logp,
        *q.stride(),
        *k.stride(),
        *pools.stride(),
        *logp.stride(),
        T,
        KP,
        HK,
        D,
        q_offset,
        a_sc,
        G=G,
        P=P,
        TAIL=bool(tail),
        BLOCK_G=_pow2_16(G),
        BLOCK_J=BJ,
        BLOCK_P=BP,
        BLOCK_TAIL=_pow2_16(P),
        BLOCK_D=min(64, _pow2_16(D)),
        BLOCK_KP=triton.next_power_of_2(KP),
    )
    return logp


def _kl_rows_config(HI: int, KP: int, DI: int, backward: bool) -> dict[str, int]:
    """Tiles and warps of the KL-rows kernel: ``BLOCK_H``, ``BLOCK_KP`` (powers of two, >= 16 for
    ``tl.dot``), the channel tile ``BLOCK_DI`` and ``num_warps``.

    A program holds the ``[BLOCK_H, BLOCK_KP]`` float32 scores (and, backward, their gradient) for
    the whole row, plus per channel tile the gathered ``[BLOCK_KP, BLOCK_DI]`` pooled keys and the
    ``dk_pool`` tile: the backward walks channels 16 at a time (64 forward), and 8 warps share a
    score tile of 2,048 entries or more (``1b``: 16 x 128 pools; GLM-5.3-Flash: 32 heads x 128), so
    that no register spills (benchmarks/gpu_compile.py, GLM-5.3-Flash backward on sm_90: 16
    channels and 8 warps 206 registers, no spill; 32 channels 560 B of spill; 16 warps cap the
    registers at 128 and spill 400-970 B; ``1b`` backward with 4 warps spilled 32-40 B).
    """
    bh, bkp = _pow2_16(HI), _pow2_16(KP)
    return dict(
        BLOCK_H=bh,
        BLOCK_KP=bkp,
        BLOCK_DI=min(16 if backward else 64, _pow2_16(DI)),
        num_warps=4 if bh * bkp < 2048 else 8,
    )


def _kl_rows(
    qc: torch.Tensor,
    kc: torch.Tensor,
    wc: torch.Tensor | None,
    pools: torch.Tensor,
    logp: torch.Tensor,
    P: int,
    i_sc: float,
    relu: bool,
    dkl: torch.Tensor | None = None,
    q_offset: int = 0,
):
    """Launch the KL-rows kernel (queries at positions ``q_offset ..``, ``kc`` the pools of positions
    ``0 .. q_offset + T - 1``): forward (``dkl`` None) -> ``kl [B, T]`` float32; backward ->
    ``(dq_idx [B, T, HI, DI], dk_pool [B, NP, DI], dw [B, T, HI] or None)`` float32."""
    B, T, HI, DI = qc.shape
    KP = pools.shape[2]
    f32 = dict(dtype=torch.float32, device=qc.device)
    backward = dkl is not None
    kl = torch.empty(B, T, **f32)
    if backward:
        dq = torch.empty(B, T, HI, DI, **f32)
        dkp = torch.zeros(kc.shape, **f32)  # the atomic scatter target: pools nobody selected get 0
        dw = None if wc is None else torch.empty(B, T, HI, **f32)
    else:
        dkl, dq, dkp, dw = kl, kl.view(B, T, 1, 1), kl.view(B, T, 1), None  # never touched
    w_arg, dw_arg = (qc if wc is None else wc), (dq if dw is None else dw)  # never touched without w
    w_strides = (0, 0, 0) if wc is None else wc.stride()
    dw_strides = (0, 0, 0) if dw is None else dw.stride()
    if B * T > 0:
        _kl_rows_kernel[(B * T,)](
            qc,
            kc,
            w_arg,
            pools,
            logp,
            kl,
            dkl,
            dq,
            dkp,
            dw_arg,
            *qc.stride(),
            *kc.stride(),
            *w_strides,
            *pools.stride(),
            *logp.stride(),
            *dkl.stride(),
            *dq.stride(),
            *dkp.stride(),
            *dw_strides,
            T,
            KP,
            HI,
            DI,
            P,
            q_offset,
            i_sc,
            HAS_W=wc is not None,
            RELU=relu,
            BACKWARD=backward,
            **_kl_rows_config(HI, KP, DI, backward),
        )
    return (dq, dkp, dw) if backward else kl


class _KPoolKLRowsTriton(torch.autograd.Function):
    """``KL_t`` ``[B, T]`` float32 from the indexer inputs and the fixed target; Triton both ways."""

    @staticmethod
    def forward(ctx, q_idx, k_pool, w_idx, pools, logp, P, i_sc, relu, q_offset):  # type: ignore[override]
        cdt = dot_dtype(q_idx, k_pool)  # the scores' dot operands (bf16-mixed: the 16-bit side)
        qc, kc = q_idx.to(cdt), k_pool.to(cdt)
        wc = None if w_idx is None else _kernel_dtype(w_idx)
        ctx.save_for_backward(qc, kc, wc, pools, logp)
        ctx.P, ctx.i_sc, ctx.relu, ctx.q_offset = P, i_sc, relu, q_offset
        ctx.dtypes = (q_idx.dtype, k_pool.dtype, None if w_idx is None else w_idx.dtype)
        return _kl_rows(qc, kc, wc, pools, logp, P, i_sc, relu, q_offset=q_offset)

    @staticmethod
    def backward(ctx, dkl):  # type: ignore[override]
        qc, kc, wc, pools, logp = ctx.saved_tensors
        dq, dkp, dw = _kl_rows(qc, kc, wc, pools, logp, ctx.P, ctx.i_sc, ctx.relu, dkl.float(), ctx.q_offset)
        q_dt, k_dt, w_dt = ctx.dtypes
        return dq.to(q_dt), dkp.to(k_dt), None if dw is None else dw.to(w_dt), None, None, None, None, None, None


def kpool_indexer_kl_loss_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_pool: torch.Tensor,
    w_idx: torch.Tensor | None,
    pool_indices: torch.Tensor,
    pool_size: int,
    attn_scale: float | None = None,
    idx_scale: float | None = None,
    query_block: int = 64,
    tail: bool = True,
    activation: str | None = "relu",
    q_offset: int = 0,
) -> torch.Tensor:
    """KPool indexer loss as Triton kernels: mean over queries with a selected pool of ``KL(p || softmax(I))``.

    The op of :func:`genolong.kernels.dsa.kpool_indexer_kl_loss` (same arguments, checks and
    result; see that module's doc for ``p``, ``I`` and the choices): one kernel computes the target
    ``log p`` per query without autograd (``q``, ``k`` are constants), another the KL rows and,
    recomputing, their gradients w.r.t. ``q_idx``, ``k_pool`` and ``w_idx`` (see the comment above
    the kernels). Memory: the ``[B, T, KP]`` float32 target is the only saved activation.

    Args:
        q: main-attention queries ``[B, T, H, D]`` (no gradient).
        k: main-attention keys ``[B, T, HK, D]``, ``H % HK == 0`` (no gradient).
        q_idx: index queries ``[B, T, HI, DI]``.
        k_pool: pooled index keys ``[B, T // P, DI]`` (from ``kpool_keys``).
        w_idx: index head weights ``[B, T, HI]`` or None (all 1).
        pool_indices: ``[B, T, KP]`` integer selected pool ids, ``-1`` padded, distinct within a row.
        pool_size: ``P``.
        attn_scale: main softmax scale, default ``D ** -0.5``.
        idx_scale: indexer scale, default ``DI ** -0.5``.
        query_block: validated (``>= 1``) like the reference's and otherwise ignored: each kernel
            program handles one query and nothing of size ``[T, KP * P]`` is materialised.
        tail: whether the query's incomplete tail pool enters the target's per-head softmax
            denominators (default True).
        activation: ``"relu"`` (default) or None.
        q_offset: position of the first query (default 0), as in the reference: the queries are
            positions ``q_offset .. q_offset + T - 1``, ``k`` and ``k_pool`` cover positions
            ``0 .. q_offset + T - 1`` and ``pool_indices`` hold global pool ids (a
            context-parallel slice or a recompute segment; the mean is over its own queries).

    Returns:
        scalar loss, float32 (float64 when the indexer inputs are float64, computed in float32);
        0 when no query selected a pool.

    Raises:
        InputError: shapes, dtypes and options as in the reference (same messages); tensors on
            different devices, or on CPU without ``TRITON_INTERPRET=1``.
    """
    _check(q, k, q_idx, k_pool, w_idx, pool_indices, pool_size, query_block, activation, q_offset)
    B, T, H, D = q.shape
    P = pool_size
    a_sc = D**-0.5 if attn_scale is None else float(attn_scale)
    i_sc = q_idx.shape[-1] ** -0.5 if idx_scale is None else float(idx_scale)
    dt = _compute_dtype(q_idx, k_pool, w_idx)
    if (q_offset + T) // P == 0:  # no complete pool anywhere: nothing to train, but keep the graph connected
        zero = torch.zeros((), dtype=dt, device=q.device)
        return sum((x.sum().to(dt) * 0 for x in (q_idx, k_pool, w_idx) if x is not None), zero)
    tensors = [q, k, q_idx, k_pool, pool_indices] + ([] if w_idx is None else [w_idx])
    check_runnable(
        _kpool_fwd_kernel,
        "genolong.kernels.dsa.triton_kpool",
        "kpool_indexer_kl_loss_triton",
        "q, k, q_idx, k_pool, w_idx and pool_indices",
        *tensors,
    )
    pools = pool_indices if pool_indices.dtype in (torch.int32, torch.int64) else pool_indices.long()
    # one operand dtype for the target's dots (bf16-mixed: the 16-bit side; see dot_dtype)
    cdt = dot_dtype(q, k)
    with torch.no_grad():
        logp = _kl_target(q.detach().to(cdt), k.detach().to(cdt), pools, P, tail, a_sc, q_offset)
    kl = _KPoolKLRowsTriton.apply(q_idx, k_pool, w_idx, pools, logp, P, i_sc, activation == "relu", q_offset)
    # a query with a selected eligible pool has a finite target somewhere in its row
    count = torch.isfinite(logp).any(-1).sum()
    return (kl.sum() / count.clamp(min=1)).to(dt)
