"""The recipes of the bundled base's chain (experiments/bundled-base/recipes/ and the last stage,
recipes/sample-base.yaml): each loads, writes out every key with a comment, starts from the one
before's export, and freezes what its header says. Moved here from tests/cli/test_config.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from tests.test_config import KEY_LINE, flat_keys

from genolong.config import load_recipe
from genolong.model.config import ModelConfig
from tests.helpers import ROOT, trained_parameter_names

HERE = Path(__file__).resolve().parents[1]
#: The bundled base's recipe chain, in order: each stage starts from the one before's export.
CHAIN = (*sorted((HERE / "recipes").glob("sample-base-*.yaml")), ROOT / "recipes" / "sample-base.yaml")


def test_the_chain_has_five_stages_in_order() -> None:
    assert [p.stem for p in CHAIN] == [
        "sample-base-1-copy",
        "sample-base-2-match",
        "sample-base-3-far",
        "sample-base-4-diverged",
        "sample-base",
    ]


@pytest.mark.parametrize("path", CHAIN[:-1], ids=lambda p: p.name)
def test_stage_recipe_loads_and_comments_every_key(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    raw = yaml.safe_load(path.read_text())
    assert flat_keys(raw) == flat_keys(recipe.to_dict())
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if KEY_LINE.match(line):
            assert "#" in line, f"{path.name}:{number}: key without a comment: {line!r}"


def test_sample_base_chain_starts_fresh_and_each_stage_continues_the_one_before() -> None:
    from genolong.quickstart import base_context

    stages = [load_recipe(path) for path in CHAIN]
    assert stages[0].model.checkpoint is None
    for before, stage in zip(stages, stages[1:]):
        assert stage.model.checkpoint == before.checkpoint.dir.parent / "export", stage.name
    assert all(s.seed == stages[0].seed and s.data.store == stages[0].data.store for s in stages)
    config = ModelConfig.from_preset("small")
    kda = {i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"}
    all_names = trained_parameter_names(
        dataclasses.replace(stages[0], model=dataclasses.replace(stages[0].model, freeze=()))
    )
    routers = {n for n in all_names if n.endswith("mlp.gate.weight")}
    for stage in stages[:-1]:
        # every weight trains but the KDA mixers and the MoE routers, which stay at their initial weights
        not_trained = all_names - trained_parameter_names(stage)
        frozen = not_trained - routers
        assert routers <= not_trained, stage.name
        assert frozen and {int(n.split(".")[1]) for n in frozen} == kda, stage.name
        assert all(".self_attn." in n for n in frozen) and stage.data.plant_repeats is not None
    # the last stage trains the MoE routers and the one dense FFN (layer 0's: its freeze list names
    # the experts), at the context the quickstart cuts to
    dense = {i for i, kind in enumerate(config.mlp_layer_types) if kind == "dense"}
    assert trained_parameter_names(stages[-1]) == routers | {
        n for n in all_names if n.startswith("layers.") and int(n.split(".")[1]) in dense and ".mlp." in n
    }
    assert stages[-1].data.context == base_context() and stages[-1].data.plant_repeats == stages[-2].data.plant_repeats
