"""experiments/bundled-base/copy_layers.py: a layer's silenced mixer is that mixer contributing nothing (the same
NLL as the model with that mixer's output projection zeroed), the hook is gone afterwards, and
every layer of the model gets its row."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from copy_emergence import copy_gain, heldout_pairs
from copy_layers import silenced_gains

from genolong.model import GenoLM
from genolong.model.config import PRESETS

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons of the same computation


def test_silenced_gains(sample_store: Path) -> None:
    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"])
    pairs = heldout_pairs(sample_store, 32, 4)
    rows = silenced_gains(model, pairs, 32)
    assert [r["layer"] for r in rows] == [None, *range(model.config.num_hidden_layers)]
    assert [r["mixer"] for r in rows[1:]] == list(model.config.layer_types)
    intact = rows[0]
    assert {
        "layer": None,
        "mixer": None,
        **copy_gain(model, pairs, 32),
    } == intact  # the hooks are removed: the model scores as before
    for row in rows[1:]:
        assert row["gain"] == pytest.approx(row["after_other"] - row["after_copy"], abs=1e-9)
        assert row["after_copy"] != intact["after_copy"]  # every mixer of a random model adds something
    # silencing = the mixer's output projection at zero (KDA layer 0, DSA layer 2)
    for i in (0, 2):
        zeroed = copy.deepcopy(model)
        with torch.no_grad():
            zeroed.layers[i].self_attn.o_proj.weight.zero_()
        expected = copy_gain(zeroed, pairs, 32)
        for key in ("after_other", "after_copy", "gain"):
            assert rows[1 + i][key] == pytest.approx(expected[key], abs=1e-6), (i, key)  # fp32 sums in another order
