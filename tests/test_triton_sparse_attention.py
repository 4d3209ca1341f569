"""Triton DSA sparse attention (kernels/dsa/triton_attention.py) under the Triton interpreter.

Checked against the torch reference :func:`genolong.kernels.dsa.sparse_attention` and a dense
float64 oracle, forward and the three input gradients, in float32 and float16 (bf16 is broken in
the interpreter), on odd shapes. Triton is a test dependency: a missing triton fails this module
(no skip). The interpreter runs each program in numpy, so sizes are small.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton  # noqa: F401  (a missing triton must fail here, not skip; tests/conftest.py sets TRITON_INTERPRET=1)

from genolong.errors import InputError
from genolong.kernels.dsa import sparse_attention
from genolong.kernels.dsa import triton_attention
from genolong.kernels.dsa.triton_attention import sparse_attention_triton
from genolong.kernels.testing import rms_ratio

pytestmark = pytest.mark.usefixtures("one_thread")

_FP32_TOL = 1e-5


def _dense_oracle(q, k, v, indices, scale, q_offset):
    """Float64 dense attention under the mask the indices define: ``(o [B, T, H, DV], lse [B, T, H])``.

    Independent of both kernels: it never gathers, it scatters the valid indices into a
    ``[B, T, TK]`` mask. Rows with no valid key give ``o = 0`` and ``lse = -inf``; differentiable.
    """
    B, T, H, _ = q.shape
    TK, HK = k.shape[1], k.shape[2]
    G = H // HK
    idx = indices.long()
    pos = q_offset + torch.arange(T)
    valid = (idx >= 0) & (idx <= pos[None, :, None])
    mask = torch.zeros(B, T, TK + 1, dtype=torch.bool)
    mask.scatter_(2, torch.where(valid, idx, TK), True)  # invalid slots land in the dropped column TK
    mask = mask[..., :TK]
    kr = k.double().repeat_interleave(G, dim=2)
    vr = v.double().repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), kr) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a constant shift; 0 for empty rows
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    o = torch.einsum("bhts,bshd->bthd", e / l.clamp_min(1e-300), vr)
    lse = (m + torch.log(l)).squeeze(-1).transpose(1, 2)  # [B, T, H], -inf where l = 0
    return o, lse.detach(), mask


def _indices(B: int, T: int, TK: int, K: int, q_offset: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct positions per row (some in the future of the query), ``-1`` padding, one row whose
    indices all lie beyond the causal limit, one row of ``-1`` only, and one row whose only valid
    slot is the last (with top-k > 32, a first key tile with no valid key before a tile with one)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(B, T, TK, generator=g).argsort(-1)[..., :K]  # distinct in [0, TK)
    idx = torch.where(torch.rand(B, T, K, generator=g) < 0.25, -1, idx)
    t_future, t_empty = T // 3, T // 2
    future = torch.arange(q_offset + t_future + 1, TK)[:K]  # all > q_offset + t_future
    idx[:, t_future] = -1
    idx[:, t_future, : len(future)] = future
    idx[:, t_empty] = -1
    idx[:, T - 1] = -1
    idx[:, T - 1, -1] = 0  # position 0 is never in the future
    return idx.to(dtype)


def _inputs(B, T, TK, H, HK, D, DV, dtype, seed, share_kv=False):
    """Leaf tensors q ``[B, T, H, D]`` (non-contiguous: a transposed view), k, v (``v is k`` if shared)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(dtype).transpose(1, 2).requires_grad_(True)
    k = torch.randn(B, TK, HK, D, generator=g).to(dtype).requires_grad_(True)
    v = k if share_kv else torch.randn(B, TK, HK, DV, generator=g).to(dtype).requires_grad_(True)
    return q, k, v


# (B, T, TK, q_offset, H, HK, D, DV, topk, index dtype, k is v)
CASES = {
    # MQA (HK = 1), D != DV, int32, one key tile (12 of 16 slots used)
    "mqa_int32": (2, 23, 23, 0, 4, 1, 16, 8, 12, torch.int32, False),
    # GQA (HK = 2), DV > D, int64, top-k 35: two key tiles, the second partial (online-softmax rescale)
    "gqa_two_tiles_int64": (1, 38, 38, 0, 4, 2, 12, 20, 35, torch.int64, False),
    # context-parallel rank: queries at 27 .. 39 over keys 0 .. 39 (TK > T)
    "q_offset_int32": (2, 13, 40, 27, 4, 2, 8, 8, 11, torch.int32, False),
    # the absorbed MLA form of the DSA layer: k = v = the latent, one KV head
    "latent_k_is_v_int64": (1, 21, 21, 0, 4, 1, 16, 16, 12, torch.int64, True),
}


def _run(case, dtype, seed):
    B, T, TK, off, H, HK, D, DV, K, idt, share = case
    q, k, v = _inputs(B, T, TK, H, HK, D, DV, dtype, seed, share)
    idx = _indices(B, T, TK, K, off, idt, seed)
    leaves = (q, k) if share else (q, k, v)
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(B, T, H, DV, generator=g).to(dtype)
    scale = 0.7 * D ** -0.5  # not the default: the scale must reach both kernels
    o = sparse_attention_triton(q, k, v, idx, scale=scale, q_offset=off)
    grads = torch.autograd.grad(o, leaves, do)
    ref = sparse_attention(q, k, v, idx, scale=scale, query_block=5, q_offset=off)
    ref_grads = torch.autograd.grad(ref, leaves, do)
    # float64 leaves: gradients w.r.t. the fp16 leaves themselves would come back rounded to fp16
    leaves64 = tuple(x.detach().double().requires_grad_(True) for x in leaves)
    q64, k64 = leaves64[:2]
    v64 = k64 if share else leaves64[2]
    o64, _, mask = _dense_oracle(q64, k64, v64, idx, scale, off)
    grads64 = torch.autograd.grad(o64, leaves64, do.double())
    return (o, *grads), (ref, *ref_grads), (o64, *grads64), mask, idx


@pytest.mark.parametrize("name", list(CASES))
def test_float32_forward_and_gradients_match_the_reference(name: str) -> None:
    """fp32: o, dq, dk, dv within RMS ratio 1e-5 of the torch reference and of the float64 oracle;
    rows with no valid key give exactly 0, keys no query validly selects get exactly zero dk/dv."""
    got, ref, exact, mask, idx = _run(CASES[name], torch.float32, seed=len(name))
    for what, a, r, x in zip(("o", "dq", "dk", "dv"), got, ref, exact):
        assert a.dtype == r.dtype and a.shape == r.shape, what
        assert rms_ratio(r, a) < _FP32_TOL, (what, rms_ratio(r, a))
        assert rms_ratio(x, a) < _FP32_TOL, (what, rms_ratio(x, a))
    o, _, dk = (x.detach() for x in got[:3])
    empty_rows = ~mask.any(-1)  # [B, T]: includes the all-future and the all -1 rows
    T = idx.shape[1]
    assert bool(empty_rows[:, T // 3].all()) and bool(empty_rows[:, T // 2].all())
    assert float(o[empty_rows].abs().max()) == 0.0
    unselected = ~mask.any(1)  # [B, TK]: keys no query may attend to
    assert bool(unselected.any())
    assert float(dk[unselected].abs().max()) == 0.0
    if len(got) == 4:
        assert float(got[3][unselected].abs().max()) == 0.0


def test_shared_latent_path_equals_two_equal_tensors() -> None:
    """``v is k`` (one gather, one summed scatter) gives the result and the gradient sum of passing
    an equal copy as ``v`` (two gathers, two scatters)."""
    B, T, H, C, K = 1, 17, 4, 16, 9
    q, k, _ = _inputs(B, T, T, H, 1, C, C, torch.float32, seed=5)
    idx = _indices(B, T, T, K, 0, torch.int32, seed=5)
    do = torch.randn(B, T, H, C, generator=torch.Generator().manual_seed(6))
    o = sparse_attention_triton(q, k, k, idx)
    dq, dk = torch.autograd.grad(o, (q, k), do)
    k2, v2 = (k.detach().clone().requires_grad_(True) for _ in range(2))
    o2 = sparse_attention_triton(q, k2, v2, idx)
    dq2, dk2, dv2 = torch.autograd.grad(o2, (q, k2, v2), do)
    torch.testing.assert_close(o, o2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dq, dq2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dk, dk2 + dv2, rtol=1e-5, atol=1e-6)
    assert float(dv2.abs().max()) > 1e-2  # the value half of the shared gradient is not negligible


@pytest.mark.parametrize("name", ["mqa_int32", "q_offset_int32"])
def test_float16_error_is_within_twice_the_reference_rounding(name: str) -> None:
    """fp16 inputs: both kernels are compared to the float64 oracle on the same fp16 inputs. The torch
    reference computes in fp32 and rounds once to fp16 (~2^-11 relative, RMS ratio ~3e-4); the
    Triton kernels also round P and dS to fp16 before their products (FlashAttention's practice),
    a second rounding of the same size, so their error may be up to ~2x the reference's, not more."""
    got, ref, exact, _, _ = _run(CASES[name], torch.float16, seed=7)
    for what, a, r, x in zip(("o", "dq", "dk", "dv"), got, ref, exact):
        assert a.dtype == torch.float16 and r.dtype == torch.float16, what
        err, ref_err = rms_ratio(x, a), rms_ratio(x, r)
        assert 0 < ref_err < 1e-3, (what, ref_err)  # the oracle really differs by fp16 rounding only
        assert err <= 2.0 * ref_err, (what, err, ref_err)


def test_saved_lse_and_the_backward_path_that_reads_it() -> None:
    """The forward's lse is the float64 log-sum-exp (-inf for empty rows), and the backward really
    recomputes P = exp(S - lse) from it, for the right (b, t, h): raising lse of one (t, h) by log 2
    halves exactly that row's P and dS, so every gradient moves by half that row's contribution."""
    B, T, TK, H, HK, D, DV, K = 2, 9, 9, 4, 2, 8, 12, 6
    q, k, v = (x.detach() for x in _inputs(B, T, TK, H, HK, D, DV, torch.float32, seed=11))
    q = q.contiguous()
    idx = _indices(B, T, TK, K, 0, torch.int64, seed=11)
    scale = D ** -0.5
    o, lse = triton_attention._forward(q, k, v, idx, scale, 0)
    o64, lse64, _ = _dense_oracle(q, k, v, idx, scale, 0)
    assert rms_ratio(o64, o) < _FP32_TOL
    empty = torch.isinf(lse64)
    assert bool(empty.any()) and bool(torch.equal(torch.isinf(lse), empty)) and bool((lse[empty] < 0).all())
    assert float((lse - lse64)[~empty].abs().max()) < 1e-5

    b, t, h = 1, 7, 3  # a row with valid keys, the last head of the second KV head
    assert torch.isfinite(lse[b, t, h])
    do = torch.randn(B, T, H, DV, generator=torch.Generator().manual_seed(12))
    leaves64 = tuple(x.double().requires_grad_(True) for x in (q, k, v))
    exact = torch.autograd.grad(_dense_oracle(*leaves64, idx, scale, 0)[0], leaves64, do.double())
    do_row = torch.zeros_like(do)
    do_row[b, t, h] = do[b, t, h]
    lse_shifted = lse.clone()
    lse_shifted[b, t, h] += math.log(2.0)
    full = triton_attention._backward(q, k, v, idx, o, do, lse, scale, 0)
    row = triton_attention._backward(q, k, v, idx, o, do_row, lse, scale, 0)
    shifted = triton_attention._backward(q, k, v, idx, o, do, lse_shifted, scale, 0)
    for what, f, r, s, x in zip(("dq", "dk", "dv"), full, row, shifted, exact):
        assert rms_ratio(x, f) < _FP32_TOL, what
        assert float(r.abs().max()) > 1e-2, what  # the row contributes to every gradient
        assert float((s - f).abs().max()) > 1e-3, what  # so the perturbation is visible
        torch.testing.assert_close(s, f - 0.5 * r, rtol=0, atol=2e-6, msg=what)


def test_validation_matches_the_reference_and_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad inputs raise the reference's ValueError, message for message; CPU tensors with compiled
    (not interpreted) kernels raise an InputError naming TRITON_INTERPRET and the torch backend."""
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 6)
    idx = torch.zeros(1, 4, 3, dtype=torch.long)
    bad = [
        ((q[0], k, v, idx), {}),  # 3-D q
        ((q, k, v, idx[:, :3]), {}),  # indices of other length
        ((q, k[:, :, :, :4], v, idx), {}),  # D mismatch
        ((q, k, v, idx), {"q_offset": 2}),  # keys do not cover the offset queries
        ((q, k, v, idx), {"q_offset": -1}),
        ((torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), idx), {}),  # H % HK
        ((q, k, v, idx.to(torch.int16)), {}),
        ((q, k, v, idx), {"query_block": 0}),
    ]
    for args, kwargs in bad:
        with pytest.raises(ValueError) as ref_err:
            sparse_attention(*args, **kwargs)
        with pytest.raises(ValueError) as got_err:
            sparse_attention_triton(*args, **kwargs)
        assert str(got_err.value) == str(ref_err.value)
    # query_block is accepted and ignored: any positive value gives the same result
    assert torch.equal(sparse_attention_triton(q, k, v, idx, query_block=1), sparse_attention_triton(q, k, v, idx))
    monkeypatch.setattr(triton_attention, "_sparse_attn_fwd_kernel", object())  # as if compiled for a GPU
    with pytest.raises(InputError, match="TRITON_INTERPRET"):
        sparse_attention_triton(q, k, v, idx)
