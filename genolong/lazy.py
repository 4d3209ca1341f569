"""Package attributes that load their submodule on first use (PEP 562 module ``__getattr__``).

``genolong.data``, ``genolong.model`` and ``genolong.parallel`` export names from submodules that
import zarr or torch; loading those only when a name is first used keeps the command line's light
commands (``--help``, ``prepare``, ``plan``, ``compare``, ``plot``) free of torch and Lightning.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, names: Mapping[str, str], public: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose public names load lazily.

    Args:
        package: the package's ``__name__`` (it must be in ``sys.modules``: call this from the
            package's own ``__init__``).
        names: public name -> the submodule (relative to ``package``) that defines it.
        public: the package's ``__all__``, listed by ``dir()`` before anything is loaded.

    Returns:
        ``(__getattr__, __dir__)``: assign them at the package's top level. A name, once loaded,
        is stored on the package, so ``__getattr__`` runs once per name.
    """
    module = sys.modules[package]

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
            vars(module)[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(public))

    return __getattr__, __dir__
