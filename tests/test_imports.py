"""The installed packages import one another one way: no import circles, read from the source with ``ast``.

The modules are every ``*.py`` of every package that ``pyproject.toml`` installs (``packages``,
each found through ``[tool.setuptools.package-dir]``: ``kernels/`` is ``genolong.kernels``,
``evaluation/`` is ``genolong.evaluation``, ``data/`` is ``genolong.bundled``). What counts as an
edge ``a -> b``:

- every import, wherever it stands (module level, inside a function, under ``TYPE_CHECKING``):
  a function-level or type-only import hides a circle from Python at import time but keeps the
  two modules tied to each other;
- relative imports resolved against the importing module's package (``from .x import y``,
  ``from ..x import y``; ``from . import x`` is the module ``x`` when there is one, else the
  package's ``__init__``), and absolute ``genolong.*`` imports;
- ``from package import name`` where ``name`` is not a submodule: the package's ``__init__``, and,
  when the package exports ``name`` lazily (:func:`genolong.lazy.lazy_exports`, a table of
  strings), also the submodule that table names: that is the module whose code runs;
- an ``__init__`` that imports its submodules eagerly (``from .x import y``) has edges to them;
  a lazy table is strings, not imports, and gives its ``__init__`` no edge.

Not counted: the parent packages Python runs before a submodule (``import genolong.model.lm``
first runs ``genolong.model``'s ``__init__``: counting that would tie every package that
re-exports its submodules eagerly to each of them), and imports of computed names
(``importlib.import_module(f"...{name}")``, as ``kernels.backends`` loads its Triton modules).

The same graph, grouped into rooms (``genolong.data``, ``genolong.model``, ...), draws the house
in ``docs/architecture.md``: ``python -m tests.test_imports`` writes the page, and
:func:`test_the_architecture_page_is_drawn_from_the_code` fails when the committed page differs.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
ARCHITECTURE = REPO / "docs" / "architecture.md"

Graph = dict[str, set[str]]


# --------------------------------------------------------------------------------------------------
# The modules and their imports
# --------------------------------------------------------------------------------------------------


def package_dirs(pyproject: Path = PYPROJECT) -> dict[str, Path]:
    """``{package: its directory}`` for every package ``pyproject``'s setuptools section installs.

    A package's directory comes from the longest ``package-dir`` key that is the package itself or
    one of its parents (``"genolong.kernels" = "kernels"`` puts ``genolong.kernels.ce`` in
    ``kernels/ce``); a package under no key is its dotted path from the repository root.
    """
    setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    mapping: Mapping[str, str] = setuptools.get("package-dir", {})
    root = pyproject.parent
    dirs = {}
    for package in setuptools["packages"]:
        keys = [k for k in mapping if k == "" or package == k or package.startswith(k + ".")]
        if not keys:
            dirs[package] = root.joinpath(*package.split("."))
            continue
        key = max(keys, key=len)
        rest = package[len(key) :].lstrip(".")
        dirs[package] = root.joinpath(mapping[key], *(rest.split(".") if rest else ()))
    return dirs


def module_files(dirs: Mapping[str, Path]) -> dict[str, Path]:
    """``{module name: its file}`` for every ``*.py`` directly in each package's directory; a
    package's ``__init__.py`` is named as the package."""
    files = {}
    for package, folder in dirs.items():
        for path in sorted(folder.glob("*.py")):
            files[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return files


def lazy_table(tree: ast.Module, package: str) -> dict[str, str]:
    """``{name: submodule}`` of a package ``__init__`` that exports names lazily: the mapping
    passed to ``lazy_exports(__name__, MAPPING, ...)``, a dict literal or a module-level name bound
    to one; empty when there is no such call."""
    bound = {
        stmt.targets[0].id: stmt.value
        for stmt in tree.body
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "lazy_exports"
            and len(node.args) >= 2
        ):
            table = node.args[1]
            if isinstance(table, ast.Name):
                table = bound.get(table.id, table)
            if isinstance(table, ast.Dict):
                return {
                    k.value: f"{package}.{v.value}"
                    for k, v in zip(table.keys, table.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
                }
    return {}


def resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module name ``node`` imports from, for a module of ``package`` (an
    ``__init__``'s package is itself): ``from ..x import y`` in ``genolong.model.lm`` is ``genolong.x``.

    Raises:
        ValueError: a relative import that climbs above the top-level package.
    """
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise ValueError(f"from {'.' * node.level}{node.module or ''} climbs above {package}")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(
    tree: ast.Module, package: str, modules: Iterable[str], lazy: Mapping[str, Mapping[str, str]]
) -> set[str]:
    """The modules of ``modules`` that ``tree`` (a module of ``package``) imports, anywhere in it.

    ``lazy``: ``{package: its lazy table}`` (see :func:`lazy_table`).
    """
    known = set(modules)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node, package)
            for alias in node.names:
                if f"{source}.{alias.name}" in known:  # from . import x / from genolong.x import y (modules)
                    found.add(f"{source}.{alias.name}")
                elif source in known:  # a name from a module, or from a package's __init__
                    found.add(source)
                    if alias.name in lazy.get(source, {}):
                        found.add(lazy[source][alias.name])
    return found


def import_graph(pyproject: Path = PYPROJECT) -> Graph:
    """``{module: the installed modules it imports}`` over every installed package (see the module
    docstring for what counts)."""
    dirs = package_dirs(pyproject)
    files = module_files(dirs)
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in files.items()}
    lazy = {name: lazy_table(trees[name], name) for name in dirs if name in trees}
    return {
        name: imports_of(tree, name if name in dirs else name.rpartition(".")[0], files, lazy) - {name}
        for name, tree in trees.items()
    }


def dangling_imports(pyproject: Path = PYPROJECT) -> list[str]:
    """The imports of an installed module that name an installed package's module (relative, or
    absolute under a top-level package) but match none: ``"module: from .x import y"``. An import
    the graph cannot resolve would be left out of it silently."""
    dirs = package_dirs(pyproject)
    files = module_files(dirs)
    roots = tuple(p for p in dirs if p.rpartition(".")[0] not in dirs)

    def inside(module: str) -> bool:
        return any(module == r or module.startswith(r + ".") for r in roots)

    found = []
    for name, path in files.items():
        package = name if name in dirs else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found += [f"{name}: import {a.name}" for a in node.names if inside(a.name) and a.name not in files]
            elif isinstance(node, ast.ImportFrom) and (node.level or inside(node.module or "")):
                source = resolve(node, package)
                found += [
                    f"{name}: from {'.' * node.level}{node.module or ''} import {a.name}"
                    for a in node.names
                    if source not in files and f"{source}.{a.name}" not in files
                ]
    return found


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted, in sorted order
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# --------------------------------------------------------------------------------------------------
# The house: rooms
# --------------------------------------------------------------------------------------------------

ABOVE = "top level, above"
BELOW = "top level, below"


def rooms(graph: Mapping[str, set[str]], packages: Iterable[str]) -> dict[str, str]:
    """``{module: its room}``. A room is a second-level package (``genolong.model``, with all its
    subpackages: ``genolong.kernels.ce`` is in ``genolong.kernels``). The top-level modules
    (``genolong.quickstart``, ``genolong.errors``, the root ``__init__``...) make two rooms, ``"ROOT
    (top level, above)"``: those that import another room (directly or through other top-level
    modules), and ``"ROOT (top level, below)"``: the rest, which every room may import. As one
    room they would import, and be imported by, every other room.

    A top-level module that becomes a package (``genolong/config.py`` -> ``genolong/config/``)
    becomes a room of its own, with no change here.
    """
    packages = set(packages)
    roots = {p for p in packages if p.rpartition(".")[0] not in packages}
    room = {}
    for module in graph:
        parts = module.split(".")
        if len(parts) >= 2 and ".".join(parts[:2]) in packages:
            room[module] = ".".join(parts[:2])
    top = [m for m in graph if m not in room]
    above: set[str] = set()
    changed = True
    while changed:  # a top-level module above the rooms, or importing one that is
        changed = False
        for module in top:
            if module not in above and any(t in room or t in above for t in graph[module]):
                above.add(module)
                changed = True
    for module in top:
        root = next(r for r in roots if module == r or module.startswith(r + "."))
        room[module] = f"{root} ({ABOVE if module in above else BELOW})"
    return room


def room_graph(graph: Mapping[str, set[str]], room: Mapping[str, str]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """``{room: {room it imports: the module edges (a, b) that make it}}``; every room is a key."""
    edges: dict[str, dict[str, list[tuple[str, str]]]] = {r: {} for r in sorted(set(room.values()))}
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if room[a] != room[b]:
                edges[room[a]].setdefault(room[b], []).append((a, b))
    return edges


def _first_paragraph(tree: ast.Module, name: str) -> str:
    """A module docstring's first paragraph as one line of Markdown (reST roles and literals made
    code spans; a leading ``"NAME: "`` dropped)."""
    doc = ast.get_docstring(tree) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")
    for prefix in (f"{name}: ", f"`{name}`: "):
        text = text.removeprefix(prefix)
    return text


def _short(module: str, room: str) -> str:
    """A module's name inside its room (``lm`` in ``genolong.model``, ``__init__`` for the package)."""
    base = room.split(" ")[0]
    return "__init__" if module == base else module.removeprefix(base + ".")


def _node(room: str) -> str:
    """A Mermaid node id for ``room``."""
    return re.sub(r"\W+", "_", room).strip("_")


def architecture_page(pyproject: Path = PYPROJECT) -> str:
    """The text of ``docs/architecture.md``: the rooms, what each holds (its package docstring's
    first paragraph; the top-level rooms list their modules), the Mermaid diagram of which room
    imports which, and the rooms that import each other (with the module imports that do it)."""
    dirs = package_dirs(pyproject)
    files = module_files(dirs)
    graph = import_graph(pyproject)
    room = rooms(graph, dirs)
    edges = room_graph(graph, room)
    members: dict[str, list[str]] = {}
    for module in sorted(graph):
        members.setdefault(room[module], []).append(module)

    lines = [
        "# The house, drawn from the imports",
        "",
        "<!-- Generated by `python -m tests.test_imports` from the source; tests/test_imports.py fails",
        "     when this page differs from the code. Do not edit by hand. -->",
        "",
        "Every installed module's imports, read from the source (every import counts, wherever it",
        "stands: module level, in a function, under `TYPE_CHECKING`), grouped into rooms: a room is",
        "a second-level package with its subpackages, in the folder pyproject.toml's `package-dir`",
        "gives it. The top-level modules make two rooms: those *above* import other rooms, those",
        "*below* import none and every room may use them. An arrow `A --> B` means that a module",
        "of A imports a module of B. Between modules there is no circle (the test asserts it); what",
        "each module imports is in `tests/test_imports.py`'s `import_graph()`.",
        "",
        "## Rooms",
        "",
    ]
    for name, modules in sorted(members.items()):
        if "(" in name:  # a top-level room: its modules
            held = "modules " + ", ".join(f"`{_short(m, name)}`" for m in modules)
        else:
            held = _first_paragraph(ast.parse(files[name].read_text()), name) or "(no package docstring)"
        folder = dirs[name.split(" ")[0]].relative_to(pyproject.parent).as_posix()
        lines.append(f"- **{name}** (`{folder}/`, {len(modules)} module{'s' if len(modules) != 1 else ''}): {held}")
    lines += ["", "## Who imports whom", "", "```mermaid", "flowchart TD"]
    for name in edges:
        lines.append(f'    {_node(name)}["{name}"]')
    for a, targets in edges.items():
        for b in sorted(targets):
            lines.append(f"    {_node(a)} --> {_node(b)}")
    lines += ["```", "", "## Rooms that import each other", ""]
    both = circles({a: set(t) for a, t in edges.items()})
    if not both:
        lines.append("None: every room imports the others one way.")
    else:
        lines += [
            "Module-level circles are zero; these rooms still reach each other through their imports",
            "(each group is a circle of rooms; under it, its room-to-room imports and the module",
            "imports that make them):",
            "",
        ]
        for component in both:
            lines.append(f"- {', '.join(f'**{r}**' for r in component)}")
            for a in component:
                for b in component:
                    if b in edges[a]:
                        shown = ", ".join(f"`{x}` -> `{y}`" for x, y in edges[a][b][:3])
                        more = len(edges[a][b]) - 3
                        lines.append(f"  - {a} -> {b}: {shown}" + (f" (and {more} more)" if more > 0 else ""))
    return "\n".join(lines) + "\n"


def write_architecture_page(path: Path = ARCHITECTURE) -> Path:
    """Write :func:`architecture_page` to ``path`` (``docs/architecture.md``); returns ``path``."""
    path.write_text(architecture_page())
    return path


# --------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------


def _package(tmp_path: Path, files: Mapping[str, str], packages: Iterable[str], package_dir: str = "") -> Path:
    """A synthetic project in ``tmp_path``: ``files`` (path -> source) and a pyproject.toml listing
    ``packages`` (and the ``package_dir`` table's lines)."""
    for rel, source in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    listed = ", ".join(f'"{p}"' for p in packages)
    table = f"\n[tool.setuptools.package-dir]\n{package_dir}\n" if package_dir else ""
    (tmp_path / "pyproject.toml").write_text(f"[tool.setuptools]\npackages = [{listed}]\n{table}")
    return tmp_path / "pyproject.toml"


def test_the_checker_finds_a_circle_hidden_in_a_function_or_type_check(tmp_path: Path) -> None:
    pyproject = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/errors.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": "from .b import x\n",
            "pkg/sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n",
            "pkg/sub/c.py": "def f():\n    from pkg.sub import d\n",
            "pkg/sub/d.py": "import pkg.sub.c\n",
            "pkg/sub/e.py": "from . import a\nfrom ..errors import InputError\nimport numpy\n",
        },
        ["pkg", "pkg.sub"],
    )
    graph = import_graph(pyproject)
    assert graph == {
        "pkg": set(),
        "pkg.errors": set(),
        "pkg.sub": set(),
        "pkg.sub.a": {"pkg.sub.b"},
        "pkg.sub.b": {"pkg.sub.a"},
        "pkg.sub.c": {"pkg.sub.d"},
        "pkg.sub.d": {"pkg.sub.c"},
        "pkg.sub.e": {"pkg.sub.a", "pkg.errors"},
    }
    assert circles(graph) == [["pkg.sub.a", "pkg.sub.b"], ["pkg.sub.c", "pkg.sub.d"]]


def test_relative_imports_resolve_against_the_package(tmp_path: Path) -> None:
    pyproject = _package(
        tmp_path,
        {
            "src/__init__.py": "from .x import name\n",  # an eager re-export: an edge of the __init__
            "src/x.py": "from . import helper\nfrom . import VALUE\n",  # a module, then a name of the __init__
            "src/helper.py": "from .. import thing\n",  # a name of the top package's __init__
            "src/deep/__init__.py": "from .. import helper\n",  # an __init__'s package is itself
            "src/deep/leaf.py": "from ... import thing\nfrom top.src import x as alias\n",
            "top/__init__.py": "",
        },
        ["top", "top.src", "top.src.deep"],
        '"top.src" = "src"',
    )
    graph = import_graph(pyproject)
    assert graph == {
        "top": set(),
        "top.src": {"top.src.x"},
        "top.src.x": {"top.src.helper", "top.src"},
        "top.src.helper": {"top"},
        "top.src.deep": {"top.src.helper"},
        "top.src.deep.leaf": {"top", "top.src.x"},
    }
    assert circles(graph) == [["top.src", "top.src.x"]]  # x imports VALUE from the __init__ that imports x
    assert resolve(ast.parse("from .. import x").body[0], "a.b") == "a"  # type: ignore[arg-type]
    assert resolve(ast.parse("from ..c.d import x").body[0], "a.b") == "a.c.d"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="climbs above a.b"):
        resolve(ast.parse("from ... import x").body[0], "a.b")  # type: ignore[arg-type]


def test_a_name_exported_lazily_is_an_edge_to_the_module_that_defines_it(tmp_path: Path) -> None:
    pyproject = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/lazy.py": "",
            "pkg/model/__init__.py": (
                "from ..lazy import lazy_exports\n_LAZY = {'Model': 'lm'}\n"
                "__getattr__, __dir__ = lazy_exports(__name__, _LAZY, ['Model'])\n"
            ),
            "pkg/model/lm.py": "from ..data import Store\n",
            "pkg/data/__init__.py": (
                "from ..lazy import lazy_exports\n"
                "__getattr__, __dir__ = lazy_exports(__name__, {'Store': 'store'}, ['Store'])\n"
            ),
            "pkg/data/store.py": "def f():\n    from pkg.model import Model\n",
        },
        ["pkg", "pkg.model", "pkg.data"],
    )
    graph = import_graph(pyproject)
    assert graph["pkg.model"] == {"pkg.lazy"} and graph["pkg.data"] == {"pkg.lazy"}  # strings, not imports
    assert graph["pkg.model.lm"] == {"pkg.data", "pkg.data.store"}
    assert circles(graph) == [["pkg.data.store", "pkg.model.lm"]]


def test_an_import_the_graph_cannot_resolve_is_named(tmp_path: Path) -> None:
    pyproject = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from .b import x\nimport pkg.c\nimport os\n",
            "pkg/b.py": "from .gone import y\nfrom . import name\nfrom os import path\n",
        },
        ["pkg"],
    )
    # ``from . import name``: a name of pkg's __init__ (resolved to it), not a missing module
    assert dangling_imports(pyproject) == ["pkg.a: import pkg.c", "pkg.b: from .gone import y"]


def test_every_import_of_an_installed_module_resolves() -> None:
    assert dangling_imports() == []


def test_package_dirs_follow_the_longest_mapping() -> None:
    dirs = package_dirs()
    assert dirs["genolong"] == REPO / "genolong"
    assert dirs["genolong.model"] == REPO / "genolong" / "model"
    assert dirs["genolong.kernels"] == REPO / "kernels" and dirs["genolong.kernels.dsa"] == REPO / "kernels" / "dsa"
    assert dirs["genolong.evaluation"] == REPO / "evaluation"
    assert dirs["genolong.bundled.sample"] == REPO / "data" / "sample"
    assert all(d.is_dir() for d in dirs.values()), dirs


def test_every_python_package_in_the_source_is_installed() -> None:
    # a folder of modules that pyproject.toml forgets would be missing from an install and from this test
    dirs = package_dirs()
    listed = set(dirs.values())
    for folder in set(dirs.values()):
        for init in folder.glob("*/__init__.py"):
            assert init.parent in listed, f"{init.parent} holds a package that pyproject.toml's packages leave out"


def test_no_import_circle_in_the_installed_packages() -> None:
    graph = import_graph()
    assert {
        "genolong.cli",
        "genolong.model.lm",
        "genolong.kernels.dsa.indexer",
        "genolong.evaluation.score",
        "genolong.bundled.sample.build_sample",
    } <= set(graph), sorted(graph)
    found = circles(graph)
    assert found == [], f"import circle(s): {found}"


def test_results_and_stats_import_one_way() -> None:
    graph = import_graph()
    ev = "genolong.evaluation."
    assert ev + "stats" not in graph[ev + "results"] and ev + "stats" not in graph[ev + "bootstrap"], graph
    assert ev + "results" not in graph[ev + "bootstrap"], graph


def test_the_rooms_of_the_house() -> None:
    graph = import_graph()
    room = rooms(graph, package_dirs())
    assert room["genolong.kernels.dsa.indexer"] == "genolong.kernels"
    assert room["genolong.evaluation.score"] == "genolong.evaluation"
    assert room["genolong.cli"] == room["genolong.cli.evaluate"] == "genolong.cli"
    assert room["genolong.quickstart"] == "genolong (top level, above)"
    assert room["genolong.errors"] == room["genolong"] == "genolong (top level, below)"
    below = [m for m, r in room.items() if r == "genolong (top level, below)"]
    assert not any(room[t] != room[m] for m in below for t in graph[m]), "a module below imports another room"


def test_a_top_level_module_that_becomes_a_package_becomes_a_room(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/errors.py": "",
        "pkg/cli.py": "from .config import load\n",
        "pkg/model/__init__.py": "",
        "pkg/model/lm.py": "from ..config import load\nfrom ..errors import E\n",
    }
    module = import_graph(
        _package(tmp_path / "before", {**files, "pkg/config.py": "from .errors import E\n"}, ["pkg", "pkg.model"])
    )
    package = import_graph(
        _package(
            tmp_path / "after",
            {
                **files,
                "pkg/config/__init__.py": "from .loading import load\n",
                "pkg/config/loading.py": "from ..errors import E\n",
            },
            ["pkg", "pkg.model", "pkg.config"],
        )
    )
    before = rooms(module, ["pkg", "pkg.model"])
    after = rooms(package, ["pkg", "pkg.model", "pkg.config"])
    assert before["pkg.config"] == before["pkg.errors"] == "pkg (top level, below)"
    assert after["pkg.config"] == after["pkg.config.loading"] == "pkg.config"
    assert room_graph(package, after)["pkg.model"] == {
        "pkg.config": [("pkg.model.lm", "pkg.config")],
        "pkg (top level, below)": [("pkg.model.lm", "pkg.errors")],
    }


def test_the_page_reports_rooms_that_import_each_other(tmp_path: Path) -> None:
    pyproject = _package(
        tmp_path,
        {
            "pkg/__init__.py": '"""The package."""\n',
            "pkg/a/__init__.py": '"""pkg.a: the first room."""\n',
            "pkg/a/one.py": "from ..b import two\n",
            "pkg/b/__init__.py": '"""Room :class:`B`, ``b``."""\n',
            "pkg/b/two.py": "",
            "pkg/b/three.py": "from ..a.one import f\n",
        },
        ["pkg", "pkg.a", "pkg.b"],
    )
    page = architecture_page(pyproject)
    assert circles(import_graph(pyproject)) == []
    assert "- **pkg (top level, below)** (`pkg/`, 1 module): modules `__init__`\n" in page
    assert "- **pkg.a** (`pkg/a/`, 2 modules): the first room.\n" in page
    assert "- **pkg.b** (`pkg/b/`, 3 modules): Room `B`, `b`.\n" in page
    assert "    pkg_a --> pkg_b\n    pkg_b --> pkg_a\n" in page
    assert "- **pkg.a**, **pkg.b**\n  - pkg.a -> pkg.b: `pkg.a.one` -> `pkg.b.two`\n" in page


def test_the_architecture_page_is_drawn_from_the_code() -> None:
    drawn = architecture_page()
    committed = ARCHITECTURE.read_text() if ARCHITECTURE.is_file() else ""
    assert committed == drawn, (
        "docs/architecture.md is not the house the imports draw: run `python -m tests.test_imports`"
    )


@pytest.mark.parametrize(
    "name",
    [
        "bucket_edges",
        "bucket_labels",
        "format_bases",
        "resample_indices",
        "resample_counts",
        "bootstrap_replicates",
        "block_bootstrap",
        "PairedCI",
        "paired_bootstrap",
        "bucket_table_from_arrays",
        "check_comparable",
        "compare",
        "BUCKET_COLUMNS",
        "COMPARE_COLUMNS",
    ],
)
def test_stats_names_still_import_from_stats(name: str) -> None:
    from genolong.evaluation import stats

    assert name in stats.__all__ and hasattr(stats, name)


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("genolong.evaluation.score", ["load_eval_model", "recipe_context", "run_recipe", "scoring_kernel_backend"]),
        ("genolong.evaluation.probe", ["PROBE_COLUMNS", "PROBE_FORMAT", "ProbeResult"]),
        ("genolong.model.decode", ["KDAState"]),
    ],
)
def test_moved_names_still_import_from_where_they_were(module: str, names: list[str]) -> None:
    # moved below the modules that shared them to break the circles; their callers import them as before
    import importlib

    loaded = importlib.import_module(module)
    assert all(name in loaded.__all__ and hasattr(loaded, name) for name in names), names


if __name__ == "__main__":  # python -m tests.test_imports: redraw docs/architecture.md
    print(write_architecture_page(), file=sys.stderr)
