"""experiments/bundled-base/sample_base_chain.py: every stage's keys make a valid recipe out of
recipes/sample-base.yaml, and each stage freezes what its description says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sample_base_chain import BUNDLED, CHAINS, STAGES, stage_command

from genolong.config import Recipe, load_recipe
from genolong.model import GenoLM
from genolong.model.config import ModelConfig
from tests.helpers import ROOT, trained_parameter_names


def _recipe(name: str, start: Path | None) -> Recipe:
    cmd = stage_command(name, Path("/work/stage"), start, Path("/data/genome"))
    return load_recipe(
        ROOT / "recipes" / "sample-base.yaml", [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
    )


def test_stages_are_recipes_and_freeze_what_they_say() -> None:
    # the bundled base can only start a chain; every other entry is a stage
    assert all(stage in STAGES for chain in CHAINS.values() for stage in chain[chain[0] == BUNDLED :])
    config = ModelConfig.from_preset("small")
    kda = {i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"}
    with torch.device("meta"):
        every = {name for name, _ in GenoLM(config).named_parameters()}
    for name in STAGES:
        first = name.startswith("1-copy")
        recipe = _recipe(name, None if first else Path("/work/before/export"))
        assert (
            recipe.name == name and recipe.data.store == Path("/data/genome") and recipe.data.plant_repeats is not None
        )
        assert recipe.checkpoint.dir == Path("/work/stage/checkpoints") and recipe.eval.every_n_steps == 0
        assert recipe.model.checkpoint == (None if first else Path("/work/before/export"))
        trained = trained_parameter_names(recipe)
        if name.startswith("routers"):  # the routers, and layer 0's dense FFN (the freeze list names the experts)
            assert {n for n in trained if not n.endswith("mlp.gate.weight")} == {
                n for n in every if n.startswith("layers.0.mlp.")
            }
            continue
        frozen = every - trained
        # the KDA mixers never train; with -fr the routers stay as the stage before left them too
        assert {int(n.split(".")[1]) for n in frozen if ".self_attn." in n} == kda
        assert {n for n in frozen if ".self_attn." not in n} == (
            {n for n in every if n.endswith("mlp.gate.weight")} if name.endswith("-fr") else set()
        )


def test_router_token_spread_reads_the_routers(sample_store: Path, tmp_path: Path) -> None:
    from sample_base_chain import router_token_spread

    from genolong.model.config import PRESETS
    from genolong.model.moe import Router

    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"])
    routers = [m for m in model.modules() if isinstance(m, Router)]
    with torch.no_grad():
        routers[0].weight.zero_()  # every token the same scores (0.5): only the bias picks
        routers[0].e_score_correction_bias.copy_(torch.linspace(0.0, 0.1, routers[0].num_experts))
    model.save_pretrained(tmp_path / "model")
    rows = router_token_spread(tmp_path / "model", sample_store, bases=256)
    assert len(rows) == len(routers)
    step = 0.1 / (routers[0].num_experts - 1)
    assert rows[0]["score_token_std"] == 0.0 and rows[0]["choice_gap"] == pytest.approx(step, abs=1e-5)
    assert rows[0]["bias_std"] == pytest.approx(float(routers[0].e_score_correction_bias.std()), abs=1e-5)
    assert all(r["score_token_std"] > 0 for r in rows[1:])  # random routers tell tokens apart
