"""Generate the API reference at build time: one page per module of the packages genolong installs.

Run by the mkdocs-gen-files plugin (``mkdocs.yml``), never by hand. It walks the installed layout
that ``docs/hooks.py`` laid out under ``build/docs-api/site-packages/`` (every directory with an
``__init__.py`` is a package, every other ``*.py`` file a module), so a new module, or a newly
declared package such as ``genolong.plan``, gets its page without an edit here.

Writes (virtual files, under ``reference/`` of the built site): ``index.md`` (every module with the
first paragraph of its docstring), one ``<package path>/<module>.md`` per module and
``<package path>/index.md`` per package, each a ``::: dotted.name`` block, and ``SUMMARY.md``, the
navigation that mkdocs-literate-nav reads.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mkdocs_gen_files

API_TREE = Path(__file__).resolve().parents[1] / "build" / "docs-api" / "site-packages"


def installed_modules(tree: Path, top: str = "genolong") -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package) for every module under ``tree/top``,
    sorted by name."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted((tree / top).rglob("*.py")):
        parts = path.relative_to(tree).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return dict(sorted(found.items()))


def summary(source: Path) -> str:
    """The first paragraph of a module's docstring on one line ('' when it has none), its Sphinx
    roles as code (``:class:`~a.B``` -> ```B```) and ``|`` escaped for a table cell."""
    doc = ast.get_docstring(ast.parse(source.read_text()))
    if not doc:
        return ""
    text = " ".join(doc.strip().split("\n\n", 1)[0].split())
    return re.sub(r":[a-z]+:`([^`]+)`", _role_as_code, text).replace("|", "\\|")


def _role_as_code(match: re.Match[str]) -> str:
    """A Sphinx role as the code span Sphinx would show: ``~`` keeps the last part of the name,
    ``title <target>`` the title."""
    target = match.group(1).split("<", 1)[0].strip()
    return f"`{target[1:].rsplit('.', 1)[-1] if target.startswith('~') else target}`"


def page(name: str, is_package: bool) -> Path:
    """Where a module's page goes, relative to ``reference/``."""
    parts = name.split(".")
    return Path(*parts, "index.md") if is_package else Path(*parts[:-1], f"{parts[-1]}.md")


def main() -> None:
    """Write the reference pages and the navigation."""
    nav = mkdocs_gen_files.Nav()
    rows = []
    for name, (source, is_package) in installed_modules(API_TREE).items():
        path = page(name, is_package)
        nav[tuple(name.split("."))] = path.as_posix()
        with mkdocs_gen_files.open(Path("reference") / path, "w") as out:
            out.write(f"::: {name}\n")
        rows.append(f"| [`{name}`]({path.as_posix()}) | {summary(source)} |")
    with mkdocs_gen_files.open("reference/index.md", "w") as out:
        out.write(
            "# API reference\n\n"
            "Every module genolong installs, generated from its docstrings at build time. "
            "`genolong.kernels` is the repository's `kernels/` directory and `genolong.evaluation` "
            "its `evaluation/` (see `package-dir` in `pyproject.toml`).\n\n"
            "| module | what it is |\n|---|---|\n" + "\n".join(rows) + "\n"
        )
    with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as out:
        out.write("* [Overview](index.md)\n")
        out.writelines(nav.build_literate_nav())


main()
