"""The wording of recipe errors: one line naming the key, the value as written, what was expected
and the fix.

Nothing here knows the schema. These helpers say a value as YAML writes it (:func:`_show`) and
what kind it is (:func:`_kind`), what a type needs from someone who wrote a given value
(:func:`_expected`, :func:`_describe`), the nearest valid key or value (:func:`_suggest`,
:func:`_suggest_value`), a field's help line from its section's ``Attributes:`` docstring
(:func:`_field_help`; :func:`_attribute_docs` also describes each key in the JSON Schema) and
where a value came from (:class:`_Context`: the recipe file or the ``--set`` item that set it).
``loading`` words pydantic's validation errors with them, ``recipe`` its cross-field checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic_core import PydanticCustomError

from ..errors import InputError


def _recipe_error(message: str, whole: bool = False) -> PydanticCustomError:
    """A validation error that :func:`_input_error` prints after ``KEY = VALUE (kind): `` (or
    ``whole``: as it is, the message names the key)."""
    return PydanticCustomError("recipe" if whole else "recipe_value", "{message}", {"message": message})


class _Context:
    """Where values came from, for error messages: the file, or a ``--set`` item."""

    def __init__(self, source: str, sets: Mapping[str, str]):
        self.source = source
        self.sets = sets

    def error(self, key: str | tuple[str, ...], message: str) -> InputError:
        """An InputError for ``message`` about dotted ``key`` (or the keys a cross-field check
        involves), prefixed with the ``--set`` item that last set one of them, else the source."""
        keys = (key,) if isinstance(key, str) else key
        origin = self.source
        for set_key, item in self.sets.items():
            if any(k == set_key or k.startswith(set_key + ".") or set_key.startswith(k + ".") for k in keys):
                origin = f"--set {item!r}"
        return InputError(f"{origin}: {message}")


def _suggest(key: str, valid: Sequence[str], prefix: str) -> str:
    """``did you mean PREFIX.KEY?`` for the nearest of ``valid``, else the list of valid keys."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    return f"valid keys{' in ' + prefix.rstrip('.') if prefix else ''}: {', '.join(valid)}"


def _suggest_value(value: str, valid: list[str]) -> str:
    """``did you mean 'VALUE'?`` for the nearest of ``valid``, else the list of choices."""
    close = difflib.get_close_matches(value, valid, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"choose one of {', '.join(map(repr, valid))}"


def _attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of a section's docstring, one plain line each (no reST roles)."""
    docs: dict[str, str] = {}
    name = None
    for line in inspect.cleandoc(cls.__doc__ or "").partition("Attributes:")[2].splitlines():
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            name = match.group(1)
            docs[name] = match.group(2)
        elif name is not None and line.startswith("        "):
            docs[name] += " " + line.strip()
    return {k: re.sub(r":\w+:`~?([^`]+)`", r"\1", v).replace("``", "") for k, v in docs.items()}


def _field_help(cls: type, name: str) -> str:
    """The first sentence of field ``name``'s ``Attributes:`` entry in ``cls``'s docstring (the name if none)."""
    return _attribute_docs(cls).get(name, name).split(". ")[0].rstrip(".")


def _describe(tp: Any) -> str:
    """A type as a user reads it: ``an integer``, ``one of 'a', 'b'``, ``a list of 2 numbers``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    plain = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        Path: "a path",
        type(None): "null",
    }
    if tp in plain:
        return plain[tp]
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin in (tuple, list):
        return f"a list of {'' if args[-1] is Ellipsis or origin is list else f'{len(args)} '}{_plural(args[0])}"
    return "a mapping" if origin in (dict, Mapping) or tp in (dict, Mapping) else str(tp)


def _plural(tp: Any) -> str:
    """``integers``, ``numbers``, ... for the items of a list type."""
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(tp, _describe(tp))


def _expected(tp: Any, value: Any) -> str:
    """What type ``tp`` needs, said to someone who wrote ``value``, with the fix."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1 and value is not None:
            return f"{_expected(options[0], value)} (or null)"
        return f"must be {_describe(tp)}" + (", not null" if value is None else "")
    if value is None:
        return f"must be {_describe(tp)}, not null; give a value or delete the key for the default"
    if typing.get_origin(tp) is Literal:
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.5)
        return f"must be {_describe(tp)}" + (f"; did you mean {close[0]!r}?" if close else "")
    if tp in (int, float) and isinstance(value, bool):
        return f"must be {_describe(tp)}, not true/false" + ("; write a whole number" if tp is int else "")
    if tp in (int, float) and isinstance(value, str):
        return f"must be {_describe(tp)}; write " + (
            "the number without quotes" if tp is int else "it without quotes (e.g. 3.0e-4)"
        )
    if tp is int and isinstance(value, float) and value.is_integer():
        return f"must be an integer; write {int(value)} without a decimal point or exponent"
    fixes = {bool: " (unquoted)", str: "; put it in quotes", tuple: "; write a YAML list in brackets, e.g. [a, b]"}
    return f"must be {_describe(tp)}{fixes.get(typing.get_origin(tp) or tp, '')}"


def _show(value: Any) -> str:
    """A value as YAML writes it inline (true, null, 'text', [1, 2])."""
    if value is None or isinstance(value, (bool, list, tuple, Mapping)):
        text = yaml.safe_dump(_plain(value), default_flow_style=True).replace("\n...", "")
        return " ".join(text.split())
    return repr(value)


def _kind(value: Any) -> str:
    """What YAML made of a value: ``null``, ``a boolean``, ``an integer``, ``a list``, ..."""
    kinds = (
        (type(None), "null"),
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        ((list, tuple), "a list"),
        (Mapping, "a mapping"),
    )
    return next((name for types_, name in kinds if isinstance(value, types_)), type(value).__name__)


def _short(value: Any) -> str:
    """``repr`` of a value (tuples as lists), cut to under 60 characters."""
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) < 60 else text[:57] + "..."


def _plain(value: Any) -> Any:
    """A value as YAML-safe builtins: dataclasses as dicts, paths as strings, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
