"""ModelConfig against transformers' Glm5NextTextConfig and its meta-device parameter count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from genolong.errors import InputError
from genolong.model import PRESETS, ModelConfig, layer_types_from_pattern, parameter_count
from tests.helpers import run_transformers

# transformers routes KDA to fla's Triton kernel when fla is importable, which fails on CPU: the
# transformers side runs once, in a subprocess that hides fla first, and answers every question.
_SCHEDULES = [
    {"num_hidden_layers": 5},
    {"num_hidden_layers": 12, "index_topk_freq": 3, "index_skip_topk_offset": 1},
    {"num_hidden_layers": 8, "index_topk_pattern": "FSSFFSSF"},
]
_HF_SCRIPT = """
import sys, json
import torch
from transformers import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel
presets, schedules = json.loads(sys.stdin.read())
out = {"count": {}, "to_dict": {}, "schedules": []}
for name, raw in presets.items():
    config = Glm5NextTextConfig(**raw)
    with torch.device("meta"):
        model = Glm5NextTextModel(config)
    lm_head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    out["count"][name] = sum(p.numel() for p in model.parameters()) + lm_head
    out["to_dict"][name] = config.to_dict()
for raw in schedules:
    c = Glm5NextTextConfig(**raw)
    out["schedules"].append([c.layer_types, c.mlp_layer_types, c.indexer_types])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hf() -> dict:
    presets = {name: config.to_hf_dict() for name, config in PRESETS.items()}
    stdout = run_transformers(_HF_SCRIPT, stdin=json.dumps([presets, _SCHEDULES]))
    return json.loads(stdout.strip().splitlines()[-1])


def test_defaults_are_the_released_geometry() -> None:
    config = ModelConfig()
    assert config.pattern == "KKKD" * 11 + "K"
    assert config.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    count = parameter_count(config)
    assert round(count.total / 1e9, 1) == 313.3 and round(count.active / 1e9, 1) == 17.4


@pytest.mark.parametrize("name", ["glm-5.3-flash", "tiny", "small", "1b"])
def test_parameter_count_matches_transformers_meta_model(hf: dict, name: str) -> None:
    """Our analytic count equals transformers' text model + LM head built on the meta device."""
    assert parameter_count(PRESETS[name]).total == hf["count"][name]


@pytest.mark.parametrize("name", ["glm-5.3-flash", "tiny", "small", "1b"])
def test_transformers_reads_our_config_to_the_same_values(hf: dict, name: str) -> None:
    assert ModelConfig.from_hf_dict(hf["to_dict"][name]) == PRESETS[name]


def test_derived_schedules_match_transformers(hf: dict) -> None:
    """Per-layer schedules derived from the legacy keys as transformers derives them. (Some of
    these schedules put a shared DSA layer after a KDA layer, which transformers only rejects
    when it runs; ModelConfig refuses such configs up front, so the derivation is checked here.)"""
    from genolong.model.config import _default_layer_types, _default_mlp_layer_types, _legacy_indexer_types

    for raw, theirs in zip(_SCHEDULES, hf["schedules"]):
        n = raw["num_hidden_layers"]
        ours = [_default_layer_types(n), _default_mlp_layer_types(n), _legacy_indexer_types(raw, n)]
        assert [list(x) for x in ours] == theirs
    assert (
        list(ModelConfig.from_hf_dict({"model_type": "glm5_next_text", **_SCHEDULES[0]}).layer_types)
        == hf["schedules"][0][0]
    )


def test_nested_checkpoint_config_round_trips(tmp_path: Path) -> None:
    nested = {
        "model_type": "glm5_next",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "vision_config": {"depth": 2},
        "image_token_id": 154854,
        "text_config": {**PRESETS["tiny"].to_hf_dict(), "num_nextn_predict_layers": 1, "dtype": "bfloat16"},
    }
    (tmp_path / "config.json").write_text(json.dumps(nested))
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.extra == {"num_nextn_predict_layers": 1, "dtype": "bfloat16"}
    assert config.wrapper is not None and config.wrapper["vision_config"] == {"depth": 2}
    config.save_pretrained(tmp_path / "out")
    again = ModelConfig.from_pretrained(tmp_path / "out")
    assert again == config
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [
        "Glm5NextForConditionalGeneration"
    ]


def test_legacy_linear_attn_config() -> None:
    config = ModelConfig.from_hf_dict(
        {
            "model_type": "glm5_next_text",
            "linear_attn_config": {"head_dim": 32, "num_heads": 4, "gate_lower_bound": None},
        }
    )
    assert (config.linear_head_dim, config.linear_num_heads, config.linear_lower_bound) == (32, 4, -5.0)


def test_patterns_and_replace() -> None:
    assert layer_types_from_pattern("KKD", 5) == (
        "linear_attention",
        "linear_attention",
        "indexed_attention",
        "linear_attention",
        "linear_attention",
    )
    config = PRESETS["tiny"].replace(num_hidden_layers=6, pattern="KD", indexer_types=("full",) * 6)
    assert config.pattern == "KDKDKD" and len(config.mlp_layer_types) == 6
    with pytest.raises(InputError, match="only K"):
        layer_types_from_pattern("KKX")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama"}, "unsupported architecture"),
        ({"model_type": "glm5_next_text", "qk_rope_head_dim": 64}, "NoPE"),
        ({"model_type": "glm5_next_text", "index_topk": 100}, "multiple of index_kpool"),
        ({"model_type": "glm5_next_text", "num_key_value_heads": 8}, "must equal num_key_value_heads"),
        (
            {"model_type": "glm5_next_text", "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3},
            "one per layer",
        ),
        (
            {"model_type": "glm5_next_text", "num_hidden_layers": 4, "indexer_types": ["shared"] * 4},
            "directly follow a full one",
        ),
        (
            {"model_type": "glm5_next_text", "num_hidden_layers": 8, "indexer_types": ["full"] * 7 + ["shared"]},
            "layer 6 is not a DSA",
        ),
        ({"model_type": "glm5_next_text", "n_group": 0}, "n_group must be at least 1"),
    ],
)
def test_bad_configs_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        ModelConfig.from_hf_dict(changes)


def test_missing_config_and_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="config.json does not exist"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(InputError, match="tiny, small"):
        ModelConfig.from_preset("huge")
