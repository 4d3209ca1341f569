"""Indexer KL loss of GLM-5.3-Flash's pooled-key (KPool) indexer, blockwise over queries.

The KPool indexer (:mod:`genolong.kernels.dsa.kpool`) scores complete pools of ``P = index_kpool``
tokens; query ``t`` keeps up to ``KP = index_topk // P`` eligible pools (pool ``j`` is eligible
iff its last token ``(j + 1) * P - 1 <= t``), expanded to their tokens, plus its own incomplete
tail pool ``tail(t) = [((t + 1) // P) * P, t]`` (``(t + 1) % P`` tokens), which is always attended
to and never scored. Let ``J(t)`` be the selected complete pools and
``S(t) = (union of the tokens of the pools in J(t)) + tail(t)`` the tokens sparse attention attends
to. With the main (NoPE MLA) attention's ``q [B, T, H, D]``, ``k [B, T, HK, D]`` (``H % HK == 0``,
key head ``h // (H / HK)``) and ``attn_scale`` (default ``D ** -0.5``)::

    a[t, h, s] = softmax_{s in S(t)} ( attn_scale * q[t, h] . k[s, h // G] )     (sparse attention's probabilities)
    m[t, j]    = (1 / H) * sum_h sum_{s in pool j} a[t, h, s]                     j in J(t)
    p[t, j]    = m[t, j] / sum_{j' in J(t)} m[t, j']                              (the tail's mass is dropped)

    I[t, j]    = sum_i w_idx[t, i] * relu( idx_scale * q_idx[t, i] . k_pool[j] )  (kpool_topk's score;
                                                                                  idx_scale default DI ** -0.5)
    KL_t       = sum_{j in J(t)} p[t, j] * ( log p[t, j] - log_softmax_{j' in J(t)}(I[t, j'])[j] )

    loss       = sum_{t : J(t) non-empty} KL_t  /  #{ (b, t) : J(t) non-empty }

Choices:

- The tail pool is excluded from both distributions (the indexer never scores it), and ``p`` is
  renormalised over ``J(t)`` after the head mean (each head's softmax still runs over all of
  ``S(t)``, tail included, exactly as sparse attention computes it).
- Queries with an empty ``J(t)`` (the first ``P - 1`` positions, or rows whose selection is all
  ``-1``) have no indexer distribution to train; they contribute nothing and are left out of the
  mean, so the loss scale does not depend on how many early positions a window has. A query with a
  single selected pool has ``KL_t = 0`` (both distributions are one-hot) and does count.
- ``q`` and ``k`` are constants (detached): gradients flow into ``q_idx``, ``k_pool`` (and through
  it into whatever pooled it: ``k_idx``, the gate and the pool-position embedding) and ``w_idx``.
- Entries of ``pool_indices`` that are ``-1`` or name a pool not eligible for the query are
  ignored. Pool ids must be distinct within a row (as :func:`kpool_select_pools` returns them).

Memory: queries are processed ``query_block`` at a time. For each block the target ``log p``
``[B, n, KP]`` is computed without autograd (main keys gathered for ``n * (KP * P + P - 1)`` tokens,
a few key heads at a time), then the indexer part runs under non-reentrant
:func:`torch.utils.checkpoint.checkpoint`, so autograd keeps only the block's inputs (slices of
``q_idx``/``w_idx``, the full ``k_pool`` by reference, and the ``[B, n, KP]`` target, in total
``B * T * KP`` floats, ``1 / (HI * DI / KP)`` of ``q_idx``) and the backward recomputes only the
indexer scores, never the main attention. Nothing of size ``[T, T]`` or ``[T, T // P]`` exists.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ...errors import InputError
from .indexer import causal_topk, indexer_scores

__all__ = [
    "kpool_indexer_kl_loss",
    "kpool_pool_ids",
    "kpool_select_pools",
    "reference_kpool_indexer_kl_loss",
    "reference_kpool_indexer_kl_rows",
]

_NEG = float("-inf")
# Upper bound on the elements of one gathered main-key tile (and of its score tile) when the
# target is computed: key heads are taken a few at a time so the gather stays ~64 MiB in float32.
_GATHER_ELEMS = 1 << 24


# ----------------------------------------------------------------------------- pool ids


def kpool_select_pools(
    q_idx: torch.Tensor,
    k_pool: torch.Tensor,
    w_idx: torch.Tensor | None,
    topk: int,
    pool_size: int,
    block_size: int = 256,
    query_block: int = 256,
    scale: float | None = None,
    activation: str | None = "relu",
) -> torch.Tensor:
    """The pools :func:`~genolong.kernels.dsa.kpool_topk` selects, as pool ids (before expansion).

    ``kpool_expand(kpool_select_pools(...), pool_size, tail)`` equals ``kpool_topk(..., tail=tail)``
    for the same arguments (same score, eligibility and tie rule: the lowest pool wins).

    Args:
        q_idx: ``[B, T, HI, DI]``; k_pool: ``[B, T // P, DI]``; w_idx: ``[B, T, HI]`` or None.
        topk: token budget (``index_topk``), divisible by ``pool_size``.
        pool_size: ``P`` (``index_kpool``).
        block_size: pools per tile (default 256); query_block: queries per tile (default 256).
        scale: default ``DI ** -0.5``; activation: default ``"relu"``.

    Returns:
        ``[B, T, topk // P]`` int64 pool ids, best first, ``-1`` padded (rows ``t < P - 1`` are all
        ``-1``). Runs without autograd.
    """
    if q_idx.dim() != 4:
        raise InputError(f"q_idx must be [B, T, HI, DI]; got {tuple(q_idx.shape)}")
    B, T, HI, DI = q_idx.shape
    P = pool_size
    if P < 1 or topk < P or topk % P != 0:
        raise InputError(f"topk ({topk}) must be a positive multiple of the pool size ({P}), as in glm5_next")
    if k_pool.shape != (B, T // P, DI):
        raise InputError(f"k_pool must be [B, T // P, DI] = {(B, T // P, DI)}; got {tuple(k_pool.shape)}")
    if w_idx is not None and w_idx.shape != (B, T, HI):
        raise InputError(f"w_idx must be [B, T, HI] = {(B, T, HI)}; got {tuple(w_idx.shape)}")
    sc = DI**-0.5 if scale is None else scale

    def score_fn(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        w = None if w_idx is None else w_idx[:, q0:q1]
        return indexer_scores(q_idx[:, q0:q1], k_pool[:, k0:k1], w, sc, activation)

    limit = (torch.arange(T, device=q_idx.device) + 1) // P - 1  # last eligible pool (-1: none)
    with torch.no_grad():
        return causal_topk(score_fn, limit, T // P, topk // P, block_size, query_block, B, q_idx.device)


def kpool_pool_ids(indices: torch.Tensor, pool_size: int, tail: bool = True) -> torch.Tensor:
    """Recover the selected pool ids from expanded token indices (the output of ``kpool_topk``).

    Args:
        indices: ``[B, T, KP * P + (P - 1 if tail and P > 1 else 0)]`` token positions in the
            layout of :func:`~genolong.kernels.dsa.kpool_expand` (each selected pool as ``P``
            consecutive slots ``j * P, ..., j * P + P - 1`` or ``P`` slots of ``-1``, then the tail).
            The layout is trusted, not checked (checking would synchronise with the device).
        pool_size: ``P``.
        tail: whether ``indices`` ends with the ``P - 1`` tail slots (default True, as ``kpool_topk``).

    Returns:
        ``[B, T, KP]`` int64 pool ids (``first token // P``), ``-1`` where the slot is empty.
    """
    P = pool_size
    if P < 1:
        raise InputError(f"pool_size must be >= 1; got {P}")
    if indices.dim() != 3:
        raise InputError(f"indices must be [B, T, K] token positions; got {tuple(indices.shape)}")
    B, T, K = indices.shape
    n_tail = P - 1 if tail else 0
    if K < n_tail or (K - n_tail) % P != 0:
        raise InputError(
            f"indices has {K} slots per query, not KP * {P} + {n_tail} (pool_size={P}, tail={tail}); "
            "pass the pool_size and tail used for the selection"
        )
    KP = (K - n_tail) // P
    first = indices[..., : KP * P].reshape(B, T, KP, P)[..., 0].long()
    return torch.where(first >= 0, torch.div(first, P, rounding_mode="floor"), torch.full_like(first, -1))


# ----------------------------------------------------------------------------- checks


def _check(q, k, q_idx, k_pool, w_idx, pool_indices, pool_size, query_block, activation, q_offset=0) -> None:
    if q_offset < 0:
        raise InputError(f"q_offset must be >= 0; got {q_offset}")
    if (
        q.dim() != 4
        or k.dim() != 4
        or q.shape[0] != k.shape[0]
        or k.shape[1] != q_offset + q.shape[1]
        or q.shape[3] != k.shape[3]
    ):
        raise InputError(
            f"q must be [B, T, H, D] and k [B, q_offset + T, HK, D] (q_offset {q_offset}); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}"
        )
    if q.shape[2] % k.shape[2] != 0:
        raise InputError(f"query heads ({q.shape[2]}) must be a multiple of key heads ({k.shape[2]})")
    B, T = q.shape[:2]
    if pool_size < 1:
        raise InputError(f"pool_size must be >= 1; got {pool_size}")
    if q_idx.dim() != 4 or q_idx.shape[:2] != (B, T):
        raise InputError(f"q_idx must be [B, T, HI, DI] = [{B}, {T}, HI, DI]; got {tuple(q_idx.shape)}")
    DI = q_idx.shape[3]
    TK = q_offset + T
    if k_pool.shape != (B, TK // pool_size, DI):
        raise InputError(
            f"k_pool must be [B, (q_offset + T) // pool_size, DI] = {(B, TK // pool_size, DI)} (complete pools "
            f"only, from kpool_keys); got {tuple(k_pool.shape)}"
        )
    if w_idx is not None and w_idx.shape != q_idx.shape[:3]:
        raise InputError(f"w_idx must be [B, T, HI] = {tuple(q_idx.shape[:3])}; got {tuple(w_idx.shape)}")
    if pool_indices.dim() != 3 or pool_indices.shape[:2] != (B, T):
        raise InputError(
            f"pool_indices must be [B, T, KP] = [{B}, {T}, KP] pool ids (use kpool_pool_ids on token "
            f"indices); got {tuple(pool_indices.shape)}"
        )
    if pool_indices.is_floating_point() or pool_indices.is_complex() or pool_indices.dtype == torch.bool:
        raise InputError(f"pool_indices must be an integer tensor; got {pool_indices.dtype}")
    if query_block < 1:
        raise InputError(f"query_block must be >= 1; got {query_block}")
    if activation not in ("relu", None):
        raise InputError(f"activation must be 'relu' or None; got {activation!r}")


def _compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when an input is float64 (low-precision inputs compute in float32)."""
    dt = torch.float32
    for x in xs:
        if x is not None:
            dt = torch.promote_types(dt, x.dtype)
    return dt


# ----------------------------------------------------------------------------- blockwise


def _block_log_target(
    q: torch.Tensor,
    k: torch.Tensor,
    pid: torch.Tensor,
    valid: torch.Tensor,
    q0: int,
    P: int,
    tail: bool,
    a_sc: float,
    dt: torch.dtype,
) -> torch.Tensor:
    """``log p`` of one query block (no autograd): ``[B, n, KP]``, ``-inf`` off the selection.

    q: ``[B, n, H, D]``; k: ``[B, T, HK, D]``; pid: ``[B, n, KP]`` pool ids (0 where not valid);
    valid: ``[B, n, KP]``. Computed in log space (log-sum-exp over heads and pool tokens), so a
    pool's mass never underflows to 0 and the renormalisation never divides 0 by 0.
    """
    B, n, H, D = q.shape
    HK = k.shape[2]
    G = H // HK
    KP = pid.shape[-1]
    dev = q.device
    offs = torch.arange(P, device=dev)
    tok = (pid[..., None] * P + offs).reshape(B, n, KP * P)
    tok_valid = valid[..., None].expand(B, n, KP, P).reshape(B, n, KP * P)
    if tail and P > 1:
        t = torch.arange(q0, q0 + n, device=dev)
        r = (t + 1) % P  # tokens in the query's incomplete pool
        tail_tok = (t + 1 - r)[:, None] + offs[None, : P - 1]  # [n, P - 1]
        tail_ok = offs[None, : P - 1] < r[:, None]
        tok = torch.cat([tok, tail_tok[None].expand(B, n, P - 1)], dim=-1)
        tok_valid = torch.cat([tok_valid, tail_ok[None].expand(B, n, P - 1)], dim=-1)
    tok = torch.where(tok_valid, tok, torch.zeros_like(tok))  # [B, n, K], in range everywhere
    K = tok.shape[-1]
    bidx = torch.arange(B, device=dev)[:, None, None]
    mask = ~tok_valid[:, :, None]  # [B, n, 1, K]
    logm = torch.full((B, n, KP), _NEG, dtype=dt, device=dev)
    hg = max(1, min(HK, _GATHER_ELEMS // max(1, B * n * K * max(D, G))))
    for h0 in range(0, HK, hg):
        h1 = min(h0 + hg, HK)
        ks = k[bidx, tok, h0:h1].to(dt)  # [B, n, K, h, D]
        qb = q[:, :, h0 * G : h1 * G].to(dt).reshape(B, n, h1 - h0, G, D)
        s = torch.einsum("bnhgd,bnkhd->bnhgk", qb, ks).reshape(B, n, (h1 - h0) * G, K) * a_sc
        s = s.masked_fill(mask, _NEG)
        lse = s.logsumexp(-1, keepdim=True)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # rows with no token
        la = (s - lse)[..., : KP * P].reshape(B, n, (h1 - h0) * G, KP, P)
        logm = torch.logaddexp(logm, la.logsumexp(dim=(2, 4)))  # the 1 / H cancels below
    has = valid.any(-1, keepdim=True)
    logm = logm.masked_fill(~valid, _NEG).masked_fill(~has, 0.0)
    return logm.log_softmax(-1).masked_fill(~valid, _NEG)


def _block_kl(
    q_idx: torch.Tensor,
    k_pool: torch.Tensor,
    w_idx: torch.Tensor | None,
    pid: torch.Tensor,
    valid: torch.Tensor,
    logp: torch.Tensor,
    i_sc: float,
    activation: str | None,
) -> torch.Tensor:
    """Sum of ``KL_t`` over the queries of one block (differentiable in q_idx, k_pool, w_idx).

    q_idx: ``[B, n, HI, DI]``; k_pool: ``[B, NP, DI]``; w_idx: ``[B, n, HI]`` or None;
    pid, valid, logp: ``[B, n, KP]`` (``logp`` the target, ``-inf`` off the selection).
    """
    B = q_idx.shape[0]
    dt = logp.dtype
    bidx = torch.arange(B, device=q_idx.device)[:, None, None]
    kp = k_pool[bidx, pid].to(dt)  # [B, n, KP, DI]
    z = torch.einsum("bnhd,bnkd->bnhk", q_idx.to(dt) * i_sc, kp)  # [B, n, HI, KP]
    if activation == "relu":
        z = torch.relu(z)
    i = z.sum(2) if w_idx is None else torch.matmul(w_idx.to(dt).unsqueeze(-2), z).squeeze(-2)  # [B, n, KP]
    has = valid.any(-1, keepdim=True)
    # rows without a selected pool get finite logits so that log_softmax (and its backward) stays finite
    logq = i.masked_fill(~valid, _NEG).masked_fill(~has, 0.0).log_softmax(-1)
    p = logp.exp()  # 0 off the selection
    term = p * (logp.masked_fill(~valid, 0.0) - logq.masked_fill(~valid, 0.0))
    return term.sum()


def kpool_indexer_kl_loss(
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
    """KPool indexer loss: mean over queries with a selected pool of ``KL(p || softmax(I))`` (see module doc).

    Args:
        q: main-attention queries ``[B, T, H, D]`` (detached here; no gradient).
        k: main-attention keys ``[B, T, HK, D]``, ``H % HK == 0`` (detached here; no gradient).
        q_idx: index queries ``[B, T, HI, DI]`` (``DSAIndexer.project``).
        k_pool: pooled index keys ``[B, T // P, DI]`` (complete pools only, ``kpool_keys``).
        w_idx: index head weights ``[B, T, HI]`` (``HI ** -0.5`` already folded in) or None (all 1).
        pool_indices: ``[B, T, KP]`` integer selected pool ids, ``-1`` padded (from
            :func:`kpool_select_pools`, or :func:`kpool_pool_ids` of ``kpool_topk``'s token indices).
        pool_size: ``P`` (``index_kpool``).
        attn_scale: main softmax scale, default ``D ** -0.5`` (the model passes ``qk_head_dim ** -0.5``).
        idx_scale: indexer scale, default ``DI ** -0.5``.
        query_block: queries per checkpointed block (default 64).
        tail: whether sparse attention also attends to the query's incomplete tail pool (default
            True, glm5_next ``index_kpool_always_select_tail``); it only changes the per-head
            softmax denominators of the target.
        activation: ``"relu"`` (default, as ``kpool_topk``) or None.
        q_offset: position of the first query (default 0): the queries are positions
            ``q_offset .. q_offset + T - 1`` and ``k`` / ``k_pool`` cover positions
            ``0 .. q_offset + T - 1`` (``[B, q_offset + T, HK, D]``, ``[B, (q_offset + T) // P, DI]``);
            ``pool_indices`` hold global pool ids. A context-parallel slice or a query segment
            scores its own queries only (the mean is over them).

    Returns:
        scalar loss, float32 (float64 when the indexer inputs are float64); 0 when no query
        selected a pool.
    """
    _check(q, k, q_idx, k_pool, w_idx, pool_indices, pool_size, query_block, activation, q_offset)
    B, T, H, D = q.shape
    P = pool_size
    a_sc = D**-0.5 if attn_scale is None else float(attn_scale)
    i_sc = q_idx.shape[-1] ** -0.5 if idx_scale is None else float(idx_scale)
    dt = _compute_dtype(q_idx, k_pool, w_idx)
    tdt = _compute_dtype(q, k)
    q, k = q.detach(), k.detach()
    if (q_offset + T) // P == 0:  # no complete pool anywhere: nothing to train, but keep the graph connected
        zero = torch.zeros((), dtype=dt, device=q.device)
        return sum((x.sum().to(dt) * 0 for x in (q_idx, k_pool, w_idx) if x is not None), zero)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q_idx, k_pool, w_idx))
    total = torch.zeros((), dtype=dt, device=q.device)
    count = torch.zeros((), dtype=dt, device=q.device)
    for q0 in range(0, T, query_block):
        q1 = min(q0 + query_block, T)
        pid = pool_indices[:, q0:q1].long()
        tq = torch.arange(q_offset + q0, q_offset + q1, device=q.device)
        valid = (pid >= 0) & ((pid + 1) * P - 1 <= tq[None, :, None])
        pid = torch.where(valid, pid, torch.zeros_like(pid))
        with torch.no_grad():
            logp = _block_log_target(q[:, q0:q1], k, pid, valid, q_offset + q0, P, tail, a_sc, tdt).to(dt)
        count = count + valid.any(-1).sum()
        args = (
            q_idx[:, q0:q1],
            k_pool,
            None if w_idx is None else w_idx[:, q0:q1],
            pid,
            valid,
            logp,
            i_sc,
            activation,
        )
        if needs_grad:
            total = total + checkpoint(_block_kl, *args, use_reentrant=False)
        else:
            total = total + _block_kl(*args)
    return total / count.clamp(min=1)


# ----------------------------------------------------------------------------- reference


def reference_kpool_indexer_kl_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_pool: torch.Tensor,
    w_idx: torch.Tensor | None,
    pool_indices: torch.Tensor,
    pool_size: int,
    attn_scale: float | None = None,
    idx_scale: float | None = None,
    tail: bool = True,
    activation: str | None = "relu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense oracle, per query: ``KL_t`` ``[B, T]`` and ``has_pool`` ``[B, T]`` bool (see module doc).

    Materialises the ``[B, H, T, T]`` attention and the ``[B, T, T // P]`` indexer scores and the
    selection as dense masks (built with Python loops); small inputs only. Same arguments as
    :func:`kpool_indexer_kl_loss`. ``KL_t`` is 0 on rows with ``has_pool`` False.
    """
    _check(q, k, q_idx, k_pool, w_idx, pool_indices, pool_size, 1, activation)
    B, T, H, D = q.shape
    HK, P = k.shape[2], pool_size
    NP = T // P
    a_sc = D**-0.5 if attn_scale is None else float(attn_scale)
    i_sc = q_idx.shape[-1] ** -0.5 if idx_scale is None else float(idx_scale)
    dt = _compute_dtype(q_idx, k_pool, w_idx)
    # selected complete pools J(t) as a dense mask
    sel = torch.zeros(B, T, NP, dtype=torch.bool)
    for b, rows in enumerate(pool_indices.tolist()):
        for t, row in enumerate(rows):
            for j in row:
                if j >= 0 and (j + 1) * P - 1 <= t:
                    sel[b, t, j] = True
    sel = sel.to(q.device)
    # S(t): the selected pools' tokens plus the tail [((t + 1) // P) * P, t]
    s_pos = torch.arange(T, device=q.device)
    toks = torch.zeros(B, T, T, dtype=torch.bool, device=q.device)
    toks[..., : NP * P] = sel.repeat_interleave(P, dim=-1)
    if tail:
        start = (s_pos + 1) // P * P
        toks |= ((s_pos[None, :] >= start[:, None]) & (s_pos[None, :] <= s_pos[:, None]))[None]
    # main attention, per head, over S(t); then the head mean
    qd = q.detach().to(dt)
    kd = k.detach().to(dt).repeat_interleave(H // HK, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", qd, kd) * a_sc
    a = scores.masked_fill(~toks[:, None], _NEG).softmax(-1).nan_to_num(0.0).mean(1)  # [B, T, T]
    m = a[..., : NP * P].reshape(B, T, NP, P).sum(-1) * sel
    p = m / m.sum(-1, keepdim=True).clamp_min(torch.finfo(dt).tiny)  # 0 rows stay 0
    # indexer distribution over J(t)
    z = torch.einsum("bthd,bjd->bthj", q_idx.to(dt), k_pool.to(dt)) * i_sc
    if activation == "relu":
        z = torch.relu(z)
    w = torch.ones(B, T, z.shape[2], dtype=dt, device=q.device) if w_idx is None else w_idx.to(dt)
    i = (w[..., None] * z).sum(2)  # [B, T, NP]
    has = sel.any(-1)
    logq = i.masked_fill(~sel, _NEG).masked_fill(~has[..., None], 0.0).log_softmax(-1)
    kl = torch.where(sel, torch.xlogy(p, p) - p * logq, torch.zeros_like(p)).sum(-1)
    return kl, has


def reference_kpool_indexer_kl_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_pool: torch.Tensor,
    w_idx: torch.Tensor | None,
    pool_indices: torch.Tensor,
    pool_size: int,
    attn_scale: float | None = None,
    idx_scale: float | None = None,
    tail: bool = True,
    activation: str | None = "relu",
) -> torch.Tensor:
    """Dense oracle of :func:`kpool_indexer_kl_loss` (same arguments, no ``query_block``).

    Returns:
        scalar: ``sum_t KL_t / max(1, #queries with a selected pool)`` from
        :func:`reference_kpool_indexer_kl_rows`.
    """
    kl, has = reference_kpool_indexer_kl_rows(
        q, k, q_idx, k_pool, w_idx, pool_indices, pool_size, attn_scale, idx_scale, tail, activation
    )
    return kl.sum() / has.sum().clamp(min=1).to(kl.dtype)
