"""What the training and the evaluation plan read from a recipe: its architecture without the
checkpoint on disk, its mesh on a number of GPUs (checked), the MoE imbalance the buffers are
sized for, the sizes given on the command line (checked), and the ``--set`` overrides that put a
suggestion on more GPUs.

No formula lives here; ``tests/plan/test_plan_train.py`` and ``tests/plan/test_plan_evaluate.py`` check the
errors these raise and the imbalance's sources.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import Recipe
from ..errors import InputError
from ..model.config import ModelConfig
from ..units import format_count
from .comm import fsdp_unit_groups

__all__ = ["recipe_moe_imbalance"]


def _model_config(recipe: Recipe) -> ModelConfig:
    """The recipe's architecture without needing the checkpoint on disk: its config.json when it
    is there, else the preset (``model.preset`` names the geometry for this purpose)."""
    ckpt = recipe.model.checkpoint
    if ckpt is not None and (ckpt / "config.json").is_file():
        return recipe.model_config()
    if recipe.model.preset is None:
        raise InputError(
            f"model.checkpoint {str(ckpt)!r} has no config.json and model.preset is not set; "
            "set model.preset to the checkpoint's geometry (e.g. glm-5.3-flash) to plan before downloading it"
        )
    return ModelConfig.from_preset(recipe.model.preset, **dict(recipe.model.overrides))


def _largest_unit(cfg: ModelConfig, ep: int = 1) -> int:
    """Parameters of the largest FSDP unit a rank gathers (:func:`~genolong.plan.fsdp_unit_groups`): the
    embedding, a block (under EP without its routed experts), one MoE layer's ``E / ep`` experts,
    or the root (LM head and final norm)."""
    return max(u.params for u in fsdp_unit_groups(cfg, 1, ep))


def _check_positive(name: str, value: Any, kind: type = float, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if not ok or not math.isfinite(value) or value <= 0:
        raise InputError(f"{name} must be a positive {'number' if kind is float else 'integer'}, got {value!r}")


def _describe(cfg: ModelConfig, count: int, split: Any = None) -> str:
    moe = sum(1 for t in (cfg.mlp_layer_types or ()) if t == "sparse")
    trained = ""
    if split is not None and split.any_frozen:
        trained = (
            f" ({format_count(split.trained)} trained, {format_count(split.frozen)} frozen"
            + (f"; LoRA adapters {format_count(split.adapters)} of the trained" if split.lora else "")
            + ")"
        )
    return (
        f"{format_count(count)} params{trained}, {cfg.num_hidden_layers} layers ({cfg.pattern.count('K')} KDA + "
        f"{cfg.pattern.count('D')} DSA, {moe} MoE x {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}), "
        f"hidden {cfg.hidden_size}, mHC x {cfg.hc_mult}"
    )


def _mesh_sizes(par: Any, cfg: ModelConfig, gpus: int) -> tuple[int, int, int, int, int, int]:
    """``(cp, dp_replicate, ep, dp_shard, dp_shard x cp, MoE layers)`` of the recipe's ``parallel``
    section on ``gpus`` processes (``dp_shard`` is what is left of them), checked.

    Raises:
        InputError: ``gpus`` not divisible by ``cp x dp_replicate``, or ``ep`` not dividing
            ``dp_shard x cp`` or the model's routed experts.
    """
    cp, rep, ep = par.cp, par.dp_replicate, par.ep
    if gpus % (cp * rep):
        raise InputError(
            f"--gpus {gpus} is not divisible by parallel.cp x parallel.dp_replicate = {cp * rep}; "
            f"use a multiple of {cp * rep}"
        )
    dp_shard = gpus // (cp * rep)
    shard = dp_shard * cp
    if shard % ep:
        raise InputError(
            f"parallel.ep = {ep} does not divide dp_shard x cp = {dp_shard} x {cp} = {shard} on {gpus} GPUs; "
            f"choose ep among the divisors of {shard}"
        )
    assert cfg.mlp_layer_types is not None and cfg.layer_types is not None
    moe_layers = sum(t == "sparse" for t in cfg.mlp_layer_types)
    if ep > 1 and (moe_layers == 0 or cfg.n_routed_experts % ep):
        raise InputError(
            f"parallel.ep = {ep} does not divide the model's n_routed_experts = {cfg.n_routed_experts}; "
            "choose ep among its divisors"
        )
    return cp, rep, ep, dp_shard, shard, moe_layers


def recipe_moe_imbalance(recipe: Recipe, override: float | None = None) -> tuple[float, str]:
    """The busiest expert's (and EP rank's) load over the mean that the plan sizes the MoE
    dispatch for, and where it comes from: ``override`` (``--moe-imbalance``) when given, else
    the recipe's ``memory.moe_imbalance`` (default 4.0, the reference's figure), capped by
    ``memory.moe_capacity_factor`` when that is set (the capacity drops the rows over it)."""
    if override is not None:
        return float(override), "--moe-imbalance"
    mem = recipe.memory
    if mem.moe_capacity_factor is not None and mem.moe_capacity_factor < mem.moe_imbalance:
        return float(mem.moe_capacity_factor), "memory.moe_capacity_factor: rows over it are dropped"
    source = "memory.moe_imbalance" + (", the reference's figure" if mem.moe_imbalance == 4.0 else "")
    return float(mem.moe_imbalance), source


def _with_gpus(overrides: list[str], gpus: int, gpus_per_node: int) -> list[str]:
    devices = min(gpus, gpus_per_node)
    return [*overrides, f"parallel.devices={devices}", f"parallel.num_nodes={math.ceil(gpus / devices)}"]
