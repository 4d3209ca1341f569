"""A griffe extension that reads genolong's docstrings as they are written, for the API reference.

Loaded by the python handler of mkdocstrings (``extensions`` in ``mkdocs.yml``); it changes only
the text griffe parses for the site, never a source file. genolong's docstrings are Google style
(``Args:``, ``Returns:``, ``Raises:``, ``Attributes:``) with two habits the Google parser does not
know:

- several parameters documented by one entry, ``n_boot, seed, level: bootstrap replicates (2000),
  seed (0) and coverage (0.95).``, its names possibly running over a line break (``a, b,`` then
  ``c: as ...``). The entry is given to each name in turn, so every parameter gets its row with
  its type from the signature, and griffe still warns about a name that is not in the signature;
- Sphinx roles in the prose (``:func:`load_recipe```, ``:class:`~genolong.errors.InputError```).
  Each becomes a code span that links to the object's page where the reference has one
  (``~`` shows the last part of the name, as Sphinx does); a name the reference does not
  document stays plain code, without a warning.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

#: sections whose entries are ``name: description``
_ENTRY_SECTIONS = re.compile(
    r"^(?P<indent>\s*)(Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments|Other Parameters|Attributes):\s*$"
)
_NAMES = r"\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)+"
#: an entry naming several parameters: ``a, b, c: text`` or ``a, b (int): text``
_GROUPED = re.compile(rf"^(?P<names>{_NAMES})(?P<rest>\s*(?:\([^)]*\))?\s*:.*)$")
#: the first line of a grouped entry whose names run over a line break: ``a, b,``
_OPEN_GROUP = re.compile(rf"^(?:{_NAMES}|\*{{0,2}}\w+)\s*,\s*$")
_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|data|attr|exc|obj|const):`(?P<target>[^`]+)`")


def split_grouped_entries(text: str) -> str:
    """``text`` with each grouped entry of its name/description sections repeated per name.

    Args:
        text: a docstring as griffe holds it (dedented).

    Returns:
        The same docstring; only grouped entries change, each into one entry per name with the
        group's description (continuation lines included).
    """
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    section_indent: int | None = None
    while i < len(lines):
        line = lines[i]
        header = _ENTRY_SECTIONS.match(line)
        if header:
            section_indent = len(header.group("indent"))
            out.append(line)
            i += 1
            continue
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if section_indent is not None and stripped and indent <= section_indent:
            section_indent = None  # the section ended
        if section_indent is None or not stripped:
            out.append(line)
            i += 1
            continue
        entry = stripped
        consumed = 1
        # names running over line breaks: join them until the line that holds the colon
        while _OPEN_GROUP.match(entry) and i + consumed < len(lines):
            entry = f"{entry} {lines[i + consumed].strip()}"
            consumed += 1
        grouped = _GROUPED.match(entry)
        if not grouped:
            out.append(line)
            i += 1
            continue
        body_start = i + consumed
        body_end = body_start
        while body_end < len(lines) and (
            not lines[body_end].strip() or len(lines[body_end]) - len(lines[body_end].lstrip()) > indent
        ):
            body_end += 1
        while body_end > body_start and not lines[body_end - 1].strip():
            body_end -= 1  # a blank line before the next entry stays where it is
        body = lines[body_start:body_end]
        for name in re.split(r"\s*,\s*", grouped.group("names")):
            out.append(f"{' ' * indent}{name}{grouped.group('rest')}")
            out.extend(body)
        i = body_end
    return "\n".join(out)


def roles_to_code(text: str, module: str, package: str) -> str:
    """``text`` with each Sphinx role as an optional cross-reference around a code span.

    Args:
        text: a docstring.
        module: the dotted path of the module the docstring is in: a name that does not start
            with ``genolong.`` (``load_recipe``, ``Recipe.save``) is looked up there.
        package: the package a relative name (``.bootstrap``) is relative to.

    Returns:
        The docstring with ``:role:`name``` (or ``:role:`title <name>```) as
        ``<autoref identifier="path" optional>`` around the name in code: mkdocs-autorefs makes
        it a link where ``path`` has a page in the reference, and leaves plain code elsewhere.
    """

    def replace(match: re.Match[str]) -> str:
        target = match.group("target").strip()
        titled = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>", target)
        if titled:
            shown, target = titled.group("title"), titled.group("target")
        elif target.startswith("~"):
            target = target[1:]
            shown = target.rsplit(".", 1)[-1]
        else:
            shown = target
        target = target.removesuffix("()")
        if target.startswith("."):
            path = f"{package}.{target.lstrip('.')}"
        elif target.split(".", 1)[0] == "genolong":
            path = target
        else:
            path = f"{module}.{target}"
        return f'<autoref identifier="{html.escape(path)}" optional><code>{html.escape(shown)}</code></autoref>'

    return _ROLE.sub(replace, text)


class GenolongDocstrings(griffe.Extension):
    """Rewrites each docstring as the module docstring above says, when griffe loads the object."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring (if it has one) before anything parses it."""
        if obj.docstring is None:
            return
        module = obj.module
        package = module.path if module.is_package or module.parent is None else module.parent.path
        obj.docstring.value = roles_to_code(split_grouped_entries(obj.docstring.value), module.path, package)
