"""Lightning indexer of DeepSeek Sparse Attention: blockwise causal top-k without a [T, T] matrix.

The score of key ``s`` for query ``t`` is (fla's convention, ``fla.ops.dsa.naive.naive_dsa_indexer``)::

    I[t, s] = sum_j w_idx[t, j] * act(scale * q_idx[t, j] . k_idx[s]),   act = ReLU, scale = DI ** -0.5

Keys are scored one ``[query_block, key_block]`` tile at a time and a running top-k is kept per
query, so peak memory is ``O(query_block * (key_block * HI + topk))`` on top of the inputs and the
``[B, T, topk]`` output: linear in T.

Tie-breaking (deterministic, on every device): among equal scores the lowest key position wins.
It is exact because each candidate is encoded as one int64 whose high 32 bits are an
order-preserving image of the float32 score and whose low 32 bits are ``2**32 - 1 - position``;
``torch.topk`` over these unique keys has a single answer whatever algorithm it uses.
(-0.0 is folded into +0.0 first, so ``w * ReLU(.)`` with negative ``w`` ties with +0.0.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["indexer_scores", "indexer_topk", "causal_topk"]

_LOW32 = 0xFFFFFFFF
_INVALID = torch.iinfo(torch.int64).min


def indexer_scores(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor | None,
    scale: float,
    activation: str | None = "relu",
) -> torch.Tensor:
    """Indexer scores of one tile, in float32.

    Args:
        q_idx: index queries ``[B, Tq, HI, DI]``.
        k_idx: index keys ``[B, Tk, DI]`` (one key per token, shared by all index heads).
        w_idx: per-head weights ``[B, Tq, HI]``; ``None`` sums the heads with weight 1.
        scale: multiplies ``q_idx . k_idx`` before the activation.
        activation: a ``torch.nn.functional`` name (default ``"relu"``) or ``None`` for identity.

    Returns:
        ``I``: ``[B, Tq, Tk]`` float32 (no causal mask applied).
    """
    B, Tq, HI, DI = q_idx.shape
    # z: [B, Tq * HI, Tk] -> [B, Tq, HI, Tk]; scale folded into the (small) query side
    z = torch.matmul((q_idx.float() * scale).reshape(B, Tq * HI, DI), k_idx.float().transpose(1, 2))
    z = z.view(B, Tq, HI, -1)
    if activation == "relu":
        z = z.relu_()
    elif activation is not None:
        z = getattr(F, activation)(z)
    if HI == 1:  # a view, not a reduction
        return z[:, :, 0] if w_idx is None else z[:, :, 0] * w_idx.float()
    if w_idx is None:
        return z.sum(2)
    # [B, Tq, 1, HI] @ [B, Tq, HI, Tk] -> [B, Tq, Tk]
    return torch.matmul(w_idx.float().unsqueeze(-2), z).squeeze(-2)


def _encode(scores: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Unique, order-preserving int64 keys: higher score first, then lower position."""
    s = scores.float() + 0.0  # folds -0.0 into +0.0
    bits = s.view(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    key = (bits << 32) | (_LOW32 - pos)
    if valid is not None:
        key = key.masked_fill(~valid, _INVALID)
    return key


def _key_score(key: torch.Tensor) -> torch.Tensor:
    """The float32 score encoded in a key (-inf for the invalid key)."""
    bits = (key >> 32).to(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return bits.view(torch.float32).masked_fill(key == _INVALID, float("-inf"))


def _decode(key: torch.Tensor) -> torch.Tensor:
    pos = _LOW32 - (key & _LOW32)
    return pos.masked_fill(key == _INVALID, -1)


def _tile_topk(s: torch.Tensor, k0: int, topk: int) -> torch.Tensor:
    """The best ``<= topk`` encoded keys of a score tile ``s`` [B, n, m] (``-inf`` = masked).

    A float top-k prefilter, then only the winners are encoded; if some row has a tie at the
    boundary (more than ``topk`` finite entries ``>=`` its ``topk``-th value), the whole tile is
    encoded and selected on the exact keys instead, so the rule "lowest position wins" holds.
    """
    m = s.shape[-1]
    if m <= topk:
        pos = torch.arange(k0, k0 + m, device=s.device)
        return _encode(s, pos, s > float("-inf"))
    vals, ii = s.topk(topk, dim=-1, sorted=False)
    kth = vals.amin(-1, keepdim=True)
    tie = (kth > float("-inf")) & ((s >= kth).sum(-1, keepdim=True) > topk)
    if bool(tie.any()):
        pos = torch.arange(k0, k0 + m, device=s.device)
        return _encode(s, pos, s > float("-inf")).topk(topk, dim=-1, sorted=False).values
    return _encode(vals, ii + k0, vals > float("-inf"))


def _sparse_candidates(s: torch.Tensor, thr: torch.Tensor, k0: int, topk: int) -> torch.Tensor | None:
    """Encoded keys of the tile entries that beat their row's threshold (``None`` if there are none).

    Returns ``[B, n, c]`` with ``c`` the largest per-row count (rows padded with the invalid key),
    all candidates kept, so no tie can be cut; if ``c > topk`` the best ``topk`` by exact key.
    """
    B, n, m = s.shape
    nz = (s > thr).view(B * n, m).nonzero()  # [N, 2], row-major
    N = nz.shape[0]
    if N == 0:
        return None
    row, col = nz[:, 0], nz[:, 1]
    counts = torch.bincount(row, minlength=B * n)
    c = int(counts.max().item())
    start = counts.cumsum(0) - counts
    rank = torch.arange(N, device=s.device) - start[row]
    buf = torch.full((B * n, c), _INVALID, dtype=torch.int64, device=s.device)
    buf[row, rank] = _encode(s.view(B * n, m)[row, col], col + k0, None)
    key = buf.view(B, n, c)
    if c > topk:
        key = key.topk(topk, dim=-1, sorted=False).values
    return key


def causal_topk(
    score_fn: Callable[[int, int, int, int], torch.Tensor],
    limit: torch.Tensor,
    num_keys: int,
    topk: int,
    block_size: int,
    query_block: int,
    batch: int,
    device: torch.device,
) -> torch.Tensor:
    """Blockwise running top-k over keys ``s <= limit[t]`` (internal engine, also used by KPool).

    Args:
        score_fn: ``score_fn(q0, q1, k0, k1) -> [B, q1 - q0, k1 - k0]`` float32 scores of a tile.
        limit: ``[T]`` int64, the last key position visible to each query (-1: none).
            Must be non-decreasing in t (true for causal masks and pooled causal masks).
        num_keys: number of key positions.
        topk: keys kept per query.
        block_size: keys scored per tile; query_block: queries per tile.
        batch: B; device: where to compute.

    Returns:
        indices ``[B, T, topk]`` int64, best first (ties: lowest position), ``-1`` padded.
    """
    T = limit.shape[0]
    out = torch.full((batch, T, topk), -1, dtype=torch.int64, device=device)
    if topk == 0 or T == 0:
        return out
    for q0 in range(0, T, query_block):
        q1 = min(q0 + query_block, T)
        lim = limit[q0:q1]  # [n]
        kmax = int(lim.max().item()) + 1  # keys [0, kmax) are needed by this query block
        if kmax <= 0:
            continue
        kmin_full = int(lim.min().item()) + 1  # keys below this are visible to every query here
        run: torch.Tensor | None = None  # [B, n, <=topk] int64 keys
        # thr: the score of each row's topk-th kept key (-inf until a row holds topk valid keys).
        # Tiles come in increasing position order, so a later key must beat thr strictly: at an
        # equal score the kept key has the lower position. Most of a tile fails this cheap test.
        thr: torch.Tensor | None = None
        for k0 in range(0, kmax, block_size):
            k1 = min(k0 + block_size, kmax)
            s = score_fn(q0, q1, k0, k1)
            if k1 > kmin_full:  # tile crosses the causal boundary
                pos = torch.arange(k0, k1, device=device)
                s = s.masked_fill((pos[None, :] > lim[:, None])[None], float("-inf"))
            if thr is None:
                key = _tile_topk(s, k0, topk)
            else:
                key = _sparse_candidates(s, thr, k0, topk)
                if key is None:
                    continue
            cand_keys = key if run is None else torch.cat([run, key], dim=-1)
            if cand_keys.shape[-1] > topk:
                cand_keys = cand_keys.topk(topk, dim=-1, sorted=False).values
            run = cand_keys
            if run.shape[-1] == topk:
                thr = _key_score(run.amin(-1, keepdim=True))
        assert run is not None
        run = run.sort(dim=-1, descending=True).values
        out[:, q0:q1, : run.shape[-1]] = _decode(run)
    return out


def indexer_topk(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor | None,
    topk: int,
    block_size: int = 2048,
    query_block: int = 256,
    scale: float | None = None,
    activation: str | None = "relu",
) -> torch.Tensor:
    """Causal top-k key selection of the lightning indexer, blockwise (never a [T, T] matrix).

    ``I[t, s] = sum_j w_idx[t, j] * act(scale * q_idx[t, j] . k_idx[s])`` for ``s <= t``; the
    ``topk`` best keys per query are returned, best first. Ties: the lowest position wins.
    Matches ``fla.ops.dsa.naive.naive_dsa_indexer(..., activation='relu')`` (as ``naive_dsa``
    calls it) whenever the top-k set has no ties at its boundary. Runs without autograd (selection
    is not differentiable); the indexer learns through ``genolong.kernels.dsa.loss``.

    Args:
        q_idx: index queries ``[B, T, HI, DI]``.
        k_idx: index keys ``[B, T, DI]``.
        w_idx: per-head weights ``[B, T, HI]`` or ``None`` (equal weights). GLM-5.3-Flash folds
            an extra ``HI ** -0.5`` into these weights; that is the caller's business.
        topk: keys per query (e.g. 2048).
        block_size: keys per tile (default 2048).
        query_block: queries per tile (default 256). Peak extra memory is about
            ``B * query_block * (block_size * (HI + 3) + 2 * topk) * 4`` bytes.
        scale: default ``DI ** -0.5``.
        activation: ``"relu"`` (default, DSA) or another ``torch.nn.functional`` name, or None.

    Returns:
        indices ``[B, T, topk]`` int64 (torch indexing wants int64; cast to int32 to store
        half the bytes), ``-1`` where fewer than ``topk`` causal keys exist (rows ``t < topk - 1``).
    """
    if q_idx.dim() != 4 or k_idx.dim() != 3:
        raise ValueError(
            f"q_idx must be [B, T, HI, DI] and k_idx [B, T, DI]; got {tuple(q_idx.shape)} and {tuple(k_idx.shape)}"
        )
    B, T, HI, DI = q_idx.shape
    if k_idx.shape != (B, T, DI):
        raise ValueError(f"k_idx must have shape {(B, T, DI)} to match q_idx; got {tuple(k_idx.shape)}")
    if w_idx is not None and w_idx.shape != (B, T, HI):
        raise ValueError(f"w_idx must have shape {(B, T, HI)}; got {tuple(w_idx.shape)}")
    if topk < 1 or block_size < 1 or query_block < 1:
        raise ValueError(f"topk, block_size and query_block must be positive; got {topk}, {block_size}, {query_block}")
    if T >= 2**32 - 1:
        raise ValueError(f"sequence length {T} does not fit the 32-bit position field")
    sc = DI**-0.5 if scale is None else scale

    def score_fn(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        w = None if w_idx is None else w_idx[:, q0:q1]
        return indexer_scores(q_idx[:, q0:q1], k_idx[:, k0:k1], w, sc, activation)

    limit = torch.arange(T, device=q_idx.device)
    with torch.no_grad():
        return causal_topk(score_fn, limit, T, topk, block_size, query_block, B, q_idx.device)
