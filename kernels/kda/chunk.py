"""Chunked Kimi Delta Attention in plain torch (UT transform / WY representation), for CPU training.

Equal to :func:`genolong.kernels.kda.recurrent_kda` (the reference). Per chunk of ``C`` tokens with
in-chunk cumulative log decay ``G_t = g_1 + ... + g_t`` (per channel) and chunk-start state ``S0``:

    A[t, s]   = beta_t sum_d k_t[d] k_s[d] exp(G_t[d] - G_s[d])        (s < t)
    Aqk[t, s] =        sum_d q_t[d] k_s[d] exp(G_t[d] - G_s[d])        (s <= t)
    Tm        = (I + A)^{-1}                                            (unit lower triangular)
    u = Tm (beta v),  w = Tm (beta exp(G) k),  delta = u - w S0         (the delta-rule "new values")
    o         = (q exp(G)) S0 + Aqk delta
    S_next    = Diag(exp(G_C)) S0 + (k exp(G_C - G))^T delta = M S0 + U

Numerical safety: decay ratios are never formed as ``exp(G_t) * exp(-G_s)`` (that overflows in
float32 once a chunk sums below about -88, and the gate's lower bound allows -5 per step, -320 per
64-token chunk). ``A`` and ``Aqk`` and the inverse ``Tm`` are built bottom-up over a binary
hierarchy of blocks (sizes 1, 2, 4, ..., C): the off-diagonal quadrant of a block of size 2h is
``(x_t exp(G_t - G_m)) (k_s exp(G_m - G_s))^T`` with ``m`` the last position of the block's first
half, so every exponent is <= 0 for any g <= 0; at the same time the block inverse is merged as
``[[X1, 0], [L21, X2]]^{-1} = [[X1, 0], [-X2 L21 X1, X2]]`` (no ``solve_triangular``). Fast path:
when no 16-token sub-block has a decay spread above 80 (float32; always true for the lower-bound gate
g >= -5), each sub-block's matrices come from a single matmul around the sub-block's middle (factors
at most exp(80), finite; the discarded upper triangle is removed with ``tril``) and the hierarchy
starts at size 16; otherwise the general path above is used all the way down. Across
chunks only ``S <- M_n S + U_n`` is sequential (one batched matmul per chunk over ``unbind``-ed
chunks); outputs are formed after the loop in one batched product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .recurrent import check_kda_inputs, compute_dtype

__all__ = ["chunk_kda"]


# Largest in-sub-block decay spread max_d (G_first - G_last) for which the sub-block matrices may be
# formed as one factorised matmul around the sub-block's middle: every factor is then at most
# exp(spread) and the discarded upper-triangle products stay finite (float32 max ~ exp(88.7)).
_SAFE_SPREAD = {torch.float32: 80.0, torch.float64: 600.0}
_SUB_BLOCK = 16


def _lower_left_quadrants(M: torch.Tensor, h: int) -> torch.Tensor:
    """``M: [..., n, c, c]`` -> the lower-left ``h x h`` quadrants of its diagonal ``2h`` blocks,
    ``[..., n * c // (2h), h, h]`` in block order."""
    *lead, n, c, _ = M.shape
    nb = c // (2 * h)
    d = torch.diagonal(M.reshape(*lead, n, nb, 2 * h, nb, 2 * h), dim1=-4, dim2=-2)  # [..., n, 2h, 2h, nb]
    return d.movedim(-1, -3)[..., h:, :h].reshape(*lead, n * nb, h, h)


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, beta: torch.Tensor, gate_bound: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted in-chunk matrices, built bottom-up over blocks of size 1, 2, 4, ..., C.

    Args:
        q, k: ``[..., C, K]`` (q already scaled), ``C`` a power of two.
        G: in-chunk inclusive cumulative log decay ``[..., C, K]``.
        beta: ``[..., C]``.
        gate_bound: a bound ``b >= -g`` on every per-token log decay, or None (default). With it
            the fast-path choice is made on the host when ``(sub-block - 1) * b`` is below the safe
            spread (no read of the data, so no device-to-host sync); otherwise, or without it, the
            largest sub-block spread is read from the data (one sync).

    Returns:
        ``(Aqk, Tm)``, both ``[..., C, C]``: ``Aqk`` lower triangular with diagonal (q_t . k_t on
        it), ``Tm = (I + A)^{-1}`` with ``A`` the strictly lower beta-weighted key matrix.

    Blocks of size ``2h`` get their off-diagonal quadrant from exponents taken relative to the last
    position of the first half (all <= 0, safe for any g <= 0). Fast path: when every sub-block of
    ``_SUB_BLOCK`` tokens has a decay spread below ``_SAFE_SPREAD`` (always so for the lower-bound
    gate, g >= -5), the sub-block matrices come from one matmul around the sub-block's middle and
    the hierarchy starts at that size.
    """
    lead = q.shape[:-2]
    C, K = q.shape[-2:]
    c = min(_SUB_BLOCK, C)
    fast = False
    safe = _SAFE_SPREAD.get(G.dtype, 80.0)
    if c > 1 and gate_bound is not None and (c - 1) * gate_bound <= safe:
        # a sub-block's spread is the decay of its last c - 1 tokens: at most (c - 1) * bound
        fast = True
    elif c > 1:
        Gs = G.detach().reshape(*lead, C // c, c, K)
        spread = (Gs[..., 0, :] - Gs[..., -1, :]).max().item()
        fast = spread <= safe
    if fast:
        ns = C // c
        Gv = G.reshape(*lead, ns, c, K)
        Gr = Gv[..., c // 2 - 1 : c // 2, :]  # [..., ns, 1, K] middle of sub-block
        row = torch.exp(Gv - Gr).unsqueeze(-3)  # [..., ns, 1, c, K]
        col = torch.exp(Gr - Gv)  # [..., ns, c, K]
        rows = torch.stack([k.reshape(*lead, ns, c, K), q.reshape(*lead, ns, c, K)], dim=-3) * row
        full = rows.reshape(*lead, ns, 2 * c, K) @ (k.reshape(*lead, ns, c, K) * col).transpose(-1, -2)
        Akk_b, Aqk_b = full.reshape(*lead, ns, 2, c, c).unbind(-3)  # [..., ns, c, c]
        Akk_b = torch.tril(Akk_b, -1) * beta.reshape(*lead, ns, c, 1)
        Dqk = torch.tril(Aqk_b)  # [..., ns, c, c]
        X = torch.ones_like(q[..., :1]).reshape(*lead, C, 1, 1)
        h = 1
        while h < c:  # invert the sub-block diagonals
            nb = C // (2 * h)
            Okk = _lower_left_quadrants(Akk_b, h)  # [..., nb, h, h]
            X1, X2 = X.reshape(*lead, nb, 2, h, h).unbind(-3)
            X21 = -(X2 @ (Okk @ X1))
            X = torch.cat([F.pad(X1, (0, h)), torch.cat([X21, X2], dim=-1)], dim=-2)
            h *= 2
    else:
        # blocks of size 1: diagonal of Aqk is q_t . k_t (decay ratio exp(0) = 1); Tm diagonal is 1
        Dqk = (q * k).sum(-1).reshape(*lead, C, 1, 1)  # [..., nblocks, h, h]
        X = torch.ones_like(Dqk)
        h = 1
    while h < C:
        nb = C // (2 * h)
        # halves of each block of size 2h; unbind (not indexing) keeps backward to one stack
        G1, G2 = G.reshape(*lead, nb, 2, h, K).unbind(-3)  # [..., nb, h, K]
        k1, k2 = k.reshape(*lead, nb, 2, h, K).unbind(-3)
        q2 = q.reshape(*lead, nb, 2, h, K)[..., 1, :, :]
        Gm = G1[..., h - 1 : h, :]  # [..., nb, 1, K] last of first half
        row = torch.exp(G2 - Gm).unsqueeze(-3)  # [..., nb, 1, h, K]  exponent <= 0
        col = torch.exp(Gm - G1)  # [..., nb, h, K]     exponent <= 0
        rows = (torch.stack([k2, q2], dim=-3) * row).reshape(*lead, nb, 2 * h, K)
        off = rows @ (k1 * col).transpose(-1, -2)  # [..., nb, 2h, h]
        Okk, Oqk = off.reshape(*lead, nb, 2, h, h).unbind(-3)
        Okk = Okk * beta.reshape(*lead, nb, 2, h)[..., 1, :].unsqueeze(-1)  # L21 of (I + A)
        D1, D2 = Dqk.reshape(*lead, nb, 2, h, h).unbind(-3)
        X1, X2 = X.reshape(*lead, nb, 2, h, h).unbind(-3)
        X21 = -(X2 @ (Okk @ X1))  # [[X1,0],[L21,X2]]^-1 block
        Dqk = torch.cat([F.pad(D1, (0, h)), torch.cat([Oqk, D2], dim=-1)], dim=-2)
        X = torch.cat([F.pad(X1, (0, h)), torch.cat([X21, X2], dim=-1)], dim=-2)
        h *= 2
    return Dqk.reshape(*lead, C, C), X.reshape(*lead, C, C)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    *,
    gate_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention in chunked (UT transform / WY) form; equal to :func:`recurrent_kda`.

    Args:
        q: queries ``[B, T, H, K]`` (used as given; the layer L2-normalises them).
        k: keys ``[B, T, H, K]`` (used as given; the layer L2-normalises them).
        v: values ``[B, T, H, V]``; ``V`` may differ from ``K``.
        g: per-channel log decay ``[B, T, H, K]``, must be ``<= 0``; any strength is safe
            (e.g. the lower-bound gate's -5 per step).
        beta: delta-rule step sizes ``[B, T, H]``.
        scale: query scale; default ``K ** -0.5``.
        initial_state: state ``[B, H, K, V]`` before the first token; default zeros.
        output_final_state: return the state after the last token (else None). Default False.
        chunk_size: tokens per chunk, a power of two; default 64. Any ``T`` works (the tail chunk
            is padded internally with k = 0, beta = 0, g = 0, which leaves the state unchanged).
        gate_bound: keyword only, a known bound ``b >= -g`` (the lower-bound gate's ``-lower_bound``,
            5); default None. It only lets the in-chunk path be chosen without reading ``g`` back
            to the host (a device-to-host sync per call); the result is the same.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``v``'s dtype; ``final_state`` ``[B, H, K, V]``
        in the accumulation dtype (float32, or float64 for float64 inputs), or None.

    Differentiable with respect to q, k, v, g, beta and initial_state through autograd.
    """
    scale = check_kda_inputs(q, k, v, g, beta, scale, initial_state)
    if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a positive power of two (e.g. 64), got {chunk_size!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    cdt = compute_dtype(q.dtype)
    if T == 0:
        S0 = q.new_zeros(B, H, K, V, dtype=cdt)
        if initial_state is not None:
            S0 = S0 + initial_state.to(cdt)
        return v.new_zeros(B, 0, H, V), (S0 if output_final_state else None)

    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C
    BH = B * H

    def prep(x: torch.Tensor, mul: float | None = None) -> torch.Tensor:
        # [B, T, H, D] -> [B*H, N, C, D] in the compute dtype (zero-padded tail)
        x = x.to(cdt)
        if mul is not None:
            x = x * mul
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(BH, N, C, x.shape[-1])

    qc, kc, vc, gc = prep(q, scale), prep(k), prep(v), prep(g)
    bc = beta.to(cdt).transpose(1, 2)
    if pad:
        bc = F.pad(bc, (0, pad))
    bc = bc.reshape(BH, N, C)

    G = gc.cumsum(-2)  # [BH, N, C, K]
    Aqk, Tm = _intra_chunk(qc, kc, G, bc, gate_bound)  # [BH, N, C, C]
    bcol = bc.unsqueeze(-1)
    u = Tm @ (bcol * vc)  # [BH, N, C, V]
    w = Tm @ (bcol * torch.exp(G) * kc)  # [BH, N, C, K]
    # One chunk and no final state asked for: no state transition feeds anything, so none is
    # computed (that graph would never be differentiated, and a saved-tensor hook that keeps its
    # tensors, as a saved output's packing does, would then keep it for good).
    transitions = N > 1 or output_final_state
    if transitions:
        G_last = G[..., C - 1 :, :]  # [BH, N, 1, K]
        kd = (kc * torch.exp(G_last - G)).transpose(-1, -2)  # [BH, N, K, C]
        M = torch.diag_embed(torch.exp(G_last.squeeze(-2))) - kd @ w  # [BH, N, K, K] chunk transition
        U = kd @ u  # [BH, N, K, V]
    q_eff = qc * torch.exp(G) - Aqk @ w  # [BH, N, C, K] reads S0
    o_intra = Aqk @ u  # [BH, N, C, V]

    S = qc.new_zeros(BH, K, V)
    if initial_state is not None:
        S = S + initial_state.to(cdt).reshape(BH, K, V)
    starts: list[torch.Tensor] = []
    if transitions:
        for M_n, U_n in zip(M.transpose(0, 1).unbind(0), U.transpose(0, 1).unbind(0)):
            starts.append(S)
            S = torch.baddbmm(U_n, M_n, S)  # [BH, K, V]
    else:
        starts.append(S)
    S_start = torch.stack(starts, dim=1)  # [BH, N, K, V]
    o = q_eff @ S_start + o_intra  # [BH, N, C, V]
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)  # [B, T, H, V]
    final = S.reshape(B, H, K, V) if output_final_state else None
    return o.to(out_dtype), final
