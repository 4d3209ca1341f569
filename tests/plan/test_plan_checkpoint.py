"""`genolong plan`'s checkpoint figures: the bytes per save, on disk with keep_last, and what each
rank reads of the base at load (genolong.plan.train.checkpoint_figures), for recipes/1m-node.yaml
and for a run from a preset's fresh weights (every parameter saved). A real save is compared with
the figure in tests/integration/test_finetune_base.py."""

from __future__ import annotations

import math
from pathlib import Path

from genolong.config import load_recipe
from genolong.plan import plan
from genolong.plan.report import format_plan

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_1m_node_saves_what_trains_and_each_rank_reads_an_eighth() -> None:
    recipe = load_recipe(RECIPES / "1m-node.yaml")
    p = plan(recipe, gpus=8)
    moe_layers = 42  # GLM-5.3-Flash: 45 layers, the first 3 dense; 288 routed-expert biases each
    assert p.checkpoint_bytes == 12 * p.trained_parameters + 4 * moe_layers * 288
    assert p.checkpoint_disk_bytes == 2 * p.checkpoint_bytes and p.keep_last == 2
    assert 72e9 < p.checkpoint_bytes < 73e9  # 6.06B attention parameters: fp32 master + 2 AdamW moments
    # the save that held every frozen weight (bf16) too: 9.5x as large
    assert p.checkpoint_bytes + 2 * p.frozen_parameters > 9 * p.checkpoint_bytes
    assert p.load_read_per_rank == math.ceil(2 * p.parameters / 8)
    line = next(line for line in format_plan(p).splitlines() if line.startswith("checkpoints:"))
    assert (
        "67.7 GiB per save" in line
        and "135.4 GiB on disk with keep_last 2" in line
        and "each rank reads 73.0 GiB" in line
    )


def test_a_run_from_fresh_weights_saves_every_parameter(tmp_path: Path) -> None:
    text = (
        (RECIPES / "1m-node.yaml").read_text().replace("  checkpoint: checkpoints/GLM-5.3-Flash", "  checkpoint: null")
    )
    text = text.replace("  vocab_map: tokenizer", "  vocab_map: identity")
    (tmp_path / "fresh.yaml").write_text(text)
    p = plan(load_recipe(tmp_path / "fresh.yaml"), gpus=8)
    assert p.checkpoint_bytes == 12 * p.trained_parameters + 4 * 42 * 288 + 2 * p.frozen_parameters
    assert p.load_read_per_rank == 0
