"""MoE load balancing (genolong.model.moe, genolong.train.module): the sequence-wise balance loss
against an independent per-sequence computation and a finite-difference check of its gradient;
the capacity drop (dropped rows add nothing, the heaviest rows are kept, the count is exact);
the bias rules; and a collapsed router on `tiny` (8 experts, top-2) that the new options bring
back to max/mean <= 2 within 50 steps and the DeepSeek-V3 sign rule at its 0.001 rate does not,
with the collapse warned once.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from genolong.model import PRESETS
from genolong.model.layers import clamped_swiglu
from genolong.model.moe import MoE, RoutingStats, capacity_keep
from genolong.train.module import routing_bias_step
from tests.scenarios import sample_windows, train_collapsed

pytestmark = pytest.mark.usefixtures("one_thread")

_CONFIG = PRESETS["tiny"].replace(n_routed_experts=8)


def _moe(seed: int = 0, chunk_tokens: int | None = None) -> MoE:
    torch.manual_seed(seed)
    return MoE(_CONFIG, chunk_tokens=chunk_tokens)


def _reference_balance_loss(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sum_i f_i P_i per sequence (row of ``x [B, T, H]``), averaged over the rows,
    written out from the router's outputs one sequence at a time."""
    e, k = moe.gate.num_experts, moe.gate.top_k
    losses = []
    for row in x:
        logits, _, indices = moe.gate(row)
        scores = logits.sigmoid()
        p = scores / scores.sum(-1, keepdim=True)
        t = row.shape[0]
        chosen = torch.zeros(e).index_add_(0, indices.reshape(-1), torch.ones(indices.numel()))
        f = e / (k * t) * chosen
        losses.append((f * p.mean(0)).sum())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("chunk_tokens", [None, 7])
def test_balance_loss_equals_the_per_sequence_formula(chunk_tokens: int | None) -> None:
    # chunks of 7 tokens cut across the two 19-token sequences: the loss is still per sequence
    moe = _moe(chunk_tokens=chunk_tokens)
    moe.balance_loss_weight = 1.0
    x = torch.randn(2, 19, _CONFIG.hidden_size)
    moe(x)
    want = _reference_balance_loss(moe, x).detach()
    # fp32 sums in another order: a few float32 ulps of a value near 1
    assert moe.last_balance_loss is not None and abs(float(moe.last_balance_loss) - float(want)) < 1e-6
    # the output is the MoE's own: the loss only adds a gradient
    plain = _moe(chunk_tokens=chunk_tokens)
    assert torch.equal(plain(x), moe(x))
    assert plain.last_balance_loss is None


def test_balance_loss_gradient_matches_finite_differences() -> None:
    moe = _moe()
    alpha = 0.5
    moe.balance_loss_weight = alpha
    x = torch.randn(2, 33, _CONFIG.hidden_size)
    out = moe(x)
    indices = moe.gate(x.reshape(-1, x.shape[-1]))[2]
    (out * 0).sum().backward()  # the output's own gradient is zero: what reaches the router is alpha * dL/dw
    grad = moe.gate.weight.grad.double() / alpha
    torch.manual_seed(3)
    direction = torch.randn_like(moe.gate.weight)
    direction /= direction.norm()
    h = 1e-3
    values = []
    with torch.no_grad():
        for sign in (1, -1):
            moe.gate.weight += sign * h * direction
            # the routing (hence f) must not change across the step, or the loss is not smooth there
            assert torch.equal(moe.gate(x.reshape(-1, x.shape[-1]))[2], indices)
            values.append(float(_reference_balance_loss(moe, x)))
            moe.gate.weight -= sign * h * direction
    numeric = (values[0] - values[1]) / (2 * h)
    analytic = float((grad * direction.double()).sum())
    # central difference in fp32: the loss (~1) carries ~1e-7 rounding, over 2h = 2e-3 that is
    # ~1e-4 absolute; the truncation error is O(h^2)
    assert abs(numeric - analytic) < 2e-4 + 1e-2 * abs(analytic), (numeric, analytic)
    assert abs(analytic) > 1e-3  # a real gradient, not zero against zero


def _expert_out(moe: MoE, x: torch.Tensor, expert: int) -> torch.Tensor:
    gate, up = F.linear(x, moe.experts.gate_up_proj[expert]).chunk(2, dim=-1)
    return F.linear(clamped_swiglu(gate, up, moe.experts.limit), moe.experts.down_proj[expert])


def test_capacity_drops_the_lightest_rows_and_they_add_nothing() -> None:
    moe = _moe()
    with torch.no_grad():  # most tokens want expert 0: a capacity of 1.0 must drop rows
        moe.gate.e_score_correction_bias[0] = 1.0
    moe.capacity_factor = 1.0
    x = torch.randn(1, 40, _CONFIG.hidden_size)
    out = moe(x)
    flat = x.reshape(-1, x.shape[-1])
    _, weights, indices = moe.gate(flat)
    weights = weights.detach()
    e, k = _CONFIG.n_routed_experts, _CONFIG.num_experts_per_tok
    capacity = math.ceil(1.0 * 40 * k / e)
    keep = capacity_keep(indices, weights, e, capacity)
    stats = moe.last_routing
    assert stats is not None
    assert int(stats.dropped) == int((~keep).sum()) > 0  # exact: row counts
    assert int(stats.load.max()) <= capacity
    assert int(stats.load.sum() + stats.dropped) == 40 * k
    # per expert, every kept row weighs at least as much as every dropped one
    for expert in range(e):
        mine = indices == expert
        kept, dropped = weights[mine & keep], weights[mine & ~keep]
        if len(kept) and len(dropped):
            assert float(kept.min()) >= float(dropped.max())
    # the output from the kept rows only, written out token by token
    want = moe.shared_experts(flat).clone()
    for t in range(40):
        for j in range(k):
            if keep[t, j]:
                want[t] += weights[t, j] * _expert_out(moe, flat[t : t + 1], int(indices[t, j]))[0]
    assert torch.allclose(out.reshape(-1, x.shape[-1]), want, rtol=1e-5, atol=1e-6)  # index_add order vs a loop
    # evaluation never drops
    moe.eval()
    moe(x)
    assert int(moe.last_routing.dropped) == 0


def test_capacity_keep_is_all_rows_when_they_fit() -> None:
    indices = torch.tensor([[0, 1], [0, 2], [0, 3]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5]])
    assert bool(capacity_keep(indices, weights, 4, 3).all())
    # capacity 2: expert 0's lightest row (token 2, weight 0.5) goes
    assert capacity_keep(indices, weights, 4, 2).tolist() == [[True, True], [True, True], [False, True]]


def test_bias_rules() -> None:
    load = torch.tensor([8.0, 0.0, 0.0, 0.0])  # mean 2
    assert routing_bias_step(load, 0.01, "sign").tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert routing_bias_step(load, 0.01, "proportional").tolist() == pytest.approx([-0.03, 0.01, 0.01, 0.01])
    near = torch.tensor([2.1, 1.9, 2.0, 2.0])
    assert routing_bias_step(near, 0.01, "proportional").abs().max() < 0.001  # balanced: barely moves
    with pytest.raises(ValueError, match="moe_bias_update"):
        routing_bias_step(load, 0.01, "inverse")


def test_routing_stats_summary() -> None:
    stats = RoutingStats(torch.tensor([10, 0, 6, 0]), torch.tensor(4), torch.tensor(8.0, dtype=torch.float64), 10)
    s = stats.summary()
    assert s["load_max_over_mean"] == pytest.approx(10 / 4)
    assert s["dead_fraction"] == 0.5 and s["top_expert_share"] == 1.0
    assert s["router_entropy"] == pytest.approx(0.8) and s["dropped_fraction"] == pytest.approx(4 / 20)


# -- a collapsed router on tiny (tests/scenarios.py; experiments/bundled-base/moe_collapse.py) ----


def test_collapsed_router_recovers_with_the_balance_loss_not_with_the_sign_rule(
    caplog: pytest.LogCaptureFixture,
) -> None:
    windows = sample_windows()
    with caplog.at_level(logging.WARNING, logger="genolong"):
        old = train_collapsed(windows, moe_bias_rate=0.001, moe_bias_update="sign")
    warned = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
    assert len(warned) == 1 and "MoE layer" in warned[0] and "train.moe_balance_loss_weight" in warned[0], warned
    new = train_collapsed(windows, moe_bias_rate=0.001, moe_bias_update="sign", moe_balance_loss_weight=0.1)
    print(
        "worst layer max/mean every 5 steps, old:",
        [round(x, 2) for x in old[::5]],
        "new:",
        [round(x, 2) for x in new[::5]],
    )
    assert len(old) == len(new) == 50
    assert old[0] > 3.5 and new[0] > 3.5  # both start collapsed: 4.0 is every token on one expert
    assert min(old) > 3.0  # the sign rule moves each bias by at most 50 x 0.001 = 0.05
    assert min(new) <= 2.0 and float(np.mean(new[-5:])) <= 2.0
