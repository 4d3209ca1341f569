"""DSA reference ops: indexer top-k, KPool, sparse attention, indexer KL loss (fla as oracle)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from genolong.kernels.dsa import (
    indexer_kl_loss_dense,
    indexer_kl_loss_sparse,
    indexer_scores,
    indexer_topk,
    kpool_expand,
    kpool_keys,
    kpool_topk,
    sparse_attention,
)
from genolong.kernels.testing import rms_ratio

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fla_naive = pytest.importorskip("fla.ops.dsa.naive")


def dense_causal_scores(q_idx, k_idx, w_idx, scale=None, activation="relu"):
    T = q_idx.shape[1]
    sc = q_idx.shape[-1] ** -0.5 if scale is None else scale
    s = indexer_scores(q_idx, k_idx, w_idx, sc, activation)
    return s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))


def brute_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k of a dense [B, T, T] score matrix, ties to the lowest position (stable sort)."""
    order = scores.sort(dim=-1, descending=True, stable=True)
    idx = order.indices[..., :topk].masked_fill(torch.isinf(order.values[..., :topk]), -1)
    if idx.shape[-1] < topk:
        idx = F.pad(idx, (0, topk - idx.shape[-1]), value=-1)
    return idx


# ---------------------------------------------------------------- indexer


@pytest.mark.parametrize("T,topk", [(63, 16), (500, 64), (1000, 100)])
def test_indexer_matches_fla(T, topk):
    torch.manual_seed(T)
    B, HI, DI = 2, 8, 16
    q_idx, k_idx = torch.randn(B, T, HI, DI), torch.randn(B, T, DI)
    w_idx = torch.randn(B, T, HI)
    ref = fla_naive.naive_dsa_indexer(q_idx, k_idx, w_idx, topk=topk, activation="relu")
    got = indexer_topk(q_idx, k_idx, w_idx, topk, block_size=128, query_block=96)
    assert got.shape == (B, T, topk) and got.dtype == torch.int64
    # rows with a tie at the top-k boundary (ReLU makes exact zeros) may differ legitimately
    s = dense_causal_scores(q_idx, k_idx, w_idx).sort(-1, descending=True).values
    tied = torch.zeros(B, T, dtype=torch.bool)
    if topk < T:
        tied = (s[..., topk - 1] == s[..., topk]) & torch.isfinite(s[..., topk])
    assert tied.float().mean() < 0.05
    same = (ref.sort(-1).values == got.sort(-1).values).all(-1)
    assert same[~tied].all()
    # -1 padding exactly where fewer than topk causal keys exist
    n_valid = (got >= 0).sum(-1)
    assert torch.equal(n_valid, torch.arange(T).clamp(max=topk - 1).add(1).expand(B, T))  # exact: counts
    # best first: the scores along the output never increase
    full = dense_causal_scores(q_idx, k_idx, w_idx)
    picked = full.gather(-1, got.clamp(min=0)).masked_fill(got < 0, float("-inf"))
    assert (picked[..., 1:] <= picked[..., :-1]).all()
    # where tied, the multiset of selected scores still matches
    ref_sc = full.gather(-1, ref.clamp(min=0)).masked_fill(ref < 0, float("-inf"))
    assert torch.equal(picked.sort(-1).values, ref_sc.sort(-1).values)  # exact: both gathered from `full`


@pytest.mark.parametrize("block_size,query_block", [(1, 7), (7, 1), (16, 33), (64, 64), (1000, 1000)])
def test_indexer_blockwise_equals_full(block_size, query_block):
    # small integers: exact scores in fp32 and many ties, so the tie rule is exercised too
    torch.manual_seed(0)
    B, T, HI, DI, topk = 2, 157, 3, 4, 20
    q_idx = torch.randint(-2, 3, (B, T, HI, DI)).float()
    k_idx = torch.randint(-2, 3, (B, T, DI)).float()
    w_idx = torch.randint(-1, 3, (B, T, HI)).float()
    full = indexer_topk(q_idx, k_idx, w_idx, topk, block_size=T, query_block=T, scale=1.0)
    got = indexer_topk(q_idx, k_idx, w_idx, topk, block_size=block_size, query_block=query_block, scale=1.0)
    assert torch.equal(got, full)  # exact: indices
    assert torch.equal(full, brute_topk(dense_causal_scores(q_idx, k_idx, w_idx, scale=1.0), topk))  # exact: indices


def test_indexer_tie_breaking_lowest_position():
    B, T, HI, DI, topk = 1, 12, 2, 4, 5
    # all scores equal (zero): the earliest positions win, in increasing order
    got = indexer_topk(torch.zeros(B, T, HI, DI), torch.randn(B, T, DI), None, topk, block_size=3, query_block=5)
    for t in range(T):
        n = min(t + 1, topk)
        assert got[0, t].tolist() == list(range(n)) + [-1] * (topk - n)
    # -0.0 (negative weight times ReLU zero) ties with +0.0; two equal positive scores: lower first
    q_idx = torch.zeros(B, T, 1, 1)
    q_idx[0, -1] = 1.0
    k_idx = torch.zeros(B, T, 1)
    k_idx[0, [3, 8]] = 2.0
    k_idx[0, [1, 6]] = -1.0  # ReLU -> 0, times w = -1 -> -0.0
    w = -torch.ones(B, T, 1)
    w[0, -1] = 1.0
    got = indexer_topk(q_idx, k_idx, w, 4, block_size=2, query_block=4, scale=1.0)
    assert got[0, -1].tolist() == [3, 8, 0, 1]


# ---------------------------------------------------------------- sparse attention


def _qkv(B, T, H, HK, D, DV, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    k = torch.randn(B, T, HK, D, generator=g, requires_grad=True)
    v = torch.randn(B, T, HK, DV, generator=g, requires_grad=True)
    return q, k, v


def _assert_forward_backward_close(ref: torch.Tensor, o: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> None:
    """``o`` equals ``ref``, and so do their gradients w.r.t. ``inputs`` for one random
    upstream gradient (RMS ratio < 1e-5)."""
    do = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, inputs, do)
    g = torch.autograd.grad(o, inputs, do)
    assert rms_ratio(ref, o) < 1e-5
    for a, b in zip(g, g_ref):
        assert rms_ratio(b, a) < 1e-5


@pytest.mark.parametrize("T,topk", [(63, 16), (500, 64), (1000, 100)])
def test_sparse_attention_matches_fla(T, topk):
    torch.manual_seed(T + 1)
    B, H, HK, D, DV, HI, DI = 2, 4, 2, 32, 16, 4, 16
    q, k, v = _qkv(B, T, H, HK, D, DV, T)
    q_idx, k_idx, w_idx = torch.randn(B, T, HI, DI), torch.randn(B, T, DI), torch.rand(B, T, HI)
    idx = indexer_topk(q_idx, k_idx, w_idx, topk)
    idx = idx.gather(-1, torch.rand(idx.shape).argsort(-1))  # order must not matter
    ref = fla_naive.naive_dsa(q, k, v, None, None, indices=idx)
    o = sparse_attention(q, k, v, idx.to(torch.int32), query_block=37)
    _assert_forward_backward_close(ref, o, (q, k, v))


@pytest.mark.parametrize("H,HK,D,DV", [(2, 2, 16, 16), (4, 1, 24, 8)])
def test_sparse_attention_full_topk_is_dense_causal(H, HK, D, DV):
    torch.manual_seed(H)
    B, T = 2, 77
    q, k, v = _qkv(B, T, H, HK, D, DV, 1)
    idx = indexer_topk(torch.randn(B, T, 2, 8), torch.randn(B, T, 8), None, topk=T + 5)
    o = sparse_attention(q, k, v, idx, query_block=16)
    kr, vr = (x.repeat_interleave(H // HK, dim=2) for x in (k, v))
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    _assert_forward_backward_close(ref, o, (q, k, v))


def test_sparse_attention_empty_rows_and_future_indices():
    B, T = 1, 9
    q, k, v = _qkv(B, T, 2, 1, 8, 8, 2)
    idx = torch.full((B, T, 3), -1)
    idx[0, 5] = torch.tensor([2, 7, -1])  # 7 > 5 is ignored, as in fla
    o = sparse_attention(q, k, v, idx)
    o.sum().backward()
    assert torch.isfinite(o).all() and torch.isfinite(q.grad).all()
    assert o[0, :5].abs().max() == 0 and torch.allclose(o[0, 5], v[0, 2].expand(2, 8))
    with pytest.raises(ValueError, match="multiple"):
        sparse_attention(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), idx[:, :4])


def test_sparse_attention_float64_inputs():
    B, T = 1, 11
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, T, 1, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(B, T, 1, 3, dtype=torch.float64, generator=g, requires_grad=True)
    idx = indexer_topk(torch.randn(B, T, 2, 4), torch.randn(B, T, 4), None, topk=5)
    # float64 inputs: computed in float32 like fla (which casts too), gradients returned as float64
    o = sparse_attention(q, k, v, idx, query_block=4)
    ref = fla_naive.naive_dsa(q, k, v, None, None, indices=idx)
    do = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        assert rms_ratio(b, a) < 1e-5


# ---------------------------------------------------------------- KPool


def test_kpool_keys_pooling():
    B, T, DI, P = 1, 11, 3, 4
    k = torch.randn(B, T, DI)
    # zero gate and ape: the plain mean of each complete pool; the tail (3 tokens) is not pooled
    pooled = kpool_keys(k, torch.zeros(B, T, DI), torch.zeros(P, DI))
    assert pooled.shape == (B, 2, DI)
    assert torch.allclose(pooled[0, 1], k[0, 4:8].mean(0))
    # a large position embedding on slot 2 selects that token of every pool, per channel
    ape = torch.zeros(P, DI)
    ape[2] = 50.0
    pooled = kpool_keys(k, torch.zeros(B, T, DI), ape)
    assert torch.allclose(pooled[0], k[0, [2, 6]], atol=1e-6)
    # the gate is per token and per channel
    gate = torch.zeros(B, T, DI)
    gate[0, 5, 1] = 50.0
    pooled = kpool_keys(k, gate, torch.zeros(P, DI))
    assert torch.allclose(pooled[0, 1, 1], k[0, 5, 1]) and torch.allclose(pooled[0, 1, 0], k[0, 4:8, 0].mean())


def test_kpool_expand_hand_case():
    P, T = 4, 10
    pools = torch.full((1, T, 3), -1)
    pools[0, 9] = torch.tensor([1, 0, -1])
    out = kpool_expand(pools, P)
    assert out.shape == (1, T, 3 * P + P - 1)
    assert out[0, 9].tolist() == [4, 5, 6, 7, 0, 1, 2, 3] + [-1] * 4 + [8, 9, -1]
    assert out[0, 2].tolist()[-3:] == [0, 1, 2]  # tail of 3 tokens
    assert out[0, 3].tolist()[-3:] == [-1, -1, -1]  # pool 0 complete at t = 3: no tail
    assert out[0, 4].tolist()[-3:] == [4, -1, -1]
    assert kpool_expand(pools, P, tail=False).shape == (1, T, 3 * P)


def _glm5_next_kpool_reference(q_idx, k_pool, w_idx, topk, P, scale):
    """Dense port of Glm5NextTextIndexer.forward's selection (no padding, no cache)."""
    B, T = q_idx.shape[:2]
    NP = k_pool.shape[1]
    scores = F.relu(torch.einsum("bthd,bpd->bthp", q_idx, k_pool) * scale)
    index_scores = torch.einsum("bth,bthp->btp", w_idx, scores)
    pool_end = torch.arange(NP) * P + P - 1
    visible = pool_end[None, :] <= torch.arange(T)[:, None]  # [T, NP]
    index_scores = index_scores.masked_fill(~visible[None], torch.finfo(index_scores.dtype).min)
    sel = index_scores.topk(min(topk // P, NP), dim=-1).indices
    sel = sel.masked_fill(~visible[None].expand(B, T, NP).gather(-1, sel), -1)
    return sel


def test_kpool_topk_matches_glm5_next_selection():
    torch.manual_seed(0)
    B, T, HI, DI, P, topk = 2, 203, 4, 8, 16, 64
    q_idx, k_idx, w_idx = torch.randn(B, T, HI, DI), torch.randn(B, T, DI), torch.randn(B, T, HI)
    k_pool = kpool_keys(k_idx, torch.randn(B, T, DI), torch.randn(P, DI))
    got = kpool_topk(q_idx, k_pool, w_idx, topk, P, block_size=3, query_block=50)
    assert got.shape == (B, T, topk + P - 1)
    ref_pools = _glm5_next_kpool_reference(q_idx, k_pool, w_idx, topk, P, DI**-0.5)
    ref = kpool_expand(F.pad(ref_pools, (0, topk // P - ref_pools.shape[-1]), value=-1), P)
    ok = (got.sort(-1).values == ref.sort(-1).values).all(-1)
    assert ok.float().mean() > 0.97  # rows that differ are ReLU-zero ties
    for t in range(T):
        row = got[0, t][got[0, t] >= 0]
        assert row.max() <= t and row.unique().numel() == row.numel()  # causal, distinct
        r = (t + 1) % P
        assert got[0, t, topk : topk + r].tolist() == list(range(t + 1 - r, t + 1))  # tail always in
        n_pools = min((t + 1) // P, topk // P)
        assert (got[0, t, :topk] >= 0).sum() == n_pools * P


def test_kpool_topk_rejects_bad_budget():
    with pytest.raises(ValueError, match="divisible"):
        kpool_topk(torch.randn(1, 32, 1, 4), torch.randn(1, 2, 4), None, 20, 16)


# ---------------------------------------------------------------- KL loss


def _direct_kl(q, k, q_idx, k_idx, w_idx, select=None, activation="relu"):
    B, T, H, D = q.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal[None] if select is None else causal[None] & select
    kr = k.detach().repeat_interleave(H // k.shape[2], dim=2)
    s = torch.einsum("bthd,bshd->bhts", q.detach(), kr) * D**-0.5
    p = s.masked_fill(~mask[:, None], float("-inf")).softmax(-1).mean(1)
    i = indexer_scores(q_idx, k_idx, w_idx, q_idx.shape[-1] ** -0.5, activation)
    logq = i.masked_fill(~mask, float("-inf")).log_softmax(-1)
    return (torch.xlogy(p, p) - p * logq.masked_fill(~mask, 0.0)).sum(-1).mean()


def _loss_inputs(B, T, H, HK, D, HI, DI, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, HK, D, generator=g)
    q_idx = torch.randn(B, T, HI, DI, generator=g, requires_grad=True)
    k_idx = torch.randn(B, T, DI, generator=g, requires_grad=True)
    w_idx = torch.randn(B, T, HI, generator=g, requires_grad=True)
    return q, k, q_idx, k_idx, w_idx


def test_kl_dense_matches_direct():
    q, k, q_idx, k_idx, w_idx = _loss_inputs(2, 45, 4, 2, 8, 3, 8, 0)
    ref = _direct_kl(q, k, q_idx, k_idx, w_idx)
    got = indexer_kl_loss_dense(q, k, q_idx, k_idx, w_idx, query_block=7, key_block=10)
    assert got.item() > 0 and abs(got.item() - ref.item()) < 1e-5 * ref.item()
    g_ref = torch.autograd.grad(ref, (q_idx, k_idx, w_idx))
    g = torch.autograd.grad(got, (q_idx, k_idx, w_idx))
    for a, b in zip(g, g_ref):
        assert rms_ratio(b, a) < 1e-5


def test_kl_sparse_matches_direct():
    B, T = 2, 45
    q, k, q_idx, k_idx, w_idx = _loss_inputs(B, T, 4, 2, 8, 3, 8, 1)
    idx = indexer_topk(q_idx.detach(), k_idx.detach(), w_idx.detach(), 9)
    select = torch.zeros(B, T, T + 1, dtype=torch.bool).scatter_(-1, idx.masked_fill(idx < 0, T), True)[..., :T]
    ref = _direct_kl(q, k, q_idx, k_idx, w_idx, select=select)
    got = indexer_kl_loss_sparse(q, k, q_idx, k_idx, w_idx, idx, query_block=8)
    assert abs(got.item() - ref.item()) < 1e-5 * ref.item()
    g_ref = torch.autograd.grad(ref, (q_idx, k_idx, w_idx))
    g = torch.autograd.grad(got, (q_idx, k_idx, w_idx))
    for a, b in zip(g, g_ref):
        assert rms_ratio(b, a) < 1e-5


def test_kl_zero_when_indexer_equals_attention():
    B, T, D = 1, 40, 8
    q, k = torch.randn(B, T, 1, D), torch.randn(B, T, 1, D)
    # one index head, weight 1, identity activation, same scale: I == the attention logits
    args = (q, k, q.clone().requires_grad_(), k[:, :, 0].clone().requires_grad_(), torch.ones(B, T, 1))
    dense = indexer_kl_loss_dense(*args, activation=None, query_block=8, key_block=8)
    assert abs(dense.item()) < 1e-6
    g = torch.autograd.grad(dense, args[2:4])
    assert max(x.abs().max().item() for x in g) < 1e-6
    idx = indexer_topk(q, k[:, :, 0], None, 7, activation=None)
    sparse = indexer_kl_loss_sparse(*args, idx, activation=None)
    assert abs(sparse.item()) < 1e-6


# ---------------------------------------------------------------- memory at 64k

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, torch
    from genolong.kernels.dsa import indexer_topk, sparse_attention
    torch.manual_seed(0)
    T = 65536
    q_idx, k_idx = torch.randn(1, T, 1, 16), torch.randn(1, T, 16)
    q = torch.randn(1, T, 2, 16, requires_grad=True)
    k = torch.randn(1, T, 1, 16, requires_grad=True)
    v = torch.randn(1, T, 1, 16, requires_grad=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    idx = indexer_topk(q_idx, k_idx, None, 64, block_size=4096, query_block=512)
    o = sparse_attention(q, k, v, idx, query_block=1024)
    o.square().sum().backward()
    ok = bool(torch.isfinite(q.grad).all() and (idx[0, -1] >= 0).all() and (idx[0, 10, 11:] == -1).all())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak, "ok": ok}))
    """
)


@pytest.mark.slow
def test_dsa_layer_64k_memory_is_linear():
    """Indexer + sparse attention fwd+bwd at T = 65,536: peak RSS growth far below 4 * T * T bytes."""
    T = 65536
    r = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["ok"]
    grown = res["peak"] - res["base"]
    # a [T, T] float32 matrix is 16 GiB; the whole call stays under 1/32 of it (512 MiB)
    assert grown < 4 * T * T / 32, f"DSA call grew RSS by {grown / 2**20:.0f} MiB"
