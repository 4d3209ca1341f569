"""Triton KPool kernels (kernels/dsa/triton_kpool.py) under the Triton interpreter.

Key pooling is checked against the torch reference :func:`genolong.kernels.dsa.kpool_keys` and a
float64 oracle, forward and the three input gradients (k_idx, gate, ape); the indexer KL loss
against :func:`genolong.kernels.dsa.kpool_indexer_kl_loss` and its dense oracle
``reference_kpool_indexer_kl_loss`` in float64, loss and the gradients w.r.t. q_idx, k_pool and
w_idx. Both in float32 and float16 (bf16 is broken in the interpreter), with T not a multiple of P,
dimensions not powers of two and B = 2. Triton is a test dependency: a missing triton fails this
module (no skip). The interpreter is slow (each program runs in numpy): small sizes.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a missing triton must fail here, not skip; tests/conftest.py sets TRITON_INTERPRET=1)

from genolong.errors import InputError
from genolong.kernels.dsa import kpool_indexer_kl_loss, kpool_keys, kpool_select_pools, triton_kpool
from genolong.kernels.dsa.kpool_loss import reference_kpool_indexer_kl_loss, reference_kpool_indexer_kl_rows
from genolong.kernels.dsa.triton_kpool import kpool_indexer_kl_loss_triton, kpool_keys_triton
from genolong.kernels.testing import rms_ratio
from tests.helpers import spy_on_launches

pytestmark = pytest.mark.usefixtures("one_thread")

_FP32_TOL = 1e-5


def _oracle(k_idx: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Float64 pooling, written independently of both implementations (explicit exp / sum)."""
    B, T, DI = k_idx.shape
    P = ape.shape[0]
    NP = T // P
    logit = gate[:, : NP * P].reshape(B, NP, P, DI) + ape[None, None]
    e = torch.exp(logit - logit.detach().amax(2, keepdim=True))
    return (e * k_idx[:, : NP * P].reshape(B, NP, P, DI)).sum(2) / e.sum(2)


def _inputs(B: int, T: int, P: int, DI: int, dtype: torch.dtype, seed: int):
    """Leaf tensors ``k_idx``, ``gate`` (a non-contiguous transposed view) ``[B, T, DI]`` and ``ape [P, DI]``.

    Gate logits of scale 2 make the pool softmax far from uniform (a wrong axis or a missing ape
    changes the result)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, T, DI, generator=g).to(dtype).requires_grad_(True)
    gate = (2 * torch.randn(B, DI, T, generator=g)).to(dtype).transpose(1, 2).requires_grad_(True)
    ape = torch.randn(P, DI, generator=g).to(dtype).requires_grad_(True)
    return k, gate, ape


def _run(B, T, P, DI, dtype, seed):
    """(triton, reference, float64 oracle) results, each ``(k_pool, dk, dgate, dape)``."""
    leaves = _inputs(B, T, P, DI, dtype, seed)
    do = torch.randn(B, T // P, DI, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    o = kpool_keys_triton(*leaves)
    got = (o, *torch.autograd.grad(o, leaves, do))
    r = kpool_keys(*leaves)
    ref = (r, *torch.autograd.grad(r, leaves, do))
    # float64 leaves: gradients w.r.t. the fp16 leaves themselves would come back rounded to fp16
    leaves64 = tuple(x.detach().double().requires_grad_(True) for x in leaves)
    x = _oracle(*leaves64)
    exact = (x, *torch.autograd.grad(x, leaves64, do.double()))
    return got, ref, exact


# (B, T, P, DI, pools per backward program): T % P != 0 in every case
CASES = {
    # P = 4, 5 pools and a 3-token tail, DI = 12 (one channel tile, padded to 16)
    "p4_b2": (2, 23, 4, 12, 32),
    # P = 16 (glm5_next's index_kpool), 2 pools and a 5-token tail, DI = 20
    "p16_b2": (2, 37, 16, 20, 32),
    # DI = 70: two channel tiles of 64, the second partial; backward chunks of 3 pools over 7
    # pools (3 + 3 + 1: the last chunk runs past the last pool), so the dape partials are summed
    "p4_chunks_two_tiles": (2, 30, 4, 70, 3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float32_forward_and_gradients_match_the_reference(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32: k_pool, dk, dgate, dape within RMS ratio 1e-5 of the torch reference and of the float64
    oracle; the tail rows (T % P tokens) get exactly zero dk and dgate."""
    B, T, P, DI, ppp = CASES[name]
    monkeypatch.setattr(triton_kpool, "_POOLS_PER_PROGRAM", ppp)
    got, ref, exact = _run(B, T, P, DI, torch.float32, seed=len(name))
    for what, a, r, x in zip(("k_pool", "dk", "dgate", "dape"), got, ref, exact):
        assert a.dtype == r.dtype == torch.float32 and a.shape == r.shape, what
        assert rms_ratio(r, a) < _FP32_TOL, (what, rms_ratio(r, a))
        assert rms_ratio(x, a) < _FP32_TOL, (what, rms_ratio(x, a))
    _, dk, dgate, _ = got
    tail = (T // P) * P
    assert T - tail > 0
    assert float(dk[:, tail:].abs().max()) == 0.0 and float(dgate[:, tail:].abs().max()) == 0.0
    assert float(dk[:, :tail].abs().min()) > 0.0  # every pooled row is written (no stale memory)
    assert float(dgate[:, :tail].abs().mean()) > 1e-2


def test_float16_error_is_within_twice_the_reference_rounding() -> None:
    """fp16 inputs: both implementations are compared to the float64 oracle on the same fp16 inputs.
    The reference rounds a to fp16 and multiplies in fp16; the kernels compute in float32 and round
    each result once, so their error must not exceed ~2x the reference's."""
    got, ref, exact = _run(2, 23, 4, 12, torch.float16, seed=7)
    for what, a, r, x in zip(("k_pool", "dk", "dgate", "dape"), got, ref, exact):
        assert a.dtype == torch.float16 and r.dtype == torch.float16, what
        err, ref_err = rms_ratio(x, a), rms_ratio(x, r)
        assert 0 < ref_err < 3e-3, (what, ref_err)  # the oracle really differs by fp16 rounding only
        assert err <= 2.0 * ref_err, (what, err, ref_err)


def test_mixed_and_float64_dtypes_and_a_broadcast_gradient() -> None:
    """Each input keeps its dtype: float64 k_idx (computed in float32, like the reference's softmax)
    with an fp16 gate and a float32 ape gives a float64 result and gradients in each input's dtype;
    ``k_pool.sum()`` (a stride-0 output gradient) gives the reference's gradients."""
    g = torch.Generator().manual_seed(3)
    B, T, P, DI = 2, 13, 4, 6
    k = torch.randn(B, T, DI, generator=g, dtype=torch.float64).requires_grad_(True)
    gate = torch.randn(B, T, DI, generator=g).half().requires_grad_(True)
    ape = torch.randn(P, DI, generator=g).requires_grad_(True)
    o = kpool_keys_triton(k, gate, ape)
    grads = torch.autograd.grad(o.sum(), (k, gate, ape))
    r = kpool_keys(k, gate, ape)
    ref = torch.autograd.grad(r.sum(), (k, gate, ape))
    assert o.dtype == torch.float64 and [x.dtype for x in grads] == [torch.float64, torch.float16, torch.float32]
    assert rms_ratio(r, o) < 1e-6
    for what, a, b in zip(("dk", "dgate", "dape"), grads, ref):
        assert a.dtype == b.dtype, what
        tol = 2e-3 if a.dtype == torch.float16 else 1e-6  # dgate: one fp16 rounding either side
        assert rms_ratio(b, a) < tol, (what, rms_ratio(b, a))


def test_no_complete_pool_gives_an_empty_result_and_zero_gradients() -> None:
    """T < P: ``[B, 0, DI]`` like the reference, and all-zero gradients (nothing is pooled)."""
    k, gate, ape = _inputs(2, 3, 4, 5, torch.float32, seed=9)
    o = kpool_keys_triton(k, gate, ape)
    assert o.shape == kpool_keys(k, gate, ape).shape == (2, 0, 5)
    dk, dgate, dape = torch.autograd.grad(o.sum() + 0 * (k.sum() + gate.sum() + ape.sum()), (k, gate, ape))
    assert float(dk.abs().max()) == float(dgate.abs().max()) == float(dape.abs().max()) == 0.0


def test_validation_matches_the_reference_and_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad shapes raise the reference's exception, type and message; CPU tensors with compiled (not
    interpreted) kernels raise an InputError naming TRITON_INTERPRET and the torch backend."""
    k, gate, ape = torch.randn(1, 8, 6), torch.randn(1, 8, 6), torch.randn(4, 6)
    bad = [
        (k[0], gate[0], ape),  # 2-D keys: the shape unpacking fails
        (k, gate[:, :7], ape),  # gate of another length
        (k, gate, ape[:, :5]),  # ape of another width
        (k, gate, ape[None]),  # 3-D ape
        (k, gate, ape[:0]),  # P = 0
    ]
    for args in bad:
        with pytest.raises(Exception) as ref_err:
            kpool_keys(*args)
        with pytest.raises(Exception) as got_err:
            kpool_keys_triton(*args)
        assert type(got_err.value) is type(ref_err.value), args[2].shape
        assert str(got_err.value) == str(ref_err.value)
    assert torch.equal(kpool_keys_triton(k, gate, ape), kpool_keys_triton(k, gate, ape))  # deterministic
    monkeypatch.setattr(triton_kpool, "_kpool_fwd_kernel", object())  # as if compiled for a GPU
    with pytest.raises(InputError, match="TRITON_INTERPRET"):
        kpool_keys_triton(k, gate, ape)


# ----------------------------------------------------------------------------- indexer KL loss


def _kl_inputs(B, T, H, HK, D, HI, DI, P, topk, dtype, seed, with_w=True):
    """``(q, k, q_idx, k_pool, w_idx, pools)``: leaves q_idx, k_pool, w_idx (or None) in ``dtype``;
    the indexer's own selection with, edited in, a ``-1`` slot, an ineligible pool (its last token
    after the query), and one query (past the first pool) whose slots are all ``-1``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    k = torch.randn(B, T, HK, D, generator=g).to(dtype)
    q_idx = torch.randn(B, T, HI, DI, generator=g).to(dtype).requires_grad_(True)
    k_pool = torch.randn(B, T // P, DI, generator=g).to(dtype).requires_grad_(True)
    w_idx = (torch.rand(B, T, HI, generator=g) + 0.5).to(dtype).requires_grad_(True) if with_w else None
    pools = kpool_select_pools(q_idx.detach(), k_pool.detach(), None if w_idx is None else w_idx.detach(), topk, P)
    t_last = T - 1
    pools[0, t_last, 0] = -1  # one empty slot in a full row
    t_inel = 2 * P - 2  # pool 1 ends at 2P - 1 > t: not eligible, must be ignored
    pools[0, t_inel, -1] = 1
    pools[-1, P + 1] = -1  # a query with complete pools but none selected: not counted
    return q, k, q_idx, k_pool, w_idx, pools


# (B, T, H, HK, D, HI, DI, P, topk, with w_idx, tail, activation)
KL_CASES = {
    # P = 4, GQA (two key heads of 2 query heads), 4 pools + a 3-token tail, weights, tail on
    "p4_gqa_weights_tail": (2, 19, 4, 2, 20, 3, 12, 4, 8, True, True, "relu"),
    # P = 16, MQA (the absorbed latent form), D = 72 and DI = 70 (two channel tiles each), no
    # weights, no tail, no activation
    "p16_mqa_two_tiles": (1, 37, 4, 1, 72, 2, 70, 16, 32, False, False, None),
}


def _kl_run(case, dtype, seed):
    """(triton, torch, float64 oracle) results, each ``(loss, d q_idx, d k_pool[, d w_idx])``."""
    B, T, H, HK, D, HI, DI, P, topk, with_w, tail, act = case
    q, k, q_idx, k_pool, w_idx, pools = _kl_inputs(B, T, H, HK, D, HI, DI, P, topk, dtype, seed, with_w)
    leaves = (q_idx, k_pool) if w_idx is None else (q_idx, k_pool, w_idx)
    kw = dict(attn_scale=0.8 * D**-0.5, idx_scale=1.3 * DI**-0.5, tail=tail, activation=act)
    loss = kpool_indexer_kl_loss_triton(q, k, q_idx, k_pool, w_idx, pools, P, **kw)
    got = (loss.detach(), *torch.autograd.grad(loss, leaves))
    ref_loss = kpool_indexer_kl_loss(q, k, q_idx, k_pool, w_idx, pools, P, query_block=7, **kw)
    ref = (ref_loss.detach(), *torch.autograd.grad(ref_loss, leaves))
    leaves64 = tuple(x.detach().double().requires_grad_(True) for x in leaves)
    w64 = None if w_idx is None else leaves64[2]
    x_loss = reference_kpool_indexer_kl_loss(q.double(), k.double(), leaves64[0], leaves64[1], w64, pools, P, **kw)
    exact = (x_loss.detach(), *torch.autograd.grad(x_loss, leaves64))
    return got, ref, exact, pools


@pytest.mark.parametrize("name", list(KL_CASES))
def test_kl_loss_float32_matches_the_reference(name: str) -> None:
    """fp32: the loss within 1e-5 relative, and d q_idx, d k_pool, d w_idx within RMS ratio 1e-5, of
    the torch function and of the float64 dense oracle; pools no query selected get zero gradient."""
    got, ref, exact, pools = _kl_run(KL_CASES[name], torch.float32, seed=len(name))
    loss, ref_loss, x_loss = got[0], ref[0], exact[0]
    assert loss.dtype == ref_loss.dtype == torch.float32 and loss.shape == ()
    assert float(x_loss) > 1e-3  # a real KL, not a zero that any kernel would match
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), (float(loss), float(ref_loss))
    assert abs(float(loss) - float(x_loss)) <= 1e-5 * abs(float(x_loss)), (float(loss), float(x_loss))
    for what, a, r, x in zip(("dq_idx", "dk_pool", "dw_idx"), got[1:], ref[1:], exact[1:]):
        assert a.dtype == r.dtype and a.shape == r.shape, what
        assert rms_ratio(r, a) < _FP32_TOL, (what, rms_ratio(r, a))
        assert rms_ratio(x, a) < _FP32_TOL, (what, rms_ratio(x, a))
    dk_pool = got[2]
    selected = torch.zeros(dk_pool.shape[:2], dtype=torch.bool)
    for b in range(pools.shape[0]):
        ids = pools[b][pools[b] >= 0].unique()
        selected[b, ids] = True
    unselected = ~selected
    if bool(unselected.any()):
        assert float(dk_pool[unselected].abs().max()) == 0.0
    assert float(dk_pool[selected].abs().mean()) > 0.0


# name: (case, first query q0): queries [q0, T) at q_offset = q0 over the keys and pools of [0, T)
KL_OFFSET_CASES = {
    # a multiple of P (a CP rank's or recompute segment's start): 2 of 4 pools before the range
    "p4_gqa_weights_tail_at_8": ("p4_gqa_weights_tail", 8),
    # not a multiple of P, mid-pool: rows whose tail pool starts before q_offset
    "p16_mqa_two_tiles_at_21": ("p16_mqa_two_tiles", 21),
}


@pytest.mark.parametrize("name", list(KL_OFFSET_CASES))
def test_kl_loss_at_a_query_offset_matches_the_reference(name: str) -> None:
    """Queries ``[q0, T)`` at ``q_offset = q0`` over the main keys and pooled keys of ``[0, T)``
    (a context-parallel rank, a recompute segment): the loss and d q_idx, d k_pool, d w_idx equal
    the torch function's at the same offset and the float64 dense oracle's (the mean of the whole
    sequence's KL rows over the range's counted queries) to 1e-5 (fp32); pools before the range
    get the gradient of the range's queries only."""
    case_name, q0 = KL_OFFSET_CASES[name]
    B, T, H, HK, D, HI, DI, P, topk, with_w, tail, act = KL_CASES[case_name]
    q, k, q_idx, k_pool, w_idx, pools = _kl_inputs(B, T, H, HK, D, HI, DI, P, topk, torch.float32, seed=len(name))
    leaves = (q_idx, k_pool) if w_idx is None else (q_idx, k_pool, w_idx)
    kw = dict(attn_scale=0.8 * D**-0.5, idx_scale=1.3 * DI**-0.5, tail=tail, activation=act)
    rows = slice(q0, T)

    def offset_loss(fn, **extra):
        w = None if w_idx is None else w_idx[:, rows]
        return fn(q[:, rows], k, q_idx[:, rows], k_pool, w, pools[:, rows], P, q_offset=q0, **kw, **extra)

    loss = offset_loss(kpool_indexer_kl_loss_triton)
    got = (loss.detach(), *torch.autograd.grad(loss, leaves))
    ref_loss = offset_loss(kpool_indexer_kl_loss, query_block=5)
    ref = (ref_loss.detach(), *torch.autograd.grad(ref_loss, leaves))
    leaves64 = tuple(x.detach().double().requires_grad_(True) for x in leaves)
    w64 = None if w_idx is None else leaves64[2]
    kl, has = reference_kpool_indexer_kl_rows(q.double(), k.double(), leaves64[0], leaves64[1], w64, pools, P, **kw)
    x_loss = kl[:, rows].sum() / has[:, rows].sum()
    exact = (x_loss.detach(), *torch.autograd.grad(x_loss, leaves64))
    loss, ref_loss, x_loss = float(got[0]), float(ref[0]), float(exact[0])
    assert x_loss > 1e-3 and bool(has[:, :q0].any())  # a real KL; queries before the range count elsewhere
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert abs(loss - x_loss) <= 1e-5 * abs(x_loss), (loss, x_loss)
    for what, a, r, x in zip(("dq_idx", "dk_pool", "dw_idx"), got[1:], ref[1:], exact[1:]):
        assert a.shape == r.shape == x.shape, what
        assert rms_ratio(r, a) < _FP32_TOL, (what, rms_ratio(r, a))
        assert rms_ratio(x, a) < _FP32_TOL, (what, rms_ratio(x, a))
    assert float(got[1][:, :q0].abs().max()) == 0.0  # queries before the range: not this call's
    assert float(got[2][:, : q0 // P].abs().sum()) > 0.0  # pools before the range: selected by its queries


def test_kl_loss_float16_error_is_within_twice_the_reference_rounding() -> None:
    """fp16 indexer and attention inputs: both implementations compute in float32 and round the
    gradients once to fp16; against the float64 oracle the kernels' error is at most ~2x the torch
    function's (the loss: 2x plus float32 noise, both errors being float32 rounding only)."""
    got, ref, exact, _ = _kl_run(KL_CASES["p4_gqa_weights_tail"], torch.float16, seed=13)
    x = float(exact[0])
    assert got[0].dtype == ref[0].dtype == torch.float32
    assert abs(float(got[0]) - x) <= 2.0 * abs(float(ref[0]) - x) + 1e-6 * abs(x), (float(got[0]), float(ref[0]), x)
    for what, a, r, e in zip(("dq_idx", "dk_pool", "dw_idx"), got[1:], ref[1:], exact[1:]):
        assert a.dtype == r.dtype == torch.float16, what
        err, ref_err = rms_ratio(e, a), rms_ratio(e, r)
        assert 0 < ref_err < 1e-3, (what, ref_err)
        assert err <= 2.0 * ref_err, (what, err, ref_err)


def test_kl_loss_without_a_selected_pool_is_zero_with_zero_gradients() -> None:
    """Every slot -1 (kernel path) and T < P (no complete pool): loss 0 like the torch function, and
    zero gradients that still reach every indexer input."""
    q, k, q_idx, k_pool, w_idx, pools = _kl_inputs(1, 9, 2, 1, 8, 2, 6, 4, 8, torch.float32, seed=17)
    pools = torch.full_like(pools, -1)
    for args in ((q, k, q_idx, k_pool, w_idx, pools, 4), (q, k, q_idx, k_pool[:, :0], w_idx, pools, 16)):
        loss = kpool_indexer_kl_loss_triton(*args)
        assert float(loss.detach()) == float(kpool_indexer_kl_loss(*args).detach()) == 0.0
        grads = torch.autograd.grad(loss, (q_idx, args[3], w_idx))
        assert [g.shape for g in grads] == [q_idx.shape, args[3].shape, w_idx.shape]
        assert all(float(g.abs().sum()) == 0.0 for g in grads)


def test_kl_loss_validation_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad inputs raise the torch function's InputError, message for message; CPU tensors with
    compiled (not interpreted) kernels raise an InputError naming TRITON_INTERPRET."""
    q, k, q_idx, k_pool, w_idx, pools = _kl_inputs(1, 9, 2, 1, 8, 2, 6, 4, 8, torch.float32, seed=19)
    good = dict(q=q, k=k, q_idx=q_idx, k_pool=k_pool, w_idx=w_idx, pool_indices=pools, pool_size=4)
    bad = [
        dict(k=torch.randn(1, 9, 3, 8)),  # H % HK
        dict(k_pool=k_pool[:, :1]),  # not T // P pools
        dict(w_idx=w_idx[..., :1]),
        dict(pool_indices=pools.float()),
        dict(pool_indices=pools[:, :4]),
        dict(pool_size=0),
        dict(query_block=0),
        dict(activation="gelu"),
    ]
    for change in bad:
        kwargs = {**good, **change}
        with pytest.raises(InputError) as ref_err:
            kpool_indexer_kl_loss(**kwargs)
        with pytest.raises(InputError) as got_err:
            kpool_indexer_kl_loss_triton(**kwargs)
        assert str(got_err.value) == str(ref_err.value), change
    monkeypatch.setattr(triton_kpool, "_kpool_fwd_kernel", object())  # as if compiled for a GPU
    with pytest.raises(InputError, match="TRITON_INTERPRET"):
        kpool_indexer_kl_loss_triton(**good)


def test_kl_loss_mixed_16bit_and_fp32_inputs_dot_in_16bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16-mixed autocast hands the loss 16-bit queries (main and index) with an fp32 latent and
    fp32 pooled keys (RMSNorm / LayerNorm outputs under fp32 master weights): the fp32 sides are
    rounded to the 16-bit dtype for the dots (tensor cores on a GPU), as autocast's matmul rounds
    them (fp16 here: the interpreter's bf16 is broken). The result equals the torch reference on the
    same rounded operands to float32 precision (loss 1e-5 relative, dk_pool and dw RMS ratio 1e-5,
    dq_idx, rounded once to fp16 on both sides, within twice the reference's own error against the
    float64 oracle), gradients come back in each input's dtype, and the kernels were launched with
    16-bit dot operands."""
    B, T, H, HK, D, HI, DI, P, topk, with_w, tail, act = KL_CASES["p4_gqa_weights_tail"]
    q, k, q_idx, k_pool, w_idx, pools = _kl_inputs(B, T, H, HK, D, HI, DI, P, topk, torch.float32, 23, with_w)
    q, q_idx = q.half(), q_idx.detach().half().requires_grad_(True)
    w_idx = w_idx.detach().float().requires_grad_(True)  # DSAIndexer.project makes the weights fp32
    kw = dict(attn_scale=0.8 * D**-0.5, idx_scale=1.3 * DI**-0.5, tail=tail, activation=act)
    target_seen = spy_on_launches(monkeypatch, triton_kpool._kl_target_kernel)
    rows_seen = spy_on_launches(monkeypatch, triton_kpool._kl_rows_kernel)
    loss = kpool_indexer_kl_loss_triton(q, k, q_idx, k_pool, w_idx, pools, P, **kw)
    got = (loss.detach(), *torch.autograd.grad(loss, (q_idx, k_pool, w_idx)))
    assert target_seen[0][:2] == [torch.float16, torch.float16]  # q and the latent k
    assert all(s[:2] == [torch.float16, torch.float16] for s in rows_seen)  # q_idx and k_pool (fwd, bwd)
    assert [x.dtype for x in got[1:]] == [torch.float16, torch.float32, torch.float32]
    # the reference on the operands as autocast rounds them (the leaf keeps the fp32 dtype)
    k_r = k.half()
    kp_r = k_pool.detach().half().float().requires_grad_(True)
    ref_loss = kpool_indexer_kl_loss(q, k_r, q_idx, kp_r, w_idx, pools, P, query_block=7, **kw)
    ref = (ref_loss.detach(), *torch.autograd.grad(ref_loss, (q_idx, kp_r, w_idx)))
    leaves64 = [x.detach().double().requires_grad_(True) for x in (q_idx, kp_r, w_idx)]
    x_loss = reference_kpool_indexer_kl_loss(q.double(), k_r.double(), *leaves64, pools, P, **kw)
    exact = (x_loss.detach(), *torch.autograd.grad(x_loss, leaves64))
    assert float(exact[0]) > 1e-3
    assert abs(float(got[0]) - float(ref[0])) <= 1e-5 * abs(float(ref[0])), (float(got[0]), float(ref[0]))
    err, ref_err = rms_ratio(exact[1], got[1]), rms_ratio(exact[1], ref[1])
    assert 0 < ref_err < 1e-3 and err <= 2.0 * ref_err, ("dq_idx", err, ref_err)
    for what, a, r in zip(("dk_pool", "dw_idx"), got[2:], ref[2:]):
        assert rms_ratio(r, a) < _FP32_TOL, (what, rms_ratio(r, a))
