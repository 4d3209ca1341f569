"""KPool indexer KL loss: the blockwise op against its dense oracle, its fixed points and its memory."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import genolong.kernels.dsa.kpool_loss as kpool_loss_mod
from genolong.errors import InputError
from genolong.kernels.dsa.kpool import kpool_expand, kpool_keys, kpool_topk
from genolong.kernels.dsa.kpool_loss import (
    kpool_indexer_kl_loss,
    kpool_pool_ids,
    kpool_select_pools,
    reference_kpool_indexer_kl_loss,
    reference_kpool_indexer_kl_rows,
)
from genolong.kernels.testing import rms_ratio

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(B, T, H, HK, D, HI, DI, P, dtype, seed, w=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, T, HK, D, generator=g, dtype=dtype)
    q_idx = torch.randn(B, T, HI, DI, generator=g, dtype=dtype).requires_grad_()
    k_pool = torch.randn(B, T // P, DI, generator=g, dtype=dtype).requires_grad_()
    w_idx = torch.randn(B, T, HI, generator=g, dtype=dtype).requires_grad_() if w else None
    return q, k, q_idx, k_pool, w_idx


def _random_pools(B, T, P, KP, seed):
    """Random selections: distinct eligible pools in random slots, -1 gaps, and some ineligible ids."""
    g = torch.Generator().manual_seed(seed)
    NP = T // P
    out = torch.full((B, T, KP), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            n_elig = (t + 1) // P
            m = min(n_elig, int(torch.randint(0, KP + 1, (1,), generator=g)))
            row = torch.full((KP,), -1, dtype=torch.int64)
            row[:m] = torch.randperm(n_elig, generator=g)[:m]
            if m < KP and torch.rand(1, generator=g) < 0.3:  # a pool not complete yet at t: ignored
                row[m] = n_elig + int(torch.randint(0, NP - n_elig + 3, (1,), generator=g))
            out[b, t] = row[torch.randperm(KP, generator=g)]
    return out


def _grads(loss, xs):
    return torch.autograd.grad(loss, [x for x in xs if x is not None], retain_graph=True)


@pytest.mark.parametrize(
    "T, P, KP, HK, query_block, tail, with_w",
    [
        (63, 4, 2, 2, 17, True, False),
        (200, 8, 4, 1, 64, False, True),
        (517, 4, 6, 4, 37, True, True),
    ],
)
def test_matches_reference_float64(T, P, KP, HK, query_block, tail, with_w):
    """Blockwise loss == dense oracle in float64 (rel 1e-10): forward and d/d(q_idx, k_pool, w_idx)."""
    q, k, q_idx, k_pool, w_idx = _inputs(2, T, 4, HK, 16, 3, 8, P, torch.float64, T, w=with_w)
    pools = _random_pools(2, T, P, KP, T)
    assert (pools >= 0).float().mean() < 0.9 and KP < (T // P) // 4  # padded, sparse selection
    ref = reference_kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, tail=tail)
    got = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, query_block=query_block, tail=tail)
    assert got.dtype == torch.float64
    assert ref.item() > 1e-3
    assert abs(got.item() - ref.item()) <= 1e-10 * ref.item()
    for a, b in zip(_grads(got, (q_idx, k_pool, w_idx)), _grads(ref, (q_idx, k_pool, w_idx))):
        assert b.abs().max() > 0
        assert rms_ratio(b, a) < 1e-10


def test_matches_reference_float32():
    """float32 blockwise loss (non-contiguous k) vs the float64 oracle on the same values: rel 1e-5."""
    B, T, P = 2, 517, 8
    q, k, q_idx, k_pool, w_idx = _inputs(B, T, 4, 2, 16, 3, 8, P, torch.float32, 1)
    k = torch.cat([k, torch.randn_like(k)], dim=-1).split([16, 16], dim=-1)[0]  # a view, as DSAMixer's k
    assert not k.is_contiguous()
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), 32, P)
    got = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, attn_scale=0.3)
    assert got.dtype == torch.float32
    x64 = [x.detach().double().requires_grad_() for x in (q_idx, k_pool, w_idx)]
    ref = reference_kpool_indexer_kl_loss(q.double(), k.double(), *x64, pools, P, attn_scale=0.3)
    assert abs(got.item() - ref.item()) <= 1e-5 * ref.item()
    for a, b in zip(_grads(got, (q_idx, k_pool, w_idx)), _grads(ref, x64)):
        assert rms_ratio(b, a) < 1e-5


def test_no_gradient_into_main_attention():
    """q and k of the main attention are constants: no grad reaches them, the indexer inputs get one."""
    B, T, P = 1, 63, 4
    q, k, q_idx, k_pool, w_idx = _inputs(B, T, 4, 2, 16, 3, 8, P, torch.float32, 2)
    q.requires_grad_()
    k.requires_grad_()
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), 12, P)
    kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, query_block=16).backward()
    assert q.grad is None and k.grad is None
    assert all(x.grad is not None and x.grad.abs().max() > 0 for x in (q_idx, k_pool, w_idx))


def _matched_case(T, P, H, seed):
    """Inputs whose indexer distribution equals the target on any selection: I[t, j] = c_j = log-odds of p.

    Main attention: every head's logit of a token of complete pool j is c_j (tail tokens random), so
    each head's mass on pool j is proportional to P * exp(c_j) and, renormalised over the selected
    pools, p[t, j] = softmax(c)_j. Indexer: one head, weight 1, relu(q_idx . k_pool[j] * scale) = c_j > 0.
    """
    g = torch.Generator().manual_seed(seed)
    D = DI = 8
    NP = T // P
    c = torch.rand(NP, generator=g, dtype=torch.float64) * 3 + 0.1  # pool log-odds, > 0
    a_sc, i_sc = 0.5, 0.25
    e0 = torch.zeros(D, dtype=torch.float64)
    e0[0] = 1.0
    q = (e0 / a_sc).expand(1, T, H, D).clone()
    k = torch.randn(1, T, 1, D, generator=g, dtype=torch.float64)  # tail tokens keep random keys
    k[0, : NP * P, 0] = c.repeat_interleave(P)[:, None] * e0
    q_idx = (e0 / i_sc).expand(1, T, 1, DI).clone().requires_grad_()
    k_pool = (c[:, None] * e0).expand(1, NP, DI).clone().requires_grad_()
    w_idx = torch.ones(1, T, 1, dtype=torch.float64, requires_grad=True)
    return q, k, q_idx, k_pool, w_idx, dict(attn_scale=a_sc, idx_scale=i_sc)


def test_zero_loss_when_indexer_matches_target():
    """KL == 0 (and zero gradient) when softmax(I) equals the target; > 0 once perturbed; rows KL >= 0."""
    T, P = 203, 4
    q, k, q_idx, k_pool, w_idx, sc = _matched_case(T, P, 3, 3)
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), 20, P, scale=sc["idx_scale"])
    loss = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, query_block=50, **sc)
    ref = reference_kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, **sc)
    assert abs(loss.item()) < 1e-12 and abs(ref.item()) < 1e-12
    assert max(g.abs().max().item() for g in _grads(loss, (q_idx, k_pool, w_idx))) < 1e-12
    # the same selection, indexer keys perturbed: strictly positive, per row and in the mean
    g = torch.Generator().manual_seed(4)
    k_bad = (k_pool.detach() + 0.5 * torch.randn(k_pool.shape, generator=g, dtype=torch.float64)).requires_grad_()
    bad = kpool_indexer_kl_loss(q, k, q_idx, k_bad, w_idx, pools, P, query_block=50, **sc)
    assert bad.item() > 1e-3
    kl, has = reference_kpool_indexer_kl_rows(q, k, q_idx, k_bad, w_idx, pools, P, **sc)
    assert (kl >= -1e-14).all() and (kl[has & ((pools >= 0).sum(-1) > 1)] > 0).all()


def test_queries_without_pools_are_excluded():
    """Rows with no complete pool add 0 and are left out of the mean; one-pool rows add 0 and count."""
    B, T, P = 2, 63, 8
    q, k, q_idx, k_pool, w_idx = _inputs(B, T, 4, 2, 16, 3, 8, P, torch.float64, 5)
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), 24, P)
    pools[1, 40:45] = -1  # later rows whose selection is empty (e.g. masked by the caller)
    kl, has = reference_kpool_indexer_kl_rows(q, k, q_idx, k_pool, w_idx, pools, P)
    t = torch.arange(T)
    expect = (t >= P - 1)[None].expand(B, T).clone()
    expect[1, 40:45] = False
    assert torch.equal(has, expect)
    assert (kl[~has] == 0).all()
    one = (pools >= 0).sum(-1) == 1  # rows P-1 .. 2P-2
    assert one.sum() == B * P and kl[one].abs().max() < 1e-14
    loss = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, query_block=10)
    assert abs(loss.item() - (kl.sum() / has.sum()).item()) < 1e-12 * loss.item()
    assert abs(loss.item() - (kl.sum() / (B * T)).item()) > 0.05 * loss.item()


def test_no_complete_pool_gives_zero_loss():
    """T < P: no pool exists; the loss is 0 and backward runs (zero gradients)."""
    q, k, q_idx, k_pool, w_idx = _inputs(1, 7, 2, 1, 8, 2, 8, 8, torch.float32, 6)
    assert k_pool.shape[1] == 0
    pools = torch.full((1, 7, 2), -1, dtype=torch.int64)
    loss = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, 8)
    assert loss.item() == 0.0
    loss.backward()
    assert q_idx.grad.abs().max() == 0 and w_idx.grad.abs().max() == 0


@pytest.mark.parametrize("tail", [True, False])
def test_end_to_end_with_kpool_topk(tail):
    """Real selections: kpool_keys -> kpool_topk -> kpool_pool_ids -> loss; grads reach k_idx, gate, ape."""
    B, T, P, topk, DI = 2, 200, 8, 32, 8
    g = torch.Generator().manual_seed(7)
    k_idx = torch.randn(B, T, DI, generator=g, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(B, T, DI, generator=g, dtype=torch.float64, requires_grad=True)
    ape = torch.randn(P, DI, generator=g, dtype=torch.float64, requires_grad=True)
    q, k, q_idx, _, w_idx = _inputs(B, T, 4, 4, 16, 3, DI, P, torch.float64, 8)
    k_pool = kpool_keys(k_idx, gate, ape)
    tokens = kpool_topk(q_idx.detach(), k_pool.detach(), w_idx.detach(), topk, P, tail=tail)
    pools = kpool_pool_ids(tokens, P, tail=tail)
    assert pools.shape == (B, T, topk // P)
    assert torch.equal(pools, kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), topk, P))
    assert torch.equal(kpool_expand(pools, P, tail), tokens)
    got = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, query_block=48, tail=tail)
    ref = reference_kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, tail=tail)
    assert ref.item() > 1e-3 and abs(got.item() - ref.item()) <= 1e-10 * ref.item()
    leaves = (q_idx, w_idx, k_idx, gate, ape)
    for a, b in zip(_grads(got, leaves), _grads(ref, leaves)):
        assert b.abs().max() > 0 and rms_ratio(b, a) < 1e-10


def test_tail_changes_the_target():
    """The tail enters each head's softmax denominator: with H > 1 the target differs with/without it."""
    B, T, P = 1, 127, 8
    q, k, q_idx, k_pool, w_idx = _inputs(B, T, 4, 4, 16, 3, 8, P, torch.float64, 9)
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), 32, P)
    with_tail = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, tail=True)
    without = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, tail=False)
    assert abs(with_tail.item() - without.item()) > 1e-4 * without.item()
    # a single head: renormalising over the pools removes the tail exactly
    one = [x[:, :, :1] for x in (q, k)]
    a = kpool_indexer_kl_loss(*one, q_idx, k_pool, w_idx, pools, P, tail=True)
    b = kpool_indexer_kl_loss(*one, q_idx, k_pool, w_idx, pools, P, tail=False)
    assert abs(a.item() - b.item()) < 1e-12 * b.item()


def test_gradient_trains_the_indexer():
    """Adam on (q_idx, k_pool, w_idx) with a fixed selection drives the loss down by more than half."""
    B, T, P = 1, 200, 4
    q, k, q_idx, k_pool, w_idx = _inputs(B, T, 4, 2, 16, 2, 8, P, torch.float32, 10)
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), 24, P)
    opt = torch.optim.Adam([q_idx, k_pool, w_idx], lr=0.05)
    first = None
    for _ in range(40):
        loss = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_autograd_keeps_only_block_inputs():
    """Checkpointing: tensors autograd saves are the inputs (shared storage) or [B, n, KP] targets."""
    B, T, P, topk, qb = 1, 300, 4, 24, 64
    q, k, q_idx, k_pool, w_idx = _inputs(B, T, 4, 2, 16, 3, 8, P, torch.float32, 11)
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), topk, P)
    inputs = {x.untyped_storage().data_ptr() for x in (q_idx, k_pool, w_idx)}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, query_block=qb)
    assert saved
    small = B * qb * (topk // P)
    for t in saved:
        assert t.untyped_storage().data_ptr() in inputs or t.numel() <= small, tuple(t.shape)
    loss.backward()


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_no_quadratic_tensor():
    """Forward + backward at T = 1024 create no tensor of [T, T // P] size (let alone [T, T])."""
    B, T, P = 1, 1024, 4
    q, k, q_idx, k_pool, w_idx = _inputs(B, T, 4, 2, 16, 3, 8, P, torch.float32, 12)
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), 16, P)
    limit = T * (T // P) // 2
    assert max(x.numel() for x in (q, k, q_idx, k_pool, w_idx, pools)) < limit
    with _LargestTensor() as mode:
        kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P).backward()
    assert 0 < mode.largest < limit


def test_target_gather_in_head_groups(monkeypatch):
    """A tiny gather budget (one key head at a time) gives the same loss as the default."""
    q, k, q_idx, k_pool, w_idx = _inputs(1, 100, 6, 3, 8, 2, 8, 4, torch.float64, 13)
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), w_idx.detach(), 12, 4)
    full = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, 4)
    monkeypatch.setattr(kpool_loss_mod, "_GATHER_ELEMS", 1)
    split = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, 4)
    assert abs(full.item() - split.item()) < 1e-13 * full.item()


def test_rejects_bad_inputs():
    """Shape, dtype and argument errors raise InputError naming the input."""
    q, k, q_idx, k_pool, w_idx = _inputs(1, 40, 2, 1, 8, 2, 8, 4, torch.float32, 14)
    pools = torch.full((1, 40, 2), -1, dtype=torch.int64)
    with pytest.raises(InputError, match="k_pool"):
        kpool_indexer_kl_loss(q, k, q_idx, k_pool[:, :-1], w_idx, pools, 4)
    with pytest.raises(InputError, match="pool_indices"):
        kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools[:, :-1], 4)
    with pytest.raises(InputError, match="pool_indices"):
        kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools.float(), 4)
    with pytest.raises(InputError, match="w_idx"):
        kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx[..., :1], pools, 4)
    with pytest.raises(InputError, match="query heads"):
        kpool_indexer_kl_loss(q[:, :, :1], k.expand(1, 40, 2, 8), q_idx, k_pool, w_idx, pools, 4)
    with pytest.raises(InputError, match="query_block"):
        kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, 4, query_block=0)
    with pytest.raises(InputError, match="slots per query"):
        kpool_pool_ids(torch.zeros(1, 40, 10, dtype=torch.int64), 4, tail=True)
    with pytest.raises(InputError, match="topk"):
        kpool_select_pools(q_idx, k_pool, w_idx, 6, 4)
