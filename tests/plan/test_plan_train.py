"""The training plan (``genolong.plan.train``, printed by ``genolong.plan.report``): exact parameter
and optimizer bytes, the reference plans, suggestions that fit, expert parallelism and the MoE
imbalance in the plan, bad input, and ``genolong plan`` itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from genolong.config import load_recipe, parse_recipe
from genolong.errors import InputError
from genolong.model import PRESETS, GenoLM
from genolong.plan import GIB, TRANSIENTS, activation_estimate, format_plan, plan
from tests.helpers import ROOT
from tests.plan_helpers import plan_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def test_parameter_and_optimizer_bytes_are_exact(tmp_path: Path) -> None:
    numel = sum(p.numel() for p in GenoLM(PRESETS["tiny"]).parameters())
    single = plan(plan_recipe(tmp_path), gpu_mem_gib=80)
    assert single.parameters == numel
    assert single.device["parameters (fp32 master, sharded)"] == 4 * numel
    assert single.device["gradients (fp32, sharded)"] == 4 * numel
    assert single.device["AdamW moments (2 x fp32, sharded)"] == 8 * numel
    assert single.device["FSDP unsharded params (2 units) + grad (1 unit)"] == 0  # nothing to gather
    # sharded over cp x dp_shard = 2 x 3 ranks (uneven shards round up)
    sharded = plan(plan_recipe(tmp_path, parallel={"cp": 2, "devices": 6}))
    assert (sharded.cp, sharded.dp_shard, sharded.shard_group) == (2, 3, 6)
    assert sharded.device["parameters (fp32 master, sharded)"] == 4 * math.ceil(numel / 6)
    assert sharded.device["AdamW moments (2 x fp32, sharded)"] == 8 * math.ceil(numel / 6)
    assert (
        sharded.device[
            "FSDP units in use + prefetched (the last block from its forward to its backward) + grad (1 unit)"
        ]
        > 0
    )
    # the root (final norm + LM head, 32-true: 4 B) stays gathered all step, with its fp32 gradient
    cfg = PRESETS["tiny"]
    root = cfg.hidden_size * (1 + cfg.vocab_size)
    assert sharded.device["FSDP root unit (final norm + LM head) unsharded all step, + its grad"] == 4 * root + 4 * root
    bf16 = plan(plan_recipe(tmp_path, parallel={"cp": 2, "devices": 6}, train={"precision": "bf16-mixed"}))
    # gathered in bf16, its gradient too (cast to fp32 only for the reduce-scatter)
    assert bf16.device["FSDP root unit (final norm + LM head) unsharded all step, + its grad"] == 2 * root + 2 * root
    # CP: the activations are those of T / cp tokens on each rank
    assert sharded.tokens_per_rank == 512
    est = activation_estimate(PRESETS["tiny"], 512, indexer_kl=True)
    assert sharded.device["saved activations (resident peak)"] == est.peak_resident_bytes


def test_reference_plan_1m_on_64_gpus_of_180_gb() -> None:
    recipe = load_recipe(ROOT / "recipes" / "1m.yaml")
    p = plan(recipe, gpus=64, gpu_mem_gib=180)
    assert (p.gpus, p.nodes, p.cp, p.dp_shard, p.shard_group, p.tokens_per_rank) == (64, 8, 8, 8, 64, 131072)
    assert p.parameters > 300e9
    # full recompute + offload keeps each layer's input streams on the host: 45 layers x 131,072
    # tokens x 4 streams x 4096 x bf16 = 180 GiB per GPU, the reference's pinned-memory figure
    assert p.host_per_gpu == 45 * 131072 * 4 * 4096 * 2 == 180 * GIB
    assert p.host_per_node == 8 * p.host_per_gpu
    assert p.device_total == sum(v for k, v in p.device.items() if k not in TRANSIENTS or k == p.transient_peak)
    text = format_plan(p)
    print(text)
    assert "verdict: " in text and ("FITS" in text or "DOES NOT FIT" in text)
    assert "assumptions:" in text and len(p.assumptions) >= 5
    assert "180.0 GiB per GPU" in text
    as_json = json.loads(json.dumps(p.to_dict()))
    assert as_json["host_per_gpu"] == p.host_per_gpu and as_json["fits"] == p.fits


def test_over_budget_plan_suggests_a_change_that_fits(tmp_path: Path) -> None:
    recipe = plan_recipe(tmp_path, preset="small", context=65536)
    base = plan(recipe, gpu_mem_gib=1000)
    assert base.fits and base.suggestion == []
    budget = (base.device_total - 0.6 * base.device["saved activations (resident peak)"]) / GIB
    over = plan(recipe, gpu_mem_gib=budget)
    assert not over.fits and over.suggestion and over.suggestion_total is not None
    assert over.suggestion_total <= budget * GIB
    sets = [s for s in over.suggestion if not s.startswith("--gpus")]
    gpus = [int(s.split()[1]) for s in over.suggestion if s.startswith("--gpus")]
    changed = parse_recipe(recipe.to_dict(), sets)
    applied = plan(changed, gpus=gpus[0] if gpus else None, gpu_mem_gib=budget)
    assert applied.fits and applied.device_total == over.suggestion_total
    assert "cheapest change that fits" in format_plan(over)
    # host memory: an offload pool larger than the node's RAM does not fit
    offload = plan_recipe(tmp_path, preset="small", context=65536, memory={"offload": True, "recompute": "full"})
    tight = plan(offload, gpu_mem_gib=1000, host_mem_gib=0.001)
    assert tight.host_per_gpu > 0 and not tight.fits_host and not tight.fits


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpus": 0}, "--gpus"),
        ({"gpus": 3}, "divisible"),
        ({"gpu_mem_gib": -1}, "--gpu-mem"),
        ({"host_mem_gib": 0}, "--host-mem"),
        ({"gpus_per_node": 1.5}, "--gpus-per-node"),
        ({"moe_imbalance": 0.5}, "moe_imbalance"),
    ],
)
def test_bad_input(tmp_path: Path, kwargs: dict, match: str) -> None:
    recipe = plan_recipe(tmp_path, parallel={"cp": 2, "devices": 2})
    with pytest.raises(InputError, match=match):
        plan(recipe, **kwargs)


def test_plan_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`genolong plan` prints the table, or JSON equal to plan().to_dict(); bad sizes are one-line errors."""
    from genolong.cli import main
    from genolong.config import load_recipe

    recipe = ROOT / "recipes" / "1m.yaml"
    assert main(["plan", str(recipe), "--gpus", "64", "--gpu-mem", "180"]) == 0
    table = capsys.readouterr().out
    assert "verdict:" in table and "pinned host memory for offload" in table
    assert main(["plan", str(recipe), "--gpus", "64", "--gpu-mem", "180", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = plan(load_recipe(recipe), gpus=64, gpu_mem_gib=180.0)
    assert printed == json.loads(json.dumps(expected.to_dict()))
    assert printed["gpus"] == 64 and printed["cp"] == 8 and isinstance(printed["fits"], bool)
    assert main(["plan", str(recipe), "--gpus", "63"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "63" in err


def test_ep_in_the_plan(tmp_path: Path) -> None:
    """The mesh line, experts per rank, the working copies (the largest unit: the root once the
    experts are split), the all-to-all buffer row, the EP comm row; impossible sizes fail."""
    from genolong.plan import SENT, ep_comm_bytes, fsdp_unit_groups

    cfg = PRESETS["tiny"]
    base = plan_recipe(
        tmp_path, parallel={"cp": 2, "devices": 4}, train={"precision": "bf16-mixed"}, memory={"moe_chunk_tokens": 128}
    )
    ep2 = parse_recipe(base.to_dict(), ["parallel.ep=2"])
    one, two = plan(base), plan(ep2)
    assert (two.ep, two.experts_per_rank, two.expert_shard_group) == (2, cfg.n_routed_experts // 2, 2)
    assert one.device["parameters (fp32 master, sharded)"] == two.device["parameters (fp32 master, sharded)"]
    from genolong.plan.params import fp32_unit_parameters

    units = [u for u in fsdp_unit_groups(cfg, 4, 2) if u.kind != "root"]
    fp32 = fp32_unit_parameters(cfg)  # gathered at 4 B in bf16-mixed: 2 B more each
    gathered = [2 * u.params + (2 * fp32.get(u.layer, 0) if u.kind == "block" else 0) for u in units]
    last = sum(g for u, g in zip(units, gathered) if u.layer == cfg.num_hidden_layers - 1)
    grad = 4 * max(u.params for u in units)
    assert two.device[
        "FSDP units in use + prefetched (the last block from its forward to its backward) + grad (1 unit)"
    ] == (max(last, max(gathered)) + max(gathered) + grad)
    H, k, inner = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    buffers = int(4.0 * 128 * k * (2 * H + 3 * inner) * 2) + 2 * 128 * k * H * 2
    assert two.device["MoE all-to-all buffers (busiest rank)"] == buffers
    assert "MoE all-to-all buffers (busiest rank)" not in one.device and "MoE dispatch chunk" in one.device
    row = next(r for r in two.comm.rows if r.part == "ep")
    call = ep_comm_bytes(cfg, 512, 2, 128, 2)
    assert (row.convention, row.forward, row.recompute, row.backward) == (
        SENT,
        call["forward"] + call["splits"],
        0,
        call["backward"],
    )
    assert one.comm.part_total("ep") == 0
    text = format_plan(two)
    assert "ep 2 (" in text and "experts sharded over 2" in text and "**EP all-to-all total**" in text
    assert "**EP all-to-all total**" not in format_plan(one) and "; ep 1" in format_plan(one)
    assert any(r.name.startswith("FSDP experts") for r in two.comm.rows)
    with pytest.raises(InputError, match="parallel.ep"):
        plan(parse_recipe(base.to_dict(), ["parallel.ep=4"]), gpus=2)  # 4 does not divide dp_shard x cp = 2


def test_plan_sizes_the_moe_dispatch_for_the_recipes_imbalance(tmp_path: Path) -> None:
    """The busiest rank's buffers scale with memory.moe_imbalance (default 4.0), a capacity factor
    below it caps them (rows over it are dropped), --moe-imbalance overrides both; the assumptions
    say which."""
    base = plan_recipe(
        tmp_path,
        parallel={"cp": 2, "devices": 4, "ep": 2},
        train={"precision": "bf16-mixed"},
        memory={"moe_chunk_tokens": 128},
    )
    cfg = PRESETS["tiny"]
    H, k, inner = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size

    def buffers(imbalance: float) -> int:
        return int(imbalance * 128 * k * (2 * H + 3 * inner) * 2) + 2 * 128 * k * H * 2

    key = "MoE all-to-all buffers (busiest rank)"
    cases = [
        ([], None, 4.0, "memory.moe_imbalance, the reference's figure"),
        (["memory.moe_imbalance=2.5"], None, 2.5, "memory.moe_imbalance"),
        (["memory.moe_capacity_factor=1.5"], None, 1.5, "memory.moe_capacity_factor"),
        (["memory.moe_capacity_factor=6.0"], None, 4.0, "memory.moe_imbalance"),
        (["memory.moe_capacity_factor=1.5"], 3.0, 3.0, "--moe-imbalance"),
    ]
    for overrides, flag, imbalance, source in cases:
        p = plan(parse_recipe(base.to_dict(), overrides), moe_imbalance=flag)
        assert p.device[key] == buffers(imbalance), overrides
        assert any(f"at {imbalance:g} x the mean load ({source}" in a for a in p.assumptions), (
            overrides,
            p.assumptions,
        )


def test_plan_suggests_expert_parallelism() -> None:
    """1m without EP is over a 140 GiB budget by the unsharded experts of one layer: the cheapest
    change that fits is parallel.ep."""
    p = plan(load_recipe(ROOT / "recipes" / "1m.yaml", ["parallel.ep=1"]), gpus=64, gpu_mem_gib=140)
    assert not p.fits and p.suggestion and p.suggestion[0].startswith("parallel.ep=")
    assert p.suggestion_total is not None and p.suggestion_total <= 140 * GIB


#: Issue 15's per-GPU targets. 256k: the reference's measured peak, 98 GiB with offload. A peak
#: torch reports (``max_memory_allocated``) does not see the CUDA context, the libraries'
#: workspaces, NCCL's buffers or the allocator's fragmentation, which the plan has counted since
#: issue 45 (6.9 + 4.7 GiB at 256k): the 256k target holds the plan's allocator-counted part, the
#: others the whole plan
REFERENCE_TARGETS = {"1m": 140.0, "512k": 180.0, "256k": 98.0, "128k": 180.0}
#: the plan rows torch's allocator peak does not count
NOT_ALLOCATED = ("CUDA context", "NCCL communicators", "allocator fragmentation")


@pytest.mark.parametrize("name", sorted(REFERENCE_TARGETS))
def test_reference_recipes_fit_64_gpus_of_180_gb(name: str) -> None:
    """Issue 15's targets on 64 x 180 GB: 1m <= 140 GiB per GPU with pinned host <= 180 GiB per
    GPU, 256k's allocator-counted part <= 98 GiB (the reference's measured peak), 512k and 128k
    fit; the settings before EP and chunked recompute (ep 1, the old recompute and chunks) do not fit."""
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    p = plan(recipe, gpus=64, gpu_mem_gib=180)
    print(format_plan(p).split("\n\n")[1])
    allocated = p.device_total - sum(v for k, v in p.device.items() if k.startswith(NOT_ALLOCATED))
    counted = allocated if name == "256k" else p.device_total
    assert p.fits and counted <= REFERENCE_TARGETS[name] * GIB, (counted / GIB, p.device_total / GIB)
    assert p.ep > 1 and p.recompute == "chunked"
    if name == "1m":
        assert p.host_per_gpu <= 180 * GIB
    old = {
        "1m": ["memory.recompute=full", "memory.moe_chunk_tokens=16384", "memory.recompute_chunk_tokens=16384"],
        "512k": [
            "memory.recompute=selective",
            "memory.recompute_modules=[kda,dsa,moe]",
            "memory.moe_chunk_tokens=16384",
        ],
        "256k": [
            "memory.recompute=selective",
            "memory.recompute_modules=[kda,dsa,moe]",
            "memory.moe_chunk_tokens=null",
        ],
        "128k": ["memory.recompute=selective", "memory.recompute_modules=[kda,dsa]", "memory.moe_chunk_tokens=null"],
    }[name]
    before = plan(load_recipe(ROOT / "recipes" / f"{name}.yaml", ["parallel.ep=1", *old]), gpus=64, gpu_mem_gib=180)
    assert not before.fits_device and before.device_total > 1.5 * p.device_total


def test_plan_command_kernel_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """--kda-kernel / --dsa-kernel override the backend's kernels (the torch KDA kernel saves
    more than fla's)."""
    from genolong.cli import main

    recipe = str(ROOT / "recipes" / "512k.yaml")
    assert main(["plan", recipe, "--gpus", "64", "--gpu-mem", "180", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert (
        main(
            [
                "plan",
                recipe,
                "--gpus",
                "64",
                "--gpu-mem",
                "180",
                "--json",
                "--kda-kernel",
                "torch",
                "--dsa-kernel",
                "torch",
            ]
        )
        == 0
    )
    forced = json.loads(capsys.readouterr().out)
    assert (auto["kda_kernel"], auto["dsa_kernel"]) == ("fla", "triton")
    assert (forced["kda_kernel"], forced["dsa_kernel"]) == ("torch", "torch")
    assert forced["plain_by_kind"]["kda"] > auto["plain_by_kind"]["kda"]
