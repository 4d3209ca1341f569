"""Recipes: strict loading (unknown keys, types, values, cross-field checks), --set, round trip, shipped files."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from genolong.config import (
    KDA_CHUNK,
    RECOMPUTE_MODULES,
    Recipe,
    kernel_multiple,
    load_recipe,
    parse_recipe,
    parse_set,
    recipe_diff,
)
from genolong.errors import InputError
from genolong.model.config import ModelConfig
from genolong.model.vocab import VocabMap
from tests.helpers import trained_parameter_names

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SHIPPED = sorted(RECIPES.glob("*.yaml"))
KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*):(.*)$")


def flat_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted keys of a nested recipe dict (model.overrides and model.vocab_map count as one key)."""
    keys: set[str] = set()
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("overrides", "vocab_map"):
            keys |= flat_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def minimal(**sections: Any) -> dict[str, Any]:
    """The smallest valid recipe (small preset, 1k context), with ``sections`` merged in."""
    data: dict[str, Any] = {
        "name": "t",
        "model": {"preset": "small"},
        "data": {"store": "genome", "context": 1024},
        "train": {"max_steps": 10},
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(name), dict):
            data[name] = {**data[name], **value}
        else:
            data[name] = value
    return data


def fails(data: dict[str, Any], match: str, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(InputError, match=match) as info:
        parse_recipe(data, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- shipped recipes -------------------------------------------------------------------------------


def test_the_shipped_set() -> None:
    assert {p.stem for p in SHIPPED} >= {"quickstart", "sample-base", "128k", "256k", "512k", "1m"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipe_loads_shows_every_key_and_comments_it(path: Path, tmp_path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    # every schema key is written out in the file (a user sees all the knobs) ...
    raw = yaml.safe_load(path.read_text())
    assert flat_keys(raw) == flat_keys(recipe.to_dict())
    # ... and every key line carries a comment
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if KEY_LINE.match(line):
            assert "#" in line, f"{path.name}:{number}: key without a comment: {line!r}"
    # the stored copy of a run loads back equal
    assert load_recipe(recipe.save(tmp_path / "recipe.yaml")) == recipe


def test_gpu_recipes_mirror_the_reference() -> None:
    contexts = {"128k": 1 << 17, "256k": 1 << 18, "512k": 1 << 19, "1m": 1 << 20}
    for name, context in contexts.items():
        recipe = load_recipe(RECIPES / f"{name}.yaml")
        assert recipe.data.context == context
        assert (
            recipe.model.preset == "glm-5.3-flash"
            and recipe.model.checkpoint == Path.cwd() / "checkpoints/GLM-5.3-Flash"
        )
        assert recipe.data.store == Path.cwd() / "genome"
        assert recipe.parallel.world_size == 64 and recipe.parallel.num_nodes == 8
        assert recipe.parallel.cp * recipe.parallel.dp_size == 64
        assert recipe.train.max_steps == 80 and recipe.train.precision == "bf16-mixed"
        assert recipe.data.context % kernel_multiple(ModelConfig.from_preset("glm-5.3-flash"), recipe.parallel.cp) == 0
    big = load_recipe(RECIPES / "512k.yaml")
    assert big.memory.offload and big.memory.moe_chunk_tokens and big.memory.recompute != "none"
    cpu = load_recipe(RECIPES / "quickstart.yaml")
    assert cpu.parallel.accelerator == "cpu" and cpu.train.precision == "32-true"
    assert cpu.model.checkpoint == Path.cwd() / "data/sample/base"
    base = load_recipe(RECIPES / "sample-base.yaml")
    assert base.model.preset == "small" and base.data.context <= 1024


def test_the_bundled_base_recipe_trains_the_routers_and_the_quickstart_the_dsa_layers() -> None:
    """recipes/sample-base.yaml, the last stage of the bundled base's chain (the earlier four and
    their test are in experiments/bundled-base/): it continues stage 4's export and trains the MoE
    routers and the one dense FFN (layer 0's: its freeze list names the experts), at the context
    the quickstart cuts to; the quickstart then fine-tunes the DSA attention layers alone."""
    from genolong.quickstart import base_context

    base = load_recipe(RECIPES / "sample-base.yaml")
    assert base.model.checkpoint == Path.cwd() / "runs/sample-base-4-diverged/export"
    config = ModelConfig.from_preset("small")
    all_names = trained_parameter_names(dataclasses.replace(base, model=dataclasses.replace(base.model, freeze=())))
    routers = {n for n in all_names if n.endswith("mlp.gate.weight")}
    dense = {i for i, kind in enumerate(config.mlp_layer_types) if kind == "dense"}
    assert trained_parameter_names(base) == routers | {
        n for n in all_names if n.startswith("layers.") and int(n.split(".")[1]) in dense and ".mlp." in n
    }
    assert base.data.context == base_context() and base.data.plant_repeats is not None
    # the quickstart fine-tunes the DSA attention layers alone: the KDA mixers stay as the base has them
    tuned = trained_parameter_names(load_recipe(RECIPES / "quickstart.yaml"))
    assert tuned and {config.layer_types[int(n.split(".")[1])] for n in tuned} == {"indexed_attention"}
    assert all(".self_attn." in n for n in tuned)


# -- unknown keys ----------------------------------------------------------------------------------


def test_unknown_key_names_the_nearest_valid_key() -> None:
    fails({**minimal(), "modle": {"preset": "small"}}, r"unknown key modle; did you mean model\?")
    fails(minimal(data={"contxt": 5}), r"unknown key data\.contxt; did you mean data\.context\?")
    fails(
        minimal(memory={"recompute_module": ["kda"]}),
        r"memory\.recompute_module; did you mean memory\.recompute_modules\?",
    )
    fails(
        minimal(model={"preset": "small", "overrides": {"hidden_sise": 64}}),
        r"unknown key model\.overrides\.hidden_sise \(not a ModelConfig field\); did you mean model\.overrides\.hidden_size\?",
    )
    fails(
        minimal(model={"preset": "small", "vocab_map": {"A": 1, "C": 2, "G": 3, "T": 4, "N": 5, "padd": 0}}),
        r"model\.vocab_map\.padd; did you mean model\.vocab_map\.pad\?",
    )
    # nothing close: the valid keys of that section are listed
    message = fails(minimal(eval={"zzzz": 1}), r"unknown key eval\.zzzz; valid keys in eval: every_n_steps, max_tiles")
    assert "batch_size" in message


def test_missing_required_keys() -> None:
    data = minimal()
    del data["data"]["context"]
    fails(data, r"missing required key data\.context")
    data = minimal()
    del data["train"]
    fails(data, r"missing required key train\.max_steps")
    fails(minimal(model={"preset": None}), r"model needs a preset .* or a checkpoint")


# -- types -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key", "value", "match"),
    [
        ("data", "context", True, r"data\.context = true \(a boolean\): must be an integer, not true/false"),
        (
            "data",
            "context",
            "1024",
            r"data\.context = '1024' \(a string\): must be an integer; write the number without quotes",
        ),
        ("data", "context", 1024.0, r"data\.context = 1024\.0 \(a number\): must be an integer; write 1024 without"),
        ("data", "context", None, r"data\.context = null \(null\): must be an integer, not null"),
        ("data", "verify", "yes please", r"data\.verify = 'yes please' \(a string\): must be true or false"),
        ("data", "verify", 1, r"data\.verify = 1 \(an integer\): must be true or false"),
        ("data", "store", 5, r"data\.store = 5 \(an integer\): must be a path"),
        ("data", "eval_split", 3, r"data\.eval_split = 3 \(an integer\): must be a string"),
        ("train", "lr", "1e-4", r"train\.lr = '1e-4' \(a string\): must be a number; write it without quotes"),
        ("train", "lr", False, r"train\.lr = false \(a boolean\): must be a number, not true/false"),
        ("train", "betas", 0.9, r"train\.betas = 0\.9 \(a number\): must be a list of 2 numbers"),
        ("train", "betas", [0.9], r"train\.betas = \[0\.9\] \(a list\): must be a list of 2 numbers, got 1"),
        ("train", "betas", [0.9, "x"], r"train\.betas = \[0\.9, x\] \(a list\): item 1 \('x'\) must be a number"),
        (
            "train",
            "precision",
            "bf16",
            r"train\.precision = 'bf16' \(a string\): must be one of '32-true', 'bf16-mixed'; did you mean 'bf16-mixed'\?",
        ),
        (
            "memory",
            "recompute",
            "sometimes",
            r"memory\.recompute = 'sometimes' \(a string\): must be one of 'none', 'selective', 'full'",
        ),
        (
            "memory",
            "recompute_modules",
            "kda",
            r"memory\.recompute_modules = 'kda' \(a string\): must be a list of strings",
        ),
        (
            "memory",
            "moe_chunk_tokens",
            "many",
            r"memory\.moe_chunk_tokens = 'many' \(a string\): must be an integer; .*\(or null\)",
        ),
        ("model", "freeze", [1], r"model\.freeze = \[1\] \(a list\): item 0 \(1\) must be a string"),
    ],
)
def test_wrong_types(section: str, key: str, value: Any, match: str) -> None:
    fails(minimal(**{section: {key: value}}), match)


def test_section_and_override_types() -> None:
    fails(minimal(data=[1, 2]), r"data must be a mapping of keys, got a list")
    fails(
        minimal(model={"preset": "small", "overrides": {"num_hidden_layers": "4"}}),
        r"model\.overrides\.num_hidden_layers = '4' \(a string\): must be an integer",
    )
    fails(
        minimal(model={"preset": "small", "overrides": ["x"]}),
        r"model\.overrides must be a mapping of ModelConfig fields",
    )
    fails(
        minimal(model={"preset": "small", "vocab_map": "identiti"}),
        r"model\.vocab_map = 'identiti'.*did you mean 'identity'\?",
    )
    fails(minimal(model={"preset": "small", "vocab_map": {"A": 1, "C": 2}}), r"model\.vocab_map lacks G, T, N")
    fails(
        minimal(model={"preset": "small", "vocab_map": {"A": 1, "C": 2, "G": 3, "T": 4, "N": -5}}),
        r"model\.vocab_map\.N = -5: token ids are non-negative",
    )
    fails(minimal(model={"preset": "smal"}), r"model\.preset = 'smal' is not a preset; did you mean 'small'\?")


def test_yaml_reads_exponent_numbers_and_rejects_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "model: {preset: small}\ndata: {store: g, context: 1024}\ntrain: {max_steps: 10, lr: 1e-4, min_lr: 5E-6}\n"
    )
    recipe = load_recipe(path)
    assert recipe.train.lr == 1e-4 and recipe.train.min_lr == 5e-6 and recipe.name == "r"
    path.write_text("model: {preset: small}\ndata: {store: g, context: 1024}\ntrain: {max_steps: 10, lr: '1e-4'}\n")
    with pytest.raises(InputError, match=r"train\.lr = '1e-4' \(a string\)"):
        load_recipe(path)
    path.write_text(
        "model: {preset: small}\ndata:\n  store: g\n  context: 1024\n  context: 2048\ntrain: {max_steps: 10}\n"
    )
    with pytest.raises(InputError, match=r"duplicate key 'context' at line 5"):
        load_recipe(path)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"recipe '.*nope\.yaml' does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [preset: small\n")
    with pytest.raises(InputError, match=r"is not valid YAML"):
        load_recipe(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(InputError, match=r"the top level must be a mapping of sections .* got a list"):
        load_recipe(bad)


# -- impossible values and cross-field checks ------------------------------------------------------


@pytest.mark.parametrize(
    ("sections", "match"),
    [
        ({"name": "a/b"}, r"name = 'a/b': use letters, digits"),
        ({"seed": -1}, r"seed = -1: must be >= 0"),
        ({"data": {"batch_size": 0}}, r"data\.batch_size = 0: must be at least 1"),
        ({"data": {"rc_prob": 1.5}}, r"data\.rc_prob = 1\.5: a probability must be in \[0, 1\]"),
        ({"data": {"num_workers": -1}}, r"data\.num_workers = -1: must be >= 0"),
        ({"data": {"windows_per_epoch": 0}}, r"data\.windows_per_epoch = 0: must be at least 1 \(or null\)"),
        (
            {"data": {"eval_split": "train"}},
            r"data\.eval_split = data\.train_split = 'train': evaluating on the training split",
        ),
        ({"train": {"max_steps": 0}}, r"train\.max_steps = 0: must be at least 1"),
        ({"train": {"lr": 0}}, r"train\.lr = 0\.0: the learning rate must be > 0"),
        ({"train": {"lr": float("nan")}}, r"train\.lr = nan: must be a finite number"),
        ({"train": {"lr": 1e-4, "min_lr": 1e-3}}, r"train\.min_lr = 0\.001: must be in \[0, train\.lr = 0\.0001\]"),
        (
            {"train": {"max_steps": 10, "warmup_steps": 10}},
            r"train\.warmup_steps = 10: must be less than train\.max_steps = 10",
        ),
        ({"train": {"betas": [0.9, 1.0]}}, r"train\.betas = \[0\.9, 1\.0\]: each beta must be in \[0, 1\)"),
        ({"train": {"eps": 0}}, r"train\.eps = 0\.0: must be > 0"),
        ({"train": {"grad_clip": -1}}, r"train\.grad_clip = -1: must be >= 0"),
        ({"train": {"accumulate_grad_batches": 0}}, r"train\.accumulate_grad_batches = 0: must be at least 1"),
        ({"train": {"max_consecutive_nonfinite": 0}}, r"train\.max_consecutive_nonfinite = 0: must be at least 1"),
        ({"memory": {"recompute": "selective"}}, r"memory\.recompute = 'selective' needs memory\.recompute_modules"),
        (
            {"memory": {"recompute": "full", "recompute_modules": ["kda"]}},
            r"applies only to memory\.recompute = 'selective' \(it is 'full'\)",
        ),
        (
            {"memory": {"recompute": "selective", "recompute_modules": ["kda", "atn"]}},
            r"item 1 = 'atn' is not a module type",
        ),
        ({"memory": {"recompute": "selective", "recompute_modules": ["kda", "kda"]}}, r"lists a module type twice"),
        ({"memory": {"moe_chunk_tokens": 0}}, r"memory\.moe_chunk_tokens = 0: must be at least 1 \(or null\)"),
        ({"memory": {"ce_chunk_tokens": 0}}, r"memory\.ce_chunk_tokens = 0: must be at least 1"),
        (
            {"memory": {"moe_capacity_factor": 0.8}},
            r"memory\.moe_capacity_factor = 0\.8: must be at least 1\.0 \(below it tokens are dropped",
        ),
        (
            {"memory": {"moe_imbalance": 0.5}},
            r"memory\.moe_imbalance = 0\.5: the busiest expert's load over the mean is at least 1\.0",
        ),
        ({"train": {"moe_balance_loss_weight": -0.1}}, r"train\.moe_balance_loss_weight = -0\.1: must be >= 0"),
        ({"train": {"moe_bias_update": "signum"}}, r"train\.moe_bias_update = 'signum'.*sign.*proportional"),
        ({"logging": {"moe_collapse_steps": 0}}, r"logging\.moe_collapse_steps = 0: must be at least 1"),
        ({"eval": {"max_tiles": 0}}, r"eval\.max_tiles = 0: must be at least 1 \(or null\)"),
        (
            {"eval": {"every_n_steps": 5}, "data": {"eval_split": None}},
            r"eval\.every_n_steps = 5 but data\.eval_split is null",
        ),
        ({"checkpoint": {"keep_last": 0}}, r"checkpoint\.keep_last = 0: must be at least 1"),
        ({"logging": {"every_n_steps": 0}}, r"logging\.every_n_steps = 0: must be at least 1"),
        ({"model": {"preset": "small", "softmask_weight": -0.1}}, r"model\.softmask_weight = -0\.1: must be >= 0"),
        (
            {"model": {"preset": "small", "vocab_map": "tokenizer"}},
            r"model\.vocab_map = 'tokenizer' reads the checkpoint's tokenizer\.json",
        ),
        (
            {"model": {"preset": "small", "overrides": {"index_kpool": 7}}},
            r"model\.overrides: index_topk \(512\) must be a positive multiple of index_kpool \(7\)",
        ),
    ],
)
def test_impossible_values(sections: dict[str, Any], match: str) -> None:
    fails(minimal(**sections), match)


def test_context_must_suit_the_kernels_and_cp() -> None:
    # small: KDA chunks of 64 and DSA key pools of 16 -> multiples of 64
    message = fails(minimal(data={"context": 1000}), r"data\.context = 1,000: must be a multiple of 64")
    assert "KDA chunk of 64" in message and "DSA key pool of 16" in message and "use 960 or 1,024" in message
    # a larger key pool raises the multiple to lcm(64, pool)
    fails(
        minimal(model={"preset": "tiny", "overrides": {"index_kpool": 128, "index_topk": 256}}, data={"context": 1088}),
        r"must be a multiple of 128 .*DSA key pool of 128 tokens",
    )
    # CP: every shard holds whole chunks: context divisible by cp x 64
    parse_recipe(minimal(data={"context": 2048}, parallel={"cp": 32, "devices": 32}))
    fails(
        minimal(data={"context": 1024}, parallel={"cp": 32, "devices": 32}),
        r"data\.context = 1,024: must be a multiple of 2,048 \(parallel\.cp = 32 shards.*use 2,048",
    )
    fails(
        minimal(data={"context": 3200}, parallel={"cp": 3, "devices": 3}),
        r"data\.context = 3,200: must be a multiple of 192",
    )
    # the eval tiles obey the same rule
    fails(minimal(eval={"context": 100}), r"eval\.context = 100: must be a multiple of 64")
    # and the model's position limit
    fails(
        minimal(model={"preset": "small", "overrides": {"max_position_embeddings": 512}}),
        r"data\.context = 1,024 exceeds the model's max_position_embeddings \(512\)",
    )


def test_kernel_multiple() -> None:
    small = ModelConfig.from_preset("small")
    assert kernel_multiple(small) == KDA_CHUNK
    assert kernel_multiple(small, cp=8) == 8 * KDA_CHUNK
    assert kernel_multiple(small.replace(index_kpool=128, index_topk=512)) == 128
    only_dsa = ModelConfig.from_preset("tiny", pattern="D", indexer_types=("full",) * 8)
    assert kernel_multiple(only_dsa) == 8  # no KDA layer: only the key pool counts
    assert kernel_multiple(ModelConfig.from_preset("tiny", pattern="K")) == KDA_CHUNK
    parse_recipe(
        minimal(
            model={"preset": "tiny", "overrides": {"pattern": "D", "indexer_types": ["full"] * 8}}, data={"context": 72}
        )
    )


def test_parallel_mesh() -> None:
    recipe = parse_recipe(
        minimal(parallel={"devices": 8, "num_nodes": 8, "cp": 8, "dp_shard": 8}, data={"context": 4096})
    )
    assert (recipe.parallel.world_size, recipe.parallel.dp_shard_size, recipe.parallel.dp_size) == (64, 8, 8)
    auto = parse_recipe(minimal(parallel={"devices": 8, "num_nodes": 2, "cp": 2, "dp_replicate": 2}))
    assert (auto.parallel.dp_shard, auto.parallel.dp_shard_size, auto.parallel.dp_size) == (-1, 4, 8)
    fails(
        minimal(parallel={"devices": 8, "num_nodes": 8, "cp": 8, "dp_shard": 4}),
        r"parallel\.cp \(8\) x dp_shard \(4\) x dp_replicate \(1\) = 32 but there are 64 processes",
    )
    fails(
        minimal(parallel={"devices": 8, "cp": 3}),
        r"parallel\.cp \(3\) x parallel\.dp_replicate \(1\) = 3 does not divide the 8 processes",
    )
    fails(minimal(parallel={"dp_shard": 0}), r"parallel\.dp_shard = 0: must be at least 1, or -1")
    fails(minimal(parallel={"devices": 0}), r"parallel\.devices = 0: must be at least 1")


# -- --set -----------------------------------------------------------------------------------------


def test_set_overrides_are_applied_in_order() -> None:
    recipe = parse_recipe(
        minimal(),
        (
            "train.lr=3e-4",
            "data.eval_split=null",
            "model.freeze=[embed_tokens.*, 'layers.0.*']",
            "model.overrides.num_hidden_layers=4",
            "data.context=2048",
            "data.context=4096",
            "memory.recompute=selective",
            "memory.recompute_modules=[kda, moe]",
            "name=other",
        ),
    )
    assert recipe.train.lr == 3e-4
    assert recipe.data.eval_split is None and recipe.data.context == 4096
    assert recipe.model.freeze == ("embed_tokens.*", "layers.0.*")
    assert recipe.model.overrides == {"num_hidden_layers": 4}
    assert recipe.model_config().num_hidden_layers == 4
    assert recipe.memory.recompute_modules == ("kda", "moe")
    assert recipe.checkpoint.dir == Path.cwd() / "runs/other/checkpoints"
    assert recipe.logging.dir == Path.cwd() / "runs/other/logs"
    mapped = parse_recipe(minimal(), [f"model.vocab_map.{b}={i}" for i, b in enumerate("ACGTN", 1)])
    assert mapped.model.vocab_map == {"A": 1, "C": 2, "G": 3, "T": 4, "N": 5}


def test_parse_set() -> None:
    assert parse_set("train.lr=1e-3") == ("train.lr", 1e-3)
    assert parse_set("data.store = genome/x") == ("data.store", "genome/x")
    assert parse_set("train.betas=[0.8, 0.9]") == ("train.betas", [0.8, 0.9])
    assert parse_set("data.eval_split=") == ("data.eval_split", None)
    assert parse_set("model.preset=a=b") == ("model.preset", "a=b")


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("train.lr", r"--set 'train\.lr': write KEY=VALUE"),
        ("train..lr=1", r"'train\.\.lr' is not a dotted key"),
        ("=1", r"'' is not a dotted key"),
        ("train.betas=[0.9, 0.95", r"the value is not valid YAML"),
        ("trian.lr=1", r"--set 'trian\.lr=1': unknown key trian; did you mean train\?"),
        ("data.contxt=1024", r"unknown key data\.contxt; did you mean data\.context\?"),
        (
            "model.overrides.hidden_sise=3",
            r"unknown key model\.overrides\.hidden_sise \(not a ModelConfig field\); did you mean model\.overrides\.hidden_size\?",
        ),
        ("data.context.x=1", r"data\.context is a single value, it has no key 'x'"),
        ("data.context=yes", r"--set 'data\.context=yes': data\.context = true \(a boolean\): must be an integer"),
        ("train.warmup_steps=10", r"--set 'train\.warmup_steps=10': train\.warmup_steps = 10: must be less than"),
        (
            "train.max_steps=5",
            r"--set 'train\.max_steps=5': train\.warmup_steps = 5: must be less than train\.max_steps = 5",
        ),
        (
            "parallel.cp=16",
            r"--set 'parallel\.cp=16': data\.context = 1,024: must be a multiple of 1,024|--set 'parallel\.cp=16': parallel\.cp \(16\)",
        ),
        (
            "memory.recompute=full",
            r"--set 'memory\.recompute=full': memory\.recompute_modules = \[kda\] applies only to",
        ),
    ],
)
def test_bad_set(item: str, match: str) -> None:
    base = minimal(
        train={"max_steps": 10, "warmup_steps": 5}, memory={"recompute": "selective", "recompute_modules": ["kda"]}
    )
    fails(base, match, (item,))


# -- round trip, paths, model resolution -----------------------------------------------------------


def test_round_trip_and_diff(tmp_path: Path) -> None:
    recipe = parse_recipe(
        minimal(
            model={
                "preset": "small",
                "overrides": {"pattern": "KKDD", "eos_token_id": [6, 7]},
                "vocab_map": {"A": 1, "C": 2, "G": 3, "T": 4, "N": 5, "pad": 0},
            },
            memory={"recompute": "selective", "recompute_modules": ["kda", "dsa"], "moe_chunk_tokens": 512},
            train={"max_steps": 10, "lr": 2.5e-4, "betas": [0.8, 0.9]},
        )
    )
    plain = recipe.to_dict()
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain  # builtins only
    assert list(plain)[:4] == ["name", "seed", "model", "data"]
    assert parse_recipe(plain) == recipe
    assert load_recipe(recipe.save(tmp_path / "run" / "recipe.yaml")) == recipe
    assert recipe_diff(recipe, recipe) == {}
    changed = parse_recipe(plain, ("train.lr=1e-4", "model.overrides.pattern=KDDD"))
    assert recipe_diff(recipe, changed) == {
        "model.overrides": ({"pattern": "KKDD", "eos_token_id": [6, 7]}, {"pattern": "KDDD", "eos_token_id": [6, 7]}),
        "train.lr": (2.5e-4, 1e-4),
    }


def test_relative_paths_resolve_against_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "recipes").mkdir()
    path = tmp_path / "recipes" / "r.yaml"
    path.write_text(yaml.safe_dump(minimal(model={"preset": "small", "checkpoint": "ckpt/base"})))
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe("recipes/r.yaml")
    assert recipe.data.store == tmp_path / "genome"  # not tmp_path/recipes/genome
    assert recipe.model.checkpoint == tmp_path / "ckpt" / "base"
    assert recipe.checkpoint.dir == tmp_path / "runs" / "t" / "checkpoints"
    monkeypatch.chdir(tmp_path / "recipes")
    assert load_recipe("r.yaml").data.store == tmp_path / "recipes" / "genome"


def test_model_config_from_a_checkpoint(tmp_path: Path) -> None:
    tiny = ModelConfig.from_preset("tiny")
    tiny.save_pretrained(tmp_path / "tiny")
    recipe = parse_recipe(
        minimal(model={"preset": "tiny", "checkpoint": str(tmp_path / "tiny"), "overrides": {"index_topk": 128}})
    )
    assert recipe.model_config() == tiny.replace(index_topk=128)
    assert recipe.vocab_map() == VocabMap.identity()
    # the checkpoint must have the preset's shapes
    fails(
        minimal(model={"preset": "small", "checkpoint": str(tmp_path / "tiny")}),
        r"model\.checkpoint '.*tiny' has hidden_size = 64 but model\.preset 'small' has 256",
    )
    # a checkpoint on disk decides the kernel multiple at load time
    ModelConfig.from_preset("tiny", index_kpool=128, index_topk=256).save_pretrained(tmp_path / "pool")
    fails(
        minimal(model={"preset": None, "checkpoint": str(tmp_path / "pool")}, data={"context": 1088}),
        r"must be a multiple of 128",
    )
    # not on disk yet: loading works (e.g. `genolong plan`), resolving the model does not
    later = parse_recipe(
        minimal(model={"preset": None, "checkpoint": str(tmp_path / "missing")}, data={"store": str(tmp_path)})
    )
    with pytest.raises(InputError, match=r"model\.checkpoint: .*config\.json does not exist"):
        later.model_config()
    with pytest.raises(InputError, match=r"data\.store = .* is not a genome store \(no manifest\.json\)"):
        later.check_paths()
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(InputError, match=r"model\.checkpoint = .*missing' is not a checkpoint directory"):
        later.check_paths()
    fine = parse_recipe(
        minimal(model={"preset": None, "checkpoint": str(tmp_path / "tiny")}, data={"store": str(tmp_path)})
    )
    fine.check_paths()


def test_vocab_map_resolution(tmp_path: Path) -> None:
    assert parse_recipe(minimal()).vocab_map() == VocabMap.identity()
    mapped = parse_recipe(minimal(model={"preset": "small", "vocab_map": {"A": 4, "C": 3, "G": 2, "T": 1, "N": 5}}))
    assert mapped.vocab_map().ids == (0, 4, 3, 2, 1, 5, -1, -1)
    too_big = parse_recipe(minimal(model={"preset": "small", "vocab_map": {"A": 1, "C": 2, "G": 3, "T": 4, "N": 50}}))
    with pytest.raises(InputError, match=r"token ids \[50\] but the model's vocab_size is 8"):
        too_big.vocab_map()
    # a text vocabulary with mode auto reads the checkpoint's tokenizer.json
    ModelConfig.from_preset("tiny", vocab_size=100, pad_token_id=99).save_pretrained(tmp_path)
    text = parse_recipe(minimal(model={"preset": None, "checkpoint": str(tmp_path)}))
    with pytest.raises(InputError, match=r"tokenizer\.json does not exist"):
        text.vocab_map()


def test_recipes_are_frozen() -> None:
    recipe = parse_recipe(minimal())
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.data.context = 2048  # type: ignore[misc]
    assert isinstance(recipe, Recipe)
    assert set(RECOMPUTE_MODULES) >= {"kda", "dsa", "moe", "mlp"}


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        # small: 8 routed experts; 4 processes with cp 2 -> dp_shard x cp = 4
        (
            ("parallel.devices=4", "parallel.cp=2", "parallel.ep=3"),
            r"parallel\.ep = 3 does not divide parallel\.dp_shard x parallel\.cp = 2 x 2 = 4",
        ),
        (
            (
                "parallel.devices=8",
                "parallel.ep=8",
                "model.overrides.n_routed_experts=12",
                "model.overrides.n_group=1",
                "model.overrides.topk_group=1",
            ),
            r"parallel\.ep = 8 does not divide the model's n_routed_experts = 12",
        ),
        (
            (
                "parallel.devices=2",
                "parallel.ep=2",
                "model.overrides.mlp_layer_types=[dense, dense, dense, dense, dense, dense, dense, dense]",
            ),
            r"parallel\.ep = 2 but the model has no MoE layer",
        ),
        (
            ("memory.recompute_chunk_tokens=100",),
            r"memory\.recompute_chunk_tokens = 100: must be a multiple of the KDA chunk of 64",
        ),
        (
            ("memory.recompute=chunked", "model.overrides.index_kpool=128", "memory.recompute_chunk_tokens=192"),
            r"memory\.recompute_chunk_tokens = 192: must be a multiple of 128 \(whole KDA chunks and DSA key pools",
        ),
    ],
)
def test_bad_expert_parallel_and_recompute_chunk(sets: tuple[str, ...], match: str) -> None:
    """Impossible EP sizes and chunked-recompute segments fail before any work, one line naming the keys."""
    fails(minimal(), match, sets)


def test_expert_parallel_and_chunked_recompute_accepted() -> None:
    recipe = parse_recipe(
        minimal(),
        (
            "parallel.devices=4",
            "parallel.cp=2",
            "parallel.ep=4",
            "memory.recompute=chunked",
            "memory.recompute_chunk_tokens=128",
        ),
    )
    assert (recipe.parallel.ep, recipe.memory.recompute, recipe.memory.recompute_chunk_tokens) == (4, "chunked", 128)
