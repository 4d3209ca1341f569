"""Nothing outside ``experiments/`` imports from it: the research trail can change or go without
touching the product (``genolong/``, ``kernels/``, ``evaluation/``), its tests or its benchmarks.

A static scan with ``ast`` of every ``*.py`` of the repository outside ``experiments/`` (and
outside virtualenvs and hidden folders). An import counts when its module path starts with
``experiments``, or when any part of it names a script of ``experiments/`` (``copy_emergence``,
``benchmarks.moe_collapse``, ...): the scripts are reached through ``sys.path``, not as a package,
so a bare ``import copy_emergence`` after a ``sys.path.append`` is the way in to catch. Imports
inside functions and under ``TYPE_CHECKING`` count as well. What experiments/ needs from product
tests goes the other way (``tests/scenarios.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from .helpers import ROOT

EXPERIMENTS = "experiments"


def experiment_modules(root: Path) -> set[str]:
    """The stems of the Python scripts under ``root/experiments`` (``test_*`` and ``conftest``
    excluded: pytest's names, not modules anything imports)."""
    return {
        p.stem
        for p in (root / EXPERIMENTS).rglob("*.py")
        if not p.stem.startswith("test_") and p.stem not in {"conftest", "__init__"}
    }


def python_files_outside(root: Path) -> list[Path]:
    """Every ``*.py`` under ``root`` but ``experiments/``, hidden folders (``.git``, ``.venv``)
    and virtualenvs (a folder holding ``pyvenv.cfg``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] == EXPERIMENTS or any(p.startswith(".") for p in parts[:-1]):
            continue
        if any((root.joinpath(*parts[:i]) / "pyvenv.cfg").exists() for i in range(1, len(parts))):
            continue
        found.append(path)
    return found


def imports_of_experiments(root: Path) -> list[str]:
    """``"FILE:LINE: module"`` for each import outside ``experiments/`` that reaches into it."""
    scripts = experiment_modules(root)
    offending = []
    for path in python_files_outside(root):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == EXPERIMENTS or scripts & set(parts):
                    offending.append(f"{path.relative_to(root)}:{node.lineno}: {module}")
                    break
    return offending


def test_nothing_outside_experiments_imports_from_it() -> None:
    assert experiment_modules(ROOT), "experiments/ holds scripts (the scan has something to look for)"
    assert imports_of_experiments(ROOT) == []


def test_the_scan_finds_each_way_in(tmp_path: Path) -> None:
    """The check can fail: a package import, a script reached through sys.path, the old
    ``benchmarks.`` path and a function-level import are all reported; the experiments' own
    imports and unrelated names are not."""
    (tmp_path / EXPERIMENTS / "trail").mkdir(parents=True)
    (tmp_path / EXPERIMENTS / "trail" / "copy_emergence.py").write_text("import json\n")
    (tmp_path / EXPERIMENTS / "trail" / "use.py").write_text("from copy_emergence import x\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("import experiments.trail\n")
    (tmp_path / "pkg" / "b.py").write_text("import sys\nsys.path.append('experiments/trail')\nimport copy_emergence\n")
    (tmp_path / "pkg" / "c.py").write_text("def f():\n    from benchmarks.copy_emergence import doubled\n")
    (tmp_path / "pkg" / "d.py").write_text("import json\nfrom .copy_emergence import y\nfrom pkg import emergence\n")
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "e.py").write_text("import experiments\n")
    assert imports_of_experiments(tmp_path) == [
        "pkg/a.py:1: experiments.trail",
        "pkg/b.py:3: copy_emergence",
        "pkg/c.py:2: benchmarks.copy_emergence",
    ]
