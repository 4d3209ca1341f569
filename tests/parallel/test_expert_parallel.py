"""Expert parallelism (genolong.parallel.expert) on gloo: the `tiny` GenoLM with its routed experts
spread over EP 2 and EP 4 ranks (each rank its own window), and on a 2 x 2 (dp_shard x cp) mesh
with EP 2, full recompute and FSDP2 (the experts a nested unit over the ranks holding the same
experts), equals one process on all the windows: hidden states, loss and every gradient
(experts gathered whole) to RMS(ref - x) / RMS(ref) < 1e-5, except where the fp32 and float64
single-process runs are further apart than that (then within twice that gap, as in
tests/parallel/test_cp_model.py). The routing is checked to be the same (global expert loads equal as
integers), so no router tie flipped between the two runs.

The all-to-all byte counter is checked against the interfaces.md formula at exactly balanced
routing (a router that sends token i's slots to experts 2i, 2i + 1 mod E).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from genolong.config import ParallelSection
from genolong.data.windows import context_parallel_bounds
from genolong.errors import InputError
from genolong.kernels.testing import rms_ratio
from genolong.model import PRESETS, GenoLM
from genolong.model.moe import MoE
from genolong.parallel import parallelize
from genolong.parallel.expert import apply_expert_parallel, ep_comm_counter
from genolong.parallel.mesh import build_mesh, cp_rank, cp_size, dp_rank, ep_size, expert_mesh, mesh_shape
from genolong.parallel.offload import ActivationOffloader
from genolong.plan import ep_comm_bytes
from genolong.train.module import clip_grad_norm_by_mesh
from tests.helpers import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

_TOL = 1e-5
_LR = 0.5
# 16 index heads keep exact top-k ties out of the pooled scores (see tests/model/test_model_dsa.py)
_CONFIG = PRESETS["tiny"].replace(index_n_heads=16)


def _loads(model: GenoLM) -> torch.Tensor:
    return torch.stack([m.last_load for m in model.modules() if isinstance(m, MoE)])


def _case(windows: int, total: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = GenoLM(_CONFIG)
    ids = torch.randint(1, 5, (windows, total))
    probe = torch.randn(windows, total, _CONFIG.hidden_size)
    return {"state": model.state_dict(), "ids": ids, "probe": probe}


def _reference(case: dict, dtype: torch.dtype) -> dict:
    model = GenoLM(_CONFIG).to(dtype)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in case["state"].items()})
    hidden = model(case["ids"])
    (hidden * case["probe"].to(dtype)).sum().backward()
    return {
        "hidden": hidden.detach().float(),
        "loads": _loads(model),
        "grads": {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None},
    }


def _balanced_bytes(ep: int, chunks: int, c: int) -> dict[str, int]:
    """The planner's formula (:func:`genolong.plan.ep_comm_bytes`, summed over the
    model's MoE layers) for one MoE layer: dispatch and combine ``(ep - 1) / ep * c * k * H * a``
    per chunk, backward the two again, ``E/ep`` int64 counts to each other rank per dispatch."""
    n_moe = sum(t == "sparse" for t in _CONFIG.mlp_layer_types)
    whole = ep_comm_bytes(_CONFIG, chunks * c, ep, c, 4)
    return {**{key: value // n_moe for key, value in whole.items()}, "recompute": 0, "dispatches": chunks}


def _balanced_counter(rank: int, world: int) -> dict:
    """One MoE under EP over all ranks, routed exactly evenly; its counter after a step."""
    config = _CONFIG
    torch.manual_seed(0)
    moe = MoE(config, chunk_tokens=6)
    k, e = config.num_experts_per_tok, config.n_routed_experts

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        token = torch.arange(x.shape[0])
        indices = torch.stack([(2 * token + j) % e for j in range(k)], dim=1)
        return x.new_zeros(x.shape[0], e), torch.sigmoid(x[:, :k]).float(), indices

    moe.gate.forward = route  # type: ignore[method-assign]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    apply_expert_parallel(moe, mesh)
    x = torch.randn(1, 18, config.hidden_size, requires_grad=True)  # 3 chunks of 6 tokens
    moe(x).sum().backward()
    return {
        "measured": ep_comm_counter(moe).as_dict(),
        "received": moe.last_received,
        "expected": _balanced_bytes(world, 3, 6),
    }


def _unequal_chunks(rank: int, world: int, balance: float = 0.0, capacity: float | None = None) -> dict:
    """One MoE under EP where the ranks hold 5, 12, 19, ... tokens (1, 2, 4, ... chunks of 6):
    each rank's output, input gradient and router gradient against the plain MoE on its own
    tokens (the MoE is position-wise; the balance loss and the capacity act on the rank's own
    tokens), as RMS ratios, and whether the routing statistics agree."""
    torch.manual_seed(1)
    plain = MoE(_CONFIG, chunk_tokens=6)
    moe = MoE(_CONFIG, chunk_tokens=6)
    moe.load_state_dict(plain.state_dict())
    for module in (plain, moe):
        module.balance_loss_weight, module.capacity_factor = balance, capacity
    apply_expert_parallel(moe, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    torch.manual_seed(10 + rank)
    x = torch.randn(1, 5 + 7 * rank, _CONFIG.hidden_size)
    probe = torch.randn_like(x)
    results = []
    for module in (plain, moe):
        xi = x.clone().requires_grad_(True)
        out = module(xi)
        (out * probe).sum().backward()
        results.append((out.detach(), xi.grad, module.gate.weight.grad, module.last_routing, module.last_balance_loss))
    (want, want_grad, want_gate, want_stats, want_bal), (got, got_grad, got_gate, got_stats, got_bal) = results
    return {
        "out": rms_ratio(want, got),
        "grad": rms_ratio(want_grad, got_grad),
        "gate": rms_ratio(want_gate, got_gate),
        "loads": torch.equal(want_stats.load, got_stats.load),  # exact: int64 counts
        "dropped": (int(want_stats.dropped), int(got_stats.dropped)),
        "balance": None if want_bal is None else (float(want_bal), float(got_bal)),
    }


def _ep_worker(rank: int, world: int, folder: str) -> None:
    case = torch.load(Path(folder) / "case.pt", weights_only=True)
    model = GenoLM(_CONFIG)
    model.load_state_dict(case["state"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    assert apply_expert_parallel(model, mesh) == 7
    # the checkpoint format: the same keys and global shapes
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {
        k: tuple(v.shape) for k, v in case["state"].items()
    }
    rows = slice(rank, rank + 1)
    hidden = model(case["ids"][rows])
    (hidden * case["probe"][rows]).sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):  # the experts: each rank holds its experts' whole gradient
            grads[n] = p.grad.full_tensor()
        else:  # the rest: this rank's share of the sum
            grads[n] = p.grad.clone()
            dist.all_reduce(grads[n])
    loads = _loads(model)
    dist.all_reduce(loads)
    received = torch.tensor([m.last_received for m in model.modules() if isinstance(m, MoE)])
    bad_split = None
    if world == 4:  # 4 ranks do not split 6 experts
        try:
            apply_expert_parallel(GenoLM(_CONFIG.replace(n_routed_experts=6, n_group=1, topk_group=1)), mesh)
        except InputError as error:
            bad_split = str(error)
    torch.save(
        {
            "hidden": hidden.detach(),
            "grads": grads,
            "loads": loads,
            "received": received,
            "bad_split": bad_split,
            "counter": _balanced_counter(rank, world),
            "unequal": _unequal_chunks(rank, world),
            "unequal_balanced": _unequal_chunks(rank, world, balance=0.5, capacity=1.0),
        },
        Path(folder) / f"rank{rank}.pt",
    )


def _compare(ref: dict, wide: dict, grads: dict[str, torch.Tensor], outright: bool = True) -> dict[str, float]:
    """Every tensor within max(1e-5, 2 x its fp32-vs-float64 gap); nearly every one (97%) below
    1e-5 outright (``outright``), or below the larger of 1e-5 and its gap (the criterion of
    tests/parallel/test_fsdp_cp.py for a CP + FSDP2 step, where 13 of 212 tensors sit above 1e-5 at
    0.1-0.5x their gap without EP). Returns the errors."""
    assert grads.keys() == ref["grads"].keys()
    rounding = {n: rms_ratio(wide["grads"][n], g) for n, g in ref["grads"].items()}
    errors = {n: rms_ratio(g, grads[n]) for n, g in ref["grads"].items()}
    over = {n: (e, rounding[n]) for n, e in errors.items() if e >= max(_TOL, 2 * rounding[n])}
    assert not over, over
    below = sum(e < (_TOL if outright else max(_TOL, rounding[n])) for n, e in errors.items())
    assert below >= 0.97 * len(errors), {n: (e, rounding[n]) for n, e in errors.items() if e >= _TOL}
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_model_equals_one_process(tmp_path: Path, world: int) -> None:
    case = _case(world, 64, seed=world)
    torch.save(case, tmp_path / "case.pt")
    ref, wide = _reference(case, torch.float32), _reference(case, torch.float64)
    run_ranks(_ep_worker, world, tmp_path, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    assert rms_ratio(ref["hidden"], torch.cat([r["hidden"] for r in ranks])) < _TOL
    k = _CONFIG.num_experts_per_tok
    for r in ranks:
        # exact: int64 expert loads; the same routing as one process (no tie flipped)
        assert torch.equal(r["loads"], ref["loads"])
        errors = _compare(ref, wide, r["grads"])
        print(
            f"EP {world}: worst {max(errors.values()):.2e}, {sum(e >= _TOL for e in errors.values())} of {len(errors)} >= 1e-5"
        )
        assert r["unequal"]["out"] < _TOL and r["unequal"]["grad"] < _TOL and r["unequal"]["loads"], r["unequal"]
        # with the balance loss and a capacity of 1.0: the same loss, the same rows dropped, and the
        # loss's gradient reaching the router through the all-to-alls
        balanced = r["unequal_balanced"]
        assert balanced["out"] < _TOL and balanced["grad"] < _TOL and balanced["gate"] < _TOL and balanced["loads"], (
            balanced
        )
        assert balanced["dropped"][0] == balanced["dropped"][1], balanced  # exact: row counts
        assert balanced["balance"] is not None and abs(balanced["balance"][0] - balanced["balance"][1]) < 1e-6, balanced
        counter = r["counter"]
        assert counter["measured"] == counter["expected"], counter  # exact: byte counts
        assert counter["received"] == 18 * k  # exact: row counts (balanced: each rank gets its share)
    # every (token, slot) row of the step was received by exactly one rank
    assert int(sum(r["received"] for r in ranks).sum()) == int(ref["loads"].sum())  # exact: row counts
    if world == 4:
        assert "parallel.ep = 4 does not divide the model's n_routed_experts = 6" in ranks[0]["bad_split"]


def _mesh_worker(rank: int, world: int, folder: str, sizes: dict[str, int], recompute: str) -> None:
    case = torch.load(Path(folder) / "case.pt", weights_only=True)
    mesh = build_mesh(ParallelSection(accelerator="cpu", devices=world, ep=2, **sizes), world_size=world)
    assert ep_size(mesh) == 2 and expert_mesh(mesh).mesh_dim_names == ("dp_replicate", "efsdp", "ep")
    model = GenoLM(_CONFIG)
    model.load_state_dict(case["state"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize(model, recompute=recompute, offload=True, offload_min_bytes=0, mesh=mesh, ep=2, moe_chunk_tokens=24)
    placements = {n: (p.device_mesh.mesh_dim_names, p.placements) for n, p in model.named_parameters()}
    # the offloader must keep the unsharded expert weights the experts save for backward on the
    # device (they are parameters, unsharded by the nested FSDP2 unit after the block's hooks ran)
    experts = [m for n, m in model.named_modules() if n.endswith(".experts")]  # FSDP2 swaps their parameters
    saved = {"offloaded": 0, "kept": 0}
    pack = ActivationOffloader._pack

    def spy(self: ActivationOffloader, tensor: torch.Tensor) -> object:
        out = pack(self, tensor)
        weights = {p._local_tensor.untyped_storage().data_ptr() for m in experts for p in m.parameters()}
        if tensor.untyped_storage().data_ptr() in weights:
            saved["offloaded" if type(out).__name__ == "_Offloaded" else "kept"] += 1
        return out

    ActivationOffloader._pack = spy  # type: ignore[method-assign]  # this spawned process only
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tokens = case["ids"][dp_rank(mesh) : dp_rank(mesh) + 1]
    lo, hi = context_parallel_bounds(tokens.shape[1], cp_rank(mesh), cp_size(mesh))
    nll, weight = model.loss(tokens[:, lo:hi], next_tokens=tokens[:, hi : hi + 1] if hi < tokens.shape[1] else None)
    total = torch.stack([nll.detach(), weight.detach()])
    dist.all_reduce(total)
    (nll / total[1]).backward()
    # the global gradient norm over both meshes (a bound this high clips nothing)
    norm = clip_grad_norm_by_mesh(list(model.parameters()), 1e9)
    torch.optim.SGD(model.parameters(), lr=_LR).step()
    update = {n: p.full_tensor() - before[n] for n, p in model.named_parameters()}
    torch.save(
        {
            "update": update,
            "placements": placements,
            "shapes": shapes,
            "loss": total[0] / total[1],
            "norm": norm,
            "saved": saved,
            "counter": ep_comm_counter(model).as_dict(),
        },
        Path(folder) / f"rank{rank}.pt",
    )


def _sgd_update(case: dict, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = GenoLM(_CONFIG).to(dtype)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in case["state"].items()})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    nll, weight = model.loss(case["ids"])
    (nll / weight).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    torch.optim.SGD(model.parameters(), lr=_LR).step()
    update = {n: (p.detach() - before[n]).float() for n, p in model.named_parameters()}
    return update, (nll / weight).detach().float(), float(norm)


_MESHES = {
    # EP groups {0, 1} and {2, 3}: each the two CP ranks of one window; experts FSDP2-sharded over
    # {0, 2} and {1, 3}
    # (full recompute: the forward exchanges run again in backward)
    "fsdp2x_cp2": (
        {"cp": 2, "dp_shard": 2},
        "full",
        ("efsdp", "ep"),
        (Shard(1), Shard(0)),
        ("dp_shard_cp",),
        (Shard(0),),
    ),
    # HSDP: 2 replicas of 2 FSDP ranks, EP over each replica's 2 ranks (no expert sharding left);
    # no recompute, so the offloader sees everything the blocks save
    "hsdp2x2": (
        {"cp": 1, "dp_shard": 2, "dp_replicate": 2},
        "none",
        ("dp_replicate", "efsdp", "ep"),
        (Replicate(), Shard(1), Shard(0)),
        ("dp_replicate", "dp_shard_cp"),
        (Replicate(), Shard(0)),
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(_MESHES))
def test_expert_parallel_with_cp_and_fsdp_step_equals_one_process(tmp_path: Path, layout: str) -> None:
    """One SGD step on windows of 144 tokens (2 for cp 2 x dp_shard 2, 4 for HSDP 2 x 2), EP 2,
    activation offload and MoE chunks of 24 tokens (3 per slice of 72, 6 per window of 144)."""
    sizes, recompute, expert_dims, expert_placements, dense_dims, dense_placements = _MESHES[layout]
    windows = 4 // sizes["cp"]
    case = _case(windows, 144, seed=3)
    torch.save(case, tmp_path / "case.pt")
    ref, loss, norm = _sgd_update(case, torch.float32)
    wide, _, _ = _sgd_update(case, torch.float64)
    run_ranks(_mesh_worker, 4, tmp_path, str(tmp_path), sizes, recompute)
    for r in range(4):
        out = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert out["shapes"] == {k: tuple(v.shape) for k, v in case["state"].items()}
        experts = {n: p for n, p in out["placements"].items() if ".experts." in n}
        assert len(experts) == 14
        assert all(p == (expert_dims, expert_placements) for p in experts.values()), experts
        assert all(p == (dense_dims, dense_placements) for n, p in out["placements"].items() if n not in experts)
        assert abs(float(out["loss"]) - float(loss)) <= _TOL * abs(float(loss))
        assert abs(float(out["norm"]) - norm) <= _TOL * norm
        assert out["saved"]["offloaded"] == 0 and (out["saved"]["kept"] > 0) == (recompute == "none"), out["saved"]
        errors = _compare({"grads": ref}, {"grads": wide}, out["update"], outright=False)
        print(
            f"rank {r}: worst {max(errors.values()):.2e}, {sum(e >= _TOL for e in errors.values())} of {len(errors)} >= 1e-5"
        )
        # 7 MoE layers x 3 (or 6) chunks, forward (and again in the recomputed backward)
        passes = 2 if recompute == "full" else 1
        assert out["counter"]["dispatches"] == passes * 7 * 144 // sizes["cp"] // 24
        assert out["counter"]["recompute"] == (passes - 1) * out["counter"]["forward"] and out["counter"]["forward"] > 0
        assert out["counter"]["backward"] > 0


def test_clip_by_mesh_equals_torch_clip_on_plain_tensors() -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in ours:
        p.grad = torch.randn_like(p)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(theirs, ours):
        a.grad = b.grad.clone()
    total = clip_grad_norm_by_mesh(ours, 0.5)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=0)


def test_impossible_expert_parallel_sizes_fail_naming_the_keys() -> None:
    with pytest.raises(
        InputError, match=r"parallel.ep = 4 does not divide parallel.dp_shard x parallel.cp = 3 x 2 = 6"
    ):
        mesh_shape(cp=2, dp_shard=3, dp_replicate=1, world_size=6, ep=4)
    with pytest.raises(InputError, match=r"parallel.ep = 0"):
        mesh_shape(cp=1, dp_shard=2, dp_replicate=1, world_size=2, ep=0)
    assert mesh_shape(cp=2, dp_shard=2, dp_replicate=2, world_size=8, ep=4) == {
        "dp_replicate": 2,
        "dp_shard": 2,
        "cp": 2,
    }
