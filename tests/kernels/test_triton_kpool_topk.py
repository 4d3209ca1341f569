"""Triton KPool indexer top-k (kernels/dsa/triton_topk.py) under the Triton interpreter.

The selection must be IDENTICAL to the torch reference :func:`genolong.kernels.dsa.kpool_topk`
(same token indices in the same order) and to an independent dense float64 oracle (a stable sort:
equal scores keep the lower pool first). The two implementations sum in different orders, so most
inputs here lie on a dyadic grid (multiples of 1/4 in [-2, 2], scale a power of two) where every
score is exact in float32 whatever the order: equal selections are then the only correct answer,
and the grid makes exact ties common (ReLU zeros, equal sums), which exercises the tie rule.
One case uses generic normal inputs. Triton is a test dependency: a missing triton fails this
module (no skip). The interpreter runs each program in numpy (slowly): sizes are small.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a missing triton must fail here, not skip; tests/conftest.py sets TRITON_INTERPRET=1)

from genolong.errors import InputError
from genolong.kernels.dsa import kpool_expand, kpool_topk, triton_topk
from genolong.kernels.dsa.triton_topk import kpool_topk_triton
from tests.helpers import spy_on_launches

pytestmark = pytest.mark.usefixtures("one_thread")


def _grid(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Multiples of 1/4 in [-2, 2]: exact in fp16, products and short sums exact in fp32."""
    return torch.randint(-8, 9, shape, generator=g).float() / 4


def _dense_oracle(q_idx, k_pool, w_idx, ksel: int, P: int, scale: float, activation) -> torch.Tensor:
    """Selected pools ``[B, T, ksel]`` int64 from the dense float64 score matrix (independent of
    both implementations' key packing): ineligible pools -inf, stable descending sort (ties keep
    the lower pool first), ``-1`` where fewer than ``ksel`` pools are eligible."""
    B, T = q_idx.shape[:2]
    NP = k_pool.shape[1]
    z = torch.einsum("bthd,bnd->bthn", q_idx.double() * scale, k_pool.double())
    if activation == "relu":
        z = z.relu()
    w = torch.ones(q_idx.shape[:3], dtype=torch.float64) if w_idx is None else w_idx.double()
    s = torch.einsum("bth,bthn->btn", w, z) + 0.0  # + 0.0: -0.0 ties with +0.0
    eligible = (torch.arange(NP)[None, :] + 1) * P - 1 <= torch.arange(T)[:, None]  # [T, NP]
    s = s.masked_fill(~eligible, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :ksel]
    order = order.masked_fill(~eligible[None].expand(B, T, NP).gather(-1, order), -1)
    return torch.nn.functional.pad(order, (0, ksel - order.shape[-1]), value=-1)


def _boundary_ties(q_idx, k_pool, w_idx, pools: torch.Tensor, P: int, scale: float, activation) -> int:
    """Rows (b, t) whose last selected pool scores exactly as well as some unselected eligible pool."""
    T, NP = q_idx.shape[1], k_pool.shape[1]
    z = torch.einsum("bthd,bnd->bthn", q_idx.double() * scale, k_pool.double())
    z = z.relu() if activation == "relu" else z
    s = z.sum(2) if w_idx is None else torch.einsum("bth,bthn->btn", w_idx.double(), z)
    eligible = (torch.arange(NP)[None, :] + 1) * P - 1 <= torch.arange(T)[:, None]
    full = pools[..., -1] >= 0  # rows with a full selection
    kth = s.gather(-1, pools[..., -1:].clamp_min(0))[..., 0]
    rest = s.masked_fill(~eligible, float("-inf")).scatter(-1, pools.clamp_min(0), float("-inf"))
    return int((full & (rest.amax(-1) == kth)).sum())


# name: (dtype, B, T, HI, DI, P, topk, with w, activation, tail, block_size, query_block, scale)
CASES = {
    # 3 pools kept (buffer padded to 4), 2 pool tiles, 5 query blocks, T % P = 1, tail on
    "fp32_w_relu_tail": (torch.float32, 2, 77, 3, 16, 4, 12, True, "relu", True, 16, 16, None),
    # fp16, no activation (negative scores), tail off, P = 3, 2 pools kept, DI padded 12 -> 16;
    # a negative scale: with ReLU or identity a positive scale cannot change any selection, a
    # negative one reverses the identity scores, so this is the case that sees the scale at all
    "fp16_w_identity_no_tail": (torch.float16, 2, 61, 2, 12, 3, 6, True, None, False, 16, 16, -0.5),
    # one head without weights (the reference's HI == 1 view path), P = 5, T % 16 and T % P != 0
    "fp32_no_w_one_head": (torch.float32, 2, 53, 1, 16, 5, 10, False, "relu", True, 16, 16, None),
    # fp16, no weights, identity, wider tiles (32 queries x 32 pools), 4 pools kept
    "fp16_no_w_identity_wide_tiles": (torch.float16, 2, 70, 2, 16, 2, 8, False, None, True, 40, 40, 0.25),
    # 16 pools kept: the buffer is as wide as the pool tile (no per-tile top-k), 3 pool tiles
    "fp32_buffer_as_wide_as_tile": (torch.float32, 2, 70, 2, 16, 2, 32, True, "relu", False, 16, 16, None),
    # one pool kept (the k = 1 top-k path) and P = 17 > 16 queries: the first query block sees no
    # pool at all (an empty walk: every slot -1)
    "fp32_one_pool_long_pools": (torch.float32, 2, 60, 2, 16, 17, 17, True, "relu", True, 16, 16, None),
}


def _case_inputs(case, seed: int):
    dtype, B, T, HI, DI, P, topk, with_w, _, _, _, _, _ = case
    g = torch.Generator().manual_seed(seed)
    q = _grid(g, B, T, HI, DI).to(dtype)
    k = _grid(g, B, T // P, DI).to(dtype)
    w = _grid(g, B, T, HI) if with_w else None
    return q, k, w


@pytest.mark.parametrize("name", list(CASES))
def test_grid_inputs_select_exactly_the_reference_pools(name: str) -> None:
    """Token indices equal to the reference's (values and order) and to the dense float64 oracle
    expanded the same way: fp32/fp16, with/without w_idx, ReLU/identity, tail on/off, odd T, -1
    padding for early queries, and rows whose selection boundary is an exact tie."""
    dtype, B, T, HI, DI, P, topk, _, act, tail, bs, qb, scale = CASES[name]
    q, k, w = _case_inputs(CASES[name], seed=len(name) + 1)  # seeds whose cases all hold boundary ties
    got = kpool_topk_triton(q, k, w, topk, P, tail=tail, block_size=bs, query_block=qb, scale=scale, activation=act)
    ref = kpool_topk(q, k, w, topk, P, tail=tail, block_size=7, query_block=9, scale=scale, activation=act)
    ksel = topk // P
    oracle_pools = _dense_oracle(q, k, w, ksel, P, DI**-0.5 if scale is None else scale, act)
    oracle = kpool_expand(oracle_pools, P, tail)
    assert got.dtype == torch.int64 and got.shape == ref.shape == (B, T, topk + (P - 1 if tail else 0))
    assert torch.equal(got, ref)
    assert torch.equal(got, oracle)
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)  # as sets (implied; kept explicit)
    # the case really covers -1 padding (queries with fewer than ksel visible pools) ...
    assert bool((oracle_pools[:, ksel * P - 2] == -1).any()) and bool((oracle_pools[:, -1] >= 0).all())
    # ... and rows whose selection boundary is an exact tie (broken by the lowest pool)
    assert _boundary_ties(q, k, w, oracle_pools, P, DI**-0.5 if scale is None else scale, act) > 0


def test_planted_ties_lowest_pool_wins_across_tiles() -> None:
    """Pools with identical keys score identically: the lower pool is kept and ranked first, also
    when the twins sit in different pool tiles, and a query with all scores equal (q = 0) gets the
    lowest pools 0, 1, ... in order."""
    B, T, HI, DI, P, topk = 2, 90, 2, 16, 4, 16  # 22 pools, tiles of 16: pools 16.. in the 2nd tile
    g = torch.Generator().manual_seed(3)
    q = _grid(g, B, T, HI, DI).abs()  # non-negative queries
    k = -_grid(g, B, T // P, DI).abs()  # non-positive keys: every ordinary score is <= 0
    k[:, [5, 18]] = 2.0  # the best pair of twins (one per tile)
    k[:, [2, 9, 20]] = 1.0  # the second best triple
    q[1, 60] = 0.0  # all scores 0 for this query
    w = torch.ones(B, T, HI)
    got = kpool_topk_triton(q, k, w, topk, P, tail=False, block_size=16, query_block=16, activation=None)
    ref = kpool_topk(q, k, w, topk, P, tail=False, activation=None)
    assert torch.equal(got, ref)
    pools = got[..., ::P] // P  # first token of each selected pool -> pool id
    assert bool((q[:, T - 1].sum() > 0).all())
    assert pools[0, T - 1].tolist() == [5, 18, 2, 9]  # 20 ties with 2 and 9 and loses
    assert pools[0, 75].tolist() == [5, 18, 2, 9]  # pool 18 just became visible ((18 + 1) * 4 - 1 = 75)
    assert pools[0, 74].tolist()[:3] == [5, 2, 9]  # before it: 5 first, the triple, then the rest
    assert pools[1, 60].tolist() == [0, 1, 2, 3]  # all-equal row: lowest pools, in order


def test_generic_normal_inputs_match_the_reference() -> None:
    """Normal (non-grid) fp32 inputs, q_idx a non-contiguous view: both sides round differently,
    yet no selection boundary of this seeded instance lies within float32 rounding, so the
    selections must be equal."""
    B, T, HI, DI, P, topk = 2, 66, 3, 16, 4, 12
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, HI, T, DI, generator=g).transpose(1, 2)  # [B, T, HI, DI], strided
    k, w = torch.randn(B, T // P, DI, generator=g), torch.randn(B, T, HI, generator=g)
    assert not q.is_contiguous()
    got = kpool_topk_triton(q, k, w, topk, P, block_size=16, query_block=16, scale=0.3)
    ref = kpool_topk(q, k, w, topk, P, scale=0.3)
    assert torch.equal(got, ref)
    assert torch.equal(got, kpool_expand(_dense_oracle(q, k, w, topk // P, P, 0.3, "relu"), P, True))


def test_validation_matches_the_reference_and_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's ValueErrors message for message; inputs the reference only fails on deep
    inside (its matmuls) raise a one-line InputError here; topk = 0 gives the tail only, as the
    reference; CPU tensors with compiled (not interpreted) kernels raise an InputError naming
    TRITON_INTERPRET and the torch backend."""
    q, k, w = torch.randn(1, 32, 2, 8), torch.randn(1, 8, 8), torch.randn(1, 32, 2)
    same = [
        ((q, k, w, 18, 4), {}),  # topk not divisible by P
        ((q, k, w, 16, 0), {}),  # P < 1
        ((q, k[:, :7], w, 16, 4), {}),  # k_pool: wrong number of pools
        ((q, torch.randn(1, 8, 6), w, 16, 4), {}),  # k_pool: wrong DI
    ]
    for args, kwargs in same:
        with pytest.raises(ValueError) as ref_err:
            kpool_topk(*args, **kwargs)
        with pytest.raises(ValueError) as got_err:
            kpool_topk_triton(*args, **kwargs)
        assert str(got_err.value) == str(ref_err.value)
    stricter = [
        ((q[0], k, w, 16, 4), {}, "q_idx"),
        ((q, k, w[:, :, :1], 16, 4), {}, "w_idx"),
        ((q, k, w, 16, 4), {"block_size": 0}, "block_size"),
    ]
    for args, kwargs, word in stricter:
        with pytest.raises(Exception):  # noqa: B017 - the reference fails too, less clearly (its own error types)
            kpool_topk(*args, **kwargs)
        with pytest.raises(InputError, match=word):
            kpool_topk_triton(*args, **kwargs)
    with pytest.raises(InputError, match="activation"):  # the reference would run gelu; the kernel has none
        kpool_topk_triton(q, k, w, 16, 4, activation="gelu")
    assert torch.equal(kpool_topk_triton(q, k, w, 0, 4), kpool_topk(q, k, w, 0, 4))  # tail only
    monkeypatch.setattr(triton_topk, "_kpool_topk_kernel", object())  # as if compiled for a GPU
    with pytest.raises(InputError, match="TRITON_INTERPRET"):
        kpool_topk_triton(q, k, w, 16, 4)


def test_mixed_16bit_queries_and_fp32_keys_dot_in_16bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16-mixed autocast hands the op 16-bit index queries and fp32 pooled keys (out of a
    LayerNorm): the keys are rounded to the 16-bit dtype (as autocast's matmul would) so that the
    GPU dots run on tensor cores, and the selection equals the reference's on the same rounded keys
    (fp16 here: the interpreter's bf16 is broken). The keys are off the fp16 grid, so the rounding
    changes scores; the reference on the unrounded fp32 keys is shown to select differently, so the
    comparison can tell the two roundings apart."""
    B, T, HI, DI, P, topk = 2, 77, 3, 16, 4, 12
    g = torch.Generator().manual_seed(5)
    q = _grid(g, B, T, HI, DI).half()
    # fp32 keys between fp16 neighbours: k16 on the grid plus an offset that fp16 rounds away
    k16 = _grid(g, B, T // P, DI)
    k = k16 * (1 + (torch.rand(B, T // P, DI, generator=g) - 0.5) * 2**-12)  # < half an fp16 ulp
    assert not torch.equal(k.half().float(), k) and torch.equal(k.half().float(), k16)
    w = _grid(g, B, T, HI)
    seen = spy_on_launches(monkeypatch, triton_topk._kpool_topk_kernel)
    got = kpool_topk_triton(q, k, w, topk, P, block_size=16, query_block=16)
    assert seen and seen[0][:2] == [torch.float16, torch.float16]  # q_idx and k_pool as dot operands
    ref = kpool_topk(q, k.half(), w, topk, P)
    assert torch.equal(got, ref)
    assert torch.equal(got, kpool_expand(_dense_oracle(q, k16, w, topk // P, P, DI**-0.5, "relu"), P, True))
    # the fp32 keys themselves select differently on this instance (ties on the grid are broken
    # by the offsets), so equality above is not an accident of rounding-insensitive inputs
    assert not torch.equal(got, kpool_topk(q.float(), k, w, topk, P))


# name: (case, first query q0, end q1): queries [q0, q1) at q_offset = q0 over the case's pools of
# the whole sequence (a key range longer than they can see: pools past q1 are never read)
OFFSET_CASES = {
    # a multiple of P (a CP rank or recompute segment start), rows cut mid-pool-tile
    "fp32_w_relu_tail_at_24": ("fp32_w_relu_tail", 24, 61),
    # not a multiple of P (3): the tail of the first rows starts before q_offset
    "fp16_identity_no_tail_at_13": ("fp16_w_identity_no_tail", 13, 50),
    # P = 17: rows 30..32 see pool 0 only, 33..49 pools 0 and 1; pool 2 (complete at 50) is in
    # the key range but past every query's reach
    "fp32_long_pools_at_30": ("fp32_one_pool_long_pools", 30, 50),
}


@pytest.mark.parametrize("name", list(OFFSET_CASES))
def test_query_offset_and_key_range_select_the_whole_sequence_rows(name: str) -> None:
    """A range of queries at ``q_offset`` over the pooled keys of a longer range (a context-parallel
    rank, a recompute segment): the kernel's selection equals the reference's at the same offset,
    the rows ``[q0, q1)`` of the whole-sequence selection (token positions global, tails included)
    and the dense oracle's rows; with exactly the pools the range sees the result is the same."""
    case_name, q0, q1 = OFFSET_CASES[name]
    dtype, B, T, HI, DI, P, topk, _, act, tail, bs, qb, scale = CASES[case_name]
    q, k, w = _case_inputs(CASES[case_name], seed=len(case_name) + 1)
    qs, ws = q[:, q0:q1], None if w is None else w[:, q0:q1]
    kw = dict(tail=tail, scale=scale, activation=act)
    got = kpool_topk_triton(qs, k, ws, topk, P, block_size=bs, query_block=qb, q_offset=q0, **kw)
    exact_range = kpool_topk_triton(qs, k[:, : q1 // P], ws, topk, P, block_size=bs, query_block=qb, q_offset=q0, **kw)
    ref = kpool_topk(qs, k, ws, topk, P, block_size=7, query_block=9, q_offset=q0, **kw)
    whole = kpool_topk(q, k, w, topk, P, **kw)
    oracle = kpool_expand(_dense_oracle(q, k, w, topk // P, P, DI**-0.5 if scale is None else scale, act), P, tail)
    assert k.shape[1] > q1 // P  # the key range is longer than the queries' reach
    assert got.shape == (B, q1 - q0, topk + (P - 1 if tail else 0))
    assert torch.equal(got, ref)
    assert torch.equal(got, exact_range)
    assert torch.equal(got, whole[:, q0:q1])
    assert torch.equal(got, oracle[:, q0:q1])
    assert bool((got[..., :topk] >= q0).any())  # pools past the offset are selected: global ids


def test_query_offset_validation_matches_the_reference() -> None:
    """Too few pools for the range's reach and a negative offset: the same ValueError as the reference."""
    q, k, w = torch.randn(1, 16, 2, 8), torch.randn(1, 8, 8), torch.randn(1, 16, 2)
    for args, kwargs in [
        ((q, k[:, :5], w, 8, 4), {"q_offset": 8}),  # queries 8..23 see 6 pools
        ((q, k, w, 8, 4), {"q_offset": -4}),
    ]:
        with pytest.raises(ValueError) as ref_err:
            kpool_topk(*args, **kwargs)
        with pytest.raises(ValueError) as got_err:
            kpool_topk_triton(*args, **kwargs)
        assert str(got_err.value) == str(ref_err.value)
    assert torch.equal(
        kpool_topk_triton(q, k[:, :6], w, 8, 4, q_offset=8), kpool_topk(q, k[:, :6], w, 8, 4, q_offset=8)
    )
