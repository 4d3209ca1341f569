"""Reading a recipe: the strict YAML loader, ``--set a.b=c`` overrides, :func:`load_recipe` and
:func:`parse_recipe`, and pydantic's validation errors turned into one-line
:class:`~genolong.errors.InputError` messages (:func:`_input_error`: the first error in the
recipe's field order, with the dotted key, the value as written and the fix).

A recipe is validated in this order: the file is read and parsed as YAML (duplicate keys are
errors, ``1e-4`` is a number); each ``--set`` item is parsed, its key checked against the schema
and assigned; pydantic validates types, keys and bounds; the name-dependent defaults are filled;
then the cross-field checks of ``recipe`` run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from ..errors import InputError
from .messages import _Context, _describe, _expected, _field_help, _kind, _show, _suggest
from .recipe import _SECTIONS, Recipe, _check, _recipe_adapter
from .schema import _abspath, _Overrides

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_set(item: str) -> tuple[str, Any]:
    """Split one ``--set`` item ``a.b=c`` into ``("a.b", value)``; the value is parsed as YAML.

    ``--set train.lr=3e-4`` gives a float, ``--set data.eval_split=null`` None,
    ``--set model.freeze=[embed_tokens.*]`` a list. Key validity is checked by :func:`load_recipe`.

    Raises:
        InputError: no ``=``, a malformed key, or a value that is not valid YAML.
    """
    if not isinstance(item, str) or "=" not in item:
        raise InputError(f"--set {item!r}: write KEY=VALUE with a dotted key, e.g. --set train.lr=3e-4")
    key, text = item.split("=", 1)
    key = key.strip()
    if not _KEY_RE.match(key):
        raise InputError(f"--set {item!r}: {key!r} is not a dotted key; write e.g. --set data.context=131072")
    try:
        value = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise InputError(
            f"--set {item!r}: the value is not valid YAML ({_one_line(exc)}); quote it or fix it"
        ) from None
    return key, value


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe file, apply ``--set`` overrides, and check everything.

    Args:
        path: the YAML file.
        overrides: ``"a.b=c"`` items (see :func:`parse_set`), applied in order on top of the file.

    Returns:
        The recipe; relative paths resolved against the current directory, ``checkpoint.dir``
        and ``logging.dir`` defaulted under ``runs/<name>/``.

    Raises:
        InputError: a missing or unparsable file, an unknown key (with the nearest valid key), a
            wrong type, an impossible value or an inconsistent combination; one line naming the
            key, the value and the fix.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(
            f"recipe {str(path)!r} does not exist; give the path of a recipe YAML file (see recipes/)"
        ) from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise InputError(f"recipe {str(path)!r} is not a readable YAML text file ({exc})") from None
    try:
        data = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise InputError(f"recipe {str(path)!r} is not valid YAML: {_one_line(exc)}") from None
    if data is None:
        data = {}
    return parse_recipe(data, overrides, name=path.stem, source=f"recipe {str(path)!r}")


def parse_recipe(
    data: Mapping[str, Any], overrides: Sequence[str] = (), *, name: str | None = None, source: str = "recipe"
) -> Recipe:
    """Build a checked :class:`Recipe` from a dict as read from YAML (see :func:`load_recipe`).

    Args:
        data: the recipe mapping (``Recipe.to_dict()`` output, or parsed YAML).
        overrides: ``"a.b=c"`` items applied on top.
        name: default run name when ``data`` has none.
        source: how error messages name the input (e.g. ``"recipe 'recipes/512k.yaml'"``).

    Raises:
        InputError: as :func:`load_recipe`.
    """
    if not isinstance(data, Mapping):
        raise InputError(
            f"{source}: the top level must be a mapping of sections (model:, data:, train:, ...), got {_kind(data)}"
        )
    raw: dict[str, Any] = _deep_copy(data)
    if isinstance(overrides, str):
        overrides = (overrides,)
    sets: dict[str, str] = {}
    for item in overrides:
        key, value = parse_set(item)
        _check_set_key(key, item)
        _assign(raw, key, value, item)
        sets[key] = item
    if name is not None and "name" not in raw:
        raw["name"] = name
    # an empty section (every key commented out) reads as null: take it as {}
    for section in _SECTIONS:
        if section in raw and raw[section] is None:
            raw[section] = {}
    if isinstance(raw.get("model"), dict) and raw["model"].get("overrides", {}) is None:
        raw["model"]["overrides"] = {}
    ctx = _Context(source, sets)
    try:
        recipe = _recipe_adapter().validate_python(raw)
    except pydantic.ValidationError as exc:
        first = min(exc.errors(include_url=False), key=lambda e: _rank(e["loc"]))
        raise _input_error(first, raw, ctx) from None
    recipe = _finish(recipe)
    _check(recipe, ctx)
    return recipe


def recipe_diff(a: Recipe, b: Recipe) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two recipes: ``{key: (value in a, value in b)}``.

    Use it on ``--resume`` to show what changed since the stored recipe.
    """
    flat_a, flat_b = _flatten(a.to_dict()), _flatten(b.to_dict())
    keys = list(flat_a) + [k for k in flat_b if k not in flat_a]
    return {k: (flat_a.get(k), flat_b.get(k)) for k in keys if flat_a.get(k) != flat_b.get(k)}


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float (YAML 1.2) and rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            if isinstance(key, (str, int, float, bool)) and key in seen:
                line = key_node.start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} at line {line}; keep one", key_node.start_mark
                )
            if isinstance(key, (str, int, float, bool)):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"),
)


def _one_line(exc: Exception) -> str:
    """An exception's message on one line (YAML errors span several)."""
    return " ".join(str(exc).split())


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    """Field name -> type (``Annotated`` and ``Strict*`` stripped to the plain type), in order."""
    return typing.get_type_hints(cls)


def _section_type(tp: Any) -> Any:
    """``tp`` without its ``| None`` when it is an optional section (``model.lora``,
    ``data.plant_repeats``), so that errors inside it name its keys; ``tp`` otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if len(sections) == 1 and type(None) in typing.get_args(tp):
            return sections[0]
    return tp


def _field_types(tp: Any) -> dict[str, Any] | None:
    """The keys a mapping of type ``tp`` may hold (a section, the Recipe, model.overrides) with
    their types; None for a plain value."""
    tp = _section_type(tp)
    return _hints(tp) if tp is _Overrides or dataclasses.is_dataclass(tp) else None


def _unknown_key(prefix: str, name: str, tp: Any) -> str:
    """``unknown key PREFIX.NAME; did you mean ...?`` for a key the mapping type ``tp`` does not hold."""
    note = " (not a ModelConfig field)" if tp is _Overrides else ""
    return f"unknown key {prefix}{name}{note}; {_suggest(name, list(_hints(_section_type(tp))), prefix)}"


def _input_error(error: Mapping[str, Any], raw: Mapping[str, Any], ctx: _Context) -> InputError:
    """One pydantic validation error as genolong's one-line InputError: the dotted key (from the
    error's ``loc``), the value as written, what was expected and the fix (from the field's type)."""
    loc, kind = error["loc"], error["type"]
    parent: Any = None
    tp: Any = Recipe
    parts: list[str] = []
    value: Any = raw
    for part in loc:
        fields = _field_types(tp)
        if fields is None or part not in fields:
            break
        parent, tp = _section_type(tp), fields[part]
        parts.append(part)
        value = value.get(part) if isinstance(value, Mapping) else None
    rest, key = loc[len(parts) :], ".".join(parts)
    if kind == "recipe":  # a message written whole by a validator (model.vocab_map)
        return ctx.error(key, error["msg"])
    if kind in ("unexpected_keyword_argument", "extra_forbidden", "invalid_key"):
        prefix, name = (key + "." if key else ""), str(rest[0])
        return ctx.error(prefix + name, _unknown_key(prefix, name, tp))
    if kind == "missing" and not rest:
        while dataclasses.is_dataclass(tp):  # a whole section left out: name its first required key
            parent = tp
            name = next(f.name for f in dataclasses.fields(tp) if f.default is f.default_factory is dataclasses.MISSING)
            key, tp = f"{key}.{name}", _hints(tp)[name]
        return ctx.error(
            key, f"missing required key {key}; add it to the recipe ({_field_help(parent, key.rsplit('.', 1)[-1])})"
        )
    if _field_types(tp) is not None:
        what = "mapping of ModelConfig fields (e.g. {num_hidden_layers: 4})" if tp is _Overrides else "mapping of keys"
        return ctx.error(key, f"{key or 'the recipe'} must be a {what}, got {_kind(value)} {value!r}")
    if kind in ("too_long", "too_short") or (kind == "missing" and rest):
        message = f"must be {_describe(tp)}, got {len(value)}"
    elif kind == "recipe_value":
        message = error["msg"]
    elif kind == "greater_than":  # a bound > x (parallel.timeout_s, model.lora.alpha)
        return ctx.error(key, f"{key} = {_show(value)}: must be > {error.get('ctx', {}).get('gt', 0):g}")
    elif kind == "less_than_equal":  # an upper bound (a share: data.plant_repeats.share)
        return ctx.error(key, f"{key} = {_show(value)}: must be <= {error.get('ctx', {}).get('le', 0):g}")
    elif kind in ("greater_than_equal", "finite_number"):
        bound = error.get("ctx", {}).get("ge")
        message = (
            "must be a finite number"
            if bound is None
            else "must be at least 1"
            if bound == 1
            else f"must be >= {bound:g}"
        )
        optional = type(None) in typing.get_args(tp)
        return ctx.error(key, f"{key} = {_show(value)}: {message}{' (or null)' if optional and bound == 1 else ''}")
    elif rest and isinstance(rest[0], int) and typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        item = args[0] if args[-1] is Ellipsis else args[rest[0]]
        message = f"item {rest[0]} ({error['input']!r}) {_expected(item, error['input'])}"
    else:
        message = _expected(tp, value)
    return ctx.error(key, f"{key} = {_show(value)} ({_kind(value)}): {message}")


def _rank(loc: tuple[Any, ...]) -> tuple[int, ...]:
    """Sort key of an error: the recipe's field order (an unknown key first in its mapping)."""
    tp: Any = Recipe
    out = []
    for part in loc:
        fields = _field_types(tp) or {}
        names = list(fields)
        out.append(names.index(part) if part in names else -1 if names or not isinstance(part, int) else part)
        tp = fields.get(part)
    return tuple(out)


def _finish(recipe: Recipe) -> Recipe:
    """Fill the name-dependent defaults (run directories under ``runs/<name>/``)."""
    for section, folder in (("checkpoint", "checkpoints"), ("logging", "logs")):
        part = getattr(recipe, section)
        if part.dir is None:
            recipe = dataclasses.replace(
                recipe, **{section: dataclasses.replace(part, dir=_abspath(f"runs/{recipe.name}/{folder}"))}
            )
    return recipe


# -- --set ---------------------------------------------------------------------------------------


def _check_set_key(key: str, item: str) -> None:
    """Reject a ``--set`` key that names nothing in the schema (with the nearest valid key)."""
    parts = key.split(".")
    tp: Any = Recipe
    for depth, part in enumerate(parts):
        prefix = "".join(p + "." for p in parts[:depth])
        fields = _field_types(tp)
        if fields is None:
            if parts[depth - 1] == "vocab_map" and depth == len(parts) - 1:
                return  # one base id: model.vocab_map.A=5 (the validator checks the name)
            raise InputError(
                f"--set {item!r}: {prefix[:-1]} is a single value, it has no key {part!r}; set {prefix[:-1]} itself"
            )
        if part not in fields:
            raise InputError(f"--set {item!r}: {_unknown_key(prefix, part, tp)}")
        tp = fields[part]


def _assign(raw: dict[str, Any], key: str, value: Any, item: str) -> None:
    """Set dotted ``key`` to ``value`` in ``raw``, making the mappings on the way (``item``: the ``--set`` text, for errors)."""
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None or (part == "vocab_map" and isinstance(child, str)):
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise InputError(
                f"--set {item!r}: {where} in the recipe is {child!r}, not a mapping; fix the recipe or set {where} whole"
            )
        node = child
    node[parts[-1]] = value


def _deep_copy(value: Any) -> Any:
    """A copy of parsed YAML (mappings as dicts, tuples as lists) that ``--set`` may change."""
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deep_copy(v) for v in value]
    return value


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of a :meth:`Recipe.to_dict` (``model.overrides`` and ``model.vocab_map`` count as one key)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value and key not in ("overrides", "vocab_map"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
