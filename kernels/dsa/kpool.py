"""KPool: GLM-5.3-Flash's pooled indexer keys (``transformers.models.glm5_next``, ``Glm5NextTextIndexer``).

The indexer keys of ``P = index_kpool`` consecutive tokens (default 16) are compressed into one
pooled key, the pools are scored by the lightning indexer, the best ``topk // P`` pools visible to
the query are expanded back into their ``P`` token positions, and the query's own incomplete pool
(the "tail", ``(t + 1) % P`` tokens) is always appended as raw tokens. Pools are aligned at
position 0 (no left padding in genome windows): pool ``j`` holds tokens ``[j * P, (j + 1) * P)``.

Pooling (per channel ``c`` of the index key)::

    a[j, i, c] = softmax_i( gate[j * P + i, c] + ape[i, c] )       # i = 0..P-1 inside pool j
    k_pool[j, c] = sum_i a[j, i, c] * k_idx[j * P + i, c]

with ``gate = hidden @ W_gate.T`` (``W_gate``: ``[DI, hidden]``, initialised to ones in glm5_next)
and ``ape``: ``[P, DI]`` (initialised to zeros), both learnable and owned by the model's module.
Only complete pools are pooled and scored; a pool is visible to query ``t`` iff its last token is
``<= t``, i.e. pools ``j < (t + 1) // P``.
"""

from __future__ import annotations

import torch

from .indexer import causal_topk, indexer_scores

__all__ = ["check_key_range", "kpool_keys", "kpool_topk", "kpool_expand"]


def kpool_keys(k_idx: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pooled index keys of the complete pools (differentiable w.r.t. all inputs).

    Args:
        k_idx: index keys ``[B, T, DI]`` (glm5_next: ``LayerNorm(wk(hidden))``).
        gate: gate logits ``[B, T, DI]`` (glm5_next: ``F.linear(hidden, index_kpool_compress_gate)``).
        ape: pool-position embedding ``[P, DI]`` added to the gate logits (``index_kpool_compress_ape``).

    Returns:
        ``[B, T // P, DI]`` pooled keys in ``k_idx.dtype`` (softmax in float32); the incomplete
        tail pool (``T % P`` tokens) is not pooled.
    """
    B, T, DI = k_idx.shape
    P = ape.shape[0]
    if gate.shape != k_idx.shape or ape.shape != (P, DI):
        raise ValueError(
            f"gate must be {tuple(k_idx.shape)} and ape [P, {DI}]; got {tuple(gate.shape)}, {tuple(ape.shape)}"
        )
    NP = T // P
    kk = k_idx[:, : NP * P].reshape(B, NP, P, DI)
    logits = gate[:, : NP * P].float().reshape(B, NP, P, DI) + ape.float()[None, None]
    a = logits.softmax(dim=2).to(k_idx.dtype)
    return (a * kk).sum(dim=2)


def kpool_expand(pool_indices: torch.Tensor, pool_size: int, tail: bool = True, q_offset: int = 0) -> torch.Tensor:
    """Expand selected pools into token positions and append each query's incomplete tail pool.

    Args:
        pool_indices: ``[B, T, KP]`` int64 selected pools (``-1`` = none), row ``i`` the query at
            global position ``t = q_offset + i``.
        pool_size: ``P``.
        tail: append the tail (glm5_next ``index_kpool_always_select_tail``, default True).
        q_offset: the first query's global position (default 0: the whole sequence).

    Returns:
        ``[B, T, KP * P + (P - 1 if tail else 0)]`` int64 token positions, ``-1`` padded: pool ``j``
        gives ``j * P, ..., j * P + P - 1`` (in the order of ``pool_indices``), then the tail
        ``t + 1 - r, ..., t`` with ``r = (t + 1) % P`` followed by ``P - 1 - r`` slots of ``-1``.
    """
    B, T, KP = pool_indices.shape
    P = pool_size
    offs = torch.arange(P, device=pool_indices.device)
    tok = pool_indices[..., None] * P + offs  # [B, T, KP, P]
    tok = tok.masked_fill(pool_indices[..., None] < 0, -1).reshape(B, T, KP * P)
    if not tail or P == 1:
        return tok
    t = torch.arange(q_offset, q_offset + T, device=pool_indices.device)  # global positions
    r = (t + 1) % P  # tokens in the query's incomplete pool
    offs = offs[: P - 1]
    tail_tok = (t + 1 - r)[:, None] + offs[None, :]  # [T, P - 1]
    tail_tok = tail_tok.masked_fill(offs[None, :] >= r[:, None], -1)
    return torch.cat([tok, tail_tok[None].expand(B, T, P - 1)], dim=-1)


def kpool_topk(
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
    """GLM-5.3-Flash selection: causal top-(topk // P) pooled keys, expanded to tokens, plus the tail.

    Pool ``j`` is scored as ``I[t, j] = sum_h w_idx[t, h] * act(scale * q_idx[t, h] . k_pool[j])``
    and is eligible for query ``t`` iff ``(j + 1) * P - 1 <= t``. Ties: the lowest pool wins.
    Blockwise over pools and queries (no [T, T / P] matrix).

    A range of queries (a context-parallel slice, a recompute segment) at global positions
    ``q_offset .. q_offset + T - 1`` selects over the pooled keys of positions ``0 .. TK - 1``
    (``TK >= q_offset + T``; pools past a query's causal limit are never read): row ``i`` equals
    row ``q_offset + i`` of the whole-sequence selection (the tiles hold other queries, but every
    score and the tie rule are per query).

    Args:
        q_idx: ``[B, T, HI, DI]``; k_pool: ``[B, NP, DI]`` from :func:`kpool_keys`
            (``NP >= (q_offset + T) // P``; ``T // P`` for the whole sequence).
        w_idx: ``[B, T, HI]`` or None. glm5_next multiplies its weights by ``HI ** -0.5``.
        topk: token budget (glm5_next ``index_topk``, 2048); must be divisible by ``pool_size``.
        pool_size: ``P`` (glm5_next ``index_kpool``, 16).
        tail: always append the query's incomplete pool (default True, as glm5_next).
        block_size: pools per tile (default 256); query_block: queries per tile (default 256).
        scale: default ``DI ** -0.5``; activation: default ``"relu"``.
        q_offset: the first query's global position (default 0).

    Returns:
        token indices ``[B, T, topk + P - 1]`` (``[B, T, topk]`` without tail) int64 global
        positions, ``-1`` padded; selected pools best first, then the tail.
    """
    B, T, HI, DI = q_idx.shape
    P = pool_size
    if P < 1 or topk % P != 0:
        raise ValueError(f"topk ({topk}) must be divisible by the pool size ({P}), as in glm5_next")
    check_key_range(k_pool, B, T, DI, P, q_offset)
    sc = DI**-0.5 if scale is None else scale

    def score_fn(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        w = None if w_idx is None else w_idx[:, q0:q1]
        return indexer_scores(q_idx[:, q0:q1], k_pool[:, k0:k1], w, sc, activation)

    limit = (torch.arange(q_offset, q_offset + T, device=q_idx.device) + 1) // P - 1  # last visible pool
    with torch.no_grad():
        pools = causal_topk(score_fn, limit, k_pool.shape[1], topk // P, block_size, query_block, B, q_idx.device)
    return kpool_expand(pools, P, tail, q_offset)


def check_key_range(k_pool: torch.Tensor, B: int, T: int, DI: int, P: int, q_offset: int) -> None:
    """The key-range check of :func:`kpool_topk` (and its Triton kernel): ``q_offset >= 0`` and
    ``k_pool [B, NP, DI]`` holding at least the pools queries ``q_offset .. q_offset + T - 1`` see.

    Raises:
        ValueError: a negative offset, or ``k_pool`` of another batch or width, or too few pools.
    """
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"q_offset must be an integer >= 0 (the first query's position); got {q_offset!r}")
    need = (q_offset + T) // P
    if k_pool.dim() != 3 or k_pool.shape[0] != B or k_pool.shape[2] != DI or k_pool.shape[1] < need:
        if q_offset == 0:
            want = f"[B, T // P, DI] = {(B, need, DI)}"
        else:
            want = f"[B, >= (q_offset + T) // P, DI] = [{B}, >= {need}, {DI}] (q_offset {q_offset})"
        raise ValueError(f"k_pool must be {want}; got {tuple(k_pool.shape)}")
