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
from genolong.kernels.dsa import sparse_attention, triton_attention
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
    scale = 0.7 * D**-0.5  # not the default: the scale must reach both kernels
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
    scale = D**-0.5
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


# --- the key-major backward: inverse index lists, split key tiles, determinism, mixed dtypes -----

#: (B, T, TK, q_offset, H, HK, D, DV, topk, index dtype, k is v): odd lengths; G = 3 pads the head
#: group to 4 rows per query in the key-major kernel; 63 keys = 4 key tiles of 16, the last partial
CASES_KEY_MAJOR = {
    "odd_63_gqa3": (1, 63, 63, 0, 6, 2, 12, 20, 21, torch.int64, False),
    "odd_latent_offset": (2, 31, 50, 19, 4, 1, 32, 32, 21, torch.int32, True),
}


def _key_lists_oracle(idx: torch.Tensor, TK: int, q_offset: int, bk: int) -> dict:
    """``{(b, tile, t): bits}`` by enumerating every slot in Python."""
    out: dict = {}
    B, T, K = idx.shape
    for b in range(B):
        for t in range(T):
            for s in idx[b, t].tolist():
                if 0 <= s <= q_offset + t:
                    key = (b, s // bk, t)
                    assert not out.get(key, 0) & (1 << (s % bk))
                    out[key] = out.get(key, 0) | (1 << (s % bk))
    return out


def test_key_lists_are_the_inverse_of_the_indices() -> None:
    """The sorted (batch, key tile, query) entries and their selection bits are exactly the valid
    slots of ``indices`` (no -1, no future slot), in order; the segments tile each list."""
    B, T, TK, off, K, bk = 2, 29, 40, 11, 13, 16
    idx = _indices(B, T, TK, K, off, torch.int64, seed=3)
    lists = triton_attention._key_lists(idx, TK, off, bk)
    NT = -(-TK // bk)
    expect = _key_lists_oracle(idx, TK, off, bk)
    got = {}
    starts = torch.cumsum(lists.counts, 0) - lists.counts
    for g in range(B * NT):
        ts = lists.ent_t[starts[g] : starts[g] + lists.counts[g]].tolist()
        assert ts == sorted(ts) and len(set(ts)) == len(ts)
        for e in range(int(starts[g]), int(starts[g] + lists.counts[g])):
            got[(g // NT, g % NT, int(lists.ent_t[e]))] = int(lists.ent_bits[e])
    assert got == expect and len(expect) > NT  # several queries per key tile
    segs = triton_attention._segments(lists.counts, 3)
    assert int(segs.red_tile.numel()) > 0  # some tiles split
    covered = torch.zeros(int(lists.counts.sum()), dtype=torch.int64)
    for i in range(segs.tile.numel()):
        s0, s1, g = int(segs.start[i]), int(segs.end[i]), int(segs.tile[i])
        assert starts[g] <= s0 < s1 <= starts[g] + lists.counts[g] and s1 - s0 <= 3
        covered[s0:s1] += 1
    assert bool((covered == 1).all())
    for g, s0, n in zip(segs.red_tile.tolist(), segs.red_slot0.tolist(), segs.red_n.tolist()):
        mine = segs.slot[segs.tile == g].tolist()
        assert mine == list(range(s0, s0 + n))  # a split tile's slots are contiguous, in order


@pytest.mark.parametrize("name", list(CASES_KEY_MAJOR))
def test_key_major_backward_odd_shapes_float32(name: str) -> None:
    """fp32, odd shapes (padded head group, partial last key tile, q_offset, several queries per key):
    o and every gradient within RMS ratio 1e-5 of the reference and the float64 oracle."""
    got, ref, exact, mask, _ = _run(CASES_KEY_MAJOR[name], torch.float32, seed=13)
    for what, a, r, x in zip(("o", "dq", "dk", "dv"), got, ref, exact):
        assert rms_ratio(r, a) < _FP32_TOL, (what, rms_ratio(r, a))
        assert rms_ratio(x, a) < _FP32_TOL, (what, rms_ratio(x, a))
    unselected = ~mask.any(1)
    assert float(got[2].detach()[unselected].abs().max()) == 0.0


@pytest.mark.parametrize("share", [False, True], ids=["separate_kv", "k_is_v"])
def test_split_key_tiles_and_head_splits_match_the_oracle(monkeypatch: pytest.MonkeyPatch, share: bool) -> None:
    """The paths the GLM-5.3-Flash shapes take, at interpreter sizes: key tiles whose query lists
    are split into segments (float32 partials summed by the reduction kernel, its columns split over
    programs), a key-major step
    holding part of one query's heads (head group 32 > 16 rows) and the dQ head group split over
    two programs. fp32 within 1e-5 of the float64 oracle; the split run equals the unsplit one up
    to float32 summation order."""
    monkeypatch.setattr(triton_attention, "_DKV_ROWS", 16)
    monkeypatch.setattr(triton_attention, "_DQ_ACC_ELEMS", 256)
    # the reduction's columns over two programs (16 = 2 x 8), as the 256-512 wide latents run on a GPU
    monkeypatch.setattr(triton_attention, "_DKV_REDUCE_COLS", 8)
    assert triton_attention._dq_config(32, 12, 16, 16, 4)[0] == 2
    assert triton_attention._key_major_config(32, 16, 16, 4)[1] == 16
    B, T, H, HK, D, K = 1, 19, 32, 1, 16, 7
    q, k, v = (x.detach() for x in _inputs(B, T, T, H, HK, D, D, torch.float32, seed=21, share_kv=share))
    q, v = q.contiguous(), (k if share else v)  # detach() broke the identity
    idx = _indices(B, T, T, K, 0, torch.int64, seed=21)
    first = torch.arange(T) % 3  # keys 0..2: one selected by every query, a long list for tile 0
    idx = torch.where(idx == first[None, :, None], -1, idx)  # indices stay distinct within a row
    idx[:, :, 0] = first
    scale = D**-0.5
    do = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(22))
    o, lse = triton_attention._forward(q, k, v, idx, scale, 0)
    split = triton_attention._backward(q, k, v, idx, o, do, lse, scale, 0, segment=4)
    whole = triton_attention._backward(q, k, v, idx, o, do, lse, scale, 0, segment=10**6)
    lists = triton_attention._key_lists(idx, T, 0, triton_attention._DKV_BLOCK_K)
    assert int(lists.counts[0]) > 4  # tile 0 really is split at segment = 4
    leaves64 = [x.double().requires_grad_(True) for x in ((q, k) if share else (q, k, v))]
    v64 = leaves64[1] if share else leaves64[2]
    o64 = _dense_oracle(leaves64[0], leaves64[1], v64, idx, scale, 0)[0]
    exact = torch.autograd.grad(o64, leaves64, do.double())
    assert rms_ratio(o64, o) < _FP32_TOL
    for what, a, b, x in zip(("dq", "dk", "dv"), split, whole, exact):
        assert rms_ratio(x, a) < _FP32_TOL, (what, rms_ratio(x, a))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


@pytest.mark.parametrize("share", [False, True], ids=["separate_kv", "k_is_v"])
def test_backward_is_deterministic(share: bool) -> None:
    """No atomics: two backward calls on the same inputs give bitwise equal gradients (fp16)."""
    case = (1, 33, 33, 0, 4, 1, 16, 16, 20, torch.int64, share)
    B, T, TK, off, H, HK, D, DV, K, idt, _ = case
    q, k, v = _inputs(B, T, TK, H, HK, D, DV, torch.float16, seed=31, share_kv=share)
    idx = _indices(B, T, TK, K, off, idt, seed=31)
    leaves = (q, k) if share else (q, k, v)
    do = torch.randn(B, T, H, DV, generator=torch.Generator().manual_seed(32)).half()
    runs = [torch.autograd.grad(sparse_attention_triton(q, k, v, idx), leaves, do) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_mixed_dtypes_run_16bit_dots() -> None:
    """fp16 queries with an fp32 latent (``v is k``; bf16-mixed training's form, fp16 standing in
    for bf16, which the interpreter cannot run): the kernels round the latent to fp16 as they load
    it, so o, dq and dk equal, bit for bit, a run on the latent rounded to fp16 beforehand (dk
    returned in fp32); the error against the float64 oracle on the mixed inputs stays within twice
    the torch reference's error on the rounded inputs."""
    B, T, H, C, K = 1, 29, 4, 32, 14
    g = torch.Generator().manual_seed(41)
    q = torch.randn(B, T, H, C, generator=g).half().requires_grad_(True)
    lat = torch.randn(B, T, 1, C, generator=g).requires_grad_(True)  # float32
    idx = _indices(B, T, T, K, 0, torch.int64, seed=41)
    do = torch.randn(B, T, H, C, generator=g).half()
    o = sparse_attention_triton(q, lat, lat, idx)
    dq, dk = torch.autograd.grad(o, (q, lat), do)
    assert o.dtype == dq.dtype == torch.float16 and dk.dtype == torch.float32
    lat16 = lat.detach().half().requires_grad_(True)
    o16 = sparse_attention_triton(q, lat16, lat16, idx)
    dq16, dk16 = torch.autograd.grad(o16, (q, lat16), do)
    assert torch.equal(o, o16) and torch.equal(dq, dq16) and torch.equal(dk.half(), dk16)
    # accuracy: against the float64 oracle on the mixed inputs themselves
    q64, l64 = q.detach().double().requires_grad_(True), lat.detach().double().requires_grad_(True)
    o64 = _dense_oracle(q64, l64, l64, idx, C**-0.5, 0)[0]
    exact = torch.autograd.grad(o64, (q64, l64), do.double())
    ref = sparse_attention(q, lat16, lat16, idx)
    ref_grads = torch.autograd.grad(ref, (q, lat16), do)
    for what, a, r, x in zip(("o", "dq", "dk"), (o, dq, dk), (ref, *ref_grads), (o64, *exact)):
        err, ref_err = rms_ratio(x, a), rms_ratio(x, r)
        assert 0 < ref_err < 2e-3, (what, ref_err)
        assert err <= 2.0 * ref_err, (what, err, ref_err)
