"""`genolong recipe schema` and `genolong recipe show`: the JSON Schema covers and accepts every
shipped recipe (and rejects a typo or a wrong type), and `show` prints a recipe that loads back equal."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from genolong.cli import main
from genolong.config import Recipe, _RecipeLoader, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SHIPPED = sorted(RECIPES.glob("*.yaml"))
_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
    "array": list,
    "object": dict,
}


def violations(value: Any, node: dict[str, Any], defs: dict[str, Any], where: str = "") -> list[str]:
    """Where ``value`` breaks JSON Schema ``node`` (the keywords the recipe schema uses; ``jsonschema``
    is not a dependency)."""
    if "$ref" in node:
        node = {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
    if "anyOf" in node:
        return (
            []
            if any(not violations(value, n, defs, where) for n in node["anyOf"])
            else [f"{where}: {value!r} matches no option"]
        )
    if "enum" in node and value not in node["enum"]:
        return [f"{where}: {value!r} not in {node['enum']}"]
    kind = _TYPES.get(node.get("type", ""), object)
    if not isinstance(value, kind) or (isinstance(value, bool) and node.get("type") in ("integer", "number")):
        return [f"{where}: {value!r} is not {node['type']}"]
    if "minimum" in node and value < node["minimum"]:
        return [f"{where}: {value!r} < {node['minimum']}"]
    out: list[str] = []
    if isinstance(value, dict):
        props = node.get("properties", {})
        out += [
            f"{where}.{k}: unknown key" for k in value if k not in props and node.get("additionalProperties") is False
        ]
        out += [f"{where}.{k}: missing" for k in node.get("required", ()) if k not in value]
        for k, v in value.items():
            if k in props:
                out += violations(v, props[k], defs, f"{where}.{k}".lstrip("."))
    if isinstance(value, list):
        items = node.get("prefixItems") or [node.get("items", {})] * len(value)
        if not node.get("minItems", 0) <= len(value) <= node.get("maxItems", len(value)):
            out.append(f"{where}: {len(value)} items")
        for i, (v, n) in enumerate(zip(value, items)):
            out += violations(v, n, defs, f"{where}[{i}]")
    return out


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("schema") / "recipe.schema.json"
    assert main(["recipe", "schema", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_schema_has_every_section_key_type_and_description(schema: dict[str, Any]) -> None:
    assert schema["$schema"].endswith("2020-12/schema") and schema["required"] == ["data", "train"]
    defs = schema["$defs"]
    hints = typing.get_type_hints(Recipe)
    assert list(schema["properties"]) == [f.name for f in dataclasses.fields(Recipe)]
    for name, node in schema["properties"].items():
        if dataclasses.is_dataclass(hints[name]):
            section = defs[node["$ref"].rsplit("/", 1)[-1]]
            assert list(section["properties"]) == [g.name for g in dataclasses.fields(hints[name])]
            assert section["additionalProperties"] is False and section["description"]
            assert all(p.get("description") for p in section["properties"].values()), name
    train, memory, data = (
        defs["TrainSection"]["properties"],
        defs["MemorySection"]["properties"],
        defs["DataSection"]["properties"],
    )
    assert train["precision"]["enum"] == ["32-true", "bf16-mixed"]
    assert memory["recompute"]["enum"] == ["none", "selective", "full", "chunked"]
    assert train["max_steps"] == {**train["max_steps"], "type": "integer", "minimum": 1}
    assert train["lr"]["type"] == "number" and data["verify"]["type"] == "boolean"
    assert data["store"]["format"] == "path" and "genolong prepare" in data["store"]["description"]
    assert "hidden_size" in defs["ModelOverrides"]["properties"] and "pattern" in defs["ModelOverrides"]["properties"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_schema_accepts_every_shipped_recipe(schema: dict[str, Any], path: Path) -> None:
    raw = yaml.load(path.read_text(), Loader=_RecipeLoader)  # noqa: S506 - YAML 1.2 numbers (1e-4), as editors read them
    assert violations(raw, schema, schema["$defs"]) == []


def test_schema_rejects_a_typo_and_a_wrong_type(schema: dict[str, Any]) -> None:
    raw = yaml.safe_load((RECIPES / "quickstart.yaml").read_text())
    raw["train"]["max_step"] = raw["train"].pop("max_steps")
    raw["data"]["context"] = "8192"
    raw["model"]["vocab_map"] = "identiti"
    raw["memory"]["ce_chunk_tokens"] = 0
    assert sorted(violations(raw, schema, schema["$defs"])) == [
        "data.context: '8192' is not integer",
        "memory.ce_chunk_tokens: 0 < 1",
        "model.vocab_map: 'identiti' matches no option",
        "train.max_step: unknown key",
        "train.max_steps: missing",
    ]


def test_show_prints_the_resolved_recipe_which_loads_back_equal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sets = ["train.lr=3e-4", "model.freeze=[embed_tokens.*]"]
    assert main(["recipe", "show", str(RECIPES / "quickstart.yaml"), *sum((["--set", s] for s in sets), [])]) == 0
    text = capsys.readouterr().out
    expected = load_recipe(RECIPES / "quickstart.yaml", sets)
    assert text == expected.to_yaml()
    (tmp_path / "quickstart.yaml").write_text(text)
    assert load_recipe(tmp_path / "quickstart.yaml") == expected
    assert expected.train.lr == 3e-4 and str(Path.cwd()) in yaml.safe_load(text)["data"]["store"]


def test_recipe_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["recipe", "show", str(RECIPES / "quickstart.yaml"), "--set", "train.max_step=5"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "genolong recipe: error: --set 'train.max_step=5': unknown key train.max_step; did you mean train.max_steps?\n"
    )
    out = tmp_path / "s.json"
    out.write_text("{}")
    assert main(["recipe", "schema", "--out", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err and out.read_text() == "{}"
    assert main(["recipe", "schema", "--out", str(out), "--force"]) == 0
    assert json.loads(out.read_text())["title"] == "genolong recipe"
