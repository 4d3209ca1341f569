"""mkdocs hook (``hooks:`` in ``mkdocs.yml``): lay out the installed packages for the API reference.

The packages are the ones ``pyproject.toml`` declares (``[tool.setuptools] packages``), each at the
directory its ``package-dir`` entry maps it to (``genolong.kernels`` -> ``kernels/``,
``genolong.evaluation`` -> ``evaluation/``), and every ``*.py`` file of a package directory is one
of its modules, as in the wheel. griffe, which mkdocstrings-python reads the sources with, finds a
package's submodules in the package's own directory, so it cannot see ``genolong.kernels`` under
``genolong/``. Before anything else of the build (the handler drops a search path that does not
exist yet), this hook therefore copies every module file into ``build/docs-api/site-packages/`` at
its installed path; ``mkdocs.yml`` points the handler's ``paths`` there and
``docs/gen_ref_pages.py`` writes one page per module it finds there.

Copies, not symbolic links: griffe resolves a module's path, and a link would lead it back to the
source directory. The folder is named ``site-packages`` because that is what the copy is;
mkdocstrings-python labels a source block from there with the installed path
(``genolong/kernels/backends.py``), as for any installed package.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the docs extra brings tomli on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
#: the installed layout griffe reads (``paths`` of the python handler in mkdocs.yml)
API_TREE = ROOT / "build" / "docs-api" / "site-packages"


def declared_packages(pyproject: Path) -> dict[str, Path]:
    """Package name -> its source directory, for every package ``pyproject`` declares that is
    Python code (has an ``__init__.py``; a data directory listed as a package is skipped).

    Args:
        pyproject: the ``pyproject.toml`` to read.

    Returns:
        The packages in declaration order, each mapped through ``package-dir`` (the longest
        mapped prefix of its name wins; unmapped names live at their dotted path under the root).
    """
    setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools.get("package-dir", {})
    packages: dict[str, Path] = {}
    for name in setuptools["packages"]:
        parts = name.split(".")
        for cut in range(len(parts), -1, -1):
            prefix = ".".join(parts[:cut])
            if prefix in mapping or cut == 0:
                base = mapping.get(prefix, "")
                directory = pyproject.parent / base / Path(*parts[cut:])
                break
        if (directory / "__init__.py").is_file():
            packages[name] = directory
    return packages


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> source file: each package's ``__init__.py`` under the package's name,
    and every other ``*.py`` file of its directory, sorted by name."""
    found: dict[str, Path] = {}
    for package, directory in packages.items():
        found[package] = directory / "__init__.py"
        for path in sorted(directory.glob("*.py")):
            if path.name != "__init__.py":
                found[f"{package}.{path.stem}"] = path
    return dict(sorted(found.items()))


def lay_out(found: dict[str, Path], tree: Path) -> None:
    """Copy every module file into ``tree`` at its installed path (``genolong/kernels/backends.py``),
    replacing what an earlier build left there."""
    if tree.exists():
        shutil.rmtree(tree)
    for name, source in found.items():
        parts = name.split(".")
        target = (
            tree.joinpath(*parts, "__init__.py")
            if source.name == "__init__.py"
            else tree.joinpath(*parts[:-1], f"{parts[-1]}.py")
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


@event_priority(100)  # first: the python handler keeps only search paths that exist
def on_config(config: Any) -> None:
    """Lay out the declared packages under :data:`API_TREE` (the config is left as it is)."""
    lay_out(modules(declared_packages(ROOT / "pyproject.toml")), API_TREE)
