"""The planner under ``model.freeze`` and ``model.lora`` (``genolong.plan.params``, the frozen parts of
``genolong.plan.activations``, ``train`` and ``comm``): the torch-free parameter table against a real
GenoLM, trained vs frozen bytes against a model after one AdamW step, saved activations against the
meter with frozen parts (every recompute mode), the FSDP reduce-scatter of trained parameters only,
the suggestion to train fewer parameters, and the one-node recipes.
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path

import pytest
import torch

from genolong.config import load_recipe, parse_recipe
from genolong.errors import InputError
from genolong.memory import ActivationMeter
from genolong.model import PRESETS, GenoLM
from genolong.model.config import ModelConfig, parameter_count
from genolong.model.dsa import DSAMixer
from genolong.parallel import parallelize
from genolong.plan import (
    ATTENTION_ONLY_FREEZE,
    GIB,
    TrainedParts,
    activation_estimate,
    comm_estimate,
    format_plan,
    fsdp_unit_groups,
    plan,
)
from genolong.plan.params import linear_shapes, lora_adapter_shapes, parameter_shapes, parameter_split
from genolong.train.module import freeze_parameters
from tests.helpers import ROOT
from tests.plan_helpers import plan_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 0.10
QUICKSTART_FREEZE = list(load_recipe(ROOT / "recipes" / "quickstart.yaml").model.freeze)
# the feed-forwards train, the attention (and the first half of the model) is frozen
ATTENTION_FROZEN = ["embed_tokens.*", "layers.*.self_attn.*", "layers.[0-3].*"]


def _reduced_glm() -> ModelConfig:
    """The glm-5.3-flash geometry's layer schedule (3 dense KDA layers, then MoE; a DSA layer with a
    shared indexer), attention biases on, at a size that builds in a second."""
    g = PRESETS["glm-5.3-flash"]
    return ModelConfig.from_preset(
        "glm-5.3-flash",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=5,
        layer_types=(*g.layer_types[:4], "indexed_attention"),
        mlp_layer_types=g.mlp_layer_types[:5],
        indexer_types=("full", "full", "full", "full", "shared"),
        vocab_size=32,
        pad_token_id=0,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        linear_num_heads=2,
        linear_head_dim=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=16,
        attention_bias=True,
    )


GEOMETRIES = {"tiny": lambda: PRESETS["tiny"], "small": lambda: PRESETS["small"], "glm-reduced": _reduced_glm}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_parameter_table_is_the_model(geometry: str) -> None:
    """Names, shapes and order of the parameters and of the nn.Linear modules equal a real GenoLM's;
    the trained count under a freeze list equals freeze_parameters' on the model."""
    cfg = GEOMETRIES[geometry]()
    model = GenoLM(cfg)
    assert list(parameter_shapes(cfg).items()) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert list(linear_shapes(cfg).items()) == [
        (n, (m.in_features, m.out_features)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    ]
    assert sum(math.prod(s) for s in parameter_shapes(cfg).values()) == parameter_count(cfg).total
    for freeze in (QUICKSTART_FREEZE, ["layers.*.mlp.experts.*"], ["embed_tokens.*"]):
        fresh = GenoLM(cfg)
        frozen = freeze_parameters(fresh, freeze)
        split = parameter_split(cfg, freeze)
        assert (split.frozen, split.trained) == (frozen, sum(p.numel() for p in fresh.parameters() if p.requires_grad))
        assert set(split.trained_names) == {n for n, p in fresh.named_parameters() if p.requires_grad}
    # without freeze the units are fsdp_unit_groups' (from parameter_count prefixes), with and without EP
    for ep in (1, 2):
        legacy = fsdp_unit_groups(cfg, 4, ep)
        split_units = fsdp_unit_groups(cfg, 4, ep, split=parameter_split(cfg))
        assert [(u.kind, u.layer, u.params, u.group) for u in legacy] == [
            (u.kind, u.layer, u.params, u.group) for u in split_units
        ]


def test_lora_adapter_counts() -> None:
    """r (in + out) per adapted linear, per expert on the fused experts; every base weight frozen but
    modules_to_save; bad globs are one-line errors naming the key."""
    cfg = PRESETS["tiny"]
    recipe = parse_recipe(
        {
            "name": "t",
            "model": {
                "preset": "tiny",
                "lora": {
                    "rank": 4,
                    "targets": ["layers.*.self_attn.q_proj", "layers.1.mlp.shared_experts.*"],
                    "routed_experts": True,
                    "modules_to_save": ["norm"],
                },
            },
            "data": {"store": "s", "context": 256},
            "train": {"max_steps": 1},
        }
    )
    lora = recipe.model.lora
    shapes = lora_adapter_shapes(cfg, lora)
    linears = linear_shapes(cfg)
    adapted = [
        n
        for n in linears
        if fnmatch.fnmatchcase(n, "layers.*.self_attn.q_proj")
        or fnmatch.fnmatchcase(n, "layers.1.mlp.shared_experts.*")
    ]
    E, inner, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    moe = sum(t == "sparse" for t in cfg.mlp_layer_types or ())
    expected = sum(4 * sum(linears[n]) for n in adapted) + moe * E * 4 * (H + 2 * inner + inner + H)
    assert sum(math.prod(s) for s in shapes.values()) == expected
    split = parameter_split(cfg, lora=lora)
    assert split.adapters == expected and split.trained == expected + H  # + the final norm in full
    assert split.frozen == parameter_count(cfg).total - H and split.total == parameter_count(cfg).total + expected
    with pytest.raises(InputError, match="model.lora.targets"):
        parameter_split(cfg, lora=lora.__class__(targets=("layers.*.nothing",)))
    with pytest.raises(InputError, match="model.freeze"):
        parameter_split(cfg, ["layers.*.nothing"])


def test_frozen_bytes_match_a_model_after_one_adamw_step(tmp_path: Path) -> None:
    """32-true, quickstart's freeze: masters, gradients and AdamW moments for the trained parameters
    only, the frozen ones at 4 B, all as a real model holds them after one AdamW step (exact)."""
    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"])
    freeze_parameters(model, QUICKSTART_FREEZE)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3)
    mixers = [m for m in model.modules() if isinstance(m, DSAMixer) and m.indexer is not None]
    for mixer in mixers:  # the trainer computes the indexer KL: the indexer's parameters get gradients
        mixer.indexer_kl = True
    nll, weight = model.loss(torch.randint(1, 6, (1, 64), generator=torch.Generator().manual_seed(1)))
    (nll / weight + sum(m.last_indexer_kl for m in mixers)).backward()
    opt.step()
    assert all(p.grad is not None for p in trained)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    moments = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
    trained_bytes = sum(p.numel() * p.element_size() for p in trained)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    p = plan(plan_recipe(tmp_path, model={"freeze": QUICKSTART_FREEZE}))
    assert p.device["trained parameters (fp32 master, sharded)"] == trained_bytes
    assert p.device["frozen parameters (fp32, sharded, no master)"] == frozen_bytes
    assert p.device["gradients (fp32, sharded, trained only)"] == grads
    assert p.device["AdamW moments (2 x fp32, sharded, trained only)"] == moments
    assert (p.trained_parameters, p.frozen_parameters, p.adapter_parameters) == (
        trained_bytes // 4,
        frozen_bytes // 4,
        0,
    )
    assert "trained" in format_plan(p).splitlines()[0] and "frozen" in format_plan(p).splitlines()[0]
    # bf16-mixed: the frozen weights at 2 B, no master; the trained state unchanged
    bf16 = plan(plan_recipe(tmp_path, model={"freeze": QUICKSTART_FREEZE}, train={"precision": "bf16-mixed"}))
    assert bf16.device["frozen parameters (bf16, sharded, no master)"] == frozen_bytes // 2
    assert bf16.device["trained parameters (fp32 master, sharded)"] == trained_bytes
    # nothing frozen: the rows and figures of before
    full = plan(plan_recipe(tmp_path))
    numel = sum(q.numel() for q in model.parameters())
    assert full.device["parameters (fp32 master, sharded)"] == 4 * numel and "frozen" not in format_plan(full)


def test_reduce_scatter_moves_trained_parameters_only(tmp_path: Path) -> None:
    """FSDP over 4 ranks: the all-gathers move every parameter of a unit, the fp32 reduce-scatter only
    its trained ones (per unit as a real model's requires_grad says); frozen units have none."""
    cfg = PRESETS["tiny"]
    model = GenoLM(cfg)
    freeze_parameters(model, QUICKSTART_FREEZE)
    by_unit: dict[str, int] = {}
    for name, param in model.named_parameters():
        key = (
            ".".join(name.split(".")[:2])
            if name.startswith("layers.")
            else ("embedding" if name.startswith("embed_tokens") else "root")
        )
        by_unit[key] = by_unit.get(key, 0) + (param.numel() if param.requires_grad else 0)
    split = parameter_split(cfg, QUICKSTART_FREEZE)
    S = 4
    frozen = comm_estimate(cfg, 256, 1, shard_group=S, split=split)
    plain = comm_estimate(cfg, 256, 1, shard_group=S)
    rows = {r.name.split(" (")[0]: r for r in frozen.rows}
    expected = sum((S - 1) * math.ceil(n / S) * 4 for n in by_unit.values() if n)
    assert rows["FSDP gradient reduce-scatter"].total == expected
    trained_units = sum(1 for n in by_unit.values() if n)
    # the quickstart freezes whole layers (the KDA ones: their mixers stay as the base has them)
    assert 0 < trained_units < cfg.num_hidden_layers
    assert rows["FSDP gradient reduce-scatter"].layers == trained_units
    gathers = [r.total for r in frozen.rows if "all-gather" in r.name]
    assert gathers == [
        r.total for r in plain.rows if "all-gather" in r.name
    ]  # fp32 run: frozen weights gathered as before
    p = plan(plan_recipe(tmp_path, model={"freeze": QUICKSTART_FREEZE}, parallel={"devices": S}))
    assert p.comm.part_total("fsdp") == frozen.part_total("fsdp") < plain.part_total("fsdp")


def _meter_frozen(
    preset: str, tokens: int, freeze: list[str], indexer_kl: bool = False, **techniques: object
) -> ActivationMeter:
    """One metered forward + backward of ``preset`` with ``freeze`` applied (fp32)."""
    torch.manual_seed(0)
    model = GenoLM(PRESETS[preset])
    freeze_parameters(model, freeze)
    model = parallelize(model, **techniques)  # type: ignore[arg-type]
    mixers = [m for m in model.modules() if isinstance(m, DSAMixer) and m.indexer is not None]
    for mixer in mixers:
        mixer.indexer_kl = indexer_kl
    ids = torch.randint(1, 6, (1, tokens), generator=torch.Generator().manual_seed(1))
    with ActivationMeter(model) as meter:
        nll, weight = model.loss(ids)
        loss = nll / weight
        if indexer_kl:
            loss = loss + sum(m.last_indexer_kl for m in mixers)
        loss.backward()
    return meter


SELECTIVE = {"recompute": "selective", "recompute_modules": ("kda", "dsa")}
CHUNKED = {"recompute": "chunked", "recompute_chunk_tokens": 256}
FROZEN_CASES = [
    ("tiny", 512, QUICKSTART_FREEZE, {}),
    ("tiny", 2048, QUICKSTART_FREEZE, {}),
    ("tiny", 1024, QUICKSTART_FREEZE, SELECTIVE),
    ("tiny", 2048, QUICKSTART_FREEZE, SELECTIVE),
    ("tiny", 1024, QUICKSTART_FREEZE, {"recompute": "full"}),
    ("tiny", 1024, QUICKSTART_FREEZE, CHUNKED),
    ("tiny", 1024, QUICKSTART_FREEZE, {**SELECTIVE, "offload": True, "offload_min_bytes": 0}),
    ("tiny", 1024, ATTENTION_FROZEN, {}),
    ("tiny", 1024, ATTENTION_FROZEN, {"recompute": "full"}),
    ("tiny", 1024, ["embed_tokens.*", "layers.*.mlp.*"], {}),
    ("small", 1024, QUICKSTART_FREEZE, {}),
    ("small", 1024, QUICKSTART_FREEZE, SELECTIVE),
]


def _frozen_id(case: tuple) -> str:
    preset, t, freeze, tech = case
    which = {id(QUICKSTART_FREEZE): "attn-only", id(ATTENTION_FROZEN): "ffn-only"}.get(id(freeze), "embed+mlp-frozen")
    return f"{preset}-T{t}-{which}-{tech.get('recompute', 'none')}" + ("-offload" if tech.get("offload") else "")


@pytest.mark.parametrize("case", FROZEN_CASES, ids=[_frozen_id(c) for c in FROZEN_CASES])
def test_planner_matches_meter_with_frozen_parts(case: tuple) -> None:
    """Frozen parts keep no weight-gradient inputs; parts below which nothing trains keep nothing."""
    preset, t, freeze, techniques = case
    meter = _meter_frozen(preset, t, freeze, **techniques)
    cfg = PRESETS[preset]
    trained = TrainedParts.from_names(cfg, parameter_split(cfg, freeze).trained_names)
    est = activation_estimate(cfg, t, trained=trained, **techniques)  # type: ignore[arg-type]
    errors = {
        "resident peak": abs(est.peak_resident_bytes - meter.peak_resident_bytes) / meter.peak_resident_bytes,
        "total peak": abs(est.peak_total_bytes - meter.peak_total_bytes) / meter.peak_total_bytes,
    }
    print(
        f"{_frozen_id(case)}: planned {est.peak_resident_bytes / 2**20:.2f} MiB, metered "
        f"{meter.peak_resident_bytes / 2**20:.2f} MiB, " + ", ".join(f"{k} {v:.3%}" for k, v in errors.items())
    )
    assert max(errors.values()) < TOLERANCE, errors
    if techniques.get("recompute") in (None, "selective"):  # freezing saves memory the unfrozen plan counts
        assert est.peak_resident_bytes < activation_estimate(cfg, t, **techniques).peak_resident_bytes  # type: ignore[arg-type]


def test_quickstart_plan_matches_its_own_step() -> None:
    """recipes/quickstart.yaml's planned saved activations (small at 8,192 tokens, selective kda+dsa,
    the indexer KL on, MoE chunks of 4,096) against the meter on the same step."""
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    p = plan(recipe)
    mem = recipe.memory
    meter = _meter_frozen(
        "small",
        recipe.data.context,
        list(recipe.model.freeze),
        indexer_kl=True,
        recompute=mem.recompute,
        recompute_modules=tuple(mem.recompute_modules),
        moe_chunk_tokens=mem.moe_chunk_tokens,
    )
    planned = p.device["saved activations (resident peak)"]
    print(f"quickstart: planned {planned / 2**20:.1f} MiB, metered {meter.peak_resident_bytes / 2**20:.1f} MiB")
    assert abs(planned - meter.peak_resident_bytes) / meter.peak_resident_bytes < TOLERANCE


def test_over_budget_plan_suggests_training_fewer_parameters(tmp_path: Path) -> None:
    """A full fine-tune that does not fit: the plan offers attention-only training (checked by
    planning it), beside the cheapest change; a recipe that freezes already gets no such line."""
    recipe = plan_recipe(tmp_path, preset="small", context=4096, memory={"recompute": "full"})
    base = plan(recipe, gpu_mem_gib=1000)
    attention_only = plan(
        parse_recipe(recipe.to_dict(), [f"model.freeze=[{','.join(ATTENTION_ONLY_FREEZE)}]"]), gpu_mem_gib=1000
    )
    assert attention_only.device_total < base.device_total
    budget = (attention_only.device_total + base.device_total) / 2 / GIB
    over = plan(recipe, gpu_mem_gib=budget)
    assert not over.fits and over.trainable_suggestion[0].startswith("model.freeze=")
    applied = plan(parse_recipe(recipe.to_dict(), over.trainable_suggestion), gpu_mem_gib=budget)
    assert applied.fits and applied.device_total == over.trainable_suggestion_total
    assert "or train fewer parameters: --set 'model.freeze=[" in format_plan(over)
    frozen = plan(parse_recipe(recipe.to_dict(), over.trainable_suggestion), gpu_mem_gib=budget / 10)
    assert not frozen.fits and frozen.trainable_suggestion == []


@pytest.mark.parametrize(("name", "gpu_mem", "limit"), [("1m-node", 180, 170), ("1m-node-h200", 141, 131)])
def test_one_node_recipes_fit_8_gpus(name: str, gpu_mem: int, limit: int) -> None:
    """GLM-5.3-Flash at 1M tokens on one node of 8 GPUs: attention-only on 180 GB, LoRA on 141 GB;
    host memory per GPU within 240 GiB."""
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    p = plan(recipe, gpus=8, gpu_mem_gib=gpu_mem)
    print(format_plan(p))
    assert (p.gpus, p.nodes, p.cp, p.ep) == (8, 1, 8, 8) and recipe.data.context == 1 << 20
    assert p.fits and p.device_total <= limit * GIB and p.host_per_gpu <= 240 * GIB
    assert p.host_per_node == 8 * p.host_per_gpu
    split = parameter_split(PRESETS["glm-5.3-flash"], recipe.model.freeze, recipe.model.lora)
    assert (p.trained_parameters, p.frozen_parameters) == (split.trained, split.frozen)
    # frozen weights in bf16 over the 8 ranks, no fp32 state for them
    frozen_row = next(v for k, v in p.device.items() if k.startswith("frozen parameters (bf16"))
    assert frozen_row == 2 * math.ceil(split.frozen / 8)
    if recipe.model.lora is not None:
        assert p.adapter_parameters == split.adapters > 0 and split.trained < 1e8
    else:
        assert 6.0e9 < split.trained < 6.2e9  # the attention layers (KDA + DSA), 1.9% of 313B
